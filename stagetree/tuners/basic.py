"""Grid search and random search: every trial trained to ``steps``."""

from __future__ import annotations

from typing import Any

from stagetree.tuners._brackets import BracketSpec, SyncBracketTuner
from stagetree.tuners.base import check_int, draw_specs

__all__ = ["GridSearch", "RandomSearch"]


class GridSearch(SyncBracketTuner):
    """Train every trial of a grid (``stagetree.space.GridSpace``, or any iterable of
    trial specs) to ``steps``, in the grid's order.

    All trials are submitted at once unless ``max_concurrent`` is given: the stage tree
    merges shared prefixes best when it sees every trial. ``seed`` is accepted for a
    uniform signature; grid search draws nothing.
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        steps: int,
        seed: int = 0,
        max_concurrent: int | None = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self.steps = check_int("steps", steps, 1)

    @property
    def horizon(self) -> int:
        return self.steps

    def _brackets(self) -> list[BracketSpec]:
        specs = draw_specs(self.space, None, self.seed)
        trials = [self._new_trial(s.config, s.hp) for s in specs]
        return [BracketSpec([self.steps], [len(trials)], trials)]


class RandomSearch(SyncBracketTuner):
    """Train ``num_trials`` trials sampled from a random space
    (``space.sample(num_trials, seed)``) to ``steps``.

    All trials are submitted at once unless ``max_concurrent`` is given. Given a grid,
    it trains ``num_trials`` grid points in an order shuffled by ``seed``.
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        steps: int,
        num_trials: int,
        seed: int = 0,
        max_concurrent: int | None = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self.steps = check_int("steps", steps, 1)
        self.num_trials = check_int("num_trials", num_trials, 1)

    @property
    def horizon(self) -> int:
        return self.steps

    def _brackets(self) -> list[BracketSpec]:
        specs = draw_specs(self.space, self.num_trials, self.seed, shuffle_grid=True)
        trials = [self._new_trial(s.config, s.hp) for s in specs]
        return [BracketSpec([self.steps], [len(trials)], trials)]
