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
