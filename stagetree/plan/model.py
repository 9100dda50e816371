"""Plain records of the search plan, shared by storages, the stage-tree builder and
the scheduler. They carry no behaviour and no I/O."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["ACTIVITY_KINDS", "ActivityRecord", "Node", "NodeLink", "Request", "RequestState"]


class RequestState(str, enum.Enum):
    """Life cycle of a request ``(node, step)``.

    pending -> scheduled -> done | failed; any non-final state -> cancelled when its
    reference count drops to zero; a cancelled or failed request becomes pending again
    when a new reference arrives.
    """

    PENDING = "pending"
    SCHEDULED = "scheduled"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Node:
    """One configuration in a plan tree.

    Attributes:
        id: storage-wide unique id (ints grow with insertion order).
        root_key: the tree this node belongs to.
        parent: parent node id, None for the tree's root.
        branch_step: first step trained under this node's ``hp`` (0 for the root; a
            child may branch at its parent's own branch step). Steps before it are the
            parent's.
        hp: the sequences (``stagetree.hp.Sequence``) this node follows from
            ``branch_step`` on, by hyper-parameter name.

    The model "after S steps" along a path lives at the deepest node of the path whose
    ``branch_step < S`` (the root for S == 0): checkpoints, metrics and requests are
    keyed by that canonical ``(node, S)``.
    """

    id: int
    root_key: str
    parent: int | None
    branch_step: int
    hp: Mapping[str, Any] = field(hash=False, compare=False)


class NodeLink(NamedTuple):
    """Where a node of a plan tree hangs (:meth:`BasePlanStorage.node_links
    <stagetree.plan.BasePlanStorage.node_links>`): its ``id``, ``parent`` and
    ``branch_step`` as :class:`Node` has them, without its sequences: all that
    :func:`~stagetree.plan.tree.path_segments` walks."""

    id: int
    parent: int | None
    branch_step: int


@dataclass
class Request:
    """A request for the model and metrics of ``node`` after ``step`` steps."""

    node: int
    step: int
    refcount: int = 1
    state: RequestState = RequestState.PENDING
    error: str | None = None


#: Kinds of :class:`ActivityRecord`, in a batch's life: it starts, saves checkpoints,
#: and ends done, failed or with its worker lost.
ACTIVITY_KINDS = ("start", "save", "done", "failed", "lost")


@dataclass(frozen=True)
class ActivityRecord:
    """One thing a worker did, as the engine that ran it recorded it (append-only; the
    dashboard's workers timeline and "training now" read it).

    A batch is identified by ``(owner, batch)``: ``owner`` is the engine's id (the
    owner of its leases), ``batch`` the engine's batch id.

    Attributes:
        seq: position in the storage's activity log (grows with every record).
        kind: one of :data:`ACTIVITY_KINDS`.
        worker: the executor's worker index.
        root_key: the tree the batch trains.
        node, step: for "save", the checkpoint's canonical key; else None.
        time: ``time.time()`` when the engine learnt of it.
        seconds: "save": the save's duration; "done": the batch's busy seconds.
        data: "start": ``{"segments": [[node, start, stop], ...], "start_step",
            "stop_step", "location"}`` (and ``"fused"``: the width of a fused job);
            "save": ``{"nbytes"}``; "done": ``{"steps", "load_seconds",
            "save_wait_seconds"}``; "failed": ``{"error"}``; "lost": ``{"reason"}``.
    """

    seq: int
    owner: str
    batch: int
    kind: str
    worker: int
    root_key: str
    node: int | None
    step: int | None
    time: float
    seconds: float
    data: Mapping[str, Any] = field(hash=False, compare=False)
