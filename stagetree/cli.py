"""The ``stagetree`` command.

Subcommands:

* ``stagetree explain SPACE.py``: load a space file (:func:`stagetree.space.load_space_file`),
  plan every trial in memory and print what sharing saves (trials, root keys, total and
  unique steps, merge rate) and the stage tree, before anything is trained.
* ``stagetree run SCRIPT.py``: run the study a script defines with its tuner, with live
  progress, then print the best trial and what sharing saved (:func:`report_study`).
* ``stagetree status``: the studies of a storage: trials, best metric, steps executed,
  requested and unique, device-seconds spent and saved.
* ``stagetree export``: the trials as CSV, JSON, Parquet, TensorBoard or MLflow runs
  (:mod:`stagetree.export`), or a trial's weights.

``status`` and ``export`` print what :mod:`stagetree.reports` (the read side, shared
with :class:`~stagetree.Study`) computes; their data functions (:func:`study_status`,
:func:`storage_status`, :func:`export_records`, ...) are importable from here too.
* ``stagetree check SCRIPT.py``: is the script's trainer exact (:mod:`stagetree.check`)?

Each subcommand is a function that adds its subparser (:data:`_SUBCOMMANDS`) and sets
``handler`` to a function ``(args) -> int``.

Errors that stagetree raises on purpose (:class:`~stagetree.exceptions.StagetreeError`)
print one line to stderr and exit with status 2, without a traceback. Ctrl-C during
``stagetree run`` closes the study (workers stop, the storage stays consistent) and
exits with status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import runpy
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from stagetree import __version__
from stagetree.dashboard.serve import DEFAULT_PORT as DEFAULT_DASHBOARD_PORT
from stagetree.exceptions import (
    CommandError,
    InvalidSpaceError,
    StagetreeError,
    StorageError,
    TrialFailedError,
)
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.reports import (
    EFFICIENCY_KEYS,
    StorageStatus,
    StudyStatus,
    accounting,
    export_records,
    export_table,
    hidden_trials,
    short_sequence,
    storage_status,
    study_status,
)
from stagetree.reports import format_value as _fmt_value
from stagetree.space import SpaceFile, TrialSpec, canonical_json, config_key, load_space_file
from stagetree.stages import Summary, build_stage_tree, render_tree, summarize

if TYPE_CHECKING:
    from stagetree.study import Study

__all__ = [
    "CommandError",
    "ExplainResult",
    "StorageStatus",
    "StudyStatus",
    "accounting",
    "build_parser",
    "default_storage",
    "efficiency_line",
    "explain",
    "export",
    "export_records",
    "export_table",
    "hidden_trials",
    "main",
    "open_existing_storage",
    "plan_trials",
    "report_study",
    "run_script",
    "short_sequence",
    "status",
    "storage_status",
    "study_status",
    "tree_lines",
]

EXIT_USAGE = 2
EXIT_FAILED = 1  # `stagetree run`: no trial of the study succeeded


# --------------------------------------------------------------------------- explain


@dataclass
class ExplainResult:
    """An in-memory plan of a space and its sharing statistics.

    Attributes:
        storage: the memory plan holding every trial (one request reference each).
        root_keys: root key -> fixed config, in order of first appearance.
        summary: :func:`stagetree.stages.summarize` of the plan.
        trials_per_root: root key -> number of trials in that tree.
    """

    storage: BasePlanStorage
    root_keys: dict[str, dict[str, Any]]
    summary: Summary
    trials_per_root: dict[str, int] = field(default_factory=dict)


def plan_trials(
    trials: Iterable[TrialSpec],
    steps: int | Callable[[TrialSpec], int],
    study: str = "explain",
    storage: BasePlanStorage | None = None,
) -> ExplainResult:
    """Insert trials into a plan and summarise the sharing.

    One root key per distinct fixed config (:func:`stagetree.space.config_key`), each
    registered with its config; every trial is inserted with its step count, which adds
    one request reference per trial, and recorded as a trial of ``study`` so that
    identical trials count twice.

    Args:
        trials: the trials.
        steps: steps per trial, or a function of the trial.
        study: name of the study the trials are recorded under.
        storage: plan to fill; a fresh :class:`MemoryPlanStorage` when None.

    Raises:
        InvalidSpaceError: ``steps`` gave something other than an int >= 1.
        InvalidTrialError: trials of one tree with different hyper-parameter names.
    """
    plan = MemoryPlanStorage() if storage is None else storage
    plan.create_study(study, {"source": "stagetree explain"})
    grouped: dict[str, list[tuple[TrialSpec, int]]] = {}
    configs: dict[str, dict[str, Any]] = {}
    for trial in trials:
        n = steps(trial) if callable(steps) else steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidSpaceError(f"steps must be an int >= 1, got {n!r} for {trial!r}")
        key = config_key(trial.config)
        if key not in configs:
            configs[key] = trial.root_config
            plan.register_root(key, trial.root_config)
        grouped.setdefault(key, []).append((trial, n))
    for key, items in grouped.items():
        insertions = plan.insert_trials(key, [(t.hp, n) for t, n in items])
        for (trial, n), ins in zip(items, insertions):
            plan.add_trial(study, key, trial.config, trial.hp, n, ins.node, ins.step)
    return ExplainResult(
        storage=plan,
        root_keys=configs,
        summary=summarize(plan, study=study),
        trials_per_root={k: len(v) for k, v in grouped.items()},
    )


def _config_text(config: Mapping[str, Any]) -> str:
    if not config:
        return "(no fixed hyper-parameters)"
    return " ".join(
        f"{k}={v if isinstance(v, str) else canonical_json(v)}" for k, v in config.items()
    )


def tree_lines(result: ExplainResult) -> list[str]:
    """The stage tree of every plan tree, each under a header naming its root key."""
    lines: list[str] = []
    for key, config in result.root_keys.items():
        count = result.trials_per_root.get(key, 0)
        lines.append(f"root {key}  {_config_text(config)}  ({count} trials)")
        nodes = {n.id: n for n in result.storage.nodes(key)}
        requests = [(r.node, r.step) for r in result.storage.requests(key)]
        text = render_tree(build_stage_tree(nodes, requests), max_lines=10**9)
        lines.extend("  " + line for line in text.splitlines())
    return lines


def _collapse(lines: list[str], max_lines: int) -> list[str]:
    if len(lines) <= max_lines:
        return lines
    return [*lines[:max_lines], f"... {len(lines) - max_lines} more lines"]


def _summary_rows(result: ExplainResult) -> list[tuple[str, str]]:
    s = result.summary
    return [
        ("trials", str(s.trials)),
        ("root keys", str(len(result.root_keys))),
        ("plan nodes", str(s.nodes)),
        ("total steps", str(s.total_steps)),
        ("unique steps", str(s.unique_steps)),
        ("merge rate", f"{s.merge_rate:.2f}"),
    ]


def explain(
    space_file: SpaceFile,
    *,
    steps: int | None = None,
    num_trials: int | None = None,
    seed: int | None = None,
    max_lines: int = 60,
    out: TextIO | None = None,
    rich_output: bool | None = None,
) -> ExplainResult:
    """Plan a space file in memory and print what sharing saves.

    Args:
        space_file: the loaded space file.
        steps: overrides the file's ``steps``.
        num_trials: overrides the file's ``num_trials``.
        seed: overrides the file's ``seed``.
        max_lines: stage-tree lines to print at most; the rest collapse.
        out: where to print (default: ``sys.stdout`` at call time).
        rich_output: a rich table instead of plain text (default: ``out`` is a terminal).

    Returns:
        The plan and its summary.
    """
    stream = sys.stdout if out is None else out
    trials = space_file.trials(num_trials=num_trials, seed=seed)
    result = plan_trials(
        trials,
        space_file.steps_for if steps is None else steps,
        study=space_file.name,
    )
    rows = _summary_rows(result)
    lines = _collapse(tree_lines(result), max_lines)
    where = f" ({space_file.path})" if space_file.path is not None else ""
    title = f"{space_file.name}{where}"
    use_rich = stream.isatty() if rich_output is None else rich_output
    if use_rich:
        from rich.console import Console
        from rich.table import Table

        console = Console(file=stream)
        console.print(title, style="bold", markup=False, highlight=False)
        table = Table(show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for label, value in rows:
            table.add_row(label, value)
        console.print(table)
        console.print("stage tree:", style="bold")
        console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
    else:
        print(title, file=stream)
        for label, value in rows:
            print(f"{label + ':':<14}{value}", file=stream)
        print("", file=stream)
        print("stage tree:", file=stream)
        for line in lines:
            print(line, file=stream)
    return result


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return value


def _cmd_explain(args: argparse.Namespace) -> int:
    explain(
        load_space_file(args.space, num_trials=args.num_trials),
        steps=args.steps,
        num_trials=args.num_trials,
        seed=args.seed,
        max_lines=args.max_lines,
    )
    return 0


def _add_explain(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain",
        help="show what a search space shares, before training anything",
        description="Plan every trial of SPACE.py in memory and print trials, root keys, "
        "total and unique steps, the merge rate and the stage tree.",
    )
    p.add_argument("space", metavar="SPACE.py", help="file defining `space` and `steps`")
    p.add_argument("--steps", type=_positive, help="steps per trial (overrides the file)")
    p.add_argument("--num-trials", type=_positive, help="trials of a random space")
    p.add_argument("--seed", type=int, help="seed of a random space (overrides the file)")
    p.add_argument(
        "--max-lines", type=_positive, default=60, help="stage-tree lines to print (default 60)"
    )
    p.set_defaults(handler=_cmd_explain)


# --------------------------------------------------------------------------- shared


DEFAULT_STORAGE = "sqlite:///stagetree.db"
STORAGE_ENV = "STAGETREE_STORAGE"
RUN_NAME = "__stagetree_run__"
EXIT_INTERRUPTED = 130
DASHBOARD_PORT = DEFAULT_DASHBOARD_PORT


def default_storage() -> str:
    """The storage URL commands use without ``--storage``: ``$STAGETREE_STORAGE`` or
    ``sqlite:///stagetree.db``."""
    return os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n", 1)[0].split())
    return text or type(exc).__name__


