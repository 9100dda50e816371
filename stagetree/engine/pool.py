"""The engines open in this process: one per storage, shared by the studies on it.

Studies on one storage in one process share one engine (one worker pool, divided by
their weights, and every stage they have in common). The first study to open it
chooses its :class:`~stagetree.engine.settings.EngineSettings` and checkpoint
location and budget; a later study that asks for others joins it all the same and is
told which of its settings are not followed
(:class:`~stagetree.exceptions.SharedEngineWarning`).

An engine whose driver stopped on an error (a database out of reach past its
ride-through window, see :mod:`stagetree.retry`) is replaced by a fresh one at the
next :func:`acquire`, and closed: a study (or a server's submission) after the outage
runs again instead of finding a stopped engine.

A process that opened an engine freezes its garbage collector at exit
(:func:`freeze_at_exit`): the interpreter's shutdown then frees what it frees without
traversing every object of the libraries loaded (0.5-1.5 s with PyTorch).

A process forked from one with open engines (a worker forked from the driver, see
:mod:`stagetree.executors._driverfork`) starts with none: the parent's engines have no
driver thread there, and a study the child opens makes its own.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from stagetree.engine.core import Engine
from stagetree.engine.settings import EngineSettings, Placement

__all__ = ["EXIT_GC_ENV", "EngineLease", "acquire", "freeze_at_exit", "open_storages", "release"]

EXIT_GC_ENV = "STAGETREE_EXIT_GC"
"""Set to ``1`` to keep the interpreter's garbage collection at exit (see
:func:`freeze_at_exit`)."""


@dataclass
class _Entry:
    engine: Engine
    settings: EngineSettings
    placement: Placement
    users: int = 0


@dataclass(frozen=True)
class EngineLease:
    """A study's use of a shared engine, given back with :func:`release`.

    Attributes:
        key: the storage's name in this process (:attr:`Placement.key`).
        engine: the engine.
        settings: the settings the engine was made with (the first study's).
        placement: the placement it was made with (the first study's).
    """

    key: str
    engine: Engine
    settings: EngineSettings
    placement: Placement


_ENGINES: dict[str, _Entry] = {}
_LOCK = threading.Lock()
_EXIT_HOOK: list[bool] = []  # registered once per process


def _forget() -> None:
    """In a forked child: the parent's engines (and its lock, which another thread may
    have held at the fork) are not this process's."""
    global _LOCK
    _LOCK = threading.Lock()
    _ENGINES.clear()


os.register_at_fork(after_in_child=_forget)


def freeze_at_exit() -> None:
    """Move every object to the garbage collector's permanent generation, run at exit.

    The interpreter's shutdown collects garbage several times, each traversing every
    object alive, most of them a library's (PyTorch: about 1 s of a 1.3 s exit on two
    cores). Frozen objects are still freed as their references go; only reference
    cycles left at exit are not collected (Python does not promise to finalize objects
    alive at exit). ``STAGETREE_EXIT_GC=1`` keeps the collection.
    """
    if os.environ.get(EXIT_GC_ENV, "0") in ("", "0"):
        gc.freeze()


def acquire(
    key: str, settings: EngineSettings, placement: Placement, make: Callable[[], Engine]
) -> EngineLease:
    """The engine of storage ``key``, made by ``make`` when none is open; the lease's
    ``settings`` and ``placement`` are the engine's, which differ from those given when
    another study made it with others. A stopped engine (its ``error`` set) is replaced
    by one made by ``make`` and closed; a ``make`` that fails leaves it in place."""
    with _LOCK:
        if not _EXIT_HOOK:
            _EXIT_HOOK.append(True)
            atexit.register(freeze_at_exit)
        entry = _ENGINES.get(key)
        if entry is None or entry.engine.error is not None:
            stopped = entry.engine if entry is not None else None
            entry = _Entry(make(), settings, placement)
            _ENGINES[key] = entry
            if stopped is not None:  # its leases and workers go (its storage is back)
                with contextlib.suppress(Exception):
                    stopped.close()
        entry.users += 1
        return EngineLease(key, entry.engine, entry.settings, entry.placement)


def release(lease: EngineLease) -> bool:
    """Give a lease back; True when it was the engine's last (the caller closes it)."""
    with _LOCK:
        entry = _ENGINES.get(lease.key)
        if entry is None or entry.engine is not lease.engine:
            return False
        entry.users -= 1
        if entry.users > 0:
            return False
        del _ENGINES[lease.key]
        return True


def open_storages() -> list[str]:
    """The keys (URLs) of the storages whose engine is open in this process."""
    with _LOCK:
        return list(_ENGINES)
