"""Executors on one machine: worker processes (:class:`LocalExecutor`) and the calling
thread (:class:`InlineExecutor`).

How the trainer reaches worker processes (:class:`TrainerSpec`, in
:mod:`stagetree.executors._spec`): workers are started with the ``spawn`` method, without
running the parent's main script again; library classes are imported by name, the
user's own classes (scripts, ``stagetree run``, notebooks, ``python -c``, stdin, classes
defined in functions) arrive pickled by value. A worker never runs the user's script.

Several trainers, one pool: the executor's trainer is sent to every worker when it is
spawned; a trainer registered with :meth:`LocalExecutor.add_trainer` is pickled once (in
``add_trainer``) and sent to a worker just before the first batch of its key that worker
gets (again to a replacement process), so workers load only the trainers they train.

Process layout: worker ``w`` is one process pinned to one device
(``CUDA_VISIBLE_DEVICES``) and to a fixed number of threads (``OMP_NUM_THREADS``,
``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``torch.set_num_threads``).
Instructions reach it on its own pipe, which the running batch polls between steps
without blocking; events come back on a second pipe per worker (one writer per pipe, so a
worker killed mid-write cannot corrupt or lock the others' channel). A worker that dies
is noticed in :meth:`LocalExecutor.events`, reported as ``WorkerLost`` after the events
it sent, and replaced by a fresh process that sends ``WorkerReady``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # registers its exit handler before ours
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import StagetreeError
from stagetree.executors._events import (
    StartupError,
    accept_event,
    admit,
    check_worker,
    missed,
    new_trainer,
    started,
)
from stagetree.executors._spec import TrainerClasses, TrainerSpec, no_main_rerun
from stagetree.executors.base import BaseExecutor
from stagetree.trainer import Trainer
from stagetree.work import (
    Abort,
    AddCheckpoint,
    Instruction,
    RunBatch,
    RunFused,
    SplitMissed,
    WorkerEvent,
    WorkerLost,
    WorkerReady,
)
from stagetree.worker import TrainerFactory, Worker

__all__ = ["InlineExecutor", "LocalExecutor", "TrainerSpec"]

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_ENV_LOCK = threading.Lock()
# A worker that dies this many times in a row before WorkerReady is not restarted.
_MAX_START_FAILURES = 3


# ---------------------------------------------------------------------- worker process


@dataclass(frozen=True)
class _ChildConfig:
    worker: int
    spec: TrainerSpec
    store: CheckpointStore  # pickles as its location
    threads: int
    device: str | None
    progress_interval: float


@dataclass(frozen=True)
class _AddTrainer:
    """Driver -> worker: the trainer of ``key`` (sent before its first batch there)."""

    key: str
    spec: TrainerSpec


def _child_env(device: str | None, threads: int) -> dict[str, str]:
    env = {name: str(threads) for name in _THREAD_VARS}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


def _worker_main(cfg: _ChildConfig, inbox: Connection, outbox: Connection) -> None:
    """Entry point of a worker process."""
    # The parent handles Ctrl-C and stops workers through close().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(_child_env(cfg.device, cfg.threads))
    lock = threading.Lock()

    def emit(event: Any) -> None:
        with lock:
            outbox.send(event)

    try:
        trainer_cls = cfg.spec.resolve()
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(cfg.threads)
        store = cfg.store
    except Exception as exc:
        emit(StartupError(cfg.worker, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    try:
        trainer_cls.warmup()  # all workers warm up at once, before the first batch
    except Exception:
        # Only an optimisation: the trainer's own construction reports real problems.
        logging.getLogger(__name__).exception(
            "worker %s: %s.warmup failed", cfg.worker, trainer_cls
        )
    trainers = TrainerClasses(trainer_cls)
    worker = Worker(cfg.worker, trainers, store, emit, progress_interval=cfg.progress_interval)
    backlog: deque[Any] = deque()
    nothing: list[AddCheckpoint | Abort] = []
    try:
        emit(WorkerReady(cfg.worker))
        while True:
            message = backlog.popleft() if backlog else inbox.recv()
            if message is None:
                break
            if isinstance(message, (RunBatch, RunFused)):
                ids = started(message)

                def poll(ids: set[int] = ids) -> list[AddCheckpoint | Abort]:
                    if not inbox.poll():
                        return nothing
                    out: list[AddCheckpoint | Abort] = []
                    while inbox.poll():
                        msg = inbox.recv()
                        if isinstance(msg, (AddCheckpoint, Abort)):
                            out.append(msg)
                        else:
                            if msg is None:  # shutting down: stop these batches first
                                out.extend(Abort(i, cfg.worker) for i in sorted(ids))
                            backlog.append(msg)
                    return out

                if isinstance(message, RunFused):
                    worker.run_fused(message, poll)
                else:
                    worker.run(message, poll)
            elif isinstance(message, _AddTrainer):
                trainers.add(message.key, message.spec)
                # Load it now (import, warm-up) while this worker has nothing to do: a
                # spec that fails to load fails the batches that need it, at their start.
                with contextlib.suppress(Exception):
                    trainers[message.key]
            elif isinstance(message, AddCheckpoint):
                emit(SplitMissed(message.batch_id, cfg.worker, message.node, message.step))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    finally:
        worker.close()  # every background checkpoint write is durable after this
    # Skip the interpreter's teardown (tearing down torch takes about a second): nothing
    # is left to flush, and the parent waits for this exit when it closes the study.
    for stream in (sys.stdout, sys.stderr):  # the user's prints must not be lost
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        outbox.close()
    os._exit(0)


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Temporarily set environment variables (inherited by a process started inside)."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in updates}
        os.environ.update(updates)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


# ---------------------------------------------------------------------- LocalExecutor


@dataclass
class _Slot:
    worker: int
    device: str | None
    process: Any = None
    inbox: Connection | None = None
    outbox: Connection | None = None
    running: set[int] = field(default_factory=set)
    ready: bool = False
    start_failures: int = 0
    pending: list[WorkerEvent] = field(default_factory=list)
    trainers: set[str] = field(default_factory=set)  # keys whose spec it was sent


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _visible_cuda_devices() -> list[str]:
    """Physical ids of the CUDA devices torch sees; empty without torch or CUDA."""
    if importlib.util.find_spec("torch") is None:
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if len(ids) >= count:
            return ids[:count]
    return [str(i) for i in range(count)]


class LocalExecutor(BaseExecutor):
    """Worker processes on this machine (see the module docstring for the layout).

    Args:
        trainer: the Trainer subclass, a ``"module:Class"`` / ``"file.py:Class"``
            string, or a :class:`TrainerSpec`.
        num_workers: worker processes; default one per device (CUDA devices torch sees),
            else one.
        checkpoint_dir: checkpoint directory shared by the workers, or a store.
        threads_per_worker: CPU threads of each worker; default ``cpus // num_workers``.
        devices: device ids to pin workers to, round-robin (``CUDA_VISIBLE_DEVICES``
            values); default every visible CUDA device, ``[]`` for no pinning.
        progress_interval: seconds between throttled ``Progress`` events.
        close_timeout: seconds :meth:`close` waits for workers to exit before
            terminating them.
    """

    supports_fusion = True

    def __init__(
        self,
        trainer: type[Trainer] | str | TrainerSpec,
        num_workers: int | None = None,
        *,
        checkpoint_dir: str | os.PathLike[str] | CheckpointStore,
        threads_per_worker: int | None = None,
        devices: Sequence[int | str] | None = None,
        progress_interval: float = 0.2,
        close_timeout: float = 10.0,
    ) -> None:
        self.spec = TrainerSpec.of(trainer)
        self.spec.check()  # fail here, not in every worker
        if isinstance(checkpoint_dir, CheckpointStore):
            self.store = checkpoint_dir
        else:
            self.store = CheckpointStore(checkpoint_dir)
        device_ids = _visible_cuda_devices() if devices is None else [str(d) for d in devices]
        if num_workers is None:
            num_workers = max(1, len(device_ids))
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if threads_per_worker is None:
            threads_per_worker = max(1, _cpu_count() // num_workers)
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self.threads_per_worker = threads_per_worker
        self.progress_interval = progress_interval
        self.close_timeout = close_timeout
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = [
            _Slot(w, device_ids[w % len(device_ids)] if device_ids else None)
            for w in range(num_workers)
        ]
        self._local: list[WorkerEvent] = []
        self._started = False
        self._closed = False
        self._lock = threading.Lock()
        # Trainers added with add_trainer: as given (to compare), and as they travel.
        self._trainers: dict[str, Any] = {}
        self._specs: dict[str, TrainerSpec] = {}
        # Stop children even when close() is forgotten. Registered with atexit after
        # multiprocessing's own exit handler, so it runs first: that handler would
        # otherwise wait forever for (non-daemonic) workers that wait for instructions.
        self._finalizer = weakref.finalize(self, _shutdown, self._slots, close_timeout)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    # ------------------------------------------------------------------ contract

    @property
    def num_workers(self) -> int:
        return len(self._slots)

    @property
    def devices(self) -> list[str | None]:
        """Device each worker is pinned to (None: not pinned)."""
        return [slot.device for slot in self._slots]

    def pid(self, worker: int) -> int | None:
        """Process id of worker ``worker`` (None before start or after close)."""
        process = self._slots[worker].process
        return None if process is None else process.pid

    def add_trainer(self, key: str, trainer: type[Trainer] | str | TrainerSpec) -> None:
        """Register a trainer under ``key`` (see :meth:`BaseExecutor.add_trainer`).

        ``trainer`` may also be a ``"module:Class"`` / ``"file.py:Class"`` string or a
        :class:`TrainerSpec`. A class that travels by value is pickled here, once; every
        running worker receives it now and loads it (import, ``warmup``) as soon as it
        is free, a worker started later with its first batch of ``key`` (a class it
        cannot load fails the batches that need it, at their start).

        Raises:
            ValueError: a bad or taken key, or a class that cannot be pickled.
        """
        with self._lock:
            if not new_trainer(self._trainers, key, trainer):
                return
        spec = TrainerSpec.of(trainer)  # pickling may take a while: not under the lock
        with self._lock:
            if new_trainer(self._trainers, key, trainer):  # (again: another thread?)
                self._specs[key] = spec
                self._trainers[key] = trainer
                if self._started and not self._closed:
                    for slot in self._slots:  # running workers load it when they are free
                        self._send_trainer(slot, key)

    def _send_trainer(self, slot: _Slot, key: str) -> None:
        """Send the spec of ``key`` to ``slot``'s worker once (lock held)."""
        spec = self._specs.get(key)
        if spec is None or key in slot.trainers or slot.inbox is None:
            return
        with contextlib.suppress(OSError):  # a dead worker is noticed in events()
            slot.inbox.send(_AddTrainer(key, spec))
            slot.trainers.add(key)

    def start(self) -> None:
        if self._closed:
            raise StagetreeError("executor is closed")
        if self._started:
            return
        self._started = True
        for slot in self._slots:
            self._spawn(slot)

    def submit(self, instruction: Instruction) -> None:
        slot = self._slots[
            check_worker(instruction, self._started and not self._closed, len(self._slots))
        ]
        with self._lock:
            if not admit(instruction, slot.running):
                self._local.extend(missed(instruction))
                return
            assert slot.inbox is not None
            with contextlib.suppress(OSError):
                # A dead worker is noticed (and its batch reported lost) in events().
                if isinstance(instruction, (RunBatch, RunFused)):
                    slot.running = started(instruction)
                    # An unknown key goes without: the worker fails that batch.
                    first = (
                        instruction.members[0] if isinstance(instruction, RunFused) else instruction
                    )
                    self._send_trainer(slot, first.trainer)
                slot.inbox.send(instruction)

    def events(self, timeout: float | None = None) -> list[WorkerEvent]:
        if not self._started:
            raise StagetreeError("executor is not running: call start() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[WorkerEvent] = []
        while True:
            with self._lock:
                out.extend(self._local)
                self._local.clear()
                if not self._closed:
                    self._collect(out)
            if out or self._closed:
                return out
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return out
            waitables: list[Any] = []
            for slot in self._slots:
                if slot.outbox is not None:
                    waitables.append(slot.outbox)
                if slot.process is not None:
                    waitables.append(slot.process.sentinel)
            multiprocessing.connection.wait(waitables, remaining)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._finalizer)
        self._finalizer()

    # ------------------------------------------------------------------ internals

    def _spawn(self, slot: _Slot) -> None:
        inbox_recv, inbox_send = self._ctx.Pipe(duplex=False)
        outbox_recv, outbox_send = self._ctx.Pipe(duplex=False)
        cfg = _ChildConfig(
            worker=slot.worker,
            spec=self.spec,
            store=self.store,
            threads=self.threads_per_worker,
            device=slot.device,
            progress_interval=self.progress_interval,
        )
        process = self._ctx.Process(
            target=_worker_main,
            args=(cfg, inbox_recv, outbox_send),
            name=f"stagetree-worker-{slot.worker}",
        )
        with _environ(_child_env(slot.device, self.threads_per_worker)), no_main_rerun():
            process.start()
        # Our copies of the child's ends: closing them lets EOF/EPIPE signal its death.
        inbox_recv.close()
        outbox_send.close()
        slot.process, slot.inbox, slot.outbox = process, inbox_send, outbox_recv
        slot.ready = False
        slot.trainers = set()

    def _collect(self, out: list[WorkerEvent]) -> None:
        """Read every available event; report and replace dead workers."""
        for slot in self._slots:
            conn = slot.outbox
            if conn is None:
                continue
            eof = False
            try:
                while conn.poll():
                    self._accept(slot, conn.recv(), out)
            except (EOFError, OSError):
                eof = True
            process = slot.process
            if eof or process.exitcode is not None:
                if process.exitcode is None:
                    process.join(1.0)
                    if process.exitcode is None:
                        process.kill()
                        process.join()
                # The process is gone: read what it sent before dying.
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll():
                        self._accept(slot, conn.recv(), out)
                self._lost(slot, out)

    def _accept(self, slot: _Slot, event: Any, out: list[WorkerEvent]) -> None:
        accept_event(slot, event, out, self.spec)

    def _lost(self, slot: _Slot, out: list[WorkerEvent]) -> None:
        process = slot.process
        code = process.exitcode
        reason = (
            f"worker process {process.pid} killed by signal {-code}"
            if code is not None and code < 0
            else f"worker process {process.pid} exited with code {code}"
        )
        out.append(WorkerLost(slot.worker, min(slot.running, default=None), reason))
        slot.running = set()
        for conn in (slot.inbox, slot.outbox):
            if conn is not None:
                conn.close()
        slot.inbox = slot.outbox = None
        process.close()
        slot.process = None
        if not slot.ready:
            slot.start_failures += 1
            if slot.start_failures >= _MAX_START_FAILURES:
                raise StagetreeError(
                    f"worker {slot.worker} died {slot.start_failures} times before it "
                    f"was ready ({reason}); not restarting it"
                )
        self._spawn(slot)