def _sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL; None for other URLs and in-memory SQLite."""
    if not url.lower().startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        database = make_url(url).database
    except ArgumentError:
        return None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def open_existing_storage(url: str) -> BasePlanStorage:
    """Open a storage read-only (nothing is ever written to it, not even stagetree's
    tables), without creating a SQLite file that is not there.

    Raises:
        StorageError: the URL cannot be opened, naming it.
    """
    from stagetree.plan import open_storage

    path = _sqlite_file(url)
    if path is not None and not path.is_file():
        raise StorageError(
            f"cannot open plan storage {url!r}: {path} does not exist{_other_databases(path)}"
        )
    try:
        storage = open_storage(url, readonly=True)  # reports never write
        storage.studies()  # a file that is not a plan fails here, not halfway through
    except StagetreeError:
        raise
    except Exception as exc:  # driver errors of a file that is not a database, ...
        raise StorageError(f"cannot open plan storage {url!r}: {_one_line(exc)}") from exc
    return storage


def _other_databases(missing: Path) -> str:
    """A hint naming the SQLite files beside a missing one (say the demo's
    ``stagetree-demo.db`` when ``stagetree.db`` was looked for); "" when none."""
    folder = missing.parent if str(missing.parent) else Path(".")
    try:
        found = sorted(p.name for p in folder.glob("*.db") if p.is_file())
    except OSError:
        return ""
    if not found:
        return ""
    shown = folder if folder.is_absolute() else None
    urls = [f"sqlite:///{shown / name if shown else name}" for name in found[:5]]
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    return f"; databases in {folder}: {', '.join(found[:5])}{more}: pass --storage {urls[0]}"


def _num(value: float) -> str:
    """A metric value: 6 significant digits."""
    return f"{value:.6g}"


def _accounting_rows(numbers: Mapping[str, float]) -> list[tuple[str, str]]:
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
    """:func:`stagetree.reports.efficiency` in one line: ``0.82 (limit 12.3 s of
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


def _efficiency_rows(numbers: Mapping[str, float]) -> list[tuple[str, str]]:
    line = efficiency_line(numbers)
    return [("efficiency", line)] if line else []


def _print_rows(
    rows: Iterable[tuple[str, str]], stream: TextIO, indent: str = "", width: int = 22
) -> None:
    for label, value in rows:
        print(f"{indent}{label + ':':<{width}}{value}", file=stream)


def _rich_rows(console: Any, rows: Iterable[tuple[str, str]], title: str | None = None) -> None:
    from rich.table import Table

    table = Table(show_header=False, title=title, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


def _use_rich(stream: TextIO, rich_output: bool | None) -> bool:
    if rich_output is not None:
        return rich_output
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


# --------------------------------------------------------------------------- report


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
    shown = _num(value) if isinstance(value, (int, float)) else "n/a"
    rows = [
        (f"best {metric}", f"{shown} ({mode}, after {best.steps} steps)"),
        ("  config", _config_line(best.config)),
    ]
    rows.extend((f"  {name}", short_sequence(seq)) for name, seq in best.hp.items())
    return rows


def _failure_rows(failures: list[tuple[int, str]], most: int = 5) -> list[tuple[str, str]]:
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
    and the saving: steps requested minus executed, and device-seconds saved
    estimated as saved steps times the measured device-seconds per executed step.

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
        ),
    }
    value = _final_metrics(best).get(metric) if best is not None else None
    numbers["best"] = float(value) if isinstance(value, (int, float)) else math.nan
    best_rows = _best_rows(best, metric, mode)
    failures = study.failures() if hasattr(study, "failures") else []
    numbers["failed"] = float(len(failures))
    best_rows.extend(_failure_rows([(tid, e.summary()) for tid, e in failures]))
    rows = [("trials", str(round(numbers["trials"]))), *_accounting_rows(numbers)]
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
        rows.extend(_efficiency_rows(stats))
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
    if _use_rich(stream, rich_output):
        from rich.console import Console

        console = Console(file=stream)
        console.print(title, style="bold", markup=False, highlight=False)
        _rich_rows(console, best_rows)
        _rich_rows(console, rows, title="sharing")
    else:
        print(title, file=stream)
        _print_rows(best_rows, stream)
        print("", file=stream)
        _print_rows(rows, stream)
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


