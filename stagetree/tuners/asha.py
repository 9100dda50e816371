"""Asynchronous successive halving (ASHA) and asynchronous Hyperband.

Follows Algorithm 2 of Li et al., "A System for Massively Parallel Hyperparameter
Tuning" (MLSys 2020): whenever a worker frees, ``get_job`` looks for a promotable
configuration from the top rung down (one in the top ``floor(|rung k| / eta)`` of rung
``k`` that was not promoted yet) and promotes it to rung ``k+1``; otherwise it starts
a new configuration on the bottom rung. Promotion resubmits the same trial with more
steps, so the study resumes it from its checkpoint (pause-and-resume, not the
stop-only variant).
"""

from __future__ import annotations

import heapq
import json
import math
from collections import Counter
from typing import Any

from stagetree.exceptions import TunerError
from stagetree.tuners.base import (
    Job,
    ReplayingRunner,
    Trial,
    Tuner,
    check_int,
    draw_specs,
    rung_levels,
)
from stagetree.tuners.sha import check_halving, halving_settings

__all__ = ["ASHA", "AsyncHyperband"]


class ASHA(Tuner):
    """Asynchronous successive halving with promotions (the paper's Algorithm 2).

    Rungs: ``levels = rung_levels(min_steps, max_steps, eta, max_rungs)``, i.e.
    ``min_steps * eta**k`` for at most ``max_rungs - 1`` lower rungs and ``max_steps`` as
    the top rung (defaults follow the paper's production setting: ``eta=4``, at most 5
    rungs). At most ``max_concurrent`` jobs are in flight; each time one finishes, free
    slots are filled by ``get_job``. By default (``max_concurrent=None``) the slots are
    the runner's workers, counted per distinct piece of work in a study that shares
    prefixes (``share=True``): jobs that would train the same steps from the same model
    take one worker between them, so ASHA keeps every worker busy, as the paper's "get a
    job whenever a worker frees" does. The search ends when ``num_trials``
    configurations have been started, every job has finished
    and nothing is promotable.

    Brackets: bracket ``s = 0..brackets-1`` starts at rung ``s`` (the paper's minimum
    early-stopping rate ``s``) and has its own rungs. New configurations are assigned to
    brackets round-robin (configuration ``i`` to bracket ``i % brackets``) so every
    bracket grows at the same rate; ``get_job`` scans rungs from the top level down,
    and at each level brackets in order.

    Ranking: a rung ranks its members by value (ties to the older trial). Failed
    trials and non-finite values stay in the rung (they count in ``|rung k|``) but rank
    worst and are never promoted. On a grid, configurations are taken in an order
    shuffled by ``seed``.

    After ``run``: :attr:`rungs` ``[bracket][level]`` maps trial id to its value at
    that level, :attr:`promotions` lists ``(trial id, bracket, from level)`` in order.

    ``sampler``: an Optuna sampler (``optuna.samplers.TPESampler(seed=0)``, ...) that
    proposes each new configuration when a worker frees, after every result before it
    was told (ASHA + TPE works like BOHB; see :mod:`stagetree.tuners.optuna_bridge`).
    Optuna cannot resume a finished trial, so a trial is told ``PRUNED`` when it
    pauses at a rung with a value below the ``max(1, |rung| // eta)``-th best there
    (Optuna's SuccessiveHalvingPruner rule; ties are kept open); should ASHA promote it
    later, its later results stay in stagetree only. Trials still paused at the end are
    told ``PRUNED`` then.
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
        eta: int = 4,
        seed: int = 0,
        max_rungs: int = 5,
        brackets: int = 1,
        max_concurrent: int | None = None,
        sampler: Any = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self._use_sampler(sampler, space)
        self.min_steps, self.max_steps, self.eta, self.num_trials, self.levels = halving_settings(
            min_steps, max_steps, num_trials, eta, max_rungs
        )
        self.max_rungs = max_rungs
        self.num_brackets = check_int("brackets", brackets, 1)
        if brackets > len(self.levels):
            raise TunerError(
                f"brackets must be <= the number of rungs ({len(self.levels)}: {self.levels}), "
                f"got {brackets}"
            )
        self.rungs: list[list[dict[int, float]]] = []
        self.promotions: list[tuple[int, int, int]] = []

    async def _search(self, ctx: ReplayingRunner) -> None:
        specs = draw_specs(
            self.space, self.num_trials, self.seed, shuffle_grid=True, sampler=self._bridge
        )
        ctx.declare(specs)  # nothing for a sampler's lazy specs: declared one by one
        levels, eta = self.levels, self.eta
        top = len(levels) - 1
        self.rungs = [[{} for _ in levels] for _ in range(self.num_brackets)]
        self.promotions = []
        ranks = [[_RungRank(eta) for _ in levels] for _ in self.rungs]
        in_flight: dict[Job, tuple[int, int]] = {}
        # With the default concurrency in a study that shares prefixes, a worker is busy
        # per distinct remaining path, not per job: jobs that train the same steps
        # (trials drawn with the same prefix) take one worker between them, so ASHA
        # counts distinct work and fills idle workers, as "whenever a worker frees".
        distinct = self.max_concurrent is None and ctx.shares_work()
        work: dict[Job, tuple[Any, ...]] = {}
        paths: Counter[tuple[Any, ...]] = Counter()  # jobs in flight per distinct work

        def occupied() -> int:
            return len(paths) if distinct else len(in_flight)

        def start(job: Job, b: int, level: int, since: int) -> Job:
            in_flight[job] = (b, level)
            if distinct:
                key = work[job] = _work_key(job.trial, since, levels[level])
                paths[key] += 1
            return job

        def get_job() -> Job | None:
            for level in range(top - 1, -1, -1):
                for b, rungs in enumerate(ranks):
                    tid = rungs[level].promotable()
                    if tid is not None:
                        rungs[level].promote()
                        self.promotions.append((tid, b, level))
                        job = ctx.submit(
                            self.trials[tid], levels[level + 1], "promote", bracket=b,
                            rung=level + 1,
                        )  # fmt: skip
                        return start(job, b, level + 1, levels[level])
            if len(self.trials) < len(specs):
                spec = specs[len(self.trials)]
                if self._bridge is not None:
                    ctx.declare([spec])
                trial = self._new_trial(spec.config, spec.hp)
                b = trial.id % self.num_brackets
                return start(ctx.submit(trial, levels[b], "submit", bracket=b, rung=b), b, b, 0)
            return None

        while True:
            while occupied() < self._workers(ctx) and get_job() is not None:
                pass
            if not in_flight:
                return
            job = await ctx.wait_first(in_flight)
            b, level = in_flight.pop(job)
            key = work.pop(job, None)
            if key is not None:
                paths[key] -= 1
                if not paths[key]:
                    del paths[key]
            value = self.rungs[b][level][job.trial.id] = self._observe(job)
            ranks[b][level].add(job.trial.id, value)
            # Optuna's SuccessiveHalvingPruner rule, ties kept: trials sharing a prefix
            # tie at early rungs, and one of them may well be promoted later
            if (
                self._bridge is not None
                and level < top
                and (value < ranks[b][level].threshold() or value == -math.inf)
            ):
                self._prune(job.trial.id)

    @property
    def horizon(self) -> int:
        return self.max_steps


class AsyncHyperband(ASHA):
    """Asynchronous Hyperband: ASHA brackets run concurrently.

    Same as :class:`ASHA` with one bracket per rung by default (bracket ``s`` starts at
    rung ``s``; the last one trains its configurations straight to ``max_steps``), new
    configurations assigned round-robin. Pass ``brackets`` to use fewer.
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
        eta: int = 4,
        seed: int = 0,
        max_rungs: int = 5,
        brackets: int | None = None,
        max_concurrent: int | None = None,
        sampler: Any = None,
    ) -> None:
        if brackets is None:
            check_halving(min_steps, max_steps, eta)
            check_int("max_rungs", max_rungs, 1)
            brackets = len(rung_levels(min_steps, max_steps, eta, max_rungs))
        super().__init__(
            space,
            metric,
            mode,
            min_steps=min_steps,
            max_steps=max_steps,
            num_trials=num_trials,
            eta=eta,
            seed=seed,
            max_rungs=max_rungs,
            brackets=brackets,
            max_concurrent=max_concurrent,
            sampler=sampler,
        )


