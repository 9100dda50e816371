"""A failed executor start leaves the engine able to start again (issue 23, item 3).

The engine counts as started only once its executor's ``start()`` returned: the next
call after a failed start (a cluster with no room, a timeout) makes a new executor and
tries again, instead of driving the failed one (which hung or failed every later call).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.exceptions import ExecutorError
from stagetree.executors.inline import InlineExecutor

pytestmark = pytest.mark.timeout(60)


class _FlakyStart(InlineExecutor):
    """An inline executor whose start fails while ``failures`` has items left."""

    def __init__(self, failures: list[str], closed: list[bool], **kwargs: object) -> None:
        super().__init__(LinearTrainer, **kwargs)  # type: ignore[arg-type]
        self._failures = failures
        self._closed_log = closed

    def start(self) -> None:
        if self._failures:
            raise ExecutorError(self._failures.pop(0))
        super().start()

    def close(self) -> None:
        self._closed_log.append(True)
        super().close()


def test_a_failed_start_is_tried_again_by_the_next_run(tmp_path: Path) -> None:
    failures = ["no room on the cluster", "still no room"]
    closed: list[bool] = []
    made: list[_FlakyStart] = []

    def factory() -> _FlakyStart:
        made.append(_FlakyStart(failures, closed, checkpoint_dir=tmp_path / "ck"))
        return made[-1]

    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Study("s", LinearTrainer, storage=url, executor=factory) as study:
        with pytest.raises(ExecutorError, match="no room on the cluster"):
            study.run({"seed": 0}, {"lr": 0.01}, 5)
        with pytest.raises(ExecutorError, match="still no room"):
            study.run({"seed": 0}, {"lr": 0.01}, 5)
        result = study.run({"seed": 0}, {"lr": 0.01}, 5)
        assert result.steps == 5 and "score" in result.metrics
        # Each failed executor was closed (what its start left), a new one made each time.
        assert len(made) == 3 and len(closed) >= 2
        assert study.run({"seed": 1}, {"lr": 0.01}, 3).steps == 3
    with Study("s", LinearTrainer, storage=url, executor="inline") as again:
        assert again.eval({"seed": 0}, {"lr": 0.01}, 5) == result.metrics