# --------------------------------------------------------------------------- run


def _pick(namespace: Mapping[str, Any], name: str, cls: type, what: str, script: str) -> Any:
    """``namespace[name]`` if it is a ``cls``, else the only ``cls`` among the globals."""
    value = namespace.get(name)
    if isinstance(value, cls):
        return value
    found: dict[int, str] = {}
    for key, obj in namespace.items():
        if isinstance(obj, cls) and not key.startswith("__"):
            found.setdefault(id(obj), key)
    if len(found) == 1:
        return namespace[next(iter(found.values()))]
    if not found:
        raise CommandError(f"{script} defines no {what} (a {cls.__name__} named `{name}`)")
    names = ", ".join(sorted(found.values()))
    plural = what[:-1] + "ies" if what.endswith("y") else what + "s"
    raise CommandError(
        f"{script} defines {len(found)} {plural} ({names}) and none is named `{name}`"
    )


@contextlib.contextmanager
def _script_context(path: Path) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Run a script like ``python SCRIPT.py`` would: its folder first on ``sys.path``
    and ``sys.argv == [SCRIPT.py]``. The callback keeps the script's globals importable
    as module :data:`RUN_NAME` (runpy drops its module when the script ends) until the
    block ends; worker processes receive its trainer class pickled by value.
    """
    saved_argv = sys.argv[:]
    saved_path = sys.path[:]
    missing = object()
    saved_module = sys.modules.get(RUN_NAME, missing)
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.resolve().parent))

    def keep(namespace: dict[str, Any]) -> None:
        module = types.ModuleType(RUN_NAME)
        module.__dict__.update(namespace)
        sys.modules[RUN_NAME] = module

    try:
        yield keep
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        if saved_module is missing:
            sys.modules.pop(RUN_NAME, None)
        else:
            sys.modules[RUN_NAME] = saved_module  # type: ignore[assignment]


def _run_user_script(path: Path, name: str) -> dict[str, Any]:
    """Run a user's script (see :func:`run_script`); a syntax error or a failed import
    in it becomes a one-line :class:`CommandError` naming the script and the line."""
    try:
        return runpy.run_path(str(path), run_name=RUN_NAME)
    except SyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        raise CommandError(f"{name}: SyntaxError: {exc.msg}{where}") from None
    except ImportError as exc:
        line = None
        tb = exc.__traceback__
        target = str(path.resolve())
        while tb is not None:  # the script's own line that imported
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == target:
                line = tb.tb_lineno
            tb = tb.tb_next
        where = f" (line {line})" if line else ""
        raise CommandError(f"{name}: {type(exc).__name__}: {exc}{where}") from None


def _close_all(studies: Iterable[Any]) -> None:
    for st in studies:
        try:
            st.close()
        except KeyboardInterrupt:  # a second Ctrl-C: go on closing the others
            continue


def run_script(
    script: str | os.PathLike[str],
    *,
    workers: int | None = None,
    storage: str | None = None,
    progress: bool = True,
    out: TextIO | None = None,
    check: bool = True,
    executor: str | None = None,
    address: str | None = None,
    checkpoints: str | None = None,
    url: str | None = None,
    token_file: str | None = None,
    dashboard: int | None = None,
    budget: str | None = None,
) -> int:
    """``stagetree run``: run the study a script defines with its tuner.

    ``budget`` limits the run (``"30m"``, ``"500 steps"``, ``"20 trials"``, ``"1h
    device"``; see :class:`stagetree.budget.Budget`); it is checked before the script
    runs.

    ``executor`` (a registered name: ``local``, ``ray``...), ``address`` (the cluster
    of a cluster executor) and ``checkpoints`` (the checkpoint location) override the
    script's studies as ``workers`` and ``storage`` do. ``url`` runs every study of the
    script on that tuning server (``stagetree serve``) with the token in ``token_file``
    (default: ``$STAGETREE_TOKEN`` / ``$STAGETREE_TOKEN_FILE``); the exactness check is
    then left out (the server's trainer version is what trains).

    The script runs under ``__name__ == "__stagetree_run__"`` (its ``if __name__ ==
    "__main__":`` block does not run) with ``workers`` and ``storage`` as overrides
    that every ``Study(...)`` it builds honours (``storage`` is also exported as
    ``$STAGETREE_STORAGE`` for the run). The study is the ``Study`` named ``study`` (or
    the only one), the tuner the ``Tuner`` named ``tuner`` (or the only one). The study
    is tuned with live progress, the report printed (:func:`report_study`) and every
    study of the script closed, also on Ctrl-C. With ``check``, a trainer version the
    storage has not seen is checked first (:func:`stagetree.check.first_contact_check`)
    and a warning printed to stderr when it is not exact. With ``dashboard`` (a port; 0:
    any free one), the dashboard of the study's storage is served on loopback from this
    process while it runs (:func:`stagetree.dashboard.start_dashboard`), its address
    printed before training starts.

    Returns:
        0, or 130 when interrupted (the study is closed cleanly: a later run resumes).

    Raises:
        CommandError: no such script, or it defines no study or no tuner.
    """
    from stagetree.budget import Budget
    from stagetree.engine.settings import overriding
    from stagetree.progress import ProgressDisplay
    from stagetree.study import Study
    from stagetree.tuners.base import Tuner

    stream = sys.stdout if out is None else out
    limits = None if budget is None else Budget.parse(budget)  # before anything runs
    path = Path(script)
    if not path.is_file():
        raise CommandError(f"no such script: {script}")
    token = None
    if token_file is not None:  # read before any override is set
        from stagetree.server.auth import read_token_file

        token = read_token_file(token_file)
    overrides: dict[str, Any] = {}
    saved_env = os.environ.get(STORAGE_ENV)
    if executor is not None:
        from stagetree.executors.registry import check_executor

        try:
            check_executor(executor)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        overrides["executor"] = executor
    if address is not None:
        overrides["address"] = address
    if checkpoints is not None:
        overrides["checkpoint_dir"] = checkpoints
    if url is not None:
        overrides["url"] = url
    if token is not None:
        overrides["token"] = token
    if workers is not None:
        overrides["workers"] = workers
    if storage is not None:
        overrides["storage"] = storage
        os.environ[STORAGE_ENV] = storage
    studies: list[Any] = []
    interrupted = False
    try:
        with overriding(**overrides), _script_context(path) as keep:
            try:
                namespace = _run_user_script(path, str(script))
                keep(namespace)
                studies = list(
                    {id(v): v for v in namespace.values() if isinstance(v, Study)}.values()
                )
                study = _pick(namespace, "study", Study, "study", str(script))
                if study._closed:  # a script without a main guard tuned and closed it
                    study = study._reopened()
                    studies.append(study)
                tuner = _pick(namespace, "tuner", Tuner, "tuner", str(script))
                from stagetree.names import check_space_names

                # Names first: a typo is refused before the storage is even opened.
                check_space_names(study.trainer, getattr(tuner, "space", None))
                from stagetree.server.client import RemoteStudy

                if check and not isinstance(study, RemoteStudy):
                    from stagetree.check import first_contact_check

                    first_contact_check(study, tuner, sys.stderr)
                display = (
                    ProgressDisplay(study, out=stream) if progress else contextlib.nullcontext()
                )
                beside = (
                    _dashboard_beside(study, dashboard, stream)
                    if dashboard is not None
                    else contextlib.nullcontext()
                )
                try:
                    with beside, display:
                        best = study.tune(tuner, budget=limits, progress=False)
                except TrialFailedError as exc:  # no trial succeeded
                    print(f"{exc}", file=sys.stderr)
                    print(f"stagetree run: error: {_one_line(exc)}", file=sys.stderr)
                    return EXIT_FAILED
                report_study(study, best, metric=tuner.metric, mode=tuner.mode, out=stream)
                _print_follow_up(study, saved_env or DEFAULT_STORAGE, stream)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                _close_all(studies)
    finally:
        if storage is not None:
            if saved_env is None:
                os.environ.pop(STORAGE_ENV, None)
            else:
                os.environ[STORAGE_ENV] = saved_env
    if interrupted:
        print("interrupted; run again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _print_follow_up(study: Any, default: str, stream: TextIO) -> None:
    """Name the study's storage in the follow-up commands when ``stagetree status``
    (which reads ``default``) would not find it by itself."""
    from stagetree.server.client import RemoteStudy

    if isinstance(study, RemoteStudy):
        return
    url = study.placement.storage
    if not isinstance(url, str) or url.startswith("memory") or url == default:
        return
    print(
        f"\nsee it again: stagetree status --storage {url}  (or export --storage {url} ...)",
        file=stream,
    )


@contextlib.contextmanager
def _dashboard_beside(study: Any, port: int, stream: TextIO) -> Iterator[None]:
    """The dashboard of ``study``'s storage on loopback while the block runs: a
    read-only handle of a database; a ``memory://`` plan through the study's engine."""
    from stagetree.dashboard import start_dashboard
    from stagetree.server.client import RemoteStudy

    if isinstance(study, RemoteStudy):
        print(f"stagetree run: the dashboard is at {study.url}/ (the server's)", file=stream)
        yield
        return
    study.open()  # the database exists (and is of this schema) before it is read
    storage = study.placement.storage
    store = study._engine.store
    database = isinstance(storage, str) and not storage.strip().startswith(("memory", ":memory:"))
    if database:
        server = start_dashboard(storage, port=port, checkpoints=store)
    else:
        server = start_dashboard("memory://", port=port, checkpoints=store, reader=study.reading)
    print(f"stagetree run: dashboard at {server.url}", file=stream, flush=True)
    try:
        yield
    finally:
        server.stop()
        if database:
            print(
                f"stagetree run: the dashboard stopped with the study; to see it again: "
                f"stagetree dashboard {storage}",
                file=stream,
            )


def _cmd_run(args: argparse.Namespace) -> int:
    return run_script(
        args.script,
        workers=args.workers,
        storage=args.storage,
        progress=not args.no_progress,
        check=not args.no_check,
        executor=args.executor,
        address=args.address,
        checkpoints=args.checkpoints,
        url=args.url,
        token_file=args.token_file,
        dashboard=args.dashboard_port if args.dashboard else None,
        budget=args.budget,
    )


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run the study a script defines, with live progress",
        description="Execute SCRIPT.py (its `if __name__ == '__main__':` block does not "
        "run), tune the Study named `study` with the Tuner named `tuner` (or the only ones "
        "it defines) and print the best trial and what sharing saved. Ctrl-C stops "
        "cleanly; run again to resume.",
    )
    p.add_argument("script", metavar="SCRIPT.py", help="file defining `study` and `tuner`")
    p.add_argument(
        "--workers", type=_positive, metavar="N", help="worker processes (overrides the script)"
    )
    p.add_argument("--storage", metavar="URL", help="plan storage URL (overrides the script)")
    p.add_argument(
        "--executor",
        metavar="NAME",
        help="where workers run: local (processes, the default), ray (a Ray cluster), ... "
        "(overrides the script)",
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="the cluster of --executor ray: auto, HOST:6379 or ray://HOST:10001 "
        "(default: this process's Ray, else a one-machine Ray)",
    )
    p.add_argument(
        "--checkpoints",
        metavar="DIR",
        help="checkpoint location every worker reaches (overrides the script)",
    )
    p.add_argument(
        "--url",
        metavar="URL",
        help="run the script's studies on this tuning server (stagetree serve), e.g. "
        "http://127.0.0.1:8642 (default: $STAGETREE_URL)",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="the server's token (default: $STAGETREE_TOKEN, else the file $STAGETREE_TOKEN_FILE)",
    )
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the dashboard of the study's storage on 127.0.0.1 while it runs "
        "(pip install 'stagetree[dashboard]')",
    )
    p.add_argument(
        "--dashboard-port",
        type=_port,
        default=DASHBOARD_PORT,
        metavar="N",
        help=f"port of --dashboard (default {DASHBOARD_PORT}; 0: any free port)",
    )
    p.add_argument(
        "--budget",
        metavar="LIMITS",
        help="stop the run after this much: 30m, 2h, 90s (wall-clock), '500 steps', "
        "'20 trials', '1h device' (device time), several separated by commas; run again "
        "with a larger budget to go on",
    )
    p.add_argument("--no-progress", action="store_true", help="do not show live progress")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not check a trainer new to the storage for exactness (stagetree check)",
    )
    p.set_defaults(handler=_cmd_run)