class _RungRank:
    """One rung's members ranked as results arrive, for ``get_job``'s question "the best
    member not promoted yet: is it in the top ``len // eta``?" in O(log n).

    Members are keys ``(-value, trial id)`` (smaller is better: value first, ties to
    the older trial). ``_top`` (a max-heap, keys negated) holds the best
    ``len // eta`` members, ``_rest`` (a min-heap) the others, ``_open`` (a min-heap)
    the members not promoted yet.
    """

    def __init__(self, eta: int) -> None:
        self.eta = eta
        self.size = 0
        self._top: list[tuple[float, int]] = []
        self._rest: list[tuple[float, int]] = []
        self._open: list[tuple[float, int]] = []

    def add(self, tid: int, value: float) -> None:
        """A member's value (``-inf`` for a failure or a non-finite metric)."""
        key = (-value, tid)
        self.size += 1
        heapq.heappush(self._open, key)
        if self._top and key < _neg(self._top[0]):
            heapq.heappush(self._top, _neg(key))
        else:
            heapq.heappush(self._rest, key)
        want = self.size // self.eta
        while len(self._top) > want:
            heapq.heappush(self._rest, _neg(heapq.heappop(self._top)))
        while len(self._top) < want:
            heapq.heappush(self._top, _neg(heapq.heappop(self._rest)))

    def promotable(self) -> int | None:
        """The best member not promoted yet when it ranks in the top ``len // eta`` with
        a finite value, else None."""
        if not self._open or not self._top:
            return None
        key = self._open[0]
        if key[0] == math.inf or key > _neg(self._top[0]):
            return None
        return key[1]

    def promote(self) -> None:
        """Mark the member :meth:`promotable` named as promoted."""
        heapq.heappop(self._open)

    def threshold(self) -> float:
        """The ``max(1, len // eta)``-th best value (a rung with members)."""
        key = _neg(self._top[0]) if self._top else self._rest[0]
        return -key[0]


def _neg(key: tuple[float, int]) -> tuple[float, int]:
    return (-key[0], -key[1])


def _work_key(trial: Trial, start: int, stop: int) -> tuple[Any, ...]:
    """What training ``trial`` from ``start`` to ``stop`` computes: its config and its
    sequences' values up to ``stop`` (equal keys train the same steps from the same
    model, which a sharing study does once)."""
    path = tuple((name, tuple(_values(trial.hp[name], stop))) for name in sorted(trial.hp))
    return (json.dumps(trial.config, sort_keys=True, default=repr), start, path)


def _values(seq: Any, stop: int) -> list[Any]:
    values = getattr(seq, "values", None)
    return list(values(0, stop)) if callable(values) else [seq] * stop
