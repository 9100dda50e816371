"""Worker processes of :class:`~stagetree.executors.local.LocalExecutor` kept across
executors: a process-wide pool of idle workers (:data:`POOL`), and stopping or releasing
an executor's worker processes (:func:`shutdown_slots`, :func:`release_slots`).

See :mod:`stagetree.executors.local` for how executors lease pooled processes.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # registers its exit handler before ours
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from stagetree.executors._process import Release, Released
from stagetree.work import WorkerEvent

__all__ = [
    "POOL",
    "Slot",
    "WorkerPool",
    "pooled_pids",
    "release_slots",
    "shutdown_pool",
    "shutdown_slots",
]


@dataclass
class Slot:
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

    def discard(self) -> None:
        """Forget its exited process: close both pipes and the process object (the one
        teardown of a slot, whoever reaped the process)."""
        for conn in (self.inbox, self.outbox):
            if conn is not None:
                conn.close()
        self.inbox = self.outbox = None
        if self.process is not None:
            self.process.close()
        self.process = None


def shutdown_slots(slots: list[Slot], timeout: float) -> None:
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
        slot.discard()


def release_slots(slots: list[Slot], timeout: float) -> None:
    """Close an executor, keeping its healthy workers: each stops its batches, drops its
    trainer and says :class:`Released`; those that do within ``timeout`` go to the pool,
    the others (dead, busy past the timeout, unpooled) are stopped."""
    asked: list[Slot] = []
    stop: list[Slot] = []
    for slot in slots:
        if slot.process is None:
            continue
        if slot.key is None or slot.inbox is None or slot.process.exitcode is not None:
            stop.append(slot)
            continue
        try:
            slot.inbox.send(Release())
            asked.append(slot)
        except OSError:
            stop.append(slot)
    deadline = time.monotonic() + timeout
    released: list[Slot] = []
    while asked and time.monotonic() < deadline:
        for slot in list(asked):
            assert slot.outbox is not None
            try:
                while slot.outbox.poll():  # its last events, then Released
                    if isinstance(slot.outbox.recv(), Released):
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
    shutdown_slots(stop + asked, 2.0)
    idle = []
    for slot in released:
        idle.append(
            Slot(
                -1, slot.device, slot.process, slot.inbox, slot.outbox, key=slot.key, born=slot.born
            )
        )
        slot.process = slot.inbox = slot.outbox = None
        slot.running = set()
    POOL.put(idle, cap=len(slots))


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


class WorkerPool:
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
        self._idle: list[tuple[float, Slot]] = []  # (since, process), oldest first
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

    def take(self, key: tuple[Any, ...]) -> Slot | None:
        """A live idle process with this key (the most recently released), or None.

        A process started before a module of this process changed on disk (an edited
        editable install, a notebook's autoreload) may hold the old code: it is stopped.
        """
        with self._lock:
            if all(slot.key != key for _, slot in self._idle):
                return None
        edited = _newest_module_mtime()
        dead: list[Slot] = []
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
        shutdown_slots(dead, 1.0)
        return found

    def put(self, slots: list[Slot], cap: int) -> None:
        if not slots:
            return
        with self._lock:
            now = time.monotonic()
            self._idle.extend((now, slot) for slot in slots)
            excess = [slot for _, slot in self._idle[: max(0, len(self._idle) - cap)]]
            del self._idle[: len(excess)]
            if self._reaper is None or not self._reaper.is_alive():
                reaper = threading.Thread(
                    target=self._reap, name="stagetree-worker-pool", daemon=True
                )
                try:
                    reaper.start()
                    self._reaper = reaper
                except RuntimeError:  # interpreter shutdown: no thread, keep nothing
                    excess = [slot for _, slot in self._idle]
                    self._idle = []
            self._wake.notify_all()
        shutdown_slots(excess, 2.0)

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
            shutdown_slots(expired, 2.0)

    def shutdown(self) -> None:
        with self._lock:
            slots = [slot for _, slot in self._idle]
            self._idle = []
            self._wake.notify_all()
        shutdown_slots(slots, 5.0)

    def forget(self) -> None:
        """In a forked child: the parent's workers are not this process's to use."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = []
        self._reaper = None


POOL = WorkerPool()
# Registered after multiprocessing's exit handler (imported above), so it runs first.
atexit.register(POOL.shutdown)
os.register_at_fork(after_in_child=POOL.forget)


def shutdown_pool() -> None:
    """Stop every idle worker process kept for reuse in this process (also done at
    interpreter exit; a later executor spawns fresh ones)."""
    POOL.shutdown()


def pooled_pids() -> list[int]:
    """Process ids of the idle worker processes kept for reuse in this process."""
    return POOL.pids()
