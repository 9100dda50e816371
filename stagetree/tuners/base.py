"""Tuner contract, the runner protocol and the replaying wrapper every tuner uses.

A tuner is a seeded, deterministic coroutine: given its seed and the *order* in which
results arrive, it always takes the same decisions. Completion order (and the worker
count) are its only nondeterministic inputs, so :class:`ReplayingRunner` logs every
completion the tuner observes, every worker count it reads and every decision it takes
(``runner.append_log``); a study that is killed and started again replays the logged
inputs (``runner.read_log``), the tuner takes the same decisions, and it goes on
asynchronously once the log is used up.

Log records are small JSON objects, one per event, in the order they happened::

    {"event": "submit", "key": 0, "trial": 0, "steps": 1, "fp": "..."}  # new trial
    {"event": "promote", "key": 5, "trial": 2, "steps": 4, "fp": "..."}  # more steps
    {"event": "done", "key": 0, "status": "ok"}      # "ok" | "failed" | "cancelled"
    {"event": "workers", "n": 8}                       # worker count seen (an input too)
    {"event": "stop", "trial": 3, "steps": 6}          # other decisions: stop, exploit...
    {"event": "diverged", "keep": 17, "reason": "..."}  # see below

``key`` numbers submissions in order; ``fp`` fingerprints the trial's config and
sequences. When a replayed run does not take the logged decision (the tuner's
arguments or the space changed, or a trial that succeeded before fails now), the
wrapper warns (:class:`ReplayDivergedWarning`), appends a ``diverged`` record that
drops the rest of the old log (``keep`` = number of records still valid) and goes on
live from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import heapq
import json
import math
import random
import warnings
from abc import ABC, abstractmethod
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Set
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from stagetree.exceptions import (
    ReplayDivergedWarning,
    StagetreeWarning,
    TrialCancelledError,
    TrialFailedError,
    TunerError,
)
from stagetree.hp import dumps_hp
from stagetree.ranking import MODES, best_key, ranked_ids, signed_value
from stagetree.records import trial_fingerprint
from stagetree.space import strict_json
from stagetree.tuners.optuna_bridge import (
    SampledSpecs,
    SamplerBridge,
    check_sampler,
    check_sampler_space,
)

if TYPE_CHECKING:
    from stagetree.hp import Sequence

__all__ = [
    "SUBMITTED",
    "Job",
    "JobQueue",
    "ReplayDivergedWarning",
    "ReplayingRunner",
    "ResultLog",
    "Trial",
    "TrialResult",
    "TrialRunner",
    "Tuner",
    "draw_specs",
    "iter_specs",
    "rung_levels",
    "space_size",
    "submitted_fingerprint",
]


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What a trial trained to ``steps`` reports.

    Attributes:
        config: fixed hyper-parameters of the trial.
        hp: sequential hyper-parameters by name.
        steps: the number of steps the trial was trained for.
        metrics: metrics at ``steps`` (``evaluate()``'s, with ``train()``'s of that
            step).
        history: all known metrics at steps ``<= steps``: the learning curve (see
            ``Study(eval_every=...)``); left empty, it becomes ``{steps: metrics}``.
    """

    config: dict[str, Any]
    hp: dict[str, Sequence]
    steps: int
    metrics: dict[str, float]
    history: dict[int, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.history:
            object.__setattr__(self, "history", {self.steps: dict(self.metrics)})


#: In the task of a submission a :class:`ReplayingRunner` makes: the ``config`` and
#: ``hp`` dicts it gives ``runner.submit`` and their trial's fingerprint (logged with
#: the decision), so that a runner that keys trials by fingerprint need not compute it
#: again (:func:`submitted_fingerprint`).
SUBMITTED: contextvars.ContextVar[tuple[dict[str, Any], dict[str, Any], str] | None] = (
    contextvars.ContextVar("stagetree_submitted", default=None)
)


def submitted_fingerprint(config: dict[str, Any], hp: dict[str, Any]) -> str:
    """The fingerprint of the trial ``(config, hp)`` (:attr:`Trial.fingerprint`): the
    one its :class:`ReplayingRunner` logged when these are the very dicts it submits in
    this task, else computed."""
    given = SUBMITTED.get()
    if given is not None and given[0] is config and given[1] is hp:
        return given[2]
    return trial_fingerprint(config, hp)


@runtime_checkable
class TrialRunner(Protocol):
    """What a tuner needs from a study.

    ``submit`` trains (or resumes, or answers from the plan) the trial up to ``steps``
    and returns its result; it raises :class:`~stagetree.exceptions.TrialFailedError`
    if training failed and :class:`~stagetree.exceptions.TrialCancelledError` if the
    request was cancelled. ``check(config, hp)`` raises when a trial does not fit the
    study: it is called before a submission is logged, so refused input leaves no
    record. ``declare(trials)`` announces ``(config, hp)`` pairs the tuner may submit
    later (a study plans checkpoints where they will branch off; decisions never depend
    on it); the optional ``plan_ahead(horizon, rungs)`` moves the horizon of later
    declarations and names the steps results are asked at (see
    :meth:`ReplayingRunner.plan_ahead`). ``append_log`` stores one JSON-serialisable
    record durably for this study; ``read_log`` returns the records of previous runs of
    this study in the order they were appended.
    """

    async def submit(
        self, config: dict[str, Any], hp: dict[str, Sequence], steps: int
    ) -> TrialResult:
        """Train the trial up to ``steps`` and return its result."""
        ...

    def num_workers(self) -> int:
        """How many trials can train at the same time."""
        ...

    def check(self, config: dict[str, Any], hp: dict[str, Sequence]) -> None:
        """Raise when the trial does not fit the study (nothing is written)."""
        ...

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Sequence]]]) -> None:
        """Announce trials that may be submitted later."""
        ...

    def append_log(self, record: dict[str, Any]) -> None:
        """Store one record durably."""
        ...

    def read_log(self) -> list[dict[str, Any]]:
        """Records of previous runs of this study, in order."""
        ...


