"""Shared helpers of the plan tests (no tests here): trial grids and tree invariants."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from stagetree.hp import Constant, MultiStep, Piecewise, Sequence, first_difference
from stagetree.plan import BasePlanStorage

Trial = tuple[dict[str, Sequence], int]


def grid(steps: int = 40) -> list[Trial]:
    """Distinct trials (lr x momentum) with shared prefixes, all ``steps`` long."""
    lrs: list[Sequence] = [
        Constant(0.1),
        MultiStep(0.1, [10], 0.1),
        MultiStep(0.1, [20], 0.1),
        MultiStep(0.1, [10, 30], 0.5),
        Constant(0.05),
    ]
    momenta: list[Sequence] = [Constant(0.9)] + [
        Piecewise([0.9, m], [s]) for s in (5, 15, 25, 35) for m in (0.8, 0.95)
    ]
    return [({"lr": lr, "momentum": m}, steps) for lr, m in itertools.product(lrs, momenta)]


def same_values(a: Mapping[str, Sequence], b: Mapping[str, Sequence], stop: int) -> bool:
    """Whether two trials have identical values on ``[0, stop)``."""
    return all(first_difference(a[name], b[name], 0, stop) is None for name in a)


def check_tree(storage: BasePlanStorage, root_key: str) -> None:
    """Assert the structural invariants of a plan tree.

    One root; every child agrees with its parent before its branch step and differs
    from it at that step; siblings branching at one step differ at that step.
    """
    nodes = storage.nodes(root_key)
    by_id = {n.id: n for n in nodes}
    assert len(by_id) == len(nodes)
    roots = [n for n in nodes if n.parent is None]
    assert len(roots) == (1 if nodes else 0)
    seen: dict[tuple[int, int, tuple[object, ...]], int] = {}
    for node in nodes:
        if node.parent is None:
            assert node.branch_step == 0
            continue
        parent = by_id[node.parent]
        b = node.branch_step
        assert b >= parent.branch_step
        assert node.id > parent.id
        assert same_values(parent.hp, node.hp, b), f"node {node.id} differs before {b}"
        assert not same_values(parent.hp, node.hp, b + 1), f"node {node.id} equals parent at {b}"
        typed = tuple((type(node.hp[k](b)), node.hp[k](b)) for k in sorted(node.hp))
        key = (node.parent, b, typed)
        assert key not in seen, f"nodes {seen.get(key)} and {node.id} are duplicate siblings"
        seen[key] = node.id
