"""What an engine writes down besides results: the activity records of its batches (the
dashboard's timeline), learning-curve points, and each study's share of the work.

The :class:`Ledger` buffers records, curve points and per-study counts, and the
engine's other writes that nothing reads before the round ends (a checkpoint's record,
a metric, a lease's release: :meth:`Ledger.defer`), and writes them all in one
transaction (:meth:`Ledger.flush`) once per round of the engine's driver (counts alone
at most every :data:`COUNTS_EVERY` seconds while only progress is reported), before any
event that could read them, or inside the transaction of a trial's end
(:meth:`Ledger.kept` and :meth:`Ledger.write`, then :meth:`Ledger.written`); it is
called with the engine's lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stagetree.exceptions import StagetreeError
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.scopes import study_scope

__all__ = ["COUNTS_EVERY", "Kept", "Ledger"]

logger = logging.getLogger("stagetree")

#: Seconds between writes of the per-study counts while a round brings progress only.
COUNTS_EVERY = 1.0


class _Curves:
    """Learning-curve points kept together, written in one call (in their place among
    the engine's other deferred writes: a metric reported after them lands after them)."""

    __slots__ = ("points", "storage")

    def __init__(self, storage: BasePlanStorage) -> None:
        self.storage = storage
        self.points: list[Any] = []

    def __call__(self) -> None:
        self.storage.put_metrics_many(self.points)


@dataclass(frozen=True)
class Kept:
    """What one transaction writes of what the ledger kept (:meth:`Ledger.kept`): the
    first ``deferred`` and ``activity`` items of its lists, and its counts when
    ``counts`` is not None. Written again as it is when the transaction runs again."""

    deferred: tuple[Callable[[], object], ...]
    counts: dict[str, dict[str, float]] | None
    activity: tuple[dict[str, Any], ...]

    def __bool__(self) -> bool:
        return bool(self.deferred or self.counts or self.activity)


class Ledger:
    """Activity records, curve points and per-study accounting of one engine.

    Args:
        storage: the plan storage they go to.
        owner: the engine's lease owner, which its activity records carry.
        clock: the time of an activity record (the executor's clock: virtual when
            simulated).

    Attributes:
        study_versions: the trainer version of each study name the engine serves (the
            scheduler charges steps by name; the counters are kept per version).
    """

    def __init__(self, storage: BasePlanStorage, owner: str, clock: Callable[[], float]) -> None:
        self.storage = storage
        self.owner = owner
        self._clock = clock
        self.study_versions: dict[str, str] = {}
        self._activity: list[dict[str, Any]] = []  # activity records not written yet
        # per-study step counts not written yet, {scope: {counter: delta}}: one
        # transaction per round of events, not one per progress report
        self._counts: dict[str, dict[str, float]] = {}
        self._counts_at = float("-inf")  # clock time of the last write of counts
        self._deferred: list[Callable[[], object]] = []  # the engine's writes, in order

    def defer(self, write: Callable[[], object]) -> None:
        """Keep a storage write of the engine for the next :meth:`flush` (or the next
        trial end's transaction): nothing reads it before then. It may run twice when
        its transaction is rolled back and run again."""
        self._deferred.append(write)

    def kept(self, every: float = 0.0) -> Kept:
        """What is kept, for one transaction: the counts only when anything else goes
        too or ``every`` seconds passed since their last write (see
        :meth:`write_counts`)."""
        counts: dict[str, dict[str, float]] | None = None
        others = bool(self._deferred or self._activity)
        if self._counts and (others or every <= 0 or self._clock() - self._counts_at >= every):
            counts = self._counts
        return Kept(tuple(self._deferred), counts, tuple(self._activity))

    def write(self, kept: Kept) -> None:
        """Write ``kept`` (inside the caller's transaction)."""
        for write in kept.deferred:
            write()
        if kept.counts:
            self.storage.add_stats_many(kept.counts)
        if kept.activity:
            self.storage.record_activity(list(kept.activity))

    def written(self, kept: Kept) -> None:
        """``kept`` is committed: drop it (what was kept meanwhile stays)."""
        del self._deferred[: len(kept.deferred)]
        del self._activity[: len(kept.activity)]
        if kept.counts is not None:
            self._counts = {}
            self._counts_at = self._clock()

    def flush(self, every: float = 0.0) -> None:
        """Write what is kept in one transaction (nothing when nothing is due). Activity
        records alone are informative: a storage error then is logged, and training
        goes on."""
        kept = self.kept(every)
        if not kept:
            return
        try:
            self.storage.atomically(lambda: self.write(kept))
        except StagetreeError as exc:
            if kept.deferred or kept.counts:
                raise
            logger.warning("worker activity not recorded: %s", exc)
        self.written(kept)

    def note(self, kind: str, batch: int, worker: int, root_key: str, **fields: Any) -> None:
        """Keep one activity record for the storage (:class:`~stagetree.plan.model.ActivityRecord`),
        written with the others of this round by :meth:`write_activity`."""
        now = self._clock()
        self._activity.append(
            {
                "owner": self.owner,
                "batch": batch,
                "kind": kind,
                "worker": worker,
                "root_key": root_key,
                "time": now,
                **fields,
            }
        )

    def write_activity(self) -> None:
        """Store the activity records kept since the last write (informative only: a
        storage error is logged, and training goes on)."""
        if not self._activity:
            return
        items, self._activity = self._activity, []
        try:
            self.storage.record_activity(items)
        except StagetreeError as exc:
            logger.warning("worker activity not recorded: %s", exc)

    def add_curves(self, points: Iterable[Any]) -> None:
        """Keep learning-curve points for the next write of what is kept."""
        last = self._deferred[-1] if self._deferred else None
        if not isinstance(last, _Curves):
            last = _Curves(self.storage)
            self._deferred.append(last)
        last.points.extend(points)

    def count(self, scope: str, **deltas: float) -> None:
        """Add ``deltas`` to the counters of ``scope`` with the round's other counts
        (written by :meth:`write_counts`): what a checkpoint or a batch's end adds to
        the storage's, the tree's and the studies' counters is then no transaction of
        its own."""
        kept = self._counts.setdefault(scope, {})
        for key, delta in deltas.items():
            kept[key] = kept.get(key, 0.0) + float(delta)

    def write_counts(self, every: float = 0.0) -> None:
        """Store the per-study counts kept by :meth:`count_studies` since the last write
        (one transaction). With ``every``, only once ``every`` seconds have passed on
        the engine's clock since the last write: a round of progress reports alone is
        then not a transaction (workers that report at different times made one a
        report); what ends a trial writes them first, unthrottled."""
        if not self._counts:
            return
        now = self._clock()
        if every > 0 and now - self._counts_at < every:
            return
        self._counts_at = now
        counts, self._counts = self._counts, {}
        self.storage.add_stats_many(counts)

    def count_studies(
        self, before: Mapping[str, float], after: Mapping[str, float], rate: float
    ) -> dict[str, float]:
        """Per-study accounting (:func:`~stagetree.plan.scopes.study_scope`): the steps
        the scheduler charged to each study for the event just handled (its usage
        ``after`` minus ``before``; fair share's usage: a step every study needed counts
        for each), and their device-seconds at ``rate``, the rate of the batch the event
        is about. Returns the steps charged to each study. The counts are kept for
        :meth:`write_counts`."""
        charged: dict[str, float] = {}
        for name, steps in after.items():
            delta = steps - before.get(name, 0.0)
            version = self.study_versions.get(name)
            if delta > 0 and version is not None:
                kept = self._counts.setdefault(study_scope(name, version), {})
                kept["steps_executed"] = kept.get("steps_executed", 0.0) + delta
                kept["device_seconds"] = kept.get("device_seconds", 0.0) + delta * rate
                charged[name] = delta
        return charged
