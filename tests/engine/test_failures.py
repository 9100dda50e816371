"""Every failure ends, and every failure is visible (issue: trust in the first hour).

No path retries forever: an unsaveable state, a trainer exception and a worker that dies
in the same stage each end, after the configured retries, in a failed trial whose
exception and traceback are in the plan and shown by ``TrialRecord``, ``status``,
``export``, the live display and ``stagetree run``.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
from failing_trainers import BadState, Counter, Dies, FailsSome, NoState, Raises, attempts

from stagetree import Study
from stagetree.cli import main, run_script
from stagetree.exceptions import StorageError, TrialFailedError
from stagetree.hp import Constant
from stagetree.plan.memory import MemoryPlanStorage

pytestmark = pytest.mark.timeout(120)


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'plan.db'}"


# --------------------------------------------------------------------------- no hangs


@pytest.mark.parametrize("executor", ["inline", "local"])
def test_trainer_without_state_dict_fails_instead_of_looping(tmp_path: Path, executor: str) -> None:
    with Study("s", NoState, storage=url(tmp_path), executor=executor, workers=1) as study:
        with pytest.raises(TrialFailedError, match=r"NoState\.state_dict\(\) is not implemented"):
            study.run({}, {"lr": 0.1}, 3)
        (trial,) = study.trials()
        assert trial.state == "failed" and trial.error is not None
        assert trial.error.type == "NotImplementedError"
        assert "checkpointing the model at step 3" in trial.error.where


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ("lock", r"state\['extra'\]\['lock'\]: cannot save a _thread.lock"),
        ("lambda", r"state\['extra'\]\['lambda'\]: cannot save a builtins.function"),
        ("set", r"state\['extra'\]\['set'\]: cannot save a builtins.set"),
        ("none", r"state_dict\(\) must return a dict of the training state, got NoneType"),
    ],
)
def test_unsaveable_state_fails_naming_the_key(tmp_path: Path, bad: str, named: str) -> None:
    with Study("s", BadState, storage=url(tmp_path), executor="inline", max_retries=2) as study:
        with pytest.raises(TrialFailedError, match=named):
            study.run({"bad": bad}, {"lr": 0.1}, 3)
        (trial,) = study.trials()
        assert trial.error is not None and trial.error.type == "CheckpointError"
        # nothing was written, and no checkpoint of the state is recorded
        assert study.state({"bad": bad}, {"lr": 0.1}, 3) is None


def test_trainer_exception_is_retried_then_fails(tmp_path: Path) -> None:
    log = str(tmp_path / "attempts")
    study = Study("s", Raises, storage=url(tmp_path), executor="inline", max_retries=2)
    with study, pytest.raises(TrialFailedError, match="boom at step 2") as info:
        study.run({"at": 2, "log": log}, {"lr": 0.1}, 5)
    assert attempts(log) == 3  # the first try and two retries, then it stops
    assert "training step 2" in str(info.value)
    assert "in train" in info.value.traceback  # the user's frame is in the traceback


@pytest.mark.parametrize("how", ["exit", "segv"])
def test_a_stage_that_kills_its_worker_fails_after_bounded_deaths(tmp_path: Path, how: str) -> None:
    log = str(tmp_path / "deaths")
    with Study("s", Dies, storage=url(tmp_path), workers=1) as study:
        with pytest.raises(TrialFailedError, match="WorkerLost") as info:
            study.run({"at": 2, "log": log, "how": how}, {"lr": 0.1}, 5)
        (trial,) = study.trials()
    assert attempts(log) == 3  # max_worker_deaths=2: the third death at this stage fails it
    reason = "killed by signal 11" if how == "segv" else "exited with code 3"
    assert reason in str(info.value)
    assert trial.error is not None and trial.error.type == "WorkerLost"


# --------------------------------------------------------------------------- visible


def _failing_grid_script(tmp_path: Path, limit: float) -> Path:
    script = tmp_path / "grid.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parents[1] / "fakes")!r})
            from failing_trainers import FailsSome
            from stagetree import Study
            from stagetree.hp import Constant
            from stagetree.space import GridSpace
            from stagetree.tuners import GridSearch

            space = GridSpace(hp={{"lr": [0.1, 0.2, 0.3]}}, fixed={{"limit": [{limit}]}})
            study = Study("grid", FailsSome, storage={url(tmp_path)!r}, workers=1)
            tuner = GridSearch(space, metric="w", steps=4)
            """
        )
    )
    return script


def test_run_shows_failures_as_they_happen_and_in_the_report(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_script(_failing_grid_script(tmp_path, 0.15), out=out) == 0  # one succeeded
    text = out.getvalue()
    summary = "FloatingPointError: lr 0.2 diverged (training step 2)"
    assert text.count(f"failed: {summary}") == 1  # announced once, as it happened
    assert text.count(summary) == 2  # and listed in the report
    assert "failed trials:        2" in text and "lr 0.3 diverged" in text


def test_run_exits_non_zero_with_the_traceback_when_every_trial_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "--no-progress", str(_failing_grid_script(tmp_path, 0.0))])
    err = capsys.readouterr().err
    assert code == 1
    assert "no trial of study 'grid' succeeded: 3 of 3 failed" in err
    assert "Traceback" in err and "in train" in err


