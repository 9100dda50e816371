"""What ``stagetree status`` prints: a study's status (:func:`study_status`) and a
storage's (:func:`storage_status`).

Pure functions of a :class:`~stagetree.plan.BasePlanStorage`, read-only (see
:mod:`stagetree.reports.trials`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagetree.engine.coordination import running_trials
from stagetree.identity import split_trials
from stagetree.plan.model import RequestState
from stagetree.records import RunRecord, StudyRow, TrialState
from stagetree.reports.costs import _study_accounting, accounting, efficiency
from stagetree.reports.lineage import study_lineage
from stagetree.reports.trials import (
    _failed,
    best_trial,
    final_records,
    final_value,
    quiet_gc,
    ranked_metric,
    records_of,
    study_record,
)
from stagetree.stages import total_steps, unique_steps

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage

__all__ = ["StorageStatus", "StudyStatus", "storage_status", "study_status"]


@dataclass
class StudyStatus:
    """One study of a storage, as ``stagetree status`` prints it.

    Attributes:
        name: the study.
        created: creation time (``time.time()``).
        trials, finished, running, failed: trial counts (``running``: trials a live
            engine holds a lease on, not rows an engine that died left ``running``).
        pending: trials neither finished, running, failed nor cancelled (waiting, or
            left ``running`` by an engine that died: they resume at the next run).
        cancelled: trials cancelled before they finished.
        metric: the metric ranked (None when no trial reported one).
        mode: ``"max"`` or ``"min"``.
        metric_note: where ``metric`` and ``mode`` come from.
        best: the best value of ``metric`` (:func:`best_trial`).
        best_trial: its trial id.
        best_step: the step it was reached at.
        steps_requested: total steps of its trials (each trained alone).
        steps_unique: steps of the union of their paths.
        numbers: :func:`accounting` of the study: its executed steps and device-seconds
            are what was trained for it (:func:`study_accounting`). None when the trials
            have metrics but neither the study nor its trees have counters (a storage
            written by a stagetree that counted only the whole storage).
        failures: ``(trial id, first line of its error)`` per failed trial.
        hidden: trials of other (older) trainer versions, not counted above.
        workers: where its workers ran, last seen (cluster executors): worker -> node.
        efficiency: :func:`efficiency` of its latest run (empty: none recorded).
        lineage: ``TrialRecord.lineage`` of each trial that a PBT exploit made, by id.
        budget_stop: ``(budget, limit reached)`` when its latest run was stopped by its
            budget (``Study.tune(budget=...)``), else None.
    """

    name: str
    created: float
    trials: int
    finished: int
    running: int
    failed: int
    metric: str | None
    mode: str
    metric_note: str
    best: float | None
    best_trial: int | None
    best_step: int | None
    steps_requested: int
    steps_unique: int
    numbers: dict[str, float] | None
    failures: list[tuple[int, str]] = field(default_factory=list)
    hidden: int = 0
    workers: dict[str, str] = field(default_factory=dict)
    pending: int = 0
    cancelled: int = 0
    efficiency: dict[str, float] = field(default_factory=dict)
    lineage: dict[int, list[dict[str, int]]] = field(default_factory=dict)
    budget_stop: tuple[str, str] | None = None


@dataclass
class StorageStatus:
    """What ``stagetree status`` prints: the studies and the storage-wide accounting.

    Attributes:
        url: the storage.
        studies: the studies shown.
        studies_total: studies in the storage.
        trials: trials of every study.
        totals: :func:`accounting` over every study of the storage (requested steps
            summed, unique steps of their union, executed steps and device-seconds of
            the storage's engines, which train a stage that several studies share once).
    """

    url: str
    studies: list[StudyStatus]
    studies_total: int
    trials: int
    totals: dict[str, float]


@quiet_gc
def study_status(
    storage: BasePlanStorage, name: str, rows: list[dict[str, Any]] | None = None
) -> StudyStatus:
    """The status of study ``name``: the trials of its latest run's trainer version.

    The metric is the one recorded in the study's meta (``meta["metric"]`` and
    ``meta["mode"]``) if any, else the first (alphabetically) metric with a finite value
    at some trial's final step, minimised when its name says loss or error. The best
    trial is :func:`best_trial`'s (the rule of ``Study.best`` and the tuners).

    Args:
        rows: the study's trial rows (:meth:`BasePlanStorage.trials`, every version),
            when the caller has read them.

    Raises:
        PlanKeyError: no study ``name`` in the storage.
    """
    record = StudyRow.from_row(study_record(storage, name))
    meta = record.meta
    rows = storage.trials(name, light=True) if rows is None else rows
    trials, hidden = split_trials(rows, meta)
    records = final_records(storage, trials)  # the final points are all the ranking reads
    metric, mode, note = ranked_metric(meta, records)
    best = best_trial(records, metric, mode) if metric is not None else None
    numbers, counted = _study_accounting(storage, trials, name)
    # Whether any trial has metrics: a final point says so; else (on a storage without
    # counters only, where it matters) look along the learning curves.
    trained = any(r.metrics for r in records) or (
        not counted and any(r.metrics for r in records_of(storage, trials))
    )
    states = [t["state"] for t in trials]
    running = len(running_trials(storage, trials))  # live leases, not stale rows
    finished, failed, cancelled = (
        states.count(s) for s in (TrialState.DONE, TrialState.FAILED, TrialState.CANCELLED)
    )
    return StudyStatus(
        name=name,
        created=record.created,
        trials=len(trials),
        finished=finished,
        running=running,
        failed=failed,
        pending=len(trials) - finished - running - failed - cancelled,
        cancelled=cancelled,
        metric=metric,
        mode=mode,
        metric_note=note,
        best=None if best is None or metric is None else float(final_value(best, metric)),
        best_trial=None if best is None else best.id,
        best_step=None if best is None else best.steps,
        steps_requested=round(numbers["steps_requested"]),
        steps_unique=round(numbers["steps_unique"]),
        numbers=(
            accounting(
                numbers["steps_requested"],
                numbers["steps_unique"],
                numbers["steps_executed"],
                numbers["device_seconds"],
                numbers["steps_requested_finished"],
            )
            if counted or not trained
            else None
        ),
        failures=[(tid, error.summary()) for tid, error in _failed(trials)],
        hidden=hidden,
        workers={str(k): str(v) for k, v in dict(meta.get("workers") or {}).items()},
        efficiency=efficiency(storage, name, rows=rows),
        lineage=_lineage_of(storage, name, trials),
        budget_stop=_budget_stop(meta),
    )


def _lineage_of(
    storage: BasePlanStorage, name: str, trials: list[dict[str, Any]]
) -> dict[int, list[dict[str, int]]]:
    return study_lineage(storage, name, trials) if trials else {}


def _budget_stop(meta: Mapping[str, Any]) -> tuple[str, str] | None:
    """What stopped the study's latest run, from its run record (``Study.tune``)."""
    run = RunRecord.from_meta(meta)
    if run is not None and run.stopped_by:
        return run.budget, run.stopped_by
    return None


