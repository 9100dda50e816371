"""The trials of a study as the read side gives them: records, learning curves,
final metrics, failures, progress and the best trial.

Every reader of results (:class:`~stagetree.Study`, ``stagetree status`` and
``stagetree export``, a server or a dashboard) asks this package
(:mod:`stagetree.reports`), so that each question has one answer:

* **Which trials.** A study's trials of one trainer version (:mod:`stagetree.identity`):
  a Study asks for its own version, the commands for the version of the study's latest
  run; the trials of other versions stay in the storage, hidden.
* **The best trial** (:func:`best_trial`, and :meth:`Tuner.best
  <stagetree.tuners.base.Tuner.best>` through :func:`stagetree.ranking.best_key`).
  Trials are compared at the largest step at which any trial has a finite value of the
  metric at its final step: a trial stopped early (by ASHA, say) never beats one
  trained further, however good its early metric. Among the trials at that step the
  best value wins, ties go to the lowest trial id, and NaN or infinite values are
  never best.

Everything here is a pure function of a :class:`~stagetree.plan.BasePlanStorage`: it
takes no engine and no lock (callers hold what they need) and never writes, so it
works on a storage opened read-only (``open_storage(url, readonly=True)``) while other
processes write to it.
"""

from __future__ import annotations

import bisect
import functools
import gc
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from stagetree.exceptions import PlanKeyError
from stagetree.identity import current_version, split_trials, trial_version
from stagetree.plan.scopes import root_scope, study_scope
from stagetree.plan.tree import curve_along, path_segments
from stagetree.ranking import MODES, best_key, check_mode, finite, guess_mode
from stagetree.records import NO_ERROR, TrialError, TrialRecord, TrialState
from stagetree.reports.lineage import study_lineage

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage
    from stagetree.plan.model import Node

__all__ = [
    "TreeCurves",
    "best_record",
    "best_trial",
    "curve_of",
    "device_seconds",
    "failures",
    "final_metrics",
    "final_records",
    "final_value",
    "hidden_trials",
    "last_points",
    "path_segments",
    "progress",
    "quiet_gc",
    "ranked_metric",
    "records_of",
    "study_record",
    "trial_records",
    "trial_rows",
]


_P = ParamSpec("_P")
_R = TypeVar("_R")


