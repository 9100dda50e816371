"""The read side: trial records, the best trial, accounting, status and export.

Every reader of results (:class:`~stagetree.Study`, ``stagetree status`` and
``stagetree export``, a server or a dashboard) asks this module, so that each question
has one answer:

* **Which trials.** A study's trials of one trainer version (:mod:`stagetree.identity`):
  a Study asks for its own version, the commands for the version of the study's latest
  run; the trials of other versions stay in the storage, hidden.
* **The best trial** (:func:`best_trial`, and :meth:`Tuner.best
  <stagetree.tuners.base.Tuner.best>` through :func:`best_key`). Trials are compared
  at the largest step at which any trial has a finite value of the metric at its
  final step: a trial stopped early (by ASHA, say) never beats one trained further,
  however good its early metric. Among the trials at that step the best value wins,
  ties go to the lowest trial id, and NaN or infinite values are never best.
* **What a study cost** (:func:`study_accounting`). Executed steps and device-seconds
  are what was trained for the study's requests (the engine's ``study:<name>@<version>``
  scope, as fair share charges it): a step two studies needed while it trained counts
  for both, a step another study had trained before costs this one nothing. On a
  storage written before studies were counted, the sums over the plan trees its trials
  use (``root:<key>`` scopes). The storage-wide counters (scope ``engine``) count every
  stage once.

Everything here is a pure function of a :class:`~stagetree.plan.BasePlanStorage`: it
takes no engine and no lock (callers hold what they need) and never writes, so it
works on a storage opened read-only (``open_storage(url, readonly=True)``) while other
processes write to it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import gc
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from stagetree.identity import split_trials

if TYPE_CHECKING:
    from stagetree.hp import Sequence
    from stagetree.plan import BasePlanStorage, Node

__all__ = [
    "EFFICIENCY_KEYS",
    "StorageStatus",
    "StudyStatus",
    "TreeCurves",
    "TrialError",
    "TrialRecord",
    "accounting",
    "best_key",
    "best_trial",
    "efficiency",
    "export_records",
    "export_table",
    "failures",
    "final_metrics",
    "final_records",
    "final_value",
    "format_value",
    "hidden_trials",
    "last_points",
    "metric_mode",
    "path_segments",
    "progress",
    "quiet_gc",
    "ranked_metric",
    "records_of",
    "short_sequence",
    "storage_status",
    "study_accounting",
    "study_record",
    "study_status",
    "trial_records",
    "trial_rows",
]

_MODES = ("max", "min")

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


# Metric names that are minimised when a study does not record its mode.
_MIN_WORDS = ("loss", "err", "perplexity", "mse", "mae", "regret")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class TrialError:
    """Why a trial failed, as kept in the plan (``attrs["error"]`` of its record).

    Attributes:
        type: the exception's type name (``"ValueError"``, ``"WorkerLost"``, ...).
        message: the exception's message.
        traceback: the formatted traceback from the worker ("" when there is none, e.g.
            a worker process that died).
        where: what it interrupted, in words ("training step 3", "evaluating or
            checkpointing the model at step 5", "building the trainer").
    """

    type: str
    message: str
    traceback: str = ""
    where: str = ""

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any] | None) -> TrialError | None:
        """The error kept in a trial record's ``attrs``, or None."""
        raw = (attrs or {}).get("error")
        if not isinstance(raw, Mapping):
            return None
        return cls(
            str(raw.get("type", "Error")),
            str(raw.get("message", "")),
            str(raw.get("traceback", "")),
            str(raw.get("where", "")),
        )

    def summary(self) -> str:
        """One line: ``ValueError: boom (training step 3)``."""
        where = f" ({self.where})" if self.where else ""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first}{where}" if first else f"{self.type}{where}"


_NO_ERROR = TrialError("Error", "no error was recorded")


@dataclass
class TrialRecord:
    """One trial of a study, as :meth:`Study.trials <stagetree.Study.trials>` and
    :func:`trial_records` return it.

    Attributes:
        id: storage-wide trial id.
        config: fixed hyper-parameters.
        hp: sequences by name.
        steps: the most steps requested for this trial so far (its final step).
        state: ``pending`` | ``running`` | ``done`` | ``failed`` | ``cancelled``.
        metrics: every known metric on the trial's path, by step: its learning curve
            (``train()``'s metrics at every step, ``evaluate()``'s every ``eval_every``
            steps and at the requested ones).
        error: why it failed (``state == "failed"``), else None.
        lineage: how population based training made this trial, oldest first: one
            ``{"donor": trial id, "step": t}`` per exploit (the trial copies the donor's
            model at step ``t`` and trains on from there with mutated sequences); empty
            for a trial that no exploit made.
    """

    id: int
    config: dict[str, Any]
    hp: dict[str, Sequence]
    steps: int
    state: str
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    error: TrialError | None = None
    lineage: list[dict[str, int]] = field(default_factory=list)


