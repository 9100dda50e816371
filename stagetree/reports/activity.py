"""The batches of a storage, from its activity records: a :class:`Batch` per
``(owner, batch)`` from its ``start`` record to its end record, read whole
(:func:`batches`) or incrementally (:class:`ActivityLog`).

A batch is running while it has a ``start`` record and no end record and its owner
(an engine) still holds a live lease; an unended batch whose owner is gone is
reported ``lost`` once it is older than the lease time-to-live. A long-lived reader
(the web layer) keeps an :class:`ActivityLog`, which reads only the records written
since its last read.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagetree.engine.coordination import lease_ttl
from stagetree.reports.trials import quiet_gc

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage

__all__ = ["ActivityLog", "Batch", "batches"]

# The kinds of activity record that end a batch.
_ENDS = ("done", "failed", "lost")


@dataclass
class Batch:
    """One batch of the activity records: ``(owner, batch)`` from its ``start`` to its
    end record.

    Attributes:
        owner, batch: its identity (the engine's owner id, the engine's batch id).
        root_key: its plan tree.
        worker: the worker that ran it.
        location: where that worker ran (``host:pid``).
        segments: ``[node, from, to)`` it trains.
        start_step, stop_step: its first and end step.
        started: when it started (None when its start record is missing).
        ended: when it ended (None while it runs, or lost without a record).
        state: ``running``, ``done``, ``failed`` or ``lost``.
        busy_seconds: what it spent (its ``done`` record), or the time since it started.
        load_seconds: loading its start checkpoint.
        save_wait_seconds: waiting at its end for its background checkpoint writes
            (its ``done`` record; 0 from a stagetree that did not record it).
        steps: steps it trained (its ``done`` record).
        saves: ``(time, step, seconds)`` of each checkpoint it saved.
        last_seq: its latest activity record.
        detail: the error of a failed batch, the reason of a lost one.
        fused: the batches of the fused job it started in (1: unfused); a member's
            ``busy_seconds`` is its share of the job's time.
    """

    owner: str
    batch: int
    root_key: str
    worker: int = 0
    location: str = ""
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    start_step: int = 0
    stop_step: int = 0
    started: float | None = None
    ended: float | None = None
    state: str = "running"
    busy_seconds: float = 0.0
    load_seconds: float = 0.0
    save_wait_seconds: float = 0.0
    steps: int = 0
    saves: list[tuple[float, int, float]] = field(default_factory=list)
    last_seq: int = 0
    detail: str = ""
    fused: int = 1

    @property
    def key(self) -> str:
        """``owner/batch``: unique in the storage."""
        return f"{self.owner}/{self.batch}"

    @property
    def rate(self) -> float | None:
        """Measured seconds per trained step, None without steps."""
        if self.steps <= 0:
            return None
        return max(self.busy_seconds - self.load_seconds, 0.0) / self.steps


def _apply(batch: Batch, record: Any) -> None:
    """Fold one activity record into its batch."""
    data = record.data or {}
    batch.last_seq = max(batch.last_seq, int(record.seq))
    batch.worker = int(record.worker)
    if record.kind == "start":
        batch.started = float(record.time)
        batch.segments = [(int(n), int(a), int(b)) for n, a, b in data.get("segments", [])]
        batch.start_step = int(data.get("start_step", 0))
        batch.stop_step = int(data.get("stop_step", 0))
        batch.location = str(data.get("location", ""))
        batch.fused = int(data.get("fused", 1))
    elif record.kind == "save":
        batch.saves.append((float(record.time), int(record.step or 0), float(record.seconds)))
    elif record.kind in _ENDS:
        batch.state = record.kind
        batch.ended = float(record.time)
        batch.busy_seconds = float(record.seconds)
        if record.kind == "done":
            batch.steps = int(data.get("steps", 0))
            batch.load_seconds = float(data.get("load_seconds", 0.0))
            batch.save_wait_seconds = float(data.get("save_wait_seconds", 0.0))
        else:
            batch.detail = str(data.get("error", data.get("reason", "")))
            if not batch.busy_seconds and batch.started is not None:
                batch.busy_seconds = max(batch.ended - batch.started, 0.0)


def _live_owners(storage: BasePlanStorage) -> set[str] | None:
    """Owners holding a live lease; None for a storage of this process only (memory),
    where an unended batch is running by definition."""
    if not storage.shared:
        return None
    return {lease.owner for lease in storage.leases()}


class ActivityLog:
    """A storage's batches folded from its activity records, read incrementally: each
    :meth:`update` reads only the records after the last one it saw (the log is
    append-only), so that a dashboard following a long study does not read its whole
    history at every change. One log per storage; thread-safe."""

    def __init__(self) -> None:
        self.seq = 0  # the last record folded in
        self._batches: dict[str, Batch] = {}
        self._lock = threading.Lock()

    @quiet_gc
    def update(self, storage: BasePlanStorage, root_keys: Collection[str] | None = None) -> None:
        """Fold in the records written since the last update (of every tree, or only
        of ``root_keys`` for a log of those trees alone)."""
        with self._lock:
            for record in storage.activity(self.seq, root_keys):
                key = f"{record.owner}/{record.batch}"
                batch = self._batches.get(key)
                if batch is None:
                    batch = Batch(str(record.owner), int(record.batch), str(record.root_key))
                    self._batches[key] = batch
                _apply(batch, record)
                self.seq = max(self.seq, int(record.seq))

    def of(self, root_keys: Collection[str]) -> dict[str, Batch]:
        """The batches of these trees, in the order they started: copies of those still
        running (:func:`batches` sets their state), the ended ones as they are (they
        change no more; callers do not modify them)."""
        wanted = set(root_keys)
        with self._lock:
            return {
                k: b if b.state in _ENDS else dataclasses.replace(b, saves=list(b.saves))
                for k, b in self._batches.items()
                if b.root_key in wanted
            }


def batches(
    storage: BasePlanStorage,
    root_keys: Collection[str],
    now: float | None = None,
    log: ActivityLog | None = None,
) -> dict[str, Batch]:
    """Every batch that trained the trees ``root_keys``, by :attr:`Batch.key`, in the
    order they started. An unended batch is running while its owner holds a live lease
    (on a SQL storage), else ``lost`` once older than the lease time-to-live.

    Args:
        log: the storage's :class:`ActivityLog`, brought up to date (else the whole
            activity of those trees is read).
    """
    if not root_keys:
        return {}
    now = time.time() if now is None else now
    if log is None:
        log = ActivityLog()
        log.update(storage, list(root_keys))
    else:
        log.update(storage)
    out = log.of(root_keys)
    running = [b for b in out.values() if b.state == "running"]
    live = _live_owners(storage) if running else None
    ttl = lease_ttl()
    for batch in running:
        started = batch.started if batch.started is not None else now
        if live is not None and batch.owner not in live and now - started > ttl:
            batch.state = "lost"
            batch.detail = "its engine stopped renewing its leases"
        else:
            batch.busy_seconds = max(now - started, 0.0)
    return out