def quiet_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` with the generational garbage collector paused (as the stage tree's
    build does, :func:`stagetree.stages.build_stage_tree`): a reader of a large study
    allocates tens of thousands of rows and points at once, and collections triggered
    halfway would walk them and everything the process holds for nothing (a third of
    the time of a view). Cycles are collected once it is enabled again; nested and
    concurrent calls leave it enabled as they found it."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


# --------------------------------------------------------------------------- records


def _studies(storage: BasePlanStorage) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in storage.studies()}


def study_record(storage: BasePlanStorage, study: str) -> dict[str, Any]:
    """The storage's record of ``study`` (``name``, ``created``, ``meta``).

    Raises:
        PlanKeyError: no study ``study`` in the storage (naming the studies there).
    """
    by_name = _studies(storage)
    if study not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        raise PlanKeyError(f"no study {study!r} in the storage (studies: {known})")
    return by_name[study]


def _trials(
    storage: BasePlanStorage, study: str, version: Any = None, light: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """``(trial rows of version, number of rows of other versions)``; ``version``
    defaults to that of the study's latest run. A study without a record has none."""
    record = _studies(storage).get(study)
    if record is None:
        return [], 0
    return split_trials(storage.trials(study, light=light), record.get("meta") or {}, version)


def trial_rows(
    storage: BasePlanStorage, study: str, version: Any = None, *, light: bool = False
) -> list[dict[str, Any]]:
    """The storage's rows (:meth:`~stagetree.plan.BasePlanStorage.trials`) of the trials
    :func:`trial_records` returns: ``study``'s trials of ``version`` (default: the
    version of its latest run), in id order, without their metrics (and with
    ``light``, without their config and sequences)."""
    return _trials(storage, study, version, light)[0]


def _along(storage: BasePlanStorage, trial: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    """:meth:`BasePlanStorage.metrics_along` the trial's sequences up to its steps (a
    light row, without them, reads its own row for them)."""
    hp = trial.get("hp")
    if hp is None:
        hp = storage.trial(int(trial["id"]))["hp"]
    return storage.metrics_along(trial["root_key"], hp, trial["steps"])


def curve_of(storage: BasePlanStorage, trial: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    """Every known metric on one ``trial``'s path up to its steps, by step (what
    :meth:`BasePlanStorage.metrics_along` gives): the metrics of its path's nodes only
    (:meth:`BasePlanStorage.path_metrics`), where ``metrics_along`` reads its whole
    plan tree to walk it (a study of 100,000 trials in one tree, for the best one)."""
    if trial.get("node") is None:
        return {}
    if trial.get("step") != trial["steps"]:  # the row's end lags: walk its values
        return _along(storage, trial)
    return storage.path_metrics(int(trial["node"]), int(trial["steps"]))


class TreeCurves:
    """The metrics of plan trees read once (one bulk read per tree), cut into each
    trial's learning curve: what :meth:`BasePlanStorage.metrics_along` gives, without
    one query per trial.

    Attributes:
        storage: the plan read.
    """

    def __init__(self, storage: BasePlanStorage) -> None:
        self.storage = storage
        self._nodes: dict[str, dict[int, Node]] = {}
        self._metrics: dict[str, dict[int, dict[int, dict[str, float]]]] = {}
        self._steps: dict[int, list[int]] = {}  # node -> its metric steps, sorted

    def nodes(self, root_key: str) -> dict[int, Node]:
        """The nodes of ``root_key``'s tree by id, read once."""
        nodes = self._nodes.get(root_key)
        if nodes is None:
            nodes = self._nodes[root_key] = {n.id: n for n in self.storage.nodes(root_key)}
        return nodes

    def metrics(self, root_key: str) -> dict[int, dict[int, dict[str, float]]]:
        """``{node: {step: metrics}}`` of ``root_key``'s tree, read once."""
        metrics = self._metrics.get(root_key)
        if metrics is None:
            metrics = self._metrics[root_key] = self.storage.metrics(root_key)
        return metrics

    def tree(self, root_key: str) -> tuple[dict[int, Node], dict[int, dict[int, dict[str, float]]]]:
        """``(nodes by id, {node: {step: metrics}})`` of ``root_key``'s tree, read once."""
        return self.nodes(root_key), self.metrics(root_key)

    def of(self, trial: Mapping[str, Any]) -> dict[int, dict[str, float]]:
        """Every known metric on ``trial``'s path up to its steps, by step."""
        if trial.get("node") is None:
            return {}
        if trial.get("step") != trial["steps"]:  # the row's end lags: walk its values
            return _along(self.storage, trial)
        nodes, metrics = self.tree(str(trial["root_key"]))
        try:
            segments = path_segments(nodes, int(trial["node"]), int(trial["steps"]))
        except KeyError:  # a node committed after the tree was read
            return _along(self.storage, trial)
        return curve_along(segments, metrics, self._steps)


@quiet_gc
def records_of(
    storage: BasePlanStorage,
    trials: Iterable[Mapping[str, Any]],
    curves: TreeCurves | None = None,
) -> list[TrialRecord]:
    """:class:`TrialRecord` of each trial row (:func:`trial_rows`), with its learning
    curve cut from one bulk read of each plan tree (``curves``, made when None)."""
    curves = curves if curves is not None else TreeCurves(storage)
    return [_record(trial, curves.of(trial)) for trial in trials]


def _record(trial: Mapping[str, Any], metrics: dict[int, dict[str, float]]) -> TrialRecord:
    """The :class:`TrialRecord` of a (full) trial row with its ``metrics`` by step."""
    error = (
        TrialError.from_attrs(trial.get("attrs")) if trial["state"] == TrialState.FAILED else None
    )
    return TrialRecord(
        int(trial["id"]),
        dict(trial.get("config") or {}),
        dict(trial.get("hp") or {}),
        int(trial["steps"]),
        str(trial["state"]),
        metrics,
        error,
    )


def final_metrics(
    storage: BasePlanStorage,
    trials: Iterable[Mapping[str, Any]],
    curves: TreeCurves | None = None,
    study: str | None = None,
) -> dict[int, dict[str, float]]:
    """The metrics of each trial row at its final step (``steps``), by trial id (trials
    without any there are left out): what :func:`records_of` would hold at that step,
    without reading the learning curves. One :meth:`BasePlanStorage.metrics_at` read
    (:meth:`BasePlanStorage.final_metrics` of ``study`` when the rows are that study's:
    one query), or taken from ``curves`` when its trees are read already; a row whose
    end lags its steps walks its path (:meth:`BasePlanStorage.metrics_along`)."""
    out: dict[int, dict[str, float]] = {}
    keys: dict[int, tuple[int, int]] = {}
    stored = storage.final_metrics(study) if study is not None and curves is None else None
    for t in trials:
        if t.get("node") is None:
            continue
        steps = int(t["steps"])
        if t.get("step") != steps:  # the row's end lags: walk its values
            found = _along(storage, t).get(steps)
            if found is not None:
                out[int(t["id"])] = found
        elif curves is not None:
            root, node = str(t["root_key"]), int(t["node"])
            if node not in curves.nodes(root):  # committed after the tree was read
                found = _along(storage, t).get(steps)
            else:
                point = curves.metrics(root).get(node, {}).get(steps)
                found = None if point is None else dict(point)
            if found is not None:
                out[int(t["id"])] = found
        elif stored is not None:
            found = stored.get(int(t["id"]))
            if found is not None:
                out[int(t["id"])] = found
        else:
            keys[int(t["id"])] = (int(t["node"]), steps)
    if keys:
        points = storage.metrics_at(keys.values())
        out.update((tid, points[key]) for tid, key in keys.items() if key in points)
    return out


def last_points(
    storage: BasePlanStorage,
    trials: Iterable[Mapping[str, Any]],
    finals: Mapping[int, dict[str, float]] | None = None,
) -> dict[int, tuple[int, dict[str, float]]]:
    """The last step with metrics on each trial's path up to its steps, and its metrics,
    by trial id (trials without any are left out): the last point of the learning curve
    that :func:`records_of` gives it. The final points first (``finals``, else
    :func:`final_metrics`); only for the trials short of their end the metrics of the
    nodes on their paths."""
    rows = list(trials)
    finals = final_metrics(storage, rows) if finals is None else finals
    out: dict[int, tuple[int, dict[str, float]]] = {}
    short: dict[str, list[Mapping[str, Any]]] = {}
    for t in rows:
        tid = int(t["id"])
        if tid in finals:
            out[tid] = (int(t["steps"]), finals[tid])
        elif t.get("node") is not None:
            short.setdefault(str(t["root_key"]), []).append(t)
    for root, found in short.items():
        nodes = {n.id: n for n in storage.nodes(root)}
        paths: dict[int, list[tuple[int, int, int]]] = {}
        for t in found:
            try:
                if t.get("step") == t["steps"]:
                    paths[int(t["id"])] = path_segments(nodes, int(t["node"]), int(t["steps"]))
                    continue
            except KeyError:  # a node committed after the tree was read
                pass
            curve = _along(storage, t)  # walk it
            if curve:
                out[int(t["id"])] = max(curve.items())
        metrics = storage.metrics(root, {n for path in paths.values() for n, _, _ in path})
        steps = {node: list(points) for node, points in metrics.items()}  # sorted
        for tid, path in paths.items():
            for node, first, last in reversed(path):
                along = steps.get(node)
                i = bisect.bisect_right(along, last) if along else 0
                if i and along is not None and along[i - 1] >= first:
                    out[tid] = (along[i - 1], metrics[node][along[i - 1]])
                    break
    return out


def final_records(
    storage: BasePlanStorage,
    trials: Iterable[Mapping[str, Any]],
    curves: TreeCurves | None = None,
    study: str | None = None,
) -> list[TrialRecord]:
    """:class:`TrialRecord` of each trial row whose ``metrics`` hold only its final
    step's (:func:`final_metrics`, of ``study``'s rows when it is given): all that
    :func:`ranked_metric`, :func:`best_trial` and :func:`final_value` read, at the cost
    of one point per trial. ``config`` and ``hp`` are the rows' own (not copied; empty
    for light rows)."""
    rows = list(trials)
    finals = final_metrics(storage, rows, curves, study)
    out = []
    for t in rows:
        tid, steps = int(t["id"]), int(t["steps"])
        error = TrialError.from_attrs(t.get("attrs")) if t["state"] == TrialState.FAILED else None
        final = finals.get(tid)
        metrics = {steps: final} if final is not None else {}
        config, hp = t.get("config", {}), t.get("hp", {})
        out.append(TrialRecord(tid, config, hp, steps, str(t["state"]), metrics, error))
    return out


@quiet_gc
def trial_records(
    storage: BasePlanStorage, study: str, version: Any = None, *, history: bool = True
) -> list[TrialRecord]:
    """Every trial of ``study`` of trainer version ``version`` (default: the version of
    the study's latest run), in id order, with its metrics by step. A study the storage
    does not hold has none.

    With ``history=False`` each record's ``metrics`` hold its final step's only (``{steps:
    metrics}``, empty when it has none there): one point per trial read by query instead
    of every learning curve (what a study of 100,000 trials can afford to list).
    """
    if not history:
        return _final_trial_records(storage, study, version)
    rows = _trials(storage, study, version)[0]
    records = records_of(storage, rows)
    lineage = study_lineage(storage, study, rows) if rows else {}
    for record in records:
        record.lineage = lineage.get(record.id, [])
    return records


def _final_trial_records(
    storage: BasePlanStorage, study: str, version: Any = None
) -> list[TrialRecord]:
    """:func:`trial_records` with ``history=False``: what :func:`final_records` makes of
    :func:`trial_rows`, from one read of the trials with their final metrics
    (:meth:`BasePlanStorage.trial_finals`: one query on SQL, no row dicts)."""
    record = _studies(storage).get(study)
    if record is None:
        return []
    meta = record.get("meta") or {}
    if version is None:
        version = current_version(storage.trials(study, light=True), meta)
    default = meta.get("version")  # trial_version's rule, without a dict per row
    own = [f for f in storage.trial_finals(study) if f.attrs.get("version", default) == version]
    out = []
    for tid, config, hp, steps, node, step, state, attrs, final in own:
        if final is None and node is not None and step != steps:  # the end lags
            final = _along(storage, storage.trial(tid)).get(steps)
        error = TrialError.from_attrs(attrs) if state == TrialState.FAILED else None
        metrics = {steps: final} if final is not None else {}
        out.append(TrialRecord(tid, config, hp, steps, str(state), metrics, error))
    rows = ({"id": f.id, "config": f.config, "hp": f.hp} for f in own)
    lineage = study_lineage(storage, study, rows) if own else {}
    for rec in out if lineage else ():
        rec.lineage = lineage.get(rec.id, [])
    return out


@quiet_gc
def best_record(
    storage: BasePlanStorage, study: str, metric: str, mode: str = "max", version: Any = None
) -> TrialRecord | None:
    """The best trial of ``study`` (of ``version``, as in :func:`trial_records`) by
    :func:`best_trial`'s rule, with its whole learning curve and lineage: what
    ``best_trial(trial_records(...), metric, mode)`` returns, with the final metrics of
    every trial read by query and only the best one's history. None when no trial has a
    finite ``metric`` at its final step.

    Raises:
        ValueError: ``mode`` is not ``"max"`` or ``"min"``.
    """
    check_mode(mode)
    record = _studies(storage).get(study)
    if record is None:
        return None
    meta = record.get("meta") or {}
    if version is None:
        version = current_version(storage.trials(study, light=True), meta)
    default = meta.get("version")  # trial_version's rule, without a dict per row
    ends = [e for e in storage.trial_ends(study) if e.attrs.get("version", default) == version]
    best: tuple[tuple[int, float, int], int] | None = None
    for end in ends:  # best_trial's rule, without a record per trial
        final = end.final
        if final is None and end.node is not None and end.step != end.steps:
            final = _along(storage, storage.trial(end.id)).get(end.steps)  # the end lags
        key = best_key(end.steps, None if final is None else final.get(metric), mode, end.id)
        if key is not None and (best is None or key > best[0]):
            best = (key, end.id)
    if best is None:
        return None
    row = storage.trial(best[1])
    out = _record(row, curve_of(storage, row))
    out.lineage = study_lineage(storage, study, [{"id": e.id} for e in ends]).get(out.id, [])
    return out


def hidden_trials(storage: BasePlanStorage, study: str | None = None) -> int:
    """Trials of other trainer versions than the latest run's (of ``study``, or of
    every study), which status and export leave out."""
    return sum(
        split_trials(storage.trials(s["name"], light=True), s.get("meta"))[1]
        for s in storage.studies()
        if study is None or s["name"] == study
    )


def failures(
    storage: BasePlanStorage, study: str, version: Any = None
) -> list[tuple[int, TrialError]]:
    """``(trial id, error)`` of every failed trial of ``study`` (of ``version``, as in
    :func:`trial_records`), in id order. Cheap: reads no metrics."""
    return _failed(_trials(storage, study, version, light=True)[0])


def _failed(trials: Iterable[Mapping[str, Any]]) -> list[tuple[int, TrialError]]:
    return [
        (int(t["id"]), TrialError.from_attrs(t.get("attrs")) or NO_ERROR)
        for t in trials
        if t["state"] == TrialState.FAILED
    ]


def tree_counters(storage: BasePlanStorage, roots: Iterable[str]) -> dict[str, float]:
    """The counters of the plan trees ``roots`` (``root:<key>`` scopes), summed."""
    out: dict[str, float] = {}
    for root in roots:
        for k, v in storage.stats(root_scope(root)).items():
            out[k] = out.get(k, 0.0) + v
    return out


def trained_counters(
    storage: BasePlanStorage,
    study: str | None,
    trials: list[dict[str, Any]],
    trees: Mapping[str, float] | None = None,
) -> tuple[Mapping[str, float], bool]:
    """What was trained for ``study``'s ``trials`` (``steps_executed``,
    ``device_seconds``): the one definition that ``Study.stats()``, ``progress()``, the
    run report and ``stagetree status`` share.

    The study's own counters (the engine's ``study:<name>@<version>`` scope at the
    version of ``trials``: what was trained for its requests, charged as workers report
    their steps, so running batches count as they go; a step two studies needed counts
    for both); on a storage written before studies were counted, what the plan trees of
    its trials cost (``trees``, when the caller summed them). Also whether any counters
    were found (a storage written before trees were counted has none).
    """
    if study is not None and trials:
        meta = (_studies(storage).get(study) or {}).get("meta") or {}
        version = trial_version(trials[0], meta)
        if version is not None:
            own = storage.stats(study_scope(study, str(version)))
            if "steps_executed" in own:
                return own, True
    if trees is None:
        trees = tree_counters(storage, {str(t["root_key"]) for t in trials})
    return trees, "steps_executed" in trees


def device_seconds(storage: BasePlanStorage, study: str, version: Any = None) -> float:
    """The device seconds trained for ``study``'s trials of ``version`` (as in
    :func:`trial_records`): the ``device_seconds`` of
    :func:`stagetree.reports.costs.study_accounting`, from the counters alone (no plan
    tree read: a run's budget asks at its start and its end)."""
    trials = _trials(storage, study, version, light=True)[0]
    return float(trained_counters(storage, study, trials)[0].get("device_seconds", 0.0))


def progress(storage: BasePlanStorage, study: str, version: Any = None) -> dict[str, float]:
    """A cheap snapshot for progress displays (reads no metrics, builds no tree):
    ``trials``, ``finished``, ``running``, ``pending``, ``failed`` (trial rows of
    ``version`` by state), ``steps_requested`` (their total steps),
    ``steps_requested_finished`` (those of the finished trials), and the study's
    ``steps_executed`` and ``device_seconds`` so far (:func:`trained_counters`, as
    :func:`stagetree.reports.costs.study_accounting` counts them)."""
    trials = _trials(storage, study, version, light=True)[0]
    states = [t["state"] for t in trials]
    trained = trained_counters(storage, study, trials)[0]
    return {
        "trials": len(trials),
        "finished": states.count(TrialState.DONE),
        "running": states.count(TrialState.RUNNING),
        "pending": states.count(TrialState.PENDING),
        "failed": states.count(TrialState.FAILED),
        "steps_requested": sum(int(t["steps"]) for t in trials),
        "steps_requested_finished": sum(
            int(t["steps"]) for t, state in zip(trials, states) if state == TrialState.DONE
        ),
        "steps_executed": round(trained.get("steps_executed", 0.0)),
        "device_seconds": float(trained.get("device_seconds", 0.0)),
    }


# --------------------------------------------------------------------------- best


def final_value(record: TrialRecord, metric: str) -> Any:
    """``metric`` of ``record`` at its final step (``record.steps``), or None."""
    return record.metrics.get(record.steps, {}).get(metric)


def best_trial(
    records: Iterable[TrialRecord], metric: str, mode: str = "max"
) -> TrialRecord | None:
    """The best trial: compared at the largest step at which any trial has a finite
    value of ``metric`` at its final step, then by that value (``mode``), ties to the
    lowest trial id; NaN and infinite values are never best (see
    :func:`~stagetree.ranking.best_key`). None when no trial has a finite value at its final step.

    Raises:
        ValueError: ``mode`` is not ``"max"`` or ``"min"``.
    """
    check_mode(mode)
    best: tuple[tuple[int, float, int], TrialRecord] | None = None
    for record in records:
        key = best_key(record.steps, final_value(record, metric), mode, record.id)
        if key is not None and (best is None or key > best[0]):
            best = (key, record)
    return best[1] if best is not None else None


def ranked_metric(
    meta: Mapping[str, Any], records: list[TrialRecord]
) -> tuple[str | None, str, str]:
    """``(metric, mode, where they come from)`` for a study's status: the metric its
    meta records, else the first (alphabetically) with a finite value at some trial's
    final step (see :func:`stagetree.reports.status.study_status`); ``(None, "max",
    "")`` when there is none."""
    metric = meta.get("metric") if isinstance(meta.get("metric"), str) else None
    if metric is not None:
        recorded = meta.get("mode")
        mode = recorded if recorded in MODES else guess_mode(metric)
        return metric, mode, "recorded in the study"
    names = sorted(
        {k for r in records for k, v in r.metrics.get(r.steps, {}).items() if finite(v) is not None}
    )
    if not names:
        return None, "max", ""
    return names[0], guess_mode(names[0]), f"first of {', '.join(names)}; mode guessed"
