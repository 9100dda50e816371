"""The Study contract: what a study offers, whether it runs here or on a tuning server.

:class:`StudyAPI` is the contract and the one parameter list;
:class:`stagetree.study.Study` implements it in this process, and
:class:`stagetree.server.client.RemoteStudy` over HTTP. ``Study(...)`` is the factory
users call: it returns a remote study when a server URL is given. The tuner loop
(:meth:`StudyAPI.tune`) is written once, here, against the public methods, so a
tuner runs unchanged against either.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import gc
import inspect
import logging
import math
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from stagetree.budget import Budget, BudgetGuard, RunReport
from stagetree.checkpoints import CheckpointStore
from stagetree.engine.core import StudySlot
from stagetree.engine.settings import DEFAULT_STORAGE, current_overrides
from stagetree.exceptions import CheckpointError, StagetreeError, TrialFailedError, TunerError
from stagetree.executors.base import WALL_CLOCK, Clock
from stagetree.hp import Sequence
from stagetree.names import check_tuner_fits
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.tree import check_steps
from stagetree.progress import ProgressDisplay
from stagetree.records import TrialError, TrialRecord
from stagetree.trainer import Trainer, check_checkpointable
from stagetree.tuners.base import TrialResult, Tuner, submitted_fingerprint

__all__ = [
    "INTERRUPTED_MESSAGE",
    "STUDY_PARAMETERS",
    "StudyAPI",
    "StudyArguments",
    "StudyRunner",
    "check_identity",
    "check_weight",
    "frozen_heap",
    "remote_url",
    "run_coro",
]

logger = logging.getLogger("stagetree")

#: What a run stopped by Ctrl-C says (``tune()`` and ``stagetree run``).
INTERRUPTED_MESSAGE = "interrupted; run again to resume"
# Set in the task that runs tune()'s tuner (its tasks inherit it): a submission made
# there is followed by a wait the study can see (the tuner's loop going idle).
TUNING: contextvars.ContextVar[bool] = contextvars.ContextVar("stagetree_tuning", default=False)

_S = TypeVar("_S", bound="StudyAPI")


@dataclass(frozen=True)
class StudyArguments:
    """The arguments a study was made with, as :class:`StudyAPI` takes them (same names,
    same order); see :meth:`StudyAPI.__init__` for each."""

    name: str
    trainer: type[Trainer]
    storage: str | BasePlanStorage = DEFAULT_STORAGE
    workers: int | None = None
    share: bool = True
    checkpoint_dir: str | os.PathLike[str] | CheckpointStore | None = None
    checkpoint_budget: int | str | None = None
    version: str | None = None
    executor: Any = "local"
    policy: str = "critical_path"
    max_retries: int = 0
    threads_per_worker: int | None = None
    eval_every: int | None = 1
    weight: float = 1.0
    url: str | None = None
    token: str | None = None
    fuse: bool | str = False
    max_fused: int | None = None
    checkpoint_every: int | str | None = "auto"
    devices_per_worker: int | tuple[int, ...] = 1
    step_timeout: float | None = None
    stop_timeout: float = 5.0

    def kwargs(self) -> dict[str, Any]:
        """The arguments as keywords (values kept as they are, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class StudyAPI(abc.ABC):
    """The contract of a study: one optimization run of a trainer, and its trials.

    A trial is ``(config, hp)``: a JSON-able fixed configuration and hyper-parameter
    sequences (:mod:`stagetree.hp`), trained to a number of steps. Both
    implementations (:class:`stagetree.study.Study` here, and
    :class:`stagetree.server.client.RemoteStudy` on a tuning server) take the same
    arguments (:meth:`__init__`), return the same types and raise the same exceptions.

    * **Trials.** :meth:`submit` (async) / :meth:`run` (sync) train a trial to ``steps``
      steps, answering from the storage what is known; :meth:`declare` announces trials
      to come; :meth:`check` refuses a trial that does not fit, writing nothing;
      :meth:`eval` and :meth:`state` read a trial's metrics and trainer state at a step
      without training; :meth:`wait_any`, :meth:`wait_all` and :meth:`cancel` manage
      submissions' tasks.
    * **Tuners.** :meth:`tune` runs a :class:`~stagetree.tuners.base.Tuner` to its end
      or its budget and records what the run did in :attr:`last_run`. Front ends that
      run a tuner elsewhere use :meth:`begin_tuning`, :meth:`end_tuning`,
      :meth:`read_log` and :meth:`append_log`.
    * **Reports.** :meth:`trials`, :meth:`failures`, :meth:`best`, :meth:`best_model`,
      :meth:`trials_dataframe`, :meth:`stats`, :meth:`progress`, :attr:`num_workers`,
      :meth:`worker_locations`, :meth:`root_key`.
    * **Life cycle.** Nothing is opened when a study is made: :meth:`open` (or the
      first use) opens it, :meth:`close` or the ``with`` block ends it.

    Attributes:
        name: the study's name. trainer: its Trainer class. version: the trainer
        version its trials are keyed by. share: whether trials share training.
        weight: its fair-share weight. fusible: the hyper-parameters it fuses on.
        eval_every: its evaluation interval (0: at requested steps only).
        last_run: what the latest :meth:`tune` did (None before one ended).
    """

    last_run: RunReport | None = None
    # The latest tune()'s tuner and result: ``stagetree run`` reports a tuning that a
    # script without a main guard ran while it loaded instead of tuning again.
    _last_tune: tuple[Tuner, TrialResult | None] | None = None
    name: str
    trainer: type[Trainer]
    version: str
    share: bool
    weight: float
    fusible: frozenset[str]
    eval_every: int
    _arguments: StudyArguments
    _closed: bool

    def __init__(
        self,
        name: str,
        trainer: type[Trainer],
        storage: str | BasePlanStorage = DEFAULT_STORAGE,
        workers: int | None = None,
        share: bool = True,
        checkpoint_dir: str | os.PathLike[str] | CheckpointStore | None = None,
        checkpoint_budget: int | str | None = None,
        version: str | None = None,
        executor: Any = "local",
        policy: str = "critical_path",
        max_retries: int = 0,
        threads_per_worker: int | None = None,
        eval_every: int | None = 1,
        weight: float = 1.0,
        url: str | None = None,
        token: str | None = None,
        fuse: bool | str = False,
        max_fused: int | None = None,
        checkpoint_every: int | str | None = "auto",
        devices_per_worker: int | tuple[int, ...] = 1,
        step_timeout: float | None = None,
        stop_timeout: float = 5.0,
    ) -> None:
        """Make a study (nothing is opened or written yet; every argument is checked).

        Args:
            name: the study's name in the storage (a study of that name is continued).
            trainer: a :class:`~stagetree.Trainer` subclass.
            storage: plan storage URL (``sqlite:///path.db``, ``postgresql://...``,
                ``memory://``) or an open :class:`~stagetree.plan.BasePlanStorage`.
            workers: number of worker processes (default: one per visible CUDA device,
                else one).
            share: False runs every trial independently from step 0 (the trial-based
                baseline); promotions of the same trial still resume it.
            checkpoint_dir: where checkpoints go: a directory (a shared mount for
                workers on several machines), a URL of any fsspec protocol
                (``file:///dir``, ``s3://bucket/prefix``, ``gs://...``, ``az://...``;
                install the protocol's package, e.g. ``stagetree[s3]``), or a
                :class:`~stagetree.checkpoints.CheckpointStore` (for fsspec options such
                as an S3 endpoint). Default: beside a SQLite file
                (``plan.db.checkpoints``); for an in-memory plan a temporary directory,
                removed when the study closes; for a database server
                ``./stagetree_checkpoints`` in the working directory (checkpoints of a
                plan that outlives the process must too; pass a location every worker
                machine reaches). The location is checked (written, read back) when
                the study opens, before anything is trained.
            checkpoint_budget: bytes the checkpoint store may hold: an int, or a size
                such as ``"10MB"`` / ``"2GiB"`` (None: unlimited).
            version: overrides the trainer's code fingerprint in the root key
                (:func:`~stagetree.identity.trainer_fingerprint`).
            executor: ``"local"`` (worker processes, the default), ``"inline"`` (in this
                process; for debugging and tests), ``"simulated"`` (virtual time, no
                training: :class:`~stagetree.executors.SimulatedExecutor`), another name
                registered with :func:`~stagetree.executors.register_executor`, or a
                factory returning a ``BaseExecutor``.
            policy: scheduling policy: ``"critical_path"`` (default), ``"bfs"`` or
                ``"thr"``.
            max_retries: how often a failing stage is retried before its requests fail.
            threads_per_worker: torch/OpenMP threads per worker process (default: the
                machine's cores divided among the workers).
            eval_every: learning curves: call ``evaluate()`` every ``eval_every`` steps
                as well as at the requested steps (default 1: every step); 0 or None
                evaluates at requested steps only. ``train()``'s metrics are recorded at
                every step either way. Evaluation never changes training (exactness),
                only its cost.
            weight: this study's share of the workers when several studies contend for
                them (fair share, default 1.0): studies with pending work get device
                time in proportion to their weights; a study alone gets every worker,
                and a stage two studies need is trained once and counted for both.
            url: a tuning server (``http://host:8642``, see ``stagetree serve``): the
                study runs there, on the server's storage and workers, and this object
                is a client with the same API
                (:class:`stagetree.server.client.RemoteStudy`). Default:
                ``STAGETREE_URL`` from the environment, else this process runs the
                study; ``url=""`` always runs it here.
            token: the server's token (default: ``STAGETREE_TOKEN`` from the
                environment).
            fuse: horizontal fusion (:mod:`stagetree.fusion`): ``True`` trains sibling
                stages that start from the same model and differ only in fusible
                hyper-parameters (optimizer scalars; see the trainer's ``fusible``) as
                one fused job on one worker, ``False`` (the default) never fuses,
                ``"auto"`` fuses when the trainer is fusible and this machine has a CUDA
                device. Fused training equals unfused training up to floating-point
                rounding (and dropout masks), not bit for bit, so a fusing study keeps
                its results in plan trees of its own: they are never handed to a study
                that does not fuse (and the other way round). Needs a trainer that can
                fuse (:class:`stagetree.torch.FusibleTrainer`) and an executor that can
                (``local``, ``inline``, ``ray``).
            max_fused: most members of one fused job (default: 32, past which the
                digits benchmark gains little on a CPU; see
                :data:`stagetree.fusion.DEFAULT_MAX_FUSED`). A trainer may hold a job to
                what its device fits (``Trainer.fused_width_limit``).
            checkpoint_every: periodic checkpoints, which bound the steps a crash loses
                (checkpoints are otherwise taken where trials branch and where batches
                end): an int (every that many steps), ``"auto"`` (the default: once a
                step and a save were measured, every 5% of a trial's steps or every
                minute of training, whichever is longer, and no more often than every
                100 steps' time, so that saves cost at most about 1% of the training;
                none for short trials) or ``None`` (off). Saves are written in the
                background.
            devices_per_worker: devices each worker owns (default 1), for trials that
                train data-parallel over several devices: a local worker process gets
                ``k`` devices of its own as its ``CUDA_VISIBLE_DEVICES`` (its trainer
                sees ``torch.cuda.device_count() == k``;
                :func:`stagetree.executors.worker_devices` lists them), and ``workers``
                defaults to the visible devices divided by ``k``; a Ray worker asks for
                ``{"GPU": k}``; a simulated one trains ``k`` devices' worth faster and
                counts ``k`` devices busy. Raises ``ValueError`` (when the workers
                start) if ``workers * k`` devices are not visible. A list (``[1, 1,
                2, 4]``, local or simulated) makes a mixed cluster, one worker per
                entry; a trial goes only to workers with the devices its trainer
                declares (``Trainer.devices_needed``) or an out-of-memory error taught
                the scheduler (see :mod:`stagetree.executors.devices`).
            step_timeout: seconds one training step (``setup``/``train`` and the
                evaluations and checkpoints after it) may take on a worker process
                (``executor="local"``); a step that takes longer fails its batch with
                the reason (``StepTimeout: step N took longer than step_timeout=Xs``;
                retried like any failure, ``max_retries``), and its worker process is
                stopped and replaced (a ``train()`` that never returns cannot be
                interrupted otherwise). None (the default): no limit.
            stop_timeout: seconds a stop (Ctrl-C, a budget that cancels running work,
                closing the study) waits for the running stages to checkpoint where
                they stand and end (default 5): a later run resumes from there and
                trains no step twice. Workers still busy then (a trainer stuck in a
                step) are stopped without waiting.

        ``workers``, ``executor``, ``policy``, ``max_retries``, ``threads_per_worker``,
        ``eval_every``, ``max_fused``, ``checkpoint_every``, ``devices_per_worker``,
        ``step_timeout`` and ``stop_timeout`` are engine settings
        (:class:`~stagetree.engine.settings.EngineSettings`); ``storage``,
        ``checkpoint_dir`` and ``checkpoint_budget`` its placement. Studies on the same
        storage in one process share one engine, made with the first study's settings
        (a later one that asks for others is told so with a
        :class:`~stagetree.exceptions.SharedEngineWarning`). A remote study runs with
        the server's: it warns (:class:`~stagetree.exceptions.RemoteArgumentWarning`)
        when one of them is not its default.

        Raises:
            ValueError: an argument out of its range (before anything is opened).
            TypeError: a trainer that is not a Trainer subclass.
        """
        check_identity(name, trainer, version)
        self._configure(
            StudyArguments(
                name=name,
                trainer=trainer,
                storage=storage,
                workers=workers,
                share=share,
                checkpoint_dir=checkpoint_dir,
                checkpoint_budget=checkpoint_budget,
                version=version,
                executor=executor,
                policy=policy,
                max_retries=max_retries,
                threads_per_worker=threads_per_worker,
                eval_every=eval_every,
                weight=weight,
                url=url,
                token=token,
                fuse=fuse,
                max_fused=max_fused,
                checkpoint_every=checkpoint_every,
                devices_per_worker=devices_per_worker,
                step_timeout=step_timeout,
                stop_timeout=stop_timeout,
            )
        )

    @abc.abstractmethod
    def _configure(self, args: StudyArguments) -> None:
        """Check ``args`` and set the study up from them (nothing is opened); keep
        ``self._arguments``, resolved, for :meth:`_reopened`."""

    def _reopened(self) -> StudyAPI:
        """A new study with this one's (resolved) arguments and version (``stagetree
        run`` uses it when a script without a main guard tuned and closed its study)."""
        return type(self)(**self._arguments.kwargs())

    # -- life cycle ----------------------------------------------------------------------

    @abc.abstractmethod
    def open(self: _S) -> _S:
        """Open the study now (it is otherwise opened on first use); returns self.

        Raises:
            StorageError: a local study's storage cannot be opened.
            ServerError: a remote study's server cannot be reached or refuses it.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """End the study: stop what it runs (pending submissions are cancelled) and
        release what it holds. Closing twice is harmless."""

    def __enter__(self: _S) -> _S:
        return self  # opened on first use (``tune`` records its metric first)

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- trials --------------------------------------------------------------------------

    @abc.abstractmethod
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

    @abc.abstractmethod
    def declare(self, trials: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
        """Announce trials ``(config, hp)`` that will be submitted later (tuners that draw
        their configurations up front do this): their paths go into the plan up to the
        tuner's horizon, without requests, so that running batches checkpoint where they
        will branch off and nothing is recomputed when they arrive.

        Raises:
            InvalidTrialError: a trial with names the trainer does not apply.
        """

    def run(self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int) -> TrialResult:
        """Synchronous :meth:`submit` for one trial."""
        check_steps(steps)  # before anything is opened
        result: TrialResult = self._drive(self.submit(config, hp, steps))
        return result

    @abc.abstractmethod
    def check(self, config: Mapping[str, Any], hp: Mapping[str, Any]) -> None:
        """Refuse a trial that does not fit the study (names, values), writing nothing.

        Raises:
            InvalidTrialError: names or values that differ from the study's trials.
        """

    @abc.abstractmethod
    def eval(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, float] | None:
        """Known metrics of the trial after ``step`` steps, without training; else None.

        Raises:
            InvalidTrialError: names the trainer or the study's trials do not have.
        """

    @abc.abstractmethod
    def state(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, Any] | None:
        """The trainer state (``Trainer.state_dict()``) of the trial after ``step``
        steps, loaded from its checkpoint; None when no checkpoint of that point exists
        (it was never reached, or evicted). Load it into ``trainer_cls(config)`` with
        ``load_state_dict`` to get the trained model.

        Raises:
            InvalidTrialError: names the trainer or the study's trials do not have.
        """

    def root_key(self, config: Mapping[str, Any], hp: Mapping[str, Sequence] | None = None) -> str:
        """The plan tree of a trial: trainer version + fixed config (+ the trial's own
        sequences when ``share=False``, so that nothing is shared). Trials whose
        hyper-parameter names differ from those of the tree already there go to a tree
        of their own names (``BasePlanStorage.tree_key``), which this key does not
        follow."""
        if not self.share and hp is None:
            raise ValueError("root_key of a study with share=False needs the trial's hp")
        return StudySlot(self.name, self.version, self.share, fusible=self.fusible).root_key(
            config, hp or {}
        )

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

    def tune(
        self, tuner: Tuner, budget: Budget | str | None = None, progress: bool | None = None
    ) -> TrialResult | None:
        """Run ``tuner`` to completion, or until ``budget`` is used up, and return the
        best trial's result (so far).

        The tuner's decisions are logged in the storage: a study killed mid-run and
        started again replays them and trains nothing twice. A run stopped by its budget
        is resumed the same way: run it again with a larger budget (or none) and the
        tuner replays what it decided, answered from the storage, then goes on.

        Args:
            tuner: the search to run.
            budget: limits of this run (:class:`~stagetree.budget.Budget`, or a string
                such as ``"30m"``, ``"2h"``, ``"500 steps"``, ``"20 trials"``,
                ``"1h device"``, ``"20 trials, 30m"``): the first limit reached stops
                the run. A ``trials`` limit lets the trials in it finish; the others
                cancel running work (its checkpoints stay reusable). The stop is logged
                (logger ``stagetree``) and recorded in :attr:`last_run` and in the
                study's run record in the storage. None: ``stagetree run --budget``'s
                limits when the command runs this, else none.
            progress: a live progress display on stderr; default: when stderr is a
                terminal (never with a simulated executor). ``False`` turns it off.

        After the call, :attr:`last_run` (:class:`~stagetree.budget.RunReport`) says
        what this run did: trials, trials answered from the storage, steps trained,
        device- and wall-seconds, and the limit that stopped it.

        With a virtual-time executor (``executor="simulated"`` or a factory of a
        :class:`~stagetree.executors.simulated.SimulatedExecutor`) no driver thread
        runs: the tuner's event loop delivers the executor's virtual instants itself
        (:func:`~stagetree.executors.simulated.drive`), so the same study simulated
        twice takes the same decisions at the same virtual times.

        Raises:
            InvalidBudgetError: a budget that is not positive or has an unknown unit
                (before anything is opened or trained).
            TunerError: ``tuner`` is not a tuner object (a name such as ``"asha"``), or
                a tuner that never ends by itself (ASHA without ``num_trials`` on a
                random space) run without a budget.
            TrialFailedError: every trial failed (with the first failure's traceback).
            KeyboardInterrupt: Ctrl-C, with a one-line message (``interrupted; run
                again to resume``) and without the internals it interrupted.
        """
        if budget is None:  # the command line's, when a command runs the script
            budget = current_overrides().budget
        limits = None if budget is None else Budget.parse(budget)
        if progress is not None and not isinstance(progress, bool):
            raise ValueError(f"progress must be True, False or None, got {progress!r}")
        check_tuner_object(tuner)
        if limits is None and getattr(tuner, "bounded", True) is False:
            raise TunerError(
                f"{type(tuner).__name__} without num_trials on a random space never ends: "
                "give it num_trials, or give the run a budget "
                "(study.tune(tuner, budget='2h'), '1h device', '100 trials', ...)"
            )
        # What is known without training stops the run before any worker starts.
        check_tuner_fits(self.trainer, tuner)
        self._start_early()  # before the storage opens (the next line, for a local study)
        try:
            if not self._virtual_time():  # a simulated executor never builds the trainer
                check_checkpointable(self.trainer)
            return self._tune(tuner, limits, progress)
        except KeyboardInterrupt:
            self._end_early(stopping=True)  # even while a worker is being started from it
            # Ctrl-C: the event loop's cancellation chained under it tells a user
            # nothing; what was trained is stored and a new run resumes from it.
            raise KeyboardInterrupt(f"study {self.name!r}: {INTERRUPTED_MESSAGE}") from None
        finally:
            self._end_early()

    def _tune(
        self, tuner: Tuner, limits: Budget | None, progress: bool | None
    ) -> TrialResult | None:
        """:meth:`tune`, its arguments checked."""
        runner = StudyRunner(self)
        clock = self._run_clock()
        started = clock.monotonic()  # the budget counts from here, not from the workers
        self.begin_tuning(tuner.metric, tuner.mode, type(tuner).__name__, tuner.horizon)
        guard: BudgetGuard | None = None
        try:
            self._ensure_started()
            spent = self._device_seconds()
            virtual = self._virtual_time()
            show = progress if progress is not None else (_stderr_is_tty() and not virtual)
            display: Any = contextlib.nullcontext()
            if show and not virtual:
                display = ProgressDisplay(self, out=sys.stderr)

            async def guarded() -> TrialResult | None:
                nonlocal guard
                TUNING.set(True)  # the tuner's tasks (copies of this context) submit
                guard = BudgetGuard(limits, self.progress, clock, started=started)
                runner.guard = guard
                return await guard.run(tuner, runner)

            with display, frozen_heap():
                best: TrialResult | None = self._drive(guarded())
            if guard is not None and guard.stopped_by is not None:
                self._after_stop()  # what the cancelled work trained is in the plan
            if guard is not None:
                # The run's device-seconds as the study's totals count them (what was
                # trained for this study), so that the report's two rows agree.
                used = max(self._device_seconds() - spent, 0.0)
                self.last_run = dataclasses.replace(guard.report(), device_seconds=used)
                self._record_run(self.last_run)
        finally:
            self.end_tuning()
        self._last_tune = (tuner, best)
        if best is None:
            self._raise_if_all_failed()
        return best

    @abc.abstractmethod
    def begin_tuning(self, metric: str, mode: str, tuner: str, horizon: int = 0) -> None:
        """Start a tuner's run: take the study's tuning lease (one tuner per study at a
        time, across processes), record the tuner's metric and mode with the next write,
        and plan trials up to ``horizon`` steps (0: unknown). :meth:`tune` calls it;
        front ends that run the tuner elsewhere (the server, for a remote client) too.

        Raises:
            StudyBusyError: another process is tuning this study.
        """

    @abc.abstractmethod
    def end_tuning(self) -> None:
        """End the run :meth:`begin_tuning` started: release the tuning lease."""

    @abc.abstractmethod
    def read_log(self) -> list[dict[str, Any]]:
        """The tuner decisions logged by this study's latest run, when that run used
        this trainer version (decisions on another version's results are not replayed)."""

    @abc.abstractmethod
    def append_log(self, record: Mapping[str, Any]) -> None:
        """Append one JSON-serialisable tuner decision to the study's log (durably)."""

    # What tune() asks of where the study runs; a local study's engine answers, a remote
    # study keeps these defaults (its server's clock, no virtual time).

    def _drive(self, coro: Any) -> Any:
        """Run ``coro`` to completion from sync code."""
        return run_coro(coro)

    def _start_early(self) -> None:  # noqa: B027 (a hook: nothing to start remotely)
        """A run begins: start what its workers are made from, when they run here, before
        the storage opens (:meth:`_end_early` ends it where no worker came of it)."""

    def _end_early(self, stopping: bool = False) -> None:  # noqa: B027 (a hook: nothing remote)
        """The run ended (or failed): end what :meth:`_start_early` started if no worker
        came of it (``stopping``, on Ctrl-C: nor is one starting to)."""

    def _ensure_started(self) -> None:  # noqa: B027 (a hook: nothing to start remotely)
        """Start the workers, when they run here."""

    def _after_stop(self) -> None:  # noqa: B027 (a hook: the server waits for its own)
        """A budget stopped the run: wait (bounded) for the cancelled batches to
        checkpoint where they stopped, when they run here."""

    def _device_seconds(self) -> float:
        """Device-seconds trained for this study so far (``stats()``'s figure)."""
        return float(self.stats().get("device_seconds", 0.0))

    def _virtual_time(self) -> bool:
        """Whether the study runs in virtual time (a simulated executor)."""
        return False

    def _run_clock(self) -> Clock:
        """The clock of a run's wall-seconds budget."""
        return WALL_CLOCK

    def _record_run(self, run: RunReport) -> None:
        """Say what stopped the run (a log line)."""
        if run.stopped_by is None or run.budget is None:
            return
        logger.warning(
            "study %s: %s; run it again with a larger budget to go on from here",
            self.name,
            run.summary(),
        )

    def _sampler_storage(self) -> tuple[str | None, Any, str, str]:
        """Where a tuner's Optuna sampler keeps its history (see
        :meth:`StudyRunner.sampler_storage`): a study whose plan is out of reach keeps it
        in memory, as long as the study lives."""
        return None, self, self.name, str(self.version)

    def _quiet_driver(self) -> contextlib.AbstractContextManager[Any]:
        """See :meth:`StudyRunner.quiet_driver` (a remote study's driver is elsewhere)."""
        return contextlib.nullcontext()

    def _answered(self, config: Any, hp: Any, steps: int) -> bool:
        """Whether the storage holds the trial's metrics at ``steps`` (no training)."""
        try:
            return self.eval(config, hp, steps) is not None
        except StagetreeError:  # a trial the study refuses fails at submit, not here
            return False

    async def _submit(
        self,
        config: Mapping[str, Any],
        hp: Mapping[str, Any],
        steps: int,
        answered: Callable[[bool], None] | None = None,
    ) -> TrialResult:
        """:meth:`submit`, telling ``answered`` first whether the storage already holds
        the result (a study whose submission looks the trial up says so from there)."""
        if answered is not None:
            answered(self._answered(config, hp, steps))
        return await self.submit(config, hp, steps)

    def _raise_if_all_failed(self) -> None:
        """``tune()`` found no best trial: when that is because every trial failed, say
        so with the first failure's traceback instead of returning None."""
        trials = self.trials()
        failed = [t for t in trials if t.state == "failed"]
        if not failed or any(t.state == "done" for t in trials):
            return
        first = failed[0]
        error = first.error or TrialError("Error", "no error was recorded")
        raise TrialFailedError(
            f"no trial of study {self.name!r} succeeded: {len(failed)} of {len(trials)} "
            f"failed; the first (trial {first.id}): {error.summary()}",
            error.traceback,
        )

    # -- workers -------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def num_workers(self) -> int:
        """How many workers train this study's trials (starting them if needed)."""

    @abc.abstractmethod
    def worker_locations(self) -> dict[int, str]:
        """Where each worker runs (``worker -> "host (node id)"``) with a cluster
        executor once it started; empty when every worker runs on one machine."""

    # -- reports -------------------------------------------------------------------------

    @abc.abstractmethod
    def trials(self, history: bool = True) -> list[TrialRecord]:
        """Every trial of this study trained by this version of the trainer (trials of
        other versions are kept in the storage but never mixed in) with its metrics by
        step. With ``history=False``, each trial's metrics at its final step only
        (``{steps: metrics}``): no learning curve is read, which a study of 100,000
        trials lists in about a second."""

    @abc.abstractmethod
    def failures(self) -> list[tuple[int, TrialError]]:
        """``(trial id, error)`` of every failed trial of this study (of this trainer
        version), in id order (cheap: reads no metrics; progress displays poll it)."""

    @abc.abstractmethod
    def best(self, metric: str, mode: str = "max") -> TrialRecord | None:
        """The best trial by ``metric`` (``mode`` ``"max"`` or ``"min"``), by the rule
        that :meth:`tune`'s result and ``stagetree status`` follow too
        (:func:`stagetree.reports.trials.best_trial`): trials are compared at the largest step
        at which any trial has a finite value of ``metric`` at its final step (a trial
        stopped early never beats one trained further, however good its early metric),
        then by that value; ties go to the lowest trial id; NaN and infinite values are
        never best. None when no trial has a finite value at its final step. It reads
        the final points of all trials in one query and the learning curve of the best
        one only (the nodes of its path, not its whole plan tree): well under a second
        at 100,000 trials.

        Raises:
            ValueError: ``mode`` is not ``"max"`` or ``"min"``.
        """

    @abc.abstractmethod
    def trials_dataframe(self, history: bool = False) -> Any:
        """This study's trials (of this trainer version) as a :class:`pandas.DataFrame`
        (extra ``pandas``), one row per trial: ``config.<name>``, ``hp.<name>`` (the
        sequence in readable form) and ``hp.<name>.last`` (its value at the last step),
        ``metric.<name>`` (final metrics, at step ``metrics_at``), ``state``, ``steps``,
        ``error``, ``lineage``; with ``history``, every recorded metric in long form
        (``study, trial, step, metric, value``). :func:`stagetree.reports.export.trials_table`
        has the exact columns; ``stagetree export`` writes the same table.

        Raises:
            MissingExtraError: pandas is not installed.
        """

    def best_model(self, metric: str, mode: str = "max") -> Any:
        """The trained model of the best trial by ``metric`` (:meth:`best`'s rule), in
        plain PyTorch form: a fresh ``trainer(config)`` with the trial's final checkpoint
        loaded, and of it the ``torch.nn.Module`` it trains (a dict attribute name ->
        module when it holds several). A trainer that is not a
        :class:`~stagetree.torch.TorchTrainer` is returned itself, its state loaded.
        ``stagetree export --checkpoint TRIAL -o DIR`` writes the same weights as files.

        Raises:
            ValueError: a bad ``mode``, or no trial has a finite ``metric`` at its end.
            CheckpointError: the best trial's final checkpoint is absent (evicted or
                cleaned up); it is not retrained.
        """
        best = self.best(metric, mode)
        if best is None:
            raise ValueError(
                f"no trial of study {self.name!r} has a finite {metric!r} at its final step"
            )
        state = self.state(best.config, best.hp, best.steps)
        if state is None:
            raise CheckpointError(
                f"trial {best.id} has no checkpoint at its final step {best.steps} (evicted "
                "or cleaned up); best_model does not train it again"
            )
        trainer = self.trainer(dict(best.config))
        trainer.load_state_dict(state)
        objects = getattr(trainer, "checkpointed_objects", None)
        if not callable(objects):
            return trainer
        from torch import nn

        modules = {k: v for k, v in objects().items() if isinstance(v, nn.Module)}
        if len(modules) == 1:
            return next(iter(modules.values()))
        return modules or trainer

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Accounting: ``steps_requested`` (total steps of this study's trials),
        ``steps_unique`` (steps of the union of their paths), ``steps_executed`` and
        ``device_seconds`` (trained for this study's requests, over every run on this
        storage: a step two studies needed counts for both, a step another study had
        trained before costs this one nothing), ``merge_rate``, storage-wide checkpoint
        seconds/bytes and live-split counts, and lost workers on this study's trees:
        ``workers_lost``, and ``steps_lost``: steps a lost worker had trained past its
        last durable checkpoint, which are trained again (they count in
        ``steps_executed`` both times). See :func:`stagetree.reports.costs.study_accounting`;
        ``stagetree status`` shows the same numbers.

        And the efficiency of the study's latest run (:meth:`tune`) of this trainer
        version, with where its wall-clock went (:func:`stagetree.reports.costs.efficiency`:
        ``efficiency``, ``wall_seconds``, ``limit_seconds``, ``startup_seconds``,
        ``ckpt_load_wait_seconds``, ``ckpt_save_wait_seconds``, ``idle_seconds``,
        ``scheduling_seconds``, ``workers``, ``steps_unique_trained``,
        ``seconds_per_step``); measured until now while the run goes on. Absent when
        no run was recorded (trials submitted without a tuner, a storage written before
        runs were recorded) or the run trained nothing.

        Counts (``trials``, steps, bytes, ``workers``...) are ints, seconds and ratios
        floats. After the study closed (``with study:``), :meth:`stats`,
        :meth:`progress`, :meth:`trials` and :meth:`best` read the stored figures
        (a database storage, opened read-only for the call); those of a ``memory://``
        storage are gone with it (:class:`~stagetree.exceptions.StagetreeError`)."""

    @abc.abstractmethod
    def progress(self) -> dict[str, float]:
        """A cheap snapshot for progress displays: ``trials`` (submitted),
        ``finished``, ``running``, ``failed``, ``steps_requested`` (total steps of the
        submitted trials), ``steps_requested_finished`` (those of the finished trials),
        ``steps_executed`` and ``device_seconds`` (trained for this study so far, as
        :meth:`stats` counts them: running batches count as they report steps),
        ``elapsed`` (seconds since this Study object was made). Counts are ints."""


#: The parameters every study takes, in order (``name`` and ``trainer`` first).
STUDY_PARAMETERS = tuple(inspect.signature(StudyAPI.__init__).parameters)[1:]


class StudyRunner:
    """The :class:`~stagetree.tuners.base.TrialRunner` a study gives its tuners: its
    public methods, so a remote study's tuner runs unchanged over HTTP."""

    def __init__(self, study: StudyAPI) -> None:
        self.study = study
        self.guard: BudgetGuard | None = None  # tune() sets it before the tuner runs

    async def submit(
        self, config: dict[str, Any], hp: dict[str, Sequence], steps: int
    ) -> TrialResult:
        if self.guard is None:
            return await self.study.submit(config, hp, steps)
        fingerprint = submitted_fingerprint(config, hp)

        async def call(answered: Callable[[bool], None]) -> TrialResult:
            return await self.study._submit(config, hp, steps, answered)

        result: TrialResult = await self.guard.submit(fingerprint, call)
        return result

    def num_workers(self) -> int:
        return self.study.num_workers

    def shares_work(self) -> bool:
        return bool(self.study.share)

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Sequence]]]) -> None:
        self.study.declare(trials)

    def plan_ahead(self, horizon: int, rungs: list[int]) -> None:
        plan = getattr(self.study, "plan_ahead", None)  # a remote study plans nothing ahead
        if callable(plan):
            plan(horizon, rungs)

    def check(self, config: dict[str, Any], hp: dict[str, Sequence]) -> None:
        self.study.check(config, hp)

    def append_log(self, record: dict[str, Any]) -> None:
        self.study.append_log(record)

    def read_log(self) -> list[dict[str, Any]]:
        return self.study.read_log()

    def sampler_storage(self) -> tuple[str | None, Any, str, str]:
        """Where a tuner's Optuna sampler keeps its history
        (:mod:`stagetree.tuners.optuna_bridge`): ``(SQLAlchemy URL of the plan, or None
        when the plan is not SQL; the object an in-memory history lives as long as: the
        open plan storage, or this study when it runs on a server; study name; trainer
        version)``."""
        return self.study._sampler_storage()

    def quiet_driver(self) -> contextlib.AbstractContextManager[Any]:
        """A block during which the study's driver makes no storage call (a local
        study's engine lock held): the Optuna bridge imports SQLAlchemy's ORM in it."""
        return self.study._quiet_driver()