# --------------------------------------------------------------------------- status


def _status_rows(st: StudyStatus) -> list[tuple[str, str]]:
    rows = [
        (
            "trials",
            f"{st.trials} ({st.finished} finished, {st.running} running, {st.failed} failed)",
        )
    ]
    if st.hidden:
        rows.append(("older trainers", f"{st.hidden} trials hidden (the trainer changed since)"))
    if st.metric is None:
        rows.append(("best", "no metrics yet"))
    elif st.best is None:
        rows.append((f"best {st.metric}", f"none finite ({st.mode}; {st.metric_note})"))
    else:
        rows.append(
            (
                f"best {st.metric}",
                f"{_num(st.best)} (trial {st.best_trial} at step {st.best_step}, "
                f"{st.mode}; {st.metric_note})",
            )
        )
    rows.extend(_failure_rows(st.failures))
    rows.extend(_lineage_rows(st))
    if st.workers:
        where = ", ".join(f"{w} on {node}" for w, node in st.workers.items())
        rows.append(("workers", f"{where} (last seen)"))
    if st.numbers is not None:
        rows.extend(_accounting_rows(st.numbers))
    else:
        merge = st.steps_requested / st.steps_unique if st.steps_unique else 1.0
        rows.extend(
            [
                ("steps requested", str(st.steps_requested)),
                ("unique steps", str(st.steps_unique)),
                ("merge rate", f"{merge:.2f}"),
                ("steps executed", "not counted per study in this storage (see all studies)"),
            ]
        )
    rows.extend(_efficiency_rows(st.efficiency))  # its latest run's
    if st.budget_stop is not None:
        budget, reached = st.budget_stop
        rows.append(("latest run", f"stopped by its budget ({budget}: {reached} reached)"))
    return rows


