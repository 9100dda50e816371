"""The search plan: one append-only tree of configurations per root key, with the
requests, checkpoints and metrics keyed by its canonical ``(node, step)`` pairs.

``open_storage(url)`` picks the backend: ``memory://`` (or ``:memory:``) keeps the plan
in this process; ``sqlite:///path.db`` and ``postgresql://...`` keep it in a database
that several processes may share.
"""

from __future__ import annotations

from stagetree.exceptions import PlanKeyError, RequestError, StorageError
from stagetree.plan.base import BasePlanStorage, CheckpointRecord
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.model import ActivityRecord, Node, Request, RequestState
from stagetree.plan.sql import SCHEMA_VERSION, SQLPlanStorage
from stagetree.plan.tree import Insertion

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

_MEMORY_URLS = ("memory://", "memory:", ":memory:")


def open_storage(url: str, readonly: bool | None = None) -> BasePlanStorage:
    """Open the plan storage at ``url``.

    Args:
        url: ``memory://`` or ``:memory:`` (this process only); ``sqlite:///path.db``;
            ``postgresql://user:pw@host/db`` (psycopg driver) or any SQLAlchemy
            ``postgresql+driver://`` URL.
        readonly: never write to the database (see :class:`SQLPlanStorage`); None:
            read-only exactly when a SQLite file cannot be written here.

    Returns:
        A :class:`MemoryPlanStorage` or :class:`SQLPlanStorage`.

    Raises:
        StorageError: the URL has an unknown scheme or cannot be opened (missing
            directory, unreachable server), naming the URL.
        SchemaVersionError: the database was written by another schema version.
    """
    if not isinstance(url, str):
        raise StorageError(f"a plan storage URL must be a str, got {url!r}")
    if url.strip() in _MEMORY_URLS:
        return MemoryPlanStorage()
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower() if ":" in url else ""
    if scheme not in ("sqlite", "postgresql", "postgres"):
        raise StorageError(
            f"cannot open plan storage {url!r}: unknown scheme {scheme!r} "
            "(use memory://, sqlite:///path.db or postgresql://...)"
        )
    return SQLPlanStorage(url, readonly=readonly)
