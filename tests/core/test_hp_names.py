"""Hyper-parameter names that reach the trainer (:mod:`stagetree.names`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from stagetree import Study, Trainer
from stagetree.exceptions import InvalidTrialError, TrialFailedError, UnreadHyperparameterWarning
from stagetree.hp import Constant
from stagetree.names import accepted_hyperparameters, check_hp_names, did_you_mean
from stagetree.plan import open_storage
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch


class Plain(Trainer):
    """Reads ``lr`` only; declares nothing."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.w = 0.0
        self.lr = 0.01

    def setup(self, hp: Mapping[str, Any]) -> None:
        if "lr" in hp:
            self.lr = hp["lr"]

    def train(self) -> None:
        self.w += self.lr

    def evaluate(self) -> Any:
        return {"w": self.w}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "lr": self.lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = state["w"]
        self.lr = state["lr"]


class Declared(Plain):
    hyperparameters = frozenset({"lr", "momentum"})


class Peeks(Plain):
    """Reads only ``lr`` and never looks at anything else."""

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = hp["lr"]


def _study(tmp_path: Path, trainer: type[Trainer], name: str = "s") -> Study:
    url = f"sqlite:///{tmp_path / 'names.db'}"
    return Study(name, trainer, storage=url, executor="inline")


def _trial_rows(tmp_path: Path, name: str = "s") -> list[dict[str, Any]]:
    storage = open_storage(f"sqlite:///{tmp_path / 'names.db'}")
    try:
        return storage.trials(name)
    finally:
        storage.close()


def test_accepted_names_follow_the_class_that_defines_setup() -> None:
    torch_trainer = pytest.importorskip("stagetree.torch").TorchTrainer
    assert accepted_hyperparameters(Plain) is None
    assert accepted_hyperparameters(Declared) == {"lr", "momentum"}
    assert "lr" in accepted_hyperparameters(torch_trainer)  # type: ignore[operator]
    assert "batch_size" in accepted_hyperparameters(torch_trainer)  # type: ignore[operator]

    class NoSetup(torch_trainer):  # type: ignore[misc, valid-type]
        pass

    class OwnSetup(torch_trainer):  # type: ignore[misc, valid-type]
        def setup(self, hp: Mapping[str, Any]) -> None:
            super().setup(hp)

    class OwnSetupDeclared(OwnSetup):
        hyperparameters = torch_trainer.hyperparameters | {"dropout"}

    assert accepted_hyperparameters(NoSetup) == torch_trainer.hyperparameters
    assert accepted_hyperparameters(OwnSetup) is None
    assert accepted_hyperparameters(OwnSetupDeclared) == torch_trainer.hyperparameters | {"dropout"}


def test_did_you_mean() -> None:
    assert did_you_mean("lrx", ["lr", "momentum"]) == "lr"
    assert did_you_mean("learning_rate", ["lr", "momentum"]) == "lr"
    assert did_you_mean("momentun", ["lr", "momentum"]) == "momentum"
    assert did_you_mean("zzz", ["lr", "momentum"]) is None
    with pytest.raises(InvalidTrialError, match=r"'lrx' \(did you mean 'lr'\?\)"):
        check_hp_names(Declared, ["lrx"])
    check_hp_names(Plain, ["anything"])  # undeclared: accepted


def test_typo_in_submit_is_rejected_before_anything_is_written(tmp_path: Path) -> None:
    with _study(tmp_path, Declared) as study:
        with pytest.raises(InvalidTrialError, match=r"'lrx' \(did you mean 'lr'\?\)") as info:
            study.run({}, {"lrx": 0.1}, 3)
        assert "accepts ['lr', 'momentum']" in str(info.value)
        with pytest.raises(InvalidTrialError, match="did you mean 'lr'"):
            study.declare([({}, {"lrx": 0.1})])
    assert _trial_rows(tmp_path) == []


