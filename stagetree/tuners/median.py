"""Median stopping (the Google Vizier rule)."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from itertools import islice
from typing import Any

from stagetree.exceptions import TunerError
from stagetree.ranking import signed_value
from stagetree.tuners.base import Job, ReplayingRunner, Tuner, check_int, draw_specs

__all__ = ["MedianStopping"]

# Which other trials' running averages the median is taken over (see the class doc).
_COMPARE = ("completed", "reached")


class MedianStopping(Tuner):
    """Train trials in chunks of ``eval_every`` steps; stop the ones below the median.

    Each chunk resubmits the trial with ``eval_every`` more steps (the study resumes
    it). After a chunk ending at step ``s >= grace_steps``, the trial stops when its
    best value so far (over its known metrics at steps ``<= s``) is strictly worse than
    the median of the *running averages* (mean over steps ``<= s``) of the other
    trials that count as samples:

    * ``compare="completed"`` (the default): the trials that *completed*, i.e. trained
      to ``steps`` without being stopped -- the rule as Google Vizier defines it (and
      Ray Tune's ``MedianStoppingRule``). Nothing stops before ``min_samples`` trials
      have completed.
    * ``compare="reached"``: every other trial that has reached step ``s`` (running,
      completed or stopped), which stops bad trials sooner, on fewer samples.

    The rule needs at least ``min_samples`` samples. Non-finite values are left out of
    running averages; a trial whose values are all non-finite has the worst possible
    best value and stops at its first check. A failed chunk ends its trial.

    The values are the trials' learning curves (``TrialResult.history``): with the
    study's ``eval_every`` (``Study(eval_every=1)``, the default) every step of a
    chunk counts, not only its last one, so a running average is not at the mercy of
    one noisy evaluation at the chunk's end. The tuner's own ``eval_every`` is the
    chunk length, i.e. how often the rule is applied.

    At most ``max_concurrent`` (default: the runner's worker count) trials train at
    once; a stopped or finished trial frees its slot for the next configuration. On a
    grid, configurations are taken in an order shuffled by ``seed``. After ``run``,
    :attr:`stopped` lists ``(trial id, step)`` of every stopped trial.

    ``sampler``: an Optuna sampler (``optuna.samplers.TPESampler(seed=0)``, ...) that
    proposes the configurations instead of ``space.sample`` (see
    :mod:`stagetree.tuners.optuna_bridge`). Each new configuration is asked
    when a slot frees, after the results before it were told; stopped trials are told
    ``PRUNED``.
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        steps: int,
        num_trials: int,
        grace_steps: int = 0,
        eval_every: int = 1,
        min_samples: int = 3,
        seed: int = 0,
        max_concurrent: int | None = None,
        sampler: Any = None,
        compare: str = "completed",
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        if compare not in _COMPARE:
            raise TunerError(f"compare must be one of {_COMPARE}, got {compare!r}")
        self.compare = compare
        self.space = space
        self._use_sampler(sampler, space)
        self.steps = check_int("steps", steps, 1)
        self.num_trials = check_int("num_trials", num_trials, 1)
        self.grace_steps = check_int("grace_steps", grace_steps, 0)
        self.eval_every = check_int("eval_every", eval_every, 1)
        self.min_samples = check_int("min_samples", min_samples, 1)
        if grace_steps > steps:
            raise TunerError(f"grace_steps must be <= steps, got {grace_steps} > {steps}")
        self.stopped: list[tuple[int, int]] = []
        self._history: dict[int, dict[int, float]] = {}
        self._completed: set[int] = set()  # trials trained to ``steps``, not stopped
        self._reset_samples()

    def _reset_samples(self) -> None:
        # compare="completed": completed trials in the order they completed, and per
        # checked step the sorted running averages of the first ``n`` of them (their
        # histories no longer change), so a check costs a bisect, not a scan of all.
        self._done_order: list[int] = []
        self._known: set[int] = set()
        self._known_of: set[int] | None = None  # the ``_completed`` set they come from
        self._samples: dict[int, tuple[int, list[float]]] = {}
        self._reset_reached()

    def _reset_reached(self) -> None:
        # compare="reached": per checked step the sorted running averages of the trials
        # that reached it, and each trial's average per checked step it counts in; kept
        # up to date from the trials whose history changed (``_changed``: trial -> the
        # lowest step that changed) and the trials added since, so a check costs a
        # bisect, not a scan of every trial.
        self._reached_of: dict[int, dict[int, float]] | None = None
        self._reached_count = 0  # trials of ``_reached_of`` seen
        self._reached: dict[int, list[float]] = {}
        self._counted: dict[int, dict[int, float]] = {}
        self._changed: dict[int, int] = {}

    @property
    def horizon(self) -> int:
        return self.steps

    def _merge(self, tid: int, job: Job) -> None:
        """Add the job's known metrics to the trial's history (as rank values)."""
        result = job.result()
        if result is None:
            return
        hist = self._history.setdefault(tid, {})
        low = math.inf  # the lowest step whose value changed
        for key, metrics in result.history.items():
            step = int(key)  # JSON storage may give string keys
            if step <= result.steps and self.metric in metrics:
                low = _put(hist, step, self._rank_value(metrics[self.metric]), low)
        low = _put(hist, result.steps, self.value(result), low)
        if low < self._changed.get(tid, math.inf):
            self._changed[tid] = int(low)

    def _rank_value(self, raw: Any) -> float:
        return signed_value(raw, self.mode)

    def _complete(self, tid: int) -> None:
        """Trial ``tid`` trained to ``steps`` without being stopped."""
        self._completed.add(tid)
        self._sync()

    def _sync(self) -> None:
        """``_done_order`` up to date with ``_completed`` (which may also be set as a
        whole)."""
        completed = self._completed
        if completed is self._known_of and len(completed) == len(self._known):
            return
        if not self._known <= completed:
            self._reset_samples()
        self._known_of = completed
        for tid in sorted(completed - self._known):
            self._known.add(tid)
            self._done_order.append(tid)

    @staticmethod
    def _average(hist: dict[int, float], step: int) -> float | None:
        """Running average of a history at ``step`` (finite values only; None: none)."""
        vals = [v for s, v in hist.items() if s <= step and v > -math.inf]
        return sum(vals) / len(vals) if vals else None

    def _completed_averages(self, tid: int, step: int) -> list[float]:
        """Sorted running averages at ``step`` of the completed trials other than
        ``tid`` that reached it (what the scan over every trial gives, sorted)."""
        self._sync()
        n, averages = self._samples.get(step, (0, []))
        for other in self._done_order[n:]:
            hist = self._history.get(other)
            if hist and max(hist) >= step:
                avg = self._average(hist, step)
                if avg is not None:
                    insort(averages, avg)
        self._samples[step] = (len(self._done_order), averages)
        if tid in self._completed:  # not the case in a run: a completed trial stops
            hist = self._history.get(tid)
            avg = None if not hist or max(hist) < step else self._average(hist, step)
            if avg is not None:
                averages = list(averages)
                averages.remove(avg)
        return averages

    def should_stop(self, tid: int, step: int) -> bool:
        """The median rule for trial ``tid`` after ``step`` steps (see the class doc)."""
        own = [v for s, v in self._history.get(tid, {}).items() if s <= step]
        best = max(own, default=-math.inf)
        if self.compare == "completed":
            averages = self._completed_averages(tid, step)
            if len(averages) < self.min_samples:
                return False
            # The median of sorted data, as ``statistics.median`` takes it.
            n = len(averages)
            i = n // 2
            median = averages[i] if n % 2 else (averages[i - 1] + averages[i]) / 2
            return best < median
        averages, mine = self._reached_averages(tid, step)
        n = len(averages) - (mine is not None)
        if n < self.min_samples:
            return False
        # The median of the sorted averages without the trial's own one (at ``skip``),
        # as ``statistics.median`` takes it.
        skip = len(averages) if mine is None else bisect_left(averages, mine)

        def at(i: int) -> float:
            return averages[i if i < skip else i + 1]

        i = n // 2
        median = at(i) if n % 2 else (at(i - 1) + at(i)) / 2
        return best < median

    def _reached_averages(self, tid: int, step: int) -> tuple[list[float], float | None]:
        """The sorted running averages at ``step`` of every trial that reached it, and
        trial ``tid``'s own among them (None: it has none): what a scan of every trial
        gives, ``tid``'s included. Kept up to date from the histories that ``_merge``
        changed and the trials added to ``_history`` since the last check (a run
        changes them only so); a new ``_history`` dict is read from scratch."""
        history = self._history
        if history is not self._reached_of:
            self._reset_reached()
            self._reached_of = history
        added = len(history) - self._reached_count
        if added > 0:  # trials come to the end of the dict: the last ``added`` are new
            for other in islice(reversed(history), added):
                self._changed[other] = -1
            self._reached_count = len(history)
        for other, low in self._changed.items():
            for s in self._reached:
                if s >= low:
                    self._recount(other, s)
        self._changed.clear()
        if step not in self._reached:
            self._reached[step] = []
            for other in history:
                self._recount(other, step)
        return self._reached[step], self._counted.get(tid, {}).get(step)

    def _recount(self, tid: int, step: int) -> None:
        """Trial ``tid``'s running average at ``step`` in the sorted averages of the
        trials that reached it, as its history is now."""
        hist = self._history.get(tid)
        avg = None if not hist or max(hist) < step else self._average(hist, step)
        counted = self._counted.setdefault(tid, {})
        old = counted.get(step)
        if old == avg:
            return
        averages = self._reached[step]
        if old is not None:
            del averages[bisect_left(averages, old)]
            del counted[step]
        if avg is not None:
            insort(averages, avg)
            counted[step] = avg

    async def _search(self, ctx: ReplayingRunner) -> None:
        specs = draw_specs(
            self.space, self.num_trials, self.seed, shuffle_grid=True, sampler=self._bridge
        )
        ctx.declare(specs)  # nothing for a sampler's lazy specs: declared one by one
        self.stopped = []
        self._history = {}
        self._completed = set()
        self._reset_samples()
        in_flight: set[Job] = set()
        while True:
            while len(in_flight) < self._workers(ctx) and len(self.trials) < len(specs):
                spec = specs[len(self.trials)]
                if self._bridge is not None:
                    ctx.declare([spec])
                trial = self._new_trial(spec.config, spec.hp)
                in_flight.add(ctx.submit(trial, min(self.eval_every, self.steps)))
            if not in_flight:
                return
            job = await ctx.wait_first(in_flight)
            in_flight.discard(job)
            self._observe(job)
            tid = job.trial.id
            if job.status != "ok":
                continue
            self._merge(tid, job)
            if job.steps >= self.steps:
                self._complete(tid)
                continue
            if job.steps >= self.grace_steps and self.should_stop(tid, job.steps):
                self.stopped.append((tid, job.steps))
                ctx.record("stop", trial=tid, steps=job.steps)
                self._prune(tid)
                continue
            nxt = min(job.steps + self.eval_every, self.steps)
            in_flight.add(ctx.submit(job.trial, nxt, "continue"))


def _put(hist: dict[int, float], step: int, value: float, low: float) -> float:
    """Set ``hist[step]``; the lowest changed step, ``low`` or ``step`` if it changed."""
    if hist.get(step) != value or step not in hist:
        hist[step] = value
        return min(low, step)
    return low
