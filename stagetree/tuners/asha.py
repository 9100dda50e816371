"""Asynchronous successive halving (ASHA) and asynchronous Hyperband.

Follows Algorithm 2 of Li et al., "A System for Massively Parallel Hyperparameter
Tuning" (MLSys 2020): whenever a worker frees, ``get_job`` looks for a promotable
configuration from the top rung down (one in the top ``floor(|rung k| / eta)`` of rung
``k`` that was not promoted yet) and promotes it to rung ``k+1``; otherwise it starts
a new configuration on the bottom rung. Promotion resubmits the same trial with more
steps, so the study resumes it from its checkpoint (pause-and-resume, not the
stop-only variant).

Brackets follow the paper's production section: bracket ``s`` starts its
configurations at rung ``s`` (minimum early-stopping rate ``s``), and new
configurations go to the brackets in proportion to the inverse of a bracket's budget
per configuration (:func:`bracket_shares`). Asynchronous Hyperband loops through the
brackets of ASHA. With ``max_steps=None`` the rungs grow without end (the paper's
infinite horizon): a trial's budget grows each time it is promoted.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import sys
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping
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
from stagetree.tuners.optuna_bridge import SampledSpecs
from stagetree.tuners.sha import check_halving, halving_settings

__all__ = ["ALLOCATIONS", "ASHA", "AsyncHyperband", "RungValues", "bracket_shares"]

#: How new configurations are assigned to brackets: ``"budget"`` (in proportion to the
#: inverse of a bracket's budget per configuration, the paper's production rule) or
#: ``"round_robin"`` (configuration ``i`` to bracket ``i % brackets``).
ALLOCATIONS = ("budget", "round_robin")
#: ASHA's default brackets (fewer when there are fewer rungs) and allocation.
DEFAULT_BRACKETS = 1
DEFAULT_ALLOCATION = "round_robin"


def bracket_shares(brackets: int, num_rungs: int | None, eta: int) -> list[float]:
    """Share of new configurations per bracket under the ``"budget"`` allocation.

    Bracket ``s`` has ``n = num_rungs - s`` rungs: it trains ``eta**(n-1)``
    configurations with a budget of about ``n`` times the top rung's steps (every rung
    of successive halving costs about the same), so its budget per configuration is
    ``n / eta**(n-1)`` top rungs and its share is proportional to ``eta**(n-1) / n``
    (70.6 / 22.1 / 7.4 % for ``eta=4``, 5 rungs, 3 brackets). With ``num_rungs=None``
    (infinite horizon) the ratio between neighbouring brackets tends to ``eta``, and
    the shares are proportional to ``eta**-s``.
    """
    if num_rungs is None:
        weights = [float(eta) ** -s for s in range(brackets)]
    else:
        weights = [eta ** (num_rungs - s - 1) / (num_rungs - s) for s in range(brackets)]
    total = sum(weights)
    return [w / total for w in weights]


class RungValues(Mapping[int, float]):
    """One rung's members: trial id -> value at the rung, in the order they entered.

    Kept as two columns, not a dict (memory per trial at 100,000 trials); reading a
    value by id builds an index of the ids the first time.
    """

    __slots__ = ("_ids", "_index", "_values")

    def __init__(self) -> None:
        self._ids = array("q")
        self._values = array("d")
        self._index: dict[int, int] | None = None

    def add(self, tid: int, value: float) -> None:
        """Trial ``tid`` entered the rung with ``value`` (a trial enters a rung once)."""
        if self._index is not None:
            if tid in self._index:
                raise ValueError(f"trial {tid} is in the rung already")
            self._index[tid] = len(self._ids)
        self._ids.append(tid)
        self._values.append(value)

    def __getitem__(self, tid: int) -> float:
        if self._index is None:
            self._index = {t: i for i, t in enumerate(self._ids)}
        return self._values[self._index[tid]]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return repr(dict(zip(self._ids, self._values)))


class _Allocator:
    """Assigns configuration ``i`` to a bracket: the one furthest behind its share of
    the ``i + 1`` configurations so far (ties to the lower bracket), so every prefix of
    the configurations is split as close to the shares as whole numbers allow."""

    def __init__(self, shares: list[float]) -> None:
        self.shares = shares
        self.counts = [0] * len(shares)

    def next(self) -> int:
        n = sum(self.counts) + 1
        b = max(range(len(self.shares)), key=lambda i: (self.shares[i] * n - self.counts[i], -i))
        self.counts[b] += 1
        return b


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
    early-stopping rate ``s``) and has its own rungs. ``allocation`` assigns new
    configurations to brackets: ``"round_robin"`` (configuration ``i`` to bracket
    ``i % brackets``, every bracket grows at the same rate) or ``"budget"`` (the paper's
    production rule: in proportion to the inverse of a bracket's budget per
    configuration, :func:`bracket_shares`; with ``eta=4``, 5 rungs and
    ``brackets=3``, 70.6 / 22.1 / 7.4 %, each prefix of the configurations split as
    close to the shares as whole numbers allow). ``get_job`` scans rungs from the top
    level down, and at each level brackets in order.

    Infinite horizon (``max_steps=None``): rungs ``min_steps * eta**k`` without end
    (``max_rungs`` is not used); a trial's budget grows each time it is promoted, and a
    rung promotes while it holds ``eta`` or more members. ``num_trials=None`` takes the
    whole grid, or draws configurations from a random space without end: such a
    search never ends by itself, and ``Study.tune`` refuses it without a budget.

    Ranking: a rung ranks its members by value (ties to the older trial). Failed
    trials and non-finite values stay in the rung (they count in ``|rung k|``) but rank
    worst and are never promoted. On a grid, configurations are taken in an order
    shuffled by ``seed``.

    After ``run``: :attr:`rungs` ``[bracket][level]`` maps trial id to its value at
    that level (a :class:`RungValues`, in the order trials entered),
    :attr:`promotions` lists ``(trial id, bracket, from level)`` in order.

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
        max_steps: int | None,
        num_trials: int | None,
        eta: int = 4,
        seed: int = 0,
        max_rungs: int = 5,
        brackets: int | None = None,
        allocation: str | None = None,
        max_concurrent: int | None = None,
        sampler: Any = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self._use_sampler(sampler, space)
        if max_steps is None:  # infinite horizon: rungs min_steps * eta**k without end
            check_halving(min_steps, min_steps, eta)
            check_int("max_rungs", max_rungs, 1)
            self.min_steps, self.max_steps, self.eta = min_steps, None, eta
            self.levels = [min_steps]
        else:
            self.min_steps, self.max_steps, self.eta, _, self.levels = halving_settings(
                min_steps, max_steps, 1, eta, max_rungs
            )
        self.num_trials = None if num_trials is None else check_int("num_trials", num_trials, 1)
        self.max_rungs = max_rungs
        if brackets is None:  # the default: as many of its brackets as there are rungs
            brackets = (
                DEFAULT_BRACKETS if max_steps is None else min(DEFAULT_BRACKETS, len(self.levels))
            )
        if allocation is None:
            allocation = DEFAULT_ALLOCATION
        self.num_brackets = check_int("brackets", brackets, 1)
        if max_steps is not None and brackets > len(self.levels):
            raise TunerError(
                f"brackets must be <= the number of rungs ({len(self.levels)}: {self.levels}), "
                f"got {brackets}"
            )
        if allocation not in ALLOCATIONS:
            raise TunerError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        self.allocation = allocation
        self.rungs: list[list[RungValues]] = []
        self.promotions: list[tuple[int, int, int]] = []

    @property
    def shares(self) -> list[float]:
        """Share of new configurations per bracket (equal shares for round-robin)."""
        if self.allocation == "round_robin":
            return [1.0 / self.num_brackets] * self.num_brackets
        rungs = None if self.max_steps is None else len(self.levels)
        return bracket_shares(self.num_brackets, rungs, self.eta)

    @property
    def bounded(self) -> bool:
        """Whether the search ends by itself: a number of configurations bounds it
        (``num_trials``, or a finite grid). Without a bound, a study needs a budget."""
        return self.num_trials is not None or not (
            hasattr(self.space, "sample") or self.sampler is not None
        )

    def _assigner(self) -> Any:
        """Configuration id -> bracket, in creation order."""
        if self.allocation == "round_robin":
            return lambda tid: tid % self.num_brackets
        alloc = _Allocator(self.shares)
        return lambda tid: alloc.next()

    async def _search(self, ctx: ReplayingRunner) -> None:
        eta = self.eta
        infinite = self.max_steps is None
        levels = self.levels = list(self.levels) if not infinite else [self.min_steps]
        # The study checkpoints batches at the rungs: a bracket's trial trains a path from
        # step 0 past the lower rungs, where other brackets' trials ask for results later.
        # Infinite horizon: trials are declared up to the furthest rung so far (see grow).
        ctx.plan_ahead(levels[-1], levels)
        specs: Any
        if self.bounded:
            specs = draw_specs(
                self.space, self.num_trials, self.seed, shuffle_grid=True, sampler=self._bridge
            )
            ctx.declare(specs)  # nothing for lazy specs: declared one by one
        elif self._bridge is not None:  # configurations without end, asked one at a time
            specs = SampledSpecs(self._bridge, sys.maxsize)
        else:
            specs = _Unbounded(self.space, self.seed)
        top = len(levels) - 1
        self.rungs = [[RungValues() for _ in levels] for _ in range(self.num_brackets)]
        self.promotions = []
        ranks = [[_RungRank(eta) for _ in levels] for _ in self.rungs]
        bracket_of = self._assigner()

        def grow(level: int) -> None:
            # infinite horizon: rung ``level`` exists once a trial may reach it
            if len(levels) > level:
                return
            while len(levels) <= level:
                levels.append(levels[-1] * eta)
                for b, rungs in enumerate(ranks):
                    rungs.append(_RungRank(eta))
                    self.rungs[b].append(RungValues())
            # The insertion horizon: every trial's path up to the furthest rung, before
            # a batch trains there, so that batches checkpoint where later promotions
            # branch off their paths (their nodes are known) instead of training the
            # prefix again.
            ctx.plan_ahead(levels[-1], levels)
            ctx.declare(self.trials.values() if getattr(specs, "lazy", False) else specs)

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
            for level in range(len(levels) - 1 if infinite else top - 1, -1, -1):
                for b, rungs in enumerate(ranks):
                    tid = rungs[level].promotable()
                    if tid is not None:
                        grow(level + 1)
                        rungs[level].promote()
                        self.promotions.append((tid, b, level))
                        job = ctx.submit(
                            self.trials[tid], levels[level + 1], "promote", bracket=b,
                            rung=level + 1,
                        )  # fmt: skip
                        return start(job, b, level + 1, levels[level])
            if len(self.trials) < len(specs):
                spec = specs[len(self.trials)]
                if getattr(specs, "lazy", False):
                    ctx.declare([spec])
                trial = self._new_trial(spec.config, spec.hp)
                b = bracket_of(trial.id)
                grow(b)
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
            value = self._observe(job)
            self.rungs[b][level].add(job.trial.id, value)
            ranks[b][level].add(job.trial.id, value)
            # Optuna's SuccessiveHalvingPruner rule, ties kept: trials sharing a prefix
            # tie at early rungs, and one of them may well be promoted later
            if (
                self._bridge is not None
                and (infinite or level < top)
                and (value < ranks[b][level].threshold() or value == -math.inf)
            ):
                self._prune(job.trial.id)

    @property
    def horizon(self) -> int:
        return 0 if self.max_steps is None else self.max_steps


class AsyncHyperband(ASHA):
    """Asynchronous Hyperband: ASHA brackets run concurrently.

    Same as :class:`ASHA` with one bracket per rung by default (bracket ``s`` starts at
    rung ``s``; the last one trains its configurations straight to ``max_steps``): it
    loops through the brackets of ASHA, new configurations assigned round-robin, or in
    Hyperband's proportions (the inverse of each bracket's budget) with
    ``allocation="budget"``. Pass ``brackets`` to use fewer (required with
    ``max_steps=None``, where rungs are endless).
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        min_steps: int,
        max_steps: int | None,
        num_trials: int | None,
        eta: int = 4,
        seed: int = 0,
        max_rungs: int = 5,
        brackets: int | None = None,
        allocation: str = "round_robin",
        max_concurrent: int | None = None,
        sampler: Any = None,
    ) -> None:
        if brackets is None and max_steps is None:
            raise TunerError("AsyncHyperband with max_steps=None needs brackets (endless rungs)")
        if brackets is None:
            assert max_steps is not None
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
            allocation=allocation,
            max_concurrent=max_concurrent,
            sampler=sampler,
        )


