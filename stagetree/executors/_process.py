"""The worker process of a :class:`~stagetree.executors.local.LocalExecutor`: its entry
point (:func:`worker_main`) and the messages between it and its driver.

A worker process serves one executor at a time, under a :class:`Lease`, with a fresh
:class:`~stagetree.executors.worker.Worker` per lease; released, it waits in the driver
process's pool (:mod:`stagetree.executors._pool`) for the next lease. This module is
what a worker process imports: it keeps to the worker's own needs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from stagetree.checkpoints import CheckpointStore
from stagetree.executors._events import StartupError, started
from stagetree.executors._spec import TrainerClasses, TrainerSpec
from stagetree.executors.devices import device_count
from stagetree.executors.worker import Worker
from stagetree.trainer import keep_caller_rng
from stagetree.work import Abort, AddCheckpoint, RunBatch, RunFused, SplitMissed, WorkerReady

__all__ = [
    "THREAD_VARS",
    "AddTrainer",
    "ChildConfig",
    "Lease",
    "Release",
    "Released",
    "child_env",
    "worker_main",
]

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Lease:
    """Driver -> worker: what one executor (one study) needs of a worker process. The
    first lease travels with the process's start; a pooled process receives the next
    executor's lease as a message (see :func:`shutdown_pool`)."""

    worker: int
    spec: TrainerSpec
    store: CheckpointStore  # pickles as its location
    progress_interval: float
    sys_path: tuple[str, ...] = ()
    step_timeout: float | None = None


@dataclass(frozen=True)
class ChildConfig:
    """What a worker process keeps for its whole life (what the pool is keyed by), and
    its first lease."""

    lease: Lease
    threads: int
    device: str | None
    # The parent's environment when the worker started: a forked worker takes it over
    # from the fork server's (which has the environment of when the server started).
    env: dict[str, str] | None = None


class Release:
    """Driver -> worker: the executor is closing and keeps the process for the next one:
    stop the running batches (as when shutting down), drop the trainer, say
    :class:`Released`, then wait for the next :class:`Lease` (or None: exit)."""


@dataclass(frozen=True)
class Released:
    """Worker -> driver: every batch ended, every checkpoint is durable, the worker holds
    nothing of the executor that leased it."""

    worker: int


@dataclass(frozen=True)
class AddTrainer:
    """Driver -> worker: the trainer of ``key`` (sent before its first batch there)."""

    key: str
    spec: TrainerSpec


def child_env(device: str | None, threads: int) -> dict[str, str]:
    env = {name: str(threads) for name in THREAD_VARS}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


def worker_main(cfg: ChildConfig, inbox: Connection, outbox: Connection) -> None:
    """Entry point of a worker process: serve leases until told to exit."""
    # The parent handles Ctrl-C and stops workers through close().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # What the process imported so far (a forked worker: its server's torch) lives as
    # long as it does: the collections that the warm-up's imports trigger, training's
    # and the one at each release (which the driver's close() waits for) skip it. Not
    # later: a lease's objects (a by-value trainer class, its cached data) must go.
    gc.freeze()
    if cfg.env is not None:
        os.environ.clear()
        os.environ.update(cfg.env)
    os.environ.update(child_env(cfg.device, cfg.threads))
    # Nothing here but the trainers draws random numbers: they need not keep ours.
    keep_caller_rng(False)
    lock = threading.Lock()

    def emit(event: Any) -> None:
        with lock:
            outbox.send(event)

    lease: Lease | None = cfg.lease
    try:
        while lease is not None and _serve(lease, cfg.threads, inbox, emit, cfg.device):
            emit(Released(lease.worker))
            lease = None
            while True:  # idle in the pool: only a lease or the exit sentinel arrive
                message = inbox.recv()
                if message is None or isinstance(message, Lease):
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


def _serve(
    lease: Lease,
    threads: int,
    inbox: Connection,
    emit: Callable[[Any], None],
    device: str | None = None,
) -> bool:
    """Serve one executor with a fresh :class:`Worker` (nothing of an earlier lease's
    trainers, models or batches survives). Returns True when released back to the pool,
    False when told to exit or unable to start. ``device``: the process's
    ``CUDA_VISIBLE_DEVICES`` (None: not pinned), whose devices it announces."""
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
    worker = Worker(
        lease.worker,
        trainers,
        store,
        emit,
        progress_interval=lease.progress_interval,
        emit_many=emit,  # a list of events goes down the pipe as one message
    )
    served = threading.Event()
    if lease.step_timeout is not None:
        threading.Thread(
            target=_watch,
            args=(worker, lease.step_timeout, served),
            name="stagetree-step-watch",
            daemon=True,
        ).start()
    backlog: deque[Any] = deque()
    nothing: list[AddCheckpoint | Abort] = []
    try:
        emit(WorkerReady(lease.worker, device_count(device)))
        while True:
            message = backlog.popleft() if backlog else inbox.recv()
            if message is None:
                return False
            if isinstance(message, Release):
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
                            if msg is None or isinstance(msg, Release):
                                # shutting down: stop these batches first
                                out.extend(Abort(i, lease.worker) for i in sorted(ids))
                            backlog.append(msg)
                    return out

                if isinstance(message, RunFused):
                    worker.run_fused(message, poll)
                else:
                    worker.run(message, poll)
            elif isinstance(message, AddTrainer):
                trainers.add(message.key, message.spec)
                # Load it now (import, warm-up) while this worker has nothing to do: a
                # spec that fails to load fails the batches that need it, at their start.
                with contextlib.suppress(Exception):
                    trainers[message.key]
            elif isinstance(message, AddCheckpoint):
                emit(SplitMissed(message.batch_id, lease.worker, message.node, message.step))
    finally:
        served.set()
        worker.close()  # every background checkpoint write is durable after this
        del worker, trainers, trainer_cls
        gc.collect()  # the trainer's model and data go now, not with the next lease
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


#: The exit status of a worker process stopped by its step-timeout watchdog.
STEP_TIMEOUT_EXIT = 3


def _watch(worker: Worker, timeout: float, served: threading.Event) -> None:
    """A step-timeout watchdog: when the step under way runs past ``timeout`` seconds,
    its batch fails with the reason (:meth:`Worker.expire`) and the process exits (the
    driver replaces it): a ``train()`` that never returns cannot be interrupted."""
    period = min(1.0, max(timeout / 4, 0.01))
    while not served.wait(period):
        if worker.expire(timeout):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(STEP_TIMEOUT_EXIT)
