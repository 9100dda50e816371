"""The :class:`Study`: a synchronous facade over the asynchronous engine.

A study owns nothing but a name, a trainer and a view of a shared engine. The engine
(one per storage and trainer in a process, see :func:`_engine_for`) owns the plan
storage, the checkpoint store, the I/O-free scheduler and an executor, and runs a
driver thread that feeds executor events to the scheduler and carries out its
instructions. Everything the engine learns (metrics, checkpoints, accounting) is
written to the plan, so a later process answers from it without training.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagetree.exceptions import (
    InvalidTrialError,
    StagetreeError,
    TrialCancelledError,
    TrialFailedError,
)
from stagetree.hp import Sequence, as_sequence, dumps_hp
from stagetree.plan import BasePlanStorage, RequestState, open_storage
from stagetree.space import canonical_json
from stagetree.trainer import Trainer
from stagetree.tuners.base import TrialResult, Tuner

if TYPE_CHECKING:
    from stagetree.checkpoints import CheckpointStore
    from stagetree.executors.base import BaseExecutor

__all__ = ["Study", "TrialRecord", "trainer_fingerprint"]

# Command-line overrides (``stagetree run --workers N --storage URL``): the CLI sets them
# before it runs a script, and every Study built by that script honours them.
_OVERRIDES: dict[str, Any] = {}


def trainer_fingerprint(trainer: type[Trainer]) -> str:
    """A short hash of the source of ``trainer``: the files that define it and the classes
    it derives from (up to :class:`Trainer`), so that editing the trainer never silently
    reuses old checkpoints. Falls back to the class's qualified name when no source can
    be read (e.g. classes typed into a REPL)."""
    files: set[str] = set()
    for cls in trainer.__mro__:
        if cls is Trainer or cls is object:
            continue
        module = sys.modules.get(cls.__module__)
        path = getattr(module, "__file__", None)
        if path:
            files.add(path)
        for attr in vars(cls).values():  # also finds classes run from a path (runpy)
            code = getattr(getattr(attr, "__func__", attr), "__code__", None)
            if code is not None and os.path.exists(code.co_filename):
                files.add(code.co_filename)
    digest = hashlib.sha256(f"{trainer.__module__}.{trainer.__qualname__}".encode())
    for path in sorted(files):
        try:
            digest.update(Path(path).read_bytes())
        except OSError:
            digest.update(path.encode())
    return digest.hexdigest()[:16]


@dataclass
class TrialRecord:
    """One trial of a study, as :meth:`Study.trials` returns it.

    Attributes:
        id: storage-wide trial id.
        config: fixed hyper-parameters.
        hp: sequences by name.
        steps: the most steps requested for this trial so far.
        state: ``pending`` | ``running`` | ``done`` | ``failed`` | ``cancelled``.
        metrics: every known metric on the trial's path, by step.
    """

    id: int
    config: dict[str, Any]
    hp: dict[str, Sequence]
    steps: int
    state: str
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)


def _default_checkpoint_dir(url: str) -> tuple[Path, bool]:
    """Where checkpoints go when the study does not say, and whether that directory is
    temporary (removed when the engine closes): beside a SQLite file; a temporary
    directory for an in-memory plan (nothing outlives it); ``./stagetree_checkpoints``
    otherwise (a server database: pass a directory every process can reach)."""
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///") :])
        return db.with_name(db.name + ".checkpoints"), False
    if url.startswith(("memory", ":memory:")):
        return Path(tempfile.mkdtemp(prefix="stagetree-ckpt-")), True
    return Path("stagetree_checkpoints"), False


def root_scope(root_key: str) -> str:
    """The accounting scope of one plan tree (see ``BasePlanStorage.add_stats``)."""
    return f"root:{root_key}"


class _Waiter:
    """A pending request of one submission: a future and what it needs to resolve."""

    __slots__ = ("future", "study", "trial_id")

    def __init__(self, study: str, trial_id: int) -> None:
        self.future: concurrent.futures.Future[dict[str, float]] = concurrent.futures.Future()
        self.study = study
        self.trial_id = trial_id


# Submissions closer together than _QUIET seconds are planned together (waiting at most
# _MAX_DELAY seconds): cheap next to a training step, and it spares the workers from
# racing past branch points of trials that were submitted at the same moment.
_QUIET = 0.02
_MAX_DELAY = 0.25


class _Engine:
    """Plan + checkpoint store + scheduler + executor, driven by one thread.

    Every access to the storage and the scheduler holds ``lock``; the driver thread
    takes it while it applies a batch of events, user threads take it to submit.
    """

    def __init__(
        self,
        storage: BasePlanStorage,
        store: CheckpointStore,
        executor_factory: Any,
        policy: str,
        max_retries: int,
        checkpoint_budget: int | None,
    ) -> None:
        from stagetree.scheduler import Scheduler

        self.storage = storage
        self.store = store
        self.lock = threading.RLock()
        self._executor_factory = executor_factory
        self.executor: BaseExecutor | None = None
        self.scheduler = Scheduler(policy=policy, max_retries=max_retries)
        self.checkpoint_budget = checkpoint_budget
        self._waiters: dict[tuple[int, int], list[_Waiter]] = {}
        self._known_roots: set[str] = set()
        self._known_nodes: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self.users = 0
        self.temporary_checkpoints = False  # remove the store's directory on close
        self._inflight: set[int] = set()
        self._queued: list[Any] = []
        self._start_refs: dict[int, str | None] = {}
        self._batch_roots: dict[int, str] = {}
        self._first_queued = self._last_queued = 0.0
        # batch id -> [start step, last reported step]: steps trained by running batches.
        self._positions: dict[int, list[int]] = {}
        self._idle = threading.Condition(self.lock)

    # -- life cycle ----------------------------------------------------------------------

    def ensure_started(self) -> None:
        with self.lock:
            if self.error is not None:
                raise StagetreeError(f"the study engine stopped: {self.error!r}") from self.error
            if self.executor is not None:
                return
            self.executor = self._executor_factory()
            self.executor.start()
            if getattr(self.executor, "virtual_time", False):
                return  # virtual time: Study.tune pumps it from the tuner's loop, no thread
            self._thread = threading.Thread(target=self._run, name="stagetree-engine", daemon=True)
            self._thread.start()

    @property
    def num_workers(self) -> int:
        return self.executor.num_workers if self.executor is not None else 1

    def running_steps(self) -> int:
        """Steps trained so far by batches that have not ended yet."""
        return sum(last - start for start, last in self._positions.values())

    def settle(self, timeout: float = 30.0) -> None:
        """When no submission is waiting any more, wait (at most ``timeout`` s) for the
        batches still in flight to report their end (background checkpoint writes,
        accounting), so that statistics are complete."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._inflight and not self._waiters and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._idle.wait(left)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.executor is not None:
            self.executor.close()
        with self.lock:
            for waiters in self._waiters.values():
                for w in waiters:
                    if not w.future.done():
                        w.future.set_exception(TrialCancelledError("the study was closed"))
                        self._set_trial_state(w, "cancelled")
            self._waiters.clear()
            # Requests this process held are no longer wanted: a later run asks again.
            for req in self.storage.requests(states=[RequestState.PENDING, RequestState.SCHEDULED]):
                self.storage.release_request(req.node, req.step, req.refcount)
        self.storage.close()
        if self.temporary_checkpoints:
            shutil.rmtree(self.store.directory, ignore_errors=True)

    # -- requests ------------------------------------------------------------------------

    def request(
        self,
        study: str,
        trial_id: int,
        root_key: str,
        node: int,
        step: int,
        leaf: int | None = None,
    ) -> _Waiter:
        """Ask for ``(node, step)``; the caller has inserted the trial (up to the node
        ``leaf``, at or below ``node``) and holds a reference to the request. Called with
        ``lock`` held."""
        from stagetree.scheduler import RequestAdded

        waiter = _Waiter(study, trial_id)
        self._waiters.setdefault((node, step), []).append(waiter)
        events = self._path_events(root_key, node if leaf is None else leaf)
        events.append(RequestAdded(node, step))
        self._enqueue(events)
        return waiter

    def declare(self, root_key: str, leaf: int) -> None:
        """Make the scheduler know the path to ``leaf`` before anything is requested on it
        (trials a tuner will submit later), so that batches checkpoint where it branches
        off. Called with ``lock`` held."""
        self._enqueue(self._path_events(root_key, leaf))

    def _path_events(self, root_key: str, leaf: int) -> list[Any]:
        """Scheduler events for the root, the nodes and the durable checkpoints of the
        path to ``leaf`` that the scheduler has not seen yet."""
        from stagetree.scheduler import CheckpointAvailable, NodeAdded, RootAdded

        events: list[Any] = []
        if root_key not in self._known_roots:
            self._known_roots.add(root_key)
            events.append(RootAdded(root_key, self.storage.root_config(root_key)))
        path = self.storage.path(leaf)
        new = [n for n in path if n.id not in self._known_nodes]
        for n in new:
            self._known_nodes.add(n.id)
            events.append(NodeAdded(n))
        if new:
            ids = {n.id for n in path}
            for (cnode, cstep), rec in self.storage.checkpoints(root_key).items():
                if cnode in ids and self.store.exists(rec.ref):
                    events.append(CheckpointAvailable(cnode, cstep, rec.ref))
        return events

    def _enqueue(self, events: list[Any]) -> None:
        """Queue scheduler events from user threads; the driver applies them together
        (see :meth:`pump`), so trials submitted at once are planned at once."""
        now = time.monotonic()
        if not self._queued:
            self._first_queued = now
        self._last_queued = now
        self._queued.extend(events)
        self._wake.set()

    def _flush(self, coalesce: bool = False) -> None:
        with self.lock:  # _enqueue runs under the lock: the queue and its times agree
            if coalesce and not self._settled():
                return
            events, self._queued = self._queued, []
            if events:
                self._apply(self.scheduler.handle_all(events))

    def cancel(self, waiter: _Waiter, node: int, step: int) -> None:
        from stagetree.scheduler import RequestCancelled

        with self.lock:
            waiters = self._waiters.get((node, step), [])
            if waiter not in waiters:
                return
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[(node, step)]
            req = self.storage.request(node, step)
            if req is not None and req.state not in (RequestState.DONE, RequestState.FAILED):
                self.storage.release_request(node, step)
                self._enqueue([RequestCancelled(node, step)])
            if not waiter.future.done():
                waiter.future.set_exception(TrialCancelledError(f"request ({node}, {step})"))
            self._set_trial_state(waiter, "cancelled")

    # -- driver thread -------------------------------------------------------------------

    def _run(self) -> None:
        assert self.executor is not None
        try:
            while not self._stop.is_set():
                self._coalesce()
                if not self.pump(timeout=0.01, coalesce=True) and not self._queued:
                    # Nothing happened: sleep until a submission or the next poll.
                    self._wake.wait(0.01)
                    self._wake.clear()
        except BaseException as exc:  # keep the error for every waiter and later calls
            self.error = exc
            tb = traceback.format_exc()
            with self.lock:
                for waiters in self._waiters.values():
                    for w in waiters:
                        if not w.future.done():
                            w.future.set_exception(TrialFailedError(f"engine failed: {exc!r}", tb))
                self._waiters.clear()

    def _coalesce(self) -> None:
        """Let a burst of submissions (a tuner submitting a rung, ``asyncio.gather`` of
        several trials) finish arriving before planning: wait until no request came for
        ``_QUIET`` s, at most ``_MAX_DELAY`` s after the first one."""
        while self._queued and not self._stop.is_set() and not self._settled():
            time.sleep(max(0.0, _QUIET - (time.monotonic() - self._last_queued)))

    def _settled(self) -> bool:
        now = time.monotonic()
        return now - self._last_queued >= _QUIET or now - self._first_queued >= _MAX_DELAY

    def pump(self, timeout: float | None, coalesce: bool = False) -> int:
        """One round of the driver: plan the queued submissions (with ``coalesce``, only
        once a burst of them has settled), take the executor's next events (waiting at
        most ``timeout`` s) and apply them. Returns how many events were applied. The driver
        thread calls it in a loop; a virtual-time executor may be pumped by its caller."""
        assert self.executor is not None
        self._flush(coalesce)
        events = self.executor.events(timeout=0 if self._queued else timeout)
        if events:
            with self.lock:
                for ev in events:
                    self._on_event(ev)
        return len(events)

    def _on_event(self, ev: Any) -> None:
        from stagetree import work

        scope = "engine"
        if isinstance(ev, work.MetricsReported):
            self.storage.put_metrics(ev.node, ev.step, ev.metrics)
        elif isinstance(ev, work.CheckpointSaved):
            self.storage.put_checkpoint(ev.node, ev.step, ev.ref, ev.nbytes)
            self.storage.add_stats(
                scope, ckpt_saves=1, ckpt_save_seconds=ev.seconds, ckpt_bytes=ev.nbytes
            )
        ended = ev.batch_id if isinstance(ev, (work.BatchDone, work.BatchFailed)) else None
        if isinstance(ev, work.WorkerLost):
            ended = ev.batch_id
        if ended is not None:
            self._inflight.discard(ended)
            self._positions.pop(ended, None)
            self._idle.notify_all()
        elif isinstance(ev, work.Progress) and ev.batch_id in self._positions:
            self._positions[ev.batch_id][1] = ev.step
        elif isinstance(ev, work.SplitMissed):
            self.storage.add_stats(scope, splits_missed=1)
        if isinstance(ev, work.BatchDone):
            self.storage.add_stats(scope, device_seconds=ev.busy_seconds, steps_executed=ev.steps)
            root = self._batch_roots.get(ev.batch_id)
            if root is not None:  # per tree too, so each study can count its own
                self.storage.add_stats(
                    root_scope(root), device_seconds=ev.busy_seconds, steps_executed=ev.steps
                )
            if ev.load_seconds:
                self.storage.add_stats(scope, ckpt_loads=1, ckpt_load_seconds=ev.load_seconds)
        if isinstance(ev, work.BatchFailed) and ev.kind == "checkpoint":
            # The start checkpoint is unreadable: forget it; the scheduler replans the
            # work from an earlier checkpoint.
            ref = self._start_refs.get(ev.batch_id)
            for (node, step), rec in self.storage.checkpoints().items():
                if rec.ref == ref:
                    self.storage.remove_checkpoint(node, step)
        if ended is not None:
            self._start_refs.pop(ended, None)
            self._batch_roots.pop(ended, None)
        self._apply(self.scheduler.handle(ev))
        if isinstance(ev, work.CheckpointSaved) and self.checkpoint_budget is not None:
            self._evict()

    def _apply(self, out: Iterable[Any]) -> None:
        from stagetree import work
        from stagetree.scheduler import RequestDone, RequestFailed

        for item in out:
            if isinstance(item, (work.RunBatch, work.AddCheckpoint, work.Abort)):
                assert self.executor is not None
                if isinstance(item, work.RunBatch):
                    self._inflight.add(item.batch_id)
                    self._positions[item.batch_id] = [item.start_step, item.start_step]
                    self._start_refs[item.batch_id] = item.start_checkpoint
                    self._batch_roots[item.batch_id] = item.root_key
                    for seg in item.segments:
                        self._mark_running(seg.node)
                if isinstance(item, work.AddCheckpoint):
                    self.storage.add_stats("engine", live_splits=1)
                self.executor.submit(item)
            elif isinstance(item, RequestDone):
                self._resolve(item.node, item.step, metrics=dict(item.metrics))
            elif isinstance(item, RequestFailed):
                self._resolve(item.node, item.step, error=(item.error, item.traceback))

    def _mark_running(self, node: int) -> None:
        for (n, _step), waiters in self._waiters.items():
            if n == node:
                for w in waiters:
                    self._set_trial_state(w, "running", only_from="pending")

    def _resolve(
        self,
        node: int,
        step: int,
        metrics: dict[str, float] | None = None,
        error: tuple[str, str] | None = None,
    ) -> None:
        req = self.storage.request(node, step)
        if error is not None:
            if req is not None:
                self.storage.set_request_state(node, step, RequestState.FAILED, error=error[0])
        else:
            if metrics is None:
                metrics = self.storage.get_metrics(node, step) or {}
            if req is not None:
                self.storage.set_request_state(node, step, RequestState.DONE)
        for w in self._waiters.pop((node, step), []):
            if w.future.done():
                continue
            if error is not None:
                w.future.set_exception(TrialFailedError(error[0], error[1]))
                self._set_trial_state(w, "failed")
            else:
                assert metrics is not None
                w.future.set_result(metrics)
                self._set_trial_state(w, "done")

    def _set_trial_state(self, w: _Waiter, state: str, only_from: str | None = None) -> None:
        try:
            if only_from is not None:
                current = self.storage.trial(w.trial_id)["state"]
                if current != only_from:
                    return
            self.storage.update_trial(w.trial_id, state=state)
        except StagetreeError:
            pass  # the trial record is informative only

    def _evict(self) -> None:
        """Keep the checkpoint store within its budget (cost-benefit, see
        :meth:`CheckpointStore.evict`); never drop a checkpoint a live request needs."""
        from stagetree.checkpoints import EvictionInfo
        from stagetree.scheduler import CheckpointLost

        assert self.checkpoint_budget is not None
        if self.store.total_bytes() <= self.checkpoint_budget:
            return
        records = self.storage.checkpoints()
        live = self.storage.requests(states=[RequestState.PENDING, RequestState.SCHEDULED])
        # A checkpoint is needed when it is the latest one on a live request's path.
        by_node: dict[int, list[int]] = {}
        for node, step in records:
            by_node.setdefault(node, []).append(step)
        needed: set[str] = set()
        pending_refs: dict[str, int] = {}
        for req in live:
            path = self.storage.path(req.node)
            best: tuple[int, int] | None = None
            for i, n in enumerate(path):
                hi = path[i + 1].branch_step if i + 1 < len(path) else req.step
                for s in by_node.get(n.id, []):
                    if s <= hi and s <= req.step and (best is None or s >= best[1]):
                        best = (n.id, s)
            if best is not None:
                ref = records[best].ref
                needed.add(ref)
                pending_refs[ref] = pending_refs.get(ref, 0) + req.refcount
        candidates = {
            rec.ref: EvictionInfo(
                recompute_cost=float(step), pending_refs=pending_refs.get(rec.ref, 0)
            )
            for (_node, step), rec in records.items()
        }
        removed = set(self.store.evict(candidates, needed))
        for (node, step), rec in records.items():
            if rec.ref in removed:
                self.storage.remove_checkpoint(node, step)
                self._apply(self.scheduler.handle(CheckpointLost(node, step)))


