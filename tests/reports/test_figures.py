"""One definition of each figure (issue 22, "numbers that add up"): ``Study.stats()``,
``Study.progress()``, the run report, ``stagetree status`` and the progress line agree
for each study of a storage, and the storage's totals add up."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study, cli
from stagetree.exceptions import StagetreeError, StorageError, TrialFailedError
from stagetree.hp import Constant
from stagetree.progress import ProgressDisplay, progress_line
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

# Counts are ints; seconds and ratios floats.
COUNTS = (
    "trials",
    "steps_requested",
    "steps_requested_finished",
    "steps_unique",
    "steps_executed",
    "ckpt_bytes",
    "live_splits",
    "splits_missed",
    "workers_lost",
    "steps_lost",
    "fused_jobs",
    "fused_members",
    "workers",
    "steps_unique_trained",
)


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/plan.db"


def _grid(*lrs: float, steps: int = 6) -> GridSearch:
    return GridSearch(GridSpace({"lr": [Constant(lr) for lr in lrs]}), "score", steps=steps)


def test_stats_counts_are_ints_and_seconds_floats(tmp_path: Path) -> None:
    with Study("s", LinearTrainer, storage=_url(tmp_path), executor="inline") as study:
        study.tune(_grid(0.01, 0.02))
        stats = study.stats()
        progress = study.progress()
    assert "efficiency" in stats
    for key, value in stats.items():
        want = int if key in COUNTS else float
        assert type(value) is want, (key, value)
    assert stats["trials"] == 2 and stats["steps_requested"] == 12
    for key in ("trials", "finished", "running", "pending", "failed"):
        assert type(progress[key]) is int, (key, progress[key])
    for key in ("steps_requested", "steps_executed"):
        assert type(progress[key]) is int, (key, progress[key])
    assert type(progress["elapsed"]) is float


def test_figures_read_from_the_storage_after_the_study_closed(tmp_path: Path) -> None:
    with Study("s", LinearTrainer, storage=_url(tmp_path), executor="inline") as study:
        study.tune(_grid(0.01, 0.02))
        stats, progress = study.stats(), study.progress()
        trials, best = study.trials(), study.best("score")
    after = study.stats()
    assert after == stats  # the run ended: nothing moves any more
    again = study.progress()
    assert {k: v for k, v in again.items() if k != "elapsed"} == {
        k: v for k, v in progress.items() if k != "elapsed"
    }
    assert study.trials() == trials
    assert study.best("score") == best
    assert study.failures() == []


def test_figures_of_a_closed_memory_study_say_they_are_gone() -> None:
    with Study("s", LinearTrainer, storage="memory://", executor="inline") as study:
        study.tune(_grid(0.01))
    for read in (study.stats, study.progress, study.trials, lambda: study.best("score")):
        with pytest.raises(StagetreeError, match=r"closed.*memory://.*gone") as raised:
            read()
        assert not isinstance(raised.value, StorageError)


def test_progress_counts_the_steps_of_its_own_study(tmp_path: Path) -> None:
    url = _url(tmp_path)
    with Study("a", LinearTrainer, storage=url, executor="inline") as a:
        a.tune(_grid(0.01, 0.02, steps=8))
    with Study("b", LinearTrainer, storage=url, executor="inline") as b:
        b.tune(_grid(0.03, 0.04, 0.05))
        stats, progress = b.stats(), b.progress()
        display = ProgressDisplay(b, out=io.StringIO(), rich_output=False)
        state = display.poll()
    assert stats["steps_executed"] == 18  # its own trials only
    assert progress["steps_executed"] == stats["steps_executed"]
    assert progress["device_seconds"] == pytest.approx(stats["device_seconds"])
    assert state is not None
    assert "steps 18 executed / 18 requested" in progress_line(state)


def _status(url: str, study: str) -> tuple[Any, str]:
    buf = io.StringIO()
    result = cli.status(url, study, out=buf, rich_output=False)
    return result, buf.getvalue()


def _report(study: Study) -> tuple[dict[str, float], str]:
    buf = io.StringIO()
    numbers = cli.report_study(study, study.best("score"), "score", out=buf, rich_output=False)
    return numbers, buf.getvalue()


def test_failed_trials_save_nothing(tmp_path: Path) -> None:
    url = _url(tmp_path)
    with Study("f", LinearTrainer, storage=url, executor="inline") as study:
        with pytest.raises(TrialFailedError):
            study.tune(_grid(2.0, 3.0))  # lr > 1 fails at the first step
        stats = study.stats()
        numbers, text = _report(study)
        display = ProgressDisplay(study, out=io.StringIO(), rich_output=False)
        state = display.poll()
    assert stats["steps_requested"] == 12 and stats["steps_executed"] == 0
    assert stats["steps_requested_finished"] == 0
    assert numbers["steps_saved"] == 0 and numbers["device_seconds_saved"] == 0
    assert re.search(r"steps saved: +0 \(0% of requested\)", text), text
    status, shown = _status(url, "f")
    assert re.search(r"steps saved: +0\b", shown), shown
    assert status.studies[0].numbers["steps_saved"] == 0
    assert status.totals["steps_saved"] == 0
    assert state is not None and state.saved == 0
    assert "saved 0 steps" in progress_line(state)