def check_identity(name: Any, trainer: Any, version: Any) -> None:
    """Check what names a study, local or remote: its name, trainer class and version.

    Raises:
        ValueError: an empty or non-string name or version.
        TypeError: a trainer that is not a Trainer subclass.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"study name must be a non-empty string, got {name!r}")
    if not (isinstance(trainer, type) and issubclass(trainer, Trainer)):
        raise TypeError(f"trainer must be a Trainer subclass, got {trainer!r}")
    if version is not None and (not isinstance(version, str) or not version):
        raise ValueError(f"version must be a non-empty string, got {version!r}")


def remote_url(url: str | None) -> str:
    """The tuning server a Study talks to: ``url``, else ``stagetree run --url``, else
    ``STAGETREE_URL``; "" for none (the study runs in this process)."""
    if url is None:
        url = current_overrides().url or os.environ.get("STAGETREE_URL") or ""
    if not isinstance(url, str):
        raise ValueError(f"url must be a string like 'http://host:8642', got {url!r}")
    return url.strip()


def check_weight(weight: Any) -> float:
    """A study's fair-share weight: a finite number > 0."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"weight must be a number > 0, got {weight!r}")
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"weight must be a finite number > 0, got {weight!r}")
    return float(weight)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


# The tuner classes of stagetree.tuners, named in the error of tune("asha").
_TUNER_CLASSES = (
    "ASHA",
    "AsyncHyperband",
    "GridSearch",
    "RandomSearch",
    "SHA",
    "Hyperband",
    "EarlyStop",
    "MedianStopping",
    "PBT",
)


