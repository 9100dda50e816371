"""Budgets: stop a tuner after so many trials, executed steps, device- or wall-seconds.

``study.tune(tuner, budget=...)`` takes a :class:`Budget` or its short form
(:meth:`Budget.parse`): ``"30m"``, ``"2h"``, ``"90s"`` (wall-clock), ``"500 steps"``,
``"20 trials"``, ``"1h device"`` / ``"3600 device-seconds"``, or several separated by
commas (``"20 trials, 30m"``): the first limit reached stops the run.

Every limit counts *this* call of ``tune``: trials are the distinct configurations the
tuner submits in it (those a resumed study answers from the storage count too: they are
trials of the run), steps and device-seconds what this run trains (answers from the
storage cost nothing), wall-seconds the run's clock (virtual time with a simulated
executor). How the run stops:

* ``trials``: the first submission of trial ``trials + 1`` is held back, as is every
  later new trial; submissions of the trials already in (promotions) go on, and the run
  stops when nothing but held-back submissions is left. Every trial in the budget is
  finished as the tuner would finish it.
* ``steps``, ``device_seconds``, ``wall_seconds``: checked at every submission and
  result and about every :data:`POLL_SECONDS` while work runs; once one is reached, the
  running work is cancelled (its checkpoints stay in the plan: a later run resumes from
  them, as after any cancellation).

:class:`BudgetGuard` carries this out for :meth:`stagetree.study_api.StudyAPI.tune`.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from stagetree.exceptions import InvalidBudgetError
from stagetree.executors.base import Clock, settle_loop

__all__ = ["POLL_SECONDS", "Budget", "BudgetGuard", "InvalidBudgetError", "RunReport"]

# Seconds between budget checks while work runs (real time only; a simulated run is
# checked at its events, so that its decisions stay deterministic).
POLL_SECONDS = 0.25


_SECONDS = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}
_COUNTS = {"trial": "trials", "trials": "trials", "step": "steps", "steps": "steps"}
_ITEM = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([A-Za-z][^,]*?)?\s*")
_UNITS_HELP = (
    "a budget is a Budget(trials=, steps=, device_seconds=, wall_seconds=) or a string "
    "like '30m', '2h', '90s' (wall-clock), '500 steps', '20 trials', '1h device' or "
    "'3600 device-seconds', several separated by commas"
)


@dataclass(frozen=True)
class Budget:
    """Limits of one tuning run; ``None`` means no limit of that kind, and the first
    limit reached stops the run (see the module doc for what each counts).

    Attributes:
        trials: distinct trials the tuner may submit.
        steps: steps the run may train (answers from the storage are free).
        device_seconds: worker time the run may use.
        wall_seconds: wall-clock seconds (virtual seconds with a simulated executor).

    Raises:
        InvalidBudgetError: no limit given, or one that is not a positive number
            (``trials`` and ``steps`` whole numbers).
    """

    trials: int | None = None
    steps: int | None = None
    device_seconds: float | None = None
    wall_seconds: float | None = None

    def __post_init__(self) -> None:
        given = False
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            given = True
            whole = f.name in ("trials", "steps")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidBudgetError(f"budget {f.name} must be a number > 0, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise InvalidBudgetError(f"budget {f.name} must be > 0, got {value!r}")
            if whole:
                if value != int(value):
                    raise InvalidBudgetError(
                        f"budget {f.name} must be a whole number, got {value!r}"
                    )
                object.__setattr__(self, f.name, int(value))
            else:
                object.__setattr__(self, f.name, float(value))
        if not given:
            raise InvalidBudgetError(f"a budget needs at least one limit: {_UNITS_HELP}")

    @classmethod
    def parse(cls, value: Any) -> Budget:
        """A :class:`Budget` from itself, a mapping of its fields, or its short form.

        Short forms: a number and a unit. Units ``s``, ``m``, ``h``, ``d`` (and their
        names: ``"90 seconds"``, ``"1.5 hours"``) are wall-clock; ``"N steps"``,
        ``"N trials"`` count; a duration followed by ``device`` (``"1h device"``) or
        ``device-seconds`` / ``device-minutes`` / ``device-hours`` is device time.
        Several limits are separated by commas (``"20 trials, 30m"``); one number with
        two units (``"1h30m"``) is not a form: write ``"90m"``.

        Raises:
            InvalidBudgetError: an unknown unit, a number without a unit, a limit given
                twice, or a value that is not positive.
        """
        if isinstance(value, Budget):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(map(str, value)) - {f.name for f in fields(cls)})
            if unknown:
                raise InvalidBudgetError(f"unknown budget limit(s) {unknown}: {_UNITS_HELP}")
            return cls(**value)
        if not isinstance(value, str):
            raise InvalidBudgetError(f"{_UNITS_HELP}; got {value!r}")
        limits: dict[str, float] = {}
        for part in value.split(","):
            name, amount = _parse_item(part, value)
            if name in limits:
                raise InvalidBudgetError(f"budget {value!r} gives {name} twice")
            limits[name] = amount
        return cls(**limits)  # type: ignore[arg-type]

    def describe(self) -> str:
        """The limits in words: ``"20 trials, 30m wall-clock"``."""
        parts = []
        if self.trials is not None:
            parts.append(f"{self.trials} trials")
        if self.steps is not None:
            parts.append(f"{self.steps} steps")
        if self.device_seconds is not None:
            parts.append(f"{_duration(self.device_seconds)} device time")
        if self.wall_seconds is not None:
            parts.append(f"{_duration(self.wall_seconds)} wall-clock")
        return ", ".join(parts)


def _parse_item(part: str, whole: str) -> tuple[str, float]:
    match = _ITEM.fullmatch(part)
    if match is None or not part.strip():
        raise InvalidBudgetError(f"cannot read budget {whole!r}: {_UNITS_HELP}")
    number = float(match.group(1))
    unit = (match.group(2) or "").strip().lower()
    if not unit:
        raise InvalidBudgetError(
            f"budget {whole!r}: {match.group(1)} has no unit (trials, steps, s, m, h, "
            f"device-seconds...): {_UNITS_HELP}"
        )
    if unit in _COUNTS:
        return _COUNTS[unit], number
    device = False
    for prefix in ("device-", "device "):
        if unit.startswith(prefix):
            unit, device = unit[len(prefix) :].strip(), True
    for suffix in (" device", " of device", "-device"):
        if unit.endswith(suffix):
            unit, device = unit[: -len(suffix)].strip(), True
    if unit in _SECONDS:
        return ("device_seconds" if device else "wall_seconds"), number * _SECONDS[unit]
    raise InvalidBudgetError(f"budget {whole!r}: unknown unit {match.group(2)!r}: {_UNITS_HELP}")


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class RunReport:
    """What one call of ``Study.tune`` did (``study.last_run``), next to the study's
    totals over every run (``study.stats()``).

    Attributes:
        trials: distinct trials the tuner submitted in this run.
        trials_answered: of those, trials whose result the storage already held when
            they were submitted (an earlier run, or another study, trained them).
        steps_executed: steps trained during this run for this study.
        device_seconds: worker time used during this run for this study.
        wall_seconds: the run's duration (virtual with a simulated executor).
        budget: the run's budget, if any.
        stopped_by: which limit stopped it (``"trials"``, ``"steps"``,
            ``"device_seconds"``, ``"wall_seconds"``), None when the tuner finished.
    """

    trials: int
    trials_answered: int
    steps_executed: int
    device_seconds: float
    wall_seconds: float
    budget: Budget | None = None
    stopped_by: str | None = None

    def summary(self) -> str:
        """One line: ``this run: 16 trials (16 found already trained), 0 steps
        trained, 0.0 device-seconds, 1.2 s``, plus the budget that stopped it."""
        answered = f" ({self.trials_answered} found already trained)"
        line = (
            f"this run: {self.trials} trials{answered if self.trials_answered else ''}, "
            f"{self.steps_executed} steps trained, {self.device_seconds:.1f} device-seconds, "
            f"{self.wall_seconds:.1f} s"
        )
        if self.stopped_by is not None and self.budget is not None:
            line += f"; stopped by its budget ({self.budget.describe()}: {self.stopped_by})"
        return line


def _ignore(found: bool) -> None:
    """What a submission of a trial already counted tells: nothing to record."""


class BudgetGuard:
    """Enforces a budget on one tuning run and counts what the run did.

    ``progress`` is the study's ``progress()`` (its ``steps_executed`` and
    ``device_seconds`` are study totals: the run's figures are their growth since the
    guard was made); ``clock`` the run's clock (the executor's: virtual when
    simulated); ``started`` when the run began on ``clock`` (default: now), so that the
    wall-clock limit counts what happened before the guard was made (opening the
    storage, starting workers). The tuner runs in :meth:`run`.
    """

    def __init__(
        self,
        budget: Budget | None,
        progress: Callable[[], Mapping[str, float]],
        clock: Clock,
        *,
        started: float | None = None,
    ) -> None:
        self.budget = budget
        self._progress = progress
        self._clock = clock
        base = progress()
        self._base_steps = float(base.get("steps_executed", 0.0))
        self._base_device = float(base.get("device_seconds", 0.0))
        self._started = clock.monotonic() if started is None else started
        self._trials: dict[str, bool] = {}  # fingerprint -> answered from the storage
        self._active = 0  # submissions under way that are not held back
        self._held = 0
        self._release = asyncio.Event()
        self._checks: set[asyncio.Future[None]] = set()
        self._task: asyncio.Future[Any] | None = None
        self.stopped_by: str | None = None

    # -- accounting

    def report(self) -> RunReport:
        """What the run did so far."""
        snap = self._progress()
        return RunReport(
            trials=len(self._trials),
            trials_answered=sum(self._trials.values()),
            steps_executed=max(round(float(snap.get("steps_executed", 0)) - self._base_steps), 0),
            device_seconds=max(float(snap.get("device_seconds", 0.0)) - self._base_device, 0.0),
            wall_seconds=max(self._clock.monotonic() - self._started, 0.0),
            budget=self.budget,
            stopped_by=self.stopped_by,
        )

    def _exceeded(self) -> str | None:
        """The first of steps, device-seconds, wall-seconds that is used up."""
        budget = self.budget
        if budget is None:
            return None
        if (
            budget.wall_seconds is not None
            and self._clock.monotonic() - self._started >= budget.wall_seconds
        ):
            return "wall_seconds"
        if budget.steps is None and budget.device_seconds is None:
            return None
        snap = self._progress()
        if (
            budget.steps is not None
            and float(snap.get("steps_executed", 0)) - self._base_steps >= budget.steps
        ):
            return "steps"
        if (
            budget.device_seconds is not None
            and float(snap.get("device_seconds", 0.0)) - self._base_device >= budget.device_seconds
        ):
            return "device_seconds"
        return None

    def _stop(self, reason: str) -> None:
        if self.stopped_by is None:
            self.stopped_by = reason
            if self._task is not None and not self._task.done():
                self._task.cancel()

    def check(self) -> None:
        """Stop the run when a limit other than ``trials`` is used up."""
        if self.stopped_by is None:
            reason = self._exceeded()
            if reason is not None:
                self._stop(reason)

    # -- the runner's side

    async def submit(
        self, fingerprint: str, call: Callable[[Callable[[bool], None]], Awaitable[Any]]
    ) -> Any:
        """Run one submission (``await call(answered)``) within the budget: a new trial
        past the ``trials`` limit, or any submission once the run is stopping, waits
        until the run is stopped (it is cancelled then). ``call`` tells ``answered``
        whether the storage already held the result when it submitted (its own look-up
        of the trial: the guard makes none)."""
        self.check()
        new = fingerprint not in self._trials
        limit = self.budget.trials if self.budget is not None else None
        over = new and limit is not None and len(self._trials) >= limit
        if self.stopped_by is not None or over:
            self._held += 1
            if self._active == 0:
                self._schedule_idle_check()
            await self._release.wait()  # never set: the stop cancels this
        answered = _ignore
        if new:
            self._trials[fingerprint] = False  # until the submission says otherwise
            trials = self._trials

            def answered(found: bool) -> None:
                trials[fingerprint] = bool(found)

        self._active += 1
        try:
            return await call(answered)
        finally:
            self._active -= 1
            self.check()
            if self._active == 0 and self._held:
                self._schedule_idle_check()

    def _schedule_idle_check(self) -> None:
        task = asyncio.ensure_future(self._idle_check())
        self._checks.add(task)  # referenced until done (the loop keeps weak references)
        task.add_done_callback(self._checks.discard)

    async def _idle_check(self) -> None:
        """Stop when only held-back submissions are left once the tuner has reacted to
        everything that finished (the loop has nothing ready to run)."""
        await settle_loop()
        if self._active == 0 and self._held and self.stopped_by is None:
            self._stop("trials")

    # -- the run

    async def run(self, tuner: Any, runner: Any) -> Any:
        """``await tuner.run(runner)``, stopped when the budget is used up; returns the
        tuner's best result (so far, when stopped)."""
        self._task = asyncio.ensure_future(tuner.run(runner))
        poller = None
        if not self._clock.virtual and self.budget is not None:  # virtual: at events only
            poller = asyncio.ensure_future(self._poll())
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if self.stopped_by is None or not self._task.done():  # cancelled from outside
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                raise
            return tuner.best()
        finally:
            if poller is not None:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)

    async def _poll(self) -> None:
        while self.stopped_by is None:
            await asyncio.sleep(POLL_SECONDS)
            self.check()
