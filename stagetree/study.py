"""The :class:`Study`: a synchronous facade over the asynchronous engine.

A study owns nothing but a name, a trainer and a view of a shared engine. The engine
(:mod:`stagetree.engine`, one per storage and trainer in a process) owns the plan
storage, the checkpoint store, the I/O-free scheduler and an executor, and runs a
driver thread that feeds executor events to the scheduler and carries out its
instructions. Everything the engine learns (metrics, checkpoints, accounting) is
written to the plan, so a later process answers from it without training.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from stagetree import reports
from stagetree.budget import Budget, BudgetGuard, RunReport
from stagetree.checkpoints import CheckpointStore, check_location
from stagetree.checkpoints.location import default_checkpoint_dir
from stagetree.engine.core import Engine, StudySlot
from stagetree.exceptions import (
    CheckpointError,
    InvalidTrialError,
    StagetreeError,
    StagetreeWarning,
    StudyBusyError,
    TrialFailedError,
)
from stagetree.executors.base import WALL_CLOCK, Clock
from stagetree.fusion import check_max_fused, fusion_names
from stagetree.hp import Sequence, as_sequence
from stagetree.identity import trainer_fingerprint
from stagetree.names import check_hp_names, check_space_names, names_mismatch
from stagetree.plan import BasePlanStorage, open_storage
from stagetree.reports import TrialError, TrialRecord
from stagetree.scheduler.core import check_checkpoint_every
from stagetree.trainer import Trainer
from stagetree.tuners.base import TrialResult, Tuner

if TYPE_CHECKING:
    from stagetree.executors.base import BaseExecutor

__all__ = ["Study", "TrialError", "TrialRecord", "trainer_fingerprint"]

# Command-line overrides (``stagetree run --workers N --storage URL``): the CLI sets them
# before it runs a script, and every Study built by that script honours them.
_OVERRIDES: dict[str, Any] = {}


logger = logging.getLogger("stagetree")

_ENGINES: dict[tuple[str, str], Engine] = {}
_ENGINES_LOCK = threading.Lock()


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
        checkpoint_dir: where checkpoints go: a directory (a shared mount for workers
            on several machines), a URL of any fsspec protocol (``file:///dir``,
            ``s3://bucket/prefix``, ``gs://...``, ``az://...``; install the protocol's
            package, e.g. ``stagetree[s3]``), or a
            :class:`~stagetree.checkpoints.CheckpointStore` (for fsspec options such as
            an S3 endpoint). Default: beside the SQLite file, a temporary directory
            otherwise. The location is checked (written, read back) when the study
            opens, before anything is trained.
        checkpoint_budget: bytes the checkpoint store may hold: an int, or a size such
            as ``"10MB"`` / ``"2GiB"`` (None: unlimited).
        version: overrides the trainer's code fingerprint in the root key
            (:func:`~stagetree.identity.trainer_fingerprint`).
        executor: ``"local"`` (worker processes, the default), ``"inline"`` (in this
            process; for debugging and tests), ``"simulated"`` (virtual time, no training:
            :class:`~stagetree.executors.SimulatedExecutor`), another name registered
            with :func:`~stagetree.executors.register_executor`, or a factory returning a
            ``BaseExecutor``.
        policy: scheduling policy: ``"critical_path"`` (default), ``"bfs"`` or ``"thr"``.
        max_retries: how often a failing stage is retried before its requests fail.
        threads_per_worker: torch/OpenMP threads per worker process (default: the
            machine's cores divided among the workers).
        eval_every: learning curves: call ``evaluate()`` every ``eval_every`` steps as
            well as at the requested steps (default 1: every step); 0 or None
            evaluates at requested steps only. ``train()``'s metrics are recorded at
            every step either way. Evaluation never changes training (exactness), only
            its cost; it is an engine setting, so studies sharing an engine (same
            storage and trainer in one process) use the first one's.
        weight: this study's share of the workers when several studies contend for
            them (fair share, default 1.0): studies with pending work get device time
            in proportion to their weights; a study alone gets every worker, and a stage
            two studies need is trained once and counted for both.
        url: a tuning server (``http://host:8642``, see ``stagetree serve``): the study
            runs there, on the server's storage and workers, and this object is a
            client with the same API (:class:`stagetree.server.client.RemoteStudy`).
            Default: ``STAGETREE_URL`` from the environment, else this process runs the
            study; ``url=""`` always runs it here.
        token: the server's token (default: ``STAGETREE_TOKEN`` from the environment).
        fuse: horizontal fusion (:mod:`stagetree.fusion`): ``True`` trains sibling stages
            that start from the same model and differ only in fusible hyper-parameters
            (optimizer scalars; see the trainer's ``fusible``) as one fused job on one
            worker, ``False`` (the default) never fuses, ``"auto"`` fuses when the
            trainer is fusible and this machine has a CUDA device. Fused training equals
            unfused training up to floating-point rounding (and dropout masks), not bit
            for bit, so a fusing study keeps its results in plan trees of its own: they
            are never handed to a study that does not fuse (and the other way round).
            Needs a trainer that can fuse (:class:`stagetree.torch.FusibleTrainer`) and
            an executor that can (``local``, ``inline``, ``ray``).
        max_fused: most members of one fused job (default: 32, past which the digits
            benchmark gains little on a CPU; see
            :data:`stagetree.fusion.DEFAULT_MAX_FUSED`). A trainer may hold a job to what
            its device fits (``Trainer.fused_width_limit``). An engine setting, like
            ``eval_every``.
        checkpoint_every: periodic checkpoints, which bound the steps a crash loses
            (checkpoints are otherwise taken where trials branch and where batches
            end): an int (every that many steps), ``"auto"`` (the default: once a step
            and a save were measured, every 5% of a trial's steps or every minute of
            training, whichever is longer, and no more often than every 100 steps'
            time, so that saves cost at most about 1% of the training; none for short
            trials) or ``None`` (off). Saves
            are written in the background. An engine setting, like ``eval_every``.
        devices_per_worker: devices each worker owns (default 1), for trials that
            train data-parallel over several devices: a local worker process gets
            ``k`` devices of its own as its ``CUDA_VISIBLE_DEVICES`` (its trainer sees
            ``torch.cuda.device_count() == k``; :func:`stagetree.executors.worker_devices`
            lists them), and ``workers`` defaults to the visible devices divided by
            ``k``; a Ray worker asks for ``{"GPU": k}``; a simulated one trains ``k``
            devices' worth faster and counts ``k`` devices busy. An engine setting, like
            ``eval_every``. Raises ``ValueError`` (when the workers start) if
            ``workers * k`` devices are not visible.

    Studies on the same storage in one process share one engine: one worker pool
    (the first study's ``workers``, ``executor``, ``policy`` and ``eval_every``), divided
    between studies with pending work by their weights, and, for studies of the same
    trainer, every stage they have in common while they run. Studies in other
    processes share everything that was stored (metrics, checkpoints).
    """

    #: What the latest :meth:`tune` call did (None before one ended).
    last_run: RunReport | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Study:
        # A study with a server URL is a client of that server (same API).
        if cls is Study and remote_url(kwargs.get("url")):
            from stagetree.server.client import RemoteStudy

            return super().__new__(RemoteStudy)
        return super().__new__(cls)

    def __init__(
        self,
        name: str,
        trainer: type[Trainer],
        storage: str | BasePlanStorage = "sqlite:///stagetree.db",
        workers: int | None = None,
        share: bool = True,
        checkpoint_dir: str | os.PathLike[str] | CheckpointStore | None = None,
        checkpoint_budget: int | None = None,
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
        devices_per_worker: int = 1,
    ) -> None:
        # Every argument is checked here, before the storage is opened or anything written.
        from stagetree.executors.registry import check_executor
        from stagetree.scheduler.policies import make_policy

        check_identity(name, trainer, version)
        # Command-line overrides (``stagetree run --workers ... --checkpoints ...``) are
        # checked like the script's own values.
        workers = _OVERRIDES.get("workers", workers)
        storage = _OVERRIDES.get("storage", storage)
        executor = _OVERRIDES.get("executor", executor)
        checkpoint_dir = _OVERRIDES.get("checkpoint_dir", checkpoint_dir)
        _check_count("workers", workers, 1)
        _check_count("threads_per_worker", threads_per_worker, 1)
        _check_count("max_retries", max_retries, 0, optional=False)
        _check_count("devices_per_worker", devices_per_worker, 1, optional=False)
        self.devices_per_worker = devices_per_worker
        checkpoint_budget = parse_size(checkpoint_budget, "checkpoint_budget")
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, CheckpointStore):
            check_location(checkpoint_dir)  # scheme and package; reached at open
        check_executor(executor)
        make_policy(policy)
        if eval_every is None:
            eval_every = 0
        _check_count("eval_every", eval_every, 0)
        self.eval_every = eval_every
        if _OVERRIDES.get("executor") == "simulated":  # `stagetree simulate`
            fusion_names(trainer, fuse)  # still checked; the simulator plans it unfused
            self.fusible: frozenset[str] = frozenset()
        else:
            self.fusible = fusion_names(trainer, fuse, executor)
        self.max_fused = check_max_fused(max_fused)
        check_checkpoint_every(checkpoint_every)
        self.checkpoint_every = checkpoint_every
        self.weight = check_weight(weight)
        if not isinstance(storage, (str, BasePlanStorage)):
            raise ValueError(
                f"storage must be a URL (sqlite:///path.db, postgresql://..., memory://) "
                f"or an open plan storage, got {storage!r}"
            )
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
        # The storage is opened on first use, not here: a module that builds a Study
        # must stay inert when it is imported (workers never import it: they receive
        # the trainer class itself).
        self._engine_obj: Engine | None = None
        self._closed = False
        self._started = time.monotonic()
        self._slot: StudySlot | None = None  # the engine's record of this study
        self._horizon = 0  # steps the current tuner may train a trial to (0: unknown)

    @property
    def _engine(self) -> Engine:
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
        key = (url, "")  # one engine (one worker pool) per storage, whatever the trainer
        with _ENGINES_LOCK:
            engine = _ENGINES.get(key)
            if engine is None:
                engine = self._make_engine(*self._engine_args)
                engine.settings = self._settings()
                _ENGINES[key] = engine
            else:
                self._warn_shared(engine, url)
            engine.users += 1
        self._engine_key = key
        self._engine_obj = engine
        self._slot = engine.open_study(
            self.name, self.version, self.share, self.weight, self.trainer, url, self.fusible
        )

    def _settings(self) -> dict[str, Any]:
        """The arguments that belong to the engine (the first study's win)."""
        _, workers, _, _, executor, policy, retries, threads = self._engine_args
        return {
            "workers": workers,
            "executor": executor,
            "policy": policy,
            "max_retries": retries,
            "threads_per_worker": threads,
            "eval_every": self.eval_every,
            "max_fused": self.max_fused,
            "checkpoint_every": self.checkpoint_every,
            "devices_per_worker": self.devices_per_worker,
        }

    def _warn_shared(self, engine: Engine, url: str) -> None:
        """Say which of this study's arguments the shared engine does not follow."""
        first = engine.settings
        differ = [
            f"{k}={v!r} (it uses {first[k]!r})"
            for k, v in self._settings().items()
            if k in first and v != first[k]
        ]
        if differ:
            warnings.warn(
                f"study {self.name!r} joins the engine of storage {url} in this process "
                f"(one worker pool for every study there), whose settings come from the "
                f"first study: {', '.join(differ)} ignored",
                StagetreeWarning,
                stacklevel=4,
            )

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
        checkpoint_dir: str | os.PathLike[str] | CheckpointStore | None,
        checkpoint_budget: int | None,
        executor: Any,
        policy: str,
        max_retries: int,
        threads_per_worker: int | None,
    ) -> Engine:
        url = storage if isinstance(storage, str) else "memory://"
        temporary = False
        if isinstance(checkpoint_dir, CheckpointStore):
            store = checkpoint_dir
            if checkpoint_budget is not None:
                store.budget_bytes = checkpoint_budget
        else:
            if checkpoint_dir is None:
                checkpoint_dir, temporary = default_checkpoint_dir(url)
            store = CheckpointStore(checkpoint_dir, budget_bytes=checkpoint_budget)
        store.check()  # an unreachable bucket fails here, before the plan is opened
        plan = open_storage(storage) if isinstance(storage, str) else storage
        trainer = self.trainer

        def factory() -> BaseExecutor:
            from stagetree.executors.base import ExecutorOptions
            from stagetree.executors.registry import make_executor

            options = ExecutorOptions(
                trainer,
                workers,
                store,
                threads_per_worker,
                store,
                _OVERRIDES.get("address"),
                devices_per_worker=self.devices_per_worker,
            )
            return make_executor(executor, options)

        engine = Engine(
            plan,
            store,
            factory,
            policy,
            max_retries,
            checkpoint_budget,
            self.eval_every,
            self.max_fused,
            self.checkpoint_every,
        )
        engine.temporary_checkpoints = temporary
        engine.default_trainer = trainer
        return engine

    # -- context manager -----------------------------------------------------------------

    def __enter__(self) -> Study:
        return self  # the storage opens on first use (``tune`` records its metric first)

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

    def _reopened(self) -> Study:
        """A new Study with this one's arguments and version (``stagetree run`` uses it
        when a script without a main guard tuned and closed its study itself)."""
        storage, workers, ckdir, budget, executor, policy, retries, threads = self._engine_args
        return Study(
            self.name,
            self.trainer,
            storage=storage,
            workers=workers,
            share=self.share,
            checkpoint_dir=ckdir,
            checkpoint_budget=budget,
            version=self.version,
            executor=executor,
            policy=policy,
            max_retries=retries,
            threads_per_worker=threads,
            eval_every=self.eval_every,
            fuse=bool(self.fusible),
            max_fused=self.max_fused,
            checkpoint_every=self.checkpoint_every,
            devices_per_worker=self.devices_per_worker,
        )

    # -- trials --------------------------------------------------------------------------

    def root_key(self, config: Mapping[str, Any], hp: Mapping[str, Sequence] | None = None) -> str:
        """The plan tree of a trial: trainer version + fixed config (+ the trial's own
        sequences when ``share=False``, so that nothing is shared)."""
        if not self.share and hp is None:
            raise ValueError("root_key of a study with share=False needs the trial's hp")
        return StudySlot(self.name, self.version, self.share, fusible=self.fusible).root_key(
            config, hp or {}
        )

    @property
    def _study_slot(self) -> StudySlot:
        _ = self._engine
        assert self._slot is not None
        return self._slot

    def _normalise(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int, define: bool = True
    ) -> tuple[dict[str, Any], dict[str, Sequence]]:
        """Checked copies of a trial's config and sequences; ``define``: the first trial
        sets the study's names (queries, ``eval``/``state``, never do)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InvalidTrialError(f"steps must be a non-negative int, got {steps!r}")
        if not isinstance(config, Mapping) or not isinstance(hp, Mapping):
            raise InvalidTrialError("config and hp must be mappings")
        seqs = {str(k): as_sequence(v) for k, v in hp.items()}
        cfg = dict(config)
        try:  # strict: a NaN, or an object written through its repr, has no stable identity
            json.dumps(cfg, allow_nan=False)
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
        """Train the trial ``(config, hp)`` to ``steps`` steps and return its result.

        A trial that reached fewer steps before resumes from there; one whose metrics at
        ``steps`` are known (from this or an earlier run) answers without training. May
        be awaited from any event loop.

        Raises:
            InvalidTrialError: bad steps, or names that differ from the study's trials.
            TrialFailedError: the trainer raised in a stage this trial needs.
            TrialCancelledError: the study was closed or the request cancelled.
        """
        if self._closed:
            raise StagetreeError(f"study {self.name!r} is closed")
        cfg, seqs = self._normalise(config, hp, steps)
        engine = self._engine
        waiter = engine.submit(self._study_slot, cfg, seqs, steps, self._horizon)
        try:
            metrics = await asyncio.wrap_future(waiter.future)
        except asyncio.CancelledError:
            engine.cancel(waiter)
            raise
        history = engine.history(self._study_slot, cfg, seqs, steps)
        # What the plan holds at ``steps``: train() metrics of that step too.
        metrics = {**history.get(steps, {}), **metrics}
        return TrialResult(config=cfg, hp=seqs, steps=steps, metrics=metrics, history=history)

    def declare(self, trials: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
        """Announce trials ``(config, hp)`` that will be submitted later (tuners that draw
        their configurations up front do this): their paths go into the plan up to the
        tuner's horizon, without requests, so that running batches checkpoint where they
        will branch off and nothing is recomputed when they arrive.

        Raises:
            InvalidTrialError: a trial with names the trainer does not apply.
        """
        trials = list(trials)
        for _config, hp in trials:
            check_hp_names(self.trainer, hp)
        if not self._horizon:
            return  # no horizon known: submissions insert all there is to know
        checked = [self._normalise(config, hp, self._horizon) for config, hp in trials]
        self._engine.declare(self._study_slot, checked, self._horizon)

    def run(self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int) -> TrialResult:
        """Synchronous :meth:`submit` for one trial."""
        return self._drive(self.submit(config, hp, steps))

    def eval(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, float] | None:
        """Known metrics of the trial after ``step`` steps, without training; else None.

        Raises:
            InvalidTrialError: names the trainer or the study's trials do not have.
        """
        cfg, seqs = self._normalise(config, hp, step, define=False)
        return self._engine.known(self._study_slot, cfg, seqs, step)[0]

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
        cfg, seqs = self._normalise(config, hp, step, define=False)
        ref = self._engine.known(self._study_slot, cfg, seqs, step)[1]
        return None if ref is None else self._engine.store.load(ref)

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
                study's run record in the storage.
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
        """
        limits = None if budget is None else Budget.parse(budget)
        if progress is not None and not isinstance(progress, bool):
            raise ValueError(f"progress must be True, False or None, got {progress!r}")
        check_space_names(self.trainer, getattr(tuner, "space", None))
        runner = _StudyRunner(self)
        self.begin_tuning(tuner.metric, tuner.mode, type(tuner).__name__, tuner.horizon)
        guard: BudgetGuard | None = None
        try:
            self._ensure_started()
            spent = self._device_seconds()
            virtual = self._virtual_time()
            show = progress if progress is not None else (_stderr_is_tty() and not virtual)
            display: Any = contextlib.nullcontext()
            if show and not virtual:
                from stagetree.progress import ProgressDisplay

                display = ProgressDisplay(self, out=sys.stderr)

            async def guarded() -> TrialResult | None:
                nonlocal guard
                guard = BudgetGuard(limits, self.progress, self._run_clock(), self._answered)
                runner.guard = guard
                return await guard.run(tuner, runner)

            with display:
                best = self._drive(guarded())
            if guard is not None:
                # The run's device-seconds as the study's totals count them (what was
                # trained for this study), so that the report's two rows agree.
                used = max(self._device_seconds() - spent, 0.0)
                self.last_run = dataclasses.replace(guard.report(), device_seconds=used)
                self._record_run(self.last_run)
        finally:
            self.end_tuning()
        if best is None:
            self._raise_if_all_failed()
        return best

    def _device_seconds(self) -> float:
        """Device-seconds trained for this study so far (``stats()``'s figure)."""
        if self._local_engine() is None:
            return float(self.stats().get("device_seconds", 0.0))
        with self._engine.reading() as storage:
            return reports.study_accounting(storage, self.name, self.version)["device_seconds"]

    def _local_engine(self) -> Engine | None:
        """The engine in this process; None for a client of a tuning server."""
        try:
            return self._engine
        except StagetreeError:
            return None

    def _ensure_started(self) -> None:
        engine = self._local_engine()
        if engine is not None:
            engine.ensure_started()

    def _virtual_time(self) -> bool:
        engine = self._local_engine()
        executor = engine.executor if engine is not None else None
        return executor is not None and executor.clock.virtual

    def _run_clock(self) -> Clock:
        """The clock of a run's wall-seconds budget: virtual time when simulated."""
        engine = self._local_engine()
        executor = engine.executor if engine is not None else None
        return executor.clock if executor is not None else WALL_CLOCK

    def _answered(self, config: Any, hp: Any, steps: int) -> bool:
        """Whether the storage holds the trial's metrics at ``steps`` (no training)."""
        try:
            return self.eval(config, hp, steps) is not None
        except StagetreeError:  # a trial the study refuses fails at submit, not here
            return False

    def _record_run(self, run: RunReport) -> None:
        """Say what stopped the run: a log line, and the study's run record."""
        if run.stopped_by is None or run.budget is None:
            return
        logger.warning(
            "study %s: %s; run it again with a larger budget to go on from here",
            self.name,
            run.summary(),
        )
        engine = self._local_engine()
        if engine is not None:
            engine.record_run(
                self._study_slot, {"budget": run.budget.describe(), "stopped_by": run.stopped_by}
            )

    # -- front ends (tune(), and the server for its remote clients) ------------------------

    def begin_tuning(self, metric: str, mode: str, tuner: str, horizon: int = 0) -> None:
        """Start a tuner's run: take the study's tuning lease (one tuner per study at a
        time, across processes), record the tuner's metric and mode with the next write,
        and plan trials up to ``horizon`` steps (0: unknown). :meth:`tune` calls it;
        front ends that run the tuner elsewhere (the server, for a remote client) too.

        Raises:
            StudyBusyError: another process is tuning this study.
        """
        engine = self._engine
        meta = {"metric": metric, "mode": mode, "tuner": tuner}
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
        """End the run :meth:`begin_tuning` started: release the tuning lease."""
        self._horizon = 0
        self._engine.end_tuning(self._study_slot)

    def check(self, config: Mapping[str, Any], hp: Mapping[str, Any]) -> None:
        """Refuse a trial that does not fit the study (names, values), writing nothing.

        Raises:
            InvalidTrialError: names or values that differ from the study's trials.
        """
        self._normalise(config, hp, 0)

    def read_log(self) -> list[dict[str, Any]]:
        """The tuner decisions logged by this study's latest run, when that run used
        this trainer version (decisions on another version's results are not replayed)."""
        return self._engine.read_log(self._study_slot)

    def append_log(self, record: Mapping[str, Any]) -> None:
        """Append one JSON-serialisable tuner decision to the study's log (durably)."""
        self._engine.append_log(self._study_slot, record)

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

    def _drive(self, coro: Any) -> Any:
        """Run ``coro`` to completion from sync code; with a virtual-time executor, its
        event loop also delivers the executor's instants (no driver thread runs)."""
        engine = self._engine
        try:
            engine.ensure_started()
        except BaseException:
            coro.close()  # never started: no "never awaited" warning
            raise
        if engine.executor is None or not engine.executor.clock.virtual:
            return _run_coro(coro)
        from stagetree.executors.simulated import drive

        def pump(timeout: float) -> int:
            try:
                return engine.pump(timeout)
            except BaseException as exc:  # the engine is unusable now, as after a thread error
                engine.error = exc
                raise

        return _run_coro(drive(coro, pump, engine.executor))

    def worker_locations(self) -> dict[int, str]:
        """Where each worker runs (``worker -> "host (node id)"``) with a cluster
        executor once it started; empty when every worker runs on this machine."""
        executor = self._engine.executor
        return executor.worker_locations() if executor is not None else {}

    @property
    def num_workers(self) -> int:
        self._engine.ensure_started()
        return self._engine.num_workers

    # -- reports (stagetree.reports: one definition each, shared with the commands) ---------

    @contextlib.contextmanager
    def reading(self) -> Iterator[BasePlanStorage]:
        """The plan storage for read-only queries (:mod:`stagetree.reports`,
        :mod:`stagetree.views`), with the engine's lock held: the engine waits while it
        is held, so keep each read short and never write."""
        with self._engine.reading() as storage:
            yield storage

    def trials(self) -> list[TrialRecord]:
        """Every trial of this study trained by this version of the trainer (trials of
        other versions are kept in the storage but never mixed in) with its metrics by
        step."""
        with self._engine.reading() as storage:
            return reports.trial_records(storage, self.name, self.version)

    def failures(self) -> list[tuple[int, TrialError]]:
        """``(trial id, error)`` of every failed trial of this study (of this trainer
        version), in id order (cheap: reads no metrics; progress displays poll it)."""
        with self._engine.reading() as storage:
            return reports.failures(storage, self.name, self.version)

    def best(self, metric: str, mode: str = "max") -> TrialRecord | None:
        """The best trial by ``metric`` (``mode`` ``"max"`` or ``"min"``), by the rule
        that :meth:`tune`'s result and ``stagetree status`` follow too
        (:func:`stagetree.reports.best_trial`): trials are compared at the largest step
        at which any trial has a finite value of ``metric`` at its final step (a trial
        stopped early never beats one trained further, however good its early metric),
        then by that value; ties go to the lowest trial id; NaN and infinite values are
        never best. None when no trial has a finite value at its final step.

        Raises:
            ValueError: ``mode`` is not ``"max"`` or ``"min"``.
        """
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        return reports.best_trial(self.trials(), metric, mode)

    def trials_dataframe(self, history: bool = False) -> Any:
        """This study's trials (of this trainer version) as a :class:`pandas.DataFrame`
        (extra ``pandas``), one row per trial: ``config.<name>``, ``hp.<name>`` (the
        sequence in readable form) and ``hp.<name>.last`` (its value at the last step),
        ``metric.<name>`` (final metrics, at step ``metrics_at``), ``state``, ``steps``,
        ``error``, ``lineage``; with ``history``, every recorded metric in long form
        (``study, trial, step, metric, value``). :func:`stagetree.export.trials_table`
        has the exact columns; ``stagetree export`` writes the same table.

        Raises:
            MissingExtraError: pandas is not installed.
        """
        from stagetree import export

        export.require("pandas", "pandas", "a DataFrame of trials")
        with self._engine.reading() as storage:
            table = export.trials_table(
                storage, self.name, history=history, version=self.version, missing_ok=True
            )
        return export.dataframe(table)

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

    def stats(self) -> dict[str, float]:
        """Accounting: ``steps_requested`` (total steps of this study's trials),
        ``steps_unique`` (steps of the union of their paths), ``steps_executed`` and
        ``device_seconds`` (trained for this study's requests, over every run on this
        storage: a step two studies needed counts for both, a step another study had
        trained before costs this one nothing), ``merge_rate``, storage-wide checkpoint
        seconds/bytes and live-split counts, and lost workers on this study's trees:
        ``workers_lost``, and ``steps_lost``: steps a lost worker had trained past its
        last durable checkpoint, which are trained again (they count in
        ``steps_executed`` both times). See :func:`stagetree.reports.study_accounting`;
        ``stagetree status`` shows the same numbers.

        And the efficiency of the study's latest run (:meth:`tune`) of this trainer
        version, with where its wall-clock went (:func:`stagetree.reports.efficiency`:
        ``efficiency``, ``wall_seconds``, ``limit_seconds``, ``startup_seconds``,
        ``ckpt_load_wait_seconds``, ``ckpt_save_wait_seconds``, ``idle_seconds``,
        ``scheduling_seconds``, ``workers``, ``steps_unique_trained``,
        ``seconds_per_step``); measured until now while the run goes on. Absent when
        no run was recorded (trials submitted without a tuner, a storage written before
        runs were recorded) or the run trained nothing."""
        engine = self._engine
        engine.settle()
        workers = engine.num_workers if engine.executor is not None else None
        with engine.reading() as storage:
            out = reports.study_accounting(storage, self.name, self.version)
            out.update(
                reports.efficiency(
                    storage, self.name, self.version, now=engine.clock(), workers=workers
                )
            )
            return out

    def progress(self) -> dict[str, float]:
        """A cheap snapshot for progress displays: ``trials`` (submitted),
        ``finished``, ``running``, ``failed``, ``steps_requested`` (total steps of the
        submitted trials), ``steps_executed`` (by the engine so far), ``device_seconds``,
        ``elapsed`` (seconds since this Study object was made)."""
        with self._engine.reading() as storage:  # the engine's lock is held
            out = reports.progress(storage, self.name, self.version)
            out["steps_executed"] += self._engine.running_steps()
        out["elapsed"] = time.monotonic() - self._started
        return out


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
        url = _OVERRIDES.get("url") or os.environ.get("STAGETREE_URL") or ""
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


