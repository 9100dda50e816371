"""The forest's groups within a plan tree: trials that branch off at step 0 of their
root share no stage, so a decision builds again only the group whose inputs changed,
not every pending trial of the plan tree; and the kept tree still equals a whole build
(models at step 0 of a root, which every group reads, included)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_forest import (
    _running,
    add_checkpoints,
    assert_whole_build,
    change,
    lose_checkpoint,
    plan,
)

from stagetree.hp import Constant
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import forest as forest_module
from stagetree.scheduler.cost import CostEstimator
from stagetree.scheduler.forest import StageForest
from stagetree.stages import RunningPosition

Key = tuple[int, int]


@pytest.mark.parametrize("seed", range(8))
def test_grouped_forest_equals_a_whole_build_after_every_change(seed: int) -> None:
    nodes, keys = plan(seed, from_zero=True)
    roots = [n.id for n in nodes.values() if n.parent is None]
    assert any(n.parent is not None and n.branch_step == 0 for n in nodes.values())
    rng = random.Random(1000 + seed)
    forest, estimator = StageForest(nodes), CostEstimator()
    requests: dict[Key, None] = {}
    checkpoints: set[Key] = set()
    node_list = list(nodes.values())
    for _ in range(150):
        op = rng.random()
        if change(rng, forest, keys, requests, checkpoints, op, (0.35, 0.5, 0.6)):
            pass
        elif op < 0.66:  # a checkpoint at step 0 of a root: every group reads it
            add_checkpoints(forest, checkpoints, [(rng.choice(roots), 0)])
        elif op < 0.74 and checkpoints:
            lose_checkpoint(rng, forest, checkpoints)
        elif op < 0.8:
            estimator.observe(rng.choice(node_list), rng.uniform(0.5, 2.0))
        running = _running(rng, nodes, keys)
        if rng.random() < 0.2:  # a batch promised the model at step 0 of a root
            running.append(RunningPosition(9, (), 0, ((rng.choice(roots), 0),)))
        promised = {k for k in requests if rng.random() < 0.1}
        memory = {k for k in rng.sample(keys, 3) if rng.random() < 0.3}
        memory |= {(r, 0) for r in roots if rng.random() < 0.05}
        assert_whole_build(forest, estimator, requests, checkpoints, running, promised, memory)


def test_a_decision_builds_only_the_changed_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forty trials of one plan tree, each with its own hyper-parameters from step 0 (a
    random search): after one request comes and one settles, the next decision builds
    the stage trees of those two trials only (before: all forty, every decision)."""
    storage = MemoryPlanStorage()
    items: list[tuple[dict[str, Any], int]] = [
        ({"lr": Constant(0.01 * (i + 1))}, 8) for i in range(41)
    ]
    storage.insert_trials("study", items, request=False)
    nodes = {n.id: n for n in storage.nodes()}
    leaves = sorted(nodes)  # the first trial's is the root, the others branch at step 0
    assert len(leaves) == 41
    forest, estimator = StageForest(nodes), CostEstimator()
    for node in leaves[:40]:
        forest.add_request((node, 8))
    first = forest.tree([], set(), (), estimator.cost, estimator.version)
    assert len(first.roots) == 40
    built: list[int] = []
    whole = forest_module.build_stage_tree

    def counting(nodes: Any, requests: Any, *args: Any) -> Any:
        built.append(len(requests))
        return whole(nodes, requests, *args)

    monkeypatch.setattr(forest_module, "build_stage_tree", counting)
    forest.add_request((leaves[40], 8))
    forest.remove_request((leaves[0], 8))
    tree = forest.tree([], set(), (), estimator.cost, estimator.version)
    assert len(tree.roots) == 40
    assert sorted(built) == [1]  # the new trial's; the settled one's group is empty
    assert forest.compared == 2
