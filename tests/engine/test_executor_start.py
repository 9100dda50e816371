"""A failed executor start leaves the engine able to start again (issue 23, item 3).

The engine counts as started only once its executor's ``start()`` returned: the next
call after a failed start (a cluster with no room, a timeout) makes a new executor and
tries again, instead of driving the failed one (which hung or failed every later call).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flaky_executor import flaky_factory
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.exceptions import ExecutorError

pytestmark = pytest.mark.timeout(60)


def test_a_failed_start_is_tried_again_by_the_next_run(tmp_path: Path) -> None:
    factory = flaky_factory(["no room on the cluster", "still no room"], tmp_path / "ck")
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Study("s", LinearTrainer, storage=url, executor=factory) as study:
        with pytest.raises(ExecutorError, match="no room on the cluster"):
            study.run({"seed": 0}, {"lr": 0.01}, 5)
        with pytest.raises(ExecutorError, match="still no room"):
            study.run({"seed": 0}, {"lr": 0.01}, 5)
        result = study.run({"seed": 0}, {"lr": 0.01}, 5)
        assert result.steps == 5 and "score" in result.metrics
        # Each failed executor was closed (what its start left), a new one made each time.
        assert len(factory.made) == 3 and len(factory.closed) >= 2
        assert study.run({"seed": 1}, {"lr": 0.01}, 3).steps == 3
    with Study("s", LinearTrainer, storage=url, executor="inline") as again:
        assert again.eval({"seed": 0}, {"lr": 0.01}, 5) == result.metrics
