"""Tests of :func:`stagetree.check_trainer` and ``stagetree check``."""

from __future__ import annotations

import random
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stagetree
from stagetree import CheckReport, Trainer, check_trainer
from stagetree.cli import main
from stagetree.exceptions import TrainerError
from stagetree.hp import Constant, MultiStep

torch = pytest.importorskip("torch")

HP = {"lr": MultiStep(0.1, [2], 0.5)}


class TinyTorch(Trainer):
    """A plain trainer: a small MLP with dropout on random data. ``rng`` in the config
    says whether the global torch RNG is part of the state (then it is exact)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        torch.manual_seed(int(config.get("seed", 0)))
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 8, generator=gen)
        self.y = torch.randn(64, 1, generator=gen)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def setup(self, hp: Mapping[str, Any]) -> None:
        for group in self.opt.param_groups:
            group["lr"] = hp["lr"]

    def train(self) -> dict[str, float]:
        self.model.train()
        loss = ((self.model(self.x) - self.y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"loss": loss.item()}

    def evaluate(self) -> dict[str, float]:
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            mse = ((self.model(self.x) - self.y) ** 2).mean().item()
        self.model.train(training)
        return {"mse": mse}

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict()}
        if self.config.get("rng"):
            state["rng"] = torch.get_rng_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        if "rng" in state:
            torch.set_rng_state(state["rng"])


def test_exported() -> None:
    assert {"check_trainer", "CheckReport"} <= set(stagetree.__all__)
    assert all(hasattr(stagetree, name) for name in stagetree.__all__)


def test_torch_trainer_is_exact() -> None:
    from stagetree.torch.examples import DigitsTrainer

    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    report = check_trainer(DigitsTrainer, {"hidden": 16, "batches_per_step": 2}, HP, 4)
    assert report.exact, report.format()
    assert report.first_divergence is None and report.findings == ()
    assert report.splits == (1, 2, 3)
    assert [c.step for c in report.comparisons] == [1, 2, 3, 4]
    assert all(c.same for c in report.comparisons)
    assert "EXACT" in report.format()
    # The caller's global RNGs are left as they were.
    assert torch.equal(before[0], torch.get_rng_state())
    assert np.array_equal(before[1], np.random.get_state()[1])
    assert before[2] == random.getstate()


def test_plain_trainer_with_global_rng_in_its_state_is_exact() -> None:
    report = check_trainer(TinyTorch, {"rng": True}, HP, 4)
    assert report.exact, report.format()


def test_dropout_on_the_global_torch_rng_is_diagnosed() -> None:
    report = check_trainer(TinyTorch, {}, HP, 4)
    assert not report.exact
    assert report.first_divergence == 2  # restored at step 1, step 2 draws other masks
    assert report.comparisons[0].same and not report.comparisons[1].same
    rng = [f for f in report.findings if "global torch RNG" in f]
    assert rng and "restore at step 1" in rng[0] and "torch.get_rng_state()" in rng[0]
    assert not any("numpy" in f or "python" in f for f in report.findings)
    assert any("state['model']['0.weight']" in f for f in report.findings)
    text = report.format()
    assert "NOT EXACT: first difference at step 2" in text and "<- differs" in text


class EvalLeavesEvalMode(TinyTorch):
    """evaluate() leaves dropout off; train() does not switch it back on."""

    def train(self) -> dict[str, float]:
        loss = ((self.model(self.x) - self.y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"loss": loss.item()}

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        with torch.no_grad():
            return {"mse": ((self.model(self.x) - self.y) ** 2).mean().item()}


def test_evaluate_changing_the_mode_is_diagnosed() -> None:
    report = check_trainer(EvalLeavesEvalMode, {"rng": True}, HP, 3)
    assert not report.exact
    trace = [f for f in report.findings if f.startswith("evaluate() leaves a trace")]
    assert trace and "model (train/eval mode)" in trace[0], report.format()


class EvalDraws(TinyTorch):
    """evaluate() draws from the global torch RNG, which is in the state."""

    def evaluate(self) -> dict[str, float]:
        noise = torch.rand(1).item()
        return {"mse": super().evaluate()["mse"] + 0.0 * noise}


def test_evaluate_drawing_from_a_global_rng_is_diagnosed() -> None:
    report = check_trainer(EvalDraws, {"rng": True}, HP, 3)
    assert not report.exact
    trace = [f for f in report.findings if f.startswith("evaluate() leaves a trace")]
    assert trace, report.format()
    assert "state['rng']" in trace[0]
    assert "global torch RNG" in trace[0]


class Counter(Trainer):
    """numpy least squares; ``extra`` in the config goes into the state as is."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.w = np.zeros(3)
        self.lr = 0.0

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = hp["lr"]

    def train(self) -> None:
        self.w = self.w + self.lr

    def evaluate(self) -> Any:
        return {"w": float(self.w.sum())}

    def state_dict(self) -> Any:
        return {"w": self.w, "sched": {"fn": self.config["extra"]}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = state["w"]


@pytest.mark.parametrize(
    ("extra", "kind"), [({1, 2}, "builtins.set"), (lambda t: t, "builtins.function")]
)
def test_unsaveable_state_is_named_by_its_path(extra: Any, kind: str) -> None:
    class WithExtra(Counter):
        def state_dict(self) -> Any:
            return {"w": self.w, "sched": {"fn": extra}}

    report = check_trainer(WithExtra, {"extra": 0}, {"lr": 0.5}, 3)
    assert not report.exact
    assert report.first_divergence == 1
    text = report.findings[0]
    assert "state['sched']['fn']" in text and kind in text, text
    assert "cannot be written as a stagetree checkpoint" in text


def test_state_dict_returning_none() -> None:
    class NoState(Counter):
        def state_dict(self) -> Any:
            return None

    report = check_trainer(NoState, {"extra": 0}, {"lr": 0.5}, 2)
    assert not report.exact
    assert "state_dict() returned None" in report.findings[0]


def test_load_state_dict_that_forgets_a_key() -> None:
    class Forgets(Counter):
        def state_dict(self) -> Any:
            return {"w": self.w.copy(), "lr": self.lr}

        def load_state_dict(self, state: Mapping[str, Any]) -> None:
            self.w = np.zeros(3)  # forgets everything

    report = check_trainer(Forgets, {}, {"lr": 0.5}, 3)
    assert not report.exact
    assert any(
        "load_state_dict() does not restore" in f and "state['w']" in f for f in report.findings
    ), report.format()


class NumpyNoise(Counter):
    """Draws from numpy's and python's global RNGs in train(); neither is in the state."""

    def train(self) -> None:
        source = self.config["source"]
        noise = np.random.normal() if source == "numpy" else random.random()
        self.w = self.w + self.lr * noise

    def state_dict(self) -> Any:
        return {"w": self.w.copy(), "lr": self.lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = state["w"]
        self.lr = state["lr"]


@pytest.mark.parametrize(("source", "label"), [("numpy", "numpy's"), ("python", "python's")])
def test_other_global_rngs_are_named(source: str, label: str) -> None:
    report = check_trainer(NumpyNoise, {"source": source}, {"lr": 0.5}, 3)
    assert not report.exact and report.first_divergence == 2
    rng = [f for f in report.findings if "a restore does not bring it back" in f]
    assert len(rng) == 1 and label in rng[0], report.format()


def test_unseeded_init_is_diagnosed() -> None:
    class Unseeded(TinyTorch):
        def __init__(self, config: Mapping[str, Any]) -> None:
            Trainer.__init__(self, config)
            self.x, self.y = torch.ones(16, 8), torch.zeros(16, 1)
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 1))
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    report = check_trainer(Unseeded, {}, HP, 2)
    assert not report.exact and report.first_divergence == 0
    assert any(
        f.startswith("__init__ is not deterministic") and "state['model']['0.weight']" in f
        for f in report.findings
    ), report.format()


