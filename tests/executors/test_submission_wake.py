"""A submission wakes the driver where it waits on the workers (issue 22, latency).

The engine's driver waits on the executor's events a poll interval at a time; a
submission (or a cancellation) from the user's thread used to be noticed only when that
wait ended. The local executor's wait now ends at :meth:`LocalExecutor.wake`, which the
engine calls for each submission: these tests make the poll an hour long, so that only
the wake-up can hand the driver a submission while its worker idles.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree.engine import core
from stagetree.executors.local import LocalExecutor
from stagetree.study import Study
from stagetree.work import WorkerReady

pytestmark = pytest.mark.timeout(120)

HOUR = 3600.0


def test_wake_ends_a_wait_on_idle_workers(tmp_path: Path) -> None:
    with LocalExecutor(LinearTrainer, 1, checkpoint_dir=tmp_path / "ck", devices=[]) as ex:
        seen: list[Any] = []
        while not any(isinstance(e, WorkerReady) for e in seen):
            seen += ex.events(timeout=30)
        returned: list[list[Any]] = []
        waiter = threading.Thread(target=lambda: returned.append(ex.events(timeout=HOUR)))
        waiter.start()
        ex.wake()
        waiter.join(timeout=60)
        assert not waiter.is_alive()
        assert returned == [[]]  # nothing happened: it returns empty-handed
        ex.wake()  # a wake with nobody waiting ends the next wait only
        assert ex.events(timeout=HOUR) == []
        assert ex.events(timeout=0.01) == []


def test_a_submission_reaches_a_driver_waiting_on_idle_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "_POLL", HOUR)
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Study("s", LinearTrainer, storage=url, workers=1) as study:
        assert study.run({"seed": 0}, {"lr": 0.01}, 2).steps == 2
        # The worker idles now, and the driver waits on it for an hour.
        results: list[Any] = []
        later = threading.Thread(
            target=lambda: results.append(study.run({"seed": 1}, {"lr": 0.01}, 2))
        )
        later.start()
        later.join(timeout=60)
        assert not later.is_alive(), "the submission waited for the driver's poll to end"
        assert results[0].steps == 2