@quiet_gc
def storage_status(storage: BasePlanStorage, url: str, study: str | None = None) -> StorageStatus:
    """The status of every study of ``storage`` (or of ``study``) and its totals.

    Raises:
        PlanKeyError: no study ``study`` in the storage.
    """
    names = [s["name"] for s in storage.studies()]
    shown = names if study is None else [study_record(storage, study)["name"]]
    rows = {name: storage.trials(name, light=True) for name in names}  # read once, for both
    trials, requested, unique, finished = _plan_totals(storage, rows)
    engine = storage.stats("engine")
    return StorageStatus(
        url=url,
        studies=[study_status(storage, n, rows[n]) for n in shown],
        studies_total=len(names),
        trials=trials,
        totals=accounting(
            requested,
            unique,
            engine.get("steps_executed", 0.0),
            engine.get("device_seconds", 0.0),
            finished,
        ),
    )


def _plan_totals(
    storage: BasePlanStorage, rows: Mapping[str, list[dict[str, Any]]]
) -> tuple[int, int, int, int]:
    """``(trials, steps requested, unique steps, steps requested by finished trials)``
    of every tree of the storage, as :func:`stagetree.stages.summarize` counts them,
    from the trial rows of every study (``rows``); without what ``summarize`` also
    reads for its pending steps."""
    keys = storage.root_keys()
    wanted = set(keys)
    nodes = {n.id: n for key in keys for n in storage.nodes(key)}
    trials = [t for found in rows.values() for t in found if t["root_key"] in wanted]
    if trials:
        count, requested = len(trials), sum(int(t["steps"]) for t in trials)
        finished = sum(int(t["steps"]) for t in trials if t["state"] == TrialState.DONE)
        ends = [(int(t["node"]), int(t["step"])) for t in trials if t["node"] is not None]
    else:  # a plan without trial records: each live or finished request is a trial
        live = [r for key in keys for r in storage.requests(key)]
        ends = [(r.node, r.step) for r in live if r.state != RequestState.CANCELLED]
        count, requested = len(ends), total_steps(ends)
        done = [(r.node, r.step) for r in live if r.state == RequestState.DONE]
        finished = total_steps(done)
    return count, requested, unique_steps(nodes, [e for e in ends if e[0] in nodes]), finished