def check_tuner_object(tuner: Any) -> None:
    """Refuse what is not a tuner (no ``run``), naming the tuner classes.

    Raises:
        TunerError: ``tuner`` is a name or another object without ``run``.
    """
    if not isinstance(tuner, str) and callable(getattr(tuner, "run", None)):
        return
    named = [c for c in _TUNER_CLASSES if isinstance(tuner, str) and c.lower() == tuner.lower()]
    example = f"stagetree.tuners.{named[0]}(space, ...)" if named else "stagetree.tuners.ASHA(...)"
    raise TunerError(
        f"tune() takes a tuner object, e.g. {example}, not {tuner!r:.60}; tuners: "
        + ", ".join(_TUNER_CLASSES)
    )


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Move what the process holds now (its imported modules, the study, its engine) to
    the collector's permanent generation while the block runs, and back when it ends
    (however it ends).

    A run keeps a hundred-odd objects per trial, enough to start full collections as
    the study grows (four in 3,000 trials), and each walks every object alive, mostly
    objects that live as long as the process (30 µs a trial at 1,000 trials, 60 at
    3,000, with a trivial trainer). Frozen, they are skipped; garbage made in the
    block is collected as usual, and what was frozen is collectable again afterwards.
    A collector turned off, or a heap the user froze already (:func:`gc.freeze`
    before), is left as it is.
    """
    if not gc.isenabled() or gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_coro(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also inside a running event loop
    (e.g. Jupyter), by using a helper thread there."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
