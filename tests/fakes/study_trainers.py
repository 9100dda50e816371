"""Fast trainers for study-level tests: numpy least squares on generated data.

Module-level classes so that worker processes can import them by file path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from stagetree import Trainer


class LinearTrainer(Trainer):
    """SGD on a generated linear regression; ``lr`` is its sequence. Deterministic."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        if config.get("fail_init"):
            raise RuntimeError("boom in __init__")
        rng = np.random.default_rng(int(config.get("seed", 0)))
        self.x = rng.normal(size=(64, 4))
        self.y = self.x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=64)
        self.w = np.zeros(4)
        self.lr = 0.01
        self.t = 0
        self.fail_train_at = config.get("fail_train_at")
        self.fail_eval = bool(config.get("fail_eval"))
        self.metric_name = str(config.get("metric_name", "score"))
        self.nan_at = config.get("nan_at")

    def setup(self, hp: Mapping[str, Any]) -> None:
        if "lr" in hp:
            self.lr = float(hp["lr"])

    def train(self) -> dict[str, float]:
        if self.fail_train_at is not None and self.t == self.fail_train_at:
            raise ValueError(f"boom in train at step {self.t}")
        if self.lr > 1.0:
            raise FloatingPointError(f"lr {self.lr} diverges at step {self.t}")
        grad = 2 * self.x.T @ (self.x @ self.w - self.y) / len(self.y)
        self.w = self.w - self.lr * grad
        self.t += 1
        return {}

    def evaluate(self) -> dict[str, float]:
        if self.fail_eval:
            raise KeyError("boom in evaluate")
        loss = float(np.mean((self.x @ self.w - self.y) ** 2))
        if self.nan_at is not None and self.t >= self.nan_at:
            loss = float("nan")
        return {self.metric_name: -loss, "loss": loss}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy(), "t": self.t, "lr": self.lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = np.array(state["w"], dtype=float)
        self.t = int(state["t"])
        self.lr = float(state["lr"])


class CrashOnceTrainer(LinearTrainer):
    """Kills its worker process (no exception, no cleanup) the first time it reaches
    step ``crash_at``; a marker file makes it a one-off."""

    def train(self) -> dict[str, float]:
        marker = self.config.get("marker")
        if marker and self.t == self.config.get("crash_at") and not os.path.exists(marker):
            with open(marker, "w") as fh:
                fh.write("crashed")
            os._exit(1)
        return super().train()


class SlowLinearTrainer(LinearTrainer):
    """LinearTrainer with 20 ms steps, for tests that act while a batch runs."""

    def train(self) -> dict[str, float]:
        import time

        time.sleep(0.02)
        return super().train()


class FusedLinearTrainer(LinearTrainer):
    """LinearTrainer that can be fused over ``lr`` (a numpy stand-in for
    :class:`stagetree.torch.FusibleTrainer`, to test the worker and scheduler side of
    fusion without torch). Each step reports ``width``: the members trained with it
    (1 unfused). The group updates member by member, so results equal unfused ones
    exactly. Config ``fuse_fails``: the group's first step raises ``FusionError``."""

    fusible = frozenset({"lr"})

    def train(self) -> dict[str, float]:
        super().train()
        return {"width": 1.0}

    @classmethod
    def fuse(cls, members: Any) -> Any:
        return _LinearGroup(list(members))

    def fused_width_limit(self) -> int | None:
        """Config ``max_width``: as if the device held no more members."""
        return self.config.get("max_width")


class _LinearGroup:
    """A FusedGroup over FusedLinearTrainer members (see stagetree.fusion)."""

    def __init__(self, members: list[FusedLinearTrainer]) -> None:
        self._members = members
        # The group's own copy of each member's weights: the trainer objects only see
        # them on sync(), as with stacked torch parameters.
        self.w = np.stack([m.w.copy() for m in members])
        self.t = members[0].t
        self.first = True

    @property
    def members(self) -> list[FusedLinearTrainer]:
        return self._members

    def setup(self, i: int, hp: Mapping[str, Any]) -> None:
        self._members[i].setup(hp)

    def step(self) -> list[dict[str, float]]:
        if self.first and self._members[0].config.get("fuse_fails"):
            from stagetree.exceptions import FusionError

            raise FusionError("this model cannot be vmapped (test)")
        self.first = False
        out = []
        width = float(len(self._members))
        for i, m in enumerate(self._members):
            if m.fail_train_at is not None and self.t == m.fail_train_at:
                raise ValueError(f"boom in fused train at step {self.t}")
            if m.lr > 1.0:
                raise FloatingPointError(f"lr {m.lr} diverges at step {self.t}")
            grad = 2 * m.x.T @ (m.x @ self.w[i] - m.y) / len(m.y)
            self.w[i] = self.w[i] - m.lr * grad
            out.append({"width": width})
        self.t += 1
        return out

    def sync(self, i: int, optimizer: bool = True) -> None:
        m = self._members[i]
        m.w = self.w[i].copy()
        m.t = self.t

    def remove(self, i: int) -> FusedLinearTrainer:
        self.sync(i)
        self.w = np.delete(self.w, i, axis=0)
        return self._members.pop(i)


def submit_together(
    study: Any, trials: list[tuple[dict[str, Any], dict[str, Any]]], steps: int
) -> Any:
    """Submit ``trials`` so that the scheduler sees them at once (however loaded the
    machine: the engine's driver waits on its lock meanwhile), then wait for them all;
    returns their results in order (or the exceptions they raised)."""
    import asyncio

    async def go() -> list[Any]:
        with study._engine.lock:
            tasks = [asyncio.ensure_future(study.submit(c, h, steps)) for c, h in trials]
            await asyncio.sleep(0)  # each task submits (up to its first await)
        return await asyncio.gather(*tasks, return_exceptions=True)

    return study._drive(go())


class RecordingTrainer(LinearTrainer):
    """LinearTrainer that needs ``config["width"]`` and appends the id of every process
    that trains it to the file ``$STAGETREE_TEST_TRAINED`` (when set): a test tells
    whether a worker process trained anything."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.width = int(config["width"])  # a misspelt key fails here

    def train(self) -> dict[str, float]:
        path = os.environ.get("STAGETREE_TEST_TRAINED")
        if path:
            with open(path, "a") as fh:
                fh.write(f"{os.getpid()}\n")
        return super().train()


class RecordingNoState(RecordingTrainer):
    """Forgets ``state_dict`` and ``load_state_dict`` (the base class raises)."""

    state_dict = Trainer.state_dict  # type: ignore[assignment]
    load_state_dict = Trainer.load_state_dict  # type: ignore[assignment]


class DeclaredTrainer(RecordingTrainer):
    """RecordingTrainer that declares what it takes and returns."""

    hyperparameters = frozenset({"lr"})
    config_names = frozenset({"seed", "width"})
    metric_names = frozenset({"score", "loss"})


class DeclaredNoState(DeclaredTrainer):
    """DeclaredTrainer without ``state_dict`` and ``load_state_dict``."""

    state_dict = Trainer.state_dict  # type: ignore[assignment]
    load_state_dict = Trainer.load_state_dict  # type: ignore[assignment]
