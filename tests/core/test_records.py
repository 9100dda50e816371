"""stagetree.records and stagetree.ranking: typed records that read the same strings
and dicts the storages keep, and the one ranking rule."""

from __future__ import annotations

import json
import math

import pytest

from stagetree.ranking import best_key, check_mode, finite, metric_mode, ranked_ids, signed_value
from stagetree.records import (
    ENDED_STATES,
    RunRecord,
    StudyRow,
    TrialError,
    TrialState,
    failure_record,
)


def test_trial_state_is_the_stored_string() -> None:
    assert TrialState.DONE == "done" and TrialState.FAILED == "failed"
    assert {TrialState.DONE: 1}.get("done") == 1  # same hash as the string
    assert "cancelled" in ENDED_STATES and "running" not in ENDED_STATES
    assert json.dumps({"s": TrialState.PENDING}) == '{"s": "pending"}'
    assert str(TrialState.RUNNING) == "running"
    assert ["done", "failed", "done"].count(TrialState.DONE) == 2


def test_failure_record_reads_back_as_trial_error() -> None:
    raw = failure_record("ValueError: boom", "tb", "training step 3")
    assert raw == {
        "type": "ValueError",
        "message": "boom",
        "traceback": "tb",
        "where": "training step 3",
    }
    error = TrialError.from_attrs({"error": raw})
    assert error is not None and error.summary() == "ValueError: boom (training step 3)"
    assert failure_record("no colon here", "")["type"] == "Error"


def test_run_record_from_meta() -> None:
    assert RunRecord.from_meta({}) is None and RunRecord.from_meta({"run": 3}) is None
    run = RunRecord.from_meta(
        {"run": {"started": 10, "workers": 2, "owner": "o", "version": "v", "ended": 12.5}}
    )
    assert run == RunRecord(10.0, 2, "o", "v", 12.5)
    stopped = RunRecord.from_meta({"run": {"budget": "1h", "stopped_by": "time"}})
    assert stopped is not None and stopped.started is None
    assert (stopped.budget, stopped.stopped_by) == ("1h", "time")
    row = StudyRow.from_row({"name": "s", "created": None, "meta": {"run": {"started": 1}}})
    assert row.created == 0.0 and row.run is not None and row.run.started == 1.0


def test_ranking_rule() -> None:
    assert finite(True) is None and finite("x") is None and finite(math.nan) is None
    assert finite("2.5") == 2.5
    assert best_key(3, 0.5, "min", 7) == (3, -0.5, -7)
    assert best_key(3, math.inf, "max", 7) is None
    assert signed_value(2.0, "min") == -2.0 and signed_value(None, "max") == -math.inf
    assert ranked_ids({3: 1.0, 1: 1.0, 2: 5.0}) == [2, 1, 3]
    assert metric_mode("val_loss", {}) == "min" and metric_mode("acc", {}) == "max"
    assert metric_mode("val_loss", {"metric": "val_loss", "mode": "max"}) == "max"
    with pytest.raises(ValueError, match="mode must be"):
        check_mode("best")