@pytest.mark.parametrize("query", ["eval", "state"])
def test_typo_in_eval_or_state(tmp_path: Path, query: str) -> None:
    # Declared names: rejected outright.
    with _study(tmp_path, Declared) as study, pytest.raises(InvalidTrialError, match="lrx"):
        getattr(study, query)({}, {"lrx": 0.1}, 3)
    # Undeclared: a query on an empty study answers None and defines nothing, so a
    # correct submission afterwards goes through.
    with _study(tmp_path, Plain, "p") as study:
        assert getattr(study, query)({}, {"lrx": 0.1}, 3) is None
        assert study.run({}, {"lr": 0.1}, 3).metrics["w"] == pytest.approx(0.3)
        # Now the study knows its names: a typo is named, with a suggestion.
        with pytest.raises(InvalidTrialError, match=r"unexpected hp names \['lrx'\] \(did you"):
            getattr(study, query)({}, {"lrx": 0.1}, 3)
    rows = _trial_rows(tmp_path, "p")
    assert [sorted(r["hp"]) for r in rows] == [["lr"]]


def test_grid_space_with_a_name_torch_trainer_does_not_apply(tmp_path: Path) -> None:
    examples = pytest.importorskip("stagetree.torch.examples")
    space = GridSpace({"learning_rate": [Constant(0.1), Constant(0.05)]})
    tuner = GridSearch(space, metric="accuracy", steps=2)
    study = _study(tmp_path, examples.DigitsTrainer)
    with study, pytest.raises(InvalidTrialError) as info:
        study.tune(tuner)
    message = str(info.value)
    assert "'learning_rate' (did you mean 'lr'?)" in message
    assert "DigitsTrainer does not apply" in message
    assert "hyperparameters = TorchTrainer.hyperparameters | {'learning_rate'}" in message
    assert _trial_rows(tmp_path) == []


def test_unread_sequence_of_a_plain_trainer_is_warned_once(tmp_path: Path) -> None:
    with _study(tmp_path, Peeks) as study:
        with pytest.warns(UnreadHyperparameterWarning, match=r"\['lrx'\].*did you mean 'lr'"):
            study.run({}, {"lr": 0.1, "lrx": 0.2}, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnreadHyperparameterWarning)
            study.run({}, {"lr": 0.2, "lrx": 0.2}, 2)  # reported once per process
    with _study(tmp_path, Peeks, "ok") as study, warnings.catch_warnings():
        warnings.simplefilter("error", UnreadHyperparameterWarning)
        study.run({"seed": 1}, {"lr": 0.1}, 2)  # another tree: another name set


def test_a_typo_alone_is_warned_with_the_name_setup_asked_for(tmp_path: Path) -> None:
    study = _study(tmp_path, Plain)  # setup: `if "lr" in hp`, so lrx is ignored
    with study, pytest.warns(UnreadHyperparameterWarning) as record:
        result = study.run({}, {"lrx": 0.5}, 2)
    assert result.metrics["w"] == pytest.approx(0.02)  # trained with the default lr
    message = str(record[0].message)
    assert "['lrx']" in message and "it asked for ['lr']" in message
    assert "did you mean 'lr'?" in message


@pytest.mark.parametrize(
    ("value", "kind"),
    [([1.0], "builtins.list"), (0.5, "builtins.float"), (None, "builtins.NoneType")],
)
def test_evaluate_returning_no_dict_fails_the_trial_clearly(
    tmp_path: Path, value: Any, kind: str
) -> None:
    class BadEvaluate(Plain):
        def evaluate(self) -> Any:
            return value

    with _study(tmp_path, BadEvaluate) as study, pytest.raises(TrialFailedError) as info:
        study.run({}, {"lr": 0.1}, 2)
    assert "BadEvaluate.evaluate() must return a dict of numbers" in str(info.value)
    assert f"got {kind}" in str(info.value)


def test_evaluate_with_a_metric_that_is_no_number(tmp_path: Path) -> None:
    class BadMetric(Plain):
        def evaluate(self) -> Any:
            return {"w": "high"}

    with _study(tmp_path, BadMetric) as study, pytest.raises(TrialFailedError) as info:
        study.run({}, {"lr": 0.1}, 2)
    assert "metric 'w' is str: 'high'" in str(info.value)
