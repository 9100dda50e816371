"""Trainers for the clean-stop tests (tests/engine/test_clean_stops.py): one that
records every step it trains, one that hangs in a step.

Module-level classes so that worker processes import them by reference.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from failing_trainers import Counter
from study_trainers import LinearTrainer


class LoggedTrainer(LinearTrainer):
    """LinearTrainer with 20 ms steps that appends ``lr:step`` to the file
    ``config["log"]`` at every ``train()`` call: a step trained twice (by one run or
    across runs) appears twice."""

    def train(self) -> dict[str, float]:
        time.sleep(0.02)
        with open(self.config["log"], "a") as fh:
            fh.write(f"{self.lr}:{self.t}\n")
        return super().train()


def trained_steps(log: str) -> list[str]:
    """The steps a :class:`LoggedTrainer` trained, one per ``train()`` call."""
    try:
        with open(log) as fh:
            return fh.read().split()
    except FileNotFoundError:
        return []


class Hangs(Counter):
    """A ``train()`` that never returns at step ``config["at"]`` when ``lr`` is above
    ``config.get("limit", 0)`` (it sleeps for an hour)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)

    def train(self) -> None:
        if self.t == self.config["at"] and self.lr > self.config.get("limit", 0.0):
            time.sleep(3600)
        super().train()
