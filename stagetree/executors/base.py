"""The executor contract: carry out instructions on workers, report what happens.

* :class:`BaseExecutor`: the contract every executor follows.
* :class:`ExecutorOptions`: what a study passes to an executor factory.
* :class:`Clock`: the time an executor keeps (:attr:`BaseExecutor.clock`): the wall
  clock (:data:`WALL_CLOCK`), or the simulator's :class:`VirtualClock`.
* :func:`settle_loop`: let an event loop run everything that is ready (the tuner's
  reactions to the current instant).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from stagetree.work import Instruction, WorkerEvent

if TYPE_CHECKING:
    from stagetree.checkpoints import CheckpointStore
    from stagetree.trainer import Trainer

__all__ = [
    "WALL_CLOCK",
    "BaseExecutor",
    "Clock",
    "ExecutorOptions",
    "VirtualClock",
    "WallClock",
    "settle_loop",
]

_E = TypeVar("_E", bound="BaseExecutor")


class Clock(ABC):
    """The time an executor keeps; what the engine, the study and budgets ask for the
    time instead of probing the executor.

    :attr:`virtual` is False for real time: the engine drives the executor from a
    thread, and budgets poll. A virtual clock (the simulator's) only moves when its
    executor delivers an instant: it never sleeps, the study's event loop pumps the
    executor, and budgets are checked at events only.
    """

    #: Whether the time is virtual (advanced by its executor, not by the world).
    virtual: bool = False

    @abstractmethod
    def now(self) -> float:
        """The time in seconds, for records: ``time.time()`` on the wall clock, the
        virtual time on a virtual one."""

    @abstractmethod
    def monotonic(self) -> float:
        """Seconds for measuring durations (never goes back)."""


class WallClock(Clock):
    """Real time: :func:`time.time` and :func:`time.monotonic`."""

    virtual = False

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class VirtualClock(Clock):
    """Virtual time in seconds from 0, moved forward by its executor (:meth:`advance`).

    Attributes:
        time: the current virtual time.
    """

    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self.time = float(start)

    def now(self) -> float:
        return self.time

    def monotonic(self) -> float:
        return self.time

    def advance(self, instant: float) -> None:
        """Move to ``instant`` (a clock never goes back: an earlier one is ignored)."""
        self.time = max(self.time, instant)


#: The wall clock every real-time executor shares.
WALL_CLOCK: Clock = WallClock()


async def settle_loop(max_rounds: int = 10_000) -> bool:
    """Let every ready callback of the running loop run (tuners react to results),
    until the loop has nothing ready but this task.

    Returns:
        False when ``max_rounds`` rounds ran out with callbacks still ready (the loop
        is busy, not settled: a replay answering thousands of trials at one instant),
        else True.
    """
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)  # CPython's queue of ready callbacks
    for i in range(max_rounds):
        await asyncio.sleep(0)
        if ready is not None:
            if not ready and i >= 1:
                return True
        elif i >= 200:
            return True
    return ready is None or not ready


@dataclass(frozen=True)
class ExecutorOptions:
    """What a study passes to an executor factory.

    Attributes:
        trainer: the Trainer subclass: the executor's default trainer, which trains
            batches whose ``RunBatch.trainer`` is ``""``; more trainers share the same
            workers through :meth:`BaseExecutor.add_trainer`.
        workers: worker count asked for (None: the executor's default).
        checkpoint_dir: the checkpoint store (or its directory).
        threads_per_worker: CPU threads per worker (None: the executor's default).
        store: the study's checkpoint store (None: open ``checkpoint_dir``).
        address: the cluster to run on, for cluster executors (``stagetree run
            --address``; None: the executor's default).
        devices_per_worker: devices each worker owns and trains on (data-parallel;
            see :mod:`stagetree.executors.devices`); one int per worker for a
            mixed cluster.
        step_timeout: seconds a training step may take before its batch fails and its
            worker is replaced (None: no limit; executors with worker processes).
    """

    trainer: Any
    workers: int | None
    checkpoint_dir: Path | CheckpointStore
    threads_per_worker: int | None
    store: Any = None
    address: str | None = None
    devices_per_worker: int | tuple[int, ...] = 1
    step_timeout: float | None = None


class BaseExecutor(ABC):
    """Runs :class:`~stagetree.work.RunBatch` instructions on a fixed set of workers.

    An executor carries instructions out and reports events; it makes no decisions
    (which batch, which worker, when to split or abort: that is the scheduler's).

    Contract, shared by every implementation:

    * Workers have ids ``0 .. num_workers - 1``. :meth:`start` brings them up; each
      announces itself with :class:`~stagetree.work.WorkerReady` (so does a replacement
      for a worker that was lost).
    * :meth:`submit` never blocks on training. A worker runs one batch at a time:
      submitting a ``RunBatch`` to a worker whose previous batch has not ended raises
      ``ValueError``. ``AddCheckpoint`` and ``Abort`` go to the worker running that batch;
      when the batch is no longer running, ``AddCheckpoint`` is answered with
      :class:`~stagetree.work.SplitMissed` and ``Abort`` is ignored.
    * Every ``RunBatch`` ends with exactly one terminal event: ``BatchDone``,
      ``BatchFailed`` or ``WorkerLost`` naming its batch. Events of one batch arrive in
      the order the worker sent them. Checkpoint writes are off the critical path: a
      ``CheckpointSaved`` (or ``CheckpointFailed``) of a batch may arrive after its
      ``BatchDone`` (never after a ``BatchFailed``), and every checkpoint it captured
      ends with one of the two unless its worker is lost; no other event of a batch
      follows its terminal event.
    * :meth:`events` blocks until at least one event is available or ``timeout``
      seconds pass (forever when None), then returns every available event. Liveness is
      checked there: a dead worker is reported as ``WorkerLost`` (after the events it
      sent before dying) and replaced.
    * :meth:`close` stops every worker, waiting a bounded time; it is idempotent.
      :meth:`close_now` does not wait for busy workers (a trainer stuck in a step).
    * ``Abort(save=True)`` asks a running batch to checkpoint the model where it stops
      before it ends (see :class:`~stagetree.work.Abort`).
    * The clock (:attr:`clock`, a :class:`Clock`): the wall clock for executors that
      run in real time (the study engine drives them from a thread, waiting in
      :meth:`events`). An executor whose time is virtual (the simulator) returns its
      :class:`VirtualClock`: it never blocks, and the study's event loop pumps it
      (:func:`stagetree.executors.simulated.drive`), so that runs are reproducible
      instant by instant. Every time the engine records (activity, a run's start and
      end) and a run's wall-seconds budget are read from this clock.
    * :meth:`bind` receives what the study knows (trainer, checkpoint store, worker
      count) when the executor was given as an object before the study existed; it
      returns the executor to use (the default: ``self``, unchanged).
    * Several trainers, one pool: the executor's own trainer (``ExecutorOptions.trainer``)
      trains batches whose :attr:`RunBatch.trainer <stagetree.work.RunBatch.trainer>` is
      ``""``; :meth:`add_trainer` registers more trainer classes under keys, before or
      after :meth:`start` and while batches run, and a batch naming a key is trained by
      that class (``Trainer(config)`` from its ``config``). Any worker serves any key; a
      worker continues its in-memory model only for a batch of the same key (and root
      key, config and ``start_at``). A batch naming a key that was not registered when it
      was submitted, or whose trainer cannot be loaded on its worker, ends with
      :class:`~stagetree.work.BatchFailed` (``phase="start"``, the error names the key or
      the loading error); the worker stays up and serves other batches.

    * Fusion (:attr:`supports_fusion`): an executor that can train several batches on one
      worker at once accepts :class:`~stagetree.work.RunFused`; its members are then
      that worker's running batches, each with its own events and terminal event, and
      the worker takes a new ``RunBatch``/``RunFused`` only after every member ended.
      A worker that cannot fuse them reports ``FusionFailed`` and runs them one by one.

    Executors are context managers: ``with Executor(...) as ex:`` starts and closes.
    """

    #: Whether :meth:`submit` accepts :class:`~stagetree.work.RunFused` (fused jobs).
    supports_fusion: bool = False

    @property
    @abstractmethod
    def num_workers(self) -> int:
        """Number of worker slots."""

    @property
    def clock(self) -> Clock:
        """The time this executor keeps (see the contract above; default: the wall
        clock)."""
        return WALL_CLOCK

    @property
    def virtual_time(self) -> bool:
        """Whether this executor keeps virtual time: ``clock.virtual``."""
        return self.clock.virtual

    def bind(self, options: ExecutorOptions) -> BaseExecutor:
        """The executor a study uses, given its options (default: ``self``)."""
        return self

    def worker_locations(self) -> dict[int, str]:
        """Where each worker runs, in words (a host name, a cluster node); empty when
        every worker runs on this machine."""
        return {}

    def add_trainer(self, key: str, trainer: type[Trainer]) -> None:
        """Register ``trainer`` under ``key``: batches whose ``RunBatch.trainer`` is
        ``key`` are trained by it (see the contract above). May be called before or
        after :meth:`start` and while batches run. Registering a key again with the
        same trainer does nothing.

        The default refuses: an executor that serves one trainer only.

        Raises:
            ValueError: ``key`` is not a non-empty string, or is registered with another
                trainer (the message names the key).
            NotImplementedError: this executor serves its own trainer only.
        """
        raise NotImplementedError(
            f"{type(self).__name__} serves one trainer only; it cannot add trainer {key!r}"
        )

    def prepare(self) -> None:  # noqa: B027 (a hint: most executors have nothing to do)
        """Get ready to start the workers soon, without starting any: a first run calls
        it before its tuner is built, so that what a start waits for (a local fork
        server importing torch) runs meanwhile. Default: nothing."""

    @abstractmethod
    def start(self) -> None:
        """Bring the workers up (each will send ``WorkerReady``)."""

    @abstractmethod
    def submit(self, instruction: Instruction) -> None:
        """Hand one instruction to its worker (``instruction.worker``)."""

    @abstractmethod
    def events(self, timeout: float | None = None) -> list[WorkerEvent]:
        """Events since the last call; waits up to ``timeout`` seconds for the first
        (an executor with a :meth:`wake` may return none sooner when woken)."""

    #: True when :meth:`events` waits its whole timeout unless an event comes or
    #: :meth:`wake` is called: the engine's driver then never sleeps beside it (a sleep
    #: would not see a worker's event, and a wake already taken by ``events`` would
    #: leave it sleeping the rest of its poll).
    waits_in_events: bool = False

    def wake(self) -> None:  # noqa: B027 (a hint: most executors do not wait long)
        """Let a call of :meth:`events` waiting in another thread return now (with what
        it has, maybe nothing): the engine calls it when a submission or cancellation
        arrives, so that it plans it without waiting its poll out. Safe from any thread,
        before a start and after a close. Default: nothing (the wait ends by its
        timeout)."""

    @abstractmethod
    def close(self) -> None:
        """Stop every worker and release resources."""

    def close_now(self) -> None:
        """:meth:`close` without waiting for the batches still running: their workers
        are stopped at once (the engine calls it when a trainer did not end its step
        within the stop's bounded wait). Default: :meth:`close`."""
        self.close()

    def __enter__(self: _E) -> _E:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