def _shutdown(slots: list[_Slot], timeout: float) -> None:
    """Stop worker processes: sentinel, bounded wait, terminate, kill."""
    for slot in slots:
        if slot.inbox is not None:
            with contextlib.suppress(OSError):
                slot.inbox.send(None)
    deadline = time.monotonic() + timeout
    alive = [s for s in slots if s.process is not None]
    while alive and time.monotonic() < deadline:
        # Keep reading events so that no worker blocks on a full pipe while stopping.
        for slot in alive:
            with contextlib.suppress(EOFError, OSError):
                while slot.outbox is not None and slot.outbox.poll():
                    slot.outbox.recv()
        alive = [s for s in alive if s.process.exitcode is None]
        if alive:
            multiprocessing.connection.wait(
                [s.process.sentinel for s in alive],
                min(0.05, max(0.0, deadline - time.monotonic())),
            )
    for slot in slots:
        process = slot.process
        if process is None:
            continue
        if process.exitcode is None:
            process.terminate()
            process.join(2.0)
        if process.exitcode is None:
            process.kill()
            process.join()
        for conn in (slot.inbox, slot.outbox):
            if conn is not None:
                conn.close()
        slot.inbox = slot.outbox = None
        process.close()
        slot.process = None


# ---------------------------------------------------------------------- InlineExecutor


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
