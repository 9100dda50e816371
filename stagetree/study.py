"""The :class:`Study`: a synchronous facade over the asynchronous engine.

A study owns nothing but a name, a trainer and a view of a shared engine. The engine
(:mod:`stagetree.engine.core`, one per storage in a process, kept by
:mod:`stagetree.engine.pool`) owns the plan storage, the checkpoint store, the I/O-free
scheduler and an executor, and runs a driver thread that feeds executor events to the
scheduler and carries out its instructions. Everything the engine learns (metrics,
checkpoints, accounting) is written to the plan, so a later process answers from it
without training.

``Study(...)`` is also the factory of the study contract (:mod:`stagetree.study_api`):
given a server URL it returns a :class:`~stagetree.server.client.RemoteStudy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from stagetree.budget import RunReport
from stagetree.checkpoints import CheckpointStore
from stagetree.checkpoints.location import default_checkpoint_dir
from stagetree.checkpoints.stores import is_local_location
from stagetree.engine import pool
from stagetree.engine.core import Engine, EngineStoppedError, StudySlot
from stagetree.engine.settings import EngineSettings, Placement, current_overrides
from stagetree.exceptions import (
    InvalidTrialError,
    SharedEngineWarning,
    StagetreeError,
    StudyBusyError,
)
from stagetree.executors.base import Clock, ExecutorOptions
from stagetree.executors.local import end_unused_server, start_server_early
from stagetree.executors.registry import make_executor
from stagetree.executors.simulated import drive
from stagetree.fusion import fusion_names
from stagetree.hp import Sequence, as_sequence
from stagetree.identity import trainer_fingerprint
from stagetree.names import check_hp_names, names_mismatch
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.registry import open_storage
from stagetree.plan.tree import check_steps
from stagetree.records import TrialError, TrialRecord
from stagetree.reports import costs as report_costs
from stagetree.reports import export
from stagetree.reports import trials as report_trials
from stagetree.reports.open import open_existing_storage
from stagetree.server.client import RemoteStudy
from stagetree.space import strict_json
from stagetree.study_api import (
    TUNING,
    StudyAPI,
    StudyArguments,
    check_weight,
    remote_url,
    run_coro,
)
from stagetree.trainer import check_checkpointable
from stagetree.tuners.base import TrialResult

if TYPE_CHECKING:
    from stagetree.executors.base import BaseExecutor

__all__ = ["Study", "TrialError", "TrialRecord", "trainer_fingerprint"]


def _same_value(a: Any, b: Any) -> bool:
    """Whether metric value ``b`` may stand for ``a`` to the bit (same type and text:
    ``0.0`` is not ``-0.0``, ``1`` not ``1.0``, NaN only itself)."""
    return a is b or (type(a) is type(b) and a == b and str(a) == str(b))


class _IdleEnd:
    """Ends the watched bursts a tuner's event loop began once that loop has nothing
    ready to run: every task of the tuner waits then (for a result, a timer, a thread).
    One check per loop, however many submissions it made."""

    _ROUNDS = 1000  # loop turns at most (a busy loop: a replay answering many trials)

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Engine) -> None:
        self.loop = loop
        self.engine = engine
        self.count = 0  # bursts begun and not ended

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, engine: Engine) -> _IdleEnd:
        """The check of ``loop`` for ``engine`` (made on first use)."""
        ends = _IDLE_ENDS.setdefault(loop, {})
        end = ends.get(id(engine))
        if end is None:
            end = ends[id(engine)] = cls(loop, engine)
        return end

    def add(self) -> None:
        """One more burst, ended at the loop's next idle moment."""
        self.count += 1
        if self.count == 1:
            self.loop.call_soon(self._check, 0)

    def _check(self, rounds: int) -> None:
        ready = getattr(self.loop, "_ready", None)  # CPython's queue of ready callbacks
        if ready and rounds < self._ROUNDS:
            self.loop.call_soon(self._check, rounds + 1)
            return
        count, self.count = self.count, 0
        for _ in range(count):
            self.engine.end_burst(watched=True)


# The idle checks of each running event loop, by engine.
_IDLE_ENDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, _IdleEnd]] = (
    weakref.WeakKeyDictionary()
)


