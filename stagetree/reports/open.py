"""Opening an existing plan storage to read it: the storage the commands use by
default (:func:`default_storage`) and :func:`open_existing_storage`, which opens it
read-only and never creates a SQLite file that is not there."""

from __future__ import annotations

import os
from pathlib import Path

from stagetree.engine.settings import DEFAULT_STORAGE
from stagetree.exceptions import StagetreeError, StorageError
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.registry import open_storage
from stagetree.reports.format import one_line

__all__ = ["DEFAULT_STORAGE", "STORAGE_ENV", "default_storage", "open_existing_storage"]

#: The environment variable naming the default storage.
STORAGE_ENV = "STAGETREE_STORAGE"


def default_storage() -> str:
    """The storage URL commands use without ``--storage``: ``$STAGETREE_STORAGE`` or
    ``sqlite:///stagetree.db``."""
    return os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def _sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL; None for other URLs and in-memory SQLite."""
    if not url.lower().startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        database = make_url(url).database
    except ArgumentError:
        return None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def open_existing_storage(url: str) -> BasePlanStorage:
    """Open a storage read-only (nothing is ever written to it, not even stagetree's
    tables), without creating a SQLite file that is not there.

    Raises:
        StorageError: the URL cannot be opened, naming it.
    """
    path = _sqlite_file(url)
    if path is not None and not path.is_file():
        raise StorageError(
            f"cannot open plan storage {url!r}: {path} does not exist{_other_databases(path)}"
        )
    try:
        storage = open_storage(url, readonly=True)  # reports never write
        storage.studies()  # a file that is not a plan fails here, not halfway through
    except StagetreeError:
        raise
    except Exception as exc:  # driver errors of a file that is not a database, ...
        raise StorageError(f"cannot open plan storage {url!r}: {one_line(exc)}") from exc
    return storage


def _other_databases(missing: Path) -> str:
    """A hint naming the SQLite files beside a missing one (say the demo's
    ``stagetree-demo.db`` when ``stagetree.db`` was looked for); "" when none."""
    folder = missing.parent if str(missing.parent) else Path(".")
    try:
        found = sorted(p.name for p in folder.glob("*.db") if p.is_file())
    except OSError:
        return ""
    if not found:
        return ""
    shown = folder if folder.is_absolute() else None
    urls = [f"sqlite:///{shown / name if shown else name}" for name in found[:5]]
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    return f"; databases in {folder}: {', '.join(found[:5])}{more}: pass --storage {urls[0]}"
