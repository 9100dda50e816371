"""``stagetree export``: the trials as CSV, JSON, Parquet, TensorBoard or MLflow runs
(:mod:`stagetree.reports.export`), or a trial's weights."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

from stagetree.cli._format import one_line
from stagetree.exceptions import CommandError
from stagetree.reports import export as exporting
from stagetree.reports.open import (
    DEFAULT_STORAGE,
    STORAGE_ENV,
    default_storage,
    open_existing_storage,
)
from stagetree.reports.trials import hidden_trials

__all__ = ["EXPORT_FORMATS", "add_parser", "export"]

EXPORT_FORMATS = ("csv", "json", "parquet", "tensorboard", "mlflow")


def export(
    url: str | None = None,
    study: str | None = None,
    fmt: str = "csv",
    out: TextIO | str | os.PathLike[str] | None = None,
    history: bool = False,
) -> int:
    """Write the trial table (:func:`stagetree.reports.export.trials_table`: one row per trial,
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
            (:class:`~stagetree.exceptions.PlanKeyError`).
        ValueError: an unknown format; MissingExtraError: parquet without pyarrow.
    """

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
        raise CommandError(f"cannot write {output}: {one_line(exc)}") from exc
    if output is not None:
        what = "rows" if args.history else "trials"
        print(f"wrote {n} {what} to {output}", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
