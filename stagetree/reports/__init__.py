"""The read side: what every reader of results (a Study, the commands, a server, the
dashboard) asks of a plan storage, one answer per question. Pure, read-only functions
of a :class:`~stagetree.plan.BasePlanStorage`.

* :mod:`.trials`: trial records and learning curves, final metrics, failures,
  progress, the best trial.
* :mod:`.costs`: accounting, what a study cost and saved, the efficiency of a run.
* :mod:`.status`: what ``stagetree status`` prints.
* :mod:`.activity`: the batches, from the activity records.
* :mod:`.lineage`: how population based training made a trial.
* :mod:`.views`: the dashboard's JSON.
* :mod:`.export`: tables, TensorBoard and MLflow runs, a trial's weights.
* :mod:`.format`: values in short text form.
* :mod:`.open`: opening an existing storage to read it.

Modules of stagetree import the submodule they need, never this package's names; the
names below are resolved lazily, for users of the former ``stagetree.reports`` module.
(The accounting lives in :mod:`.costs`, not ``.accounting``: a submodule of that name
would hide the function :func:`~stagetree.reports.costs.accounting` exported here.)
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "EFFICIENCY_KEYS",
    "StorageStatus",
    "StudyStatus",
    "TreeCurves",
    "TrialError",
    "TrialRecord",
    "accounting",
    "best_key",
    "best_record",
    "best_trial",
    "efficiency",
    "export_records",
    "export_table",
    "failures",
    "final_metrics",
    "final_records",
    "final_value",
    "format_value",
    "hidden_trials",
    "last_points",
    "metric_mode",
    "path_segments",
    "progress",
    "quiet_gc",
    "ranked_metric",
    "records_of",
    "short_sequence",
    "storage_status",
    "study_accounting",
    "study_record",
    "study_status",
    "trial_records",
    "trial_rows",
]

_HOME = {
    "TrialError": "stagetree.records",
    "TrialRecord": "stagetree.records",
    "best_key": "stagetree.ranking",
    "metric_mode": "stagetree.ranking",
    "EFFICIENCY_KEYS": "stagetree.reports.costs",
    "accounting": "stagetree.reports.costs",
    "efficiency": "stagetree.reports.costs",
    "study_accounting": "stagetree.reports.costs",
    "StorageStatus": "stagetree.reports.status",
    "StudyStatus": "stagetree.reports.status",
    "storage_status": "stagetree.reports.status",
    "study_status": "stagetree.reports.status",
    "export_records": "stagetree.reports.export",
    "export_table": "stagetree.reports.export",
    "format_value": "stagetree.reports.format",
    "short_sequence": "stagetree.reports.format",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME.get(name, "stagetree.reports.trials")), name)
