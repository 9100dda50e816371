"""``stagetree status``: the studies of a storage: trials, best metric, steps executed,
requested and unique, device-seconds spent and saved (computed by
:mod:`stagetree.reports`, the read side shared with :class:`~stagetree.Study`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from stagetree.cli._format import (
    accounting_rows,
    efficiency_rows,
    failure_rows,
    num,
    print_rows,
    rich_rows,
    use_rich,
)
from stagetree.reports.open import (
    DEFAULT_STORAGE,
    STORAGE_ENV,
    default_storage,
    open_existing_storage,
)
from stagetree.reports.status import StorageStatus, StudyStatus, storage_status

__all__ = ["add_parser", "status"]


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
                f"{num(st.best)} (trial {st.best_trial} at step {st.best_step}, "
                f"{st.mode}; {st.metric_note})",
            )
        )
    rows.extend(failure_rows(st.failures))
    rows.extend(_lineage_rows(st))
    if st.workers:
        where = ", ".join(f"{w} on {node}" for w, node in st.workers.items())
        rows.append(("workers", f"{where} (last seen)"))
    if st.numbers is not None:
        rows.extend(accounting_rows(st.numbers))
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
    rows.extend(efficiency_rows(st.efficiency))  # its latest run's
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
    """Print the studies of a storage (:func:`stagetree.reports.status.study_status`: each
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
            (:class:`~stagetree.exceptions.PlanKeyError`).
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
        rows = [("trials", str(result.trials)), *accounting_rows(result.totals)]
        blocks.append((f"all {count} studies", rows))
    if use_rich(stream, rich_output):
        from rich.console import Console

        console = Console(file=stream)
        console.print(header, style="bold", markup=False, highlight=False)
        for title, rows in blocks:
            rich_rows(console, rows, title=title)
    else:
        print(header, file=stream)
        for title, rows in blocks:
            print("", file=stream)
            print(title, file=stream)
            print_rows(rows, stream, indent="  ")
    return result


def _cmd_status(args: argparse.Namespace) -> int:
    status(args.storage, args.study)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
