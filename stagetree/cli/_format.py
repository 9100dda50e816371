"""Terminal output several commands share: label/value rows as plain text or rich
tables, the sharing and efficiency rows, and :func:`report_study` (``stagetree run``'s
report, also used by examples)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from stagetree.reports.costs import EFFICIENCY_KEYS, accounting
from stagetree.reports.format import format_value as _fmt_value
from stagetree.reports.format import one_line, short_sequence

if TYPE_CHECKING:
    from stagetree.study import Study

__all__ = [
    "accounting_rows",
    "efficiency_line",
    "efficiency_rows",
    "failure_rows",
    "num",
    "one_line",
    "print_rows",
    "report_study",
    "rich_rows",
    "use_rich",
]


def num(value: float) -> str:
    """A metric value: 6 significant digits."""
    return f"{value:.6g}"


def accounting_rows(numbers: Mapping[str, float]) -> list[tuple[str, str]]:
    requested = numbers["steps_requested"]
    saved = numbers["steps_saved"]
    share = f" ({100.0 * saved / requested:.0f}% of requested)" if requested else ""
    per_step = numbers["seconds_per_step"]
    estimate = f" (estimated at {per_step:.3g} s per executed step)" if per_step else ""
    return [
        ("steps requested", str(round(requested))),
        ("unique steps", str(round(numbers["steps_unique"]))),
        ("steps executed", str(round(numbers["steps_executed"]))),
        ("merge rate", f"{numbers['merge_rate']:.2f}"),
        ("device-seconds", f"{numbers['device_seconds']:.1f}"),
        ("steps saved", f"{round(saved)}{share}"),
        ("device-seconds saved", f"{numbers['device_seconds_saved']:.1f}{estimate}"),
    ]


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if abs(value) < 10 else f"{value:.1f} s"


def efficiency_line(numbers: Mapping[str, float]) -> str:
    """:func:`stagetree.reports.costs.efficiency` in one line: ``0.82 (limit 12.3 s of
    15.0 s on 2 workers; start-up 2.10 s, checkpoint load 0.30 s + save 0.10 s, idle
    0.20 s, scheduling 0.10 s)``; "" without an efficiency."""
    if "efficiency" not in numbers:
        return ""
    workers = round(numbers.get("workers", 1.0))
    parts = ", ".join(
        [
            f"start-up {_seconds(numbers['startup_seconds'])}",
            f"checkpoint load {_seconds(numbers['ckpt_load_wait_seconds'])}"
            f" + save {_seconds(numbers['ckpt_save_wait_seconds'])}",
            f"idle {_seconds(numbers['idle_seconds'])}",
            f"scheduling {_seconds(numbers['scheduling_seconds'])}",
        ]
    )
    return (
        f"{numbers['efficiency']:.2f} (limit {_seconds(numbers['limit_seconds'])} of "
        f"{_seconds(numbers['wall_seconds'])} on {workers} worker{'s' if workers != 1 else ''}"
        f"; {parts})"
    )


def efficiency_rows(numbers: Mapping[str, float]) -> list[tuple[str, str]]:
    line = efficiency_line(numbers)
    return [("efficiency", line)] if line else []


def print_rows(
    rows: Iterable[tuple[str, str]], stream: TextIO, indent: str = "", width: int = 22
) -> None:
    for label, value in rows:
        print(f"{indent}{label + ':':<{width}}{value}", file=stream)


def rich_rows(console: Any, rows: Iterable[tuple[str, str]], title: str | None = None) -> None:
    from rich.table import Table

    table = Table(show_header=False, title=title, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


def use_rich(stream: TextIO, rich_output: bool | None) -> bool:
    if rich_output is not None:
        return rich_output
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _final_metrics(best: Any) -> dict[str, float]:
    """Metrics at the trial's last step, for a TrialResult or a TrialRecord."""
    metrics = getattr(best, "metrics", None) or {}
    if metrics and all(isinstance(v, Mapping) for v in metrics.values()):
        return dict(metrics.get(best.steps, {}))  # a TrialRecord: {step: metrics}
    return dict(metrics)


def _config_line(config: Mapping[str, Any]) -> str:
    if not config:
        return "(no fixed hyper-parameters)"
    return " ".join(f"{k}={_fmt_value(v)}" for k, v in config.items())


def _best_rows(best: Any, metric: str, mode: str) -> list[tuple[str, str]]:
    if best is None:
        return [(f"best {metric}", f"none (no trial reported a finite {metric})")]
    value = _final_metrics(best).get(metric)
    shown = num(value) if isinstance(value, (int, float)) else "n/a"
    rows = [
        (f"best {metric}", f"{shown} ({mode}, after {best.steps} steps)"),
        ("  config", _config_line(best.config)),
    ]
    rows.extend((f"  {name}", short_sequence(seq)) for name, seq in best.hp.items())
    return rows