def _lineage_rows(st: StudyStatus) -> list[tuple[str, str]]:
    """PBT's exploits: how many trials they made, and the best trial's ancestry."""
    if not st.lineage:
        return []
    text = f"{len(st.lineage)} trials made by PBT exploits"
    chain = st.lineage.get(st.best_trial) if st.best_trial is not None else None
    if chain:
        steps = ", ".join(f"trial {e['donor']} to step {e['step']}" for e in chain)
        text += f"; best trial {st.best_trial} follows {steps}"
    return [("lineage", text)]


def status(
    url: str | None = None,
    study: str | None = None,
    out: TextIO | None = None,
    rich_output: bool | None = None,
) -> StorageStatus:
    """Print the studies of a storage (:func:`stagetree.reports.study_status`: each
    study's own steps executed, device-seconds and saving, counted on the plan trees its
    trials use), and the totals of all studies when the storage holds more than one
    (where a stage that several studies share counts once).

    Args:
        url: storage URL (default: :func:`default_storage`).
        study: only this study.
        out: where to print (default: ``sys.stdout`` at call time).
        rich_output: rich tables instead of plain text (default: ``out`` is a terminal).

    Raises:
        StorageError: the storage cannot be opened, or holds no study ``study``
            (:class:`~stagetree.plan.PlanKeyError`).
    """
    stream = sys.stdout if out is None else out
    url = default_storage() if url is None else url
    storage = open_existing_storage(url)
    try:
        result = storage_status(storage, url, study)
    finally:
        storage.close()
    count = result.studies_total
    header = f"storage {url}: " + (
        "no studies" if count == 0 else f"{count} stud{'y' if count == 1 else 'ies'}"
    )
    blocks: list[tuple[str, list[tuple[str, str]]]] = []
    for st in result.studies:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.created))
        blocks.append((f"study {st.name} (created {created})", _status_rows(st)))
    if count > 1:
        rows = [("trials", str(result.trials)), *_accounting_rows(result.totals)]
        blocks.append((f"all {count} studies", rows))
    if _use_rich(stream, rich_output):
        from rich.console import Console

        console = Console(file=stream)
        console.print(header, style="bold", markup=False, highlight=False)
        for title, rows in blocks:
            _rich_rows(console, rows, title=title)
    else:
        print(header, file=stream)
        for title, rows in blocks:
            print("", file=stream)
            print(title, file=stream)
            _print_rows(rows, stream, indent="  ")
    return result


