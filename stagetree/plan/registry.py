"""Which backend opens a plan storage URL: a scheme -> factory registry.

``memory://`` (or ``:memory:``) keeps the plan in this process; ``sqlite:///path.db``
and ``postgresql://...`` keep it in a database that several processes may share. A
backend of another scheme registers itself with :func:`register_storage`.
"""

from __future__ import annotations

from collections.abc import Callable

from stagetree.exceptions import StorageError
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.sql import SQLPlanStorage

__all__ = ["StorageFactory", "open_storage", "register_storage", "storage_schemes"]

#: ``factory(url, readonly)`` -> an open storage.
StorageFactory = Callable[[str, "bool | None"], BasePlanStorage]

_MEMORY_URLS = ("memory://", "memory:", ":memory:")
_FACTORIES: dict[str, StorageFactory] = {}


def register_storage(scheme: str, factory: StorageFactory) -> None:
    """Make :func:`open_storage` open URLs of ``scheme`` (the part before ``:``, before
    any ``+driver``) with ``factory(url, readonly)``. A later registration of the same
    scheme replaces the earlier one."""
    if not scheme or not scheme.isidentifier():
        raise ValueError(f"a storage scheme must be a plain name, got {scheme!r}")
    _FACTORIES[scheme.lower()] = factory


def storage_schemes() -> list[str]:
    """The schemes :func:`open_storage` knows, sorted."""
    return sorted(_FACTORIES)


def _scheme(url: str) -> str:
    if url.strip() in _MEMORY_URLS:
        return "memory"
    return url.split(":", 1)[0].split("+", 1)[0].lower() if ":" in url else ""


def open_storage(url: str, readonly: bool | None = None) -> BasePlanStorage:
    """Open the plan storage at ``url``.

    Args:
        url: ``memory://`` or ``:memory:`` (this process only); ``sqlite:///path.db``;
            ``postgresql://user:pw@host/db`` (psycopg driver) or any SQLAlchemy
            ``postgresql+driver://`` URL; or a scheme registered with
            :func:`register_storage`.
        readonly: never write to the database (see :class:`SQLPlanStorage`); None:
            read-only exactly when a SQLite file cannot be written here.

    Returns:
        A :class:`MemoryPlanStorage`, a :class:`SQLPlanStorage`, or what a registered
        factory opens.

    Raises:
        StorageError: the URL has an unknown scheme or cannot be opened (missing
            directory, unreachable server), naming the URL.
        SchemaVersionError: the database was written by another schema version.
    """
    if not isinstance(url, str):
        raise StorageError(f"a plan storage URL must be a str, got {url!r}")
    scheme = _scheme(url)
    factory = _FACTORIES.get(scheme)
    if factory is None:
        raise StorageError(
            f"cannot open plan storage {url!r}: unknown scheme {scheme!r} "
            "(use memory://, sqlite:///path.db or postgresql://...)"
        )
    return factory(url, readonly)


register_storage("memory", lambda url, readonly: MemoryPlanStorage())
for _name in ("sqlite", "postgresql", "postgres"):
    register_storage(_name, lambda url, readonly: SQLPlanStorage(url, readonly=readonly))
