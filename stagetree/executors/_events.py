"""What worker-slot executors (local processes, Ray actors) share about the events their
workers send: the start-up failure message and how a slot takes in one event."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from stagetree.exceptions import TrainerError
from stagetree.work import BatchDone, BatchFailed, WorkerEvent, WorkerReady

__all__ = ["StartupError", "accept_event"]


@dataclass(frozen=True)
class StartupError:
    """Worker -> driver: the worker could not start (trainer import, store...)."""

    worker: int
    error: str
    traceback: str


class _Slot(Protocol):
    ready: bool
    start_failures: int
    running: int | None


def accept_event(slot: _Slot, event: Any, out: list[WorkerEvent], spec: Any) -> None:
    """Take one event of the worker in ``slot``: a start-up failure raises (naming the
    trainer ``spec``); ``WorkerReady`` marks the slot ready; a terminal event frees it.

    Raises:
        TrainerError: the worker could not start.
    """
    if isinstance(event, StartupError):
        raise TrainerError(
            f"worker {event.worker} could not start ({spec}): {event.error}", event.traceback
        )
    if isinstance(event, WorkerReady):
        slot.ready = True
        slot.start_failures = 0
    elif isinstance(event, (BatchDone, BatchFailed)) and event.batch_id == slot.running:
        slot.running = None
    out.append(event)
