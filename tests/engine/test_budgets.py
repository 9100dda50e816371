"""Budgets: ``Study.tune(tuner, budget=...)``, ``stagetree run --budget`` and resuming a
study a budget stopped."""

from __future__ import annotations

import logging
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer, SlowLinearTrainer

from stagetree import Budget, Study
from stagetree.cli import main
from stagetree.distributions import Choice, LogUniform
from stagetree.exceptions import InvalidBudgetError, LargeGridWarning
from stagetree.hp import Constant
from stagetree.space import GridSpace, RandomSpace
from stagetree.tuners import ASHA, GridSearch, RandomSearch, ReplayDivergedWarning
from stagetree.tuners.basic import GRID_WINDOW

SPACE = RandomSpace({"lr": LogUniform(0.001, 0.1)})
# Cheap simulated studies: the simulator's trainer reports "accuracy".
SIM_SPACE = RandomSpace({"lr": Choice([0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2])})


def asha(metric: str = "score", space: Any = SPACE) -> ASHA:
    return ASHA(space, metric, min_steps=1, max_steps=8, num_trials=8, eta=2, seed=1)


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", Budget(wall_seconds=1800)),
        ("2h", Budget(wall_seconds=7200)),
        ("90 s", Budget(wall_seconds=90)),
        ("1.5 hours", Budget(wall_seconds=5400)),
        ("500 steps", Budget(steps=500)),
        ("1 trial", Budget(trials=1)),
        ("20 trials", Budget(trials=20)),
        ("1h device", Budget(device_seconds=3600)),
        ("3600 device-seconds", Budget(device_seconds=3600)),
        ("10 device-minutes", Budget(device_seconds=600)),
        ("20 trials, 30m, 500 steps", Budget(trials=20, wall_seconds=1800, steps=500)),
    ],
)
def test_budget_short_forms(text: str, expected: Budget) -> None:
    assert Budget.parse(text) == expected


def test_budget_from_itself_and_a_mapping() -> None:
    budget = Budget(trials=50, device_seconds=3600, wall_seconds=1800, steps=10_000)
    assert Budget.parse(budget) is budget
    assert Budget.parse({"trials": 5, "steps": 100.0}) == Budget(trials=5, steps=100)
    assert budget.describe() == "50 trials, 10000 steps, 1h device time, 30m wall-clock"


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("0m", "must be > 0"),
        ("-5 steps", "steps must be > 0, got -5"),
        ("1h30m", "unknown unit 'h30m'"),
        ("30 parsecs", "unknown unit 'parsecs'"),
        ("30", "has no unit"),
        ("", "cannot read budget"),
        ("2 trials, 3 trials", "gives trials twice"),
        ("1.5 trials", "whole number"),
        (50, "a budget is a Budget"),
        ({"hours": 2}, "unknown budget limit(s) ['hours']"),
        ({}, "at least one limit"),
    ],
)
def test_budget_bad_input_names_the_problem(value: Any, needle: str) -> None:
    with pytest.raises(InvalidBudgetError, match=None) as info:
        Budget.parse(value)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_budget_fields_are_checked() -> None:
    with pytest.raises(InvalidBudgetError, match="steps must be > 0"):
        Budget(steps=0)
    with pytest.raises(InvalidBudgetError, match="wall_seconds must be > 0"):
        Budget(wall_seconds=float("nan"))
    with pytest.raises(InvalidBudgetError, match="trials must be a number"):
        Budget(trials=True)  # type: ignore[arg-type]


def test_bad_budget_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    db = tmp_path / "plan.db"
    study = Study("b", LinearTrainer, storage=f"sqlite:///{db}", executor="inline")
    with pytest.raises(InvalidBudgetError, match="unknown unit 'fortnights'"):
        study.tune(asha(), budget="2 fortnights")
    with pytest.raises(InvalidBudgetError, match="must be > 0"):
        study.tune(asha(), budget="0 steps")
    assert not db.exists()  # the storage was never opened
    study.close()


# --------------------------------------------------------------------------- tune


def test_trials_budget_finishes_the_trials_in_it(caplog: pytest.LogCaptureFixture) -> None:
    tuner = RandomSearch(SPACE, "score", steps=5, num_trials=6, seed=1, max_concurrent=2)
    with Study("t", LinearTrainer, storage="memory://", executor="inline") as study:
        with caplog.at_level(logging.WARNING, logger="stagetree"):
            best = study.tune(tuner, budget="3 trials")
        run = study.last_run
        trials = study.trials()
    assert run is not None
    assert run.stopped_by == "trials" and run.trials == 3 and run.steps_executed == 15
    # The three trials in the budget trained to the end; the fourth was never submitted.
    assert len(trials) == 3 and all(t.state == "done" and t.steps == 5 for t in trials)
    assert best is not None and best.steps == 5
    assert best.metrics["score"] == max(t.metrics[5]["score"] for t in trials)
    assert "stopped by its budget (3 trials: trials)" in caplog.text