@dataclass(frozen=True, eq=False, slots=True)
class Trial:
    """One configuration as a tuner sees it: a tuner-wide ``id`` (0, 1, ... in the order
    the tuner created them), fixed ``config`` and sequences ``hp``."""

    id: int
    config: dict[str, Any]
    hp: dict[str, Sequence]
    # Slots, not an instance dict: a tuner keeps one Trial per trial of the study; the
    # fingerprint is computed when a submission is logged, not kept (memory per trial).

    @property
    def fingerprint(self) -> str:
        """Short stable hash of the config and the sequences' JSON, for the replay log."""
        return trial_fingerprint(self.config, self.hp)


def _same_items(a: Mapping[Any, Any], b: Mapping[Any, Any]) -> bool:
    """Whether two mappings hold equal keys in the same order with the very same
    values (then one may stand for the other, to the bit)."""
    return len(a) == len(b) and all(
        type(k) is type(j) and k == j and v is w for (k, v), (j, w) in zip(a.items(), b.items())
    )


def _sharing(result: TrialResult, trial: Trial) -> TrialResult:
    """``result`` with its trial's ``config`` and ``hp`` dicts in place of equal copies
    (a tuner keeps every result: memory per trial)."""
    config = result.config
    if config is not trial.config and _same_items(config, trial.config):
        config = trial.config
    hp = result.hp
    if hp is not trial.hp and _same_items(hp, trial.hp):
        hp = trial.hp
    if config is result.config and hp is result.hp:
        return result
    return TrialResult(config, hp, result.steps, result.metrics, result.history)


def _float_values(metrics: Mapping[str, float]) -> tuple[float, ...] | None:
    """A step's metric values when every one is a finite ``float`` (a column of
    doubles gives them back equal and of the same type), else None."""
    values = tuple(metrics.values())
    if all(type(v) is float for v in values) and all(map(math.isfinite, values)):
        return values
    return None