def _cmd_status(args: argparse.Namespace) -> int:
    status(args.storage, args.study)
    return 0


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="list the studies of a storage and what sharing saved",
        description="Per study: trials, the best metric, steps executed / requested / "
        "unique, device-seconds spent and saved (a stage several studies share counts "
        "for each), and for all studies together when several share the storage. Reads "
        "a storage other processes may be writing.",
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help=f"plan storage URL (default: ${STORAGE_ENV} or {DEFAULT_STORAGE})",
    )
    p.add_argument("--study", metavar="NAME", help="only this study")
    p.set_defaults(handler=_cmd_status)


# --------------------------------------------------------------------------- export


EXPORT_FORMATS = ("csv", "json", "parquet", "tensorboard", "mlflow")


def export(
    url: str | None = None,
    study: str | None = None,
    fmt: str = "csv",
    out: TextIO | str | os.PathLike[str] | None = None,
    history: bool = False,
) -> int:
    """Write the trial table (:func:`stagetree.export.trials_table`: one row per trial,
    the columns of ``Study.trials_dataframe()``) or, with ``history``, every recorded
    metric in long form (``study, trial, step, metric, value``), as CSV, JSON (a list of
    row objects) or Parquet.

    Args:
        url: storage URL (default: :func:`default_storage`).
        study: only this study.
        fmt: ``"csv"``, ``"json"`` or ``"parquet"``.
        out: a text stream (default ``sys.stdout`` at call time) or a file path (written
            whole or not at all; parquet needs one).
        history: the long-form metric history instead of one row per trial.

    Returns:
        Rows written.

    Raises:
        StorageError: the storage cannot be opened, or holds no study ``study``
            (:class:`~stagetree.plan.PlanKeyError`).
        ValueError: an unknown format; MissingExtraError: parquet without pyarrow.
    """
    from stagetree import export as exporting

    if fmt not in exporting.TABLE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(exporting.TABLE_FORMATS)}, got {fmt!r}")
    if fmt == "parquet":
        exporting.require("pyarrow", "parquet", "--format parquet")
    url = default_storage() if url is None else url
    storage = open_existing_storage(url)
    try:
        table = exporting.trials_table(storage, study, history=history)
        hidden = hidden_trials(storage, study)
    finally:
        storage.close()
    if hidden:
        print(f"{hidden} trials of older trainer versions not exported", file=sys.stderr)
    exporting.write_table(table, fmt, out)
    return len(table.rows)