def failure_rows(failures: list[tuple[int, str]], most: int = 5) -> list[tuple[str, str]]:
    """Rows naming failed trials and the first line of each error (at most ``most``)."""
    if not failures:
        return []
    rows = [("failed trials", str(len(failures)))]
    rows.extend((f"  trial {tid}", summary) for tid, summary in failures[:most])
    if len(failures) > most:
        rows.append(("  ...", f"{len(failures) - most} more (stagetree export shows every error)"))
    return rows


def report_study(
    study: Study,
    best: Any,
    metric: str,
    mode: str = "max",
    out: TextIO | None = None,
    rich_output: bool | None = None,
) -> dict[str, float]:
    """Print the best trial and what sharing saved.

    Prints the best trial (its metric, config and sequences in short form), then
    trials, steps requested, unique steps, steps executed, merge rate, device-seconds,
    and the saving (:func:`~stagetree.reports.costs.accounting`): steps requested by
    the trials that finished minus steps executed, and device-seconds saved estimated
    as saved steps times the measured device-seconds per executed step.

    Args:
        study: an open study (its :meth:`~stagetree.study.Study.stats` are read).
        best: what ``study.tune`` returned (a ``TrialResult``), a ``TrialRecord`` from
            ``study.best``, or None.
        metric: the metric the tuner optimised.
        mode: ``"max"`` or ``"min"``.
        out: where to print (default: ``sys.stdout`` at call time).
        rich_output: rich tables instead of plain text (default: ``out`` is a terminal).

    Returns:
        The numbers printed: ``trials`` and those of :func:`accounting`, plus ``best``
        (the best trial's metric, NaN when there is none).
    """
    stream = sys.stdout if out is None else out
    stats = study.stats()
    trials = stats.get("trials")
    numbers = {
        "trials": float(trials if trials is not None else len(study.trials())),
        **accounting(
            stats.get("steps_requested", 0.0),
            stats.get("steps_unique", 0.0),
            stats.get("steps_executed", 0.0),
            stats.get("device_seconds", 0.0),
            stats.get("steps_requested_finished"),
        ),
    }
    value = _final_metrics(best).get(metric) if best is not None else None
    numbers["best"] = float(value) if isinstance(value, (int, float)) else math.nan
    best_rows = _best_rows(best, metric, mode)
    failures = study.failures() if hasattr(study, "failures") else []
    numbers["failed"] = float(len(failures))
    best_rows.extend(failure_rows([(tid, e.summary()) for tid, e in failures]))
    rows = [("trials", str(round(numbers["trials"]))), *accounting_rows(numbers)]
    run = getattr(study, "last_run", None)
    if run is not None:  # this run's own figures; the rows above are the study's totals
        rows = [*_run_rows(run, numbers), ("study totals", "over every run so far:"), *rows]
    if stats.get("workers_lost"):  # a cluster lost workers (or nodes): what it cost
        numbers["workers_lost"] = stats["workers_lost"]
        numbers["steps_lost"] = stats.get("steps_lost", 0.0)
        rows.append(("workers lost", str(round(stats["workers_lost"]))))
        rows.append(("steps lost", f"{round(numbers['steps_lost'])} (recomputed)"))
    if "efficiency" in stats:  # the run's efficiency and where its wall-clock went
        numbers.update({k: stats[k] for k in EFFICIENCY_KEYS if k in stats})
        rows.extend(efficiency_rows(stats))
    if stats.get("fused_jobs"):  # fuse=True: siblings trained as one job
        numbers["fused_jobs"] = stats["fused_jobs"]
        numbers["fused_members"] = stats.get("fused_members", 0.0)
        rows.append(
            (
                "fused",
                f"{round(stats['fused_jobs'])} job(s) trained "
                f"{round(numbers['fused_members'])} stages at once",
            )
        )
    title = f"study {study.name}"
    if use_rich(stream, rich_output):
        from rich.console import Console

        console = Console(file=stream)
        console.print(title, style="bold", markup=False, highlight=False)
        rich_rows(console, best_rows)
        rich_rows(console, rows, title="sharing")
    else:
        print(title, file=stream)
        print_rows(best_rows, stream)
        print("", file=stream)
        print_rows(rows, stream)
    return numbers


def _run_rows(run: Any, numbers: dict[str, float]) -> list[tuple[str, str]]:
    """``this run`` (:class:`~stagetree.budget.RunReport`) rows; adds its numbers as
    ``run_*`` to ``numbers``."""
    numbers.update(
        run_trials=float(run.trials),
        run_trials_answered=float(run.trials_answered),
        run_steps_executed=float(run.steps_executed),
        run_device_seconds=float(run.device_seconds),
    )
    answered = f", {run.trials_answered} found already trained" if run.trials_answered else ""
    rows = [
        (
            "this run",
            f"{run.trials} trials{answered}; trained {run.steps_executed} steps in "
            f"{run.device_seconds:.1f} device-seconds ({run.wall_seconds:.1f} s)",
        )
    ]
    if run.budget is not None:
        stop = f"stopped the run ({run.stopped_by} reached)" if run.stopped_by else "not reached"
        rows.append(("budget", f"{run.budget.describe()}: {stop}"))
    return rows
