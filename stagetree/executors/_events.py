"""What executors share about the messages they exchange with their workers: the rules
of ``submit`` and ``add_trainer`` (see :class:`~stagetree.executors.base.BaseExecutor`),
the start-up failure message, and how a worker slot takes in one event."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from stagetree.exceptions import StagetreeError, TrainerError
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    RunBatch,
    RunFused,
    SplitMissed,
    WorkerEvent,
    WorkerReady,
)

__all__ = [
    "StartupError",
    "accept_event",
    "admit",
    "check_worker",
    "missed",
    "new_trainer",
    "started",
]


def new_trainer(registered: Mapping[str, Any], key: str, trainer: Any) -> bool:
    """Whether ``trainer`` is new under ``key`` (False: the same trainer is registered
    there already, so registering it again does nothing).

    Raises:
        ValueError: ``key`` is not a non-empty string, ``trainer`` is None, or ``key`` is
            registered with another trainer.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"a trainer key must be a non-empty string, got {key!r}")
    if trainer is None:
        raise ValueError(f"trainer {key!r}: no trainer given")
    if key not in registered:
        return True
    existing = registered[key]
    if existing is trainer or existing == trainer:
        return False
    raise ValueError(
        f"trainer key {key!r} is already registered with {_name(existing)}; "
        f"cannot register {_name(trainer)} under it"
    )


def _name(trainer: Any) -> str:
    if isinstance(trainer, type):
        return f"{trainer.__module__}.{trainer.__qualname__}"
    return repr(trainer)


def check_worker(instruction: Any, live: bool, num_workers: int) -> int:
    """The worker an instruction is for.

    Raises:
        StagetreeError: the executor is not running (``live`` is False).
        ValueError: no such worker.
    """
    if not live:
        raise StagetreeError("executor is not running: call start() first")
    worker = int(instruction.worker)
    if not 0 <= worker < num_workers:
        raise ValueError(f"no worker {worker} (have {num_workers})")
    return worker


def started(instruction: RunBatch | RunFused) -> set[int]:
    """The batch ids a ``RunBatch`` or ``RunFused`` starts on its worker."""
    if isinstance(instruction, RunFused):
        return set(instruction.batch_ids)
    return {instruction.batch_id}


def admit(instruction: Any, running: Collection[int]) -> bool:
    """Whether ``instruction`` goes to its worker, whose running batches are ``running``
    (several for a fused job): a ``RunBatch`` or ``RunFused`` does (to an idle worker),
    an ``AddCheckpoint``/``Abort`` only for a batch still running; for any other the
    caller answers with :func:`missed`.

    Raises:
        ValueError: a ``RunBatch``/``RunFused`` for a worker whose previous batch has not
            ended.
        TypeError: not an instruction.
    """
    if isinstance(instruction, (RunBatch, RunFused)):
        if running:
            ids = sorted(started(instruction))
            raise ValueError(
                f"worker {instruction.worker} is still running batch {min(running)}; "
                f"cannot start batch {ids[0] if len(ids) == 1 else ids}"
            )
        return True
    if isinstance(instruction, (AddCheckpoint, Abort)):
        return instruction.batch_id in running
    raise TypeError(f"not an instruction: {instruction!r}")


def missed(instruction: Any) -> list[WorkerEvent]:
    """The answer to a live instruction whose batch no longer runs: ``SplitMissed`` for
    an ``AddCheckpoint``, nothing for an ``Abort``."""
    if isinstance(instruction, AddCheckpoint):
        return [
            SplitMissed(
                instruction.batch_id, instruction.worker, instruction.node, instruction.step
            )
        ]
    return []


@dataclass(frozen=True)
class StartupError:
    """Worker -> driver: the worker could not start (trainer import, store...)."""

    worker: int
    error: str
    traceback: str


class _Slot(Protocol):
    ready: bool
    start_failures: int
    running: set[int]


def accept_event(slot: _Slot, event: Any, out: list[WorkerEvent], spec: Any) -> None:
    """Take one message of the worker in ``slot``: an event, or a list of events sent
    together (see :class:`~stagetree.executors.worker.Worker`'s ``emit_many``), taken
    in order. A start-up failure raises (naming the trainer ``spec``); ``WorkerReady``
    marks the slot ready; a terminal event frees it.

    Raises:
        TrainerError: the worker could not start.
    """
    if type(event) is list:
        for one in event:
            accept_event(slot, one, out, spec)
        return
    if isinstance(event, StartupError):
        raise TrainerError(
            f"worker {event.worker} could not start ({spec}): {event.error}", event.traceback
        )
    if isinstance(event, WorkerReady):
        slot.ready = True
        slot.start_failures = 0
    elif isinstance(event, (BatchDone, BatchFailed)):
        slot.running.discard(event.batch_id)
    out.append(event)
