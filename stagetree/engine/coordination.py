"""Engines that share one plan storage divide the work with leases (DESIGN semantics 5).

The :class:`Coordinator` is the engine's delegate for everything other processes may
be doing on the same storage. It runs on the engine's driver thread, under the
engine's lock:

* **Claims.** Before a ``RunBatch`` goes to the executor its segments are leased in the
  plan (:meth:`BasePlanStorage.claim`, all or none). When another live engine holds an
  overlapping lease, the batch is not run: the scheduler is told it ended without work
  and the requests it was to serve are taken out of the scheduler and *parked* (the
  waiters, the storage's references and the trial rows stay as they are).
* **Waiting.** While requests are parked, the coordinator polls the plan: metrics that
  another engine stored for a parked request resolve it (once the checkpoint there is
  durable too, or no live lease will still write it); when a conflicting lease is
  gone (released, or expired with its dead engine) or a new durable checkpoint appears
  on a parked request's tree, the requests go back to the scheduler together with every
  durable checkpoint of the tree, so work resumes from the other engine's checkpoints.
* **Nodes of other processes** (shared storages only): nodes appended to a tree this
  engine knows are fed to the scheduler, whose branch-checkpoint logic then asks
  running batches to checkpoint where the other process's trials branch off.
* **Adoption**: a pending request of another engine that lies on a stage this engine
  holds a lease on (so the other one cannot train it) is added to this scheduler,
  without a waiter, so the running batch evaluates it on its way. It is dropped again
  when its storage request is cancelled.
* **Heartbeat**: every lease of the engine is renewed every ``ttl / 5`` seconds;
  batch leases are released when the batch ends, all leases when the engine closes.

The coordinator sees its engine through :class:`CoordinationPort` only: the few engine
methods it needs, which :class:`~stagetree.engine.core.Engine` implements.

The lease time-to-live comes from ``STAGETREE_LEASE_TTL`` (seconds); when unset, 15,
or twice the plan storage's ride-through window when that is longer
(:func:`~stagetree.plan.leases.outage_proof_ttl`): the leases outlive a database outage
the engine rides through, so no other engine takes a stage this one still trains.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from stagetree.exceptions import StorageError
from stagetree.plan.base import BasePlanStorage, CheckpointRecord
from stagetree.plan.leases import ClaimResult, Lease, new_owner, outage_proof_ttl, overlaps
from stagetree.plan.model import Node, RequestState
from stagetree.scheduler import CheckpointAvailable, NodeAdded, RequestAdded, RequestCancelled
from stagetree.work import BatchDone

if TYPE_CHECKING:
    from stagetree.checkpoints import CheckpointStore
    from stagetree.scheduler import Scheduler
    from stagetree.work import RunBatch

__all__ = ["DEFAULT_TTL", "CoordinationPort", "Coordinator", "lease_ttl", "running_trials"]

_log = logging.getLogger(__name__)

DEFAULT_TTL = 15.0
GAP_SECONDS = 120.0  # how long an id skipped by the node cursor is asked for again
Key = tuple[int, int]


def lease_ttl(default: float = DEFAULT_TTL) -> float:
    """Lease time-to-live in seconds: ``STAGETREE_LEASE_TTL`` or ``default``."""
    raw = os.environ.get("STAGETREE_LEASE_TTL", "")
    try:
        ttl = float(raw) if raw else default
    except ValueError:
        ttl = default
    return ttl if ttl > 0 else default


class CoordinationPort(Protocol):
    """What a :class:`Coordinator` uses of its engine (implemented by
    :class:`~stagetree.engine.core.Engine`); called with the engine's lock held.

    Attributes:
        storage: the plan storage the engines share.
        store: the checkpoint store (whether a checkpoint is durable there).
        scheduler: the engine's scheduler, read only: its live requests and claims, and
            the checkpoints it knows.
    """

    storage: BasePlanStorage
    store: CheckpointStore
    scheduler: Scheduler

    def resolve(self, node: int, step: int, metrics: dict[str, float] | None = None) -> None:
        """Request ``(node, step)`` is done with ``metrics``: answer its waiters."""

    def apply_events(self, events: list[Any]) -> None:
        """Feed scheduler events to the scheduler and carry out its instructions."""

    def has_queued_events(self) -> bool:
        """Whether submissions wait to be planned (the coordinator polls after them)."""

    def known_roots(self) -> list[str]:
        """The plan trees the scheduler knows, sorted."""

    def knows_node(self, node: int) -> bool:
        """Whether the scheduler knows plan node ``node``."""

    def learn_node(self, node: int) -> bool:
        """Mark ``node`` known to the scheduler; False when it already was."""

    def has_waiters(self, node: int, step: int) -> bool:
        """Whether this process has submissions of request ``(node, step)``."""

    def waiting_studies(self, node: int, step: int) -> list[str]:
        """The study of each unanswered submission of request ``(node, step)``."""


class Coordinator:
    """Leases, parked requests and plan polling of one engine, seen through its
    :class:`CoordinationPort` (see the module docstring). Every method is called with
    the engine's lock held."""

    def __init__(self, engine: CoordinationPort, ttl: float | None = None) -> None:
        self.engine = engine
        self.owner = new_owner()  # carries this machine's key: dead holders are told
        window = engine.storage.retry_seconds
        self.ttl = ttl if ttl is not None else lease_ttl(outage_proof_ttl(window, DEFAULT_TTL))
        if engine.storage.shared and self.ttl <= window:
            _log.warning(
                "lease time-to-live %g s is not longer than the database's ride-through "
                "window of %g s: a stage this engine trains may be leased to another engine "
                "during a long outage (unset STAGETREE_LEASE_TTL for the safe default)",
                self.ttl,
                window,
            )
        self.poll = min(0.2, self.ttl / 10)
        self.shared = engine.storage.shared
        self._batch_leases: dict[int, tuple[Lease, ...]] = {}
        self._studies: set[str] = set()
        # request -> references taken off the scheduler, by study
        self._parked: dict[Key, dict[str, int]] = {}
        self._parked_roots: set[str] = set()
        self._waiting_on: set[int] = set()  # ids of the leases that stopped our claims
        self._adopted: set[Key] = set()
        self._last_beat = self._last_poll = time.monotonic()
        # Polling for other processes' nodes reads what was appended since the last poll
        # (ids grow with insertion), not every known tree again: a tree read whole once,
        # when it becomes known, then a cursor. An id skipped below the cursor may belong
        # to a transaction still open (PostgreSQL commits out of id order): it is asked
        # for again until it shows up or GAP_SECONDS pass (a rolled-back insert).
        self._node_cursor: int | None = None
        self._node_gaps: dict[int, float] = {}
        self._roots_read: set[str] = set()

    @property
    def storage(self) -> BasePlanStorage:
        return self.engine.storage

    @property
    def parked(self) -> dict[Key, int]:
        """Requests waiting on another engine's leases, with their reference counts."""
        return {key: sum(by_study.values()) for key, by_study in self._parked.items()}

    # -- batches -------------------------------------------------------------------------

    def claim(self, batch: RunBatch, granted: Callable[[], None] | None = None) -> list[Any]:
        """Lease the segments of ``batch``. Returns [] when granted (run it); otherwise
        the scheduler events that undo the batch and park its requests.

        One transaction: the reads of what other engines did meanwhile, the lease, and
        ``granted`` (storage writes of the batch's start, made only when the lease is
        granted: the trials it starts marked running). It may run again on a transient
        failure, so ``granted`` writes only."""
        storage = self.storage
        segments = [(s.node, s.start, s.stop) for s in batch.segments]

        def tx() -> tuple[dict[Key, dict[str, float]], list[Any], ClaimResult | None]:
            live = [key for key in batch.evaluate_at if self.engine.scheduler.is_live(key)]
            # One read of the checkpoint records serves both questions (by the nodes'
            # key); metrics are read only where a record is found (rarely: the batch
            # is about to train there).
            nodes = {n for n, _ in live} | ({n for n, _, _ in segments} if self.shared else set())
            on = storage.checkpoints_on(sorted(nodes)) if nodes else {}
            known, newer = self._answered(live, on), []
            if not known:
                newer = self._checkpoints_on(segments, on)
            if known or newer:
                return known, newer, None
            result = storage.claim(self.owner, batch.root_key, segments, self.ttl)
            if result.ok and granted is not None:
                granted()
            return known, newer, result

        known, newer, result = storage.atomically(tx)
        if known:
            for key, metrics in known.items():
                self.engine.resolve(key[0], key[1], metrics=metrics)
            claims = self.engine.scheduler.live_claims
            undo: list[Any] = [
                RequestCancelled(k[0], k[1], n, study=study)
                for k in known
                for study, n in sorted(claims.get(k, {}).items())
            ]
            return [*undo, BatchDone(batch.batch_id, batch.worker, 0.0, 0)]
        if newer:  # another engine got further along this path: start from there
            return [*newer, BatchDone(batch.batch_id, batch.worker, 0.0, 0)]
        assert result is not None
        _log.debug("claim %s of batch %d: %s", segments, batch.batch_id, result.ok)
        if result.ok:
            self._batch_leases[batch.batch_id] = result.granted
            self._last_beat = time.monotonic()
            return []
        events: list[Any] = []
        claims = self.engine.scheduler.live_claims
        live = self.engine.scheduler.live_requests
        for key in batch.evaluate_at:
            if live.get(key, 0):
                parked = self._parked.setdefault(key, {})
                for study, n in sorted(claims.get(key, {}).items()):
                    parked[study] = parked.get(study, 0) + n
                    events.append(RequestCancelled(key[0], key[1], n, study=study))
        self._parked_roots.add(batch.root_key)
        self._waiting_on.update(lease.id for lease in result.conflicts)
        events.append(BatchDone(batch.batch_id, batch.worker, 0.0, 0))
        return events

    def _answered(
        self, live: list[Key], on: Mapping[Key, CheckpointRecord]
    ) -> dict[Key, dict[str, float]]:
        """The ``live`` requests a batch evaluates whose metrics another engine stored
        meanwhile, with a checkpoint there (``on``: the records on their nodes):
        ``{(node, step): metrics}``."""
        known = {}
        for key in live:
            metrics = self.storage.get_metrics(*key) if key in on else None
            if metrics is not None:
                known[key] = metrics
        return known

    def _checkpoints_on(
        self, segments: list[tuple[int, int, int]], on: Mapping[Key, CheckpointRecord]
    ) -> list[Any]:
        """``CheckpointAvailable`` for durable checkpoints the scheduler does not know
        inside the ``segments`` about to be trained (saved by another engine); ``on``:
        the records on the segments' nodes (by the checkpoints' key, constant per claim,
        not the whole tree's: quadratic for a study in one shared tree)."""
        if not self.shared:
            return []
        known = self.engine.scheduler.checkpoints
        out: list[Any] = []
        for (node, step), rec in on.items():
            if (node, step) in known or not any(
                n == node and a < step <= b for n, a, b in segments
            ):
                continue
            if self.engine.store.exists(rec.ref):
                out.append(CheckpointAvailable(node, step, rec.ref))
        return out

    def batch_ended(
        self, batch_id: int, defer: Callable[[Callable[[], object]], None] | None = None
    ) -> None:
        """Release the leases of a batch whose checkpoints are durable; with ``defer``,
        the release is handed to it, to be written with the engine's other writes (their
        transaction writes the checkpoints' records first)."""
        leases = self._batch_leases.pop(batch_id, ())
        if leases:
            release = functools.partial(self.storage.release, self.owner, [x.id for x in leases])
            if defer is None:
                release()
            else:
                defer(release)

    # -- studies -------------------------------------------------------------------------

    def claim_study(self, study: str) -> Lease | None:
        """Lease ``study`` to this engine; returns the live lease of the other engine
        that holds it, or None when granted."""
        result = self.storage.claim_study(self.owner, study, self.ttl)
        if not result.ok:
            return result.conflicts[0]
        self._studies.add(study)
        return None

    def release_study(self, study: str) -> None:
        """Drop the lease on ``study`` (a storage error leaves it to expire)."""
        if study not in self._studies:
            return
        self._studies.discard(study)
        with contextlib.suppress(StorageError):
            ids = [
                lease.id
                for lease in self.storage.leases(study)
                if lease.owner == self.owner and lease.node is None
            ]
            if ids:
                self.storage.release(self.owner, ids)

    # -- polling -------------------------------------------------------------------------

    def tick(self) -> None:
        """Heartbeat and plan polling; cheap when there is nothing to do (throttled)."""
        now = time.monotonic()
        if (self._batch_leases or self._studies) and now - self._last_beat >= self.ttl / 5:
            self._last_beat = now
            self.storage.renew(self.owner, self.ttl)
        if now - self._last_poll < self.poll or self.engine.has_queued_events():
            return  # submissions are applied first: the scheduler knows their roots then
        self._last_poll = now
        events: list[Any] = []
        if self.shared:
            events.extend(self._new_nodes())
        if self._parked:
            events.extend(self._unpark())
        if self.shared and (self._batch_leases or self._adopted):
            events.extend(self._adopt())
        if events:
            self.engine.apply_events(events)

    def foreign_nodes(self, queued: list[Any]) -> list[Any]:
        """Nodes other processes added to the trees of ``queued`` submission events, to
        be planned with them (so the first batches already checkpoint where the other
        processes' trials branch off)."""
        return self._new_nodes() if self.shared else []

    def _new_nodes(self) -> list[Any]:
        """``NodeAdded`` for nodes other processes appended to trees this engine knows."""
        engine = self.engine
        storage = self.storage
        known = engine.known_roots()
        if self._node_cursor is None:  # first poll: trees are read whole from here on
            self._node_cursor = storage.last_node_id()
        found: list[Node] = []
        for root in known:
            if root not in self._roots_read:  # newly known: its nodes so far, once
                self._roots_read.add(root)
                found.extend(storage.nodes(root))
        now = time.monotonic()
        appended = storage.nodes_after(self._node_cursor, self._node_gaps)
        if appended:
            seen = {node.id for node in appended}
            for node_id in seen:
                self._node_gaps.pop(node_id, None)
            top = max(seen)
            for node_id in range(self._node_cursor + 1, top):
                if node_id not in seen:
                    self._node_gaps[node_id] = now
            self._node_cursor = max(self._node_cursor, top)
        for node_id, since in list(self._node_gaps.items()):
            if now - since > GAP_SECONDS:
                del self._node_gaps[node_id]
        roots = set(known)
        events: list[Any] = []
        for node in found + appended:
            if node.root_key in roots and engine.learn_node(node.id):
                events.append(NodeAdded(node))
        return events

    def _new_checkpoints(self) -> list[Any]:
        """``CheckpointAvailable`` for durable checkpoints on the parked requests' trees
        that the scheduler does not know (saved by other engines)."""
        engine = self.engine
        known = engine.scheduler.checkpoints
        events: list[Any] = []
        for root in sorted(self._parked_roots):
            for (node, step), rec in self.storage.checkpoints(root).items():
                if (
                    known.get((node, step)) != rec.ref
                    and engine.knows_node(node)
                    and engine.store.exists(rec.ref)
                ):
                    events.append(CheckpointAvailable(node, step, rec.ref))
        return events

    def _settled(self, key: Key, foreign: list[Lease]) -> bool:
        """Whether another engine's metrics of ``key`` settle it: its checkpoint is
        durable too, or no live lease of another engine will still write it (a finished
        request finds its model on disk whenever one was promised)."""
        if self.storage.checkpoint(*key) is not None:
            return True
        return not any(overlaps(lease, key[0], key[1] - 1, key[1]) for lease in foreign)

    def _unpark(self) -> list[Any]:
        engine = self.engine
        foreign = [
            lease
            for root in self._parked_roots
            for lease in self.storage.leases(root)
            if lease.owner != self.owner
        ]
        for key in list(self._parked):
            metrics = self.storage.get_metrics(*key)
            req = self.storage.request(*key)
            if metrics is not None and self._settled(key, foreign):
                del self._parked[key]
                engine.resolve(key[0], key[1], metrics=metrics)
            elif req is None or req.state == RequestState.CANCELLED:
                del self._parked[key]  # nobody wants it any more
        if not self._parked:
            self._parked_roots.clear()
            self._waiting_on.clear()
            return []
        events = self._new_checkpoints()
        live = {lease.id for root in self._parked_roots for lease in self.storage.leases(root)}
        if not events and self._waiting_on <= live:
            return []  # nothing changed: keep waiting
        _log.debug("unpark %s", sorted(self._parked))
        for (node, step), by_study in sorted(self._parked.items()):
            waiters = engine.waiting_studies(node, step)
            for study, count in sorted(by_study.items()):
                waiting = sum(w == study for w in waiters)
                n = min(count, waiting) if waiting else count
                events.append(RequestAdded(node, step, n, study=study))
        self._parked.clear()
        self._parked_roots.clear()
        self._waiting_on.clear()
        return events

    def _adopt(self) -> list[Any]:
        """Pending requests of other engines on stages this engine holds (see the module
        docstring); and adopted requests nobody wants any more are dropped.

        One read a poll: the requests on the leased nodes and on those of the adopted
        requests (a lease covers steps of one node, so no other request can lie inside
        it), by the requests' primary key, whatever the number of trees or the study's
        size."""
        engine = self.engine
        live = engine.scheduler.live_requests
        self._adopted &= set(live)
        leases = [lease for held in self._batch_leases.values() for lease in held]
        nodes = {lease.node for lease in leases if lease.node is not None}
        found = self.storage.requests_on(nodes | {key[0] for key in self._adopted})
        by_key = {(req.node, req.step): req for req in found}
        events: list[Any] = []
        for key in sorted(self._adopted):
            req = by_key.get(key)
            if (req is None or req.state == RequestState.CANCELLED) and not engine.has_waiters(
                *key
            ):
                self._adopted.discard(key)
                claims = engine.scheduler.live_claims.get(key, {})
                events.extend(
                    RequestCancelled(key[0], key[1], n, study=study)
                    for study, n in sorted(claims.items())
                )
        wanted = (RequestState.PENDING, RequestState.SCHEDULED)
        for req in found:
            key = (req.node, req.step)
            if req.state not in wanted or req.node not in nodes:
                continue
            if key in live or engine.has_waiters(*key) or not engine.knows_node(key[0]):
                continue
            if any(overlaps(lease, req.node, req.step - 1, req.step) for lease in leases):
                self._adopted.add(key)
                events.append(RequestAdded(key[0], key[1]))
                _log.debug("adopt request %s", key)
        return events

    # -- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Release every lease of this engine (batches and studies)."""
        self._batch_leases.clear()
        self._studies.clear()
        with contextlib.suppress(StorageError):  # else they expire by themselves
            self.storage.release(self.owner)


def running_trials(storage: BasePlanStorage, trials: Iterable[Mapping[str, Any]]) -> set[int]:
    """Ids of the unfinished trials whose path a live stage lease covers: the trials some
    live engine is training right now (read-only; a trial row left ``running`` by an
    engine that was killed is not among them once its leases expired)."""
    out: set[int] = set()
    by_root: dict[str, list[Lease]] = {}
    for t in trials:
        if t.get("state") in ("done", "failed", "cancelled") or t.get("node") is None:
            continue
        root = str(t["root_key"])
        if root not in by_root:
            by_root[root] = [x for x in storage.leases(root) if x.node is not None]
        leases = by_root[root]
        if not leases:
            continue
        path: Sequence[Any] = storage.path(int(t["node"]))
        for i, node in enumerate(path):
            lo = node.branch_step
            hi = path[i + 1].branch_step if i + 1 < len(path) else int(t["step"])
            if any(overlaps(lease, node.id, lo, max(hi, lo + 1)) for lease in leases):
                out.add(int(t["id"]))
                break
    return out
