"""Grid search and random search: every trial trained to ``steps``."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

from stagetree.exceptions import LargeGridWarning, TunerError
from stagetree.tuners._brackets import BracketSpec, SyncBracketTuner
from stagetree.tuners.base import (
    Job,
    ReplayingRunner,
    check_int,
    draw_specs,
    iter_specs,
    space_size,
)

__all__ = ["GRID_WINDOW", "LARGE_GRID", "GridSearch", "RandomSearch"]


#: Grids above this many points get a :class:`LargeGridWarning` naming their size and
#: are submitted :data:`GRID_WINDOW` trials at a time instead of all at once.
LARGE_GRID = 100_000
#: Trials of a large grid in flight at once (consecutive points: those that share a
#: plan tree are contiguous in grid order, so the stage tree still merges them).
GRID_WINDOW = 1_000
# Submissions between two turns of the event loop, so that a budget's clock is seen
# while a large window is being submitted.
_YIELD_EVERY = 100


class GridSearch(SyncBracketTuner):
    """Train every trial of a grid (``stagetree.space.GridSpace``, or any iterable of
    trial specs) to ``steps``, in the grid's order.

    All trials are submitted at once unless ``max_concurrent`` is given: the stage tree
    merges shared prefixes best when it sees every trial. A grid of more than
    :data:`LARGE_GRID` points is warned about (:class:`LargeGridWarning`, with its
    size), enumerated lazily and submitted :data:`GRID_WINDOW` trials at a time, so that
    a run with a budget starts training at once and stops when the budget is used up.
    ``seed`` is accepted for a uniform signature; grid search draws nothing, so
    ``sampler`` is refused.
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
        size = space_size(space)
        if size is not None and size > LARGE_GRID:
            warnings.warn(
                f"the grid has {size:,} trials: GridSearch trains every one of them to "
                f"{self.steps} steps. It is enumerated lazily and submitted "
                f"{GRID_WINDOW:,} at a time; give the run a budget, or sample the grid "
                "(RandomSearch(space, ..., num_trials=N), ASHA...)",
                LargeGridWarning,
                stacklevel=2,
            )

    @property
    def horizon(self) -> int:
        return self.steps

    def _brackets(self) -> list[BracketSpec]:
        specs = draw_specs(self.space, None, self.seed)
        trials = [self._new_trial(s.config, s.hp) for s in specs]
        return [BracketSpec([self.steps], [len(trials)], trials)]

    def _window(self) -> int | None:
        if self.max_concurrent is not None:
            return self.max_concurrent
        size = space_size(self.space)
        return GRID_WINDOW if size is None or size > LARGE_GRID else None

    async def _search(self, ctx: ReplayingRunner) -> None:
        """One rung of every grid point, pulled from the grid as slots free up (the
        decisions and log of the one-bracket :class:`SyncBracketTuner`)."""
        ids: list[int] = []
        self.rung_trials = [[ids]]
        limit = self._window()
        specs = iter_specs(self.space)
        in_flight: dict[Job, None] = {}
        more = True
        while True:
            while more and (limit is None or len(in_flight) < limit):
                spec = next(specs, None)
                if spec is None:
                    more = False
                    break
                trial = self._new_trial(spec.config, spec.hp)
                ids.append(trial.id)
                in_flight[ctx.submit(trial, self.steps, "submit", bracket=0, rung=0)] = None
                if len(ids) % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
            if not in_flight:
                return
            job = await ctx.wait_first(in_flight)
            del in_flight[job]
            self._observe(job)


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
