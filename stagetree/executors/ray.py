"""Workers as Ray actors: :class:`RayExecutor` (``pip install 'stagetree[ray]'``).

One actor per worker slot, placed with the resources the user names (``{"GPU": 1}``
by default when the cluster has GPUs, else ``{"CPU": 1}``). Each actor runs the same
:class:`~stagetree.executors.worker.Worker` as a local worker process, in a thread of its own,
so everything a local worker does holds on Ray: the trainer stays warm between
batches, checkpoints are written in the background and are durable before the batch's
terminal event, live splits (``AddCheckpoint``) and ``Abort`` reach the running batch
between steps, and training is exact.

The trainer reaches the actors as it reaches local workers (one mechanism,
:class:`~stagetree.executors._spec.TrainerSpec`): by import path for installed
libraries, pickled by value (cloudpickle) otherwise. The plan (SQLite on one machine,
PostgreSQL when workers span machines) stays the single source of truth on the
driver; checkpoints go straight from actors to the checkpoint store (a shared
directory or a bucket), never through Ray's object store: events carry their refs
only.

Several trainers share the actors: the executor's own trainer is an argument of every
actor; a trainer registered with :meth:`RayExecutor.add_trainer` is pickled once and
sent to an actor along with the first batch of its key that actor gets (in the same
``run_batch`` call: the calls of a threaded actor are not ordered), and again to a
replacement actor.

Events: the driver keeps one ``drain`` call in flight per actor and waits on them
with ``ray.wait``; an actor answers a ``drain`` with the events its worker emitted
since the previous one, in order, so the events of a batch arrive in the order they
were sent. An actor that dies (its process, or its node) is noticed there: its batch
ends with ``WorkerLost`` (the scheduler plans its stages again from their last
durable checkpoint) and a replacement actor is started, which Ray places when the
cluster has room.

Start-up refuses, with an error that names the problem: Ray not installed, no cluster
at the address, a cluster that does not answer within ``start_timeout`` (``ray.init``
included), worker resources that no node of the cluster has, a checkpoint location the
actors cannot reach (checked once with a marker checkpoint written by the driver and
read by every actor), and actors whose Python or Ray version differs from the
driver's.

Idle release (``idle_release=S``, what ``stagetree serve --executor ray`` uses): once no
batch has run for ``S`` seconds, the actors are stopped (their checkpoint writes end
first) and their resources go back to the cluster; the next batch of a slot starts a
new actor for it (the batch waits until Ray places it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import platform
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import ExecutorError, StagetreeError
from stagetree.executors._events import (
    StartupError,
    accept_event,
    admit,
    check_worker,
    missed,
    new_trainer,
    started,
)
from stagetree.executors._spec import TrainerClasses, TrainerSpec
from stagetree.executors.base import BaseExecutor
from stagetree.executors.devices import worker_devices
from stagetree.executors.worker import Worker
from stagetree.extras import install_hint
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    Instruction,
    RunBatch,
    RunFused,
    SplitMissed,
    WorkerEvent,
    WorkerLost,
    WorkerReady,
)

if TYPE_CHECKING:
    from stagetree.executors.base import ExecutorOptions
    from stagetree.trainer import Trainer

__all__ = ["RayExecutor", "default_resources", "import_ray"]

logger = logging.getLogger(__name__)

# A slot whose actor dies this many times in a row before it is ready is not restarted.
_MAX_START_FAILURES = 3
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ExecutorError: Ray is not installed (the message names the extra to install).
    """
    try:
        import ray
    except ImportError as exc:
        raise ExecutorError(
            f"the Ray executor needs Ray, which is not installed here ({exc}): "
            f"{install_hint('ray')}"
        ) from exc
    return ray


def _versions() -> dict[str, str]:
    """Python and Ray versions of this process."""
    import ray

    return {"python": platform.python_version(), "ray": str(ray.__version__)}


# The driver's versions; a function so that tests can pretend to be another driver.
driver_versions = _versions


# ---------------------------------------------------------------------- the actor


