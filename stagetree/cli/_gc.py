"""``stagetree gc``: remove checkpoints no live request and no kept trial needs
(:func:`stagetree.tools.gc.collect_garbage`)."""

from __future__ import annotations

import argparse
import sys

from stagetree.cli._format import one_line
from stagetree.cli._options import EXIT_USAGE
from stagetree.reports.open import DEFAULT_STORAGE, STORAGE_ENV, default_storage
from stagetree.tools.gc import DEFAULT_GRACE, collect_garbage, parse_duration

__all__ = ["add_parser"]


def _grace(text: str) -> float:
    try:
        return parse_duration(text, "--grace")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree gc``: remove checkpoints no live request and no kept trial needs
    (:func:`stagetree.tools.gc.collect_garbage`)."""

    def handler(args: argparse.Namespace) -> int:
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
            print(f"stagetree gc: error: {one_line(exc)}", file=sys.stderr)
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