def test_nondeterministic_training_is_reported_as_such() -> None:
    class Entropy(Counter):
        def train(self) -> None:
            self.w = self.w + np.random.default_rng().normal(size=3)  # OS entropy

        def state_dict(self) -> Any:
            return {"w": self.w.copy()}

    report = check_trainer(Entropy, {}, {"lr": 0.5}, 3)
    assert not report.exact and report.first_divergence == 1
    assert report.findings[0].startswith("training is not deterministic"), report.format()
    assert "state['w']" in report.findings[0]


def test_evaluate_must_return_a_dict_of_numbers() -> None:
    for value in ([1.0], 0.5, None, np.zeros(2)):

        class Bad(Counter):
            def evaluate(self, value: Any = value) -> Any:
                return value

        with pytest.raises(TrainerError, match=r"evaluate\(\) must return a dict of numbers"):
            check_trainer(Bad, {"extra": 0}, {"lr": 0.5}, 2)


def test_names_are_checked_and_unread_ones_noted() -> None:
    class Declared(Counter):
        hyperparameters = frozenset({"lr"})

    with pytest.raises(ValueError, match="did you mean 'lr'"):
        check_trainer(Declared, {"extra": 0}, {"lrx": 0.5}, 2)

    class Lenient(Counter):
        def setup(self, hp: Mapping[str, Any]) -> None:
            self.lr = hp.get("lr", 0.1)

    report = check_trainer(Lenient, {"extra": 0}, {"lrx": 0.5}, 2)
    assert report.exact and report.findings == ()
    assert "['lrx']" in report.notes[0] and "Notes" in report.format()