class _WorkerActor:
    """The body of one worker actor (wrapped with ``ray.remote`` by the driver).

    Calls run on several actor threads (``max_concurrency``): ``run_batch`` and
    ``instruct`` only queue, the batch runs in the actor's own batch thread, and
    ``drain`` blocks (a bounded time) until events are there.
    """

    def __init__(
        self,
        worker_id: int,
        spec: TrainerSpec,
        store: CheckpointStore,
        threads: int,
        progress_interval: float,
    ) -> None:
        self._id = worker_id
        self._cond = threading.Condition()
        self._events: deque[Any] = deque()
        self._queue: deque[RunBatch | RunFused | None] = deque()
        self._live: dict[int, list[AddCheckpoint | Abort]] = {}
        self._ended: set[int] = set()
        self._current: set[int] = set()
        self._worker: Any = None
        self._thread: threading.Thread | None = None
        self._store = store
        self._trainers: TrainerClasses | None = None
        os.environ.update({name: str(threads) for name in _THREAD_VARS})
        try:
            trainer_cls = spec.resolve()
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(threads)
        except Exception as exc:
            self._emit(
                StartupError(worker_id, f"{type(exc).__name__}: {exc}", traceback.format_exc())
            )
            return
        with contextlib.suppress(Exception):  # only an optimisation
            trainer_cls.warmup()
        self._trainers = TrainerClasses(trainer_cls)
        self._worker = Worker(
            worker_id, self._trainers, store, self._emit, progress_interval=progress_interval
        )
        self._thread = threading.Thread(target=self._loop, name="stagetree-batches", daemon=True)
        self._thread.start()
        # The GPUs Ray gave this actor (CUDA_VISIBLE_DEVICES): stages that need more
        # never come here.
        self._emit(WorkerReady(worker_id, max(1, len(worker_devices()))))

    def _emit(self, event: Any) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def hello(self, marker: str | None, token: str) -> dict[str, Any]:
        """Where this actor runs, its versions, and whether it reads the driver's marker
        checkpoint (``reach``: None when it does, else why not)."""
        import ray

        reach: str | None = None
        if marker is not None:
            try:
                if not self._store.exists(marker):
                    reach = "the marker checkpoint the driver wrote is not there"
                elif self._store.load(marker).get("token") != token:
                    reach = "the marker checkpoint there is another driver's"
            except Exception as exc:
                reach = f"{type(exc).__name__}: {exc}"
        return {
            **_versions(),
            "node": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "reach": reach,
        }

    def run_batch(
        self, batch: RunBatch | RunFused, trainers: Mapping[str, TrainerSpec] | None = None
    ) -> None:
        """Queue ``batch`` (or a fused job); ``trainers``: specs of trainer keys this actor
        has not had (the batch's, the first time it gets one of that key)."""
        with self._cond:
            if trainers and self._trainers is not None:
                for key, spec in trainers.items():
                    self._trainers.add(key, spec)
            for batch_id in started(batch):
                self._live.setdefault(batch_id, [])
            self._queue.append(batch)
            self._cond.notify_all()

    def instruct(self, message: AddCheckpoint | Abort) -> None:
        with self._cond:
            if message.batch_id in self._ended:
                if isinstance(message, AddCheckpoint):
                    self._events.append(
                        SplitMissed(message.batch_id, self._id, message.node, message.step)
                    )
                    self._cond.notify_all()
                return
            # A threaded actor may run this before run_batch of the same batch: keep it.
            self._live.setdefault(message.batch_id, []).append(message)

    def drain(self, timeout: float) -> list[Any]:
        """Every event since the last call, in order; waits up to ``timeout`` s for one."""
        with self._cond:
            if not self._events:
                self._cond.wait(timeout)
            out = list(self._events)
            self._events.clear()
        return out

    def stop(self, timeout: float) -> list[Any]:
        """Abort the running batch, stop the batch thread, wait for background writes."""
        with self._cond:
            for current in self._current:
                self._live.setdefault(current, []).append(Abort(current, self._id))
            self._queue.clear()
            self._queue.append(None)
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._worker is not None:
            self._worker.close()
        with self._cond:
            out = list(self._events)
            self._events.clear()
        return out

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                batch = self._queue.popleft()
                if batch is None:
                    return
                ids = sorted(started(batch))
                self._current = set(ids)

            def poll(ids: list[int] = ids) -> list[AddCheckpoint | Abort]:
                out: list[AddCheckpoint | Abort] = []
                with self._cond:
                    for bid in ids:
                        live = self._live.get(bid)
                        if live:
                            out.extend(live)
                            live.clear()
                return out

            ended: set[int] = set()

            def emit(event: Any, ended: set[int] = ended) -> None:
                if isinstance(event, (BatchDone, BatchFailed)):
                    ended.add(event.batch_id)
                self._emit(event)

            try:
                self._worker.emit = emit
                if isinstance(batch, RunFused):
                    self._worker.run_fused(batch, poll)
                else:
                    self._worker.run(batch, poll)
            except BaseException as exc:  # a bug, not the trainer's: still end the batches
                members = batch.members if isinstance(batch, RunFused) else (batch,)
                for member in members:
                    if member.batch_id in ended:
                        continue
                    self._emit(
                        BatchFailed(
                            member.batch_id,
                            self._id,
                            member.segments[0].node,
                            member.start_step,
                            f"{type(exc).__name__}: {exc}",
                            traceback.format_exc(),
                        )
                    )
            finally:
                with self._cond:
                    self._current = set()
                    for bid in ids:
                        self._live.pop(bid, None)
                    self._ended.update(ids)