def _studies(storage: BasePlanStorage) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in storage.studies()}


def study_record(storage: BasePlanStorage, study: str) -> dict[str, Any]:
    """The storage's record of ``study`` (``name``, ``created``, ``meta``).

    Raises:
        PlanKeyError: no study ``study`` in the storage (naming the studies there).
    """
    from stagetree.exceptions import PlanKeyError

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


def path_segments(nodes: Mapping[int, Node], node: int, step: int) -> list[tuple[int, int, int]]:
    """``(node, first, last)`` per node of the path that ends at the canonical
    ``(node, step)``, root first: the steps ``first..last`` (inclusive) whose model is
    keyed by that node (what :func:`stagetree.plan.tree.walk` returns for the trial).

    Raises:
        KeyError: a node of the path is not in ``nodes``.
    """
    chain = [nodes[node]]
    while chain[-1].parent is not None:
        chain.append(nodes[chain[-1].parent])
    chain.reverse()
    out: list[tuple[int, int, int]] = []
    for i, n in enumerate(chain):
        first = 0 if n.parent is None else n.branch_step + 1
        last = chain[i + 1].branch_step if i + 1 < len(chain) else step
        if last >= first:
            out.append((n.id, first, last))
    return out


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
        out: dict[int, dict[str, float]] = {}
        for node, first, last in segments:
            points = metrics.get(node)
            if not points:
                continue
            steps = self._steps.get(node)
            if steps is None:
                steps = self._steps[node] = sorted(points)
            lo, hi = bisect.bisect_left(steps, first), bisect.bisect_right(steps, last)
            for step in steps[lo:hi]:
                out[step] = dict(points[step])
        return out


@quiet_gc
def records_of(
    storage: BasePlanStorage,
    trials: Iterable[Mapping[str, Any]],
    curves: TreeCurves | None = None,
) -> list[TrialRecord]:
    """:class:`TrialRecord` of each trial row (:func:`trial_rows`), with its learning
    curve cut from one bulk read of each plan tree (``curves``, made when None)."""
    curves = curves if curves is not None else TreeCurves(storage)
    out = []
    for trial in trials:
        error = TrialError.from_attrs(trial.get("attrs")) if trial["state"] == "failed" else None
        out.append(
            TrialRecord(
                int(trial["id"]),
                dict(trial.get("config") or {}),
                dict(trial.get("hp") or {}),
                int(trial["steps"]),
                str(trial["state"]),
                curves.of(trial),
                error,
            )
        )
    return out


def final_metrics(
    storage: BasePlanStorage,
    trials: Iterable[Mapping[str, Any]],
    curves: TreeCurves | None = None,
) -> dict[int, dict[str, float]]:
    """The metrics of each trial row at its final step (``steps``), by trial id (trials
    without any there are left out): what :func:`records_of` would hold at that step,
    without reading the learning curves. One :meth:`BasePlanStorage.metrics_at` read,
    or taken from ``curves`` when its trees are read already; a row whose end lags its
    steps walks its path (:meth:`BasePlanStorage.metrics_along`)."""
    out: dict[int, dict[str, float]] = {}
    keys: dict[int, tuple[int, int]] = {}
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
) -> list[TrialRecord]:
    """:class:`TrialRecord` of each trial row whose ``metrics`` hold only its final
    step's (:func:`final_metrics`): all that :func:`ranked_metric`, :func:`best_trial`
    and :func:`final_value` read, at the cost of one point per trial. ``config`` and
    ``hp`` are the rows' own (not copied; empty for light rows)."""
    rows = list(trials)
    finals = final_metrics(storage, rows, curves)
    out = []
    for t in rows:
        tid, steps = int(t["id"]), int(t["steps"])
        error = TrialError.from_attrs(t.get("attrs")) if t["state"] == "failed" else None
        final = finals.get(tid)
        metrics = {steps: final} if final is not None else {}
        config, hp = t.get("config", {}), t.get("hp", {})
        out.append(TrialRecord(tid, config, hp, steps, str(t["state"]), metrics, error))
    return out


