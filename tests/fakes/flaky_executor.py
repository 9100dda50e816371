"""An executor whose start fails a given number of times (a cluster with no room, a
start timeout), for the tests of what a failed start leaves behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from study_trainers import LinearTrainer

from stagetree.exceptions import ExecutorError
from stagetree.executors.inline import InlineExecutor


class FlakyStart(InlineExecutor):
    """An inline executor of ``LinearTrainer`` whose start raises ``ExecutorError``
    with the next message of ``failures`` while it has one left; each close is logged
    in ``closed``."""

    def __init__(self, failures: list[str], closed: list[bool], checkpoint_dir: Path) -> None:
        super().__init__(LinearTrainer, checkpoint_dir=checkpoint_dir)
        self._failures = failures
        self._closed_log = closed

    def start(self) -> None:
        if self._failures:
            raise ExecutorError(self._failures.pop(0))
        super().start()

    def close(self) -> None:
        self._closed_log.append(True)
        super().close()


def flaky_factory(failures: list[str], checkpoint_dir: Path) -> Any:
    """A factory of :class:`FlakyStart` sharing ``failures``; its ``made`` and
    ``closed`` lists say what it made and closed."""
    closed: list[bool] = []
    made: list[FlakyStart] = []

    def factory() -> FlakyStart:
        made.append(FlakyStart(failures, closed, checkpoint_dir))
        return made[-1]

    factory.made = made  # type: ignore[attr-defined]
    factory.closed = closed  # type: ignore[attr-defined]
    return factory