def test_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        check_trainer(Counter, {}, {"lr": 0.5}, 1)
    with pytest.raises(ValueError, match="splits"):
        check_trainer(Counter, {}, {"lr": 0.5}, 3, splits=[3])
    report = check_trainer(Counter, {"extra": 1}, {"lr": Constant(0.5)}, 3, splits=[2])
    assert isinstance(report, CheckReport) and report.exact and report.splits == (2,)


# --------------------------------------------------------------------------- CLI

SCRIPT = """
import torch
from stagetree import Study
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch
from test_check import TinyTorch

space = GridSpace({"lr": [MultiStep(0.1, [2], 0.5), Constant(0.05)]}, fixed={"rng": [RNG]})
tuner = GridSearch(space, metric="mse", mode="min", steps=3)
study = Study("chk", TinyTorch, storage=STORAGE, executor="inline")
"""


def _script(tmp_path: Path, rng: bool) -> Path:
    path = tmp_path / f"study_{int(rng)}.py"
    url = f"sqlite:///{tmp_path / 'chk.db'}"
    text = SCRIPT.replace("RNG", repr(rng)).replace("STORAGE", repr(url))
    path.write_text(textwrap.dedent(text))
    return path


def test_cli_check_exit_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    assert main(["check", str(_script(tmp_path, True)), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "check of TinyTorch" in out and "EXACT" in out
    assert main(["check", str(_script(tmp_path, False)), "--steps", "3"]) == 1
    out = capsys.readouterr().out
    assert "NOT EXACT: first difference at step 2" in out
    assert "global torch RNG" in out
    assert not (tmp_path / "chk.db").exists()  # checking writes nothing
    assert main(["check", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    # No tuner: the space named `space`; --splits picks the restores.
    path = _script(tmp_path, False)
    path.write_text(path.read_text().replace("tuner = ", "other = "))
    assert main(["check", str(path), "--steps", "3", "--splits", "2"]) == 1
    out = capsys.readouterr().out
    assert "split at steps 2 " in out and "first difference at step 3" in out


def test_run_warns_once_about_a_trainer_that_is_not_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    path = _script(tmp_path, False)
    assert main(["run", str(path), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "stagetree: warning: TinyTorch is not exact" in err
    assert "global torch RNG" in err and "first difference at step 2" in err
    assert "best mse" in out  # the run went on
    # Checked once per trainer version and storage.
    assert main(["run", str(path), "--no-progress"]) == 0
    assert "not exact" not in capsys.readouterr().err


def test_run_is_quiet_about_an_exact_trainer_and_can_skip_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    assert main(["run", str(_script(tmp_path, True)), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    bad = _script(tmp_path, False)
    bad.write_text(bad.read_text().replace('"chk"', '"chk2"').replace("chk.db", "chk2.db"))
    assert main(["run", str(bad), "--no-progress", "--no-check"]) == 0
    assert capsys.readouterr().err == ""
