"""Trainers that fail in every way a user's trainer can: for tests/engine/test_failures.py.

Module-level classes so that worker processes import them by reference. Trainers that
must fail a bounded number of times count their attempts in a file named by the config.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stagetree import Trainer


class Counter(Trainer):
    """Adds ``lr`` to ``w`` each step; ``evaluate`` reports ``w``. Correct as it is."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.w = 0.0
        self.t = 0
        self.lr = 0.0

    def setup(self, hp: Mapping[str, Any]) -> None:
        if "lr" in hp:
            self.lr = float(hp["lr"])

    def train(self) -> None:
        self.w += self.lr
        self.t += 1

    def evaluate(self) -> dict[str, float]:
        return {"w": self.w}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "t": self.t}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w, self.t = float(state["w"]), int(state["t"])


class NoState(Counter):
    """Forgets to implement state_dict/load_state_dict (the base class raises)."""

    state_dict = Trainer.state_dict  # type: ignore[assignment]
    load_state_dict = Trainer.load_state_dict  # type: ignore[assignment]


class BadState(Counter):
    """``state_dict`` holds what no checkpoint can hold; ``config["bad"]`` says what."""

    def state_dict(self) -> Any:
        bad = self.config["bad"]
        if bad == "none":
            return None
        value: Any = {"lock": threading.Lock(), "lambda": lambda x: x, "set": {1, 2}}[bad]
        return {"w": self.w, "t": self.t, "extra": {bad: value}}


class Raises(Counter):
    """Raises in ``train`` at step ``config["at"]``; counts attempts in ``config["log"]``."""

    def train(self) -> None:
        if self.t == self.config["at"]:
            with open(self.config["log"], "a") as f:
                f.write("x")
            raise ValueError(f"boom at step {self.t}")
        super().train()


class Dies(Counter):
    """Kills its worker process at step ``config["at"]`` (``config["how"]``: "exit" or
    "segv"); counts deaths in ``config["log"]``."""

    def train(self) -> None:
        if self.t == self.config["at"]:
            with open(self.config["log"], "a") as f:
                f.write("x")
            if self.config["how"] == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            os._exit(3)
        super().train()


class FailsSome(Counter):
    """Raises in ``train`` at step 2 when ``lr`` is above ``config["limit"]``."""

    def train(self) -> None:
        if self.t == 2 and self.lr > self.config["limit"]:
            raise FloatingPointError(f"lr {self.lr} diverged")
        super().train()


def attempts(log: str | Path) -> int:
    path = Path(log)
    return len(path.read_text()) if path.exists() else 0
