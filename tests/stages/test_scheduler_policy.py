"""The critical-path policy: the whole path while the work bounds the study, up to its
first branch point once the tree's depth does (issue 25, item 7)."""

from __future__ import annotations

from typing import Any

from test_scheduler import Harness, only, segs

from stagetree.hp import Constant, MultiStep
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import CriticalPathPolicy, Scheduler
from stagetree.scheduler.events import NodeAdded, RequestAdded, RootAdded
from stagetree.stages import Stage, StageTree
from stagetree.work import RunBatch

TRUNK = {"lr": Constant(0.1)}
AT10 = {"lr": MultiStep(0.1, [10], 0.1)}


def _first_batches(
    workers: int, chains: dict[str, int], trunk_steps: int = 100
) -> list[list[tuple[int, int, int]]]:
    """Plan tree "a" (a 10-step trunk, then two branches to ``trunk_steps``) and one
    chain per entry of ``chains`` (plan tree name -> steps), loaded at once: the batches
    of ``workers`` idle workers."""
    plan = MemoryPlanStorage()
    trials: list[tuple[str, dict[str, Any], int]] = [
        ("a", TRUNK, trunk_steps),  # node 1
        ("a", AT10, trunk_steps),  # node 2, from step 10
    ]
    trials += [(root, {"lr": Constant(0.2)}, steps) for root, steps in chains.items()]
    ends = [plan.insert_trial(root, hp, steps) for root, hp, steps in trials]
    events: list[Any] = [RootAdded(r, {}) for r in dict.fromkeys(t[0] for t in trials)]
    events += [NodeAdded(n) for n in plan.nodes()]
    events += [RequestAdded(e.node, e.step) for e in ends]
    sched = Scheduler(num_workers=workers)
    return [segs(b) for b in only(sched.handle_all(events), RunBatch)]


def test_a_depth_bound_study_stops_the_path_at_its_first_branch_point() -> None:
    # Two workers for 285 steps whose longest path is 100: the depth bounds the study.
    # After the branch point at 10, 90 steps are left of tree a's path, fewer than tree
    # b's 95: the worker chooses again at 10 rather than committing to 90 more steps.
    assert _first_batches(2, {"b": 95}) == [[(1, 0, 10)], [(3, 0, 95)]]


def test_a_path_longer_than_every_other_goes_whole() -> None:
    # Tree b's 50 steps never compete with the 90 left after the branch point.
    assert _first_batches(2, {"b": 50}) == [[(1, 0, 10), (1, 10, 100)], [(3, 0, 50)]]


def test_one_worker_runs_the_whole_path() -> None:
    # Nobody else could take what it leaves at the branch point.
    assert _first_batches(1, {"b": 95}) == [[(1, 0, 10), (1, 10, 100)]]


def test_a_work_bound_study_runs_the_whole_path() -> None:
    # Many chains for two workers: the work bounds the study, the model stays on its
    # worker through the branch point (no checkpoint load).
    chains = {f"b{k}": 95 for k in range(6)}
    assert _first_batches(2, chains)[0] == [(1, 0, 10), (1, 10, 100)]


def test_the_scheduler_tells_the_policy_its_workers() -> None:
    policy = CriticalPathPolicy()
    assert policy.workers is None
    sched = Scheduler(num_workers=3, policy=policy)
    h = Harness(workers=None)
    h.sched = sched
    h.trial(TRUNK, 10)
    assert policy.workers == 3


def test_outside_a_scheduler_the_path_goes_whole() -> None:
    trunk = Stage(1, 0, 10, cost=10.0)
    for node in (1, 2):
        child = Stage(node, 10, 100, parent=trunk, cost=90.0)
        trunk.children.append(child)
    other = Stage(3, 0, 95, cost=95.0)
    stages = [trunk, *trunk.children, other]
    tree = StageTree(stages, [trunk, other], [], {})
    assert CriticalPathPolicy().choose(tree, [trunk, other]) == [trunk, trunk.children[0]]


def test_the_scheduler_cuts_the_path_without_walking_the_tree(monkeypatch: Any) -> None:
    # The depth-bound cut's inputs (the longest paths from the roots, the remaining
    # work) come from the scheduler's kept stage tree, not from a walk of every stage
    # (CriticalPathPolicy._paths): the same decisions as the policy's on a whole tree.
    def walk(*args: Any) -> None:
        raise AssertionError("the scheduler walked the whole tree for the cut")

    monkeypatch.setattr(CriticalPathPolicy, "_paths", staticmethod(walk))
    assert _first_batches(2, {"b": 95}) == [[(1, 0, 10)], [(3, 0, 95)]]
    assert _first_batches(2, {"b": 50}) == [[(1, 0, 10), (1, 10, 100)], [(3, 0, 50)]]
    chains = {f"b{k}": 95 for k in range(6)}
    assert _first_batches(2, chains)[0] == [(1, 0, 10), (1, 10, 100)]


def test_at_the_threshold_the_work_bound_study_keeps_the_whole_path() -> None:
    # 400 steps of work, the longest path 100, two workers: 100 x 2 is exactly half the
    # work (kept work that cannot tell is checked on the whole tree): the whole path.
    assert _first_batches(2, {"b": 100, "c": 100, "d": 10})[0] == [(1, 0, 10), (1, 10, 100)]
