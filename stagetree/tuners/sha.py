"""Synchronous successive halving (SHA), Hyperband and the Hippo paper's EarlyStop."""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceABC
from typing import Any

from stagetree.exceptions import TunerError
from stagetree.tuners._brackets import BracketSpec, SyncBracketTuner
from stagetree.tuners.base import check_int, draw_specs, rung_levels

__all__ = ["SHA", "EarlyStop", "Hyperband", "check_halving", "halving_counts", "hyperband_split"]


def halving_settings(
    min_steps: int, max_steps: int, num_trials: int, eta: int, max_rungs: int | None = None
) -> tuple[int, int, int, int, list[int]]:
    """Validate what every successive-halving tuner (SHA, Hyperband, ASHA) takes and
    return ``(min_steps, max_steps, eta, num_trials, levels)``, ``levels`` being the rung
    step counts."""
    check_halving(min_steps, max_steps, eta)
    num_trials = check_int("num_trials", num_trials, 1)
    if max_rungs is not None:
        check_int("max_rungs", max_rungs, 1)
    return min_steps, max_steps, eta, num_trials, rung_levels(min_steps, max_steps, eta, max_rungs)


def check_halving(min_steps: Any, max_steps: Any, eta: Any) -> None:
    """Validate successive-halving arguments, raising :class:`TunerError` naming the culprit."""
    check_int("min_steps", min_steps, 1)
    check_int("max_steps", max_steps, 1)
    if min_steps > max_steps:
        raise TunerError(f"min_steps must be <= max_steps, got {min_steps} > {max_steps}")
    check_int("eta", eta, 2)


