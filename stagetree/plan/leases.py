"""Leases: how engines that share a plan storage divide the work between them.

A *stage lease* says "owner ``owner`` is training steps ``[start, stop)`` of node
``node`` of tree ``scope``" until ``expires`` (``time.time()`` of the process that
wrote it). A *study lease* (``node is None``, ``scope`` = the study's name) says "owner
``owner`` is tuning this study". An owner (one engine) renews all its leases with a
heartbeat; when it dies they expire and count as gone. The rules every backend
follows, in one place:

* :func:`overlaps`: two stage leases conflict when they are on the same node and their
  step ranges intersect; study leases conflict when they name the same study.
* A claim is atomic: either every requested segment is granted, or none is and the
  live leases of other owners that stand in the way are returned.
* Expired leases are ignored by claims and by :meth:`leases` with ``live_only``.
* A lease outlives the outages its storage rides through (:func:`outage_proof_ttl`):
  while the database is out of reach its holder cannot renew it, and a lease that
  expired during the outage would let another engine take the stage the moment the
  database is back, while the holder still trains it.
* A lease whose holder is a dead process of this machine is ignored by claims at once
  (:meth:`Lease.live`): a run killed with ``kill -9`` can be resumed without waiting
  for its leases to expire. "This machine" is the owner's machine key (:func:`new_owner`:
  host name, boot and process-id namespace), so a process of another container that
  shares the host name is never taken for a dead one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ClaimResult",
    "Lease",
    "host_pid",
    "new_owner",
    "outage_proof_ttl",
    "overlaps",
    "stage_conflicts",
    "study_conflicts",
]


@dataclass(frozen=True)
class Lease:
    """A claim of one owner on part of the plan (see the module docstring).

    Attributes:
        id: unique id (storage-wide).
        owner: the engine holding it (a random id per engine).
        scope: the root key of a stage lease, the study name of a study lease.
        node: the plan node of a stage lease; None for a study lease.
        start: first step trained (stage lease; 0 for a study lease).
        stop: step after the last one trained (stage lease; 0 for a study lease).
        host: host name of the owner's process.
        pid: process id of the owner.
        created: ``time.time()`` when it was granted.
        expires: ``time.time()`` after which it is gone unless renewed.
    """

    id: int
    owner: str
    scope: str
    node: int | None
    start: int
    stop: int
    host: str
    pid: int
    created: float
    expires: float

    def live(self, now: float) -> bool:
        """Unexpired, and not held by a dead process of this machine."""
        return self.expires > now and not self.holder_dead()

    def holder_dead(self) -> bool:
        """Whether the owner is a process of this machine (same machine key) that no
        longer runs; False whenever that cannot be told."""
        _, _, key = self.owner.rpartition("@")
        if key != machine_key() or self.host != socket.gethostname():
            return False
        return not _running(self.pid)

    def describe(self) -> str:
        """Who holds it, for messages: ``host:pid``."""
        return f"{self.host}:{self.pid}"


@dataclass(frozen=True)
class ClaimResult:
    """What :meth:`~stagetree.plan.BasePlanStorage.claim` did: ``granted`` leases (all
    the segments asked for) or, when another owner holds a live overlapping lease,
    nothing granted and those ``conflicts``."""

    granted: tuple[Lease, ...] = ()
    conflicts: tuple[Lease, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.conflicts


def overlaps(lease: Lease, node: int, start: int, stop: int) -> bool:
    """True when stage ``lease`` covers some step of ``[start, stop)`` of ``node``."""
    return lease.node == node and lease.start < stop and start < lease.stop


def stage_conflicts(
    leases: Iterable[Lease], owner: str, segments: Iterable[tuple[int, int, int]], now: float
) -> list[Lease]:
    """Live stage leases of owners other than ``owner`` that overlap ``segments``."""
    segs = [s for s in segments if s[2] > s[1]]
    return [
        lease
        for lease in leases
        if lease.owner != owner
        and lease.node is not None
        and lease.live(now)
        and any(overlaps(lease, n, a, b) for n, a, b in segs)
    ]


def study_conflicts(leases: Iterable[Lease], owner: str, study: str, now: float) -> list[Lease]:
    """Live study leases on ``study`` of owners other than ``owner``."""
    return [
        lease
        for lease in leases
        if lease.node is None and lease.scope == study and lease.owner != owner and lease.live(now)
    ]


def outage_proof_ttl(window: float, least: float) -> float:
    """The lease time-to-live of an engine whose plan storage rides through outages of
    up to ``window`` seconds (:attr:`~stagetree.plan.base.BasePlanStorage.retry_seconds`):
    at least ``least``, and twice the window, so that a lease renewed (every fifth of
    its time-to-live) just before an outage is still live when the outage ends at the
    window's edge, with the last slow try (a connection attempt) inside it too. A holder
    that rides an outage through so keeps every stage it was training."""
    return max(least, 2.0 * window)


@functools.cache
def machine_key() -> str:
    """12 hex digits that name this machine's processes: the host name, the boot and
    the process-id namespace (two containers with one host name differ)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as fh:
        parts.append(fh.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def new_owner() -> str:
    """A new lease owner id: random, with this machine's key (``<hex>@<key>``), so that
    a process of this machine can tell its dead holders (:meth:`Lease.holder_dead`)."""
    return f"{uuid.uuid4().hex}@{machine_key()}"


def _running(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id: cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def host_pid() -> tuple[str, int]:
    """This process's host name and pid (recorded with its leases)."""
    return socket.gethostname(), os.getpid()