def trial_records(storage: BasePlanStorage, study: str, version: Any = None) -> list[TrialRecord]:
    """Every trial of ``study`` of trainer version ``version`` (default: the version of
    the study's latest run), in id order, with its metrics by step. A study the storage
    does not hold has none."""
    from stagetree.lineage import study_lineage

    rows = _trials(storage, study, version)[0]
    records = records_of(storage, rows)
    lineage = study_lineage(storage, study, rows) if rows else {}
    for record in records:
        record.lineage = lineage.get(record.id, [])
    return records


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
        (int(t["id"]), TrialError.from_attrs(t.get("attrs")) or _NO_ERROR)
        for t in trials
        if t["state"] == "failed"
    ]


def progress(storage: BasePlanStorage, study: str, version: Any = None) -> dict[str, float]:
    """A cheap snapshot for progress displays (reads no metrics, builds no tree):
    ``trials``, ``finished``, ``running``, ``pending``, ``failed`` (trial rows of
    ``version`` by state), ``steps_requested`` (their total steps), and the storage-wide
    ``steps_executed`` and ``device_seconds`` of the batches that ended so far."""
    trials = _trials(storage, study, version, light=True)[0]
    states = [t["state"] for t in trials]
    engine = storage.stats("engine")
    return {
        "trials": float(len(trials)),
        "finished": float(states.count("done")),
        "running": float(states.count("running")),
        "pending": float(states.count("pending")),
        "failed": float(states.count("failed")),
        "steps_requested": float(sum(int(t["steps"]) for t in trials)),
        "steps_executed": engine.get("steps_executed", 0.0),
        "device_seconds": engine.get("device_seconds", 0.0),
    }


# --------------------------------------------------------------------------- best


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")


def _finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def best_key(steps: int, value: Any, mode: str, tiebreak: int) -> tuple[int, float, int] | None:
    """The rank of a result (``value`` of the metric after ``steps`` steps) in the one
    best-trial rule: the larger key is the better result. None for a value that is
    never best (missing, not a number, NaN, infinite).

    Keys compare steps first (a result at more steps beats any result at fewer), then
    the value (``mode`` ``"max"`` or ``"min"``), then ``tiebreak`` (the smaller wins:
    the trial id, or the order the trial was created in).
    """
    number = _finite(value)
    if number is None:
        return None
    return (int(steps), number if mode == "max" else -number, -int(tiebreak))


def final_value(record: TrialRecord, metric: str) -> Any:
    """``metric`` of ``record`` at its final step (``record.steps``), or None."""
    return record.metrics.get(record.steps, {}).get(metric)


def best_trial(
    records: Iterable[TrialRecord], metric: str, mode: str = "max"
) -> TrialRecord | None:
    """The best trial: compared at the largest step at which any trial has a finite
    value of ``metric`` at its final step, then by that value (``mode``), ties to the
    lowest trial id; NaN and infinite values are never best (see :func:`best_key`).
    None when no trial has a finite value at its final step.

    Raises:
        ValueError: ``mode`` is not ``"max"`` or ``"min"``.
    """
    _check_mode(mode)
    best: tuple[tuple[int, float, int], TrialRecord] | None = None
    for record in records:
        key = best_key(record.steps, final_value(record, metric), mode, record.id)
        if key is not None and (best is None or key > best[0]):
            best = (key, record)
    return best[1] if best is not None else None


# --------------------------------------------------------------------------- accounting


def accounting(
    steps_requested: float, steps_unique: float, steps_executed: float, device_seconds: float
) -> dict[str, float]:
    """What sharing saved: requested minus executed steps, and device-seconds saved
    estimated as saved steps times the measured device-seconds per executed step.

    Returns:
        ``steps_requested``, ``steps_unique``, ``steps_executed``, ``merge_rate``
        (requested / unique, 1.0 when nothing is unique), ``device_seconds``,
        ``seconds_per_step`` (0.0 before any step ran), ``steps_saved``,
        ``device_seconds_saved``.
    """
    saved = steps_requested - steps_executed
    per_step = device_seconds / steps_executed if steps_executed > 0 else 0.0
    return {
        "steps_requested": float(steps_requested),
        "steps_unique": float(steps_unique),
        "steps_executed": float(steps_executed),
        "merge_rate": steps_requested / steps_unique if steps_unique else 1.0,
        "device_seconds": float(device_seconds),
        "seconds_per_step": per_step,
        "steps_saved": float(saved),
        "device_seconds_saved": saved * per_step,
    }


