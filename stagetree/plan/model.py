"""Plain records of the search plan, shared by storages, the stage-tree builder and
the scheduler. They carry no behaviour and no I/O."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Node", "Request", "RequestState"]


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


@dataclass(frozen=True)
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


@dataclass
class Request:
    """A request for the model and metrics of ``node`` after ``step`` steps."""

    node: int
    step: int
    refcount: int = 1
    state: RequestState = RequestState.PENDING
    error: str | None = None
