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


def _figures(study: Study, url: str) -> dict[str, dict[str, float]]:
    """The figures of ``study`` as each reader shows them (the study is open)."""
    stats, progress = study.stats(), study.progress()
    numbers, _ = _report(study)
    shown, _ = _status(url, study.name)
    (st,) = shown.studies
    assert st.numbers is not None
    state = ProgressDisplay(study, out=io.StringIO(), rich_output=False).poll()
    assert state is not None
    return {
        "stats": stats,
        "progress": progress,
        "report": numbers,
        "status": {
            "trials": st.trials,
            "failed": st.failed,
            "steps_requested": st.steps_requested,
            "steps_unique": st.steps_unique,
            **st.numbers,
        },
        "line": {
            "trials": state.trials,
            "failed": state.failed,
            "steps_requested": state.steps_requested,
            "steps_executed": state.steps_executed,
            "steps_saved": state.saved,
            "device_seconds": state.device_seconds,
        },
    }


def _agree(figures: dict[str, dict[str, float]]) -> dict[str, float]:
    """Every reader that shows a figure shows the same value; returns them."""
    agreed: dict[str, float] = {}
    for key in (
        "trials",
        "failed",
        "steps_requested",
        "steps_unique",
        "steps_executed",
        "steps_saved",
        "device_seconds",
    ):
        values = {reader: got[key] for reader, got in figures.items() if key in got}
        first = next(iter(values.values()))
        for value in values.values():
            assert value == pytest.approx(first, rel=1e-9, abs=1e-9), (key, values)
        agreed[key] = first
    return agreed


def test_two_studies_on_one_storage_agree_everywhere_and_add_up(tmp_path: Path) -> None:
    url = _url(tmp_path)
    with Study("f", LinearTrainer, storage=url, executor="inline") as failing:
        failing.tune(_grid(0.01, 0.02, 2.0))  # lr 2.0 fails at its first step
        f = _agree(_figures(failing, url))
    with Study("r", LinearTrainer, storage=url, executor="inline") as resumed:
        resumed.tune(_grid(0.03, 0.04, 0.05, 0.06), budget="10 steps")
        assert resumed.last_run is not None and resumed.last_run.stopped_by is not None
        stopped = _agree(_figures(resumed, url))
        resumed.tune(_grid(0.03, 0.04, 0.05, 0.06))  # resumed: goes on where it stopped
        r = _agree(_figures(resumed, url))
    assert (f["trials"], f["failed"], f["steps_requested"]) == (3, 1, 18)
    assert f["steps_executed"] == f["steps_unique"] - 6 == 12  # the failed trial: none
    assert f["steps_saved"] == 0  # 12 finished - 12 executed: nothing shared
    assert stopped["steps_executed"] <= stopped["steps_unique"]
    assert (r["trials"], r["failed"], r["steps_requested"]) == (4, 0, 24)
    assert r["steps_executed"] == r["steps_unique"] == 24  # never a step twice
    assert r["steps_saved"] == 0
    # After the studies closed: the stored figures, the same.
    for study, want in ((failing, f), (resumed, r)):
        stats = study.stats()
        for key in ("trials", "steps_requested", "steps_unique", "steps_executed"):
            assert stats[key] == want[key], key
    # The storage's totals: the sums of the studies (nothing shared between them).
    shown, _ = _status(url, None)
    totals = shown.totals
    assert shown.trials == f["trials"] + r["trials"]
    for key in ("steps_requested", "steps_unique", "steps_executed", "steps_saved"):
        assert totals[key] == f[key] + r[key], key
    # Device-seconds: the workers' busy time, each batch's charged to the studies whose
    # steps it trained.
    assert totals["device_seconds"] == pytest.approx(f["device_seconds"] + r["device_seconds"])


def test_a_runs_device_seconds_read_no_plan_tree(tmp_path: Path, monkeypatch: Any) -> None:
    """What a run's budget reads of the device seconds at its start and end is
    ``Study.stats()["device_seconds"]``, from the counters alone: no plan tree is read
    (it read every node of the study's trees twice a run: seconds for a resumed study of
    100,000 trials)."""
    from stagetree.plan.sql import SQLPlanStorage

    with Study("s", LinearTrainer, storage=_url(tmp_path), executor="inline") as study:
        study.tune(_grid(0.01, 0.02, 0.03))
        trees: list[Any] = []
        nodes = SQLPlanStorage.nodes

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            trees.append(args)
            return nodes(self, *args, **kwargs)

        monkeypatch.setattr(SQLPlanStorage, "nodes", counted)
        seconds = study._device_seconds()
        assert trees == []
        monkeypatch.undo()
        assert seconds > 0 and seconds == pytest.approx(study.stats()["device_seconds"])