def _tree_stats(storage: BasePlanStorage, roots: Iterable[str]) -> dict[str, float]:
    """The counters of the plan trees ``roots``, summed."""
    from stagetree.plan.scopes import root_scope

    out: dict[str, float] = {}
    for root in roots:
        for k, v in storage.stats(root_scope(root)).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _own_counters(
    storage: BasePlanStorage, study: str, trials: list[dict[str, Any]]
) -> dict[str, float]:
    """The study's own counters (``engine.study_scope``: what was trained for its
    requests) at the version of ``trials``; empty when none were kept."""
    from stagetree.identity import trial_version
    from stagetree.plan.scopes import study_scope

    if not trials:
        return {}
    meta = (_studies(storage).get(study) or {}).get("meta") or {}
    version = trial_version(trials[0], meta)
    return storage.stats(study_scope(study, str(version))) if version is not None else {}


def _study_accounting(
    storage: BasePlanStorage, trials: list[dict[str, Any]], study: str | None = None
) -> tuple[dict[str, float], bool]:
    """:func:`study_accounting` of ``trials``, and whether any counters were found for
    them (a storage written before studies or trees were counted has none)."""
    from stagetree.stages import unique_steps

    requested = float(sum(int(t["steps"]) for t in trials))
    roots = {str(t["root_key"]) for t in trials}
    nodes = {n.id: n for root in roots for n in storage.nodes(root)}
    ends = [(int(t["node"]), int(t["step"])) for t in trials if t.get("node") is not None]
    unique = float(unique_steps(nodes, [e for e in ends if e[0] in nodes]))
    trees = _tree_stats(storage, roots)
    own = _own_counters(storage, study, trials) if study is not None else {}
    # What was trained for this study's requests when the engine kept it (shared work
    # counts for every study that needed it); else all that its trees cost.
    trained = own if "steps_executed" in own else trees
    everything = storage.stats("engine")
    numbers = {
        "trials": float(len(trials)),
        "steps_requested": requested,
        "steps_unique": unique,
        "merge_rate": requested / unique if unique else 1.0,
        "steps_executed": trained.get("steps_executed", 0.0),
        "device_seconds": trained.get("device_seconds", 0.0),
        "ckpt_save_seconds": everything.get("ckpt_save_seconds", 0.0),
        "ckpt_load_seconds": everything.get("ckpt_load_seconds", 0.0),
        "ckpt_bytes": everything.get("ckpt_bytes", 0.0),
        "live_splits": everything.get("live_splits", 0.0),
        "splits_missed": everything.get("splits_missed", 0.0),
        "workers_lost": trees.get("workers_lost", 0.0),
        "steps_lost": trees.get("steps_lost", 0.0),
        "fused_jobs": trees.get("fused_jobs", 0.0),
        "fused_members": trees.get("fused_members", 0.0),
    }
    return numbers, "steps_executed" in trained


def study_accounting(storage: BasePlanStorage, study: str, version: Any = None) -> dict[str, float]:
    """What ``study`` (its trials of ``version``, as in :func:`trial_records`) asked
    for and cost, as :meth:`Study.stats <stagetree.Study.stats>` returns it.

    Returns:
        ``trials``; ``steps_requested`` (total steps of the trials), ``steps_unique``
        (steps of the union of their paths) and ``merge_rate`` (requested / unique);
        ``steps_executed`` and ``device_seconds``: what was trained for this study's
        requests, over every run on this storage (``engine.study_scope``: a step that
        several studies needed counts for each; a step another study had trained
        before costs this one nothing); on a storage written before studies were
        counted, what the plan trees its trials use cost. ``workers_lost`` and
        ``steps_lost`` (steps a lost worker trained past its last durable checkpoint:
        trained again, counted in ``steps_executed`` both times) of those trees; and
        the storage-wide ``ckpt_save_seconds``, ``ckpt_load_seconds``,
        ``ckpt_bytes``, ``live_splits`` and ``splits_missed``; ``fused_jobs`` and
        ``fused_members``: fused jobs started on those trees and the batches in them
        (:mod:`stagetree.fusion`).
    """
    return _study_accounting(storage, _trials(storage, study, version, light=True)[0], study)[0]


