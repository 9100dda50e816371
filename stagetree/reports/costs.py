"""What a study cost and what sharing saved: :func:`accounting`,
:func:`study_accounting` (:meth:`Study.stats <stagetree.Study.stats>`) and
:func:`efficiency` (how close a run came to the limit of this system).

**What a study cost** (:func:`study_accounting`). Executed steps and device-seconds
are what was trained for the study's requests (the engine's ``study:<name>@<version>``
scope, as fair share charges it): a step two studies needed while it trained counts
for both, a step another study had trained before costs this one nothing. Its
device-seconds are the busy time of the batches that trained for it (settled when
each batch ends; the training time of its steps while it runs), as the storage-wide
counters count them: studies that share nothing add up to the storage. On a
storage written before studies were counted, the sums over the plan trees its trials
use (``root:<key>`` scopes). The storage-wide counters (scope ``engine``) count every
stage once.

Pure functions of a :class:`~stagetree.plan.BasePlanStorage`, read-only (see
:mod:`stagetree.reports.trials`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from stagetree.identity import split_trials
from stagetree.records import RunRecord, TrialState
from stagetree.reports.activity import batches
from stagetree.reports.trials import _studies, _trials, quiet_gc, trained_counters, tree_counters
from stagetree.stages import unique_steps

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage

__all__ = [
    "COUNT_KEYS",
    "EFFICIENCY_KEYS",
    "accounting",
    "efficiency",
    "saving_ratio",
    "steps_saved",
    "study_accounting",
]

#: The figures of :func:`study_accounting` and :func:`efficiency` that count things
#: (trials, steps, bytes, workers): ints; every other figure is seconds or a ratio (float).
COUNT_KEYS = frozenset(
    {
        "trials",
        "steps_requested",
        "steps_requested_finished",
        "steps_unique",
        "steps_executed",
        "ckpt_bytes",
        "live_splits",
        "splits_missed",
        "workers_lost",
        "steps_lost",
        "fused_jobs",
        "fused_members",
        "workers",
        "steps_unique_trained",
    }
)


def _typed(numbers: dict[str, float]) -> dict[str, float]:
    """``numbers`` with the counts (:data:`COUNT_KEYS`) as ints, the rest as floats."""
    return {k: round(v) if k in COUNT_KEYS else float(v) for k, v in numbers.items()}


def accounting(
    steps_requested: float,
    steps_unique: float,
    steps_executed: float,
    device_seconds: float,
    steps_finished: float | None = None,
) -> dict[str, float]:
    """What sharing saved: the steps requested by the trials that finished
    (``steps_finished``; all of ``steps_requested`` when not given) minus the steps
    executed, never negative, and device-seconds saved estimated as saved steps times
    the measured device-seconds per executed step. The steps of a failed or cancelled
    trial are not saved: nothing was trained for it that sharing spared. The one
    definition of the saving: the run report, ``stagetree status``, the dashboard and
    the progress line (:func:`steps_saved`) show it.

    Returns:
        ``steps_requested``, ``steps_unique``, ``steps_executed``, ``merge_rate``
        (requested / unique, 1.0 when nothing is unique), ``device_seconds``,
        ``seconds_per_step`` (0.0 before any step ran), ``steps_saved``,
        ``device_seconds_saved``.
    """
    finished = steps_requested if steps_finished is None else steps_finished
    saved = steps_saved(finished, steps_executed)
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


def steps_saved(steps_finished: float, steps_executed: float) -> float:
    """Steps sharing saved: those requested by the trials that finished minus those
    executed, never negative (while trials run, their steps executed so far count and
    theirs requested do not yet: the saving never includes work still to do)."""
    return max(float(steps_finished) - float(steps_executed), 0.0)


def saving_ratio(steps_saved: float, steps_executed: float) -> float | None:
    """The saving as a factor: ``(steps executed + steps saved) / steps executed``, with
    ``steps_saved`` as :func:`steps_saved` defines it. At the end of a study whose
    trials all finished it is requested / executed; while it runs it counts only what
    the finished trials were spared (never the work still to do, never a failed
    trial's steps), so it never shows more than the run will end with for the same
    work. The dashboard's badge shows it. None before any step ran."""
    if steps_executed <= 0:
        return None
    return (float(steps_executed) + max(float(steps_saved), 0.0)) / float(steps_executed)


def _study_accounting(
    storage: BasePlanStorage, trials: list[dict[str, Any]], study: str | None = None
) -> tuple[dict[str, float], bool]:
    """:func:`study_accounting` of ``trials``, and whether any counters were found for
    them (a storage written before studies or trees were counted has none)."""
    requested = float(sum(int(t["steps"]) for t in trials))
    roots = {str(t["root_key"]) for t in trials}
    nodes = {n.id: n for root in roots for n in storage.nodes(root)}
    ends = [(int(t["node"]), int(t["step"])) for t in trials if t.get("node") is not None]
    unique = float(unique_steps(nodes, [e for e in ends if e[0] in nodes]))
    trees = tree_counters(storage, roots)
    # What was trained for this study's requests when the engine kept it (shared work
    # counts for every study that needed it); else all that its trees cost.
    trained, counted = trained_counters(storage, study, trials, trees)
    everything = storage.stats("engine")
    numbers: dict[str, float] = {
        "trials": len(trials),
        "steps_requested": requested,
        "steps_requested_finished": sum(
            int(t["steps"]) for t in trials if t["state"] == TrialState.DONE
        ),
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
    return _typed(numbers), counted


def study_accounting(storage: BasePlanStorage, study: str, version: Any = None) -> dict[str, float]:
    """What ``study`` (its trials of ``version``, as in :func:`trial_records`) asked
    for and cost, as :meth:`Study.stats <stagetree.Study.stats>` returns it.

    Returns:
        ``trials``; ``steps_requested`` (total steps of the trials),
        ``steps_requested_finished`` (those of the trials that finished: what the
        saving is counted against, see :func:`accounting`), ``steps_unique``
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
    :func:`stagetree.reports.activity.batches`).

    The run is the one :meth:`Study.tune <stagetree.Study.tune>` (or
    :meth:`~stagetree.Study.begin_tuning`) recorded in the study's meta (``run``:
    ``started``, ``ended``, ``workers``, ``owner``); its batches are those its engine
    (``owner``) started on the study's plan trees between those times. With ``W``
    workers and the wall-clock ``T`` from ``started`` to ``ended``, or to the end of
    the last batch it started if later (now while it runs; the run's last activity
    record when its engine died without saying)::

        efficiency = (unique steps x median seconds per step trained alone / W) / T

    (the limit capped at what the other parts leave of ``T``: see
    ``scheduling_seconds``)

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
      and steps slower than the median. Never negative: when steps trained faster
      than the median, so that the limit would exceed what the other parts leave of
      ``W x T``, the limit is that rest (the parts still add up to ``T``) and
      ``scheduling_seconds`` is 0.

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
    record = _studies(storage).get(study)
    meta = (record or {}).get("meta") or {}
    run = RunRecord.from_meta(meta)
    if run is None or run.started is None:
        return {}
    if version is not None and run.version not in (None, version):
        return {}
    rows = storage.trials(study, light=True) if rows is None else rows
    roots = {str(t["root_key"]) for t in split_trials(rows, meta, version)[0]}
    now = time.time() if now is None else float(now)
    start, owner = run.started, run.owner
    ended = run.ended
    found = [
        b
        for b in batches(storage, roots, now=now).values()
        if (owner is None or b.owner == owner) and b.started is not None and b.started >= start
    ]
    if ended is not None:
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
    count = int(run.workers or workers or len({(b.location, b.worker) for b in found}))
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
    # The limit is at most the worker-time the other parts leave: steps that trained
    # faster than the median would otherwise make the remainder negative.
    rest = max(count * wall - count * startup - idle - load - save_wait, 0.0)
    limit = min(limit, rest)
    scheduling = rest - limit
    return _typed(
        {
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
    )


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
    if not storage.shared:
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
