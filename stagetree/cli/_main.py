"""The ``stagetree`` command's entry point: :func:`build_parser` (every subcommand) and
:func:`main`.

Errors that stagetree raises on purpose (:class:`~stagetree.exceptions.StagetreeError`)
print one line to stderr and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

from stagetree import __version__
from stagetree.cli import _check as check
from stagetree.cli import _dashboard as dashboard
from stagetree.cli import _explain as explain
from stagetree.cli import _export as export
from stagetree.cli import _gc as gc
from stagetree.cli import _run as run
from stagetree.cli import _serve as serve
from stagetree.cli import _simulate as simulate
from stagetree.cli import _status as status
from stagetree.cli._options import EXIT_USAGE
from stagetree.exceptions import StagetreeError

__all__ = ["COMMANDS", "build_parser", "main"]

#: One function per subcommand, in the order ``--help`` lists them: each adds its
#: parser and sets ``handler``.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    explain.add_parser,
    run.add_parser,
    status.add_parser,
    export.add_parser,
    simulate.add_parser,
    check.add_parser,
    serve.add_parser,
    dashboard.add_parser,
    gc.add_parser,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``stagetree`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="stagetree",
        description="Hyper-parameter optimization that never trains the same thing twice.",
    )
    parser.add_argument("--version", action="version", version=f"stagetree {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in COMMANDS:
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