# --------------------------------------------------------------------------- efficiency

EFFICIENCY_KEYS = (
    "efficiency",
    "wall_seconds",
    "limit_seconds",
    "startup_seconds",
    "ckpt_load_wait_seconds",
    "ckpt_save_wait_seconds",
    "idle_seconds",
    "scheduling_seconds",
    "workers",
    "steps_unique_trained",
    "seconds_per_step",
)


@quiet_gc
def efficiency(
    storage: BasePlanStorage,
    study: str,
    version: Any = None,
    *,
    now: float | None = None,
    workers: int | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> dict[str, float]:
    """How close the study's latest run came to the limit of this system (training
    each unique step once, on every worker at once), and where the rest of its
    wall-clock went; all from the workers' own timings (the activity records, see
    :func:`stagetree.views.batches`).

    The run is the one :meth:`Study.tune <stagetree.Study.tune>` (or
    :meth:`~stagetree.Study.begin_tuning`) recorded in the study's meta (``run``:
    ``started``, ``ended``, ``workers``, ``owner``); its batches are those its engine
    (``owner``) started on the study's plan trees between those times. With ``W``
    workers and the wall-clock ``T`` from ``started`` to ``ended``, or to the end of
    the last batch it started if later (now while it runs; the run's last activity
    record when its engine died without saying)::

        efficiency = (unique steps x median seconds per step trained alone / W) / T

    * *unique steps*: the ``(node, step)`` pairs the run's finished batches trained,
      each counted once (a step trained twice, e.g. after a lost worker, counts once;
      steps earlier runs trained are not this run's work).
    * *seconds per step trained alone*: per finished batch, ``(busy - load -
      save wait) / steps`` (a member of a fused job: its share of the job's time, and
      of its load); the median over the batches **weighted by their steps** (the
      rate at which half of the run's steps trained: a one-step batch's odd timing
      weighs one step), the lower one on a tie.

    The rest of ``W x T`` worker-seconds, each divided by ``W`` so that the parts are
    seconds of the wall-clock that add up to ``T`` (``wall_seconds``)::

        T = limit + startup + ckpt_load_wait + ckpt_save_wait + idle + scheduling

    * ``startup_seconds``: from the run's start until its first step trained (the
      workers starting up, the tuner's first decisions, the first batch building its
      trainer or loading its checkpoint), on every worker.
    * ``ckpt_load_wait_seconds``: the finished batches' start-checkpoint loads (and
      trainer builds) after that, which their training waited for (each batch loads
      when it starts; not the storage-wide ``ckpt_load_seconds`` of
      :func:`study_accounting`).
    * ``ckpt_save_wait_seconds``: what finished batches waited at their end for their
      background checkpoint writes. Workers no longer wait (a batch ends when its
      training does and its writes go on after it), so this is 0 for studies run since;
      a worker that waits for a checkpoint still being written elsewhere is idle.
    * ``idle_seconds``: worker-time after the first step in which a worker had no
      batch of this study (another study sharing the workers counts as idle).
    * ``scheduling_seconds``: the remainder: dispatching batches and reporting their
      end, steps trained more than once or by batches that failed, were lost or still
      run (a running batch counts only once it ends), evaluation beyond the median's,
      and steps slower than the median (it can be slightly negative when steps
      trained faster than the median).

    Also ``workers`` (``W``), ``steps_unique_trained`` and ``seconds_per_step`` (the
    median). Empty when there is no such run (a storage written before runs were
    recorded, a study not run by a tuner, a run of another trainer ``version``) or it
    trained nothing: no figure rather than a wrong one.

    Args:
        version: the trainer version whose run is wanted (default: the latest run's).
        now: the end of a run that has not ended (default ``time.time()``; the
            engine's clock for a virtual-time run).
        workers: ``W`` when the run's record has none (else the number of workers
            that ran its batches).
        rows: the study's trial rows (:meth:`BasePlanStorage.trials`, every version),
            when the caller has read them.
    """
    from stagetree.views import batches

    record = _studies(storage).get(study)
    meta = (record or {}).get("meta") or {}
    run = meta.get("run")
    if not isinstance(run, Mapping) or not isinstance(run.get("started"), (int, float)):
        return {}
    if version is not None and run.get("version") not in (None, version):
        return {}
    rows = storage.trials(study, light=True) if rows is None else rows
    roots = {str(t["root_key"]) for t in split_trials(rows, meta, version)[0]}
    now = time.time() if now is None else float(now)
    start, owner = float(run["started"]), run.get("owner")
    ended = run.get("ended")
    found = [
        b
        for b in batches(storage, roots, now=now).values()
        if (owner is None or b.owner == owner) and b.started is not None and b.started >= start
    ]
    if isinstance(ended, (int, float)):
        # ... or later, when batches it started ended after it (their last checkpoint
        # writes: the run's wall-clock includes them).
        last = [b.ended or 0.0 for b in found if b.started is not None and b.started <= ended]
        end = max([float(ended), *last])
    elif any(b.state == "running" for b in found) or _owner_lives(storage, owner):
        end = now
    else:  # its engine died without recording the end: its last record ends it
        end = max([start, *(b.ended or b.started or start for b in found)])
    found = [b for b in found if b.started is not None and b.started <= end]
    done = [b for b in found if b.state == "done" and b.steps > 0]
    if not done:
        return {}
    count = int(run.get("workers") or workers or len({(b.location, b.worker) for b in found}))
    count = max(count, 1)
    wall = max(end - start, 0.0)
    # The first step trained: the earliest start of a batch after its load (a batch
    # loads its start checkpoint, or builds its trainer, before it trains).
    first = min(_began(b, start) + _load(b) for b in found)
    first = min(max(first, start), start + wall)
    startup = first - start
    occupied = 0.0
    by_worker: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for b in found:
        assert b.started is not None
        lo, hi = max(b.started, first), min(b.ended if b.ended is not None else end, end)
        if hi > lo:
            by_worker.setdefault((b.location, b.worker), []).append((lo, hi))
    for spans in by_worker.values():
        occupied += _union_length(spans)
    idle = max(count * (wall - startup) - occupied, 0.0)
    # Load time after the first step (what came before it is start-up).
    load = sum(_overlap(_began(b, start), _began(b, start) + _load(b), first) for b in done)
    save_wait = sum(b.save_wait_seconds for b in done)
    rates = sorted(
        (
            max(b.busy_seconds - b.load_seconds / max(b.fused, 1) - b.save_wait_seconds, 0.0)
            / b.steps,
            b.steps,
        )
        for b in done
    )
    half, total, rate = sum(w for _, w in rates) / 2.0, 0.0, rates[-1][0]
    for r, w in rates:
        total += w
        if total >= half:
            rate = r
            break
    unique = _trained_steps(done)
    limit = unique * rate
    scheduling = count * wall - count * startup - idle - load - save_wait - limit
    return {
        "efficiency": limit / count / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
        "limit_seconds": limit / count,
        "startup_seconds": startup,
        "ckpt_load_wait_seconds": load / count,
        "ckpt_save_wait_seconds": save_wait / count,
        "idle_seconds": idle / count,
        "scheduling_seconds": scheduling / count,
        "workers": float(count),
        "steps_unique_trained": float(unique),
        "seconds_per_step": rate,
    }


def _began(batch: Any, default: float) -> float:
    return float(batch.started) if batch.started is not None else default


def _load(batch: Any) -> float:
    """The load time a batch reported (0 before it ended)."""
    return float(batch.load_seconds) if batch.state == "done" else 0.0


def _overlap(lo: float, hi: float, after: float) -> float:
    """The length of ``[lo, hi]`` after ``after``."""
    return max(hi - max(lo, after), 0.0)


def _owner_lives(storage: BasePlanStorage, owner: Any) -> bool:
    """Whether engine ``owner`` still holds a lease (always, on a storage of this
    process alone, which has no leases)."""
    from stagetree.plan import SQLPlanStorage

    if not isinstance(storage, SQLPlanStorage):
        return True
    return any(lease.owner == owner for lease in storage.leases())


def _union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals (a fused job's members overlap)."""
    length, reach = 0.0, -math.inf
    for lo, hi in sorted(spans):
        if hi > reach:
            length += hi - max(lo, reach)
            reach = hi
    return length


def _trained_steps(done: Iterable[Any]) -> int:
    """How many distinct ``(node, step)`` finished batches trained: each trains the
    first ``steps`` steps of its segments, in order."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for b in done:
        left = b.steps
        for node, lo, hi in b.segments:
            if left <= 0:
                break
            take = min(hi - lo, left)
            if take > 0:
                spans.setdefault(node, []).append((lo, lo + take))
                left -= take
    return round(sum(_union_length(s) for s in spans.values()))


# --------------------------------------------------------------------------- status


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


def _guess_mode(metric: str) -> str:
    return "min" if any(w in metric.lower() for w in _MIN_WORDS) else "max"


def metric_mode(metric: str, meta: Mapping[str, Any]) -> str:
    """The mode of ``metric`` in a study: the one its meta records for it, else
    ``"min"`` when the name says loss or error, else ``"max"``."""
    recorded = meta.get("mode")
    if meta.get("metric") == metric and recorded in _MODES:
        return str(recorded)
    return _guess_mode(metric)


def ranked_metric(
    meta: Mapping[str, Any], records: list[TrialRecord]
) -> tuple[str | None, str, str]:
    """``(metric, mode, where they come from)`` for a study's status: the metric its
    meta records, else the first (alphabetically) with a finite value at some trial's
    final step (see :func:`study_status`); ``(None, "max", "")`` when there is none."""
    metric = meta.get("metric") if isinstance(meta.get("metric"), str) else None
    if metric is not None:
        recorded = meta.get("mode")
        mode = recorded if recorded in _MODES else _guess_mode(metric)
        return metric, mode, "recorded in the study"
    names = sorted(
        {
            k
            for r in records
            for k, v in r.metrics.get(r.steps, {}).items()
            if _finite(v) is not None
        }
    )
    if not names:
        return None, "max", ""
    return names[0], _guess_mode(names[0]), f"first of {', '.join(names)}; mode guessed"


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
    from stagetree.engine.coordination import running_trials

    record = study_record(storage, name)
    meta = record.get("meta") or {}
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
    finished, failed, cancelled = (states.count(s) for s in ("done", "failed", "cancelled"))
    return StudyStatus(
        name=name,
        created=float(record.get("created") or 0.0),
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
    from stagetree.lineage import study_lineage

    return study_lineage(storage, name, trials) if trials else {}


def _budget_stop(meta: Mapping[str, Any]) -> tuple[str, str] | None:
    """What stopped the study's latest run, from its run record (``Study.tune``)."""
    run = meta.get("run")
    if isinstance(run, Mapping) and run.get("stopped_by"):
        return str(run.get("budget", "")), str(run["stopped_by"])
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
    trials, requested, unique = _plan_totals(storage, rows)
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
        ),
    )