class ResultLog(SequenceABC[tuple[int, TrialResult]]):
    """:attr:`Tuner.results`: ``(trial id, result)`` per observed result, in order,
    kept in columns instead of one result with a metrics and a history dict each
    (memory per trial at 100,000 trials).

    A result whose config and sequences are its trial's (the same values), whose
    metrics are its history's entry at its steps, and whose metric values are finite
    floats is kept as its trial id, its steps and its history's steps, names (one tuple
    per distinct set) and values (a column of doubles); reading it builds a
    :class:`TrialResult` with the trial's ``config`` and ``hp`` dicts and fresh
    ``metrics`` and ``history`` dicts of the same values (``metrics`` is the history's
    entry). Any other result is kept as it came. Reading a result builds it each time:
    equal results, not one object.
    """

    __slots__ = (
        "_at",
        "_first",
        "_kept",
        "_name_ids",
        "_names",
        "_names_of",
        "_off",
        "_steps",
        "_tid",
        "_trials",
        "_values",
    )  # fmt: skip

    def __init__(self, trials: Mapping[int, Trial]) -> None:
        self._trials = trials
        # per result: trial id, steps, first history entry, first value
        self._tid = array("q")
        self._steps = array("q")
        self._first = array("q")
        self._off = array("q")
        # per history entry: its step and its names (an index into _names)
        self._at = array("q")
        self._names_of = array("q")
        self._values = array("d")
        self._names: list[tuple[str, ...]] = []
        self._name_ids: dict[tuple[str, ...], int] = {}
        self._kept: dict[int, TrialResult] = {}  # results kept as they came, by index

    def append(self, item: tuple[int, TrialResult]) -> None:
        """Add ``(trial id, result)`` at the end (a trial id is an int)."""
        tid, result = item
        i = len(self._tid)
        rows = self._rows(tid, result) if type(result.steps) is int else None
        self._tid.append(tid)
        self._steps.append(result.steps if rows is not None else 0)
        self._first.append(len(self._at))
        self._off.append(len(self._values))
        if rows is None:
            trial = self._trials.get(tid)
            self._kept[i] = result if trial is None else _sharing(result, trial)
            return
        for step, names, values in rows:
            nid = self._name_ids.setdefault(names, len(self._names))
            if nid == len(self._names):
                self._names.append(names)
            self._at.append(step)
            self._names_of.append(nid)
            self._values.extend(values)

    def _rows(
        self, tid: int, result: TrialResult
    ) -> list[tuple[int, tuple[str, ...], tuple[float, ...]]] | None:
        """The history's entries as ``(step, names, values)`` when the result can be
        built again from them and its trial (see the class doc), else None."""
        trial = self._trials.get(tid)
        history = result.history
        at = history.get(result.steps)
        if (
            trial is None
            or at is None
            or not _same_items(result.config, trial.config)
            or not _same_items(result.hp, trial.hp)
            or not (result.metrics is at or _same_items(result.metrics, at))
        ):
            return None
        rows = []
        for step, metrics in history.items():
            values = _float_values(metrics)
            if type(step) is not int or values is None:
                return None
            rows.append((step, tuple(metrics), values))
        return rows

    def __len__(self) -> int:
        return len(self._tid)

    def _result(self, i: int) -> TrialResult:
        kept = self._kept.get(i)
        if kept is not None:
            return kept
        trial = self._trials[self._tid[i]]
        end = self._first[i + 1] if i + 1 < len(self._first) else len(self._at)
        off = self._off[i]
        history: dict[int, dict[str, float]] = {}
        for e in range(self._first[i], end):
            names = self._names[self._names_of[e]]
            history[self._at[e]] = dict(zip(names, self._values[off : off + len(names)]))
            off += len(names)
        steps = self._steps[i]
        return TrialResult(trial.config, trial.hp, steps, history[steps], history)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("result index out of range")
        i %= n
        return self._tid[i], self._result(i)

    def __iter__(self) -> Iterator[tuple[int, TrialResult]]:
        for i in range(len(self)):
            yield self._tid[i], self._result(i)

    def metric_items(self, metric: str) -> Iterator[tuple[int, int, int, Any]]:
        """``(index, trial id, steps, value of metric at steps or None)`` per result,
        without building the results."""
        kept = self._kept
        for i in range(len(self)):
            tid, steps = self._tid[i], self._steps[i]
            result = kept.get(i)
            if result is not None:
                yield i, tid, result.steps, result.metrics.get(metric)
                continue
            end = self._first[i + 1] if i + 1 < len(self._first) else len(self._at)
            off = self._off[i]
            value = None
            for e in range(self._first[i], end):
                names = self._names[self._names_of[e]]
                if self._at[e] == steps and metric in names:
                    value = self._values[off + names.index(metric)]
                off += len(names)
            yield i, tid, steps, value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ResultLog, list)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ResultLog({list(self)!r})"


@dataclass(eq=False, slots=True)
class Job:
    """One submission: ``trial`` trained to ``steps``. ``key`` numbers submissions."""

    key: int
    trial: Trial
    steps: int
    task: asyncio.Task[TrialResult]

    @property
    def status(self) -> str:
        """``"ok"``, ``"failed"`` or ``"cancelled"`` once the task is done.

        Raises:
            BaseException: any other exception the runner raised (a bug, not an outcome).
        """
        if not self.task.done():
            raise RuntimeError(f"job {self.key} is not done")
        if self.task.cancelled():
            return "cancelled"
        exc = self.task.exception()
        if exc is None:
            return "ok"
        if isinstance(exc, TrialFailedError):
            return "failed"
        if isinstance(exc, TrialCancelledError):
            return "cancelled"
        raise exc

    def result(self) -> TrialResult | None:
        """The result, or None when the trial failed or was cancelled."""
        return self.task.result() if self.status == "ok" else None


