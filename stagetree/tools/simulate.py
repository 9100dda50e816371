"""Simulate whole studies in virtual time: what sharing saves, before training anything.

:func:`simulate` runs a tuner against a :class:`~stagetree.Study` whose executor is a
:class:`~stagetree.executors.simulated.SimulatedExecutor`: the real plan, stage-tree
builder, scheduler and tuner take every decision; only training is replaced by a
step-cost model (:class:`StepCost`) and a synthetic learning curve
(:class:`LearningCurve`). It reports the makespan, device-hours and step counts, and
a lower bound on the makespan::

    lower bound = max(longest path, unique work / workers)

where *longest path* is the training time of the longest trial (no schedule can beat
training one trial's steps in sequence) and *unique work* the training time of the
union of the trials' paths (what sharing leaves to train). With ``share=False`` every
trial trains alone (the trial-based baseline), so unique work is all the work.

Device needs: workers may differ (``devices_per_worker=[1, 1, 2, 4]``), a trainer may
declare what a trial needs (``devices_needed``), and ``memory_devices`` says what a
trial really needs: fewer devices run out of memory, and the scheduler learns the need
as it would from a real CUDA out-of-memory error.

Workers with several devices (``devices_per_worker=k``) train every batch
data-parallel over their ``k`` devices: a step takes ``step_cost / (1 + (k - 1) * e)``
seconds for a parallel efficiency ``e``, and device-hours count each busy worker ``k``
times. Training seconds (longest path, unique work, the lower bound) are then seconds
on one such worker.

Several tuners at once (``simulate(None, [t1, t2, ...])``) run as several studies on
one storage and one pool of workers: they share stages with each other, as studies of
one model on one storage do.

``stagetree simulate SCRIPT.py --workers 40`` loads a script's ``study`` and
``tuner`` and prints the estimate with and without sharing (:func:`simulate_script`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, TextIO

from stagetree.engine.settings import Overrides, overriding
from stagetree.exceptions import CommandError
from stagetree.executors.devices import check_parallel_efficiency, check_worker_devices
from stagetree.executors.simulated import (
    LearningCurve,
    SimulatedExecutor,
    SimulatedTrainer,
    StepCost,
    drive,
)
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.stages import Work, build_stage_tree, work
from stagetree.study import Study, trainer_fingerprint
from stagetree.study_api import StudyRunner, run_coro
from stagetree.tools.scripts import loaded_script, pick, values_of
from stagetree.trainer import Trainer
from stagetree.tuners.base import TrialResult, Tuner

#: The ``__name__`` a script loaded for simulation runs under.
RUN_NAME = "__stagetree_simulate__"

__all__ = [
    "LearningCurve",
    "SimResult",
    "SimulatedExecutor",
    "SimulatedTrainer",
    "StepCost",
    "Work",
    "format_table",
    "load_script",
    "simulate",
    "simulate_script",
    "work",
]


@dataclass(frozen=True)
class SimResult:
    """What a simulated study cost.

    Attributes:
        makespan: virtual seconds from the start until the tuner(s) returned.
        device_hours: busy hours of all devices: each worker's busy hours (loads,
            training, evaluations and background saves until each batch ended) times
            its ``devices_per_worker``.
        steps_executed: training steps the workers ran.
        steps_requested: total steps of the trials (each trained alone from 0).
        steps_unique: steps of the union of the trials' paths.
        merge_rate: ``steps_requested / steps_unique`` (over every study with several).
        best: the tuner's best result (of the first tuner with several).
        bests: the best result of each tuner.
        longest_path: seconds of training of the longest trial (on one worker, its
            ``devices_per_worker`` devices data-parallel, as every training second here).
        unique_work: seconds of training of the unique steps (all steps without
            sharing).
        requested_work: seconds of training of every trial alone from step 0.
        lower_bound: ``max(longest_path, unique_work / workers)``.
        end: virtual time the last batch ended (cancelled work and saves included).
        workers, share, trials: the set-up; ``trials`` counts every study's trials.
        stats: executor and engine counters (``ckpt_loads``, ``ckpt_saves``,
            ``live_splits``, ``splits_missed``, ``batches``).
        devices_per_worker: devices each worker owns (a batch trains on all of them;
            the largest worker's in a mixed cluster).
        parallel_efficiency: the data-parallel efficiency ``e`` of those devices.
        worker_devices: the devices of each worker.
    """

    makespan: float
    device_hours: float
    steps_executed: int
    steps_requested: int
    steps_unique: int
    merge_rate: float
    best: TrialResult | None
    bests: tuple[TrialResult | None, ...] = ()
    longest_path: float = 0.0
    unique_work: float = 0.0
    requested_work: float = 0.0
    lower_bound: float = 0.0
    end: float = 0.0
    workers: int = 1
    share: bool = True
    trials: int = 0
    stats: Mapping[str, float] = field(default_factory=dict)
    devices_per_worker: int = 1
    parallel_efficiency: float = 1.0
    worker_devices: tuple[int, ...] = ()

    @property
    def devices(self) -> int:
        """The devices of the simulated cluster (``workers * devices_per_worker`` when
        every worker has as many)."""
        return sum(self.worker_devices) or self.workers * self.devices_per_worker

    @property
    def makespan_hours(self) -> float:
        """:attr:`makespan` in hours."""
        return self.makespan / 3600.0

    @property
    def work_merge_rate(self) -> float:
        """``requested_work / unique_work``: the merge rate weighted by step costs,
        the device-hours saving that sharing allows at best."""
        return self.requested_work / self.unique_work if self.unique_work > 0 else 1.0

    @property
    def bound_ratio(self) -> float:
        """``makespan / lower_bound`` (1.0 is optimal)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else math.inf


# --------------------------------------------------------------------------- bounds


# --------------------------------------------------------------------------- simulate


def _curve_for(tuners: Seq[Tuner], curve: LearningCurve | None) -> LearningCurve:
    """The default curve, reporting every tuner's metric (as accuracy or loss)."""
    if curve is not None:
        return curve
    aliases = {
        t.metric: ("accuracy" if t.mode == "max" else "loss")
        for t in tuners
        if t.metric not in ("accuracy", "loss")
    }
    return LearningCurve(aliases=aliases)


@contextlib.contextmanager
def _no_overrides() -> Iterator[None]:
    """Command-line overrides (``stagetree run --storage``) must not redirect the
    simulated studies to a real storage."""
    with overriding(Overrides()):
        yield


def simulate(
    source: Any = None,
    tuner: Tuner | Callable[[Any], Tuner] | Seq[Tuner] | None = None,
    workers: int = 40,
    share: bool = True,
    *,
    policy: str = "critical_path",
    step_cost: Callable[[Mapping[str, Any], Mapping[str, Any]], float] | None = None,
    curve: LearningCurve | None = None,
    trainer: type[Trainer] | None = None,
    version: str | None = None,
    name: str = "simulated",
    devices_per_worker: int | Seq[int] = 1,
    parallel_efficiency: float = 1.0,
    watch: Callable[[SimulatedExecutor], None] | None = None,
    **executor_options: Any,
) -> SimResult:
    """Run ``tuner`` against a simulated study and report what it cost.

    Args:
        source: a script path (``str`` or ``PathLike`` ending in ``.py``) defining
            ``study`` and ``tuner`` (see :func:`load_script`), a search space, or None.
        tuner: a :class:`~stagetree.tuners.base.Tuner`; a callable ``space -> Tuner``
            (called with ``source`` when it is a space); a list of tuners to run as
            several studies on one storage and worker pool; None with a script.
        workers: simulated workers.
        share: False trains every trial alone (the trial-based baseline; promotions
            still resume a trial from its checkpoint). With several tuners, nothing
            is shared between their studies either.
        policy: scheduling policy (``critical_path``, ``bfs``, ``thr``).
        step_cost: seconds per step, ``(config, values) -> float`` (default
            :class:`StepCost`).
        curve: learning-curve model (default :class:`LearningCurve` reporting each
            tuner's metric).
        trainer: the trainer class, for the plan's root keys (default
            :class:`SimulatedTrainer`; a script's study's trainer).
        version: the trainer version in the root keys (default: the trainer's
            fingerprint).
        name: study name (``name``, ``name-1``, ... with several tuners).
        devices_per_worker: devices per worker; every batch trains data-parallel on
            all of a worker's devices (``workers`` workers own ``workers *
            devices_per_worker`` devices); a list gives each worker its own count
            (a mixed cluster of ``len(devices_per_worker)`` workers). A trial's
            stages go only to workers with the devices its trainer declares
            (``devices_needed``) or the scheduler learned.
        parallel_efficiency: ``e`` in (0, 1]: a step on ``k`` devices takes
            ``step_cost / (1 + (k - 1) * e)`` seconds.
        watch: called with the :class:`SimulatedExecutor` before the run, so that a
            caller can read its virtual clock and device-seconds as results arrive
            (anytime curves: best value against device-seconds).
        **executor_options: more :class:`SimulatedExecutor` options
            (``checkpoint_bytes``, ``save_latency``, ``eval_seconds``,
            ``memory_devices``: the devices a trial needs to fit in memory, learned
            from simulated out-of-memory errors, ...).

    Returns:
        The :class:`SimResult`.

    Raises:
        StagetreeError: a script without a tuner, or a simulation that stalls.
        ValueError: bad arguments.
    """
    tuners: list[Tuner]
    if isinstance(source, (str, os.PathLike)) and str(source).endswith(".py"):
        loaded = load_script(source)
        if tuner is None:
            tuner = loaded.tuner
        trainer = trainer or loaded.trainer
        version = version if version is not None else loaded.version
        name = loaded.name
    if tuner is None:
        raise ValueError("simulate needs a tuner (or a script that defines one)")
    if isinstance(tuner, Tuner):
        tuners = [tuner]
    elif isinstance(tuner, Seq) and not isinstance(tuner, str):
        tuners = list(tuner)
        if not tuners or not all(isinstance(t, Tuner) for t in tuners):
            raise ValueError("tuner must be a Tuner, a list of Tuners or a factory")
    elif callable(tuner):
        made = tuner(source)
        if not isinstance(made, Tuner):
            raise ValueError(f"the tuner factory returned {made!r}, not a Tuner")
        tuners = [made]
    else:
        raise ValueError(f"tuner must be a Tuner, a list of Tuners or a factory, got {tuner!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    trainer = trainer or SimulatedTrainer
    cost = step_cost if step_cost is not None else StepCost()
    if isinstance(devices_per_worker, Seq):
        workers = len(devices_per_worker)  # a mixed cluster: one worker per entry
    executor = SimulatedExecutor(
        workers,
        step_cost=cost,
        curve=_curve_for(tuners, curve),
        devices_per_worker=devices_per_worker,
        parallel_efficiency=parallel_efficiency,
        **executor_options,
    )
    if watch is not None:
        watch(executor)
    return _run(tuners, executor, trainer, version, name, share, policy, cost)


def _run(
    tuners: list[Tuner],
    executor: SimulatedExecutor,
    trainer: type[Trainer],
    version: str | None,
    name: str,
    share: bool,
    policy: str,
    cost: Callable[[Mapping[str, Any], Mapping[str, Any]], float],
) -> SimResult:
    base_version = version if version is not None else trainer_fingerprint(trainer)
    storage = MemoryPlanStorage()
    names = [name] if len(tuners) == 1 else [f"{name}-{i}" for i in range(len(tuners))]
    studies: list[Study] = []

    def factory() -> SimulatedExecutor:  # one factory: the studies share one engine
        return executor

    with tempfile.TemporaryDirectory(prefix="stagetree-sim-") as ckdir, _no_overrides():
        try:
            for study_name in names:
                studies.append(
                    Study(
                        study_name,
                        trainer,
                        storage=storage,
                        workers=executor.num_workers,
                        share=share,
                        checkpoint_dir=ckdir,
                        # Trial-based baseline: no sharing across studies either.
                        version=base_version if share else f"{base_version}|{study_name}",
                        executor=factory,
                        policy=policy,
                    )
                )
            if len(studies) == 1:
                bests: list[TrialResult | None] = [studies[0].tune(tuners[0])]
            else:
                # Several tuners on one loop: what Study.tune does for one, for each.
                for t, st in zip(tuners, studies):
                    st.begin_tuning(t.metric, t.mode, type(t).__name__, t.horizon)
                engine = studies[0]._engine
                engine.ensure_started()

                async def main() -> list[TrialResult | None]:
                    runs = [t.run(StudyRunner(s)) for t, s in zip(tuners, studies)]
                    return list(await asyncio.gather(*runs))

                bests = run_coro(drive(main(), engine.pump, executor))
            return _account(studies, storage, executor, bests, share, cost)
        finally:
            for st in studies:
                st.close()


def _account(
    studies: Seq[Any],
    storage: MemoryPlanStorage,
    executor: SimulatedExecutor,
    bests: Seq[TrialResult | None],
    share: bool,
    cost: Callable[[Mapping[str, Any], Mapping[str, Any]], float],
) -> SimResult:
    trials = [t for st in studies for t in storage.trials(st.name)]
    ends = [(int(t["node"]), int(t["step"])) for t in trials if t["node"] is not None]
    nodes = {n.id: n for n in storage.nodes()}
    roots = {key: storage.root_config(key) for key in {n.root_key for n in nodes.values()}}
    speedup = executor.speedup

    def worker_cost(config: Mapping[str, Any], values: Mapping[str, Any]) -> float:
        return cost(config, values) / speedup  # a step on one worker's devices

    bounds = work(nodes, roots, ends, worker_cost, executor.num_workers)
    unique = build_stage_tree(nodes, list(dict.fromkeys(ends))).total_steps
    requested = sum(int(t["steps"]) for t in trials)
    engine = storage.stats("engine")
    done_at = executor.done_at if executor.done_at is not None else executor.now
    return SimResult(
        makespan=done_at,
        device_hours=executor.device_seconds / 3600.0,
        steps_executed=executor.steps_trained,
        steps_requested=requested,
        steps_unique=unique,
        merge_rate=requested / unique if unique else 1.0,
        best=bests[0] if bests else None,
        bests=tuple(bests),
        longest_path=bounds.longest_path,
        unique_work=bounds.unique_work,
        requested_work=bounds.requested_work,
        lower_bound=bounds.lower_bound,
        end=executor.now,
        workers=executor.num_workers,
        share=share,
        trials=len(trials),
        stats={
            "batches": float(executor.batches),
            "ckpt_loads": float(executor.loads),
            "ckpt_saves": float(executor.saves),
            "live_splits": engine.get("live_splits", 0.0),
            "splits_missed": float(executor.splits_missed),
        },
        devices_per_worker=max(executor.worker_devices),
        parallel_efficiency=executor.parallel_efficiency,
        worker_devices=tuple(executor.worker_devices),
    )


# --------------------------------------------------------------------------- scripts


@dataclass
class LoadedScript:
    """What :func:`load_script` found: the tuner, the study's trainer, version, name and
    devices per worker."""

    tuner: Tuner
    trainer: type[Trainer]
    version: str
    name: str
    devices_per_worker: int | tuple[int, ...] = 1


def load_script(path: str | os.PathLike[str]) -> LoadedScript:
    """Run a study script (the ``stagetree run`` convention: module globals ``study`` and
    ``tuner``) without running its study: every ``Study`` it builds gets a throw-away
    in-memory storage and a simulated executor, so no worker is started and nothing is
    trained, also when a script without a main guard tunes its study.

    The script is loaded by :func:`stagetree.tools.scripts.loaded_script`, as module
    ``__stagetree_simulate__`` (its ``if __name__ == "__main__":`` block does not run).

    Raises:
        CommandError: no such file, an error in it, or it defines no study or no tuner.
    """
    namespace: dict[str, Any] = {}
    # A script without a main guard tunes its study while it loads: in virtual time.
    with overriding(storage="memory://", executor="simulated"):
        try:
            with loaded_script(path, run_name=RUN_NAME) as namespace:
                study = pick(namespace, "study", Study, "study", str(path))
                tuner = pick(namespace, "tuner", Tuner, "tuner", str(path))
                devices = getattr(study, "devices_per_worker", 1)
                return LoadedScript(tuner, study.trainer, study.version, study.name, devices)
        finally:
            for value in values_of(namespace, Study):
                with contextlib.suppress(Exception):
                    value.close()


def format_table(headers: Seq[str], rows: Seq[Seq[Any]]) -> str:
    """A markdown table; floats are printed with 3 significant decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def simulate_script(
    script: str | os.PathLike[str],
    workers: int | None = None,
    *,
    policy: str = "critical_path",
    step_seconds: float = 1.0,
    out: TextIO | None = None,
    devices_per_worker: int | Seq[int] | None = None,
    parallel_efficiency: float = 1.0,
) -> tuple[SimResult, SimResult]:
    """``stagetree simulate``: estimate a script's study with and without sharing and
    print both rows (device-hours, makespan, steps, merge rate) and the savings.

    Every step costs ``step_seconds`` at batch size 128 (:class:`StepCost`) on one
    device; with ``devices_per_worker`` devices per worker it is divided by ``1 +
    (devices_per_worker - 1) * parallel_efficiency`` (see :func:`simulate`);
    ``devices_per_worker`` None takes the script's study's (``Study(devices_per_worker=)``).
    A list is a mixed cluster of one worker per entry; ``workers`` None is then its
    length, else 40.

    Returns:
        ``(shared, trial-based)`` results.

    Raises:
        CommandError: ``workers`` disagrees with a mixed cluster's length.
    """
    stream = sys.stdout if out is None else out
    if devices_per_worker is not None:
        workers = _cluster(workers, devices_per_worker)  # before loading the script
    check_parallel_efficiency(parallel_efficiency)
    loaded = load_script(script)
    if devices_per_worker is None:
        devices_per_worker = loaded.devices_per_worker
    workers = _cluster(workers, devices_per_worker)
    cost = StepCost(base_seconds=step_seconds)
    results = []
    for share in (True, False):
        results.append(
            simulate(
                None,
                loaded.tuner,
                workers,
                share,
                policy=policy,
                step_cost=cost,
                trainer=loaded.trainer,
                version=loaded.version,
                name=loaded.name,
                devices_per_worker=devices_per_worker,
                parallel_efficiency=parallel_efficiency,
            )
        )
    shared, alone = results
    rows = [
        [
            label,
            r.device_hours,
            r.makespan_hours,
            r.steps_executed,
            r.steps_requested,
            r.merge_rate if r.share else 1.0,
        ]
        for label, r in (("stage-based (shared)", shared), ("trial-based (no sharing)", alone))
    ]
    devices = ""
    detail = f"({shared.devices} devices, data-parallel efficiency {parallel_efficiency:g})"
    if isinstance(devices_per_worker, Seq):
        devices = f" of {', '.join(map(str, devices_per_worker))} devices {detail}"
    elif devices_per_worker > 1:
        devices = f" x {devices_per_worker} devices {detail}"
    print(
        f"simulated {script}: {shared.trials} trials on {workers} workers{devices}, "
        f"{step_seconds:g} s per step at batch size 128, policy {policy}",
        file=stream,
    )
    headers = ["execution", "device-hours", "makespan (h)", "steps executed", "steps requested",
               "merge rate"]  # fmt: skip
    print(format_table(headers, rows), file=stream)
    saving = alone.device_hours / shared.device_hours if shared.device_hours else math.inf
    speedup = alone.makespan / shared.makespan if shared.makespan else math.inf
    print(f"sharing saves {saving:.2f}x device-hours and {speedup:.2f}x makespan", file=stream)
    return shared, alone


def _cluster(workers: int | None, devices_per_worker: int | Seq[int]) -> int:
    """The simulated workers: one per entry of a mixed cluster's list (``workers``, when
    given, must agree), else ``workers`` (40 when None).

    Raises:
        ValueError: ``devices_per_worker`` is neither an int >= 1 nor a list of them.
        CommandError: ``workers`` disagrees with the list.
    """
    mixed = check_worker_devices(devices_per_worker)
    if mixed is None:
        return 40 if workers is None else workers
    if workers is not None and workers != len(mixed):
        raise CommandError(
            f"--workers {workers} disagrees with --devices-per-worker, a cluster of "
            f"{len(mixed)} workers ({','.join(map(str, mixed))}): give one of them, or "
            "make them agree"
        )
    return len(mixed)