def test_a_budget_stopped_study_resumes_where_it_stopped(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("r", LinearTrainer, storage=url, executor="inline") as study:
        first = study.tune(asha(), budget=Budget(trials=3))
        assert study.last_run is not None and study.last_run.stopped_by == "trials"
        steps_first = study.last_run.steps_executed
    assert first is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergedWarning)  # the replay follows the log
        with Study("r", LinearTrainer, storage=url, executor="inline") as study:
            best = study.tune(asha())
            run = study.last_run
            total = study.stats()["steps_executed"]
    assert run is not None and run.stopped_by is None and run.budget is None
    assert run.trials == 8 and run.trials_answered == 3
    with Study("ref", LinearTrainer, storage="memory://", executor="inline") as ref:
        expected = ref.tune(asha())
        ref_steps = ref.stats()["steps_executed"]
    # The same decisions and result as a run without a budget, and no step twice.
    assert best is not None and expected is not None
    assert best.hp == expected.hp and best.metrics == expected.metrics
    assert total == ref_steps and run.steps_executed == ref_steps - steps_first


def _simulated(name: str) -> Study:
    return Study(name, LinearTrainer, storage="memory://", executor="simulated", workers=2)


def _run_record(study: Study) -> dict[str, Any]:
    with study.reading() as storage:
        meta = next(s["meta"] for s in storage.studies() if s["name"] == study.name)
    run = meta["run"]
    assert isinstance(run, dict)
    return run


@pytest.mark.parametrize(
    ("budget", "reason"),
    [("10 steps", "steps"), ("12 device-seconds", "device_seconds"), ("10s", "wall_seconds")],
)
def test_resource_budgets_stop_a_simulated_study(budget: str, reason: str) -> None:
    with _simulated("full") as study:
        study.tune(asha("accuracy", SIM_SPACE))
        full = study.stats()["steps_executed"]
    with _simulated("s") as study:
        best = study.tune(asha("accuracy", SIM_SPACE), budget=budget)
        run = study.last_run
        record = _run_record(study)
        stats = study.stats()
    assert run is not None and run.stopped_by == reason
    limit = Budget.parse(budget)
    if reason == "steps":
        assert limit.steps is not None and run.steps_executed >= limit.steps
    elif reason == "device_seconds":
        assert limit.device_seconds is not None and run.device_seconds >= limit.device_seconds
    else:
        assert limit.wall_seconds is not None and run.wall_seconds >= limit.wall_seconds
    assert stats["steps_executed"] < full  # stopped before the tuner's end
    assert best is not None  # the best so far
    assert record["stopped_by"] == reason and record["budget"] == limit.describe()
    assert "ended" in record


def test_wall_clock_budget_cancels_running_work(tmp_path: Path) -> None:
    # 4 trials x 400 steps of 20 ms: about 30 s unstopped; stopped after 0.5 s.
    tuner = RandomSearch(SPACE, "score", steps=400, num_trials=4, seed=0)
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("w", SlowLinearTrainer, storage=url, executor="inline") as study:
        best = study.tune(tuner, budget="0.5s")
        run = study.last_run
        trials = study.trials()
    assert run is not None and run.stopped_by == "wall_seconds"
    assert run.wall_seconds < 20
    assert best is None  # nothing finished in time
    assert trials and all(t.state != "done" for t in trials)


# --------------------------------------------------------------------------- CLI

SCRIPT = """
from study_trainers import LinearTrainer
from stagetree import Study
from stagetree.distributions import LogUniform
from stagetree.space import RandomSpace
from stagetree.tuners import RandomSearch

open({marker!r}, "a").write("ran\\n")
space = RandomSpace({{"lr": LogUniform(0.001, 0.1)}})
tuner = RandomSearch(space, "score", steps=4, num_trials=5, seed=0, max_concurrent=1)
study = Study("cli", LinearTrainer, storage={url!r}, executor="inline")
"""


def _script(tmp_path: Path) -> tuple[Path, Path, str]:
    import study_trainers

    marker = tmp_path / "ran.txt"
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    path = tmp_path / "budget_study.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(Path(study_trainers.__file__).parent)!r})\n"
        + textwrap.dedent(SCRIPT.format(marker=str(marker), url=url))
    )
    return path, marker, url