def _json(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record as it comes back from JSON storage (tuples become lists...).

    A record of text keys and plain finite scalars (most of a tuner's: a submission, a
    job's end) comes back as it is: its copy, without a JSON round trip."""
    out = dict(record)
    for key, value in out.items():
        kind = type(value)
        if type(key) is not str or kind not in _PLAIN or (kind is float and not _finite(value)):
            break
    else:
        return out
    decoded = json.loads(strict_json(out))
    assert isinstance(decoded, dict)
    return decoded


# The JSON scalars that decode to an equal value of the same type (a finite float too).
_PLAIN = frozenset({str, int, float, bool, type(None)})
_finite = math.isfinite


def _effective_log(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Apply ``diverged`` records: each keeps only the first ``keep`` records before it."""
    out: list[dict[str, Any]] = []
    for rec in records:
        if rec.get("event") == "diverged":
            del out[int(rec["keep"]) :]
        else:
            out.append(_json(rec))
    return out


class ReplayingRunner:
    """Wraps a :class:`TrialRunner`: submits, waits, and logs and replays both.

    Every tuner goes through one of these (``Tuner.run`` builds it), so replay logic
    lives here only. While the previous run's log lasts, :meth:`wait_first` returns the
    job the log names next (awaiting that very job), and decisions are checked against
    the log instead of being appended again.
    """

    def __init__(self, runner: TrialRunner) -> None:
        self._runner = runner
        self._log = _effective_log(runner.read_log())
        self._pos = 0
        self._next_key = 0
        self._jobs: dict[int, Job] = {}  # submitted and not returned by wait_first yet
        self._workers: int | None = None
        # Keys of finished jobs not returned yet, smallest first: wait_first takes the
        # smallest without scanning every job in flight. A job's key is pushed as its
        # coroutine ends, so it is here exactly when ``job.task.done()`` is true.
        self._done: list[int] = []
        self._done_keys: set[int] = set()
        self._ending = 0  # jobs ended so far
        self._ended: dict[int, int] = {}  # key -> order its job ended in (till woken on)
        self._waiter: asyncio.Future[None] | None = None
        self._waiting: tuple[int, Set[Job] | Mapping[Job, Any]] | None = None

    # -- state

    @property
    def replaying(self) -> bool:
        """Whether records of the previous run are still being replayed."""
        return self._pos < len(self._log)

    def declare(self, specs: Iterable[Any]) -> None:
        """Tell the runner which trials (``TrialSpec``-like: ``config``, ``hp``) the tuner
        may submit later (a Study plans checkpoints where they will branch off).
        Decisions never depend on it. Specs asked lazily from a sampler
        (``lazy`` set) are not iterated here: declare them one by one as they come."""
        if getattr(specs, "lazy", False):
            return
        self._runner.declare([(dict(s.config), dict(s.hp)) for s in specs])

    def plan_ahead(self, horizon: int, rungs: Iterable[int] = ()) -> None:
        """Tell the runner that the tuner may train trials up to ``horizon`` steps from
        now on (a study inserts the trials declared from then on that far) and asks for
        results at steps ``rungs`` (a study's batches checkpoint there as they pass).
        For tuners whose horizon grows while they run (infinite-horizon ASHA) and whose
        requests at a step may come after a shared path was trained past it (ASHA's
        brackets). Decisions never depend on it; ``plan_ahead`` is optional on a
        :class:`TrialRunner`."""
        plan = getattr(self._runner, "plan_ahead", None)
        if callable(plan):
            plan(int(horizon), sorted(set(rungs)))

    def num_workers(self) -> int:
        """The runner's worker count (at least 1), itself a logged input.

        The count shapes asynchronous decisions (how many jobs a free worker's turn
        fills), so a change is logged as ``{"event": "workers", "n": ...}`` and a
        replay uses the logged count: a study resumed on a different number of workers
        replays the same decisions, then adapts. Tuners may call this at every decision
        point to follow an elastic cluster.
        """
        if self.replaying:
            rec = self._log[self._pos]
            if rec.get("event") == "workers":
                self._pos += 1
                self._workers = int(rec["n"])
            if self._workers is not None:
                return self._workers
        real = max(1, int(self._runner.num_workers()))
        if real != self._workers:
            self._append({"event": "workers", "n": real})
            self._workers = real
        return real

    def shares_work(self) -> bool:
        """Whether the runner trains a prefix shared by several submissions once (a
        stage-based study): jobs whose remaining steps follow the same path then take
        one worker between them. False for runners that do not say (``shares_work``
        is optional on a :class:`TrialRunner`)."""
        shares = getattr(self._runner, "shares_work", None)
        return bool(shares()) if callable(shares) else False

    # -- logging

    def _append(self, record: dict[str, Any]) -> None:
        rec = _json(record)
        if self.replaying:
            expected = self._log[self._pos]
            if expected == rec:
                self._pos += 1
                return
            self._diverge(f"logged {expected}, now {rec}")
        self._runner.append_log(rec)

    def _diverge(self, reason: str) -> None:
        warnings.warn(
            f"tuner replay diverged from the log at record {self._pos}: {reason}; "
            "going on live from here",
            ReplayDivergedWarning,
            stacklevel=3,
        )
        self._runner.append_log({"event": "diverged", "keep": self._pos, "reason": reason})
        del self._log[self._pos :]

    def record(self, event: str, **fields: Any) -> None:
        """Log a decision that is not a submission (``stop``, ``exploit``...).

        ``fields`` must be JSON-serialisable.
        """
        self._append({"event": event, **fields})

    # -- submitting and waiting

    def submit(self, trial: Trial, steps: int, event: str = "submit", **fields: Any) -> Job:
        """Log the decision and start ``runner.submit(trial.config, trial.hp, steps)``.

        Args:
            trial: the trial to train.
            steps: train it up to this many steps (resuming when it has trained before).
            event: the decision's name in the log: ``submit`` for a new trial,
                ``promote`` or ``continue`` for more steps of a known one.
            **fields: extra JSON-serialisable fields of the log record.
        """
        key = self._next_key
        self._next_key += 1
        # refuse a trial that cannot run before logging it
        self._runner.check(dict(trial.config), dict(trial.hp))
        fingerprint = trial.fingerprint
        self._append(
            {
                "event": event,
                "key": key,
                "trial": trial.id,
                "steps": steps,
                "fp": fingerprint,
                **fields,
            }
        )
        runner = self._runner

        async def call() -> TrialResult:
            config, hp = dict(trial.config), dict(trial.hp)
            SUBMITTED.set((config, hp, fingerprint))  # this task's own context
            try:
                return await runner.submit(config, hp, steps)
            finally:
                self._finished(key)

        job = Job(key, trial, steps, asyncio.ensure_future(call()))
        job.task.add_done_callback(functools.partial(self._on_done, key))
        self._jobs[key] = job
        return job

    def _finished(self, key: int) -> None:
        if key not in self._done_keys and key in self._jobs:  # not returned already
            self._done_keys.add(key)
            self._ending += 1
            self._ended[key] = self._ending
            heapq.heappush(self._done, key)

    def _on_done(self, key: int, _task: asyncio.Future[Any]) -> None:
        # A task cancelled before it started never ran its ``finally``: count it here.
        self._finished(key)
        ended = self._ended.pop(key, 0)
        # Wake wait_first one loop turn after a job of its pool ended while it waited,
        # as asyncio.wait(FIRST_COMPLETED) does: the jobs found done on waking, hence
        # the decisions, stay what they were.
        if self._waiter is None or self._waiting is None or self._waiter.done():
            return
        since, pool = self._waiting
        if ended > since and self._jobs.get(key) in pool:
            self._waiter.set_result(None)

    def _take_done(self, pool: Set[Job] | Mapping[Job, Any]) -> Job | None:
        """The finished job of ``pool`` with the smallest key (removed from the finished
        ones), None when none of ``pool`` has finished."""
        skipped: list[int] = []
        found: Job | None = None
        while self._done:
            key = heapq.heappop(self._done)
            job = self._jobs.get(key)
            if job is None:  # returned already (a replayed completion)
                self._done_keys.discard(key)
            elif job in pool:
                self._done_keys.discard(key)
                found = job
                break
            else:
                skipped.append(key)
        for key in skipped:
            heapq.heappush(self._done, key)
        return found

    async def wait_first(self, jobs: Iterable[Job]) -> Job:
        """Wait until one of ``jobs`` is done and return it (one job per call).

        Live, the finished job with the smallest key wins when several are done; while
        replaying, the job the log names next. Failed and cancelled jobs are returned
        too (see :attr:`Job.status`); any other exception from the runner propagates.
        Pass the jobs in flight as a dict or a set: the call then costs O(log n) in the
        number of jobs, whatever their number (another iterable is copied into a set).
        """
        pool: Set[Job] | Mapping[Job, Any] = jobs if isinstance(jobs, (Set, Mapping)) else set(jobs)
        if not pool:
            raise ValueError("wait_first needs at least one job")
        if self.replaying:
            rec = self._log[self._pos]
            job = self._jobs.get(rec.get("key", -1)) if rec.get("event") == "done" else None
            if job is None or job not in pool:
                self._diverge(f"logged {rec}, now waiting for jobs {sorted(j.key for j in pool)}")
            else:
                await asyncio.wait([job.task])
                del self._jobs[job.key]
                status = job.status
                if status == rec.get("status"):
                    self._pos += 1
                    return job
                self._diverge(f"job {job.key} was {rec.get('status')!r}, now {status!r}")
                self._runner.append_log({"event": "done", "key": job.key, "status": status})
                return job
        found = self._take_done(pool)
        while found is None:
            self._waiter = asyncio.get_running_loop().create_future()
            self._waiting = (self._ending, pool)
            try:
                await self._waiter
            finally:
                self._waiter = self._waiting = None
            found = self._take_done(pool)
        del self._jobs[found.key]
        self._append({"event": "done", "key": found.key, "status": found.status})
        return found

    wait_any = wait_first

    async def wait_all(self, jobs: Iterable[Job]) -> list[Job]:
        """Wait for every job; returns them in the order they were observed."""
        pending = list(jobs)
        out: list[Job] = []
        while pending:
            job = await self.wait_first(pending)
            pending.remove(job)
            out.append(job)
        return out

    async def aclose(self, finished: bool) -> None:
        """Cancel jobs still running; when the tuner ``finished`` normally, warn if the
        log holds records it did not reach."""
        if finished and self.replaying:
            self._diverge(f"the tuner finished before record {self._log[self._pos]}")
        pending = [j.task for j in self._jobs.values() if not j.task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


class JobQueue:
    """Submissions in FIFO order with at most ``limit`` in flight (None: no limit).

    Decisions are pushed as they are taken and submitted (and logged) when a slot is
    free, at the next :meth:`next` call, so the log order stays deterministic.
    """

    def __init__(self, ctx: ReplayingRunner, limit: int | None) -> None:
        self._ctx = ctx
        self._limit = limit
        self._queue: deque[tuple[Trial, int, str, Any, dict[str, Any]]] = deque()
        self.in_flight: dict[Job, Any] = {}

    def push(self, trial: Trial, steps: int, event: str, tag: Any = None, **fields: Any) -> None:
        """Queue ``trial`` up to ``steps``; ``tag`` comes back with the job from :meth:`next`."""
        self._queue.append((trial, steps, event, tag, fields))

    def __bool__(self) -> bool:
        return bool(self._queue or self.in_flight)

    async def next(self) -> tuple[Job, Any]:
        """Submit what fits, wait for the next finished job; returns it and its tag."""
        while self._queue and (self._limit is None or len(self.in_flight) < self._limit):
            trial, steps, event, tag, fields = self._queue.popleft()
            self.in_flight[self._ctx.submit(trial, steps, event, **fields)] = tag
        job = await self._ctx.wait_first(self.in_flight)
        return job, self.in_flight.pop(job)


# --------------------------------------------------------------------------- helpers


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum``, else :class:`TunerError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TunerError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise TunerError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def rung_levels(
    min_steps: int, max_steps: int, eta: int, max_rungs: int | None = None
) -> list[int]:
    """Steps of successive-halving rungs: ``min_steps * eta**k`` below ``max_steps``,
    then ``max_steps`` itself as the top rung.

    With ``max_rungs``, only the first ``max_rungs - 1`` of the lower rungs are kept:
    the top rung is always ``max_steps``, so the best trials always train fully.
    """
    levels: list[int] = []
    steps = min_steps
    while steps < max_steps:
        levels.append(steps)
        steps *= eta
    if max_rungs is not None:
        levels = levels[: max_rungs - 1]
    return [*levels, max_steps]


def draw_specs(
    space: Any, n: int | None, seed: int, shuffle_grid: bool = False, sampler: Any = None
) -> Any:
    """``n`` trial specs (objects with ``config`` and ``hp``) from ``space``.

    With ``sampler`` (the tuner's :class:`~stagetree.tuners.optuna_bridge.SamplerBridge`,
    ``Tuner._bridge`` during ``run``), a lazy sequence of ``n`` specs that asks the
    Optuna sampler for spec ``i`` (tuner trial ``i``) when it is first read: read them
    in order, as trials are created, so each proposal sees the results before it.
    A random space (it has ``sample``) gives ``space.sample(n, seed)``. Anything else
    is enumerated in order (a ``GridSpace``, or a plain list of specs); with
    ``shuffle_grid`` the enumeration is shuffled by ``seed`` first (adaptive tuners
    assume configurations arrive in random order), then the first ``n`` are kept.
    """
    if isinstance(space, (Mapping, str, bytes)):
        raise TunerError(
            f"a tuner takes a search space, not a {type(space).__name__}: wrap the "
            "options in stagetree.space.GridSpace(hp={...}, fixed={...}) or "
            "RandomSpace(hp={...}), or pass a list of TrialSpec"
        )
    if hasattr(space, "sample"):
        if n is None:
            raise TunerError("num_trials is required for a random search space")
        if sampler is not None:
            return SampledSpecs(sampler, n)
        drawn = list(space.sample(n, seed))
        distinct = len(drawn)
        if _distinct_specs(drawn) < distinct:  # texts only where some may be the same
            distinct = len({_spec_key(s) for s in drawn})
        if distinct < len(drawn):
            warnings.warn(
                f"{len(drawn)} trials were drawn but only {distinct} are distinct (the "
                f"space has few configurations): {len(drawn) - distinct} draws repeat a "
                "trial, and identical trials train once; widen the space or draw fewer",
                StagetreeWarning,
                stacklevel=3,
            )
        return drawn
    specs = list(iter_specs(space))
    if shuffle_grid:
        random.Random(seed).shuffle(specs)
    return specs if n is None else specs[:n]


def iter_specs(space: Any) -> Iterator[Any]:
    """The trial specs of a grid or a list of specs, in order, one at a time (a grid of
    a million points is never built whole).

    Raises:
        TunerError: not a space, an empty one, or an item that is not a trial spec.
    """
    if isinstance(space, (Mapping, str, bytes)) or hasattr(space, "sample"):
        yield from draw_specs(space, None, 0)  # refuses these, naming what to do
        return
    try:
        items = iter(space) if hasattr(space, "__iter__") else iter(space.trials())
    except (TypeError, AttributeError):
        raise TunerError(f"a tuner takes a search space, got {space!r}") from None
    empty = True
    for spec in items:
        empty = False
        if not (hasattr(spec, "config") and hasattr(spec, "hp")):
            raise TunerError(
                f"a search space must yield trial specs (with .config and .hp), got "
                f"{spec!r}: use stagetree.space.GridSpace or a list of TrialSpec"
            )
        yield spec
    if empty:
        raise TunerError("the search space has no trials")


def space_size(space: Any) -> int | None:
    """How many trials a grid or a list of specs holds, without enumerating it; None
    when it cannot say."""
    size = getattr(space, "size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    try:
        return len(space)
    except TypeError:
        return None


def _distinct_specs(specs: list[Any]) -> int:
    """How many of ``specs`` differ as ``TrialSpec`` values (hash and equality: the
    canonical config and the sequences), or 0 where they are not all hashable. Specs
    that differ so have different :func:`_spec_key` texts too: a random space's draws
    (distinct already) need no text each."""
    try:
        return len(set(specs))
    except TypeError:
        return 0


def _spec_key(spec: Any) -> str:

    return json.dumps(spec.config, sort_keys=True, default=repr) + dumps_hp(spec.hp)


# --------------------------------------------------------------------------- Tuner


class Tuner(ABC):
    """Base class of every tuner.

    Contract:

    * ``await tuner.run(runner)`` drives a whole search through ``runner`` (a
      :class:`TrialRunner`) and returns the best result, or None when no trial
      produced a finite value of ``metric``. "Best" compares results at the largest
      number of steps any finite result reached (a 1-step metric never beats a
      64-step one), then by value; ties go to the trial created first. This is the
      one rule of :mod:`stagetree.ranking` (``Study.best``, ``stagetree status``).
    * Every tuner takes ``metric`` (a name the trainer reports) and ``mode``
      (``"max"`` or ``"min"``), and a ``seed``: given the seed and the order in which
      results arrive, decisions are identical. Subclasses implement :meth:`_search`
      against a :class:`ReplayingRunner` and use only its ``submit``/``wait_*``/
      ``record`` so that a resumed study replays them.
    * A result without ``metric`` raises :class:`~stagetree.exceptions.TunerError`
      naming the metric and the names that were returned. NaN and +/-inf values rank
      worst: they are never promoted, never donors, never the best. Failed or
      cancelled trials rank worst too.
    * Invalid arguments raise :class:`~stagetree.exceptions.TunerError` naming the
      argument, in the constructor.
    * Tuners that draw configurations take ``sampler=``, an Optuna sampler
      (:mod:`stagetree.tuners.optuna_bridge`): it proposes each new trial through
      Optuna's ask-and-tell API and is told every result :meth:`_observe` sees
      (``COMPLETE`` at :attr:`horizon`, ``FAIL`` on failure) and every stop
      (:meth:`_prune`).

    After ``run``, :attr:`results` holds ``(trial id, result)`` for every result
    observed, in observation order, and :attr:`trials` every trial by id. A result
    whose config and sequences are its trial's (the same values) holds the trial's
    ``config`` and ``hp`` dicts themselves, not copies: one of each per trial, however
    many results it has. :attr:`results` is a :class:`ResultLog` (a sequence; it keeps
    the results' metrics in columns and builds a result, equal each time, when it is
    read); setting it to a list of pairs works too.
    """

    def __init__(
        self, metric: str, mode: str = "max", seed: int = 0, max_concurrent: int | None = None
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise TunerError(f"metric must be a non-empty str, got {metric!r}")
        if mode not in MODES:
            raise TunerError(f"mode must be 'max' or 'min', got {mode!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TunerError(f"seed must be an int, got {seed!r}")
        if max_concurrent is not None:
            check_int("max_concurrent", max_concurrent, 1)
        self.metric = metric
        self.mode = mode
        self.seed = seed
        self.max_concurrent = max_concurrent
        self.trials: dict[int, Trial] = {}
        self.results: SequenceABC[tuple[int, TrialResult]] = ResultLog(self.trials)
        self.sampler: Any = None
        self._bridge: Any = None  # the SamplerBridge of the current run

    def _use_sampler(self, sampler: Any, space: Any) -> None:
        """Validate ``sampler`` (None or an Optuna sampler) against ``space`` and keep it.

        Raises:
            TunerError: not an Optuna sampler, Optuna missing, or a space a sampler
                cannot search (a grid, a ``where`` filter).
            InvalidSpaceError: a distribution Optuna cannot represent (named).
        """
        if sampler is None:
            return

        self.sampler = check_sampler(sampler)
        check_sampler_space(space)

    async def run(self, runner: TrialRunner) -> TrialResult | None:
        """Run the search to its end and return the best result (see the class doc)."""
        self.trials = {}
        self.results = ResultLog(self.trials)
        ctx = ReplayingRunner(runner)
        if self.sampler is not None:
            self._bridge = SamplerBridge.open(self, runner)
        finished = False
        try:
            await self._search(ctx)
            finished = True
            if self._bridge is not None:
                self._bridge.close()
        finally:
            bridge, self._bridge = self._bridge, None
            if bridge is not None and not finished:
                # An interrupted search keeps in the storage what its sampler was asked
                # and told (its resume re-reads it); the interruption itself propagates.
                with contextlib.suppress(Exception):
                    bridge.flush()
            await ctx.aclose(finished)
        return self.best()

    @property
    def horizon(self) -> int:
        """The most steps this tuner may train one trial to, 0 when it cannot say.

        A study inserts each trial's path up to the horizon when it is first submitted,
        so that running batches checkpoint where later promotions branch off. Tuners
        with a fixed budget override it.
        """
        return 0

    @abstractmethod
    async def _search(self, ctx: ReplayingRunner) -> None:
        """The algorithm: submit and wait through ``ctx`` until done."""

    # -- helpers for subclasses

    def _new_trial(self, config: Mapping[str, Any], hp: Mapping[str, Sequence]) -> Trial:
        trial = Trial(len(self.trials), dict(config), dict(hp))
        self.trials[trial.id] = trial
        return trial

    def _workers(self, ctx: ReplayingRunner) -> int:
        return self.max_concurrent if self.max_concurrent is not None else ctx.num_workers()

    def value(self, result: TrialResult) -> float:
        """Rank value of ``result``: higher is better whatever the mode; ``-inf`` for a
        non-finite metric.

        Raises:
            TunerError: ``metric`` is not among the result's metrics.
        """
        if self.metric not in result.metrics:
            raise TunerError(
                f"metric {self.metric!r} is not among the metrics the trainer returned: "
                f"{sorted(result.metrics)}"
            )
        return signed_value(result.metrics[self.metric], self.mode)

    def _observe(self, job: Job) -> float:
        """Record ``job``'s result; return its rank value (``-inf`` if it failed)."""
        result = job.result()
        if self._bridge is not None and job.status != "cancelled":
            value = None  # the raw metric when finite: Optuna's direction knows the mode
            if result is not None and self.value(result) > -math.inf:
                value = float(result.metrics[self.metric])
            self._bridge.result(job.trial.id, job.steps, value, failed=result is None)
        if result is None:
            return -math.inf
        v = self.value(result)
        results = self.results
        if isinstance(results, ResultLog):
            results.append((job.trial.id, result))
        else:  # a list set by hand
            results.append((job.trial.id, _sharing(result, job.trial)))  # type: ignore[attr-defined]
        return v

    def _prune(self, tid: int) -> None:
        """Tell the sampler (if any) that a rung stopped trial ``tid``."""
        if self._bridge is not None:
            self._bridge.prune(tid)

    @staticmethod
    def _ranked(values: Mapping[int, float]) -> list[int]:
        """Trial ids best first; ties go to the smaller id."""
        return ranked_ids(values)

    def best(self) -> TrialResult | None:
        """Best observed result (see the class doc), None without a finite one: the
        rule of :func:`stagetree.ranking.best_key`, with trials in creation order as the
        tie-break (what ``Study.best`` and ``stagetree status`` rank by too)."""
        results = self.results
        items: Iterable[tuple[int, int, int, Any]]
        if isinstance(results, ResultLog):  # no result built but the best
            items = results.metric_items(self.metric)
        else:
            items = (
                (i, tid, r.steps, r.metrics.get(self.metric)) for i, (tid, r) in enumerate(results)
            )
        best: tuple[tuple[int, float, int], int] | None = None
        for i, tid, steps, value in items:
            key = best_key(steps, value, self.mode, tid)
            if key is not None and (best is None or key > best[0]):
                best = (key, i)
        return results[best[1]][1] if best is not None else None
