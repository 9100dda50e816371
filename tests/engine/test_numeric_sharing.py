"""Numbers that are equal share (issue 25): ``128`` and ``128.0`` are one value to the
plan, and ``setup()`` gets one canonical value, so a trial trains bit for bit alike
whichever spelling it was written with, alone or sharing with the other spelling.

Real PyTorch training on CPU: the value is a batch size (a slice bound, which must be
an int) and a learning rate (in the optimizer and in the trainer's own arithmetic).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_exactness import assert_same_state  # noqa: E402

from stagetree import Study, Trainer  # noqa: E402
from stagetree.hp import Constant, Cosine, Exponential, MultiStep, Piecewise, Sequence  # noqa: E402
from stagetree.space import GridSpace  # noqa: E402
from stagetree.torch import deterministic  # noqa: E402

pytestmark = pytest.mark.torch


class BatchLrTrainer(Trainer):
    """Least squares with SGD; ``batch_size`` slices the data, ``lr`` drives the
    optimizer and a decay the trainer computes itself."""

    hyperparameters = frozenset({"lr", "batch_size"})

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(int(config.get("seed", 0)))
        self.x = 0.3 * torch.randn(512, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)
        self.model = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.model.weight.copy_(torch.randn(1, 8, generator=g))
            self.model.bias.zero_()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.batch_size = 1
        self.lr: Any = 0.0
        self.t = 0

    def setup(self, hp: Mapping[str, Any]) -> None:
        if "batch_size" in hp:
            self.batch_size = hp["batch_size"]  # used as is: a slice bound
        if "lr" in hp:
            self.lr = hp["lr"]
            for group in self.opt.param_groups:
                group["lr"] = hp["lr"]

    def train(self) -> dict[str, float]:
        start = (self.t * 37) % (len(self.x) - 256)
        xb = self.x[start : start + self.batch_size]
        yb = self.y[start : start + self.batch_size]
        loss = ((self.model(xb) - yb) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.model.weight.mul_(1 - 1e-3 * self.lr)
        self.t += 1
        return {"train_loss": float(loss.detach())}

    def evaluate(self) -> dict[str, float]:
        with torch.no_grad():
            return {"loss": float(((self.model(self.x) - self.y) ** 2).mean())}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "t": self.t,
            "batch_size": self.batch_size,
            "lr": self.lr,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.t = state["t"]
        self.batch_size = state["batch_size"]
        self.lr = state["lr"]


CONFIG = {"seed": 3}
STEPS = 12
# One trial, two spellings: ints in the first, floats of the same values in the second.
AS_INTS: dict[str, Sequence] = {"batch_size": Constant(128), "lr": Piecewise([1, 0.5], [5])}
AS_FLOATS: dict[str, Sequence] = {
    "batch_size": MultiStep(128.0, [STEPS], 2.0),
    "lr": MultiStep(1.0, [5], 0.5),
}


def _study(path: Path, name: str = "s") -> Study:
    return Study(name, BatchLrTrainer, storage=f"sqlite:///{path}", executor="inline")


def test_either_spelling_trains_bit_for_bit_alike(tmp_path: Path) -> None:
    results = []
    with deterministic(threads=1):
        for i, hp in enumerate((AS_INTS, AS_FLOATS)):
            with _study(tmp_path / f"alone{i}.db") as study:
                metrics = study.run(CONFIG, hp, STEPS).metrics
                results.append((metrics, study.state(CONFIG, hp, STEPS)))
    (m_int, s_int), (m_float, s_float) = results
    assert m_int == m_float
    assert_same_state(s_int, s_float)
    assert type(s_float["batch_size"]) is int  # setup() got the canonical 128


def test_the_two_spellings_share_one_training(tmp_path: Path) -> None:
    with deterministic(threads=1), _study(tmp_path / "shared.db") as study:
        first = study.run(CONFIG, AS_FLOATS, STEPS)
        second = study.run(CONFIG, AS_INTS, STEPS)
        assert first.metrics == second.metrics
        stats = study.stats()
        assert stats["steps_executed"] == STEPS  # the second trial trained nothing
        assert_same_state(
            study.state(CONFIG, AS_FLOATS, STEPS), study.state(CONFIG, AS_INTS, STEPS)
        )


def test_fig10_space_runs_at_its_merge_rate(tmp_path: Path) -> None:
    # The Hippo paper's Fig. 10 space typed as written (see tests/cli/test_cli_explain.py):
    # run for real, each unique step is trained once and the merge rate is 240 / 159.
    space = GridSpace(
        {
            "lr": [Cosine(0.1, 60), Exponential(0.1, 0.95)],
            "batch_size": [Constant(128), MultiStep(128, [40], 2)],
        }
    )

    async def run_all(study: Study) -> list[Any]:
        # Declared first, as a tuner does: the plan knows every branch point before a
        # worker starts, however far apart the submissions that follow arrive.
        study.declare([(t.config, t.hp) for t in space])
        return await asyncio.gather(*(study.submit(t.config, t.hp, 60) for t in space))

    with deterministic(threads=1), _study(tmp_path / "fig10.db") as study:
        study.begin_tuning("loss", "min", "grid", horizon=60)
        asyncio.run(run_all(study))
        study.end_tuning()
        stats = study.stats()
    assert stats["steps_requested"] == 240
    assert stats["steps_unique"] == 159
    assert stats["steps_executed"] == stats["steps_unique"]
    assert round(stats["merge_rate"], 3) == 1.509
