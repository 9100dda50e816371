"""LocalExecutor looks at its workers through one kept poll object (``_watch.Watch``), not
a selector built per pipe, per process and per event read at every round."""

from __future__ import annotations

import multiprocessing.connection
import time
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree.executors import LocalExecutor
from stagetree.hp import Constant
from stagetree.work import BatchDone, MetricsReported, RunBatch, Segment, WorkerReady


def _batch(batch_id: int, worker: int) -> RunBatch:
    return RunBatch(
        batch_id=batch_id,
        worker=worker,
        root_key=f"r{batch_id}",
        config={},
        start_step=0,
        start_at=None,
        start_checkpoint=None,
        segments=(Segment(1, 0, 5, {"lr": Constant(0.01)}),),
        evaluate_at=((1, 5),),
    )


def _collect(ex: LocalExecutor, kind: type, count: int) -> list[Any]:
    seen: list[Any] = []
    deadline = time.monotonic() + 60
    while sum(isinstance(e, kind) for e in seen) < count:
        assert time.monotonic() < deadline, f"timed out; events so far: {seen}"
        seen.extend(ex.events(timeout=1.0))
    return seen


def test_events_build_no_selector_per_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    base = multiprocessing.connection._WaitSelector  # type: ignore[attr-defined]

    class Counting(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    with LocalExecutor(
        LinearTrainer, num_workers=2, checkpoint_dir=tmp_path, devices=[], threads_per_worker=1
    ) as ex:
        _collect(ex, WorkerReady, 2)
        builds = getattr(getattr(ex, "_watch", None), "builds", None)
        monkeypatch.setattr(multiprocessing.connection, "_WaitSelector", Counting)
        looks = 0
        for round_ in range(3):
            for worker in (0, 1):
                ex.submit(_batch(10 * round_ + worker, worker))
            seen: list[Any] = []
            deadline = time.monotonic() + 60
            while sum(isinstance(e, BatchDone) for e in seen) < 2:
                assert time.monotonic() < deadline, f"timed out; events so far: {seen}"
                seen.extend(ex.events(timeout=1.0))
                looks += 1
            assert len([e for e in seen if isinstance(e, MetricsReported)]) == 2
        # Every event read and every look at the two workers without a selector (on
        # main: one per pipe and per process at each look, and one per event read).
        assert made == [] and looks >= 3
        # The same pipes and processes: the poll object kept.
        assert builds is not None and ex._watch.builds == builds
