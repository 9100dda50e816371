"""Typed records that cross module boundaries: what a storage, the engine and the read
side tell each other about trials, studies and runs.

* :class:`TrialState`: a trial's life cycle, a ``str`` enum (its values are the strings
  the storages keep, so a member compares equal to them and is written as them).
* :class:`TrialError`: why a trial failed (``attrs["error"]`` of its row, written by
  :func:`failure_record`).
* :class:`TrialRecord`: one trial with its learning curve, as the read side gives it.
* :class:`StudyRow`: a study as :meth:`BasePlanStorage.studies
  <stagetree.plan.BasePlanStorage.studies>` holds it.
* :class:`RunRecord`: a study's latest tuning run (``meta["run"]``), written by the
  engine and read by the efficiency report and the status.

This module imports only :mod:`stagetree.hp` of stagetree: every layer above the core
may use it.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.hp import Sequence, dumps_hp

__all__ = [
    "ENDED_STATES",
    "NO_ERROR",
    "RunRecord",
    "StudyRow",
    "TrialError",
    "TrialRecord",
    "TrialState",
    "failure_record",
    "trial_fingerprint",
]


class TrialState(str, enum.Enum):
    """Life cycle of a trial row: pending -> running -> done | failed; cancelled when
    nothing wants it any more. The values are the strings storages keep."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


#: States a trial does not leave by itself.
ENDED_STATES = frozenset({TrialState.DONE, TrialState.FAILED, TrialState.CANCELLED})


def failure_record(error: str, traceback: str, where: str = "") -> dict[str, str]:
    """How a failure is kept in a trial's ``attrs["error"]`` (see :class:`TrialError`):
    the exception's type and message, its traceback, and what it interrupted."""
    kind, sep, message = error.partition(": ")
    if not sep or not kind.replace(".", "").replace("_", "").isalnum():
        kind, message = "Error", error
    return {"type": kind, "message": message, "traceback": traceback, "where": where}


def trial_fingerprint(config: Mapping[str, Any], hp: Mapping[str, Sequence]) -> str:
    """The short stable hash of a trial's config and sequences that names it in a
    tuner's replay log (``Trial.fingerprint``; the lineage of PBT trials is read back
    by it)."""
    text = _CONFIG_ENCODER.encode(config) + dumps_hp(hp)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# json.dumps(config, sort_keys=True, default=repr), without an encoder built per call
_CONFIG_ENCODER = json.JSONEncoder(sort_keys=True, default=repr)


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


#: What a failed trial without a recorded error reports.
NO_ERROR = TrialError("Error", "no error was recorded")


# Not frozen: the read side sets ``lineage`` after reading the records, and callers
# (tests, exporters) may annotate them; every other record here is frozen.
@dataclass
class TrialRecord:
    """One trial of a study, as :meth:`Study.trials <stagetree.Study.trials>` and
    :func:`stagetree.reports.trials.trial_records` return it.

    Attributes:
        id: storage-wide trial id.
        config: fixed hyper-parameters.
        hp: sequences by name.
        steps: the most steps requested for this trial so far (its final step).
        state: ``pending`` | ``running`` | ``done`` | ``failed`` | ``cancelled``
            (:class:`TrialState` values).
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


@dataclass(frozen=True)
class RunRecord:
    """A study's latest tuning run, as the engine records it in ``meta["run"]``
    (``Engine.begin_tuning`` writes ``started``, ``workers``, ``owner`` and
    ``version``; ``Engine.end_tuning`` adds ``ended``; a run its budget stopped adds
    ``budget`` and ``stopped_by``).

    Attributes:
        started: when the run started (``time.time()``, or the virtual clock; None
            when not recorded as a number: a storage written before runs were).
        workers: how many workers the engine ran (None when not recorded).
        owner: the engine's lease owner, which the activity records of its batches carry.
        version: the trainer version the run trained.
        ended: when it ended (None while it runs, or when its engine died).
        budget: the budget that stopped it, in words ("" when none did).
        stopped_by: which limit of that budget stopped it (None when none did).
    """

    started: float | None = None
    workers: int | None = None
    owner: str | None = None
    version: str | None = None
    ended: float | None = None
    budget: str = ""
    stopped_by: str | None = None

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any] | None) -> RunRecord | None:
        """The run recorded in a study's meta, or None when it has none."""
        run = (meta or {}).get("run")
        if not isinstance(run, Mapping):
            return None
        started = run.get("started")
        ended = run.get("ended")
        workers = run.get("workers")
        owner, version, stopped = run.get("owner"), run.get("version"), run.get("stopped_by")
        return cls(
            started=float(started) if isinstance(started, (int, float)) else None,
            workers=int(workers) if isinstance(workers, (int, float)) and workers else None,
            owner=owner,
            version=version,
            ended=float(ended) if isinstance(ended, (int, float)) else None,
            budget=str(run.get("budget", "")),
            stopped_by=str(stopped) if stopped else None,
        )


@dataclass(frozen=True)
class StudyRow:
    """A study as a plan storage keeps it (one row of :meth:`BasePlanStorage.studies
    <stagetree.plan.BasePlanStorage.studies>`).

    Attributes:
        name: the study.
        created: when it was created (``time.time()``; 0.0 when unknown).
        meta: what its front ends recorded (metric and mode, workers, the latest run).
    """

    name: str
    created: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> StudyRow:
        """The record of a storage's ``{"name", "meta", "created"}`` row."""
        return cls(str(row["name"]), float(row.get("created") or 0.0), row.get("meta") or {})

    @property
    def run(self) -> RunRecord | None:
        """Its latest tuning run (:class:`RunRecord`), or None."""
        return RunRecord.from_meta(self.meta)
