"""Trials submitted together are planned together, however long each insertion takes
(issue 23: the gc tests' plans differed under load).

The driver used to plan what had arrived once no submission came for 20 ms: on a loaded
machine a tuner's rung arrived in pieces, the first trial was planned alone, and which
checkpoints the plan held depended on the load. ``Study.submit`` now announces the
submissions of one pass of its event loop as a burst, planned once all of it arrived.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.engine import core
from stagetree.hp import Constant, MultiStep
from stagetree.plan import open_storage
from stagetree.space import GridSpace
from stagetree.tuners import ASHA, GridSearch

pytestmark = pytest.mark.timeout(120)

# One plan tree: Constant(0.05) is the root path; the MultiSteps branch off it at steps
# 5 and 10; Constant(0.02) branches at 0.
LRS = [Constant(0.05), MultiStep(0.05, [5], 0.5), MultiStep(0.05, [10], 0.5), Constant(0.02)]
SPACE = GridSpace({"lr": LRS}, fixed={"seed": [1]})


def test_a_rung_inserted_slowly_is_planned_as_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        engine = study._engine
        insert = engine._insert_path

        def slow_insert(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.1)  # a loaded machine: longer than the driver's quiet window
            return insert(*args, **kwargs)

        engine._insert_path = slow_insert  # type: ignore[method-assign]
        study.tune(GridSearch(SPACE, steps=20, metric="score"))
    with open_storage(url) as plan:
        checkpoints = set(plan.checkpoints())
        first = next(a for a in plan.activity() if a.kind == "start")
    # Planned as one: the root path is trained once, split where the trials branch
    # (5 and 10); each trial's end is kept, nothing else.
    assert first.data["segments"] == [[1, 0, 5], [1, 5, 10], [1, 10, 20]]
    assert checkpoints == {(1, 5), (1, 10), (1, 20), (2, 20), (3, 20), (4, 20)}


@pytest.mark.timeout(60)
def test_a_waiting_tuner_is_planned_without_the_quiet_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: a tuner that submitted and now waits for its results has nothing more
    to add, so its trials are planned at once (not after the quiet window: here an
    hour, longer than the test's timeout)."""
    monkeypatch.setattr(core, "_QUIET", 3600.0)
    monkeypatch.setattr(core, "_MAX_DELAY", 3600.0)
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    tuner = ASHA(SPACE, "score", min_steps=2, max_steps=8, num_trials=4, eta=2)
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        best = study.tune(tuner)
    assert best is not None
    assert len(study.trials()) == 4