def halving_counts(n: int, rungs: int, eta: int) -> list[int]:
    """Trials per rung of one bracket: ``n``, then ``max(1, previous // eta)``."""
    counts = [n]
    for _ in range(rungs - 1):
        counts.append(max(1, counts[-1] // eta))
    return counts


def hyperband_split(num_trials: int, num_brackets: int, eta: int) -> list[int]:
    """Configurations per Hyperband bracket, bracket ``b`` having ``s = num_brackets-1-b``
    halvings: proportional to Hyperband's ``ceil(B / (s + 1) * eta**s)``, scaled to sum
    to ``num_trials`` by largest remainder (ties to the more exploratory bracket)."""
    weights = [math.ceil(num_brackets / (s + 1) * eta**s) for s in range(num_brackets - 1, -1, -1)]
    total = sum(weights)
    exact = [num_trials * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(num_brackets), key=lambda b: (-(exact[b] - counts[b]), b))
    for b in order[: num_trials - sum(counts)]:
        counts[b] += 1
    return counts


class SHA(SyncBracketTuner):
    """Synchronous successive halving.

    ``num_trials`` trials train to ``min_steps``; at rung ``k`` the best
    ``max(1, n_{k-1} // eta)`` survivors of rung ``k-1`` train to ``min_steps * eta**k``;
    the top rung is ``max_steps`` (see :func:`~stagetree.tuners.base.rung_levels`).
    Each rung waits for all of its trials. A promotion resubmits the same trial with
    more steps: the study resumes it from its checkpoint. Failed trials and non-finite
    values are never promoted. On a grid, trials are taken in an order shuffled by
    ``seed``.

    ``sampler``: an Optuna sampler (``optuna.samplers.TPESampler(seed=0)``, ...) that
    proposes the configurations instead of ``space.sample`` (see
    :mod:`stagetree.tuners.optuna_bridge`). Trials a rung drops are told
    ``PRUNED``; all are asked at once, so the sampler learns across runs rather than
    within one (use ASHA for that).
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        min_steps: int,
        max_steps: int,
        num_trials: int,
        eta: int = 3,
        seed: int = 0,
        max_concurrent: int | None = None,
        sampler: Any = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self.min_steps, self.max_steps, self.eta, self.num_trials, self.levels = halving_settings(
            min_steps, max_steps, num_trials, eta
        )
        self._use_sampler(sampler, space)

    @property
    def horizon(self) -> int:
        return self.max_steps

    def _brackets(self) -> list[BracketSpec]:
        specs = draw_specs(
            self.space, self.num_trials, self.seed, shuffle_grid=True, sampler=self._bridge
        )
        trials = [self._new_trial(s.config, s.hp) for s in specs]
        return [
            BracketSpec(
                self.levels, halving_counts(len(trials), len(self.levels), self.eta), trials
            )
        ]


class Hyperband(SyncBracketTuner):
    """Hyperband: brackets of SHA that trade many short trials against few long ones.

    With rungs ``levels = rung_levels(min_steps, max_steps, eta)`` (``L`` of them),
    bracket ``b = 0..L-1`` starts at ``levels[b]``: bracket 0 is the most exploratory
    SHA, bracket ``L-1`` trains its trials straight to ``max_steps``. The
    ``num_trials`` configurations are split over the brackets in Hyperband's
    proportions (:func:`hyperband_split`). Brackets run side by side, each
    synchronous within itself.

    ``sampler``: an Optuna sampler (``optuna.samplers.TPESampler(seed=0)``, ...) that
    proposes the configurations instead of ``space.sample`` (see
    :mod:`stagetree.tuners.optuna_bridge`).
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        min_steps: int,
        max_steps: int,
        num_trials: int,
        eta: int = 3,
        seed: int = 0,
        max_concurrent: int | None = None,
        sampler: Any = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self.min_steps, self.max_steps, self.eta, self.num_trials, self.levels = halving_settings(
            min_steps, max_steps, num_trials, eta
        )
        self._use_sampler(sampler, space)

    @property
    def horizon(self) -> int:
        return self.max_steps

    def _brackets(self) -> list[BracketSpec]:
        specs = draw_specs(
            self.space, self.num_trials, self.seed, shuffle_grid=True, sampler=self._bridge
        )
        trials = [self._new_trial(s.config, s.hp) for s in specs]
        split = hyperband_split(len(trials), len(self.levels), self.eta)
        out: list[BracketSpec] = []
        first = 0
        for b, n in enumerate(split):
            steps = self.levels[b:]
            if n:
                group = trials[first : first + n]
                out.append(BracketSpec(steps, halving_counts(n, len(steps), self.eta), group))
            first += n
        return out


class EarlyStop(SyncBracketTuner):
    """The Hippo paper's milestone tuner.

    ``schedule = [(steps_0, n_0), (steps_1, n_1), ...]``: ``n_0`` trials (sampled from a
    random space, or the first ``n_0`` of a grid shuffled by ``seed``) train to
    ``steps_0``; then the best ``n_1`` of them train to ``steps_1``, and so on.
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        schedule: SequenceABC[tuple[int, int]] = ((5, 8), (10, 4)),
        seed: int = 0,
        max_concurrent: int | None = None,
        sampler: Any = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        if isinstance(schedule, (str, bytes)) or not schedule:
            raise TunerError(f"schedule must be a non-empty list of (steps, n), got {schedule!r}")
        pairs: list[tuple[int, int]] = []
        for i, item in enumerate(schedule):
            try:
                steps, n = item
            except (TypeError, ValueError):
                raise TunerError(f"schedule[{i}] must be a (steps, n) pair, got {item!r}") from None
            check_int(f"schedule[{i}] steps", steps, 1)
            check_int(f"schedule[{i}] n", n, 1)
            if pairs and steps <= pairs[-1][0]:
                raise TunerError(
                    f"schedule steps must be strictly increasing, got {steps} after {pairs[-1][0]}"
                )
            pairs.append((steps, n))
        self.space = space
        self.schedule = pairs
        self._use_sampler(sampler, space)

    @property
    def horizon(self) -> int:
        return self.schedule[-1][0]

    def _brackets(self) -> list[BracketSpec]:
        specs = draw_specs(
            self.space, self.schedule[0][1], self.seed, shuffle_grid=True, sampler=self._bridge
        )
        trials = [self._new_trial(s.config, s.hp) for s in specs]
        counts = [len(trials)] + [n for _, n in self.schedule[1:]]
        return [BracketSpec([s for s, _ in self.schedule], counts, trials)]