_ENGINES: dict[tuple[str, str], _Engine] = {}
_ENGINES_LOCK = threading.Lock()


def _trainer_ref(trainer: type[Trainer]) -> str:
    return f"{trainer.__module__}:{trainer.__qualname__}:{id(trainer)}"


class Study:
    """One optimization run: a trainer, a storage, and the trials submitted to it.

    Args:
        name: the study's name in the storage (a study of that name is continued).
        trainer: a :class:`~stagetree.Trainer` subclass.
        storage: plan storage URL (``sqlite:///path.db``, ``postgresql://...``,
            ``memory://``) or an open :class:`~stagetree.plan.BasePlanStorage`.
        workers: number of worker processes (default: one per visible CUDA device, else
            one).
        share: False runs every trial independently from step 0 (the trial-based
            baseline); promotions of the same trial still resume it.
        checkpoint_dir: where checkpoints go (default: beside the SQLite file, a
            temporary directory otherwise).
        checkpoint_budget: bytes the checkpoint store may hold (None: unlimited).
        version: overrides the trainer's source fingerprint in the root key.
        executor: ``"local"`` (worker processes, the default), ``"inline"`` (in this
            process; for debugging and tests), ``"simulated"`` (virtual time, no training:
            :class:`~stagetree.executors.SimulatedExecutor`) or a factory returning a
            ``BaseExecutor``.
        policy: scheduling policy: ``"critical_path"`` (default), ``"bfs"`` or ``"thr"``.
        max_retries: how often a failing stage is retried before its requests fail.
        threads_per_worker: torch/OpenMP threads per worker process (default: the
            machine's cores divided among the workers).

    Studies on the same storage with the same trainer in one process share one engine,
    so they share stages while they run; studies in other processes share everything
    that was stored (metrics, checkpoints).
    """

    def __init__(
        self,
        name: str,
        trainer: type[Trainer],
        storage: str | BasePlanStorage = "sqlite:///stagetree.db",
        workers: int | None = None,
        share: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_budget: int | None = None,
        version: str | None = None,
        executor: Any = "local",
        policy: str = "critical_path",
        max_retries: int = 0,
        threads_per_worker: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"study name must be a non-empty string, got {name!r}")
        if not (isinstance(trainer, type) and issubclass(trainer, Trainer)):
            raise TypeError(f"trainer must be a Trainer subclass, got {trainer!r}")
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if checkpoint_budget is not None and checkpoint_budget < 0:
            raise ValueError(f"checkpoint_budget must be >= 0, got {checkpoint_budget!r}")
        workers = _OVERRIDES.get("workers", workers)
        storage = _OVERRIDES.get("storage", storage)
        self.name = name
        self.trainer = trainer
        self.share = share
        self.version = version if version is not None else trainer_fingerprint(trainer)
        self._engine_args = (
            storage,
            workers,
            checkpoint_dir,
            checkpoint_budget,
            executor,
            policy,
            max_retries,
            threads_per_worker,
        )
        # The storage is opened on first use, not here: worker processes import user
        # scripts to find the trainer class, and the Study those scripts build there
        # must stay inert.
        self._engine_obj: _Engine | None = None
        self._closed = False
        self._started = time.monotonic()
        self._names: tuple[frozenset[str], frozenset[str]] | None = None
        self._trial_ids: dict[tuple[str, str], int] = {}
        self._horizon = 0  # steps the current tuner may train a trial to (0: unknown)
        self._meta: dict[str, Any] = {}  # recorded with the study when it is created

    @property
    def _engine(self) -> _Engine:
        if self._engine_obj is None:
            self._attach()
        assert self._engine_obj is not None
        return self._engine_obj

    def _attach(self) -> None:
        """Join (or make) the engine of this storage and trainer; load this study."""
        if self._closed:
            raise StagetreeError(f"study {self.name!r} is closed")
        storage = self._engine_args[0]
        url = storage if isinstance(storage, str) else f"object:{id(storage)}"
        key = (url, _trainer_ref(self.trainer))
        with _ENGINES_LOCK:
            engine = _ENGINES.get(key)
            if engine is None:
                engine = self._make_engine(*self._engine_args)
                _ENGINES[key] = engine
            engine.users += 1
        self._engine_key = key
        self._engine_obj = engine
        with engine.lock:
            meta = {"version": self.version, "share": self.share, **self._meta}
            engine.storage.create_study(self.name, meta)
            for t in engine.storage.trials(self.name):
                self._trial_ids[(canonical_json(t["config"]), dumps_hp(t["hp"]))] = t["id"]
                if self._names is None:
                    self._names = (frozenset(t["config"]), frozenset(t["hp"]))

    def open(self) -> Study:
        """Open the storage now (it is otherwise opened on first use); returns self.

        Raises:
            StorageError: the storage URL cannot be opened.
        """
        _ = self._engine
        return self

    def _make_engine(
        self,
        storage: str | BasePlanStorage,
        workers: int | None,
        checkpoint_dir: str | os.PathLike[str] | None,
        checkpoint_budget: int | None,
        executor: Any,
        policy: str,
        max_retries: int,
        threads_per_worker: int | None,
    ) -> _Engine:
        from stagetree.checkpoints import CheckpointStore

        plan = open_storage(storage) if isinstance(storage, str) else storage
        url = storage if isinstance(storage, str) else "memory://"
        temporary = False
        if checkpoint_dir is not None:
            ckdir = Path(checkpoint_dir)
        else:
            ckdir, temporary = _default_checkpoint_dir(url)
        store = CheckpointStore(ckdir, budget_bytes=checkpoint_budget)
        trainer = self.trainer

        def factory() -> BaseExecutor:
            if callable(executor) and not isinstance(executor, str):
                return executor()
            if executor == "inline":
                from stagetree.executors import InlineExecutor

                return InlineExecutor(trainer, checkpoint_dir=ckdir)
            if executor == "local":
                from stagetree.executors import LocalExecutor

                return LocalExecutor(
                    trainer,
                    num_workers=workers,
                    checkpoint_dir=ckdir,
                    threads_per_worker=threads_per_worker,
                )
            if executor == "simulated":
                from stagetree.executors.simulated import SimulatedExecutor

                return SimulatedExecutor(num_workers=workers or 1)
            raise ValueError(
                f"executor must be 'local', 'inline', 'simulated' or a factory, got {executor!r}"
            )

        engine = _Engine(plan, store, factory, policy, max_retries, checkpoint_budget)
        engine.temporary_checkpoints = temporary
        return engine

    # -- context manager -----------------------------------------------------------------

    def __enter__(self) -> Study:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (when no other study uses them) and close the storage."""
        if self._closed:
            return
        self._closed = True
        if self._engine_obj is None:
            return
        with _ENGINES_LOCK:
            self._engine.users -= 1
            last = self._engine.users == 0
            if last:
                _ENGINES.pop(self._engine_key, None)
        if last:
            self._engine.close()

    # -- trials --------------------------------------------------------------------------

    def root_key(self, config: Mapping[str, Any], hp: Mapping[str, Sequence] | None = None) -> str:
        """The plan tree of a trial: trainer version + fixed config (+ the trial's own
        sequences when ``share=False``, so that nothing is shared)."""
        text = canonical_json({"version": self.version, "config": dict(config)})
        if not self.share:
            assert hp is not None
            text += "|trial|" + dumps_hp(hp)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def _normalise(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int
    ) -> tuple[dict[str, Any], dict[str, Sequence]]:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InvalidTrialError(f"steps must be a non-negative int, got {steps!r}")
        if not isinstance(config, Mapping) or not isinstance(hp, Mapping):
            raise InvalidTrialError("config and hp must be mappings")
        seqs = {str(k): as_sequence(v) for k, v in hp.items()}
        cfg = dict(config)
        try:
            canonical_json(cfg)
        except (TypeError, ValueError) as exc:
            raise InvalidTrialError(f"config must be JSON-serialisable: {exc}") from exc
        names = (frozenset(cfg), frozenset(seqs))
        if self._names is None:
            self._names = names
        elif names != self._names:
            want_c, want_h = self._names
            diff = []
            for label, have, want in (("config", names[0], want_c), ("hp", names[1], want_h)):
                if have - want:
                    diff.append(f"unexpected {label} names {sorted(have - want)}")
                if want - have:
                    diff.append(f"missing {label} names {sorted(want - have)}")
            raise InvalidTrialError(f"trial does not match study {self.name!r}: " + "; ".join(diff))
        return cfg, seqs

    def _trial_id(
        self,
        root_key: str,
        cfg: dict[str, Any],
        seqs: dict[str, Sequence],
        steps: int,
        node: int,
        step: int,
    ) -> int:
        storage = self._engine.storage
        ident = (canonical_json(cfg), dumps_hp(seqs))
        tid = self._trial_ids.get(ident)
        if tid is None:
            tid = storage.add_trial(self.name, root_key, cfg, seqs, steps, node, step)
            self._trial_ids[ident] = tid
        else:
            rec = storage.trial(tid)
            if steps > rec["steps"]:
                storage.update_trial(tid, steps=steps, node=node, step=step, state="pending")
        return tid

    async def submit(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int
    ) -> TrialResult:
        """Train the trial ``(config, hp)`` to ``steps`` steps and return its result.

        A trial that reached fewer steps before resumes from there; one whose metrics at
        ``steps`` are known (from this or an earlier run) answers without training. May
        be awaited from any event loop.

        Raises:
            InvalidTrialError: bad steps, or names that differ from the study's trials.
            TrialFailedError: the trainer raised in a stage this trial needs.
            TrialCancelledError: the study was closed or the request cancelled.
        """
        fut, cfg, seqs, node, step, waiter = self._submit(config, hp, steps)
        try:
            metrics = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if waiter is not None:
                self._engine.cancel(waiter, node, step)
            raise
        return self._result(cfg, seqs, steps, metrics)

    def _submit(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int
    ) -> tuple[
        concurrent.futures.Future[dict[str, float]],
        dict[str, Any],
        dict[str, Sequence],
        int,
        int,
        _Waiter | None,
    ]:
        if self._closed:
            raise StagetreeError(f"study {self.name!r} is closed")
        cfg, seqs = self._normalise(config, hp, steps)
        engine = self._engine
        root_key = self.root_key(cfg, seqs)
        with engine.lock:
            storage = engine.storage
            storage.register_root(root_key, cfg)
            # The path goes in up to the tuner's horizon, so that the scheduler knows
            # where this trial will branch off others later (branch checkpoints).
            ins = storage.insert_trial(root_key, seqs, max(steps, self._horizon), request=False)
            leaf = ins.node
            if self._horizon > steps:
                where = storage.locate(root_key, seqs, steps)
                assert where is not None
                node, step = where
            else:
                node, step = ins.node, ins.step
            tid = self._trial_id(root_key, cfg, seqs, steps, node, step)
            known = storage.get_metrics(node, step)
            if known is not None:
                storage.update_trial(tid, state="done")
                fut: concurrent.futures.Future[dict[str, float]] = concurrent.futures.Future()
                fut.set_result(known)
                return fut, cfg, seqs, node, step, None
        engine.ensure_started()
        with engine.lock:
            storage.add_request(node, step)
            waiter = engine.request(self.name, tid, root_key, node, step, leaf=leaf)
        return waiter.future, cfg, seqs, node, step, waiter

    def _result(
        self,
        cfg: dict[str, Any],
        seqs: dict[str, Sequence],
        steps: int,
        metrics: Mapping[str, float],
    ) -> TrialResult:
        with self._engine.lock:
            history = self._engine.storage.metrics_along(self.root_key(cfg, seqs), seqs, steps)
        return TrialResult(config=cfg, hp=seqs, steps=steps, metrics=dict(metrics), history=history)

    def declare(self, trials: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
        """Announce trials ``(config, hp)`` that will be submitted later (tuners that draw
        their configurations up front do this): their paths go into the plan up to the
        tuner's horizon, without requests, so that running batches checkpoint where they
        will branch off and nothing is recomputed when they arrive."""
        engine = self._engine
        with engine.lock:
            for config, hp in trials:
                cfg, seqs = self._normalise(config, hp, self._horizon)
                if not self._horizon:
                    return  # no horizon known: nothing beyond what submissions insert
                root_key = self.root_key(cfg, seqs)
                engine.storage.register_root(root_key, cfg)
                ins = engine.storage.insert_trial(root_key, seqs, self._horizon, request=False)
                engine.declare(root_key, ins.node)

    def run(self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int) -> TrialResult:
        """Synchronous :meth:`submit` for one trial."""
        return self._drive(self.submit(config, hp, steps))

    def eval(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, float] | None:
        """Known metrics of the trial after ``step`` steps, without training; else None."""
        cfg, seqs = self._normalise(config, hp, step)
        with self._engine.lock:
            where = self._engine.storage.locate(self.root_key(cfg, seqs), seqs, step)
            if where is None:
                return None
            return self._engine.storage.get_metrics(*where)

    def state(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, Any] | None:
        """The trainer state (``Trainer.state_dict()``) of the trial after ``step``
        steps, loaded from its checkpoint; None when no checkpoint of that point exists
        (it was never reached, or evicted). Load it into ``trainer_cls(config)`` with
        ``load_state_dict`` to get the trained model."""
        cfg, seqs = self._normalise(config, hp, step)
        with self._engine.lock:
            where = self._engine.storage.locate(self.root_key(cfg, seqs), seqs, step)
            rec = self._engine.storage.checkpoint(*where) if where is not None else None
        if rec is None:
            return None
        return self._engine.store.load(rec.ref)

    @staticmethod
    async def wait_any(
        aws: Iterable[Awaitable[Any]],
    ) -> tuple[set[asyncio.Future[Any]], set[asyncio.Future[Any]]]:
        """Wait until the first of ``aws`` finishes: returns ``(done, pending)``."""
        tasks = {asyncio.ensure_future(a) for a in aws}
        return await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)

    @staticmethod
    async def wait_all(aws: Iterable[Awaitable[Any]]) -> list[Any]:
        """Wait for all of ``aws``; returns results (or exceptions) in order."""
        return list(await asyncio.gather(*aws, return_exceptions=True))

    @staticmethod
    def cancel(task: asyncio.Future[Any]) -> bool:
        """Cancel a submission's task; its request is released (work another live
        request still needs goes on)."""
        return task.cancel()

    # -- tuners --------------------------------------------------------------------------

    def tune(self, tuner: Tuner) -> TrialResult | None:
        """Run ``tuner`` to completion and return the best trial's result.

        The tuner's decisions are logged in the storage: a study killed mid-run and
        started again replays them and trains nothing twice.

        With a virtual-time executor (``executor="simulated"`` or a factory of a
        :class:`~stagetree.executors.simulated.SimulatedExecutor`) no driver thread
        runs: the tuner's event loop delivers the executor's virtual instants itself
        (:func:`~stagetree.executors.simulated.drive`), so the same study simulated
        twice takes the same decisions at the same virtual times.
        """
        runner = _StudyRunner(self)
        self._horizon = _tuner_horizon(tuner)
        self._meta = {"metric": tuner.metric, "mode": tuner.mode, "tuner": type(tuner).__name__}
        return self._drive(tuner.run(runner))

    def _drive(self, coro: Any) -> Any:
        """Run ``coro`` to completion from sync code; with a virtual-time executor, its
        event loop also delivers the executor's instants (no driver thread runs)."""
        engine = self._engine
        engine.ensure_started()
        if not getattr(engine.executor, "virtual_time", False):
            return _run_coro(coro)
        from stagetree.executors.simulated import drive

        def pump(timeout: float) -> int:
            try:
                return engine.pump(timeout)
            except BaseException as exc:  # the engine is unusable now, as after a thread error
                engine.error = exc
                raise

        return _run_coro(drive(coro, pump, engine.executor))

    @property
    def num_workers(self) -> int:
        self._engine.ensure_started()
        return self._engine.num_workers

    # -- reports -------------------------------------------------------------------------

    def trials(self) -> list[TrialRecord]:
        """Every trial of this study with its metrics by step."""
        with self._engine.lock:
            storage = self._engine.storage
            out = []
            for t in storage.trials(self.name):
                hist = storage.metrics_along(t["root_key"], t["hp"], t["steps"])
                out.append(TrialRecord(t["id"], t["config"], t["hp"], t["steps"], t["state"], hist))
            return out

    def best(self, metric: str, mode: str = "max") -> TrialRecord | None:
        """The trial with the best ``metric`` at its last step (NaN ranks worst)."""
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        best: tuple[float, TrialRecord] | None = None
        for t in self.trials():
            m = t.metrics.get(t.steps, {}).get(metric)
            if m is None or not math.isfinite(m):
                continue
            score = m if mode == "max" else -m
            if best is None or score > best[0]:
                best = (score, t)
        return best[1] if best else None

    def stats(self) -> dict[str, float]:
        """Accounting: ``steps_requested`` (total steps of this study's trials),
        ``steps_unique`` (steps of the union of their paths), ``steps_executed`` and
        ``device_seconds`` (trained on the plan trees this study uses, over every run on
        this storage: a tree shared with another study counts for both), ``merge_rate``,
        and storage-wide checkpoint seconds/bytes and live-split counts."""
        from stagetree.stages import unique_steps

        self._engine.settle()
        with self._engine.lock:
            storage = self._engine.storage
            trials = storage.trials(self.name)
            requested = float(sum(t["steps"] for t in trials))
            roots = {t["root_key"] for t in trials}
            nodes = {n.id: n for root in roots for n in storage.nodes(root)}
            unique = float(unique_steps(nodes, [(t["node"], t["step"]) for t in trials]))
            engine_stats: dict[str, float] = {}
            for root in roots:
                for k, v in storage.stats(root_scope(root)).items():
                    engine_stats[k] = engine_stats.get(k, 0.0) + v
            everything = storage.stats("engine")
        out = {
            "trials": float(len(trials)),
            "steps_requested": requested,
            "steps_unique": unique,
            "merge_rate": requested / unique if unique else 1.0,
            "steps_executed": engine_stats.get("steps_executed", 0.0),
            "device_seconds": engine_stats.get("device_seconds", 0.0),
            "ckpt_save_seconds": everything.get("ckpt_save_seconds", 0.0),
            "ckpt_load_seconds": everything.get("ckpt_load_seconds", 0.0),
            "ckpt_bytes": everything.get("ckpt_bytes", 0.0),
            "live_splits": everything.get("live_splits", 0.0),
            "splits_missed": everything.get("splits_missed", 0.0),
        }
        return out

    def progress(self) -> dict[str, float]:
        """A cheap snapshot for progress displays: ``trials`` (submitted),
        ``finished``, ``running``, ``failed``, ``steps_requested`` (total steps of the
        submitted trials), ``steps_executed`` (by the engine so far), ``device_seconds``,
        ``elapsed`` (seconds since this Study object was made)."""
        with self._engine.lock:
            storage = self._engine.storage
            trials = storage.trials(self.name)
            engine_stats = storage.stats("engine")
            running = self._engine.running_steps()
        states = [t["state"] for t in trials]
        return {
            "trials": float(len(trials)),
            "finished": float(states.count("done")),
            "running": float(states.count("running")),
            "pending": float(states.count("pending")),
            "failed": float(states.count("failed")),
            "steps_requested": float(sum(t["steps"] for t in trials)),
            "steps_executed": engine_stats.get("steps_executed", 0.0) + running,
            "device_seconds": engine_stats.get("device_seconds", 0.0),
            "elapsed": time.monotonic() - self._started,
        }


