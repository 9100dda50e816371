"""What an engine is made with, and the command line's overrides of it.

* :class:`EngineSettings`: the settings of one engine (one worker pool), checked when
  made. Studies that share an engine (same storage, one process) share these.
* :class:`Placement`: where an engine keeps what it learns: the plan storage, the
  checkpoint location and its budget.
* :class:`Overrides`: what ``stagetree run --workers N --storage URL ...`` imposes on
  every study its script builds. They live in a :class:`contextvars.ContextVar`, set
  for a block by :func:`overriding`, so that nothing global is mutated and a run's
  overrides end with the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from stagetree.checkpoints import CheckpointStore, check_location
from stagetree.executors.registry import check_executor
from stagetree.fusion import check_max_fused
from stagetree.plan.base import BasePlanStorage
from stagetree.scheduler.core import check_checkpoint_every
from stagetree.scheduler.policies import make_policy

__all__ = [
    "DEFAULT_STORAGE",
    "EngineSettings",
    "Overrides",
    "Placement",
    "current_overrides",
    "overriding",
    "parse_size",
]

#: The plan storage of a study that names none.
DEFAULT_STORAGE = "sqlite:///stagetree.db"


def _check_count(name: str, value: Any, least: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _check_seconds(name: str, value: Any, optional: bool) -> None:
    """A duration in seconds: a finite number > 0 (or None when ``optional``)."""
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        allowed = "a number of seconds > 0" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class EngineSettings:
    """The settings of one engine, checked when made (see :class:`stagetree.Study` for
    what each means). ``eval_every=None`` is kept as 0 and ``max_fused=None`` as
    :data:`stagetree.fusion.DEFAULT_MAX_FUSED`, so that equal settings compare equal.

    Raises:
        ValueError: a setting out of its range, an unknown executor or policy.
    """

    workers: int | None = None
    executor: Any = "local"
    policy: str = "critical_path"
    max_retries: int = 0
    threads_per_worker: int | None = None
    eval_every: int | None = 1
    max_fused: int | None = None
    checkpoint_every: int | str | None = "auto"
    devices_per_worker: int | tuple[int, ...] = 1
    step_timeout: float | None = None
    stop_timeout: float = 5.0

    def __post_init__(self) -> None:
        _check_count("workers", self.workers, 1)
        _check_count("threads_per_worker", self.threads_per_worker, 1)
        _check_count("max_retries", self.max_retries, 0, optional=False)
        if isinstance(self.devices_per_worker, (list, tuple)):  # a mixed cluster
            if not self.devices_per_worker:
                raise ValueError("devices_per_worker must be an int >= 1 or a non-empty list")
            for k in self.devices_per_worker:
                _check_count("devices_per_worker", k, 1, optional=False)
            object.__setattr__(self, "devices_per_worker", tuple(self.devices_per_worker))
        else:
            _check_count("devices_per_worker", self.devices_per_worker, 1, optional=False)
        check_executor(self.executor)
        make_policy(self.policy)
        eval_every = 0 if self.eval_every is None else self.eval_every
        _check_count("eval_every", eval_every, 0)
        object.__setattr__(self, "eval_every", eval_every)
        object.__setattr__(self, "max_fused", check_max_fused(self.max_fused))
        check_checkpoint_every(self.checkpoint_every)
        _check_seconds("step_timeout", self.step_timeout, optional=True)
        _check_seconds("stop_timeout", self.stop_timeout, optional=False)

    def differences(self, other: EngineSettings) -> list[tuple[str, Any, Any]]:
        """``(name, this value, other's value)`` of every setting that differs."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class Placement:
    """Where an engine keeps what it learns, checked when made (nothing is opened).

    Attributes:
        storage: a plan storage URL or an open storage.
        checkpoint_dir: a directory, an fsspec URL, a
            :class:`~stagetree.checkpoints.CheckpointStore`, or None (the default
            location of the storage).
        checkpoint_budget: bytes the checkpoint store may hold (an int or a size such
            as ``"10MB"``, kept as an int), None for unlimited.

    Raises:
        ValueError: a storage that is neither a URL nor a storage, a bad size, or a
            checkpoint location of an unknown scheme.
    """

    storage: str | BasePlanStorage = DEFAULT_STORAGE
    checkpoint_dir: str | os.PathLike[str] | CheckpointStore | None = None
    checkpoint_budget: int | str | None = None

    def __post_init__(self) -> None:
        budget = parse_size(self.checkpoint_budget, "checkpoint_budget")
        object.__setattr__(self, "checkpoint_budget", budget)
        location = self.checkpoint_dir
        if location is not None and not isinstance(location, CheckpointStore):
            check_location(location)  # scheme and package; reached at open
        if not isinstance(self.storage, (str, BasePlanStorage)):
            raise ValueError(
                f"storage must be a URL (sqlite:///path.db, postgresql://..., memory://) "
                f"or an open plan storage, got {self.storage!r}"
            )

    def differences(self, other: Placement) -> list[tuple[str, Any, Any]]:
        """``(name, this value, other's value)`` of the checkpoint location and budget
        where this placement asks for one (is not None) that differs from ``other``'s."""
        return [
            (name, getattr(self, name), getattr(other, name))
            for name in ("checkpoint_dir", "checkpoint_budget")
            if getattr(self, name) is not None and getattr(self, name) != getattr(other, name)
        ]

    @property
    def budget(self) -> int | None:
        """The checkpoint budget in bytes (None: unlimited)."""
        assert not isinstance(self.checkpoint_budget, str)  # parsed when made
        return self.checkpoint_budget

    @property
    def key(self) -> str:
        """What names the storage in a process: its URL, or the open object's id."""
        storage = self.storage
        return storage if isinstance(storage, str) else f"object:{id(storage)}"


@dataclass(frozen=True)
class Overrides:
    """Command-line overrides (``stagetree run``, ``stagetree simulate``): every field
    that is not None replaces what a study built in their scope asks for.

    Attributes:
        workers: ``--workers``.
        storage: ``--storage`` (a URL).
        executor: ``--executor`` (``"simulated"`` while ``stagetree simulate`` loads
            a script).
        checkpoint_dir: ``--checkpoints``.
        address: ``--address`` (a Ray cluster).
        url: ``--url`` (a tuning server).
        token: the token of ``--token-file``.
        budget: ``--budget`` (a :class:`~stagetree.budget.Budget` or its text): the
            limits of a ``tune()`` called without a budget of its own (a script
            without a main guard that tunes while ``stagetree run`` loads it).
        step_timeout: ``--step-timeout`` (seconds a training step may take).
        stop_timeout: ``--stop-timeout`` (seconds a stop waits for the running stages
            to checkpoint).
    """

    workers: int | None = None
    storage: str | None = None
    executor: Any = None
    checkpoint_dir: str | os.PathLike[str] | None = None
    address: str | None = None
    url: str | None = None
    token: str | None = None
    budget: Any = None
    step_timeout: float | None = None
    stop_timeout: float | None = None


# Overrides is frozen, so one shared default is safe.
_NONE = Overrides()
_OVERRIDES: ContextVar[Overrides] = ContextVar("stagetree_overrides", default=_NONE)


def current_overrides() -> Overrides:
    """The overrides in force here (none outside an :func:`overriding` block)."""
    return _OVERRIDES.get()


@contextlib.contextmanager
def overriding(base: Overrides | None = None, /, **changes: Any) -> Iterator[Overrides]:
    """Impose overrides on the studies built in this block (in this thread, and in the
    tasks and contexts copied from it); the previous ones are back after it.

    Args:
        base: the overrides to start from (default: those in force); ``Overrides()``
            clears them, e.g. for studies that must not follow a command line.
        changes: fields of :class:`Overrides`; a None value leaves the field as it is.

    Yields:
        The overrides in force in the block.
    """
    start = current_overrides() if base is None else base
    new = dataclasses.replace(start, **{k: v for k, v in changes.items() if v is not None})
    token = _OVERRIDES.set(new)
    try:
        yield new
    finally:
        _OVERRIDES.reset(token)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: Any, name: str = "size") -> int | None:
    """Bytes from an int or a size string (``"10MB"``, ``"1.5 GiB"``, ``"512"``); None
    stays None.

    Raises:
        ValueError: a negative size, or a value that is not a size (naming ``name``).
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number: float = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name} must be a number of bytes or a size like '10MB' or '2GiB', got {value!r}"
            )
        number = float(match.group(1)) * _UNITS[unit]
    else:
        raise ValueError(f"{name} must be an int or a size like '10MB', got {value!r}")
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return int(number)
