"""The ``stagetree`` command, and the functions behind its subcommands for scripts and
tests: ``main(argv)`` runs it; ``run_script``, ``status``, ``export``, ``explain``
do what their subcommands do and return what they found.

The implementation is private, one module per subcommand: :mod:`._main` builds the
parser and dispatches to ``_explain``, ``_run``, ``_status``, ``_export``,
``_simulate``, ``_check``, ``_serve``, ``_dashboard``, ``_gc`` (each has
``add_parser(sub)``, which adds its subparser and sets ``handler`` to a function
``(args) -> int``); :mod:`._format` prints what several of them share and
:mod:`._options` holds their argument types and exit statuses. What the commands read
comes from :mod:`stagetree.reports` (re-exported here: a command shows the same records
a study returns), and the storage a command reads is opened by
:mod:`stagetree.reports.open`. This is the top floor: nothing in stagetree imports it.
"""

from __future__ import annotations

from stagetree.cli._explain import ExplainResult, explain, plan_trials, tree_lines
from stagetree.cli._export import EXPORT_FORMATS, export
from stagetree.cli._format import efficiency_line, report_study
from stagetree.cli._main import build_parser, main
from stagetree.cli._options import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE
from stagetree.cli._run import run_script
from stagetree.cli._status import status
from stagetree.exceptions import CommandError
from stagetree.reports.costs import accounting
from stagetree.reports.export import export_records, export_table
from stagetree.reports.format import short_sequence
from stagetree.reports.open import (
    DEFAULT_STORAGE,
    STORAGE_ENV,
    default_storage,
    open_existing_storage,
)
from stagetree.reports.status import StorageStatus, StudyStatus, storage_status, study_status
from stagetree.reports.trials import hidden_trials

__all__ = [
    "DEFAULT_STORAGE",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "EXPORT_FORMATS",
    "STORAGE_ENV",
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
