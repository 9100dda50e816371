"""The scheduler's stage tree kept per plan tree (``StageForest``): after any sequence
of changes it equals a whole build over the same inputs."""

from __future__ import annotations

import random
from typing import Any

import pytest

from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.plan.model import Node
from stagetree.scheduler.cost import CostEstimator
from stagetree.scheduler.forest import StageForest
from stagetree.stages import RunningPosition, StageTree, build_stage_tree

Key = tuple[int, int]


def plan(seed: int) -> tuple[dict[int, Node], list[Key]]:
    """Nodes of four plan trees whose trials share prefixes, and canonical positions on
    them (requests and checkpoints are drawn among those)."""
    rng = random.Random(seed)
    storage = MemoryPlanStorage()
    for root in ("a", "b", "c", "d"):
        items = []
        for _ in range(6):
            lr = MultiStep(0.1, sorted(rng.sample(range(2, 14), rng.randint(0, 2))), 0.5)
            bs = rng.choice([Constant(64), Piecewise([64, 128], [rng.randint(2, 12)])])
            items.append(({"lr": lr, "bs": bs}, rng.randint(4, 16)))
        storage.insert_trials(root, items, request=False)
    nodes = {n.id: n for n in storage.nodes()}
    keys: list[Key] = []
    for node in nodes.values():
        first = 0 if node.parent is None else node.branch_step + 1
        keys.extend((node.id, t) for t in range(first, 17))
    return nodes, keys


def path_of(nodes: dict[int, Node], key: Key) -> tuple[tuple[int, int, int], ...]:
    """The segments ``(node, start, stop)`` from step 0 of ``key``'s tree to ``key``."""
    node, stop = nodes[key[0]], key[1]
    out = []
    while True:
        start = node.branch_step if node.parent is not None else 0
        if start < stop:
            out.append((node.id, start, stop))
        if node.parent is None:
            return tuple(reversed(out))
        stop = node.branch_step
        node = nodes[node.parent]


def snapshot(tree: StageTree) -> dict[str, Any]:
    """Everything a decision may read of a stage tree, by value."""
    index = {id(s): i for i, s in enumerate(tree.stages)}

    def stages(items: list[Any]) -> list[int]:
        return [index[id(s)] for s in items]

    return {
        "stages": [
            (
                s.node,
                s.start,
                s.stop,
                list(s.evaluate_at),
                s.cost,
                s.origin,
                None if s.parent is None else index[id(s.parent)],
                stages(s.children),
            )
            for s in tree.stages
        ],
        "roots": stages(tree.roots),
        "ready": stages(tree.ready_roots()),
        "waiting": stages(tree.waiting_roots()),
        "covered": list(tree.covered),
    }


@pytest.mark.parametrize("seed", range(6))
def test_forest_equals_a_whole_build_after_every_change(seed: int) -> None:
    nodes, keys = plan(seed)
    rng = random.Random(seed)
    forest = StageForest(nodes)
    estimator = CostEstimator()
    requests: dict[Key, None] = {}
    checkpoints: set[Key] = set()
    node_list = list(nodes.values())
    for _ in range(150):
        op = rng.random()
        if op < 0.35:
            key = rng.choice(keys)
            if key not in requests:
                requests[key] = None
                forest.add_request(key)
        elif op < 0.5 and requests:
            key = rng.choice(list(requests))
            del requests[key]
            forest.remove_request(key)
        elif op < 0.62:
            key = rng.choice(keys)
            if key not in checkpoints:
                checkpoints.add(key)
                forest.add_checkpoint(key)
        elif op < 0.7 and checkpoints:
            key = rng.choice(sorted(checkpoints))
            checkpoints.discard(key)
            forest.remove_checkpoint(key)
        elif op < 0.8:  # the costs move
            estimator.observe(rng.choice(node_list), rng.uniform(0.5, 2.0))
        # What running and saving batches contribute changes at every decision.
        running = []
        for batch_id in range(rng.randint(0, 3)):
            segments = path_of(nodes, rng.choice(keys))
            if not segments:
                continue
            step = rng.randint(segments[0][1], segments[-1][2])
            # Checkpoints promised at positions it passed (canonical, on its path).
            passed = [(n, t) for n, a, b in segments for t in range(a + 1, min(b, step) + 1)]
            saving = tuple(k for k in passed if rng.random() < 0.2)
            running.append(RunningPosition(batch_id + 1, segments, step, saving))
        promised = {k for k in requests if rng.random() < 0.1}
        memory = {k for k in rng.sample(keys, 3) if rng.random() < 0.3}
        got = forest.tree(running, promised, memory, estimator.cost, estimator.version)
        want = build_stage_tree(
            nodes,
            [k for k in requests if k not in promised],
            checkpoints | memory,
            running,
            estimator.cost,
        )
        assert snapshot(got) == snapshot(want)


def test_forest_refuses_what_a_whole_build_refuses() -> None:
    nodes, keys = plan(0)
    forest = StageForest(nodes)
    child = next(n for n in nodes.values() if n.parent is not None)
    forest.add_request(keys[0])
    forest.add_checkpoint((child.id, child.branch_step))  # not canonical on its node
    with pytest.raises(ValueError, match="not canonical"):
        forest.tree([], set(), (), lambda n: 1.0, None)
    forest.remove_checkpoint((child.id, child.branch_step))
    forest.add_checkpoint((10_000, 3))
    with pytest.raises(ValueError, match="not among the plan nodes"):
        forest.tree([], set(), (), lambda n: 1.0, None)