class Study(StudyAPI):
    """One optimization run: a trainer, a storage, and the trials submitted to it.

    The study contract (:class:`~stagetree.study_api.StudyAPI`, whose ``__init__``
    documents every argument), run in this process. ``Study(..., url=...)`` (or
    ``STAGETREE_URL``, or ``stagetree run --url``) returns a
    :class:`~stagetree.server.client.RemoteStudy` instead: the same contract, run by a
    tuning server.

    Studies on the same storage in one process share one engine
    (:mod:`stagetree.engine.pool`): one worker pool, made with the first study's
    engine settings (:attr:`settings`; a study that asks for others is told so with a
    :class:`~stagetree.exceptions.SharedEngineWarning`), divided between studies with
    pending work by their weights, and, for studies of the same trainer, every stage
    they have in common while they run. Studies in other processes share everything
    that was stored (metrics, checkpoints).

    Attributes:
        settings: the engine settings this study asks for
            (:class:`~stagetree.engine.settings.EngineSettings`).
        placement: its storage and checkpoint location
            (:class:`~stagetree.engine.settings.Placement`).
    """

    if not TYPE_CHECKING:  # type checkers see StudyAPI.__init__'s parameters instead

        def __new__(cls, *args: Any, **kwargs: Any) -> StudyAPI:
            # A study with a server URL is a client of that server (same contract).
            if cls is Study and remote_url(kwargs.get("url")):
                return RemoteStudy(*args, **kwargs)
            return super().__new__(cls)

        # What inspect.signature(Study) and help(Study) show: the real parameters.
        __new__.__signature__ = inspect.signature(StudyAPI.__init__).replace(
            return_annotation=inspect.Signature.empty
        )

    def _configure(self, args: StudyArguments) -> None:
        # Every argument is checked here, before the storage is opened or anything
        # written. Command-line overrides (``stagetree run --workers ...
        # --checkpoints ...``) are checked like the script's own values.
        over = current_overrides()
        args = dataclasses.replace(
            args,
            workers=args.workers if over.workers is None else over.workers,
            storage=args.storage if over.storage is None else over.storage,
            executor=args.executor if over.executor is None else over.executor,
            checkpoint_dir=over.checkpoint_dir or args.checkpoint_dir,
            step_timeout=args.step_timeout if over.step_timeout is None else over.step_timeout,
            stop_timeout=args.stop_timeout if over.stop_timeout is None else over.stop_timeout,
        )
        self._address = over.address  # a Ray cluster, for the executor
        self.settings = EngineSettings(
            workers=args.workers,
            executor=args.executor,
            policy=args.policy,
            max_retries=args.max_retries,
            threads_per_worker=args.threads_per_worker,
            eval_every=args.eval_every,
            max_fused=args.max_fused,
            checkpoint_every=args.checkpoint_every,
            devices_per_worker=args.devices_per_worker,
            step_timeout=args.step_timeout,
            stop_timeout=args.stop_timeout,
        )
        self.placement = Placement(args.storage, args.checkpoint_dir, args.checkpoint_budget)
        trainer = args.trainer
        if over.executor == "simulated":  # `stagetree simulate`
            fusion_names(trainer, args.fuse)  # still checked; the simulator plans it unfused
            self.fusible: frozenset[str] = frozenset()
        else:
            self.fusible = fusion_names(trainer, args.fuse, args.executor)
        self.weight = check_weight(args.weight)
        self.devices_per_worker = self.settings.devices_per_worker
        self.eval_every = int(self.settings.eval_every or 0)
        assert self.settings.max_fused is not None  # EngineSettings made it an int
        self.max_fused: int = self.settings.max_fused
        self.checkpoint_every = self.settings.checkpoint_every
        self.name = args.name
        self.trainer = trainer
        self.share = args.share
        self.version = args.version if args.version is not None else trainer_fingerprint(trainer)
        self._arguments = dataclasses.replace(
            args, version=self.version, fuse=bool(self.fusible), weight=self.weight
        )
        # The storage is opened on first use, not here: a module that builds a Study
        # must stay inert when it is imported (workers never import it: they receive
        # the trainer class itself).
        self._engine_obj: Engine | None = None
        self._replacing = False  # an engine is made again: its store was proven before
        self._lease: pool.EngineLease | None = None
        self._closed = False
        self._started = time.monotonic()
        self._slot: StudySlot | None = None  # the engine's record of this study
        self._horizon = 0  # steps the current tuner may train a trial to (0: unknown)

    @property
    def _engine(self) -> Engine:
        # An engine that stopped on an error is replaced (stagetree.engine.pool).
        if self._engine_obj is None or self._engine_obj.error is not None:
            self._attach()
        assert self._engine_obj is not None
        return self._engine_obj

    def _attach(self) -> None:
        """Join (or make) the engine of this storage; load this study."""
        if self._closed:
            raise StagetreeError(f"study {self.name!r} is closed")
        url = self.placement.key
        self._replacing = self._engine_obj is not None
        lease = pool.acquire(url, self.settings, self.placement, self._make_engine)
        differ = self.settings.differences(lease.settings)
        differ += self.placement.differences(lease.placement)
        if differ:
            self._warn_shared(differ, url)
        self._lease = lease
        self._engine_obj = engine = lease.engine
        self._slot = engine.open_study(
            self.name, self.version, self.share, self.weight, self.trainer, url, self.fusible
        )

    def _warn_shared(self, differences: list[tuple[str, Any, Any]], url: str) -> None:
        """Say which of this study's settings the shared engine does not follow."""
        differ = [f"{k}={v!r} (it uses {w!r})" for k, v, w in differences]
        warnings.warn(
            f"study {self.name!r} joins the engine of storage {url} in this process "
            f"(one worker pool for every study there), whose settings come from the "
            f"first study: {', '.join(differ)} ignored",
            SharedEngineWarning,
            stacklevel=5,
        )

    def open(self) -> Study:
        """Open the storage now (it is otherwise opened on first use); returns self.

        Raises:
            StorageError: the storage URL cannot be opened.
        """
        _ = self._engine
        return self

    def _make_engine(self) -> Engine:
        placement, settings = self.placement, self.settings
        storage, checkpoint_dir = placement.storage, placement.checkpoint_dir
        budget = placement.budget
        url = storage if isinstance(storage, str) else "memory://"
        temporary = False
        # Nothing is created for a storage that does not open: a store that creates
        # nothing here (given, or remote: an unreachable bucket fails before the plan
        # is opened) is checked first, a local directory only once the plan is open.
        store: CheckpointStore | None = None
        if isinstance(checkpoint_dir, CheckpointStore):
            store = checkpoint_dir
            if budget is not None:
                store.budget_bytes = budget
            store.check(self._replacing)
        elif checkpoint_dir is not None and not is_local_location(checkpoint_dir):
            store = CheckpointStore(checkpoint_dir, budget_bytes=budget)
            store.check(self._replacing)
        plan = open_storage(storage) if isinstance(storage, str) else storage
        if store is None:
            assert not isinstance(checkpoint_dir, CheckpointStore)
            try:
                if checkpoint_dir is None:
                    checkpoint_dir, temporary = default_checkpoint_dir(url)
                store = CheckpointStore(checkpoint_dir, budget_bytes=budget)
                store.check()
            except BaseException:
                if isinstance(storage, str):  # opened here: closed here
                    plan.close()
                raise
        trainer = self.trainer
        address = self._address

        def factory() -> BaseExecutor:
            options = ExecutorOptions(
                trainer,
                settings.workers,
                store,
                settings.threads_per_worker,
                store,
                address,
                devices_per_worker=settings.devices_per_worker,
                step_timeout=settings.step_timeout,
            )
            return make_executor(settings.executor, options)

        engine = Engine(
            plan,
            store,
            factory,
            settings.policy,
            settings.max_retries,
            budget,
            self.eval_every,
            self.max_fused,
            settings.checkpoint_every,
            stop_timeout=settings.stop_timeout,
        )
        engine.temporary_checkpoints = temporary
        engine.default_trainer = trainer
        return engine

    # -- context manager -----------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (when no other study uses them) and close the storage."""
        if self._closed:
            return
        self._closed = True
        end_unused_server()  # started by a tune() that never started a worker
        if self._lease is None:
            return
        if pool.release(self._lease):
            self._lease.engine.close()

    # -- trials --------------------------------------------------------------------------

    @property
    def _study_slot(self) -> StudySlot:
        # The slot of the engine attached now: read after ``self._engine`` (which
        # replaces a stopped engine), never replacing it itself, so that
        # ``self._engine.f(self._study_slot)`` pairs an engine with its own slot.
        if self._slot is None:
            _ = self._engine
        assert self._slot is not None
        return self._slot

    def _normalise(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int, define: bool = True
    ) -> tuple[dict[str, Any], dict[str, Sequence]]:
        """Checked copies of a trial's config and sequences; ``define``: the first trial
        sets the study's names (queries, ``eval``/``state``, never do)."""
        check_steps(steps)
        if not isinstance(config, Mapping) or not isinstance(hp, Mapping):
            raise InvalidTrialError("config and hp must be mappings")
        seqs = {str(k): as_sequence(v) for k, v in hp.items()}
        cfg = dict(config)
        try:  # strict: a NaN, or an object written through its repr, has no stable identity
            strict_json(cfg)
        except (TypeError, ValueError) as exc:
            raise InvalidTrialError(
                f"config {cfg!r} cannot be a fixed configuration ({exc}): use finite numbers, "
                "strings, booleans, None, and lists or dicts of those"
            ) from None
        check_hp_names(self.trainer, seqs)
        slot = self._study_slot  # the names of the study's stored trials
        names = (frozenset(cfg), frozenset(seqs))
        if slot.names is None:
            if define:
                slot.names = names
        elif names != slot.names:
            want_c, want_h = slot.names
            diff = []
            for label, have, want in (("config", names[0], want_c), ("hp", names[1], want_h)):
                diff += names_mismatch(label, have, want)
            raise InvalidTrialError(f"trial does not match study {self.name!r}: " + "; ".join(diff))
        return cfg, seqs

    async def submit(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int
    ) -> TrialResult:
        return await self._submit(config, hp, steps)

    async def _submit(
        self,
        config: Mapping[str, Any],
        hp: Mapping[str, Any],
        steps: int,
        answered: Callable[[bool], None] | None = None,
    ) -> TrialResult:
        """:meth:`submit`; ``answered`` hears, once the engine took the submission,
        whether the plan already held its metrics (the submission's own look-up: no
        second one)."""
        if self._closed:
            raise StagetreeError(f"study {self.name!r} is closed")
        cfg, seqs = self._normalise(config, hp, steps)
        self._burst()
        engine = self._engine
        try:
            waiter = engine.submit(self._study_slot, cfg, seqs, steps, self._horizon)
        except EngineStoppedError:
            # It stopped on an error since it was attached, before taking this
            # submission: its replacement takes it, as it takes every later one.
            engine = self._engine
            waiter = engine.submit(self._study_slot, cfg, seqs, steps, self._horizon)
        if answered is not None:
            answered(waiter.answered)
        try:
            metrics = await asyncio.wrap_future(waiter.future)
        except asyncio.CancelledError:
            self._burst(watched_only=True)
            engine.cancel(waiter)
            raise
        # From the engine in use now: one that stopped on an error meanwhile was
        # replaced, and closed, by the study's next use (the result is stored anyway).
        engine = self._engine
        history = engine.history(self._study_slot, cfg, seqs, steps, at=waiter)
        # What the plan holds at ``steps``: train() metrics of that step too; the
        # history's entry itself when that is all (one dict per result, not two).
        at = history.get(steps, {})
        if not all(k in at and _same_value(at[k], v) for k, v in metrics.items()):
            at = {**at, **metrics}
        return TrialResult(config=cfg, hp=seqs, steps=steps, metrics=at, history=history)

    def _burst(self, watched_only: bool = False) -> None:
        """Announce what this pass of the running event loop (a tuner's rung, a gather)
        submits as one burst, planned together: it ends when the loop comes round again;
        a tuner's, once its loop has nothing left to run (every task of it waits), and is
        planned then without the quiet window (simulated time plans each instant as it
        comes). Outside an event loop, nothing is announced; with ``watched_only``, only
        a tuner's (its declarations, between its submissions)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        engine = self._engine
        if TUNING.get() and not self._virtual_time():
            engine.begin_burst(watched=True)
            _IdleEnd.of(loop, engine).add()
        elif not watched_only:
            engine.begin_burst()
            loop.call_soon(engine.end_burst)

    def declare(self, trials: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
        trials = list(trials)
        for _config, hp in trials:
            check_hp_names(self.trainer, hp)
        if not self._horizon:
            return  # no horizon known: submissions insert all there is to know
        checked = [self._normalise(config, hp, self._horizon) for config, hp in trials]
        self._burst(watched_only=True)
        self._engine.declare(self._study_slot, checked, self._horizon)

    def plan_ahead(self, horizon: int, rungs: Iterable[int] = ()) -> None:
        """The running tuner may train trials up to ``horizon`` steps from now on (trials
        declared later are inserted that far) and asks for results at ``rungs`` (the
        batches of its plan trees checkpoint there as they pass, see
        :class:`~stagetree.scheduler.events.SaveSteps`)."""
        self._horizon = max(self._horizon, int(horizon))
        self._burst(watched_only=True)
        self._engine.save_at(self._study_slot, rungs)

    def eval(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, float] | None:
        cfg, seqs = self._normalise(config, hp, step, define=False)
        return self._engine.known(self._study_slot, cfg, seqs, step)[0]

    def state(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, Any] | None:
        cfg, seqs = self._normalise(config, hp, step, define=False)
        ref = self._engine.known(self._study_slot, cfg, seqs, step)[1]
        return None if ref is None else self._engine.store.load(ref)

    # -- what tune() asks of the engine ---------------------------------------------------

    def _device_seconds(self) -> float:
        with self._engine.reading() as storage:
            return report_trials.device_seconds(storage, self.name, self.version)

    def _start_early(self) -> None:
        # The fork server of the local workers starts before the storage opens and the
        # engine is built: its imports overlap them (issue 22). A run answered from the
        # storage ends it again (begin_tuning), as does a run that fails before.
        if self.settings.executor == "local" and not self._closed:
            check_checkpointable(self.trainer)  # (tune() checks it too) not for nothing
            start_server_early(self.trainer)

    def _end_early(self, stopping: bool = False) -> None:
        end_unused_server(stopping)

    def _ensure_started(self) -> None:
        # The workers start with the first trial the storage cannot answer (what they fork
        # from started in begin_tuning for a first run, which will train).
        self._engine.ensure_started(workers=False)
        if self._engine.has_log(self._study_slot):
            # a re-run: its replay is answered from one read of the finished trials
            self._engine.prepare_replay(self._study_slot)

    def _virtual_time(self) -> bool:
        return self._run_clock().virtual

    def _after_stop(self) -> None:
        engine = self._engine
        if not engine.run_clock.virtual:  # simulated work is pumped by tune(), now over
            engine.wait_stopped()

    def _run_clock(self) -> Clock:
        """The clock of a run's wall-seconds budget: the executor's (virtual time when
        simulated)."""
        return self._engine.run_clock

    def _record_run(self, run: RunReport) -> None:
        """Say what stopped the run: a log line, and the study's run record."""
        super()._record_run(run)
        if run.stopped_by is None or run.budget is None:
            return
        self._engine.record_run(
            self._study_slot, {"budget": run.budget.describe(), "stopped_by": run.stopped_by}
        )

    def _sampler_storage(self) -> tuple[str | None, Any, str, str]:
        plan = self._engine.storage
        arg = self.placement.storage
        url = plan.database_url()
        if url is not None:
            url = arg if isinstance(arg, str) else url
            if url.split(":", 1)[0] in ("postgresql", "postgres"):
                url = "postgresql+psycopg:" + url.split(":", 1)[1]
        return url, plan, self.name, self.version

    def _quiet_driver(self) -> contextlib.AbstractContextManager[Any]:
        return self._engine.reading()

    # -- front ends (tune(), and the server for its remote clients) ------------------------

    def begin_tuning(self, metric: str, mode: str, tuner: str, horizon: int = 0) -> None:
        engine = self._engine
        meta = {"metric": metric, "mode": mode, "tuner": tuner}
        if not engine.has_log(self._study_slot):
            # A run with no decision logged (a first run) will train: what its workers
            # fork from starts now, while the tuner is built, and before the engine's
            # thread (see stagetree.executors._driverfork: forked from this process).
            engine.prepare_workers()
        else:
            end_unused_server()  # a re-run trains nothing, or starts its workers later
        holder = engine.begin_tuning(self._study_slot, meta)
        if holder is not None:
            left = max(0.0, holder.expires - time.time())
            raise StudyBusyError(
                f"study {self.name!r} is being tuned by another process ({holder.describe()}); "
                "running it twice at once would duplicate its trials and its tuner's log. "
                "Wait for that run to finish, or give this run another study name. If that "
                f"process is gone, its lease expires in {left:.0f} s (it is renewed every "
                f"{engine.lease_ttl / 5:.0f} s while the process lives); then run again to "
                "resume the study.",
                study=self.name,
                holder=holder.describe(),
            )
        self._horizon = int(horizon)

    def end_tuning(self) -> None:
        self._horizon = 0
        self._engine.end_tuning(self._study_slot)

    def check(self, config: Mapping[str, Any], hp: Mapping[str, Any]) -> None:
        self._normalise(config, hp, 0)

    def read_log(self) -> list[dict[str, Any]]:
        return self._engine.read_log(self._study_slot)

    def append_log(self, record: Mapping[str, Any]) -> None:
        self._engine.append_log(self._study_slot, record)

    def _drive(self, coro: Any) -> Any:
        """Run ``coro`` to completion from sync code; with a virtual-time executor, its
        event loop also delivers the executor's instants (no driver thread runs)."""
        try:
            engine = self._engine
            engine.ensure_started(workers=False)
        except BaseException:
            coro.close()  # never started: no "never awaited" warning
            raise
        if engine.executor is None or not engine.executor.clock.virtual:
            return run_coro(coro)

        def pump(timeout: float) -> int:
            try:
                return engine.pump(timeout)
            except BaseException as exc:  # the engine is unusable now, as after a thread error
                engine.error = exc
                raise

        return run_coro(drive(coro, pump, engine.executor))

    def worker_locations(self) -> dict[int, str]:
        """Where each worker runs (``worker -> "host (node id)"``) with a cluster
        executor once it started; empty when every worker runs on this machine."""
        executor = self._engine.executor
        return executor.worker_locations() if executor is not None else {}

    @property
    def num_workers(self) -> int:
        # Its executor's count; asking starts no worker (a run that trains nothing
        # never starts one).
        return self._engine.num_workers

    # -- reports (stagetree.reports: one definition each, shared with the commands) ---------

    @contextlib.contextmanager
    def reading(self) -> Iterator[BasePlanStorage]:
        """The plan storage for read-only queries (:mod:`stagetree.reports`,
        :mod:`stagetree.reports.views`), with the engine's lock held: the engine waits while it
        is held, so keep each read short and never write.

        Once the study is closed, its storage opened read-only for the call (the
        stored figures stay readable after ``with study:``).

        Raises:
            StagetreeError: the study is closed and its storage was in memory (its
                figures went with it) or an object it was given.
        """
        if not self._closed:
            with self._engine.reading() as storage:
                yield storage
            return
        storage = self._closed_storage()
        try:
            yield storage
        finally:
            storage.close()

    def _closed_storage(self) -> BasePlanStorage:
        """The storage of a closed study, opened read-only."""
        url = self.placement.storage
        if not isinstance(url, str) or url.startswith("memory:"):
            where = url if isinstance(url, str) else "a storage object"
            raise StagetreeError(
                f"study {self.name!r} is closed and its storage ({where}) closed with it: "
                "its figures are gone; read them (stats(), progress(), trials(), best()) "
                "before the study closes, or use a database storage (sqlite:///...)"
            )
        return open_existing_storage(url)

    def trials(self, history: bool = True) -> list[TrialRecord]:
        with self.reading() as storage:
            return report_trials.trial_records(storage, self.name, self.version, history=history)

    def failures(self) -> list[tuple[int, TrialError]]:
        with self.reading() as storage:
            return report_trials.failures(storage, self.name, self.version)

    def best(self, metric: str, mode: str = "max") -> TrialRecord | None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        with self.reading() as storage:
            return report_trials.best_record(storage, self.name, metric, mode, self.version)

    def trials_dataframe(self, history: bool = False) -> Any:
        export.require("pandas", "pandas", "a DataFrame of trials")
        with self.reading() as storage:
            table = export.trials_table(
                storage, self.name, history=history, version=self.version, missing_ok=True
            )
        return export.dataframe(table)

    def stats(self) -> dict[str, float]:
        if self._closed:  # the stored figures: the run ended
            with self.reading() as storage:
                out = report_costs.study_accounting(storage, self.name, self.version)
                out.update(report_costs.efficiency(storage, self.name, self.version))
                return out
        engine = self._engine
        engine.settle()
        workers = engine.num_workers if engine.executor is not None else None
        with engine.reading() as storage:
            out = report_costs.study_accounting(storage, self.name, self.version)
            out.update(
                report_costs.efficiency(
                    storage, self.name, self.version, now=engine.clock(), workers=workers
                )
            )
            return out

    def progress(self) -> dict[str, float]:
        # The study's own steps: running batches are charged as they report steps.
        with self.reading() as storage:  # the engine's lock is held while it runs
            out = report_trials.progress(storage, self.name, self.version)
        out["elapsed"] = time.monotonic() - self._started
        return out


# A remote study is a Study too (``isinstance(Study(..., url=...), Study)``): both
# implement the same contract, and front ends find a script's study either way.
Study.register(RemoteStudy)
