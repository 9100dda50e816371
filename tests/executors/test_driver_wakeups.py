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


def _driver_sleeps_while_idle(tmp_path: Path, executor: type[InlineExecutor], idle: float) -> int:
    """Run a trial on ``executor``, count the driver's sleeps on its own wake-up over
    ``idle`` seconds with nothing to do, then check a submission still reaches it."""

    def factory() -> InlineExecutor:
        return executor(LinearTrainer, checkpoint_dir=tmp_path / "ck")

    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Study("s", LinearTrainer, storage=url, executor=factory) as study:
        assert study.run({"seed": 0}, {"lr": 0.01}, 3).steps == 3
        wake = CountingWake()
        study._engine._wake = wake
        time.sleep(idle)
        sleeps = wake.sleeps
        # A submission still reaches the driver.
        assert study.run({"seed": 1}, {"lr": 0.01}, 2).steps == 2
    return sleeps


def test_an_idle_driver_sleeps_only_inside_the_executors_wait(tmp_path: Path) -> None:
    # About 30 rounds of the driver with nothing to do.
    assert _driver_sleeps_while_idle(tmp_path, WatchingExecutor, 0.3) == 0


class WokenExecutor(InlineExecutor):
    """An inline executor that waits in ``events`` until an event or a wake, as a process
    pool does, and here returns after 1 ms with nothing, as a wake taken by ``events``
    (while the driver's own wake-up was already cleared) leaves it."""

    waits_in_events = True

    def events(self, timeout: float | None = None) -> list[Any]:
        out = super().events(timeout)
        if not out and timeout:
            time.sleep(0.001)
        return out


def test_an_executor_woken_with_nothing_is_asked_again_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a poll of an hour, a driver that slept "the rest of its poll" after such a
    # return would not look at its workers for an hour (seen as a hang of a submission
    # whose wake the executor's wait had taken).
    from stagetree.engine import core

    monkeypatch.setattr(core, "_POLL", 3600.0)
    assert _driver_sleeps_while_idle(tmp_path, WokenExecutor, 0.1) == 0
