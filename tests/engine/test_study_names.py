"""A study with other hyper-parameter names is its own study (issue 25): on the same
storage, trainer and fixed config, renaming or adding a hyper-parameter gives the
trials a plan tree of their own, without an error; the names check against the
trainer's declared ``hyperparameters`` stays."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from study_trainers import DeclaredTrainer, LinearTrainer

from stagetree import Study
from stagetree.cli import plan_trials
from stagetree.exceptions import InvalidTrialError, UnreadHyperparameterWarning
from stagetree.hp import Constant, MultiStep
from stagetree.plan import open_storage
from stagetree.space import TrialSpec

CONFIG = {"seed": 1}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # LinearTrainer reads lr only
        warnings.simplefilter("ignore", UnreadHyperparameterWarning)
        yield


def _study(url: str, name: str, trainer: type = LinearTrainer) -> Study:
    return Study(name, trainer, storage=url, executor="inline")


def test_renamed_and_added_names_are_studies_of_their_own(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with _study(url, "first") as first:
        before = first.run(CONFIG, {"lr": 0.05}, 4).metrics
        base = first.root_key(CONFIG)
    with _study(url, "renamed") as renamed:
        renamed.run(CONFIG, {"learning_rate": 0.05}, 4)
        assert renamed.stats()["steps_executed"] == 4  # nothing shared with "lr"
    with _study(url, "added") as added:
        added.run(CONFIG, {"lr": 0.05, "momentum": 0.9}, 4)
        assert added.stats()["steps_executed"] == 4
    plan = open_storage(url)
    keys = {t["root_key"] for s in ("first", "renamed", "added") for t in plan.trials(s)}
    assert len(keys) == 3 and base in keys  # the first study's tree stays where it was
    assert {plan.tree_names(k) for k in keys} == {
        ("lr",),
        ("learning_rate",),
        ("lr", "momentum"),
    }
    plan.close()
    with _study(url, "first") as again:  # found again, nothing trained
        assert again.run(CONFIG, {"lr": 0.05}, 4).metrics == before
        assert again.run(CONFIG, {"lr": 0.05}, 4).metrics == before
    with _study(url, "added2") as other:  # a second study of the added names shares
        other.run(CONFIG, {"lr": 0.05, "momentum": 0.9}, 4)
        assert other.stats()["steps_executed"] == 0


def test_the_declared_names_check_stays(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    config = {"seed": 1, "width": 2}
    with _study(url, "first", DeclaredTrainer) as first:
        first.run(config, {"lr": 0.05}, 2)
    with (
        _study(url, "second", DeclaredTrainer) as second,
        pytest.raises(InvalidTrialError, match="did you mean 'lr'"),
    ):
        second.run(config, {"learning_rate": 0.05}, 2)


def test_a_study_keeps_one_name_set(tmp_path: Path) -> None:
    with _study(f"sqlite:///{tmp_path / 'p.db'}", "s") as study:
        study.run(CONFIG, {"lr": 0.05}, 2)
        with pytest.raises(InvalidTrialError, match="momentum"):
            study.run(CONFIG, {"lr": 0.05, "momentum": 0.9}, 2)


def test_explain_plans_each_name_set_apart() -> None:
    trials = [
        TrialSpec({}, {"lr": Constant(0.1)}),
        TrialSpec({}, {"lr": MultiStep(0.1, [5], 0.1)}),
        TrialSpec({}, {"learning_rate": Constant(0.1)}),
    ]
    result = plan_trials(trials, 10)
    assert len(result.root_keys) == 2
    assert result.summary.total_steps == 30 and result.summary.unique_steps == 25