def test_tune_raises_when_no_trial_succeeded(tmp_path: Path) -> None:
    from stagetree.space import GridSpace
    from stagetree.tuners import GridSearch

    space = GridSpace(hp={"lr": [0.1, 0.2]}, fixed={"limit": [0.0]})
    study = Study("g", FailsSome, storage=url(tmp_path), executor="inline")
    with study, pytest.raises(TrialFailedError, match="no trial of study 'g' succeeded") as info:
        study.tune(GridSearch(space, metric="w", steps=4))
    assert "FloatingPointError" in str(info.value) and "in train" in info.value.traceback


def test_status_and_export_show_each_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_script(_failing_grid_script(tmp_path, 0.15), out=io.StringIO()) == 0
    capsys.readouterr()
    assert main(["status", "--storage", url(tmp_path)]) == 0
    status = capsys.readouterr().out
    assert "1 finished, 0 running, 2 failed" in status
    assert "FloatingPointError: lr 0.2 diverged (training step 2)" in status

    assert main(["export", "--storage", url(tmp_path), "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    failed = [r for r in records if r["state"] == "failed"]
    assert sorted(r["error"] for r in failed) == [
        "FloatingPointError: lr 0.2 diverged (training step 2)",
        "FloatingPointError: lr 0.3 diverged (training step 2)",
    ]
    assert all(r["error"] is None for r in records if r["state"] == "done")
    with Study("grid", FailsSome, storage=url(tmp_path), executor="inline") as study:
        errors = [r.error for r in study.trials() if r.error is not None]
    assert all("in train" in e.traceback for e in errors)  # the traceback: on TrialRecord

    assert main(["export", "--storage", url(tmp_path), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    # the row of a failed trial (with its metrics up to the failure) carries the error
    assert sorted(r["error"] for r in rows if r["state"] == "failed") == [
        "FloatingPointError: lr 0.2 diverged (training step 2)",
        "FloatingPointError: lr 0.3 diverged (training step 2)",
    ]


def test_trial_record_error_is_cleared_when_the_trial_later_succeeds(tmp_path: Path) -> None:
    log = str(tmp_path / "attempts")
    config = {"at": 2, "log": log}
    with Study("s", Raises, storage=url(tmp_path), executor="inline") as study:
        with pytest.raises(TrialFailedError):
            study.run(config, {"lr": 0.1}, 5)
        assert study.trials()[0].error is not None
    # the same trial submitted to a fixed trainer (same root: pinned version) succeeds
    with Study("s", Counter, storage=url(tmp_path), executor="inline") as study:
        study.version = Study("x", Raises, storage="memory://").version
        study.run(config, {"lr": 0.1}, 5)
        (trial,) = study.trials()
        assert (trial.state, trial.error) == ("done", None)


# --------------------------------------------------------------------------- checkpoints


def test_a_corrupt_checkpoint_is_reported_once_and_recomputed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = url(tmp_path)
    with Study("s", Counter, storage=storage, executor="inline") as study:
        first = study.run({}, {"lr": 0.5}, 4)
        ckdir = study._engine.store.directory
    for path in Path(ckdir).glob("*.ckpt"):
        path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    with (
        caplog.at_level(logging.WARNING, logger="stagetree"),
        Study("s", Counter, storage=storage, executor="inline") as study,
    ):
        longer = study.run({}, {"lr": 0.5}, 8)
        assert study.state({}, {"lr": 0.5}, 8) is not None
    warnings = [r for r in caplog.records if "cannot be loaded" in r.getMessage()]
    assert len(warnings) == 1
    assert first.metrics == {"w": 2.0} and longer.metrics == {"w": 4.0}


def test_state_of_a_finished_trial_is_never_none(tmp_path: Path) -> None:
    """Regression: the request used to settle on its metrics, before its checkpoint was
    durable, so ``state()`` right after ``run()`` could find nothing."""
    with Study("s", Counter, storage=url(tmp_path), workers=2) as study:
        for i in range(12):
            hp: dict[str, Any] = {"lr": Constant(0.1 * (i + 1))}
            study.run({}, hp, 3 + i % 4)
            assert study.state({}, hp, 3 + i % 4) is not None, i


class _MetricsLost(MemoryPlanStorage):
    """A plan storage that cannot store metrics."""

    def put_metrics_many(self, items: Any) -> None:
        raise StorageError("metrics table on fire")


def test_an_engine_that_stops_on_an_error_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """Found by benchmarks/chaos.py: an engine whose driver thread stopped on an error
    failed its waiting trials and logged nothing; a tuner that counts them as failed
    trials went on, and the cause was nowhere to be seen."""
    caplog.set_level(logging.ERROR, logger="stagetree")
    study = Study("broken", Counter, storage=_MetricsLost(), executor="inline")
    with study, pytest.raises(TrialFailedError, match="engine failed"):
        study.run({}, {"lr": Constant(0.1)}, 3)
    assert "the study engine stopped on an error" in caplog.text
    assert "metrics table on fire" in caplog.text
