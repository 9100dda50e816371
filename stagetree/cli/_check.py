"""``stagetree check SCRIPT.py``: is the script's trainer exact
(:func:`stagetree.tools.check.check_script`)? Exit status 0 when it is, 1 when not."""

from __future__ import annotations

import argparse

from stagetree.cli._options import positive
from stagetree.tools.check import check_script

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree check SCRIPT.py``: is the script's trainer exact
    (:func:`stagetree.tools.check.check_script`)? Exit 0 when it is, 1 when not."""

    def handler(args: argparse.Namespace) -> int:
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
    p.add_argument("--steps", type=positive, default=4, help="steps per run (4; at least 2)")
    p.add_argument(
        "--splits",
        type=positive,
        nargs="+",
        metavar="STEP",
        help="steps to split at (default: every step)",
    )
    p.set_defaults(handler=handler)
