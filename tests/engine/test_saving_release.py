"""An ended batch's stage leases are let go once its checkpoint writes all ended: the
engine looks again only when a batch ended or the scheduler's saving batches lost one
(not at every event), and still lets every batch go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagetree.distributions import LogUniform
from stagetree.executors.simulated import LearningCurve, SimulatedExecutor, SimulatedTrainer
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.space import RandomSpace
from stagetree.study import Study
from stagetree.tuners import ASHA
from stagetree.work import RunBatch, RunFused


def test_every_batch_is_let_go_once_its_writes_end(tmp_path: Path) -> None:
    executor = SimulatedExecutor(4, curve=LearningCurve(aliases={"acc": "accuracy"}))
    started: list[int] = []
    submit = executor.submit

    def counting(instruction: object) -> None:
        if isinstance(instruction, RunBatch):
            started.append(instruction.batch_id)
        elif isinstance(instruction, RunFused):
            started.extend(b.batch_id for b in instruction.batches)
        submit(instruction)  # type: ignore[arg-type]

    executor.submit = counting  # type: ignore[method-assign]
    space = RandomSpace(hp={"lr": LogUniform(1e-3, 0.3)})  # type: ignore[dict-item]
    tuner = ASHA(space, "acc", min_steps=4, max_steps=16, num_trials=24, eta=2, seed=0)
    with Study(
        "s",
        SimulatedTrainer,
        storage=MemoryPlanStorage(),
        workers=4,
        checkpoint_dir=str(tmp_path / "ckpt"),
        executor=lambda: executor,
    ) as study:
        engine = study._engine
        ended: list[int] = []
        batch_ended = engine.coord.batch_ended

        def noting(batch_id: int, *args: Any) -> None:
            ended.append(batch_id)
            batch_ended(batch_id, *args)

        engine.coord.batch_ended = noting  # type: ignore[method-assign]
        study.tune(tuner)
        saved_late = engine.scheduler.saving_left
        assert not engine._unreleased
        assert not engine.scheduler.saving
    assert saved_late > 0  # some batches ended before their writes did
    assert sorted(ended) == sorted(started)
