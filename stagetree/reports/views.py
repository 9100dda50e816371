"""The dashboard's queries: JSON-ready views of a plan storage (``docs/dashboard-api.md``).

Every function here is a pure, read-only function of a
:class:`~stagetree.plan.BasePlanStorage` built on the rest of :mod:`stagetree.reports` (one answer
per question: the status, the best trial, the accounting), and returns plain dicts
and lists that :func:`json.dumps` takes as they are: numbers that are not finite
become None, times are ``time.time()`` seconds. Each answer carries ``revision``, the
storage's change counter read *before* anything else, so that what it holds is at
least as new as its revision. The web layer (:mod:`stagetree.dashboard`) only routes
and serialises.

Everything is read in bulk (every node, request, checkpoint and metric step of a tree
in one read each), never node by node, and only what a view shows: trial rows without
their config and sequences where those are not shown (``trials(light=True)``), each
trial's final point rather than its learning curve where only the ranking needs it
(:func:`stagetree.reports.trials.final_records`, one
:meth:`~stagetree.plan.BasePlanStorage.metrics_at` read). Views pause the generational
garbage collector while they build (:func:`stagetree.reports.trials.quiet_gc`). A study of
10,000 trials gives its status and its tree in a fraction of a second.
:func:`read_tree` does the reading and :func:`build_tree` the computing, so that a
caller holding a lock for the reads (a server's engine) releases it before the
computation; a tree built from the previous one (``previous``) shares its unchanged
nodes, which :func:`tree_delta` then skips by identity.

Batches (the workers timeline, "training" nodes) come from the storage's activity
records (:mod:`stagetree.reports.activity`); a long-lived reader (the web layer) keeps
an :class:`~stagetree.reports.activity.ActivityLog`, which reads only the records
written since its last read.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagetree.exceptions import PlanKeyError
from stagetree.executors.simulated import StepCost
from stagetree.hp import Constant
from stagetree.identity import split_trials
from stagetree.plan.model import RequestState
from stagetree.ranking import metric_mode
from stagetree.records import TrialState
from stagetree.reports.activity import ActivityLog, Batch, batches
from stagetree.reports.costs import saving_ratio
from stagetree.reports.format import format_value
from stagetree.reports.status import StudyStatus, storage_status, study_status
from stagetree.reports.trials import (
    TreeCurves,
    best_trial,
    final_records,
    last_points,
    path_segments,
    quiet_gc,
    ranked_metric,
    study_record,
    trial_rows,
)
from stagetree.stages import work

if TYPE_CHECKING:
    from stagetree.hp import Sequence
    from stagetree.plan.base import BasePlanStorage, CheckpointRecord
    from stagetree.plan.model import Node, Request

__all__ = [
    "MAX_RUNS",
    "ActivityLog",
    "TreeData",
    "build_tree",
    "checkpoint_of",
    "compact",
    "curves",
    "node_detail",
    "number",
    "read_tree",
    "savings",
    "stage_tree",
    "study_detail",
    "study_summaries",
    "study_summary",
    "timeline",
    "tree_delta",
    "trials_table",
    "value_runs",
]

#: The most runs :func:`value_runs` returns for one hyper-parameter (longer ones are
#: sampled).
MAX_RUNS = 200

# A compact label lists at most this many values of a sequence, else first … last.
_LABEL_VALUES = 4


# --------------------------------------------------------------------------- values


def number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None: what
    JSON can carry of a metric."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _metrics(values: Mapping[str, float]) -> dict[str, float | None]:
    return {k: number(v) for k, v in values.items()}


def _value(value: Any) -> Any:
    """A hyper-parameter value for JSON (non-finite floats become None)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# Up to this many steps, values are computed one by one rather than in the sequences'
# cached chunks of 1024 (a node's few steps should not cost a thousand values).
_DIRECT = 256


def _values(seq: Sequence, start: int, stop: int) -> list[Any]:
    if stop - start <= _DIRECT:
        return [seq(t) for t in range(start, stop)]
    return seq.values(start, stop)


def _same(a: list[Any], b: list[Any]) -> bool:
    """Typed equality of two value lists (``1`` is not ``1.0``)."""
    return a == b and all(type(x) is type(y) for x, y in zip(a, b))


def _runs(seq: Sequence, start: int, stop: int) -> list[tuple[int, int, Any]]:
    """Every run ``(from, to, value)`` of equal values of ``seq`` on ``[start, stop)``
    (values of different types differ: ``1`` is not ``1.0``)."""
    if stop <= start:
        return []
    if isinstance(seq, Constant):
        return [(start, stop, seq.value)]
    values = _values(seq, start, stop)
    out: list[tuple[int, int, Any]] = []
    begin, last = start, values[0]
    for i, v in enumerate(values[1:], start + 1):
        if v != last or type(v) is not type(last):
            out.append((begin, i, last))
            begin, last = i, v
    out.append((begin, stop, last))
    return out


