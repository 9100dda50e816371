"""Stage trees: building, critical paths, merge rates, rendering."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.plan.model import Node
from stagetree.stages import (
    Covered,
    Origin,
    RunningPosition,
    Stage,
    StageTree,
    bench_build,
    build_stage_tree,
    critical_path,
    kwise_merge_rate,
    merge_rate,
    render_tree,
    summarize,
    total_steps,
    unique_steps,
)

# --------------------------------------------------------------------------- helpers


def shape(tree: StageTree) -> list[tuple[int, int, int, tuple[int, int, int] | None]]:
    """(node, start, stop, parent interval) per stage, in tree order."""
    return [
        (
            s.node,
            s.start,
            s.stop,
            None if s.parent is None else (s.parent.node, s.parent.start, s.parent.stop),
        )
        for s in tree.stages
    ]


@pytest.fixture
def grid() -> tuple[dict[int, Node], dict[str, tuple[int, int]]]:
    """Constant lr for 100 steps, a branch at 50 (to 120) and one at 70 (to 90), plus a
    30-step prefix of the constant trial."""
    storage = MemoryPlanStorage()
    ends = {
        "const": storage.insert_trial("r", {"lr": Constant(0.1)}, 100),
        "at50": storage.insert_trial("r", {"lr": MultiStep(0.1, [50], 0.1)}, 120),
        "at70": storage.insert_trial("r", {"lr": MultiStep(0.1, [70], 0.5)}, 90),
        "short": storage.insert_trial("r", {"lr": Constant(0.1)}, 30),
    }
    nodes = {n.id: n for n in storage.nodes()}
    return nodes, {k: (v.node, v.step) for k, v in ends.items()}


def chain_nodes(depth: int) -> dict[int, Node]:
    """A path of ``depth`` nodes, node i branching at step i - 1 from node i - 1."""
    nodes = {1: Node(1, "r", None, 0, {"lr": Constant(0.0)})}
    for i in range(2, depth + 1):
        nodes[i] = Node(i, "r", i - 1, i - 1, {"lr": Constant(float(i))})
    return nodes


# --------------------------------------------------------------------------- building


def test_shared_prefix_merges_into_one_tree(grid) -> None:
    nodes, ends = grid
    tree = build_stage_tree(nodes, ends.values())
    # node 1 = constant, node 2 = branch at 50, node 3 = branch at 70
    assert shape(tree) == [
        (1, 0, 50, None),
        (1, 50, 70, (1, 0, 50)),
        (1, 70, 100, (1, 50, 70)),
        (3, 70, 90, (1, 50, 70)),
        (2, 50, 120, (1, 0, 50)),
    ]
    root = tree.roots[0]
    assert tree.roots == [root]
    assert root.origin == Origin("fresh", 1, 0)
    assert root.evaluate_at == [30]
    assert [s.evaluate_at for s in tree.stages[1:]] == [[], [100], [90], [120]]
    assert root.requests_below() == 4
    assert tree.total_steps == 50 + 20 + 30 + 20 + 70
    assert tree.covered == []


def test_duplicate_requests_are_one_point(grid) -> None:
    nodes, ends = grid
    tree = build_stage_tree(nodes, [ends["const"], ends["const"]])
    assert shape(tree) == [(1, 0, 100, None)]
    assert tree.stages[0].evaluate_at == [100]


def test_requests_start_at_latest_checkpoint_on_their_path(grid) -> None:
    nodes, ends = grid
    # (1, 60) lies on the paths of const and at70, not on at50's (it left node 1 at 50);
    # (1, 40) on all of them, but after short's step 30.
    tree = build_stage_tree(nodes, ends.values(), checkpoints=[(1, 60), (1, 40)])
    assert shape(tree) == [
        (1, 0, 30, None),
        (1, 40, 50, None),
        (2, 50, 120, (1, 40, 50)),
        (1, 60, 70, None),
        (1, 70, 100, (1, 60, 70)),
        (3, 70, 90, (1, 60, 70)),
    ]
    origins = [r.origin for r in tree.roots]
    assert origins == [
        Origin("fresh", 1, 0),
        Origin("checkpoint", 1, 40),
        Origin("checkpoint", 1, 60),
    ]
    assert tree.roots[0].evaluate_at == [30]
    # a later checkpoint on at50's own node takes over
    tree = build_stage_tree(nodes, [ends["at50"]], checkpoints=[(1, 40), (2, 110), (2, 121)])
    assert shape(tree) == [(2, 110, 120, None)]
    assert tree.roots[0].origin == Origin("checkpoint", 2, 110)


def test_checkpoint_at_branch_step_serves_the_child(grid) -> None:
    nodes, ends = grid
    tree = build_stage_tree(nodes, [ends["at50"]], checkpoints=[(1, 50)])
    assert shape(tree) == [(2, 50, 120, None)]
    assert tree.roots[0].origin == Origin("checkpoint", 1, 50)


def test_checkpoint_on_a_sibling_branch_is_not_on_the_path(grid) -> None:
    nodes, ends = grid
    tree = build_stage_tree(nodes, [ends["at70"]], checkpoints=[(2, 80), (1, 80)])
    # (1, 80) lies past at70's branch at 70, (2, 80) on another branch.
    assert shape(tree) == [(1, 0, 70, None), (3, 70, 90, (1, 0, 70))]


def test_checkpoint_at_the_request_gives_an_evaluation_only_stage(grid) -> None:
    nodes, ends = grid
    tree = build_stage_tree(nodes, [ends["short"], ends["const"]], checkpoints=[(1, 30)])
    assert shape(tree) == [(1, 30, 30, None), (1, 30, 100, None)]
    evaluation, rest = tree.stages
    assert evaluation.evaluate_at == [30] and evaluation.steps == 0
    assert evaluation.origin == rest.origin == Origin("checkpoint", 1, 30)
    assert rest.evaluate_at == [100]


def test_request_at_step_zero_is_an_evaluation_of_the_fresh_model(grid) -> None:
    nodes, _ = grid
    tree = build_stage_tree(nodes, [(1, 0)])
    assert shape(tree) == [(1, 0, 0, None)]
    assert tree.roots[0].origin == Origin("fresh", 1, 0)


def test_running_batch_covers_positions_ahead_of_it(grid) -> None:
    nodes, ends = grid
    batch = RunningPosition(7, ((1, 0, 100),), step=20)
    tree = build_stage_tree(nodes, ends.values(), running=[batch])
    # const (1, 100) and short (1, 30) lie on the batch: covered, no stage.
    assert sorted(tree.covered, key=lambda c: c.step) == [Covered(1, 30, 7), Covered(1, 100, 7)]
    assert shape(tree) == [(2, 50, 120, None), (3, 70, 90, None)]
    assert [r.origin for r in tree.roots] == [
        Origin("running", 1, 50, 7),
        Origin("running", 1, 70, 7),
    ]
    assert tree.ready_roots() == []
    assert tree.waiting_roots() == tree.roots


def test_positions_a_running_batch_passed_are_not_covered(grid) -> None:
    nodes, ends = grid
    batch = RunningPosition(7, ((1, 0, 100),), step=60)
    tree = build_stage_tree(nodes, [ends["at50"], ends["short"], ends["at70"]], running=[batch])
    assert [(r.node, r.start, r.stop, r.origin.kind) for r in tree.roots] == [  # type: ignore[union-attr]
        (1, 0, 50, "fresh"),  # request points do not split stages
        (3, 70, 90, "running"),
    ]
    assert tree.roots[0].evaluate_at == [30]
    assert shape(tree)[1] == (2, 50, 120, (1, 0, 50))
    assert tree.ready_roots() == [tree.roots[0]]


def test_promised_checkpoint_already_passed_still_counts(grid) -> None:
    nodes, ends = grid
    batch = RunningPosition(7, ((1, 0, 100),), step=60, saving=((1, 50),))
    tree = build_stage_tree(nodes, [ends["at50"]], running=[batch])
    assert shape(tree) == [(2, 50, 120, None)]
    assert tree.roots[0].origin == Origin("running", 1, 50, 7)


def test_request_beyond_a_running_batch_starts_at_its_end(grid) -> None:
    nodes, _ = grid
    batch = RunningPosition(3, ((1, 0, 60),), step=10)
    tree = build_stage_tree(nodes, [(1, 100)], running=[batch])
    assert shape(tree) == [(1, 60, 100, None)]
    assert tree.roots[0].origin == Origin("running", 1, 60, 3)


def test_durable_checkpoint_wins_a_tie_with_a_running_batch(grid) -> None:
    nodes, _ = grid
    batch = RunningPosition(3, ((1, 0, 60),), step=10)
    tree = build_stage_tree(nodes, [(1, 100)], checkpoints=[(1, 60)], running=[batch])
    assert tree.roots[0].origin == Origin("checkpoint", 1, 60)


def test_children_branching_at_the_root_step_are_fresh_roots() -> None:
    storage = MemoryPlanStorage()
    a = storage.insert_trial("r", {"lr": Constant(0.1)}, 40)
    b = storage.insert_trial("r", {"lr": Constant(0.2)}, 30)
    nodes = {n.id: n for n in storage.nodes()}
    assert nodes[b.node].branch_step == 0
    tree = build_stage_tree(nodes, [(a.node, 40), (b.node, 30)], checkpoints=[(a.node, 0)])
    assert shape(tree) == [(a.node, 0, 40, None), (b.node, 0, 30, None)]
    assert all(r.origin == Origin("checkpoint", a.node, 0) for r in tree.roots)


def test_unknown_nodes_and_non_canonical_keys_raise(grid) -> None:
    nodes, _ = grid
    with pytest.raises(ValueError, match="node 99"):
        build_stage_tree(nodes, [(99, 10)])
    with pytest.raises(ValueError, match="not canonical"):
        build_stage_tree(nodes, [(2, 50)])  # node 2 branches at 50
    with pytest.raises(ValueError, match="not canonical"):
        build_stage_tree(nodes, [(1, 10)], checkpoints=[(3, 70)])


def test_deep_trees_need_no_recursion() -> None:
    nodes = chain_nodes(5000)
    tree = build_stage_tree(nodes, [(5000, 5000), (2500, 2600)])
    # one stage per node; node 2500 continues to 2600, so it splits where 2501 branches
    assert len(tree.stages) == 5001
    assert tree.total_steps == 5100
    path = critical_path(tree)
    assert len(path) == 5000 and path[-1].evaluate_at == [5000]
    text = render_tree(tree, max_lines=3000)
    assert text.endswith("... 2001 more")
    # indentation stops growing; the depth is written out instead
    assert (
        text.splitlines()[-2]
        == "  " * 32 + "(depth 2998) node 2999 [2998, 2999) lr=2999  1 request below"
    )
    assert unique_steps(nodes, [(5000, 5000)]) == 5000


# --------------------------------------------------------------------------- invariants


def brute_force(
    nodes: Mapping[int, Node],
    requests: Iterable[tuple[int, int]],
    checkpoints: set[tuple[int, int]],
) -> set[tuple[int, int]]:
    """(node, training step) pairs the requests still need, from first principles."""
    need: set[tuple[int, int]] = set()
    for n, s in requests:
        path = [nodes[n]]
        while path[-1].parent is not None:
            path.append(nodes[path[-1].parent])
        path.reverse()

        def active(t: int, path: list[Node] = path) -> int:
            return [p for p in path if p.branch_step <= t][-1].id

        def canonical(t: int, path: list[Node] = path) -> int:
            return ([p for p in path if p.branch_step < t] or path[:1])[-1].id

        start = max((t for t in range(s + 1) if (canonical(t), t) in checkpoints), default=0)
        need.update((active(t), t) for t in range(start, s))
    return need


@pytest.mark.parametrize("seed", range(25))
def test_random_trees_match_first_principles(seed: int) -> None:
    rng = random.Random(seed)
    nodes = {1: Node(1, "r", None, 0, {})}
    for i in range(2, rng.randint(2, 30)):
        parent = nodes[rng.randint(1, i - 1)]
        step = parent.branch_step + rng.choice([0, 1, 3, 5, 8]) * (parent.parent is not None)
        if parent.parent is not None:
            step = max(step, parent.branch_step + 1)
        nodes[i] = Node(i, "r", parent.id, step, {})

    def canonical_key(n: int) -> tuple[int, int]:
        b = nodes[n].branch_step
        return n, rng.randint(b + 1, b + 12)

    requests = [canonical_key(rng.choice(list(nodes))) for _ in range(rng.randint(1, 20))]
    ckpts = {canonical_key(rng.choice(list(nodes))) for _ in range(rng.randint(0, 8))}
    tree = build_stage_tree(nodes, requests, ckpts)

    got = [(s.node, t) for s in tree.stages for t in range(s.start, s.stop)]
    assert len(got) == len(set(got)), "stages overlap"
    assert set(got) == brute_force(nodes, requests, ckpts)
    for s in tree.stages:
        if s.parent is None:
            assert s in tree.roots and s.origin is not None and s.origin.step == s.start
        else:
            assert s.parent.stop == s.start and s in s.parent.children
    points = sorted((s.node, t) for s in tree.stages for t in s.evaluate_at)
    assert points == sorted(set(requests))
    assert sum(s.cost for s in tree.stages) == tree.total_steps
    assert unique_steps(nodes, requests) == build_stage_tree(nodes, requests).total_steps


# --------------------------------------------------------------------------- critical path


def test_critical_path_follows_the_most_expensive_chain(grid) -> None:
    nodes, ends = grid
    tree = build_stage_tree(nodes, ends.values())
    path = critical_path(tree)
    assert [(s.node, s.start, s.stop) for s in path] == [(1, 0, 50), (2, 50, 120)]
    # node 3 ten times as expensive per step: 0-50, 50-70, then 20 steps x 10
    tree = build_stage_tree(nodes, ends.values(), cost=lambda n: 10.0 if n.id == 3 else 1.0)
    path = critical_path(tree)
    assert [(s.node, s.start, s.stop) for s in path] == [(1, 0, 50), (1, 50, 70), (3, 70, 90)]
    assert path[-1].cost == 200.0


def test_critical_path_among_given_roots_and_of_nothing(grid) -> None:
    nodes, ends = grid
    tree = build_stage_tree(nodes, ends.values(), checkpoints=[(1, 60), (1, 40)])
    short = [r for r in tree.roots if r.stop == 30]
    assert critical_path(tree, short) == short
    assert critical_path(tree, []) == []
    empty = build_stage_tree(nodes, [])
    assert empty.stages == [] and critical_path(empty) == []


# --------------------------------------------------------------------------- merge rate


def test_merge_rate_counts_total_over_unique_steps() -> None:
    trials: list[tuple[str, dict[str, Any], int]] = [
        ("r", {"lr": MultiStep(0.1, [100], 0.1)}, 200),
        ("r", {"lr": Constant(0.1)}, 200),  # shares steps 0-99
    ]
    assert merge_rate(trials) == pytest.approx(400 / 300)
    # another root key shares nothing
    assert merge_rate([*trials, ("other", {"lr": Constant(0.1)}, 200)]) == pytest.approx(600 / 500)
    assert merge_rate([]) == 1.0
    assert merge_rate([("r", {"lr": 0.1}, 10), ("r", {"lr": 0.1}, 10)]) == 2.0


def test_kwise_merge_rate_shares_across_studies() -> None:
    study = [("r", {"lr": Piecewise([0.1, v], [50])}, 100) for v in (0.01, 0.02, 0.03)]
    single = merge_rate(study)
    assert single == pytest.approx(300 / 200)
    assert kwise_merge_rate([study, study]) == pytest.approx(600 / 200)
    assert kwise_merge_rate([study]) == single


def test_total_and_unique_steps(grid) -> None:
    nodes, ends = grid
    assert total_steps(ends.values()) == 100 + 120 + 90 + 30
    assert unique_steps(nodes, ends.values()) == 100 + 70 + 20


def test_grid_with_many_shared_prefixes() -> None:
    values = [0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001]
    storage = MemoryPlanStorage()
    items = [
        ({"lr": Piecewise(list(v), [30, 60, 90])}, 120)
        for v in itertools.product(values, values, values, values)
    ]
    ins = storage.insert_trials("g", items)
    nodes = {n.id: n for n in storage.nodes()}
    requests = [(i.node, i.step) for i in ins]
    tree = build_stage_tree(nodes, requests)
    assert len(tree.roots) == 7
    assert tree.total_steps == 30 * (7 + 7**2 + 7**3 + 7**4)
    assert len(critical_path(tree)) == 4
    assert bench_build(storage) >= 0.0


# --------------------------------------------------------------------------- explain


def test_render_stage_tree_shows_changes_and_origins(grid) -> None:
    nodes, ends = grid
    text = render_tree(build_stage_tree(nodes, ends.values(), checkpoints=[(1, 60)]))
    assert text.splitlines() == [
        "node 1 [0, 50) lr=0.1  2 requests below, evaluate at 30  (from scratch)",
        "  node 2 [50, 120) lr=0.01  1 request below, evaluate at 120",
        "node 1 [60, 70)  2 requests below  (from checkpoint (node 1, step 60))",
        "  node 1 [70, 100)  1 request below, evaluate at 100",
        "  node 3 [70, 90) lr=0.05  1 request below, evaluate at 90",
    ]
    running = build_stage_tree(
        nodes, [ends["at50"]], running=[RunningPosition(4, ((1, 0, 99),), 5)]
    )
    assert render_tree(running) == (
        "node 2 [50, 120) lr=0.01  1 request below, evaluate at 120"
        "  (after batch 4 at (node 1, step 50))"
    )


def test_render_collapses_past_max_lines(grid) -> None:
    nodes, ends = grid
    text = render_tree(build_stage_tree(nodes, ends.values()), max_lines=2)
    assert text.splitlines()[2:] == ["... 3 more"]
    assert len(text.splitlines()) == 3
    assert render_tree(build_stage_tree(nodes, [])) == "(empty)"
    with pytest.raises(ValueError, match="max_lines"):
        render_tree(nodes, max_lines=0)


def test_render_plan_nodes(grid) -> None:
    nodes, ends = grid
    text = render_tree(list(nodes.values()), requests=ends.values())
    assert text.splitlines() == [
        "node 1 [0, 100) lr=0.1  4 requests below",
        "  node 2 [50, 120) lr=0.01  1 request below",
        "  node 3 [70, 90) lr=0.05  1 request below",
    ]


def test_summarize_uses_trial_records_or_requests() -> None:
    storage = MemoryPlanStorage()
    a = storage.insert_trial("r", {"lr": Constant(0.1)}, 100)
    b = storage.insert_trial("r", {"lr": MultiStep(0.1, [60], 0.5)}, 100)
    storage.put_checkpoint(a.node, 60, "ckpt-60", 10)
    summary = summarize(storage)
    assert (summary.trials, summary.total_steps, summary.unique_steps) == (2, 200, 140)
    assert summary.merge_rate == pytest.approx(200 / 140)
    assert (summary.nodes, summary.checkpoints, summary.pending_requests) == (2, 1, 2)
    assert summary.pending_steps == 40 + 40  # both continue from the checkpoint at 60

    storage.create_study("s", {})
    for end in (a, b, a):
        storage.add_trial("s", "r", {}, {"lr": Constant(0.1)}, end.step, end.node, end.step)
    summary = summarize(storage, study="s")
    assert (summary.trials, summary.total_steps, summary.unique_steps) == (3, 300, 140)
    assert summarize(storage, root_keys=["nope"]).trials == 0


def test_stage_helpers() -> None:
    leaf = Stage(2, 5, 9, evaluate_at=[9])
    root = Stage(1, 0, 5, children=[leaf], evaluate_at=[3])
    leaf.parent = root
    assert leaf.root() is root and leaf.steps == 4
    assert list(root.subtree()) == [root, leaf]
    assert root.requests_below() == 2