def test_cli_run_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, marker, url = _script(tmp_path)
    assert main(["run", str(path), "--budget", "0m", "--no-progress"]) == 2
    assert "budget" in capsys.readouterr().err
    assert main(["run", str(path), "--budget", "3 lightyears"]) == 2
    assert "unknown unit 'lightyears'" in capsys.readouterr().err
    assert not marker.exists()  # refused before the script ran

    assert main(["run", str(path), "--budget", "2 trials", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "budget:" in out and "2 trials: stopped the run (trials reached)" in out
    assert "this run:" in out and "2 trials; trained 8 steps" in out
    assert main(["status", "--storage", url]) == 0
    assert "latest run:" in (out := capsys.readouterr().out)
    assert "stopped by its budget (2 trials: trials reached)" in out

    assert main(["run", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "5 trials, 2 found already trained; trained 12 steps" in out
    assert "budget:" not in out
    assert main(["status", "--storage", url]) == 0
    assert "stopped by its budget" not in capsys.readouterr().out  # that run finished


def test_a_remote_study_keeps_its_budget(tmp_path: Path) -> None:
    """A client of a tuning server runs the tuner here: the budget applies the same way."""
    # The server harness, from its own test folder.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from test_server import Server

    server = Server(tmp_path)
    server.start()
    try:
        tuner = RandomSearch(SPACE, "score", steps=3, num_trials=5, seed=2, max_concurrent=1)
        with server.study("remote") as study:
            best = study.tune(tuner, budget="2 trials")
            run = study.last_run
            trials = study.trials()
    finally:
        server.stop()
    assert run is not None and run.stopped_by == "trials" and run.trials == 2
    assert best is not None and len(trials) == 2


# --------------------------------------------------------------------------- huge grids


def test_a_wall_budget_on_a_huge_grid_trains_and_stops_promptly() -> None:
    # 10**9 points: a grid that was built or submitted whole would never start.
    options = [Constant(0.001 * (i + 1)) for i in range(1000)]
    many = list(range(1000))
    space = GridSpace({"lr": options}, fixed={"seed": many, "rep": many})
    with pytest.warns(LargeGridWarning, match=r"the grid has 1,000,000,000 trials"):
        tuner = GridSearch(space, "score", steps=2)
    study = Study("huge", LinearTrainer, storage="memory://", executor="inline", workers=1)
    with study:
        study.tune(tuner, budget=Budget(wall_seconds=0.5), progress=False)
        run = study.last_run
        assert run is not None and run.stopped_by == "wall_seconds"
        # The run started at once, a window at a time (a finished trial frees its slot
        # for the next grid point: at most one per two steps trained), and its stop is
        # recorded.
        finished = run.steps_executed // 2
        assert 0 < run.trials <= len(tuner.trials) <= GRID_WINDOW + finished
        assert study.stats()["steps_executed"] == run.steps_executed


def test_the_wall_budget_counts_from_the_start_of_tune(monkeypatch: pytest.MonkeyPatch) -> None:
    # What tune() does before the tuner starts (opening, starting workers) is in the
    # run's wall-clock: a start that takes the whole budget stops the run at once.
    study = Study("slowstart", LinearTrainer, storage="memory://", executor="inline")
    real = type(study)._ensure_started
    clock = study._run_clock()

    def slow_start(self: Study) -> None:
        real(self)
        deadline = clock.monotonic() + 0.3
        while clock.monotonic() < deadline:
            time.sleep(0.01)

    monkeypatch.setattr(type(study), "_ensure_started", slow_start)
    with study:
        study.tune(asha(), budget=Budget(wall_seconds=0.2), progress=False)
        run = study.last_run
        assert run is not None and run.stopped_by == "wall_seconds"
        assert run.wall_seconds >= 0.3
        assert run.steps_executed == 0


def test_the_run_counts_trials_answered_from_their_submission_without_a_look_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard learns whether the storage answered a trial from the submission's own
    look-up: no second walk of the plan per trial (issue 24)."""
    from stagetree.engine.core import Engine

    looked_up: list[int] = []
    known = Engine.known

    def counting(self: Engine, *args: Any) -> Any:
        looked_up.append(args[-1])
        return known(self, *args)

    monkeypatch.setattr(Engine, "known", counting)
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        study.tune(asha(), progress=False)
        first = study.last_run
    # The same trials, replayed; then another study's trials, trained by a study
    # sharing the plan.
    with Study("s", LinearTrainer, storage=url, executor="inline") as again:
        again.tune(asha(), progress=False)
        replayed = again.last_run
    space = GridSpace({"lr": [Constant(0.01), Constant(0.07)]}, fixed={"seed": [0, 1]})
    tuner = ASHA(space, "score", mode="max", min_steps=1, max_steps=4, eta=2, num_trials=4)
    with Study("t", LinearTrainer, storage=url, executor="inline") as other:
        other.tune(tuner, progress=False)
    with Study("u", LinearTrainer, storage=url, executor="inline") as other:
        other.tune(tuner, progress=False)
        shared = other.last_run
    assert first is not None and first.trials == 8 and first.trials_answered == 0
    assert replayed is not None and replayed.trials == replayed.trials_answered == 8
    assert shared is not None and shared.trials == shared.trials_answered == 4
    assert looked_up == []
