"""Grid search and random search: every trial trained to ``steps``."""

from __future__ import annotations

from typing import Any

from stagetree.exceptions import TunerError
from stagetree.tuners._brackets import BracketSpec, SyncBracketTuner
from stagetree.tuners.base import check_int, draw_specs

__all__ = ["GridSearch", "RandomSearch"]


class GridSearch(SyncBracketTuner):
    """Train every trial of a grid (``stagetree.space.GridSpace``, or any iterable of
    trial specs) to ``steps``, in the grid's order.

    All trials are submitted at once unless ``max_concurrent`` is given: the stage tree
    merges shared prefixes best when it sees every trial. ``seed`` is accepted for a
    uniform signature; grid search draws nothing, so ``sampler`` is refused.
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
        sampler: Any = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        if sampler is not None:
            raise TunerError(
                "GridSearch trains every point of its grid and draws nothing, so it takes "
                "no sampler; to let an Optuna sampler choose, describe the space with "
                "distributions (RandomSpace) and use RandomSearch, ASHA, ... with sampler="
            )
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

    ``sampler``: an Optuna sampler (``optuna.samplers.TPESampler(seed=0)``, ...) that
    proposes the configurations instead of ``space.sample`` (see
    :mod:`stagetree.tuners.optuna_bridge`). All trials are asked at once, so
    the sampler learns across runs (a resumed or extended study), not within one.
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
        sampler: Any = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self.steps = check_int("steps", steps, 1)
        self.num_trials = check_int("num_trials", num_trials, 1)
        self._use_sampler(sampler, space)

    @property
    def horizon(self) -> int:
        return self.steps

    def _brackets(self) -> list[BracketSpec]:
        specs = draw_specs(
            self.space, self.num_trials, self.seed, shuffle_grid=True, sampler=self._bridge
        )
        trials = [self._new_trial(s.config, s.hp) for s in specs]
        return [BracketSpec([self.steps], [len(trials)], trials)]