def _tuner_horizon(tuner: Tuner) -> int:
    """The most steps ``tuner`` may train one trial to, when it says (0 otherwise)."""
    steps = [getattr(tuner, name, None) for name in ("max_steps", "steps")]
    schedule = getattr(tuner, "schedule", None)
    if schedule:
        steps.extend(s for s, _n in schedule)
    return max((s for s in steps if isinstance(s, int)), default=0)


class _StudyRunner:
    """The :class:`~stagetree.tuners.base.TrialRunner` a study gives its tuners."""

    def __init__(self, study: Study) -> None:
        self.study = study

    async def submit(
        self, config: dict[str, Any], hp: dict[str, Sequence], steps: int
    ) -> TrialResult:
        return await self.study.submit(config, hp, steps)

    def num_workers(self) -> int:
        return self.study.num_workers

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Sequence]]]) -> None:
        self.study.declare(trials)

    def append_log(self, record: dict[str, Any]) -> None:
        with self.study._engine.lock:
            self.study._engine.storage.append_log(self.study.name, record)

    def read_log(self) -> list[dict[str, Any]]:
        with self.study._engine.lock:
            return self.study._engine.storage.read_log(self.study.name)


def _run_coro(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also inside a running event loop
    (e.g. Jupyter), by using a helper thread there."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
