"""A study's counters are written once a second of the engine's clock while only
progress is reported, and before anything that ends a trial: workers that report their
steps at different times made one transaction a report, most of a large study's driver
time on SQLite; and a checkpoint's or a batch end's counters made one each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagetree.distributions import LogUniform
from stagetree.executors.simulated import LearningCurve, SimulatedExecutor, SimulatedTrainer
from stagetree.hp import Constant
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.scopes import study_scope
from stagetree.space import RandomSpace
from stagetree.study import Study
from stagetree.tuners import RandomSearch
from stagetree.work import Progress


class CountingPlan(MemoryPlanStorage):
    def __init__(self) -> None:
        super().__init__()
        self.count_writes = 0
        self.stats_writes = 0  # transactions of counters, any scope

    def add_stats_many(self, deltas: Any) -> None:
        if any(scope.startswith(study_scope("s", "")[:-1]) for scope in deltas):
            self.count_writes += 1
        self.stats_writes += 1
        super().add_stats_many(deltas)

    def add_stats(self, scope: str, **deltas: float) -> None:
        self.stats_writes += 1
        super().add_stats(scope, **deltas)


def test_progress_rounds_write_the_counts_once_a_second(tmp_path: Path) -> None:
    plan = CountingPlan()
    executor = SimulatedExecutor(8, curve=LearningCurve(aliases={"acc": "accuracy"}))
    progress = 0
    events = executor.events

    def counting(timeout: Any) -> Any:
        nonlocal progress
        got = events(timeout)
        progress += sum(isinstance(ev, Progress) for ev in got)
        return got

    executor.events = counting  # type: ignore[method-assign]
    # Batch sizes drawn per trial: steps of different lengths, so the workers report at
    # different moments (a round of events holds one report).
    space = RandomSpace(
        hp={
            "lr": Constant(LogUniform(1e-3, 0.3)),  # type: ignore[arg-type]
            "batch_size": Constant(LogUniform(64, 512)),  # type: ignore[arg-type]
        }
    )
    study = Study(
        "s",
        SimulatedTrainer,
        storage=plan,
        workers=8,
        checkpoint_dir=str(tmp_path / "ckpt"),
        executor=lambda: executor,
        version="v",
    )
    try:
        study.tune(RandomSearch(space, "acc", steps=64, num_trials=24, seed=0))
        stats = plan.stats(study_scope("s", "v"))
    finally:
        study.close()
    assert progress >= 24 * 32  # the workers report about every step
    # At most one write a virtual second (one a step here), one before or after each
    # trial's end, one at the close: not one a progress report.
    assert plan.count_writes <= executor.now + 2 * 24 + 2
    assert plan.count_writes < progress / 4
    assert stats["steps_executed"] == 24 * 64  # nothing is lost on the way
    # The storage's, the trees' and the studies' counters of checkpoints and batch
    # ends go with them: no transaction of their own (three a trial).
    assert plan.stats_writes <= executor.now + 2 * 24
