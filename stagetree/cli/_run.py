"""``stagetree run SCRIPT.py``: run the study a script defines with its tuner, with live
progress, then print the best trial and what sharing saved
(:func:`stagetree.cli._format.report_study`). Ctrl-C closes the study (workers stop,
the storage stays consistent) and exits with status 130."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from stagetree.budget import Budget
from stagetree.cli._format import one_line, report_study
from stagetree.cli._options import EXIT_FAILED, EXIT_INTERRUPTED, port_number, positive, seconds
from stagetree.dashboard import DEFAULT_PORT as DEFAULT_DASHBOARD_PORT
from stagetree.dashboard import start_dashboard
from stagetree.engine.settings import overriding
from stagetree.exceptions import CommandError, TrialFailedError
from stagetree.executors.registry import check_executor
from stagetree.names import check_tuner_fits
from stagetree.progress import ProgressDisplay
from stagetree.reports.open import DEFAULT_STORAGE, STORAGE_ENV
from stagetree.server.client import RemoteStudy
from stagetree.study import Study
from stagetree.study_api import INTERRUPTED_MESSAGE
from stagetree.tools.check import first_contact_check
from stagetree.tools.scripts import loaded_script, pick, script_path, values_of
from stagetree.trainer import check_checkpointable
from stagetree.tuners.base import Tuner
from stagetree.web.auth import read_token_file

__all__ = ["add_parser", "command_line_overrides", "run_script"]


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
    step_timeout: float | None = None,
    stop_timeout: float | None = None,
) -> int:
    """``stagetree run``: run the study a script defines with its tuner.

    ``budget`` limits the run (``"30m"``, ``"500 steps"``, ``"20 trials"``, ``"1h
    device"``; see :class:`stagetree.budget.Budget`); it is checked before the script
    runs. ``step_timeout`` (seconds a training step may take: a stuck trainer's
    request fails with the reason) and ``stop_timeout`` (seconds a stop waits for the
    running stages to checkpoint) override the studies' ``step_timeout=`` and
    ``stop_timeout=``.

    ``executor`` (a registered name: ``local``, ``ray``...), ``address`` (the cluster
    of a cluster executor) and ``checkpoints`` (the checkpoint location) override the
    script's studies as ``workers`` and ``storage`` do. ``url`` runs every study of the
    script on that tuning server (``stagetree serve``) with the token in ``token_file``
    (default: ``$STAGETREE_TOKEN`` / ``$STAGETREE_TOKEN_FILE``); the exactness check is
    then left out (the server's trainer version is what trains).

    The script runs under ``__name__ == "__stagetree_run__"`` (its ``if __name__ ==
    "__main__":`` block does not run) with ``workers`` and ``storage`` as overrides
    that every ``Study(...)`` it builds honours (``storage`` is also exported as
    ``$STAGETREE_STORAGE`` for the run). A script without a main guard that tunes its
    study while it loads (with ``budget`` unless it gives its own) is not tuned again:
    that tuning is reported. The study is the ``Study`` named ``study`` (or
    the only one), the tuner the ``Tuner`` named ``tuner`` (or the only one). The study
    is tuned with live progress, the report printed (:func:`report_study`) and every
    study of the script closed, also on Ctrl-C. With ``check``, a trainer version the
    storage has not seen is checked first (:func:`stagetree.tools.check.first_contact_check`)
    and a warning printed to stderr when it is not exact. With ``dashboard`` (a port; 0:
    any free one), the dashboard of the study's storage is served on loopback from this
    process while it runs (:func:`stagetree.dashboard.start_dashboard`), its address
    printed before training starts.

    Returns:
        0, or 130 when interrupted (the study is closed cleanly: a later run resumes).

    Raises:
        CommandError: no such script, or it defines no study or no tuner.
    """
    stream = sys.stdout if out is None else out
    limits = None if budget is None else Budget.parse(budget)  # before anything runs
    script_path(script)  # before the token file or any override is read
    token = None
    if token_file is not None:  # read before any override is set
        token = read_token_file(token_file)
    if executor is not None:
        try:
            check_executor(executor)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    default = os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE  # before --storage sets it
    try:
        with (
            command_line_overrides(
                executor=executor,
                address=address,
                checkpoints=checkpoints,
                url=url,
                token=token,
                workers=workers,
                storage=storage,
                budget=limits,
                step_timeout=step_timeout,
                stop_timeout=stop_timeout,
            ),
            loaded_script(script) as namespace,
        ):
            studies = values_of(namespace, Study)
            try:
                study = pick(namespace, "study", Study, "study", str(script))
                # A script without a main guard tuned its study while it loaded (under
                # the command's overrides and budget): that was the run; report it.
                tuned = study._last_tune
                if study._closed:  # ... and closed it: reopened to read its figures
                    run = study.last_run
                    study = study._reopened()
                    study.last_run = run
                    studies.append(study)
                if tuned is not None:
                    tuner, best = tuned
                    report_study(study, best, metric=tuner.metric, mode=tuner.mode, out=stream)
                    _print_follow_up(study, default, stream)
                    return 0
                tuner = pick(namespace, "tuner", Tuner, "tuner", str(script))
                # Names first: a typo is refused before the storage is even opened.
                check_tuner_fits(study.trainer, tuner)
                if not study._virtual_time():
                    check_checkpointable(study.trainer)
                if check and not isinstance(study, RemoteStudy):
                    # A trainer that fails, or a metric it never returns, stops the run
                    # here, before any worker starts.
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
                    print(f"stagetree run: error: {one_line(exc)}", file=sys.stderr)
                    return EXIT_FAILED
                report_study(study, best, metric=tuner.metric, mode=tuner.mode, out=stream)
                _print_follow_up(study, default, stream)
            finally:
                _close_all(studies)
    except KeyboardInterrupt:
        print(INTERRUPTED_MESSAGE, file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


@contextlib.contextmanager
def command_line_overrides(
    *,
    executor: str | None = None,
    address: str | None = None,
    checkpoints: str | None = None,
    url: str | None = None,
    token: str | None = None,
    workers: int | None = None,
    storage: str | None = None,
    budget: Budget | None = None,
    step_timeout: float | None = None,
    stop_timeout: float | None = None,
) -> Iterator[None]:
    """While the block runs, every ``Study(...)`` honours the options given (None: the
    script's own), every ``tune()`` without a budget of its own ``budget``, and
    ``storage`` is also ``$STAGETREE_STORAGE``; both are restored when it ends."""
    saved_env = os.environ.get(STORAGE_ENV)
    given = {
        "executor": executor,
        "address": address,
        "checkpoint_dir": checkpoints,
        "url": url,
        "token": token,
        "workers": workers,
        "storage": storage,
        "budget": budget,
        "step_timeout": step_timeout,
        "stop_timeout": stop_timeout,
    }
    chosen = {key: value for key, value in given.items() if value is not None}
    if storage is not None:
        os.environ[STORAGE_ENV] = storage
    try:
        with overriding(**chosen):
            yield
    finally:
        if storage is not None:
            if saved_env is None:
                os.environ.pop(STORAGE_ENV, None)
            else:
                os.environ[STORAGE_ENV] = saved_env


def _print_follow_up(study: Any, default: str, stream: TextIO) -> None:
    """Name the study's storage in the follow-up commands when ``stagetree status``
    (which reads ``default``) would not find it by itself."""
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
        step_timeout=args.step_timeout,
        stop_timeout=args.stop_timeout,
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        "--workers", type=positive, metavar="N", help="worker processes (overrides the script)"
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
        "(needs starlette and uvicorn: the dashboard extra)",
    )
    p.add_argument(
        "--dashboard-port",
        type=port_number,
        default=DEFAULT_DASHBOARD_PORT,
        metavar="N",
        help=f"port of --dashboard (default {DEFAULT_DASHBOARD_PORT}; 0: any free port)",
    )
    p.add_argument(
        "--budget",
        metavar="LIMITS",
        help="stop the run after this much: 30m, 2h, 90s (wall-clock), '500 steps', "
        "'20 trials', '1h device' (device time), several separated by commas; run again "
        "with a larger budget to go on",
    )
    p.add_argument(
        "--step-timeout",
        type=seconds,
        metavar="SECONDS",
        help="seconds a training step may take: a stuck trainer's trial fails with the "
        "reason and its worker is replaced (default: no limit; overrides the script)",
    )
    p.add_argument(
        "--stop-timeout",
        type=seconds,
        metavar="SECONDS",
        help="seconds a stop (Ctrl-C, a budget) waits for the running stages to "
        "checkpoint before it stops their workers (default 5; overrides the script)",
    )
    p.add_argument("--no-progress", action="store_true", help="do not show live progress")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not check a trainer new to the storage for exactness (stagetree check)",
    )
    p.set_defaults(handler=_cmd_run)
