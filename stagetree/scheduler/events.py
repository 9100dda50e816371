"""Events the study layer feeds the scheduler, and notices the scheduler gives back.

Worker and executor events (``Progress``, ``CheckpointSaved``, ...) live in
:mod:`stagetree.work`; the events here describe the plan: its roots, nodes, requests
(with the studies that hold them, and the studies' weights) and durable checkpoints.
Notices tell the study what became of its requests. All are frozen, picklable
dataclasses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.plan.model import Node
from stagetree.work import WorkerEvent

__all__ = [
    "CheckpointAvailable",
    "CheckpointLost",
    "DevicesLearned",
    "Event",
    "NodeAdded",
    "Notice",
    "PlanEvent",
    "RequestAdded",
    "RequestCancelled",
    "RequestDone",
    "RequestFailed",
    "RootAdded",
    "SaveSteps",
    "StudyWeight",
]


@dataclass(frozen=True)
class RootAdded:
    """A plan tree and its fixed config (``Trainer(config)``); before its nodes.

    ``fusible``: the sequence names that may differ between members of a fused job of
    this tree (:mod:`stagetree.fusion`); empty: its stages are never fused.
    ``devices``: the devices a stage of this tree needs (declared by its trainer, or
    learned from an out-of-memory error and kept in the plan); ``fused_width``: the widest
    fused job of this tree known to fit in device memory (0: not known)."""

    root_key: str
    config: Mapping[str, Any] = field(hash=False)
    fusible: frozenset[str] = field(default=frozenset(), hash=False)
    devices: int = 1
    fused_width: int = 0


@dataclass(frozen=True)
class NodeAdded:
    """A plan node; its parent (and root) must have been added before."""

    node: Node


@dataclass(frozen=True)
class RequestAdded:
    """``count`` new references of study ``study`` to request ``(node, step)``
    (canonical key). Several studies may hold references to one request; ``""`` is the
    anonymous study.

    A request whose metrics are already known never reaches the scheduler: the study
    answers it from the plan.
    """

    node: int
    step: int
    count: int = 1
    study: str = ""


@dataclass(frozen=True)
class RequestCancelled:
    """``count`` references of study ``study`` to request ``(node, step)`` are dropped."""

    node: int
    step: int
    count: int = 1
    study: str = ""


@dataclass(frozen=True)
class StudyWeight:
    """Study ``study`` gets device time in proportion to ``weight`` (> 0, finite) while
    it contends for workers with other studies; a study never given one weighs 1.0."""

    study: str
    weight: float


@dataclass(frozen=True)
class SaveSteps:
    """Batches of plan tree ``root_key`` checkpoint at ``steps`` where they pass them
    (added to the steps given before). A tuner's rung steps: a request there may come
    after a batch trained past it (a lower bracket's configuration on a path that a
    higher bracket's trial trains from step 0), and then starts from that checkpoint
    instead of training the prefix again."""

    root_key: str
    steps: frozenset[int] = field(hash=False)


@dataclass(frozen=True)
class CheckpointAvailable:
    """A durable checkpoint of ``(node, step)`` under ``ref`` (at start-up from the plan,
    or after the study recorded a ``CheckpointSaved``; repeats are harmless)."""

    node: int
    step: int
    ref: str


@dataclass(frozen=True)
class CheckpointLost:
    """The checkpoint of ``(node, step)`` is gone (evicted or corrupt)."""

    node: int
    step: int


@dataclass(frozen=True)
class RequestDone:
    """Notice: metrics of live request ``(node, step)`` were reported; it is settled."""

    node: int
    step: int
    metrics: Mapping[str, float] = field(hash=False)


@dataclass(frozen=True)
class RequestFailed:
    """Notice: live request ``(node, step)`` depends on a stage that failed (after the
    allowed retries); it is settled. ``error`` and ``traceback`` are the trainer's."""

    node: int
    step: int
    error: str
    traceback: str = ""
    where: str = ""  # what failed, for people: "training step 80", "evaluating step 30"


@dataclass(frozen=True)
class DevicesLearned:
    """Notice: a stage of plan tree ``root_key`` ran out of device memory: from now on
    its stages need ``devices`` devices, and its fused jobs hold at most ``fused_width``
    members (0: no limit learned). The study keeps this in the plan, so that a later run
    starts with it."""

    root_key: str
    devices: int
    fused_width: int = 0


PlanEvent = (
    RootAdded
    | NodeAdded
    | RequestAdded
    | RequestCancelled
    | StudyWeight
    | SaveSteps
    | CheckpointAvailable
    | CheckpointLost
)
Event = PlanEvent | WorkerEvent
Notice = RequestDone | RequestFailed | DevicesLearned
