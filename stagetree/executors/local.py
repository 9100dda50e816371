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

Process layout: worker ``w`` is one process pinned to one device, or to
``devices_per_worker`` devices of its own (``CUDA_VISIBLE_DEVICES``; see
:mod:`stagetree.executors.devices`) and to a fixed number of threads (``OMP_NUM_THREADS``,
``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``torch.set_num_threads``).
Instructions reach it on its own pipe, which the running batch polls between steps
without blocking; events come back on a second pipe per worker (one writer per pipe, so a
worker killed mid-write cannot corrupt or lock the others' channel). A worker that dies
is noticed in :meth:`LocalExecutor.events`, reported as ``WorkerLost`` after the events
it sent, and replaced by a fresh process that sends ``WorkerReady``.

Start-up, and processes kept across executors: a worker process serves one executor at a
time, under a *lease* (worker id, trainer, checkpoint store, the parent's ``sys.path``),
with a fresh :class:`~stagetree.worker.Worker` per lease. When an executor closes, each
healthy worker stops its batches, drops its trainer and model, and waits in this
process's pool (:class:`_WorkerPool`); the next executor with the same start method,
device, threads, working directory and environment leases those processes instead of
starting new ones (a study's first step then starts in about 0.1 s instead of seconds of
importing torch and the trainer). The pool is bounded, idle processes stop after
``STAGETREE_WORKER_IDLE`` seconds, dead ones are discarded, and :func:`shutdown_pool`
(also run at interpreter exit) stops them all.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
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
from stagetree.executors.devices import check_devices_per_worker, device_groups
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

__all__ = ["InlineExecutor", "LocalExecutor", "TrainerSpec", "pooled_pids", "shutdown_pool"]

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_PINNED_VARS = frozenset((*_THREAD_VARS, "CUDA_VISIBLE_DEVICES"))
_ENV_LOCK = threading.Lock()
# A worker that dies this many times in a row before WorkerReady is not restarted.
_MAX_START_FAILURES = 3


# ---------------------------------------------------------------------- worker process


@dataclass(frozen=True)
class _Lease:
    """Driver -> worker: what one executor (one study) needs of a worker process. The
    first lease travels with the process's start; a pooled process receives the next
    executor's lease as a message (see :func:`shutdown_pool`)."""

    worker: int
    spec: TrainerSpec
    store: CheckpointStore  # pickles as its location
    progress_interval: float
    sys_path: tuple[str, ...] = ()


@dataclass(frozen=True)
class _ChildConfig:
    """What a worker process keeps for its whole life (what the pool is keyed by), and
    its first lease."""

    lease: _Lease
    threads: int
    device: str | None


class _Release:
    """Driver -> worker: the executor is closing and keeps the process for the next one:
    stop the running batches (as when shutting down), drop the trainer, say
    :class:`_Released`, then wait for the next :class:`_Lease` (or None: exit)."""


@dataclass(frozen=True)
class _Released:
    """Worker -> driver: every batch ended, every checkpoint is durable, the worker holds
    nothing of the executor that leased it."""

    worker: int


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
    """Entry point of a worker process: serve leases until told to exit."""
    # The parent handles Ctrl-C and stops workers through close().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(_child_env(cfg.device, cfg.threads))
    lock = threading.Lock()

    def emit(event: Any) -> None:
        with lock:
            outbox.send(event)

    lease: _Lease | None = cfg.lease
    try:
        while lease is not None and _serve(lease, cfg.threads, inbox, emit):
            emit(_Released(lease.worker))
            lease = None
            while True:  # idle in the pool: only a lease or the exit sentinel arrive
                message = inbox.recv()
                if message is None or isinstance(message, _Lease):
                    lease = message
                    break
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    # Skip the interpreter's teardown (tearing down torch takes about a second): nothing
    # is left to flush, and the parent waits for this exit when it closes the study.
    for stream in (sys.stdout, sys.stderr):  # the user's prints must not be lost
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        outbox.close()
    os._exit(0)


def _serve(lease: _Lease, threads: int, inbox: Connection, emit: Callable[[Any], None]) -> bool:
    """Serve one executor with a fresh :class:`Worker` (nothing of an earlier lease's
    trainers, models or batches survives). Returns True when released back to the pool,
    False when told to exit or unable to start."""
    if lease.sys_path:
        sys.path[:] = list(lease.sys_path)  # the leasing process's, as spawn gives it
    try:
        trainer_cls = lease.spec.resolve()
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        store = lease.store
    except Exception as exc:
        emit(StartupError(lease.worker, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return False
    try:
        trainer_cls.warmup()  # all workers warm up at once, before the first batch
    except Exception:
        # Only an optimisation: the trainer's own construction reports real problems.
        logging.getLogger(__name__).exception(
            "worker %s: %s.warmup failed", lease.worker, trainer_cls
        )
    trainers = TrainerClasses(trainer_cls)
    worker = Worker(lease.worker, trainers, store, emit, progress_interval=lease.progress_interval)
    backlog: deque[Any] = deque()
    nothing: list[AddCheckpoint | Abort] = []
    try:
        emit(WorkerReady(lease.worker))
        while True:
            message = backlog.popleft() if backlog else inbox.recv()
            if message is None:
                return False
            if isinstance(message, _Release):
                return True
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
                            if msg is None or isinstance(msg, _Release):
                                # shutting down: stop these batches first
                                out.extend(Abort(i, lease.worker) for i in sorted(ids))
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
                emit(SplitMissed(message.batch_id, lease.worker, message.node, message.step))
    finally:
        worker.close()  # every background checkpoint write is durable after this
        del worker, trainers, trainer_cls
        gc.collect()  # the trainer's model and data go now, not with the next lease
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


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
    key: tuple[Any, ...] | None = None  # its pool key (None: it is not pooled)
    born: float = 0.0  # time.time() when its process was started


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


_FORKSERVER_LOCK = threading.Lock()


def _preload_modules(trainer: Any) -> list[str]:
    """What the fork server imports once for its children: torch (when this process has
    it) and stagetree's modules the trainer class is made of (``stagetree.torch``...).
    Other libraries are left to the workers: a module that starts a thread when imported
    would make forking from the server unsafe."""
    modules = ["stagetree.executors.local"]
    if "torch" in sys.modules:
        modules.append("torch")
    if isinstance(trainer, type):
        for cls in trainer.__mro__:
            name = cls.__module__
            if name.startswith("stagetree.") and name not in modules:
                modules.append(name)
    return modules


def _start_forkserver(preload: list[str]) -> None:
    """Start multiprocessing's fork server (once per process) with ``preload`` imported,
    in this process's environment (not a worker's pinned one). A server that is running
    already keeps what it imported. Only imports: ``Trainer.warmup`` runs in each forked
    worker, as work that may start threads (torch's thread pools) must never precede a
    fork (its children can hang on a lock held by a thread they do not have)."""
    from multiprocessing import forkserver

    with _FORKSERVER_LOCK, no_main_rerun():
        multiprocessing.set_forkserver_preload(preload)
        forkserver.ensure_running()


class LocalExecutor(BaseExecutor):
    """Worker processes on this machine (see the module docstring for the layout).

    Args:
        trainer: the Trainer subclass, a ``"module:Class"`` / ``"file.py:Class"``
            string, or a :class:`TrainerSpec`.
        num_workers: worker processes; default one per device (CUDA devices torch sees;
            one per ``devices_per_worker`` devices), else one.
        checkpoint_dir: checkpoint directory shared by the workers, or a store.
        threads_per_worker: CPU threads of each worker; default ``cpus // num_workers``.
        devices: device ids to pin workers to, round-robin (``CUDA_VISIBLE_DEVICES``
            values); default every visible CUDA device, ``[]`` for no pinning.
        devices_per_worker: devices each worker owns (default 1): worker ``w`` gets
            devices ``w*k .. w*k+k-1`` of ``devices`` alone, as its
            ``CUDA_VISIBLE_DEVICES``, so its trainer sees ``k`` devices (``cuda:0`` ..
            ``cuda:{k-1}``) and can train data-parallel over them; ``num_workers``
            then defaults to ``len(devices) // k``.
        progress_interval: seconds between throttled ``Progress`` events.
        close_timeout: seconds :meth:`close` waits for workers to exit (or to be
            released to the pool) before terminating them.
        keep_workers: on :meth:`close`, put the idle worker processes in this process's
            pool for the next executor instead of stopping them (see
            :func:`shutdown_pool`); :meth:`start` takes processes from the pool first.
        start_method: ``"spawn"`` (default; or ``$STAGETREE_START_METHOD``): each worker
            is a fresh interpreter that imports torch and the trainer itself;
            ``"forkserver"``: workers are forked from multiprocessing's fork server,
            which imports torch and stagetree once (faster cold
            starts with several workers; the server keeps the environment it started
            with, and it is shared with the rest of the program's forkserver use).
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
        keep_workers: bool = True,
        start_method: str | None = None,
        devices_per_worker: int = 1,
    ) -> None:
        check_devices_per_worker(devices_per_worker)
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec = TrainerSpec.of(trainer)
        self.spec.check()  # fail here, not in every worker
        if isinstance(checkpoint_dir, CheckpointStore):
            self.store = checkpoint_dir
        else:
            self.store = CheckpointStore(checkpoint_dir)
        device_ids = _visible_cuda_devices() if devices is None else [str(d) for d in devices]
        groups = device_groups(device_ids, devices_per_worker, num_workers)
        num_workers = len(groups)
        self.devices_per_worker = devices_per_worker
        if threads_per_worker is None:
            threads_per_worker = max(1, _cpu_count() // num_workers)
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self.threads_per_worker = threads_per_worker
        self.progress_interval = progress_interval
        self.close_timeout = close_timeout
        self.keep_workers = keep_workers
        if start_method is None:
            start_method = os.environ.get("STAGETREE_START_METHOD") or "spawn"
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        self._ctx: Any = multiprocessing.get_context(start_method)
        self._preload = _preload_modules(trainer) if start_method == "forkserver" else []
        self._slots = [_Slot(w, group) for w, group in enumerate(groups)]
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
        """Device each worker is pinned to, its ``CUDA_VISIBLE_DEVICES`` (``"0,1"`` with
        two devices per worker; None: not pinned)."""
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
        if self._preload:
            _start_forkserver(self._preload)
        for slot in self._slots:
            self._start_worker(slot)

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
        if self.keep_workers and _POOL.enabled():
            self._finalizer.detach()
            _release(self._slots, self.close_timeout)
        else:
            self._finalizer()

    # ------------------------------------------------------------------ internals

    def _lease(self, slot: _Slot) -> _Lease:
        return _Lease(
            worker=slot.worker,
            spec=self.spec,
            store=self.store,
            progress_interval=self.progress_interval,
            sys_path=tuple(sys.path),
        )

    def _pool_key(self, slot: _Slot) -> tuple[Any, ...]:
        """What a pooled process must share with ``slot`` to serve it: start method,
        device, threads, working directory and environment (a process keeps those of
        its start)."""
        with _ENV_LOCK:  # not while _environ() has changed them for a start
            env = hash(
                tuple(sorted((k, v) for k, v in os.environ.items() if k not in _PINNED_VARS))
            )
            cwd = os.getcwd()
        return (self._ctx.get_start_method(), slot.device, self.threads_per_worker, cwd, env)

    def _start_worker(self, slot: _Slot) -> None:
        """Take a live process from the pool for ``slot``, else spawn one."""
        if self.keep_workers:
            key = self._pool_key(slot)
            lease = self._lease(slot)
            while (idle := _POOL.take(key)) is not None:
                assert idle.inbox is not None
                try:
                    idle.inbox.send(lease)
                except OSError:  # it died in the pool
                    _shutdown([idle], 1.0)
                    continue
                slot.process, slot.inbox, slot.outbox = idle.process, idle.inbox, idle.outbox
                slot.ready = False
                slot.trainers = set()
                slot.key, slot.born = key, idle.born
                return
        self._spawn(slot)

    def _spawn(self, slot: _Slot) -> None:
        inbox_recv, inbox_send = self._ctx.Pipe(duplex=False)
        outbox_recv, outbox_send = self._ctx.Pipe(duplex=False)
        cfg = _ChildConfig(
            lease=self._lease(slot), threads=self.threads_per_worker, device=slot.device
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
        slot.key = self._pool_key(slot) if self.keep_workers else None
        slot.born = time.time()

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
        self._start_worker(slot)


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


# ---------------------------------------------------------------------- the pool


def _release(slots: list[_Slot], timeout: float) -> None:
    """Close an executor, keeping its healthy workers: each stops its batches, drops its
    trainer and says :class:`_Released`; those that do within ``timeout`` go to the pool,
    the others (dead, busy past the timeout, unpooled) are stopped."""
    asked: list[_Slot] = []
    stop: list[_Slot] = []
    for slot in slots:
        if slot.process is None:
            continue
        if slot.key is None or slot.inbox is None or slot.process.exitcode is not None:
            stop.append(slot)
            continue
        try:
            slot.inbox.send(_Release())
            asked.append(slot)
        except OSError:
            stop.append(slot)
    deadline = time.monotonic() + timeout
    released: list[_Slot] = []
    while asked and time.monotonic() < deadline:
        for slot in list(asked):
            assert slot.outbox is not None
            try:
                while slot.outbox.poll():  # its last events, then _Released
                    if isinstance(slot.outbox.recv(), _Released):
                        released.append(slot)
                        asked.remove(slot)
                        break
            except (EOFError, OSError):
                asked.remove(slot)
                stop.append(slot)
        if asked:
            waitables: list[Any] = [s.outbox for s in asked]
            waitables += [s.process.sentinel for s in asked]
            multiprocessing.connection.wait(
                waitables, min(0.05, max(0.0, deadline - time.monotonic()))
            )
    _shutdown(stop + asked, 2.0)
    idle = []
    for slot in released:
        idle.append(
            _Slot(
                -1, slot.device, slot.process, slot.inbox, slot.outbox, key=slot.key, born=slot.born
            )
        )
        slot.process = slot.inbox = slot.outbox = None
        slot.running = set()
    _POOL.put(idle, cap=len(slots))


def _newest_module_mtime() -> float:
    """When the newest source file of this process's modules was last modified (a few
    milliseconds for torch's two thousand modules)."""
    newest = 0.0
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(path).st_mtime)
    return newest


class _WorkerPool:
    """Idle worker processes of this process, kept for the next :class:`LocalExecutor`.

    A process serves one executor at a time with a fresh :class:`Worker` per lease (no
    model, state or trainer class of one study reaches the next: a by-value class is
    unpickled again, and the previous lease's objects are dropped and collected before
    it joins the pool). The pool keeps at most as many processes as the executor that
    released last had workers (the oldest go first), stops a process idle for
    ``STAGETREE_WORKER_IDLE`` seconds (default 60; 0 turns the pool off), discards
    processes that died, and is emptied at interpreter exit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle: list[tuple[float, _Slot]] = []  # (since, process), oldest first
        self._reaper: threading.Thread | None = None

    @staticmethod
    def idle_seconds() -> float:
        try:
            return float(os.environ.get("STAGETREE_WORKER_IDLE", "60"))
        except ValueError:
            return 60.0

    def enabled(self) -> bool:
        return self.idle_seconds() > 0

    def pids(self) -> list[int]:
        with self._lock:
            return [slot.process.pid for _, slot in self._idle]

    def take(self, key: tuple[Any, ...]) -> _Slot | None:
        """A live idle process with this key (the most recently released), or None.

        A process started before a module of this process changed on disk (an edited
        editable install, a notebook's autoreload) may hold the old code: it is stopped.
        """
        with self._lock:
            if all(slot.key != key for _, slot in self._idle):
                return None
        edited = _newest_module_mtime()
        dead: list[_Slot] = []
        found = None
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                slot = self._idle[i][1]
                if slot.key != key:
                    continue
                del self._idle[i]
                assert slot.outbox is not None
                # An idle worker sends nothing: anything readable is its end (EOF).
                if slot.process.exitcode is not None or slot.outbox.poll() or slot.born < edited:
                    dead.append(slot)
                    continue
                found = slot
                break
        _shutdown(dead, 1.0)
        return found

    def put(self, slots: list[_Slot], cap: int) -> None:
        if not slots:
            return
        with self._lock:
            now = time.monotonic()
            self._idle.extend((now, slot) for slot in slots)
            excess = [slot for _, slot in self._idle[: max(0, len(self._idle) - cap)]]
            del self._idle[: len(excess)]
            if self._reaper is None or not self._reaper.is_alive():
                self._reaper = threading.Thread(
                    target=self._reap, name="stagetree-worker-pool", daemon=True
                )
                self._reaper.start()
            self._wake.notify_all()
        _shutdown(excess, 2.0)

    def _reap(self) -> None:
        """Stop processes idle for too long (a daemon thread while the pool is not empty)."""
        while True:
            with self._lock:
                if not self._idle:
                    self._reaper = None
                    return
                limit = self.idle_seconds()
                now = time.monotonic()
                expired = [slot for since, slot in self._idle if now - since >= limit]
                if not expired:
                    oldest = min(since for since, _ in self._idle)
                    self._wake.wait(max(0.01, oldest + limit - now))
                    continue
                self._idle = [(t, slot) for t, slot in self._idle if slot not in expired]
            _shutdown(expired, 2.0)

    def shutdown(self) -> None:
        with self._lock:
            slots = [slot for _, slot in self._idle]
            self._idle = []
            self._wake.notify_all()
        _shutdown(slots, 5.0)

    def forget(self) -> None:
        """In a forked child: the parent's workers are not this process's to use."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = []
        self._reaper = None


_POOL = _WorkerPool()
# Registered after multiprocessing's exit handler (imported above), so it runs first.
atexit.register(_POOL.shutdown)
os.register_at_fork(after_in_child=_POOL.forget)


def shutdown_pool() -> None:
    """Stop every idle worker process kept for reuse in this process (also done at
    interpreter exit; a later executor spawns fresh ones)."""
    _POOL.shutdown()


def pooled_pids() -> list[int]:
    """Process ids of the idle worker processes kept for reuse in this process."""
    return _POOL.pids()


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