def _check_count(name: str, value: Any, least: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: Any, name: str = "size") -> int | None:
    """Bytes from an int or a size string (``"10MB"``, ``"1.5 GiB"``, ``"512"``); None
    stays None.

    Raises:
        ValueError: a negative size, or a value that is not a size (naming ``name``).
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number: float = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name} must be a number of bytes or a size like '10MB' or '2GiB', got {value!r}"
            )
        number = float(match.group(1)) * _UNITS[unit]
    else:
        raise ValueError(f"{name} must be an int or a size like '10MB', got {value!r}")
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return int(number)


class _StudyRunner:
    """The :class:`~stagetree.tuners.base.TrialRunner` a study gives its tuners: its
    public methods, so a remote study's tuner runs unchanged over HTTP."""

    def __init__(self, study: Study) -> None:
        self.study = study
        self.guard: BudgetGuard | None = None  # tune() sets it before the tuner runs

    async def submit(
        self, config: dict[str, Any], hp: dict[str, Sequence], steps: int
    ) -> TrialResult:
        if self.guard is None:
            return await self.study.submit(config, hp, steps)
        from stagetree.tuners.base import Trial

        fingerprint = Trial(0, config, hp).fingerprint

        async def call() -> TrialResult:
            return await self.study.submit(config, hp, steps)

        result: TrialResult = await self.guard.submit(fingerprint, call, config, hp, steps)
        return result

    def num_workers(self) -> int:
        return self.study.num_workers

    def shares_work(self) -> bool:
        return bool(self.study.share)

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Sequence]]]) -> None:
        self.study.declare(trials)

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
        from stagetree.plan.sql import SQLPlanStorage

        try:
            plan = self.study._engine.storage
        except StagetreeError:  # a remote study: its plan is on the server, out of reach
            return None, self.study, self.study.name, str(getattr(self.study, "version", ""))
        arg = self.study._engine_args[0]
        url: str | None = None
        if isinstance(plan, SQLPlanStorage):
            url = arg if isinstance(arg, str) else plan._engine.url.render_as_string(False)
            if url.split(":", 1)[0] in ("postgresql", "postgres"):
                url = "postgresql+psycopg:" + url.split(":", 1)[1]
        return url, plan, self.study.name, self.study.version


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def _run_coro(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also inside a running event loop
    (e.g. Jupyter), by using a helper thread there."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
