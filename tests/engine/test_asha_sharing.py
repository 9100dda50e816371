"""ASHA in a study that shares prefixes: in-flight work is counted per distinct path."""

from __future__ import annotations

import asyncio
from typing import Any

from tuner_fakes import FakeRunner

from stagetree.hp import Constant, Then
from stagetree.space import GridSpace
from stagetree.tuners import ASHA

# 8 trials identical for their first 8 steps: their first rung (4 steps) is one piece of
# work in a sharing study.
SPACE = GridSpace(hp={"x": [Then(Constant(0.7), Constant(0.1 * i), 8) for i in range(8)]})


class SharingRunner(FakeRunner):
    """A fake study that says it shares prefixes (as ``Study(share=True)`` does)."""

    def shares_work(self) -> bool:
        return True


def _asha(**kw: Any) -> ASHA:
    return ASHA(SPACE, "acc", min_steps=4, max_steps=16, num_trials=8, seed=0, **kw)


def _run(tuner: ASHA, runner: FakeRunner) -> None:
    asyncio.run(tuner.run(runner))


def test_sharing_study_fills_workers_per_distinct_path() -> None:
    runner = SharingRunner(workers=2)
    _run(_asha(), runner)
    # All 8 first-rung jobs train the same 4 steps: one worker's work, so ASHA submits
    # every one of them at once instead of 2.
    assert runner.max_in_flight == 8
    assert len(runner.calls) >= 8


def test_without_sharing_one_job_per_worker() -> None:
    runner = FakeRunner(workers=2)
    _run(_asha(), runner)
    assert runner.max_in_flight == 2


def test_explicit_max_concurrent_counts_jobs() -> None:
    runner = SharingRunner(workers=2)
    _run(_asha(max_concurrent=3), runner)
    assert runner.max_in_flight == 3


def test_distinct_paths_count_one_worker_each() -> None:
    # Trials that differ from step 0 share nothing: 2 workers, 2 jobs.
    space = GridSpace(hp={"x": [Constant(0.1 * i) for i in range(8)]})
    runner = SharingRunner(workers=2)
    _run(ASHA(space, "acc", min_steps=4, max_steps=16, num_trials=8, seed=0), runner)
    assert runner.max_in_flight == 2
