"""Worker processes on this machine: :class:`LocalExecutor` (its worker processes'
side is :mod:`stagetree.executors._process`, its pool of idle processes
:mod:`stagetree.executors._pool`; batches in the calling thread:
:mod:`stagetree.executors.inline`).

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
with a fresh :class:`~stagetree.executors.worker.Worker` per lease. When an executor closes, each
healthy worker stops its batches, drops its trainer and model, and waits in this
process's pool (:class:`WorkerPool`); the next executor with the same start method,
device, threads, working directory and environment leases those processes instead of
starting new ones (a study's first step then starts in about 0.1 s instead of seconds of
importing torch and the trainer). The pool is bounded, idle processes stop after
``STAGETREE_WORKER_IDLE`` seconds, dead ones are discarded, and :func:`shutdown_pool`
(also run at interpreter exit) stops them all.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import glob
import importlib.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing import forkserver
from typing import Any

from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import StagetreeError
from stagetree.executors._driverfork import driver_context, refusal, server_pid, stop_server
from stagetree.executors._events import (
    accept_event,
    admit,
    check_worker,
    missed,
    new_trainer,
    started,
)
from stagetree.executors._pool import (
    POOL,
    Slot,
    pooled_pids,
    release_slots,
    shutdown_pool,
    shutdown_slots,
)
from stagetree.executors._process import (
    THREAD_VARS,
    AddTrainer,
    ChildConfig,
    Lease,
    child_env,
    worker_main,
)
from stagetree.executors._spec import TrainerSpec, no_main_rerun
from stagetree.executors._watch import Watch
from stagetree.executors.base import BaseExecutor
from stagetree.executors.devices import check_worker_devices, device_count, device_groups
from stagetree.trainer import Trainer
from stagetree.work import (
    Instruction,
    RunBatch,
    RunFused,
    WorkerEvent,
    WorkerLost,
)

__all__ = [
    "LocalExecutor",
    "TrainerSpec",
    "end_unused_server",
    "pooled_pids",
    "shutdown_pool",
    "start_server_early",
]

_PINNED_VARS = frozenset((*THREAD_VARS, "CUDA_VISIBLE_DEVICES"))
_ENV_LOCK = threading.Lock()
# A worker that dies this many times in a row before WorkerReady is not restarted.
_MAX_START_FAILURES = 3


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


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _visible_cuda_devices() -> list[str]:
    """Physical ids of the CUDA devices torch sees; empty without torch or CUDA."""
    if "torch" not in sys.modules and not _may_have_gpus():
        return []  # no import of torch (seconds) to learn that there is no device
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


def _may_have_gpus() -> bool:
    """False when this machine surely has no device torch.cuda could use: on Linux, no
    NVIDIA device (``/dev/nvidia0``..., ``/proc/driver/nvidia/gpus``) and no ROCm one
    (``/dev/kfd``); True elsewhere (ask torch)."""
    if not sys.platform.startswith("linux"):
        return True
    found = glob.glob("/dev/nvidia[0-9]*") + glob.glob("/proc/driver/nvidia/gpus/*")
    return bool(found) or os.path.exists("/dev/kfd")


_FORKSERVER_LOCK = threading.Lock()


# Forking from a server that imported torch once makes cold starts cheaper than a fresh
# interpreter per worker (benchmarks/startup_bench.py); spawn where there is no fork.
_DEFAULT_START = (
    "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
)


_SERVER_FIRST = "stagetree.executors._forkserver_begin"
_SERVER_HOOKS = "stagetree.executors._forkserver"


def _preload_modules(trainer: Any) -> list[str]:
    """What the fork server imports once for its children: torch (when this process has
    it), stagetree's modules the trainer class is made of (``stagetree.torch``...) and
    what the class says its ``warmup`` imports (``warmup_imports``; a
    :class:`~stagetree.torch.TorchTrainer`'s: ``torch._dynamo``, seconds per worker
    otherwise), between the server's own first and last modules
    (:mod:`stagetree.executors._forkserver_begin`: the garbage collector off while it
    imports; :mod:`stagetree.executors._forkserver`: what it imported frozen, the
    collector on, its exit settings). Other libraries are left to the workers: a module
    that leaves a lock held by a thread it starts would make forking from the server
    unsafe."""
    modules = [_SERVER_FIRST, "stagetree.executors._process"]
    if "torch" in sys.modules:
        modules.append("torch")
    if isinstance(trainer, type):
        for cls in trainer.__mro__:
            name = cls.__module__
            if name.startswith("stagetree.") and name not in modules:
                modules.append(name)
        imports = getattr(trainer, "warmup_imports", ())
        if isinstance(imports, (tuple, list)):
            modules += [m for m in imports if isinstance(m, str) and m not in modules]
    return [*modules, _SERVER_HOOKS]  # last: it freezes what the others imported


def _start_forkserver(preload: list[str]) -> None:
    """Start multiprocessing's fork server (once per process) with ``preload`` imported,
    in this process's environment (not a worker's pinned one). A server that is running
    already keeps what it imported. Only imports: ``Trainer.warmup`` runs in each forked
    worker, as work that may start threads (torch's thread pools) must never precede a
    fork (its children can hang on a lock held by a thread they do not have)."""
    global _STARTED_MP_SERVER
    with _FORKSERVER_LOCK, no_main_rerun():
        multiprocessing.set_forkserver_preload(preload)
        before = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        forkserver.ensure_running()
        if forkserver._forkserver._forkserver_pid != before:  # type: ignore[attr-defined]
            _STARTED_MP_SERVER = True
            # Seconds more to the first worker (it imports torch): say why.
            logging.getLogger(__name__).debug(
                "workers fork from a fresh fork server: this process may not fork it (%s)",
                refusal(),
            )


# Whether a worker was forked from this process's fork server (that one, or any later
# one), and how many are being forked now: a server that served none may be ended at
# once (end_unused_server). Under _EARLY_LOCK, never held while this process forks.
_FORKED_A_WORKER = False
_FORKING = 0
_STARTED_EARLY = False  # by start_server_early: only such a server is ended as unused
_STARTED_MP_SERVER = False  # multiprocessing's fork server was started here
_EARLY_LOCK = threading.Lock()


def start_server_early(trainer: Any) -> None:
    """Start the fork server that a :class:`LocalExecutor` of ``trainer`` forks its
    workers from (see :func:`_server_context`) before the executor exists: ``tune()``
    calls it first thing, so that the server's imports (torch's, the trainer's
    ``warmup_imports``: seconds) overlap the driver's own work (opening the storage,
    building the engine, the tuner's first decisions). Nothing with another start
    method (``$STAGETREE_START_METHOD=spawn``) or a trainer that is not a class. A run
    that turns out to train nothing ends it again (:func:`end_unused_server`)."""
    global _STARTED_EARLY
    method = os.environ.get("STAGETREE_START_METHOD") or _DEFAULT_START
    if method == "forkserver" and isinstance(trainer, type):
        before = (server_pid(), forkserver._forkserver._forkserver_pid)  # type: ignore[attr-defined]
        _server_context(_preload_modules(trainer))
        after = (server_pid(), forkserver._forkserver._forkserver_pid)  # type: ignore[attr-defined]
        if after != before:  # started here, not one that runs for others already
            with _EARLY_LOCK:
                _STARTED_EARLY = True


def end_unused_server(stopping: bool = False) -> None:
    """End the fork server :func:`start_server_early` started when no worker was forked
    from it (a study closed untuned, a run answered from the storage, a run that failed
    before its workers started): killed at once, not waited for while it imports. A server
    that forked a worker stays for the workers to come (the pool's), and so does one
    that a worker is being forked from now, unless ``stopping`` (Ctrl-C, the program's
    exit: that start is abandoned, and fails). It runs at exit too, so that nothing holds
    the program's output open after it."""
    global _STARTED_EARLY, _STARTED_MP_SERVER
    with _EARLY_LOCK:
        if not _STARTED_EARLY or _FORKED_A_WORKER or (_FORKING and not stopping):
            return
        _STARTED_EARLY = False
        stop_server()
        if not _STARTED_MP_SERVER:
            return
        server: Any = forkserver._forkserver
        with _FORKSERVER_LOCK:
            pid = server._forkserver_pid
            _STARTED_MP_SERVER = False
            if pid is None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                server._stop()  # closes its pipe, reaps it, removes its socket


@contextlib.contextmanager
def _interruptible(waits: bool) -> Iterator[None]:
    """Where ``waits`` (a start from a fork server, which may still be importing for
    seconds), Ctrl-C raises KeyboardInterrupt in the main thread during the start:
    ``tune()``'s event loop (asyncio's runner) only cancels the run at its next turn, so
    its handler would leave the interrupted program waiting for the server's imports."""
    handler = signal.getsignal(signal.SIGINT) if waits else None
    method = getattr(handler, "func", handler)  # the runner's: a partial of its method
    if threading.current_thread() is not threading.main_thread() or not isinstance(
        getattr(method, "__self__", None), asyncio.Runner
    ):
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def _forget_servers() -> None:
    """In a forked child: the servers and their state are its parent's."""
    global _EARLY_LOCK, _FORKED_A_WORKER, _FORKING, _STARTED_EARLY, _STARTED_MP_SERVER
    _EARLY_LOCK = threading.Lock()  # another thread of the parent may have held it
    _FORKED_A_WORKER = _STARTED_EARLY = _STARTED_MP_SERVER = False
    _FORKING = 0


atexit.register(end_unused_server, stopping=True)
os.register_at_fork(after_in_child=_forget_servers)


def _server_context(preload: list[str]) -> Any:
    """The context of forkserver workers: those of the fork server forked from this
    process (:mod:`stagetree.executors._driverfork`: no fresh interpreter imports torch
    first), where this process may fork now or forked it already; else multiprocessing's
    own fork server, started with ``preload``. (No lock of this module is held while
    this process forks: its children would hold it for ever.)"""
    ctx = driver_context(preload)
    if ctx is not None:
        return ctx
    _start_forkserver(preload)
    return multiprocessing.get_context("forkserver")


def _stop_workers(
    lock: threading.Lock, closing: threading.Event, slots: list[Slot], timeout: float, pid: int
) -> None:
    """An executor's exit finalizer (it must not hold the executor): stop its workers.

    Under the executor's lock, and marking it closed first: at interpreter exit the
    engine's thread may still be reading events, and a worker it saw exit (stopped
    here) must not be reaped twice, nor replaced by a fresh process that nothing would
    stop (multiprocessing's exit handler would then wait for it forever).
    """
    if os.getpid() != pid:
        return  # a forked child's exit: the workers are its parent's
    with lock:
        closing.set()
        shutdown_slots(slots, timeout)


class _WakePipe:
    """A pipe whose read end :meth:`LocalExecutor.events` waits on with the workers'
    pipes: a byte written to it (:meth:`set`, from any thread) ends that wait.

    Its descriptors live as long as the executor (a finalizer closes them), not just
    until its close: a wake after a close then writes to this pipe, never to a
    descriptor number the process reused for something else.
    """

    def __init__(self, owner: object) -> None:
        self.r, self.w = os.pipe()  # not inherited by spawned workers (PEP 446)
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        weakref.finalize(owner, _close_fds, self.r, self.w)

    def set(self) -> None:
        # A full pipe has a wake pending already.
        with contextlib.suppress(OSError):
            os.write(self.w, b"\0")

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self.r, 4096):
                pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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
            then defaults to ``len(devices) // k``. A list (``[1, 1, 2, 4]``) makes
            a mixed cluster: one worker per entry, worker ``w`` owning the next
            ``k_w`` devices (a stage goes only to a worker with the devices its tree
            needs; see :mod:`stagetree.executors.devices`).
        progress_interval: seconds between throttled ``Progress`` events.
        close_timeout: seconds :meth:`close` waits for workers to exit (or to be
            released to the pool) before terminating them.
        keep_workers: on :meth:`close`, put the idle worker processes in this process's
            pool for the next executor instead of stopping them (see
            :func:`shutdown_pool`); :meth:`start` takes processes from the pool first.
        start_method: ``"forkserver"`` (the default where the platform has it; or
            ``$STAGETREE_START_METHOD``): workers are forked from multiprocessing's fork
            server, which imports torch and stagetree once, so a cold start pays one
            ``import torch`` however many workers start (each worker still sets its own
            devices and threads, and imports the trainer's module and runs
            ``Trainer.warmup`` itself; the server is shared with the rest of the
            program's forkserver use). Where this process may fork safely, the server
            is a fork of it instead, which imports nothing it has already
            (:mod:`stagetree.executors._driverfork`; ``$STAGETREE_FORK_DRIVER=0``: never).
            ``"spawn"``: each worker is a fresh interpreter that imports torch and the
            trainer itself.
        step_timeout: seconds a training step may take (None: no limit). A worker
            whose step runs longer reports its batch failed
            (``StepTimeout: step N took longer than step_timeout=Xs``) and exits; it
            is reported lost and replaced like any worker that died.
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
        devices_per_worker: int | Sequence[int] = 1,
        step_timeout: float | None = None,
    ) -> None:
        check_worker_devices(devices_per_worker)
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
        self.step_timeout = step_timeout
        self.close_timeout = close_timeout
        self.keep_workers = keep_workers
        if start_method is None:
            start_method = os.environ.get("STAGETREE_START_METHOD") or _DEFAULT_START
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        self._ctx: Any = multiprocessing.get_context(start_method)
        self._preload = _preload_modules(trainer) if start_method == "forkserver" else []
        self._slots = [Slot(w, group) for w, group in enumerate(groups)]
        self._local: list[WorkerEvent] = []
        self._started = False
        # Set once, under the lock, by close() or the exit finalizer: from then on no
        # thread reads, replaces or restarts a worker (see _stop_workers).
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._alarm = _WakePipe(self)
        self._watch = Watch(self._alarm.r)
        # Trainers added with add_trainer: as given (to compare), and as they travel.
        self._trainers: dict[str, Any] = {}
        self._specs: dict[str, TrainerSpec] = {}
        # Stop children even when close() is forgotten. Registered with atexit after
        # multiprocessing's own exit handler, so it runs first: that handler would
        # otherwise wait forever for (non-daemonic) workers that wait for instructions.
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._lock, self._closing, self._slots, close_timeout, os.getpid()
        )
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    # ------------------------------------------------------------------ contract

    @property
    def _closed(self) -> bool:
        return self._closing.is_set()

    @property
    def num_workers(self) -> int:
        return len(self._slots)

    @property
    def devices(self) -> list[str | None]:
        """Device each worker is pinned to, its ``CUDA_VISIBLE_DEVICES`` (``"0,1"`` with
        two devices per worker; None: not pinned)."""
        return [slot.device for slot in self._slots]

    @property
    def worker_device_counts(self) -> list[int]:
        """Devices each worker owns (1 when not pinned)."""
        return [device_count(slot.device) for slot in self._slots]

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

    def _send_trainer(self, slot: Slot, key: str) -> None:
        """Send the spec of ``key`` to ``slot``'s worker once (lock held)."""
        spec = self._specs.get(key)
        if spec is None or key in slot.trainers or slot.inbox is None:
            return
        with contextlib.suppress(OSError):  # a dead worker is noticed in events()
            slot.inbox.send(AddTrainer(key, spec))
            slot.trainers.add(key)

    def prepare(self) -> None:
        """Start the fork server (forked from this process where that is safe; it
        imports what the workers need in its own process while this one builds the
        tuner); no worker starts."""
        if self._preload and not self._closed and not self._started:
            self._ctx = _server_context(self._preload)

    def start(self) -> None:
        if self._closed:
            raise StagetreeError("executor is closed")
        if self._started:
            return
        self._started = True
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
        woken = False
        while True:
            with self._lock:
                out.extend(self._local)
                self._local.clear()
                if not self._closed:
                    self._collect(out)
                if out or self._closed or woken:
                    return out
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return out
            # Watches what the last look saw (a worker replaced since: the next look).
            # close() (or the exit finalizer) may close a pipe while this waits: the next
            # round sees the executor closed.
            with contextlib.suppress(OSError, ValueError):
                if self._watch.wait(remaining):
                    self._alarm.clear()  # wake(): one more look at the workers, then return
                    woken = True

    waits_in_events = True

    def wake(self) -> None:
        self._alarm.set()

    def close(self) -> None:
        self._close(wait_busy=True)

    def close_now(self) -> None:
        """Close, stopping the workers still running a batch at once (a trainer stuck
        in a step is not waited for); idle ones are released or stopped as by
        :meth:`close`."""
        self._close(wait_busy=False)

    def _close(self, wait_busy: bool) -> None:
        # Under the lock: no other thread (the engine's, reading events) may be reading,
        # reaping or restarting a worker while they are stopped.
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
            self._alarm.set()  # an events() waiting in another thread returns
            atexit.unregister(self._finalizer)
            self._finalizer.detach()
            slots = self._slots
            if not wait_busy:
                busy = [s for s in slots if s.running]
                shutdown_slots(busy, 0.0)
                slots = [s for s in slots if not s.running]
            if self.keep_workers and POOL.enabled():
                release_slots(slots, self.close_timeout)
            else:
                shutdown_slots(slots, self.close_timeout)

    # ------------------------------------------------------------------ internals

    def _lease(self, slot: Slot) -> Lease:
        return Lease(
            worker=slot.worker,
            spec=self.spec,
            store=self.store,
            progress_interval=self.progress_interval,
            sys_path=tuple(sys.path),
            step_timeout=self.step_timeout,
        )

    def _pool_key(self, slot: Slot) -> tuple[Any, ...]:
        """What a pooled process must share with ``slot`` to serve it: start method,
        device, threads, working directory and environment (a process keeps those of
        its start)."""
        with _ENV_LOCK:  # not while _environ() has changed them for a start
            env = hash(
                tuple(sorted((k, v) for k, v in os.environ.items() if k not in _PINNED_VARS))
            )
            cwd = os.getcwd()
        return (self._ctx.get_start_method(), slot.device, self.threads_per_worker, cwd, env)

    def _start_worker(self, slot: Slot) -> None:
        """Take a live process from the pool for ``slot``, else spawn one."""
        if self.keep_workers:
            key = self._pool_key(slot)
            lease = self._lease(slot)
            while (idle := POOL.take(key)) is not None:
                assert idle.inbox is not None
                try:
                    idle.inbox.send(lease)
                except OSError:  # it died in the pool
                    shutdown_slots([idle], 1.0)
                    continue
                slot.process, slot.inbox, slot.outbox = idle.process, idle.inbox, idle.outbox
                slot.ready = False
                slot.trainers = set()
                slot.key, slot.born = key, idle.born
                return
        self._spawn(slot)

    def _spawn(self, slot: Slot) -> None:
        global _FORKED_A_WORKER, _FORKING
        with _EARLY_LOCK:  # no server is ended as unused while this forks a worker
            _FORKING += 1
        try:
            self._spawn_worker(slot)
        finally:
            with _EARLY_LOCK:
                _FORKING -= 1
                _FORKED_A_WORKER = _FORKED_A_WORKER or slot.process is not None

    def _spawn_worker(self, slot: Slot) -> None:
        if self._preload:  # the server forked from this process, while it runs
            self._ctx = _server_context(self._preload)
        inbox_recv, inbox_send = self._ctx.Pipe(duplex=False)
        outbox_recv, outbox_send = self._ctx.Pipe(duplex=False)
        forked = self._ctx.get_start_method() == "forkserver"
        cfg = ChildConfig(
            lease=self._lease(slot),
            threads=self.threads_per_worker,
            device=slot.device,
            env=dict(os.environ) if forked else None,
        )
        process = self._ctx.Process(
            target=worker_main,
            args=(cfg, inbox_recv, outbox_send),
            name=f"stagetree-worker-{slot.worker}",
        )
        env = child_env(slot.device, self.threads_per_worker)
        with _environ(env), no_main_rerun(), _interruptible(forked):
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
        """Read every available event; report and replace dead workers (only those
        whose event pipe or process sentinel is ready: one look at all of them)."""
        watch = self._watch
        ready_slots, ready = watch.look(self._slots)
        for i in ready_slots:
            slot = self._slots[i]
            conn = slot.outbox
            if conn is None:
                continue
            fd = conn.fileno()
            eof = False
            try:
                if fd in ready:
                    self._accept(slot, conn.recv(), out)
                    while watch.readable(fd):
                        self._accept(slot, conn.recv(), out)
            except (EOFError, OSError):
                eof = True
            process = slot.process
            if eof or (process.sentinel in ready and process.exitcode is not None):
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

    def _accept(self, slot: Slot, event: Any, out: list[WorkerEvent]) -> None:
        accept_event(slot, event, out, self.spec)

    def _lost(self, slot: Slot, out: list[WorkerEvent]) -> None:
        process = slot.process
        code = process.exitcode
        reason = (
            f"worker process {process.pid} killed by signal {-code}"
            if code is not None and code < 0
            else f"worker process {process.pid} exited with code {code}"
        )
        out.append(WorkerLost(slot.worker, min(slot.running, default=None), reason))
        slot.running = set()
        slot.discard()
        if not slot.ready:
            slot.start_failures += 1
            if slot.start_failures >= _MAX_START_FAILURES:
                raise StagetreeError(
                    f"worker {slot.worker} died {slot.start_failures} times before it "
                    f"was ready ({reason}); not restarting it"
                )
        self._start_worker(slot)
