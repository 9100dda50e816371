"""A submission and a claim read the checkpoint records of their path only (by the
checkpoints' key), not every record of their tree: a study in one shared tree (a grid
with a shared prefix) read them all per submission that added nodes, and per claim on a
shared storage, which made its cost per trial grow with the study."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stagetree.executors.simulated import LearningCurve, SimulatedExecutor, SimulatedTrainer
from stagetree.hp import Constant, Then
from stagetree.plan.base import BasePlanStorage, CheckpointRecord
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.sql import SQLPlanStorage
from stagetree.study import Study

Found = dict[tuple[int, int], CheckpointRecord]


class _Counting:
    """Counts the checkpoint records each read returns, in order."""

    reads: list[int]

    def checkpoints(self, root_key: str | None = None) -> Found:
        out: Found = super().checkpoints(root_key)  # type: ignore[misc]
        self.reads.append(len(out))
        return out

    def checkpoints_on(self, nodes: Any) -> Found:
        out: Found = super().checkpoints_on(nodes)  # type: ignore[misc]
        self.reads.append(len(out))
        return out


class CountingSQL(_Counting, SQLPlanStorage):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.reads = []


class CountingMemory(_Counting, MemoryPlanStorage):
    def __init__(self) -> None:
        super().__init__()
        self.reads = []


def _grid_one_by_one(plan: Any, tmp_path: Path, trials: int) -> tuple[list[int], int]:
    """Train ``trials`` points of a grid sharing their first 4 steps (one plan tree: a
    root and one child per point branching at step 4), one after the other, so that
    each submission and claim comes after the earlier trials' checkpoints. Returns the
    records each read returned, and the records stored in the end."""
    executor = SimulatedExecutor(2, curve=LearningCurve(aliases={"acc": "accuracy"}))
    study = Study(
        "grid",
        SimulatedTrainer,
        storage=plan,
        workers=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        executor=lambda: executor,
        version="v",
    )
    try:
        for i in range(trials):
            study.run({}, {"lr": Then(Constant(0.7), Constant(0.01 * (i + 1)), 4)}, 8)
        reads = list(plan.reads)
        return reads, len(plan.checkpoints())
    finally:
        study.close()


def _check(plan: Any, tmp_path: Path) -> None:
    reads, stored = _grid_one_by_one(plan, tmp_path, 24)
    assert stored >= 24  # the tree holds a record per trial at least
    assert reads  # the submissions (and claims) read some
    # A path is the root and one child: its records are the root's and the child's,
    # a handful whatever the number of trials (was up to every record of the tree).
    assert max(reads) <= 4, reads


def test_reads_of_checkpoints_stay_constant_on_sql(sql_plan_url: str, tmp_path: Path) -> None:
    _check(CountingSQL(sql_plan_url), tmp_path)


def test_reads_of_checkpoints_stay_constant_in_memory(tmp_path: Path) -> None:
    _check(CountingMemory(), tmp_path)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_checkpoints_on_reads_the_nodes_asked(backend: str, tmp_path: Path) -> None:
    plan: BasePlanStorage = (
        MemoryPlanStorage() if backend == "memory" else SQLPlanStorage(f"sqlite:///{tmp_path}/p.db")
    )
    a = plan.insert_trial("r", {"lr": Constant(0.1)}, 8, request=False)
    b = plan.insert_trial("r", {"lr": Then(Constant(0.1), Constant(0.2), 4)}, 8, request=False)
    c = plan.insert_trial("s", {"lr": Constant(0.3)}, 8, request=False)
    plan.put_checkpoint(a.node, 4, "a4", 1)
    plan.put_checkpoint(a.node, 8, "a8", 1)
    plan.put_checkpoint(b.node, 8, "b8", 1)
    plan.put_checkpoint(c.node, 8, "c8", 1)
    plan.remove_checkpoint(a.node, 8)
    found = plan.checkpoints_on([b.node, a.node])
    assert {k: r.ref for k, r in found.items()} == {(a.node, 4): "a4", (b.node, 8): "b8"}
    assert list(found) == sorted(found)
    assert plan.checkpoints_on([]) == {}
    # the contract's default (a filter of every record) answers the same
    assert BasePlanStorage.checkpoints_on(plan, [a.node, b.node]) == found