def _plan_totals(
    storage: BasePlanStorage, rows: Mapping[str, list[dict[str, Any]]]
) -> tuple[int, int, int]:
    """``(trials, steps requested, unique steps)`` of every tree of the storage, as
    :func:`stagetree.stages.summarize` counts them, from the trial rows of every study
    (``rows``); without what ``summarize`` also reads for its pending steps."""
    from stagetree.plan.model import RequestState
    from stagetree.stages import total_steps, unique_steps

    keys = storage.root_keys()
    wanted = set(keys)
    nodes = {n.id: n for key in keys for n in storage.nodes(key)}
    trials = [t for found in rows.values() for t in found if t["root_key"] in wanted]
    if trials:
        count, requested = len(trials), sum(int(t["steps"]) for t in trials)
        ends = [(int(t["node"]), int(t["step"])) for t in trials if t["node"] is not None]
    else:  # a plan without trial records: each live or finished request is a trial
        live = [r for key in keys for r in storage.requests(key)]
        ends = [(r.node, r.step) for r in live if r.state != RequestState.CANCELLED]
        count, requested = len(ends), total_steps(ends)
    return count, requested, unique_steps(nodes, [e for e in ends if e[0] in nodes])


# --------------------------------------------------------------------------- export


def format_value(value: Any) -> str:
    """A config or hyper-parameter value in short form, as the CLI and the dashboard
    print it: floats with ``%g``, sequences as in :func:`short_sequence`,
    lists element-wise, strings as they are."""
    from stagetree.hp import Sequence

    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, Sequence):
        return short_sequence(value)
    if isinstance(value, str):
        return value
    return repr(value)