# ---------------------------------------------------------------------- the driver


@dataclass
class _Slot:
    worker: int
    resources: dict[str, float]
    actor: Any = None
    drain: Any = None  # the drain call in flight
    hello: Any = None  # the hello call in flight (until answered)
    running: set[int] = field(default_factory=set)
    ready: bool = False
    node: str | None = None
    host: str | None = None
    start_failures: int = 0
    trainers: set[str] = field(default_factory=set)  # keys whose spec the actor was sent
    released: bool = False  # its actor was stopped while idle (idle_release)


def _probe(address: str | None, timeout: float = 5.0) -> str | None:
    """Why nothing listens at a ``host:port`` (or ``ray://host:port``) address, or None
    (also for ``"auto"`` and no address, which Ray resolves and refuses quickly)."""
    if not address or address == "auto":
        return None
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return f"cannot open a connection to {hostport} ({exc})"


def _loopback(address: str | None) -> bool:
    """Whether a ``host:port`` address names this machine's loopback interface."""
    if not address:
        return False
    host = address.split("://", 1)[-1].rstrip("/").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _init_within(
    ray: Any, kwargs: Mapping[str, Any], timeout: float, release: threading.Event
) -> None:
    """``ray.init(**kwargs)``, given up after ``timeout`` s (it may otherwise wait without
    end for a cluster that accepts connections and never answers).

    ``ray.init`` runs in a thread of its own, which then waits for ``release`` (set once
    Ray is shut down): Ray ends the process at the next call when the thread that
    connected has ended.

    Raises:
        TimeoutError: no answer within ``timeout`` s (a late success is shut down).
        Exception: what ``ray.init`` raised.
    """
    done = threading.Event()
    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def connect() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as exc:
            outcome["error"] = exc
        with lock:
            late = outcome.setdefault("late", False)
            done.set()
        if "error" in outcome:
            return
        if late:
            with contextlib.suppress(Exception):
                ray.shutdown()  # nobody waits for this connection any more
            return
        release.wait()

    threading.Thread(target=connect, name="stagetree-ray-init", daemon=True).start()
    done.wait(timeout)
    with lock:
        if not done.is_set():
            outcome["late"] = True
            raise TimeoutError(f"ray.init did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]


def default_resources(nodes: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A worker's resources when the user names none: one GPU when some node of the
    cluster (``nodes``: each node's total resources) has one, else one CPU."""
    return {"GPU": 1.0} if any(n.get("GPU", 0) >= 1 for n in nodes) else {"CPU": 1.0}


def _alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items() if v > 0)


def _capacity(need: Mapping[str, float], have: Mapping[str, float]) -> int:
    counts = [int(have.get(k, 0.0) // v) for k, v in need.items() if v > 0]
    return min(counts) if counts else 1


def _describe(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k!r}: {v:g}" for k, v in sorted(resources.items())) + "}"


class RayExecutor(BaseExecutor):
    """Workers as Ray actors (see the module docstring).

    Built either complete (``RayExecutor(trainer, checkpoint_dir=...)``) or without a
    trainer, as a study argument: ``Study(..., executor=RayExecutor(address="auto",
    worker_resources={"GPU": 1}, num_workers=8))``; the study then binds it to its
    trainer and checkpoint store (:meth:`bind`).

    Args:
        trainer: the Trainer subclass, a ``"module:Class"`` string or a
            :class:`TrainerSpec` (None: given by the study).
        num_workers: actors; default as many as the cluster's nodes can hold with
            ``worker_resources``.
        address: the Ray cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``,
            ``"local"``: a new one-machine Ray of this process's own); None: this
            process's Ray when it is connected already, else Ray's rule (the cluster
            of ``RAY_ADDRESS``, else the one ``ray start`` started on this machine,
            else a new one-machine Ray).
        worker_resources: resources of each actor, a dict for every worker or a list
            with one dict per worker (pin workers to nodes with custom resources);
            default ``{"GPU": 1}`` when the cluster has GPUs, else ``{"CPU": 1}``
            (``{"GPU": k}`` for a study with ``devices_per_worker=k``). An actor with
            ``{"GPU": k}`` owns ``k`` GPUs: Ray sets its ``CUDA_VISIBLE_DEVICES`` to
            them, so the trainer sees ``torch.cuda.device_count() == k`` and
            :func:`~stagetree.executors.worker_devices` lists them.
        checkpoint_dir: the checkpoint location (a directory every node reaches) or a
            store (None: given by the study).
        threads_per_worker: CPU threads of each worker (default: the actor's CPUs, at
            least one).
        progress_interval: seconds between throttled ``Progress`` events.
        close_timeout: seconds :meth:`close` waits for actors to stop.
        start_timeout: seconds :meth:`start` waits for the cluster to answer
            (``ray.init``) and again for the first actors to come up.
        init_kwargs: extra arguments of ``ray.init`` (when this executor connects).
        idle_release: seconds without a running batch after which the actors are
            stopped and their resources given back to the cluster; the next batch
            starts new ones (None: the actors stay until :meth:`close`).
    """

    supports_fusion = True

    def __init__(
        self,
        trainer: type[Trainer] | str | TrainerSpec | None = None,
        num_workers: int | None = None,
        *,
        address: str | None = None,
        worker_resources: Mapping[str, float] | Sequence[Mapping[str, float]] | None = None,
        checkpoint_dir: str | os.PathLike[str] | CheckpointStore | None = None,
        threads_per_worker: int | None = None,
        progress_interval: float = 0.2,
        close_timeout: float = 10.0,
        start_timeout: float = 60.0,
        init_kwargs: Mapping[str, Any] | None = None,
        idle_release: float | None = None,
    ) -> None:
        if idle_release is not None and not idle_release > 0:
            raise ValueError(f"idle_release must be > 0 seconds or None, got {idle_release!r}")
        if num_workers is not None and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1
        ):
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if threads_per_worker is not None and threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self._resources = self._check_resources(worker_resources, num_workers)
        self._requested = num_workers
        self.address = address
        self.threads_per_worker = threads_per_worker
        self.progress_interval = progress_interval
        self.close_timeout = close_timeout
        self.start_timeout = start_timeout
        self.init_kwargs = dict(init_kwargs or {})
        self.idle_release = idle_release
        self._idle_since = time.monotonic()
        # Idle release and the next batch's new actor (events() and submit() may run
        # in different threads).
        self._release_lock = threading.Lock()
        self.spec = None if trainer is None else TrainerSpec.of(trainer)
        self.store: CheckpointStore | None
        if checkpoint_dir is None or isinstance(checkpoint_dir, CheckpointStore):
            self.store = checkpoint_dir
        else:
            self.store = CheckpointStore(checkpoint_dir)
        self._slots: list[_Slot] = []
        self._local: list[WorkerEvent] = []
        self._started = False
        self._closed = False
        self._owns_ray = False
        self._ray_shut = threading.Event()  # ends the thread that connected (_init_within)
        self._marker: str | None = None
        self._token = uuid.uuid4().hex
        self._actor_cls: Any = None
        # Trainers added with add_trainer: as given (to compare), and as they travel.
        self._trainers: dict[str, Any] = {}
        self._specs: dict[str, TrainerSpec] = {}
        self._trainers_lock = threading.Lock()

    @staticmethod
    def _check_resources(
        resources: Mapping[str, float] | Sequence[Mapping[str, float]] | None,
        num_workers: int | None,
    ) -> list[dict[str, float]] | None:
        if resources is None:
            return None
        items = [resources] if isinstance(resources, Mapping) else list(resources)
        if not items:
            raise ValueError("worker_resources must not be an empty list")
        out = []
        for item in items:
            if not isinstance(item, Mapping) or not item:
                raise ValueError(
                    f"worker_resources must be a dict like {{'GPU': 1}} (or a list of "
                    f"them), got {item!r}"
                )
            for k, v in item.items():
                if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"worker resource {k!r}: {v!r} is not a name and a number")
                if v < 0:
                    raise ValueError(f"worker resource {k!r} must be >= 0, got {v!r}")
            out.append({str(k): float(v) for k, v in item.items()})
        if not isinstance(resources, Mapping) and num_workers not in (None, len(out)):
            raise ValueError(
                f"worker_resources lists {len(out)} workers but num_workers={num_workers}"
            )
        return out

    def bind(self, options: ExecutorOptions) -> BaseExecutor:
        """A copy of this executor for a study's trainer and checkpoint store (what this
        one was built with wins, trainers added with :meth:`add_trainer` included)."""
        resources: Any = self._resources
        k = options.devices_per_worker
        if resources is not None and len(resources) == 1:
            resources = resources[0]
        elif resources is None and isinstance(k, tuple):  # a mixed cluster
            resources = [{"GPU": float(g)} for g in k]
        elif resources is None and isinstance(k, int) and k > 1:
            # Study(devices_per_worker=k): k GPUs per actor (Ray sets its
            # CUDA_VISIBLE_DEVICES to them).
            resources = {"GPU": float(k)}
        bound = RayExecutor(
            self.spec if self.spec is not None else options.trainer,
            self._requested if self._requested is not None else options.workers,
            address=self.address if self.address is not None else options.address,
            worker_resources=resources,
            checkpoint_dir=(
                self.store
                if self.store is not None
                else (options.store if options.store is not None else options.checkpoint_dir)
            ),
            threads_per_worker=(
                self.threads_per_worker
                if self.threads_per_worker is not None
                else options.threads_per_worker
            ),
            progress_interval=self.progress_interval,
            close_timeout=self.close_timeout,
            start_timeout=self.start_timeout,
            init_kwargs=self.init_kwargs,
            idle_release=self.idle_release,
        )
        with self._trainers_lock:
            bound._trainers.update(self._trainers)
            bound._specs.update(self._specs)
        return bound

    # ------------------------------------------------------------------ contract

    def add_trainer(self, key: str, trainer: type[Trainer] | str | TrainerSpec) -> None:
        """Register a trainer under ``key`` (see :meth:`BaseExecutor.add_trainer`).

        ``trainer`` may also be a ``"module:Class"`` string or a :class:`TrainerSpec`.
        A class that travels by value is pickled here, once; each actor receives it
        with its first batch of ``key`` and loads it then (a class it cannot load fails
        that batch at its start).

        Raises:
            ValueError: a bad or taken key, or a class that cannot be pickled.
        """
        with self._trainers_lock:
            if not new_trainer(self._trainers, key, trainer):
                return
            self._specs[key] = TrainerSpec.of(trainer)
            self._trainers[key] = trainer

    @property
    def num_workers(self) -> int:
        if self._slots:
            return len(self._slots)
        return self._requested or (len(self._resources) if self._resources else 1)

    @property
    def devices_per_worker(self) -> int:
        """GPUs each actor owns when every worker asks for the same whole number of them
        (``{"GPU": k}``), else 1: what a busy second of a worker counts in
        device-seconds."""
        resources = [s.resources for s in self._slots] or self._resources or []
        gpus = {r.get("GPU", 0.0) for r in resources}
        if len(gpus) == 1:
            k = gpus.pop()
            if k >= 1 and k == int(k):
                return int(k)
        return 1

    def worker_locations(self) -> dict[int, str]:
        """``worker -> "host (node abcdef12)"`` for the actors that are up."""
        return {
            s.worker: f"{s.host} (node {s.node[:8]})"
            for s in self._slots
            if s.node is not None and s.host is not None
        }

    def worker_nodes(self) -> dict[int, str]:
        """``worker -> Ray node id`` for the actors that are up."""
        return {s.worker: s.node for s in self._slots if s.node is not None}

    def start(self) -> None:
        if self._closed:
            raise StagetreeError("executor is closed")
        if self._started:
            return
        if self.spec is None or self.store is None:
            raise ValueError(
                "RayExecutor needs a trainer and a checkpoint location: pass them, or give "
                "the executor to a Study (it binds them)"
            )
        self.spec.check()  # fail here, not in every actor
        ray = import_ray()
        self._connect(ray)
        try:
            self._start_actors(ray)
        except BaseException:
            self.close()
            raise
        self._started = True

    def _connect(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"log_to_driver": True, **self.init_kwargs}
        if self.address is not None:
            kwargs["address"] = self.address
        where = self.address or "this machine"
        hint = (
            "Start one with `ray start --head` (and `ray start --address HEAD:6379` on the "
            "other machines), or pass --address / RayExecutor(address=...)"
        )
        problem = _probe(self.address)
        if problem is not None:  # ray.init would retry for minutes
            raise ExecutorError(f"no Ray cluster at {where!r}: {problem}. {hint}")
        try:
            _init_within(ray, kwargs, self.start_timeout, self._ray_shut)
        except TimeoutError as exc:
            loopback = (
                " Ray reaches a 127.0.0.1 address through this machine's own address, so "
                "a cluster that listens on loopback only is out of its reach: start the "
                "cluster on an address every node reaches (`ray start --head "
                "--node-ip-address=ADDR`) and pass that address."
                if _loopback(self.address)
                else ""
            )
            raise ExecutorError(
                f"no answer from a Ray cluster at {where!r} within {self.start_timeout:g} s "
                f"({exc}).{loopback} {hint}"
            ) from exc
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ExecutorError(
                f"cannot connect to a Ray cluster at {where!r}: {type(exc).__name__}: {exc}. "
                + hint
            ) from exc
        self._owns_ray = True

    def _start_actors(self, ray: Any) -> None:
        nodes = _alive_nodes(ray)
        totals = [dict(n.get("Resources", {})) for n in nodes]
        resources = self._resources if self._resources is not None else [default_resources(totals)]
        for need in resources:
            if not any(_fits(need, have) for have in totals):
                described = "; ".join(
                    f"{n.get('NodeManagerAddress', '?')}: "
                    + _describe({k: v for k, v in t.items() if not k.startswith("node:")})
                    for n, t in zip(nodes, totals)
                )
                raise ExecutorError(
                    f"no node of the Ray cluster has the worker resources {_describe(need)}, "
                    f"so the workers would wait forever; the nodes have: {described}. "
                    "Ask for fewer (worker_resources=...) or add such a node"
                )
        count = self._requested
        if count is None:
            if len(resources) > 1:
                count = len(resources)
            else:
                count = max(1, sum(_capacity(resources[0], have) for have in totals))
        per_slot = resources if len(resources) == count else [resources[0]] * count
        self._slots = [_Slot(w, dict(per_slot[w])) for w in range(count)]
        assert self.store is not None
        try:
            info = self.store.save(f"stagetree-reach-{self._token}", {"token": self._token})
            self._marker = info.ref
        except Exception as exc:
            raise ExecutorError(
                f"cannot write to the checkpoint location {self.store}: {exc}"
            ) from exc
        self._actor_cls = ray.remote(_WorkerActor)
        for slot in self._slots:
            self._spawn(ray, slot)
        hellos = {slot.hello: slot for slot in self._slots}
        ready, _ = ray.wait(list(hellos), num_returns=len(hellos), timeout=self.start_timeout)
        if not ready:
            raise ExecutorError(
                f"no worker actor started within {self.start_timeout:g} s: the Ray cluster "
                f"has no room for actors with {_describe(self._slots[0].resources)} "
                "(other jobs hold its resources?)"
            )
        for ref in ready:
            self._on_hello(ray, hellos[ref], ref)

    def _spawn(self, ray: Any, slot: _Slot) -> None:
        res = dict(slot.resources)
        cpus = res.pop("CPU", 0.0)
        gpus = res.pop("GPU", 0.0)
        memory = res.pop("memory", None)
        threads = self.threads_per_worker or max(1, int(cpus))
        options: dict[str, Any] = {
            "num_cpus": cpus,
            "num_gpus": gpus,
            "resources": res,
            "max_concurrency": 8,
            "max_restarts": 0,
            "name": None,
        }
        if memory is not None:
            options["memory"] = memory
        assert self.spec is not None and self.store is not None
        slot.actor = self._actor_cls.options(**options).remote(
            slot.worker, self.spec, self.store, threads, self.progress_interval
        )
        slot.hello = slot.actor.hello.remote(self._marker, self._token)
        slot.drain = None
        slot.ready = False
        slot.trainers = set()
        slot.node = slot.host = None

    def _on_hello(self, ray: Any, slot: _Slot, ref: Any) -> None:
        """Check an actor's answer to ``hello``; then start draining its events."""
        slot.hello = None
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as exc:
            self._lost(ray, slot, exc, self._local)
            return
        mine = driver_versions()
        theirs = {k: info.get(k) for k in mine}
        if theirs != mine:
            raise ExecutorError(
                f"worker {slot.worker} on {info.get('host')} runs Python {theirs['python']} "
                f"with Ray {theirs['ray']}, but this driver runs Python {mine['python']} "
                f"with Ray {mine['ray']}: install the same versions on every node"
            )
        if info.get("reach") is not None:
            raise ExecutorError(
                f"worker {slot.worker} on {info.get('host')} (node {str(info.get('node'))[:8]}) "
                f"cannot reach the checkpoint location {self.store} ({info['reach']}). "
                "Workers on other nodes need a location every node reaches: a shared "
                "file system mounted at the same path, or a bucket"
            )
        slot.node, slot.host = info.get("node"), info.get("host")
        slot.drain = slot.actor.drain.remote(0.5)

    def submit(self, instruction: Instruction) -> None:
        live = self._started and not self._closed
        worker = check_worker(instruction, live, len(self._slots))
        slot = self._slots[worker]
        if not admit(instruction, slot.running):
            self._local.extend(missed(instruction))
        elif isinstance(instruction, (RunBatch, RunFused)):
            with self._release_lock:
                if slot.actor is None and slot.released:
                    # Released while idle: a new actor, placed when the cluster has room.
                    slot.released = False
                    self._spawn(import_ray(), slot)
                if slot.actor is None:
                    raise ValueError(f"worker {worker} is not up")
                slot.running = started(instruction)
                self._idle_since = time.monotonic()
            first = instruction.members[0] if isinstance(instruction, RunFused) else instruction
            key = first.trainer
            spec = self._specs.get(key)
            if spec is not None and key not in slot.trainers:
                # With the batch: a threaded actor does not run its calls in order. An
                # unknown key goes without: the actor fails that batch.
                slot.trainers.add(key)
                slot.actor.run_batch.remote(instruction, {key: spec})
            else:
                slot.actor.run_batch.remote(instruction)
        elif slot.actor is None:  # lost meanwhile: its batch is reported lost
            self._local.extend(missed(instruction))
        else:
            slot.actor.instruct.remote(instruction)

    def events(self, timeout: float | None = None) -> list[WorkerEvent]:
        if not self._started:
            raise StagetreeError("executor is not running: call start() first")
        ray = import_ray()
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[WorkerEvent] = []
        while True:
            out.extend(self._local)
            self._local.clear()
            if self._closed:
                return out
            calls: dict[Any, tuple[_Slot, str]] = {}
            for slot in self._slots:
                if slot.hello is not None:
                    calls[slot.hello] = (slot, "hello")
                elif slot.drain is not None:
                    calls[slot.drain] = (slot, "drain")
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not calls:
                if out or remaining == 0:
                    return out
                time.sleep(min(0.05, remaining if remaining is not None else 0.05))
                continue
            wait = 0.0 if out else remaining
            ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
            if not ready and wait != 0:
                ready, _ = ray.wait(list(calls), num_returns=1, timeout=wait)
            for ref in ready:
                slot, kind = calls[ref]
                if kind == "hello":
                    self._on_hello(ray, slot, ref)
                    continue
                try:
                    batch = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    self._lost(ray, slot, exc, out)
                    continue
                for event in batch:
                    self._accept(slot, event, out)
                if slot.actor is not None:
                    slot.drain = slot.actor.drain.remote(0.5)
            out.extend(self._local)
            self._local.clear()
            self._release_if_idle(ray, out)
            if out or (deadline is not None and time.monotonic() >= deadline):
                return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            self._ray_shut.set()
            return
        stops = []
        for slot in self._slots:
            # An actor Ray never placed (no room) has nothing to stop: it is killed below.
            if slot.actor is not None and slot.hello is None:
                with contextlib.suppress(Exception):
                    stops.append(slot.actor.stop.remote(self.close_timeout))
        if stops:
            with contextlib.suppress(Exception):
                ray.wait(stops, num_returns=len(stops), timeout=self.close_timeout)
        for slot in self._slots:
            if slot.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(slot.actor, no_restart=True)
            slot.actor = slot.drain = slot.hello = None
        if self._marker is not None and self.store is not None:
            with contextlib.suppress(Exception):
                self.store.delete(self._marker)
        if self._owns_ray:
            with contextlib.suppress(Exception):
                ray.shutdown()
            self._ray_shut.set()

    # ------------------------------------------------------------------ internals

    def _accept(self, slot: _Slot, event: Any, out: list[WorkerEvent]) -> None:
        accept_event(slot, event, out, self.spec)

    def _release_if_idle(self, ray: Any, out: list[WorkerEvent]) -> None:
        """With ``idle_release``: stop every actor once no batch has run (and none has
        been starting) for that long; their last events (checkpoint writes that ended)
        go to ``out``. The next batch of a slot starts a new actor (:meth:`submit`)."""
        if self.idle_release is None:
            return
        with self._release_lock:
            now = time.monotonic()
            if any(s.running or s.hello is not None for s in self._slots):
                self._idle_since = now
                return
            live = [s for s in self._slots if s.actor is not None]
            if not live or now - self._idle_since < self.idle_release:
                return
            for slot in live:
                # The drain in flight first: stop() hands over only what it left.
                with contextlib.suppress(ray.exceptions.RayError):
                    if slot.drain is not None:
                        for event in ray.get(slot.drain, timeout=self.close_timeout):
                            self._accept(slot, event, out)
            stops = {slot.actor.stop.remote(self.close_timeout): slot for slot in live}
            ready, _ = ray.wait(list(stops), num_returns=len(stops), timeout=self.close_timeout)
            for ref in ready:
                with contextlib.suppress(ray.exceptions.RayError):
                    for event in ray.get(ref):
                        self._accept(stops[ref], event, out)
            for slot in live:
                with contextlib.suppress(Exception):
                    ray.kill(slot.actor, no_restart=True)
                slot.actor = slot.drain = slot.hello = None
                slot.node = slot.host = None
                slot.ready = False
                slot.released = True
            logger.info(
                "released %d idle Ray worker(s) after %g s without a batch; the next "
                "batch starts them again",
                len(live),
                self.idle_release,
            )

    def _lost(self, ray: Any, slot: _Slot, exc: BaseException, out: list[WorkerEvent]) -> None:
        node_alive = True
        if slot.node is not None:
            with contextlib.suppress(Exception):
                node_alive = any(n.get("NodeID") == slot.node for n in _alive_nodes(ray))
        where = f"{slot.host} (node {slot.node[:8]})" if slot.node and slot.host else "its node"
        if not node_alive:
            reason = f"Ray node {where} was lost"
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            reason = f"Ray actor of worker {slot.worker} on {where} died: {first}"
        out.append(WorkerLost(slot.worker, min(slot.running, default=None), reason))
        slot.running = set()
        with contextlib.suppress(Exception):
            ray.kill(slot.actor, no_restart=True)
        slot.actor = slot.drain = slot.hello = None
        if not slot.ready:
            slot.start_failures += 1
            if slot.start_failures >= _MAX_START_FAILURES:
                raise ExecutorError(
                    f"worker {slot.worker} died {slot.start_failures} times before it was "
                    f"ready ({reason}); not restarting it"
                )
        # Ray places the replacement when the cluster has room for it.
        self._spawn(ray, slot)
