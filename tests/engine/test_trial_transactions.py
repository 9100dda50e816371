"""A trial's submission (its row and its request) and its end (its metrics, its
request's state and its own state) are one transaction each on the SQL plan: a
transaction costs the driver a commit, and a trial made about twenty of them, most of
its cost on SQLite. Together they also never leave a trial without its request, or one
reported finished whose state or metrics are not stored yet."""

from __future__ import annotations

from pathlib import Path

from sql_trace import Statement, random_search, transactions, writes

from stagetree.plan.sql import SQLPlanStorage

TRIALS = 12


def _writes(tx: list[Statement], table: str) -> bool:
    return writes(tx, table, "insert into") or writes(tx, table, "update")


def test_a_trial_is_submitted_and_ended_in_one_transaction_each(
    sql_plan_url: str, tmp_path: Path
) -> None:
    plan = SQLPlanStorage(sql_plan_url)
    seen = transactions(plan)
    trials = random_search(plan, tmp_path, TRIALS)["trials"]
    assert [t["state"] for t in trials] == ["done"] * TRIALS
    new_trials = [tx for tx in seen if writes(tx, "trials", "insert into")]
    assert len(new_trials) == TRIALS
    for tx in new_trials:  # the trial's row and its request go in together
        assert _writes(tx, "requests")
    # Once the workers run (from the first submission on), its path's new node too.
    assert sum(_writes(tx, "nodes") for tx in new_trials) >= TRIALS - 1
    trial_ends = [tx for tx in seen if _writes(tx, "trials") and _writes(tx, "requests")]
    # Each end writes the request's state and the trial's state together (and the
    # metrics held for the checkpoint, when there are any).
    assert len(trial_ends) == 2 * TRIALS
    # Transactions that write trials, requests or metrics: one submission, one start
    # (the trial's state: running) and one end a trial, not one a record.
    record_writes = [
        tx for tx in seen if any(_writes(tx, t) for t in ("trials", "requests", "metrics"))
    ]
    assert len(record_writes) <= 3 * TRIALS + 2