def short_sequence(seq: Any, offset: int = 0) -> str:
    """A sequence in short form: ``0.1`` for a constant, ``MultiStep(0.1, [8, 12],
    0.1)``, ``0.1 until step 4, then Exponential(0.1, 0.8)``.

    Args:
        seq: a :class:`~stagetree.hp.Sequence` (anything else is formatted as a value).
        offset: the absolute step the sequence starts at (for the steps of ``Then``).
    """
    import dataclasses

    from stagetree.hp import Constant, Sequence, Shifted, Then

    if isinstance(seq, Constant):
        return format_value(seq.value)
    if isinstance(seq, Then):
        start = offset + seq.at
        first = short_sequence(seq.first, offset)
        second = seq.second
        if isinstance(second, Shifted) and second.offset == start:  # what PBT continues
            base = short_sequence(second.base)
            return f"{first} until step {start}, then {base} continued from step {start}"
        return f"{first} until step {start}, then {short_sequence(seq.second, start)}"
    if isinstance(seq, Sequence) and dataclasses.is_dataclass(seq):
        args = ", ".join(format_value(getattr(seq, f.name)) for f in dataclasses.fields(seq))
        return f"{type(seq).__name__}({args})"
    return format_value(seq)


def _json_number(value: float) -> float | str:
    """Strict JSON has no NaN or infinities: they become ``"nan"``, ``"inf"``,
    ``"-inf"`` (``float()`` reads them back)."""
    return value if math.isfinite(value) else str(value)