def _cmd_export(args: argparse.Namespace) -> int:
    from stagetree import export as exporting

    output = None if args.output in (None, "-") else args.output
    if args.checkpoint is not None:
        if output is None:
            raise CommandError("--checkpoint needs -o DIR: the directory to write the weights to")
        files = exporting.export_checkpoint(
            args.storage, args.checkpoint, output, checkpoints=args.checkpoints
        )
        names = ", ".join(f.name for f in files)
        print(f"wrote trial {args.checkpoint}'s weights to {output}: {names}", file=sys.stderr)
        return 0
    if args.format is None:
        raise CommandError(
            "give --format (csv, json, parquet, tensorboard, mlflow) or --checkpoint"
        )
    if args.format == "tensorboard":
        exporting.require("tensorboardX", "tensorboard", "--format tensorboard")
        if output is None:
            raise CommandError("--format tensorboard needs -o DIR: the log directory")
        if Path(output).exists() and not Path(output).is_dir():
            raise CommandError(f"-o {output} exists and is not a directory")
        n = exporting.export_tensorboard(args.storage, output, args.study)
        print(
            f"wrote {n} TensorBoard runs to {output} (tensorboard --logdir {output})",
            file=sys.stderr,
        )
        return 0
    if args.format == "mlflow":
        exporting.require("mlflow", "mlflow", "--format mlflow")
        if output is not None:
            raise CommandError("--format mlflow writes to --tracking-uri, not -o")
        done = exporting.export_mlflow(
            args.storage,
            args.study,
            tracking_uri=args.tracking_uri,
            artifacts=args.artifacts,
            checkpoints=args.checkpoints,
        )
        print(
            f"MLflow ({done.tracking_uri}): {done.logged} runs logged, {done.replaced} replaced, "
            f"{done.skipped} unchanged",
            file=sys.stderr,
        )
        if done.no_checkpoint:
            ids = ", ".join(str(i) for i in done.no_checkpoint)
            print(f"no final checkpoint to log for trials {ids}", file=sys.stderr)
        return 0
    if args.format == "parquet" and output is None:
        raise CommandError("--format parquet needs -o FILE")
    try:
        n = export(args.storage, args.study, args.format, output, history=args.history)
    except OSError as exc:
        raise CommandError(f"cannot write {output}: {_one_line(exc)}") from exc
    if output is not None:
        what = "rows" if args.history else "trials"
        print(f"wrote {n} {what} to {output}", file=sys.stderr)
    return 0


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write the trials as CSV, JSON, Parquet, TensorBoard runs or MLflow runs, "
        "or a trial's weights",
        description="csv/json/parquet: one row per trial: study, trial, state, steps, "
        "config.<name>, hp.<name> (readable) and hp.<name>.last, metrics_at, "
        "metric.<name>, error, lineage; --history: every metric by step in long form "
        "(study, trial, step, metric, value). tensorboard: one run per trial under -o DIR "
        "(metrics by step, hyper-parameters in HParams). mlflow: one run per trial "
        "(params, metrics by step; --artifacts: the weights). --checkpoint TRIAL -o DIR: "
        "the trial's trained weights as torch state_dicts (DIR/model.pt) and DIR/trial.json.",
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help=f"plan storage URL (default: ${STORAGE_ENV} or {DEFAULT_STORAGE})",
    )
    p.add_argument("--study", metavar="NAME", help="only this study")
    p.add_argument("--format", choices=EXPORT_FORMATS, help="output format")
    p.add_argument(
        "--history", action="store_true", help="csv/json/parquet: metric history in long form"
    )
    p.add_argument(
        "-o", "--output", metavar="PATH", help="file (csv/json/parquet) or directory to write"
    )
    p.add_argument("--checkpoint", metavar="TRIAL", type=int, help="write this trial's weights")
    p.add_argument(
        "--checkpoints",
        metavar="LOCATION",
        help="checkpoint directory or URL (default: beside a SQLite plan)",
    )
    p.add_argument(
        "--tracking-uri",
        metavar="URI",
        help="mlflow: tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)",
    )
    p.add_argument(
        "--artifacts", action="store_true", help="mlflow: log each trial's weights as artifacts"
    )
    p.set_defaults(handler=_cmd_export)


# --------------------------------------------------------------------------- main