class _Unbounded:
    """Configurations without end from a random space, drawn (and declared) one at a
    time: item ``i`` is the ``i``-th of ``space.sample(n, seed)`` for any ``n > i`` (the
    same draws, repeats skipped)."""

    lazy = True

    def __init__(self, space: Any, seed: int) -> None:
        self._space = space
        self._rng = random.Random(seed)
        self._seen: set[Any] = set()
        self._specs: list[Any] = []
        self._exhausted = False

    def _fill(self, i: int) -> bool:
        """Draw up to item ``i``; False when the space gave nothing new in
        ``max(100, 10 * drawn)`` draws in a row (a finite space, used up)."""
        repeats = 0
        while len(self._specs) <= i and not self._exhausted:
            spec = self._space.sample_one(self._rng)
            if spec in self._seen:
                repeats += 1
                self._exhausted = repeats > max(100, 10 * len(self._specs))
                continue
            repeats = 0
            self._seen.add(spec)
            self._specs.append(spec)
        return len(self._specs) > i

    def __len__(self) -> int:
        """The configurations drawn, and one more while the space gives new ones."""
        n = len(self._specs)
        return n + 1 if self._fill(n) else n

    def __getitem__(self, i: int) -> Any:
        if not self._fill(i):
            raise IndexError(i)
        return self._specs[i]


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