def export_records(storage: BasePlanStorage, study: str | None = None) -> list[dict[str, Any]]:
    """Every trial with its metric history, as JSON-able dicts: per study, the trials
    of its latest trainer version (:func:`hidden_trials` counts the others).

    Each dict: ``study``, ``trial`` (id), ``config``, ``hp`` (sequences as JSON),
    ``steps``, ``state``, ``error`` (None, or for a failed trial ``{"type", "message",
    "traceback", "where"}``) and ``history``: ``[{"step": s, "metrics": {...}}, ...]``
    in step order (only steps with metrics; NaN and infinities as strings).

    Raises:
        PlanKeyError: no study ``study`` in the storage.
    """
    names = [s["name"] for s in storage.studies()] if study is None else [study]
    if study is not None:
        study_record(storage, study)
    out: list[dict[str, Any]] = []
    for name in names:
        for rec in trial_records(storage, name):
            out.append(
                {
                    "study": name,
                    "trial": rec.id,
                    "config": dict(rec.config),
                    "hp": {k: seq.to_json() for k, seq in rec.hp.items()},
                    "steps": rec.steps,
                    "state": rec.state,
                    "error": dataclasses.asdict(rec.error) if rec.error is not None else None,
                    "history": [
                        {"step": step, "metrics": {k: _json_number(v) for k, v in m.items()}}
                        for step, m in sorted(rec.metrics.items())
                    ],
                }
            )
    return out


def _cell(value: Any) -> Any:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return value


def export_table(records: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """One row per (trial, step with metrics) of :func:`export_records`.

    Columns: ``study``, ``trial``, ``config.<name>`` (in order of first appearance),
    ``hp`` (JSON of the sequences), ``step``, ``metric.<name>`` (sorted), ``state`` and
    ``error`` (the first line of a failed trial's error). Cells a row does not have are
    empty. A failed trial without metrics still gets one row (with an empty step), so
    that every failure is in the table.
    """
    records = list(records)
    config_names: dict[str, None] = {}
    metric_names: set[str] = set()
    for rec in records:
        config_names.update(dict.fromkeys(rec["config"]))
        for h in rec["history"]:
            metric_names.update(h["metrics"])
    metrics = sorted(metric_names)
    header = [
        "study",
        "trial",
        *(f"config.{k}" for k in config_names),
        "hp",
        "step",
        *(f"metric.{k}" for k in metrics),
        "state",
        "error",
    ]
    rows: list[list[Any]] = []
    for rec in records:
        config = [_cell(rec["config"].get(k, "")) for k in config_names]
        hp = json.dumps(rec["hp"], sort_keys=True, separators=(",", ":"))
        error = rec.get("error") or {}
        line = f"{error.get('type', 'Error')}: {error.get('message', '')}" if error else ""
        tail = [rec.get("state", ""), line.splitlines()[0] if line else ""]
        history = rec["history"] or ([{"step": "", "metrics": {}}] if error else [])
        for h in history:
            values = [h["metrics"].get(k, "") for k in metrics]
            rows.append([rec["study"], rec["trial"], *config, hp, h["step"], *values, *tail])
    return header, rows