# One function per subcommand: adds its parser and sets ``handler``.
_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_explain,
    _add_run,
    _add_status,
    _add_export,
]


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree simulate SCRIPT.py``: the script's study in virtual time, with and
    without sharing (:func:`stagetree.simulate.simulate_script`)."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
        return value

    def handler(args: argparse.Namespace) -> int:
        from stagetree.simulate import simulate_script

        simulate_script(
            args.script,
            args.workers,
            policy=args.policy,
            step_seconds=args.step_seconds,
            devices_per_worker=args.devices_per_worker,
            parallel_efficiency=args.parallel_efficiency,
        )
        return 0

    def efficiency(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0.0 < value <= 1.0:  # NaN fails too
            raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
        return value

    p = sub.add_parser(
        "simulate",
        help="estimate a study's device-hours and makespan, with and without sharing",
        description="Load SCRIPT.py like `stagetree run` (its `study` and `tuner`; the "
        "study's storage and workers are not touched), run the tuner against simulated "
        "workers in virtual time (real plan, scheduler and tuner; a step-cost model and a "
        "synthetic learning curve instead of training), once with shared stages and once "
        "trial by trial, and print device-hours, makespan and steps of both.",
    )
    p.add_argument("script", metavar="SCRIPT.py", help="file defining `study` and `tuner`")
    p.add_argument("--workers", type=_positive, default=40, help="simulated workers (40)")
    p.add_argument("--policy", choices=["critical_path", "bfs", "thr"], default="critical_path")
    p.add_argument(
        "--step-seconds",
        type=seconds,
        default=1.0,
        help="seconds per step at batch size 128 (1.0; larger batches are faster per step)",
    )
    p.add_argument(
        "--devices-per-worker",
        type=_positive,
        default=None,
        metavar="K",
        help="devices per worker: every trial trains data-parallel on K devices (default: "
        "the study's devices_per_worker, 1)",
    )
    p.add_argument(
        "--parallel-efficiency",
        type=efficiency,
        default=1.0,
        metavar="E",
        help="a step on K devices is 1 + (K - 1) * E times as fast as on one (1.0)",
    )
    p.set_defaults(handler=handler)


_SUBCOMMANDS.append(_add_simulate)


def _add_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree check SCRIPT.py``: is the script's trainer exact
    (:func:`stagetree.check.check_script`)? Exit 0 when it is, 1 when not."""

    def handler(args: argparse.Namespace) -> int:
        from stagetree.check import check_script

        report = check_script(args.script, steps=args.steps, splits=args.splits)
        return 0 if report.exact else 1

    p = sub.add_parser(
        "check",
        help="check that the script's trainer is exact (shared stages = training alone)",
        description="Load SCRIPT.py like `stagetree run` (nothing is trained on the study's "
        "storage), train the first trial of its tuner's space for a few steps straight "
        "through and split with checkpoint round-trips into fresh instances, and report "
        "the first step where metrics or state differ and why. Exit status 0 when exact, "
        "1 when not.",
    )
    p.add_argument("script", metavar="SCRIPT.py", help="file defining `study` (and `tuner`)")
    p.add_argument("--steps", type=_positive, default=4, help="steps per run (4; at least 2)")
    p.add_argument(
        "--splits",
        type=_positive,
        nargs="+",
        metavar="STEP",
        help="steps to split at (default: every step)",
    )
    p.set_defaults(handler=handler)


_SUBCOMMANDS.append(_add_check)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree serve``: a shared tuning server (:func:`stagetree.server.serve`)."""

    def handler(args: argparse.Namespace) -> int:
        from stagetree.server.serve import serve

        return serve(
            args.storage or default_storage(),
            executor=args.executor,
            workers=args.workers,
            checkpoints=args.checkpoints,
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            lease_ttl=args.lease_ttl,
        )

    p = sub.add_parser(
        "serve",
        help="run a shared tuning server that studies tune against (Study(url=...))",
        description="Own the engines, workers and plan of every study that clients tune "
        "over HTTP (Study(..., url=URL, token=...), STAGETREE_URL, stagetree run --url). "
        "Every request needs the token; without --token-file (loopback hosts only) one "
        "is generated into a file of mode 0600 whose path is printed.",
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help="plan storage (default: $STAGETREE_STORAGE or sqlite:///stagetree.db)",
    )
    p.add_argument(
        "--executor",
        default="local",
        metavar="NAME",
        help="where workers run: local (default), ray, inline...",
    )
    p.add_argument(
        "--workers", type=_positive, metavar="N", help="workers of the one pool every study shares"
    )
    p.add_argument(
        "--checkpoints", metavar="URL", help="checkpoint location (default: beside a SQLite plan)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8642, help="port (default 8642)")
    p.add_argument("--token-file", metavar="F", help="file holding the token (needed off loopback)")
    p.add_argument("--ssl-certfile", metavar="F", help="TLS certificate (PEM), with --ssl-keyfile")
    p.add_argument("--ssl-keyfile", metavar="F", help="TLS private key (PEM)")
    p.add_argument(
        "--lease-ttl",
        type=float,
        metavar="S",
        help="seconds before a silent client's session (and a dead server's plan leases) "
        "expire (default: $STAGETREE_LEASE_TTL or 15)",
    )
    p.set_defaults(handler=handler)


_SUBCOMMANDS.append(_add_serve)


def _add_dashboard(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree dashboard``: the web dashboard of a storage
    (:func:`stagetree.dashboard.serve_dashboard`)."""

    def handler(args: argparse.Namespace) -> int:
        from stagetree.dashboard import serve_dashboard

        return serve_dashboard(
            args.storage or default_storage(),
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            checkpoints=args.checkpoints,
            show_token=args.show_token,
        )

    p = sub.add_parser(
        "dashboard",
        help="serve a web dashboard of a storage: the live stage tree, curves, savings",
        description="Serve a read-only dashboard of every study of STORAGE_URL (which "
        "other processes may be training): the stage tree live, learning curves, the "
        "trials, the workers timeline and what sharing saved. Listens on 127.0.0.1; on "
        "any other address every request needs the token of --token-file.",
    )
    p.add_argument(
        "storage",
        nargs="?",
        metavar="STORAGE_URL",
        help=f"plan storage URL (default: ${STORAGE_ENV} or {DEFAULT_STORAGE})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port", type=_port, default=DASHBOARD_PORT, help=f"port (default {DASHBOARD_PORT})"
    )
    p.add_argument(
        "--token-file",
        metavar="F",
        help="file holding the token every request needs (required off loopback)",
    )
    p.add_argument(
        "--checkpoints",
        metavar="DIR",
        help="checkpoint location for downloads (default: beside a SQLite plan)",
    )
    p.add_argument(
        "--show-token",
        action="store_true",
        help="print the address with ?token= (puts the token on the terminal)",
    )
    p.set_defaults(handler=handler)


_SUBCOMMANDS.append(_add_dashboard)


def _grace(text: str) -> float:
    from stagetree.checkpoints.gc import parse_duration

    try:
        return parse_duration(text, "--grace")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_gc(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree gc``: remove checkpoints no live request and no kept trial needs
    (:func:`stagetree.checkpoints.collect_garbage`)."""

    def handler(args: argparse.Namespace) -> int:
        from stagetree.checkpoints.gc import DEFAULT_GRACE, collect_garbage

        try:
            report = collect_garbage(
                args.storage or default_storage(),
                args.checkpoints,
                keep=args.keep,
                study=args.study,
                dry_run=args.dry_run,
                grace=DEFAULT_GRACE if args.grace is None else args.grace,
            )
        except ValueError as exc:  # checked before anything is opened or written
            print(f"stagetree gc: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
        for line in report.lines():
            print(line)
        return 0

    p = sub.add_parser(
        "gc",
        help="remove checkpoints that no pending request and no kept trial needs",
        description="Remove checkpoints of old trainer versions, files killed workers "
        "left unreferenced (once older than --grace), and by --keep: 'all' nothing more; "
        "'leaves' (default) all but every trial's final checkpoint; 'best' all but each "
        "study's best trial's. A checkpoint that pending work starts from is never "
        "removed; a running study's trials' final checkpoints neither (gc refuses). "
        "Prints what it frees, by reason.",
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help=f"plan storage URL (default: ${STORAGE_ENV} or {DEFAULT_STORAGE})",
    )
    p.add_argument(
        "--checkpoints",
        metavar="URL",
        help="checkpoint location (default: beside a SQLite plan)",
    )
    p.add_argument("--study", metavar="NAME", help="only this study's checkpoints")
    p.add_argument(
        "--keep",
        choices=("best", "leaves", "all"),
        default="leaves",
        help="what to keep besides what pending work needs (default: leaves)",
    )
    p.add_argument("--dry-run", action="store_true", help="report what would go; remove nothing")
    p.add_argument(
        "--grace",
        type=_grace,
        metavar="DURATION",
        help="age before an unreferenced file is removed: seconds, or 30m, 2h (default 1h)",
    )
    p.set_defaults(handler=handler)


_SUBCOMMANDS.append(_add_gc)


def build_parser() -> argparse.ArgumentParser:
    """The ``stagetree`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="stagetree",
        description="Hyper-parameter optimization that never trains the same thing twice.",
    )
    parser.add_argument("--version", action="version", version=f"stagetree {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stagetree`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors, --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except BrokenPipeError:  # `stagetree export ... | head`: the reader left
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except StagetreeError as exc:
        message = " ".join(str(exc).split("\n", 1)[0].split()) or type(exc).__name__
        print(f"stagetree {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
