"""What can be told without training stops a run before any worker starts or any step
trains: a trainer without ``state_dict``, a metric the trainer never returns, a
misspelt fixed configuration name; through ``study.tune()`` (from what the trainer
declares) and through ``stagetree run`` (from the first-contact check as well)."""

from __future__ import annotations

import multiprocessing
import os
import re
import textwrap
from pathlib import Path

import pytest
import study_trainers
from study_trainers import DeclaredNoState, DeclaredTrainer

from stagetree.cli import main
from stagetree.exceptions import InvalidTrialError, TrainerError, TunerError
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.tuners import GridSearch

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file every process that trains a step appends its id to."""
    path = tmp_path / "trained.txt"
    monkeypatch.setenv("STAGETREE_TEST_TRAINED", str(path))
    return path


def _pids(path: Path) -> set[int]:
    return {int(line) for line in path.read_text().split()} if path.exists() else set()


def _space(**fixed: list[object]) -> GridSpace:
    return GridSpace({"lr": [Constant(0.01), Constant(0.02)]}, fixed=fixed or {"width": [2]})


@pytest.mark.parametrize(
    ("trainer", "space", "metric", "error", "named"),
    [
        (DeclaredNoState, _space(), "score", TrainerError, r"DeclaredNoState does not implement "),
        (DeclaredTrainer, _space(), "acc", TunerError, r"metric 'acc' is not among.*'score'"),
        (
            DeclaredTrainer,
            _space(widht=[2]),
            "score",
            InvalidTrialError,
            r"fixed hyper-parameter\(s\) 'widht' \(did you mean 'width'\?\)",
        ),
    ],
    ids=["no-state_dict", "unknown-metric", "config-typo"],
)
def test_tune_refuses_what_the_trainer_declares_before_any_worker_starts(
    tmp_path: Path,
    trained: Path,
    trainer: type,
    space: GridSpace,
    metric: str,
    error: type[Exception],
    named: str,
) -> None:
    before = set(multiprocessing.active_children())
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("ff", trainer, storage=url, executor="local", workers=1) as study:
        with pytest.raises(error, match=named):
            study.tune(GridSearch(space, metric, steps=3), progress=False)
        assert set(multiprocessing.active_children()) <= before  # no worker started
        assert study.stats()["steps_executed"] == 0
    assert not trained.exists()  # nothing trained anywhere


TRAINER_SCRIPT = """
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.tuners import GridSearch
from study_trainers import {trainer}

space = GridSpace({{"lr": [Constant(0.01), Constant(0.02)]}}, fixed={fixed})
study = Study("ff", {trainer}, storage={url!r}, executor="local", workers=1)
tuner = GridSearch(space, metric={metric!r}, steps=3)
"""


@pytest.mark.parametrize(
    ("trainer", "fixed", "metric", "named"),
    [
        ("RecordingNoState", {"width": [2]}, "score", r"RecordingNoState does not implement"),
        (
            "RecordingTrainer",
            {"width": [2]},
            "acc",
            r"metric 'acc' is not among the metrics RecordingTrainer returns: \['loss', "
            r"'score'\]",
        ),
        (
            "RecordingTrainer",
            {"widht": [2]},
            "score",
            r"RecordingTrainer fails on the first trial .*nothing was trained.*KeyError: 'width'",
        ),
    ],
    ids=["no-state_dict", "unknown-metric", "config-typo"],
)
def test_run_stops_on_what_the_first_contact_check_knows(
    tmp_path: Path,
    trained: Path,
    capsys: pytest.CaptureFixture[str],
    trainer: str,
    fixed: dict[str, list[int]],
    metric: str,
    named: str,
) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    path = tmp_path / "ff_study.py"
    text = TRAINER_SCRIPT.format(trainer=trainer, fixed=fixed, metric=metric, url=url)
    path.write_text(textwrap.dedent(text))
    assert main(["run", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stagetree run: error: ")
    assert re.search(named, " ".join(err.split())), err
    assert _pids(trained) <= {os.getpid()}  # only the check trained, in this process
    cls = getattr(study_trainers, trainer)
    with Study("ff", cls, storage=url, executor="inline") as again:
        assert again.stats()["steps_executed"] == 0
