"""The search plan: one append-only tree of configurations per root key, with the
requests, checkpoints and metrics keyed by its canonical ``(node, step)`` pairs.

Modules: :mod:`~stagetree.plan.base` (the storage contract), :mod:`~.model` (nodes,
requests, activity), :mod:`~.tree` (the walk that inserts trials), :mod:`~.leases`,
:mod:`~.scopes` (accounting keys), :mod:`~.memory` and :mod:`~.sql` (the backends),
:mod:`~.registry` (``open_storage(url)`` picks the backend by scheme; a new backend
registers its scheme with :func:`stagetree.plan.registry.register_storage`).

The names below load on first use, so that a worker process that needs only the plan's
records (:mod:`stagetree.plan.model`) does not load SQLAlchemy. Modules inside stagetree
import the defining module, never this facade (a test checks it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SCHEMA_VERSION": "stagetree.plan.sql",
    "ActivityRecord": "stagetree.plan.model",
    "BasePlanStorage": "stagetree.plan.base",
    "CheckpointRecord": "stagetree.plan.base",
    "Insertion": "stagetree.plan.tree",
    "MemoryPlanStorage": "stagetree.plan.memory",
    "Node": "stagetree.plan.model",
    "PlanKeyError": "stagetree.exceptions",
    "Request": "stagetree.plan.model",
    "RequestError": "stagetree.exceptions",
    "RequestState": "stagetree.plan.model",
    "SQLPlanStorage": "stagetree.plan.sql",
    "open_storage": "stagetree.plan.registry",
}

__all__ = [
    "SCHEMA_VERSION",
    "ActivityRecord",
    "BasePlanStorage",
    "CheckpointRecord",
    "Insertion",
    "MemoryPlanStorage",
    "Node",
    "PlanKeyError",
    "Request",
    "RequestError",
    "RequestState",
    "SQLPlanStorage",
    "open_storage",
]

if TYPE_CHECKING:
    from stagetree.exceptions import PlanKeyError, RequestError
    from stagetree.plan.base import BasePlanStorage, CheckpointRecord
    from stagetree.plan.memory import MemoryPlanStorage
    from stagetree.plan.model import ActivityRecord, Node, Request, RequestState
    from stagetree.plan.registry import open_storage
    from stagetree.plan.sql import SCHEMA_VERSION, SQLPlanStorage
    from stagetree.plan.tree import Insertion


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stagetree.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
