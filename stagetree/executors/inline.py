"""Batches run synchronously in the calling thread: :class:`InlineExecutor` (tests,
debugging, profiling)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import StagetreeError
from stagetree.executors._events import admit, check_worker, missed, new_trainer, started
from stagetree.executors.base import BaseExecutor
from stagetree.executors.worker import TrainerFactory, Worker
from stagetree.trainer import Trainer
from stagetree.work import (
    Abort,
    AddCheckpoint,
    Instruction,
    RunBatch,
    RunFused,
    WorkerEvent,
    WorkerReady,
)

__all__ = ["InlineExecutor"]


class InlineExecutor(BaseExecutor):
    """Runs batches synchronously in the calling thread (tests, debugging, profiling).

    ``submit`` queues; :meth:`events` runs every queued batch to its end and returns
    what happened. ``AddCheckpoint``/``Abort`` submitted for a queued batch are
    delivered at its first step; for a batch that already ran, the contract's answers
    apply (``SplitMissed`` / ignored). Nothing can arrive while no batch is queued, so
    :meth:`events` then returns at once instead of waiting.

    Several trainers: :meth:`add_trainer` registers more trainer classes (or callables
    ``config -> Trainer``) under keys; every worker builds a batch's trainer with the one
    of its ``RunBatch.trainer`` key.

    Args:
        trainer: a Trainer subclass or any callable ``config -> Trainer``.
        num_workers: worker slots (each keeps its own trainer in memory).
        checkpoint_dir: checkpoint directory, or a store.
        progress_interval: seconds between throttled ``Progress`` events.
    """

    supports_fusion = True

    def __init__(
        self,
        trainer: Callable[[Mapping[str, Any]], Trainer],
        num_workers: int = 1,
        *,
        checkpoint_dir: str | os.PathLike[str] | CheckpointStore,
        progress_interval: float = 0.2,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.store = (
            checkpoint_dir
            if isinstance(checkpoint_dir, CheckpointStore)
            else CheckpointStore(Path(checkpoint_dir))
        )
        self._events: list[WorkerEvent] = []
        # Trainers by key ("": the default), shared by the workers, which look a batch's
        # key up when it starts.
        self._factories: dict[str, TrainerFactory] = {"": trainer}
        self._workers = [
            Worker(
                w,
                self._factories,
                self.store,
                self._events.append,
                progress_interval=progress_interval,
            )
            for w in range(num_workers)
        ]
        self._queue: deque[RunBatch | RunFused] = deque()
        self._live: dict[int, list[AddCheckpoint | Abort]] = {}
        self._running: dict[int, set[int]] = {}  # worker -> batch ids not yet ended
        self._started = False
        self._closed = False

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Worker]:
        """The in-process workers (for inspection in tests)."""
        return list(self._workers)

    def add_trainer(self, key: str, trainer: type[Trainer]) -> None:
        """Register a trainer under ``key`` (see :meth:`BaseExecutor.add_trainer`);
        any callable ``config -> Trainer`` will do."""
        if new_trainer(self._factories, key, trainer):
            self._factories[key] = trainer

    def start(self) -> None:
        if self._closed:
            raise StagetreeError("executor is closed")
        if not self._started:
            self._started = True
            self._events.extend(WorkerReady(w) for w in range(len(self._workers)))

    def submit(self, instruction: Instruction) -> None:
        live = self._started and not self._closed
        worker = check_worker(instruction, live, len(self._workers))
        if not admit(instruction, self._running.get(worker, ())):
            self._events.extend(missed(instruction))
        elif isinstance(instruction, (RunBatch, RunFused)):
            self._running[worker] = started(instruction)
            for batch_id in started(instruction):
                self._live[batch_id] = []
            self._queue.append(instruction)
        else:
            self._live[instruction.batch_id].append(instruction)

    def events(self, timeout: float | None = None) -> list[WorkerEvent]:
        if not self._started:
            raise StagetreeError("executor is not running: call start() first")
        while self._queue:
            batch = self._queue.popleft()
            lives = [self._live[i] for i in sorted(started(batch))]

            def poll(
                lives: list[list[AddCheckpoint | Abort]] = lives,
            ) -> list[AddCheckpoint | Abort]:
                out: list[AddCheckpoint | Abort] = []
                for live in lives:
                    out.extend(live)
                    live.clear()
                return out

            try:
                worker = self._workers[batch.worker]
                if isinstance(batch, RunFused):
                    worker.run_fused(batch, poll)
                else:
                    worker.run(batch, poll)
                # In-process and sequential: the batch's writes end before events()
                # returns (they follow its BatchDone, as with other executors).
                worker.flush()
            finally:
                for i in started(batch):
                    del self._live[i]
                self._running.pop(batch.worker, None)
        out = list(self._events)
        self._events.clear()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.close()
