"""Live progress of a running study, for ``stagetree run`` and scripts.

:class:`ProgressDisplay` polls ``study.progress()`` from a background thread. On a
terminal it draws a rich live panel (steps bar, trials, saving, elapsed, ETA); anywhere
else (a log file, a pipe, CI) it prints one plain line every few seconds, never a
carriage return, and a last line when it stops.

The ETA divides the steps still to execute by the recent rate (steps executed per
wall-clock second over a sliding window). Steps still to execute are the unique steps
of the submitted trials minus the executed ones when the study can tell its unique
steps (``study.stats()["steps_unique"]``, refreshed every few seconds and a second after
trials are added, because it walks the plan; steps requested since the last refresh
count as unique meanwhile), else the requested steps minus the executed ones, which
overestimates when trials share. Trials a tuner has not submitted yet are not counted.

The saving shown is the one ``stagetree run``'s report and ``stagetree status`` show
(:func:`stagetree.reports.costs.steps_saved`): the steps requested by the trials that
finished minus the steps executed, never negative (a failed trial saves nothing, and
work still to do is never counted as saved; :attr:`ProgressState.saved`). The steps
executed are the study's own (``study.progress()``), as ``study.stats()`` counts them.

A trial that fails is announced once, as it happens, with its error on one line
(``trial 3 failed: ValueError: boom (training step 4)``), above the live panel or
between the plain lines (``study.failures()`` is read when the failed count grows).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

__all__ = ["ProgressDisplay", "ProgressState", "format_duration", "progress_line"]

# Seconds between refreshes of the unique steps once trials were added.
_STALE_REFRESH = 1.0


class _HasProgress(Protocol):
    def progress(self) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class ProgressState:
    """One snapshot of a study's progress, with the derived saving and ETA.

    Attributes:
        trials: trials submitted so far.
        finished: trials done.
        running: trials with a stage on a worker.
        failed: trials that failed.
        steps_requested: total steps of the submitted trials (each trained alone).
        steps_executed: steps the engine has trained.
        steps_unique: unique steps of the submitted trials, when known.
        device_seconds: worker busy time so far.
        elapsed: seconds since the study started.
        eta: estimated seconds until the submitted trials are trained; None when no
            rate has been measured yet.
        workers: where each worker runs (``"0 on host (node ab12cd34)"``), for cluster
            executors; empty on one machine.
        steps_finished: steps requested by the trials that finished, when known.
    """

    trials: int
    finished: int
    running: int
    failed: int
    steps_requested: int
    steps_executed: int
    steps_unique: int | None
    device_seconds: float
    elapsed: float
    eta: float | None
    workers: tuple[str, ...] = ()
    steps_finished: int | None = None

    @property
    def saved(self) -> int:
        """Steps that sharing saves. With ``steps_finished`` (the steps requested by
        the trials that finished, as ``Study.progress()`` gives them), the definition
        of :func:`stagetree.reports.costs.steps_saved` that the run report and
        ``stagetree status`` show: those minus the steps executed, never negative (a
        failed trial saves nothing). Without it: requested minus executed, where steps
        not executed yet count as executed up to the unique steps (when known), so that
        the saving never includes work still to do; never negative."""
        if self.steps_finished is not None:
            return max(self.steps_finished - self.steps_executed, 0)
        done = self.steps_executed
        if self.steps_unique is not None:
            done = max(done, self.steps_unique)
        return max(self.steps_requested - done, 0)

    @property
    def target(self) -> int:
        """Steps the engine must execute in all (unique when known, else requested)."""
        return self.steps_unique if self.steps_unique is not None else self.steps_requested


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (``"?"`` for None or a non-finite value)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    total = max(round(seconds), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def progress_line(state: ProgressState) -> str:
    """The plain one-line form of ``state``."""
    unique = f", {state.steps_unique} unique" if state.steps_unique is not None else ""
    return (
        f"[{format_duration(state.elapsed)}] "
        f"trials {state.finished}/{state.trials} finished, {state.running} running"
        + (f", {state.failed} failed" if state.failed else "")
        + f" | steps {state.steps_executed} executed / {state.steps_requested} requested"
        + unique
        + f" | saved {state.saved} steps | ETA {format_duration(state.eta)}"
        + (f" | workers {', '.join(state.workers)}" if state.workers else "")
    )


def _int(snapshot: Mapping[str, Any], key: str) -> int:
    value = snapshot.get(key, 0)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0
    return round(number) if math.isfinite(number) else 0


class ProgressDisplay:
    """Shows a study's progress while the ``with`` block runs.

    Args:
        study: anything with ``progress() -> {name: number}`` (a
            :class:`~stagetree.study.Study`); ``stats()`` is used, when present, for
            the unique steps.
        interval: seconds between polls.
        out: where to draw (default: ``sys.stdout`` when entering).
        rich_output: a rich live display instead of plain lines (default: ``out`` is a
            terminal).
        plain_every: seconds between plain lines.
        window: seconds of history the rate (and so the ETA) is measured over.
        unique_every: seconds between refreshes of the unique steps.

    Polling errors (a study closed under the display, a busy database) are skipped: the
    display never raises into the code it watches.
    """

    def __init__(
        self,
        study: _HasProgress,
        interval: float = 0.5,
        *,
        out: TextIO | None = None,
        rich_output: bool | None = None,
        plain_every: float = 5.0,
        window: float = 30.0,
        unique_every: float = 5.0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.study = study
        self.interval = interval
        self.plain_every = plain_every
        self.window = window
        self.unique_every = unique_every
        self._out = out
        self._rich_output = rich_output
        self._samples: deque[tuple[float, int]] = deque()
        self._unique: int | None = None
        self._unique_requested = 0
        self._unique_at: float | None = None
        self._started = time.monotonic()
        self._last_line_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Any = None
        self._lock = threading.Lock()
        self._failures_shown: set[int] = set()
        self.state: ProgressState | None = None

    # -- polling -------------------------------------------------------------------------

    def _unique_steps(self, now: float, requested: int) -> int | None:
        """Unique steps of the submitted trials, refreshed from ``study.stats()`` every
        ``unique_every`` seconds, or after ``_STALE_REFRESH`` seconds once trials were
        added; until then, steps requested since the last refresh count as unique (an
        upper bound, so the ETA errs long)."""
        stale = requested != self._unique_requested
        wait = _STALE_REFRESH if stale else self.unique_every
        if self._unique_at is None or now - self._unique_at >= wait:
            self._unique_at = now
            stats = getattr(self.study, "stats", None)
            try:
                numbers = stats() if stats is not None else {}
                unique = float(numbers["steps_unique"])
                at = float(numbers.get("steps_requested", requested))
            except Exception:  # the study may not be able to tell yet; keep the last value
                pass
            else:
                if math.isfinite(unique) and math.isfinite(at):
                    self._unique, self._unique_requested = round(unique), round(at)
        if self._unique is None:
            return None
        return self._unique + max(requested - self._unique_requested, 0)

    def _rate(self, now: float, executed: int) -> float | None:
        """Steps per second over the window, None before two distinct samples."""
        samples = self._samples
        samples.append((now, executed))
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()
        t0, s0 = samples[0]
        if now <= t0 or executed <= s0:
            return None
        return (executed - s0) / (now - t0)

    def poll(self, now: float | None = None) -> ProgressState | None:
        """Take one snapshot; returns it (or None when the study could not answer).

        Args:
            now: monotonic time of the snapshot (tests pass their own clock).
        """
        now = time.monotonic() if now is None else now
        try:
            snap = self.study.progress()
        except Exception:
            return None
        executed = _int(snap, "steps_executed")
        requested = _int(snap, "steps_requested")
        if "steps_unique" in snap:
            unique: int | None = _int(snap, "steps_unique")
        else:
            unique = self._unique_steps(now, requested)
        rate = self._rate(now, executed)
        target = unique if unique is not None else requested
        remaining = max(target - executed, 0)
        eta: float | None
        if remaining == 0 and _int(snap, "trials") > 0:
            eta = 0.0
        else:
            eta = remaining / rate if rate else None
        elapsed = snap.get("elapsed")
        try:
            where = self.study.worker_locations()  # type: ignore[attr-defined]
        except Exception:  # not a Study (a test double), or not started
            where = {}
        state = ProgressState(
            trials=_int(snap, "trials"),
            finished=_int(snap, "finished"),
            running=_int(snap, "running"),
            failed=_int(snap, "failed"),
            steps_requested=requested,
            steps_executed=executed,
            steps_unique=unique,
            device_seconds=float(snap.get("device_seconds", 0.0) or 0.0),
            elapsed=float(elapsed) if elapsed is not None else now - self._started,
            eta=eta,
            workers=tuple(f"{w} on {node}" for w, node in sorted(where.items())),
            steps_finished=(
                _int(snap, "steps_requested_finished")
                if "steps_requested_finished" in snap
                else None
            ),
        )
        self.state = state
        return state

    # -- drawing -------------------------------------------------------------------------

    @property
    def stream(self) -> TextIO:
        """Where the display draws."""
        return sys.stdout if self._out is None else self._out

    @property
    def rich(self) -> bool:
        """Whether the display draws with rich (a terminal) or prints plain lines."""
        if self._rich_output is not None:
            return self._rich_output
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _renderable(self, state: ProgressState | None) -> Any:
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold")
        grid.add_column()
        if state is None:
            grid.add_row("stagetree", "waiting for the first trial...")
            return grid
        target = max(state.target, state.steps_executed, 1)
        bar = ProgressBar(total=target, completed=min(state.steps_executed, target), width=30)
        steps = Table.grid(padding=(0, 1))
        steps.add_row(bar, f"{state.steps_executed}/{state.target} executed")
        grid.add_row("steps", steps)
        unique = f" ({state.steps_unique} unique)" if state.steps_unique is not None else ""
        grid.add_row("requested", f"{state.steps_requested} steps{unique}")
        failed = f", {state.failed} failed" if state.failed else ""
        grid.add_row(
            "trials",
            f"{state.finished}/{state.trials} finished, {state.running} running{failed}",
        )
        grid.add_row("saved", f"{state.saved} steps so far")
        grid.add_row(
            "time",
            f"elapsed {format_duration(state.elapsed)}, ETA {format_duration(state.eta)}",
        )
        if state.workers:
            grid.add_row("workers", ", ".join(state.workers))
        return grid

    def _draw(self, state: ProgressState | None, now: float, final: bool = False) -> None:
        with self._lock:
            if self._live is not None:
                self._live.update(self._renderable(state), refresh=True)
                return
            if self.rich or state is None:
                return
            due = self._last_line_at is None or now - self._last_line_at >= self.plain_every
            if due or final:
                self._last_line_at = now
                print(progress_line(state), file=self.stream, flush=True)

    def tick(self, now: float | None = None) -> ProgressState | None:
        """Poll once and draw (the background thread calls this every ``interval``).

        Args:
            now: monotonic time of the tick (tests pass their own clock).
        """
        now = time.monotonic() if now is None else now
        state = self.poll(now)
        if state is not None:
            self._announce_failures(state)
        self._draw(state if state is not None else self.state, now)
        return state

    def _announce_failures(self, state: ProgressState) -> None:
        """Print each newly failed trial once (its error's summary line)."""
        failures = getattr(self.study, "failures", None)
        if failures is None or state.failed <= len(self._failures_shown):
            return
        try:
            found = failures()
        except Exception:
            return
        for trial_id, error in found:
            if trial_id in self._failures_shown:
                continue
            self._failures_shown.add(trial_id)
            summary = error.summary() if hasattr(error, "summary") else str(error)
            line = f"trial {trial_id} failed: {summary}"
            with self._lock:
                if self._live is not None:
                    self._live.console.print(line, style="red", markup=False, highlight=False)
                else:
                    print(line, file=self.stream, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # never let drawing kill the run
                self.tick()

    # -- context manager -----------------------------------------------------------------

    def __enter__(self) -> ProgressDisplay:
        self._started = time.monotonic()
        if self.rich:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream)
            self._live = Live(
                self._renderable(None),
                console=console,
                auto_refresh=False,
                transient=False,
                redirect_stdout=self.stream is sys.stdout,
                redirect_stderr=self.stream is sys.stdout,
            )
            self._live.start(refresh=True)
        else:
            # The first plain line comes after ``plain_every``, not at once: a short run
            # prints only its final line.
            self._last_line_at = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="stagetree-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        now = time.monotonic()
        state = self.poll(now)
        with contextlib.suppress(Exception):
            if state is not None:
                self._announce_failures(state)
            self._draw(state if state is not None else self.state, now, final=True)
        if self._live is not None:
            with contextlib.suppress(Exception):
                self._live.stop()
            self._live = None