def value_runs(seq: Sequence, start: int, stop: int, limit: int = MAX_RUNS) -> list[list[Any]]:
    """``seq``'s values on ``[start, stop)`` as runs ``[from, to, value]`` of equal
    values; at most ``limit`` runs: longer ones are sampled (every run boundary kept is
    a real one, each value is the value at the run's start)."""
    runs = _runs(seq, start, stop)
    if len(runs) > limit:
        picked = [runs[i * len(runs) // limit] for i in range(limit)]
        runs = [
            (a, picked[i + 1][0] if i + 1 < len(picked) else stop, v)
            for i, (a, _, v) in enumerate(picked)
        ]
    return [[a, b, _value(v)] for a, b, v in runs]


@functools.lru_cache(maxsize=65536)
def compact(seq: Sequence, start: int, stop: int) -> str:
    """``seq``'s values on ``[start, stop)`` in a few characters: ``0.1`` (one value),
    ``0.1 → 0.01@20`` (the value from step 20 on), ``0.1 → … → 0.001@29 (30 values)``
    for a sequence with many. An empty range gives the value at ``start``."""
    runs = _runs(seq, start, stop) if stop > start else [(start, start + 1, seq(start))]
    fmt = format_value
    if len(runs) <= _LABEL_VALUES:
        return " → ".join(fmt(v) if i == 0 else f"{fmt(v)}@{a}" for i, (a, _, v) in enumerate(runs))
    (_, _, first), (a, _, last) = runs[0], runs[-1]
    return f"{fmt(first)} → … → {fmt(last)}@{a} ({len(runs)} values)"


@functools.lru_cache(maxsize=65536)
def _label(
    hp: tuple[tuple[str, Sequence], ...],
    parent: tuple[tuple[str, Sequence], ...] | None,
    start: int,
    stop: int,
) -> str:
    """``name=values`` of the hyper-parameters in which a node differs from its parent
    on its own steps (every one at a root)."""
    before = dict(parent or ())
    end = max(stop, start + 1)
    shown = [
        (name, seq)
        for name, seq in hp
        if name not in before
        or not (
            seq is before[name]
            or _same(_values(seq, start, end), _values(before[name], start, end))
        )
    ]
    return ", ".join(f"{name}={compact(seq, start, stop)}" for name, seq in shown or hp)


def _hp_key(node: Node) -> tuple[tuple[str, Sequence], ...]:
    return tuple(sorted(node.hp.items()))


# --------------------------------------------------------------------------- studies


def _study_state(storage: BasePlanStorage, st: StudyStatus) -> str:
    """``running`` (trials train, or a tuner holds the study's lease), ``idle`` (no
    trials, or some wait with nothing running), ``failed`` (every trial that ended
    failed), else ``finished``."""
    tuning = any(lease.node is None for lease in storage.leases(st.name))
    if st.running or tuning:
        return "running"
    if st.trials == 0 or st.pending:
        return "idle"
    if st.failed and not st.finished:
        return "failed"
    return "finished"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _saving(st: StudyStatus) -> float | None:
    """The study's saving factor (:func:`~stagetree.reports.costs.saving_ratio`)."""
    numbers = st.numbers
    if numbers is None:
        return None
    return saving_ratio(numbers["steps_saved"], round(numbers["steps_executed"]))


def _summary(storage: BasePlanStorage, st: StudyStatus) -> dict[str, Any]:
    numbers = st.numbers
    executed = round(numbers["steps_executed"]) if numbers is not None else None
    seconds = numbers["device_seconds"] if numbers is not None else None
    return {
        "name": st.name,
        "created": st.created,
        "state": _study_state(storage, st),
        "trials": st.trials,
        "finished": st.finished,
        "running": st.running,
        "failed": st.failed,
        "pending": st.pending,
        "cancelled": st.cancelled,
        "metric": st.metric,
        "mode": st.mode,
        "best": number(st.best),
        "best_trial": st.best_trial,
        "best_step": st.best_step,
        "steps_requested": st.steps_requested,
        "steps_unique": st.steps_unique,
        "steps_executed": executed,
        "merge_rate": _ratio(st.steps_requested, st.steps_unique),
        "device_seconds": number(seconds),
        "saving": _saving(st),
        "workers": dict(st.workers),
    }


def study_summary(storage: BasePlanStorage, name: str) -> dict[str, Any]:
    """The ``StudySummary`` of study ``name`` (the numbers of
    :func:`stagetree.reports.status.study_status`). ``steps_executed`` and ``device_seconds``
    are None on a storage that never counted them.

    Raises:
        PlanKeyError: no study ``name``.
    """
    return _summary(storage, study_status(storage, name))


@quiet_gc
def study_summaries(storage: BasePlanStorage, url: str = "") -> dict[str, Any]:
    """``GET /api/studies``: every study's summary and the storage-wide totals
    (:func:`stagetree.reports.status.storage_status`) of the storage at ``url``."""
    revision = storage.revision()
    status = storage_status(storage, url)
    totals = status.totals
    return {
        "revision": revision,
        "url": url,
        "studies": [_summary(storage, st) for st in status.studies],
        "totals": {
            "steps_requested": round(totals["steps_requested"]),
            "steps_unique": round(totals["steps_unique"]),
            "steps_executed": round(totals["steps_executed"]),
            "device_seconds": number(totals["device_seconds"]) or 0.0,
        },
    }


@quiet_gc
def study_detail(
    storage: BasePlanStorage, name: str, log: ActivityLog | None = None
) -> dict[str, Any]:
    """``GET /api/studies/{name}``: the study's summary and its :func:`savings`
    (``log``: see :func:`batches`).

    Raises:
        PlanKeyError: no study ``name``.
    """
    revision = storage.revision()
    meta = study_record(storage, name).get("meta") or {}
    rows = storage.trials(name, light=True)  # read once, for the status and the savings
    st = study_status(storage, name, rows)
    return {
        "revision": revision,
        "study": _summary(storage, st),
        "savings": savings(storage, name, st, log, split_trials(rows, meta)[0]),
    }


def _seconds_per_step(
    storage: BasePlanStorage, roots: Collection[str], log: ActivityLog | None
) -> float | None:
    """The median measured seconds per step of the batches that trained these trees
    (busy seconds less checkpoint loading, over steps), None before any."""
    found = batches(storage, roots, log=log).values()
    rates = [b.rate for b in found if b.state == "done" and b.rate is not None]
    return statistics.median(rates) if rates else None


def savings(
    storage: BasePlanStorage,
    name: str,
    status: StudyStatus | None = None,
    log: ActivityLog | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``Savings`` of study ``name``: what was trained for it
    (:func:`stagetree.reports.costs.study_accounting`), what sharing saved
    (:func:`~stagetree.reports.costs.steps_saved`: the finished trials' requested steps
    less those executed), and the two together, what that work would have cost without
    sharing (every trial's requested steps once all finished), at the device-seconds
    per step its own executed steps cost (the batches' median rate before it has any);
    ``ratio`` is :func:`~stagetree.reports.costs.saving_ratio`, the badge's saving. With
    :func:`_estimate` when it has requested steps and executed none yet.

    Args:
        status: the study's :func:`~stagetree.reports.status.study_status`, when the caller
            has it.
        log: see :func:`batches`.
        rows: the study's :func:`~stagetree.reports.trials.trial_rows`, when the caller has
            them.

    Raises:
        PlanKeyError: no study ``name``.
    """
    st = status if status is not None else study_status(storage, name)
    rows = rows if rows is not None else trial_rows(storage, name, light=True)
    roots = list(dict.fromkeys(str(t["root_key"]) for t in rows))
    numbers = st.numbers
    executed = round(numbers["steps_executed"]) if numbers is not None else None
    seconds = numbers["device_seconds"] if numbers is not None else None
    # One rate for both sides (as `stagetree run` reports the saving): what the study's
    # own executed steps cost; the batches' median rate before it has any.
    per_step: float | None = None
    if numbers is not None and numbers["seconds_per_step"] > 0:
        per_step = numbers["seconds_per_step"]
    else:
        per_step = _seconds_per_step(storage, roots, log)
    requested = st.steps_requested
    # Without sharing, the work done so far: what ran plus what sharing spared the
    # finished trials (all of requested once every trial finished).
    saved = round(numbers["steps_saved"]) if numbers is not None else None
    alone = executed + saved if executed is not None and saved is not None else None
    return {
        "alone": {
            "steps": alone,
            "device_seconds": number(alone * per_step)
            if alone is not None and per_step is not None
            else None,
        },
        "ran": {"steps": executed, "device_seconds": number(seconds)},
        "saved": {
            "steps": saved,
            "device_seconds": number(saved * per_step)
            if saved is not None and per_step is not None
            else None,
        },
        "ratio": _saving(st),
        "seconds_per_step": number(per_step),
        "estimate": _estimate(storage, st, rows) if requested and not executed else None,
    }


def _estimate(
    storage: BasePlanStorage, st: StudyStatus, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """What the simulator expects of the study's plan before anything ran: its unique
    steps, and the makespan bound of :func:`stagetree.stages.work` (longest path,
    or unique work shared by the workers) with the simulator's step-cost model, at
    the storage's recorded worker count (1 when none was recorded)."""
    roots = {str(t["root_key"]) for t in rows}
    nodes = {n.id: n for root in roots for n in storage.nodes(root)}
    configs: dict[str, Mapping[str, Any]] = {}
    for root in roots:
        try:
            configs[root] = storage.root_config(root)
        except PlanKeyError:
            configs[root] = {}
    ends = [
        (int(t["node"]), int(t["step"]))
        for t in rows
        if t.get("node") is not None and t["node"] in nodes
    ]
    workers = max([len((s.get("meta") or {}).get("workers") or {}) for s in storage.studies()])
    workers = max(workers, 1)
    bound = work(nodes, configs, ends, StepCost(), workers)
    return {
        "steps_alone": st.steps_requested,
        "steps_unique": st.steps_unique,
        "merge_rate": _ratio(st.steps_requested, st.steps_unique),
        "workers": workers,
        "makespan_seconds": number(bound.lower_bound),
        "source": "simulator",
    }


# --------------------------------------------------------------------------- batches


def _worker_names(found: Iterable[Batch]) -> dict[tuple[str, int], str]:
    """A name per ``(location, worker)``: the worker number alone when every batch ran
    in one process, ``host:pid/worker`` across processes."""
    pairs = {(b.location, b.worker) for b in found}
    several = len({loc for loc, _ in pairs}) > 1
    return {(loc, w): f"{loc}/{w}" if several and loc else str(w) for loc, w in pairs}


# --------------------------------------------------------------------------- the tree


@dataclass
class TreeData:
    """Everything :func:`build_tree` needs, read from the storage by :func:`read_tree`.

    Attributes:
        revision: the storage's revision, read first.
        name: the study.
        roots: the root keys of its trials' trees, in the order of their first trial.
        nodes: every node of those trees, by id.
        requests: their requests.
        checkpoints: their durable checkpoints.
        metric_steps: the largest step with metrics per node.
        trials: the study's trial rows (its latest trainer version; light rows,
            without config and sequences).
        others: ``(node, step)`` ends of every other trial on those trees (other
            studies, other versions).
        batches: the batches that trained those trees.
    """

    revision: int
    name: str
    roots: list[str]
    nodes: dict[int, Node]
    requests: list[Request]
    checkpoints: dict[tuple[int, int], CheckpointRecord]
    metric_steps: dict[int, int]
    trials: list[dict[str, Any]]
    others: list[tuple[int, int]]
    batches: dict[str, Batch]


@quiet_gc
def read_tree(storage: BasePlanStorage, name: str, log: ActivityLog | None = None) -> TreeData:
    """Read what study ``name``'s stage tree is made of: a few bulk reads per tree
    (the batches through ``log`` when given, see :func:`batches`).

    Raises:
        PlanKeyError: no study ``name``.
    """
    revision = storage.revision()
    record = study_record(storage, name)
    mine = storage.trials(name, light=True)
    own, _ = split_trials(mine, record.get("meta") or {})
    roots = list(dict.fromkeys(str(t["root_key"]) for t in own))
    ids = {t["id"] for t in own}
    wanted = set(roots)
    everyone = [
        t
        for s in storage.studies()
        if s["name"] != name
        for t in storage.trials(s["name"], light=True)
    ]
    others = [
        (int(t["node"]), int(t["step"]))
        for t in [*mine, *everyone]
        if t["id"] not in ids and t["root_key"] in wanted and t.get("node") is not None
    ]
    nodes: dict[int, Node] = {}
    requests: list[Request] = []
    checkpoints: dict[tuple[int, int], CheckpointRecord] = {}
    metric_steps: dict[int, int] = {}
    for root in roots:
        nodes.update((n.id, n) for n in storage.nodes(root))
        requests.extend(storage.requests(root))
        checkpoints.update(storage.checkpoints(root))
        metric_steps.update(storage.metric_steps(root))
    return TreeData(
        revision,
        name,
        roots,
        nodes,
        requests,
        checkpoints,
        metric_steps,
        own,
        others,
        batches(storage, roots, log=log),
    )


@dataclass
class _Progress:
    """Per node: how far anything asks it to go (``end``), how far it is trained
    (``done``), its checkpoints, and the furthest step that live, failed and cancelled
    requests in its subtree need it trained to (-1: none)."""

    end: dict[int, int]
    done: dict[int, int]
    checkpoints: dict[int, list[int]]
    live: dict[int, int]
    failed: dict[int, int]
    cancelled: dict[int, int]
    own_failed: set[int]
    wanted: dict[int, int]


def _progress(data: TreeData, order: list[int]) -> _Progress:
    """Each node's :class:`_Progress`: from its own requests, checkpoints and metric
    steps, then bottom-up (children have larger ids): a child needs its parent trained
    to its branch step, and a child that trained any step proves its parent got there."""
    nodes = data.nodes
    end = {i: nodes[i].branch_step for i in order}
    done = {i: max(nodes[i].branch_step, data.metric_steps.get(i, 0)) for i in order}
    ckpts: dict[int, list[int]] = defaultdict(list)
    for key, step in sorted(data.checkpoints):
        if key in nodes:
            ckpts[key].append(step)
            done[key] = max(done[key], step)
    needs = {state: dict.fromkeys(order, -1) for state in ("live", "failed", "cancelled")}
    kind = {
        RequestState.PENDING: "live",
        RequestState.SCHEDULED: "live",
        RequestState.FAILED: "failed",
        RequestState.CANCELLED: "cancelled",
    }
    own_failed: set[int] = set()
    # How far any request (in any state) of the node or below needs it: past that, the
    # node only carries the branch points of announced (declared) trials.
    wanted = dict.fromkeys(order, -1)
    for r in data.requests:
        if r.node not in nodes:
            continue
        end[r.node] = max(end[r.node], r.step)
        wanted[r.node] = max(wanted[r.node], r.step)
        if r.state == RequestState.DONE:
            done[r.node] = max(done[r.node], r.step)
        else:
            need = needs[kind[r.state]]
            need[r.node] = max(need[r.node], r.step)
            if r.state == RequestState.FAILED:
                own_failed.add(r.node)
    for i in reversed(order):
        p, b = nodes[i].parent, nodes[i].branch_step
        if p is None or p not in nodes:
            continue
        end[p] = max(end[p], b)
        if done[i] > b:
            done[p] = max(done[p], b)
        if wanted[i] >= 0 or done[i] > b:
            wanted[p] = max(wanted[p], b)
        for need in needs.values():
            if need[i] >= 0:
                need[p] = max(need[p], b)
    return _Progress(
        {i: max(end[i], done[i]) for i in order},
        done,
        ckpts,
        needs["live"],
        needs["failed"],
        needs["cancelled"],
        own_failed,
        {i: max(wanted[i], done[i]) for i in order},
    )


def _through(data: TreeData, order: list[int]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Per node, the study's trials that train some of its steps (sorted), and how many
    trials of others do: a trial trains steps of its end node and of every ancestor but
    the one its path leaves at that ancestor's own branch step."""
    nodes = data.nodes
    through: dict[int, list[int]] = {i: [] for i in order}  # every trial below
    others_through = dict.fromkeys(order, 0)
    for t in data.trials:
        if t.get("node") is not None and t["node"] in nodes:
            through[int(t["node"])].append(int(t["id"]))
    for key, _ in data.others:
        if key in nodes:
            others_through[key] += 1
    listed = {i: list(through[i]) for i in order}
    others_listed = dict(others_through)
    for i in reversed(order):
        p = nodes[i].parent
        if p is None or p not in nodes:
            continue
        through[p].extend(through[i])
        others_through[p] += others_through[i]
        if nodes[i].branch_step > nodes[p].branch_step:
            listed[p].extend(through[i])
            others_listed[p] += others_through[i]
    return {i: sorted(v) for i, v in listed.items()}, others_listed


def _training(data: TreeData, done: Mapping[int, int]) -> dict[int, str]:
    """The worker training each node now: a running batch with a segment on it that
    is not trained yet."""
    names = _worker_names(data.batches.values())
    out: dict[int, str] = {}
    for batch in data.batches.values():
        if batch.state != "running":
            continue
        for node, _a, b in batch.segments:
            if node in data.nodes and b > done[node]:
                out.setdefault(node, names[(batch.location, batch.worker)])
    return out


def _state(i: int, progress: _Progress, training: Mapping[int, str], start: int) -> str:
    """A node's state: the rules of ``docs/dashboard-api.md``; a failure or live request
    below that needs this node trained further counts for it too; a node no request
    needs and nothing trained is only announced (``declared``)."""
    done = progress.done[i]
    if i in training:
        return "training"
    if progress.wanted[i] <= start:
        return "declared"
    if i in progress.own_failed:
        return "failed"
    if progress.live[i] > done:
        return "pending"
    if progress.failed[i] > done:
        return "failed"
    if progress.cancelled[i] > done:
        return "cancelled"
    return "trained"


@quiet_gc
def build_tree(data: TreeData, previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The stage tree of :class:`TreeData` (``GET /api/studies/{name}/tree``, full):
    one ``Node`` per plan node of the study's trees (``docs/dashboard-api.md`` gives
    each field and the rules of ``state``).

    Args:
        previous: a full tree of the same study and storage built earlier: the nodes
            that did not change are its node objects (and their labels are not made
            again), so that trees of successive revisions share them and
            :func:`tree_delta` finds the unchanged ones by identity.
    """
    nodes = data.nodes
    order = sorted(nodes)  # a parent's id is smaller than its children's
    root_index = {key: i for i, key in enumerate(data.roots)}
    progress = _progress(data, order)
    trials, others = _through(data, order)
    training = _training(data, progress.done)
    before = {n["id"]: n for n in previous["nodes"]} if previous is not None else {}
    out: list[dict[str, Any]] = []
    for i in order:
        node = nodes[i]
        stop = progress.end[i]
        old = before.get(i)
        if (
            old is not None
            and old["end"] == stop
            and old["parent"] == node.parent
            and old["start"] == node.branch_step
        ):
            label = old["label"]  # a node's label depends on its (fixed) values up to end
        else:
            parent = nodes.get(node.parent) if node.parent is not None else None
            label = _label(
                _hp_key(node),
                _hp_key(parent) if parent is not None else None,
                node.branch_step,
                stop,
            )
        new = {
            "id": i,
            "parent": node.parent,
            "root": root_index.get(node.root_key, 0),
            "start": node.branch_step,
            "end": stop,
            "done": progress.done[i],
            "wanted": progress.wanted[i],
            "state": _state(i, progress, training, node.branch_step),
            "worker": training.get(i),
            "checkpoints": progress.checkpoints.get(i, []),
            "trials": trials[i],
            "others": others[i],
            "label": label,
        }
        out.append(old if old is not None and old == new else new)
    return {
        "revision": data.revision,
        "full": True,
        "max_step": max(progress.end.values(), default=0),
        "roots": list(data.roots),
        "nodes": out,
        "removed": [],
    }


def stage_tree(storage: BasePlanStorage, name: str) -> dict[str, Any]:
    """``GET /api/studies/{name}/tree``: the whole stage tree of study ``name``
    (:func:`read_tree`, then :func:`build_tree`).

    Raises:
        PlanKeyError: no study ``name``.
    """
    return build_tree(read_tree(storage, name))


def tree_delta(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``new`` (a full tree) as a delta from ``old`` (the full tree of an earlier
    revision): ``"full": false`` and only the nodes that are new or changed. Nodes are
    never removed from a plan, so ``removed`` stays empty."""
    before = {n["id"]: n for n in old["nodes"]}
    return {
        **new,
        "full": False,
        "nodes": [
            n
            for n in new["nodes"]
            if (b := before.get(n["id"])) is not n and b != n  # shared: unchanged
        ],
        "removed": [],
    }


@quiet_gc
def node_detail(
    storage: BasePlanStorage, name: str, node_id: int, tree: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``GET /api/studies/{name}/nodes/{id}``: the node as in the tree, its sequences
    as runs over its steps (:func:`value_runs`), its metrics and this study's trials
    through it.

    Args:
        tree: the study's full tree when the caller has it (else it is built).

    Raises:
        PlanKeyError: no study ``name``, or no node ``node_id`` in its trees.
    """
    tree = tree if tree is not None else stage_tree(storage, name)
    found = next((n for n in tree["nodes"] if n["id"] == node_id), None)
    if found is None:
        raise PlanKeyError(f"no node {node_id} in the stage tree of study {name!r}")
    node = storage.node(node_id)
    start, stop = found["start"], max(found["end"], found["start"] + 1)
    metrics = storage.metrics(node.root_key, [node_id]).get(node_id, {})
    rows = {t["id"]: t for t in trial_rows(storage, name, light=True)}
    return {
        "revision": tree["revision"],
        "node": found,
        "hp": {k: value_runs(seq, start, stop) for k, seq in sorted(node.hp.items())},
        "metrics": [[step, _metrics(values)] for step, values in sorted(metrics.items())],
        "trials": [
            {"id": t, "steps": int(rows[t]["steps"]), "state": str(rows[t]["state"])}
            for t in found["trials"]
            if t in rows
        ],
    }


# --------------------------------------------------------------------------- curves


def _series(points: Mapping[int, Mapping[str, float]], metric: str | None) -> list[list[Any]]:
    """``[step, value]`` of ``metric`` at each point that has it (:func:`number`)."""
    isfinite = math.isfinite
    out: list[list[Any]] = []
    if metric is None:
        return out
    for step, values in points.items():
        if metric in values:
            x = values[metric]
            out.append([step, x if type(x) is float and isfinite(x) else number(x)])
    return out


def _trial_paths(
    curves: TreeCurves, rows: Iterable[Mapping[str, Any]]
) -> dict[int, list[tuple[int, int, int]]]:
    """``(node, first, last)`` of each trial's path, by trial id (trials not in a tree
    yet have none)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for t in rows:
        if t.get("node") is None:
            out[int(t["id"])] = []
            continue
        nodes = curves.nodes(str(t["root_key"]))
        try:
            out[int(t["id"])] = path_segments(nodes, int(t["node"]), int(t["steps"]))
        except KeyError:  # committed after the tree was read
            out[int(t["id"])] = []
    return out


@quiet_gc
def curves(storage: BasePlanStorage, name: str, metric: str | None = None) -> dict[str, Any]:
    """``GET /api/studies/{name}/curves``: the learning curves of the study's trials as
    shared segments: the points of ``metric`` (default: the study's ranked metric,
    :func:`stagetree.reports.trials.ranked_metric`) per plan node, and per trial the nodes of
    its path with ``ends``, the last step of each node on that path (a trial's curve is
    each node's points after the previous node's end up to its own).

    Raises:
        PlanKeyError: no study ``name``.
    """
    revision = storage.revision()
    meta = study_record(storage, name).get("meta") or {}
    rows = trial_rows(storage, name, light=True)
    tree_curves = TreeCurves(storage)
    records = final_records(storage, rows, tree_curves)  # what the ranking reads
    ranked, ranked_mode, _ = ranked_metric(meta, records)
    metric = metric or ranked
    mode = ranked_mode if metric == ranked else metric_mode(metric or "", meta)
    best = best_trial(records, metric, mode) if metric else None
    paths = _trial_paths(tree_curves, rows)
    names: set[str] = set()
    segments: dict[str, list[list[Any]]] = {}
    for t in rows:
        metrics = tree_curves.metrics(str(t["root_key"]))
        for node, _first, _last in paths[int(t["id"])]:
            key = str(node)
            if key in segments:
                continue
            points = metrics.get(node, {})
            names.update(*points.values())
            segments[key] = _series(points, metric)
    return {
        "revision": revision,
        "metric": metric,
        "mode": mode,
        "metrics": sorted(names),
        "best_trial": best.id if best is not None else None,
        "segments": {k: v for k, v in segments.items() if v},
        "trials": [
            {
                "id": int(t["id"]),
                "state": str(t["state"]),
                "steps": int(t["steps"]),
                "rung": int(t["steps"]),
                "nodes": [n for n, _, _ in paths[int(t["id"])]],
                "ends": [last for _, _, last in paths[int(t["id"])]],
            }
            for t in rows
        ],
    }


# --------------------------------------------------------------------------- trials


def _checkpoint_url(name: str, trial_id: int) -> str:
    return f"/api/studies/{urllib.parse.quote(name, safe='')}/trials/{trial_id}/checkpoint"


@quiet_gc
def trials_table(storage: BasePlanStorage, name: str) -> dict[str, Any]:
    """``GET /api/studies/{name}/trials``: one row per trial of the study's latest
    trainer version: config, sequences in compact form over its steps
    (:func:`compact`), its metrics at its last step with metrics, the first line of its
    error, and the download address of its final checkpoint when the plan holds one.

    Raises:
        PlanKeyError: no study ``name``.
    """
    revision = storage.revision()
    meta = study_record(storage, name).get("meta") or {}
    rows = trial_rows(storage, name)
    records = final_records(storage, rows)  # what the ranking reads
    metric = ranked_metric(meta, records)[0]
    ckpts: dict[tuple[int, int], CheckpointRecord] = {}
    for root in dict.fromkeys(str(t["root_key"]) for t in rows):
        ckpts.update(storage.checkpoints(root))
    finals = {r.id: r.metrics[r.steps] for r in records if r.metrics}
    lasts = last_points(storage, rows, finals)
    out = []
    for t, rec in zip(rows, records):
        last = lasts.get(rec.id)
        end = (t.get("node"), t.get("step"))
        has_ckpt = t["state"] == TrialState.DONE and end in ckpts
        out.append(
            {
                "id": rec.id,
                "state": rec.state,
                "steps": rec.steps,
                "config": rec.config,
                "hp": {k: compact(seq, 0, rec.steps) for k, seq in sorted(rec.hp.items())},
                "metrics": _metrics(last[1]) if last is not None else {},
                "error": rec.error.summary() if rec.error is not None else None,
                "checkpoint": _checkpoint_url(name, rec.id) if has_ckpt else None,
            }
        )
    return {"revision": revision, "metric": metric, "trials": out}


def checkpoint_of(
    storage: BasePlanStorage, name: str, trial_id: int
) -> tuple[str, int, int] | None:
    """``(ref, step, nbytes)`` of the checkpoint at trial ``trial_id``'s final
    ``(node, step)``, or None when the plan holds none there.

    Raises:
        PlanKeyError: no study ``name``, or no trial ``trial_id`` of it.
    """
    study_record(storage, name)
    try:
        trial = storage.trial(trial_id)
    except PlanKeyError:
        trial = None
    if trial is None or trial["study"] != name:
        raise PlanKeyError(f"no trial {trial_id} in study {name!r}")
    if trial.get("node") is None or trial.get("step") is None:
        return None
    record = storage.checkpoint(int(trial["node"]), int(trial["step"]))
    if record is None:
        return None
    return record.ref, int(trial["step"]), int(record.nbytes)


# --------------------------------------------------------------------------- timeline


def _trials_by_node(
    paths: Mapping[int, Seq[tuple[int, int, int]]], nodes: Mapping[int, Node]
) -> dict[int, list[tuple[int, int]]]:
    """``node -> [(last, trial)]`` sorted by ``last``: the trials that train steps
    ``[branch step, last)`` of the node."""
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for trial, path in paths.items():
        for node, _first, last in path:
            if last > nodes[node].branch_step:
                out[node].append((last, trial))
    for entries in out.values():
        entries.sort()
    return out


def _batch_trials(
    batch: Batch, by_node: Mapping[int, list[tuple[int, int]]], nodes: Mapping[int, Node]
) -> list[int]:
    """The study's trials whose path trains a step of one of the batch's segments."""
    out: set[int] = set()
    for node, a, b in batch.segments:
        entries = by_node.get(node)
        if not entries or nodes[node].branch_step >= b:
            continue
        first = bisect.bisect_right(entries, (a, math.inf))  # the trials going past a
        out.update(trial for _, trial in entries[first:])
    return sorted(out)


@quiet_gc
def timeline(
    storage: BasePlanStorage, name: str, after: int = 0, log: ActivityLog | None = None
) -> dict[str, Any]:
    """``GET /api/studies/{name}/timeline``: the batches that trained the study's
    trees (which worker trained which segments when, its checkpoint saves, its load
    time) and each worker's busy and idle seconds. With ``after``, only the batches
    with an activity record after that sequence number (whole batches). ``log``: see
    :func:`batches`.

    Raises:
        PlanKeyError: no study ``name``.
    """
    revision = storage.revision()
    now = time.time()
    study_record(storage, name)
    rows = trial_rows(storage, name, light=True)
    roots = list(dict.fromkeys(str(t["root_key"]) for t in rows))
    found = batches(storage, roots, now, log)
    tree_curves = TreeCurves(storage)
    paths = {k: v for k, v in _trial_paths(tree_curves, rows).items() if v}
    nodes = {i: n for root in roots for i, n in tree_curves.nodes(root).items()}
    by_node = _trials_by_node(paths, nodes)
    names = _worker_names(found.values())
    index = {root: i for i, root in enumerate(roots)}
    seq = max((b.last_seq for b in found.values()), default=after)
    shown = []
    for b in found.values():
        if b.last_seq <= after:
            continue
        shown.append(
            {
                "key": b.key,
                "worker": names[(b.location, b.worker)],
                "location": b.location,
                "root": index.get(b.root_key, 0),
                "segments": [list(s) for s in b.segments],
                "start_step": b.start_step,
                "stop_step": b.stop_step,
                "started": b.started,
                "ended": b.ended,
                "state": b.state,
                "load_seconds": b.load_seconds,
                "busy_seconds": b.busy_seconds,
                "saves": [list(s) for s in b.saves],
                "fused": b.fused,
                "trials": _batch_trials(b, by_node, nodes),
            }
        )
    return {
        "revision": revision,
        "seq": max(seq, after),
        "now": now,
        "batches": shown,
        "workers": _workers(found.values(), names, now),
    }


def _workers(
    found: Iterable[Batch], names: Mapping[tuple[str, int], str], now: float
) -> list[dict[str, Any]]:
    """Busy seconds (its batches) and idle seconds (the rest of the span from its first
    start to its last end, or now) of each worker."""
    busy: dict[str, float] = defaultdict(float)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for b in found:
        w = names[(b.location, b.worker)]
        busy[w] += b.busy_seconds
        began = b.started if b.started is not None else (b.ended or now) - b.busy_seconds
        first[w] = min(first.get(w, began), began)
        last[w] = max(last.get(w, began), b.ended if b.ended is not None else now)
    return [
        {
            "worker": w,
            "busy_seconds": busy[w],
            "idle_seconds": max(last[w] - first[w] - busy[w], 0.0),
        }
        for w in sorted(busy, key=_worker_order)
    ]


def _worker_order(name: str) -> tuple[str, int]:
    head, _, tail = name.rpartition("/")
    return (head, int(tail)) if tail.isdigit() else (name, 0)
