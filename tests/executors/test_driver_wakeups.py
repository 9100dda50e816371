"""The engine's driver watches its workers all the time it idles (issue 22, efficiency).

An executor's ``events(timeout)`` waits on its workers (a process pool on their pipes)
and returns as soon as one reports. The driver used to sleep another poll interval on
its own wake-up after every such wait that found nothing: an event that arrived then
(a batch's end, whose worker waits for its next batch) waited for that sleep to end.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.executors.inline import InlineExecutor

pytestmark = pytest.mark.timeout(60)


class WatchingExecutor(InlineExecutor):
    """An inline executor that, with nothing to report, waits its whole timeout (as a
    process pool does on its workers' pipes)."""

    def events(self, timeout: float | None = None) -> list[Any]:
        out = super().events(timeout)
        if not out and timeout:
            time.sleep(timeout)
        return out


class CountingWake(threading.Event):
    """The driver's wake-up event, counting the sleeps it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None or timeout > 0:
            self.sleeps += 1
        return super().wait(timeout)


def test_an_idle_driver_sleeps_only_inside_the_executors_wait(tmp_path: Path) -> None:
    def factory() -> InlineExecutor:
        return WatchingExecutor(LinearTrainer, checkpoint_dir=tmp_path / "ck")

    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Study("s", LinearTrainer, storage=url, executor=factory) as study:
        assert study.run({"seed": 0}, {"lr": 0.01}, 3).steps == 3
        engine = study._engine
        wake = CountingWake()
        engine._wake = wake
        time.sleep(0.3)  # about 30 rounds of the driver with nothing to do
        assert wake.sleeps == 0
        # A submission still reaches the driver.
        assert study.run({"seed": 1}, {"lr": 0.01}, 2).steps == 2
