"""The I/O-free scheduler: its events, policies and cost estimator.

:class:`Scheduler` turns events (plan changes, worker reports) into instructions for
executors (:mod:`stagetree.work`) and notices for the study; see
:mod:`stagetree.scheduler.core` for the decisions it makes.
"""

from __future__ import annotations

from stagetree.scheduler.core import BatchInfo, Scheduler
from stagetree.scheduler.cost import CostEstimator
from stagetree.scheduler.events import (
    CheckpointAvailable,
    CheckpointLost,
    Event,
    NodeAdded,
    Notice,
    PlanEvent,
    RequestAdded,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RootAdded,
    StudyWeight,
)
from stagetree.scheduler.policies import (
    BasePolicy,
    BFSPolicy,
    CriticalPathPolicy,
    ThroughputPolicy,
    make_policy,
)

__all__ = [
    "BFSPolicy",
    "BasePolicy",
    "BatchInfo",
    "CheckpointAvailable",
    "CheckpointLost",
    "CostEstimator",
    "CriticalPathPolicy",
    "Event",
    "NodeAdded",
    "Notice",
    "PlanEvent",
    "RequestAdded",
    "RequestCancelled",
    "RequestDone",
    "RequestFailed",
    "RootAdded",
    "Scheduler",
    "StudyWeight",
    "ThroughputPolicy",
    "make_policy",
]
