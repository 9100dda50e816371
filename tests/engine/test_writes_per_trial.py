"""What a trial writes to the SQL plan, by transaction: the tuner's records of a
decision go with the submission they decide (no commit of their own, durable before
it acts); the lease of a batch and its trials' running state go together; the end of
a trial carries what the engine kept of its round (curve points, metrics, the
checkpoint's record, counters) in its own transaction, durable before the trial is
answered; the rest of a round (lease releases, activity) is one transaction. A trial
made about eleven write transactions, now about four."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sql_trace import Statement, random_search, transactions
from sql_trace import writes as _writes

from stagetree.plan.sql import SQLPlanStorage

TRIALS = 12
_trials: list[dict[str, Any]] = []  # the last run's trial rows


def _submits(tx: list[Statement]) -> int:
    return sum(
        '"event":"submit"' in str(params)
        for s, params in tx
        if s.startswith("insert into stagetree_logs ")
    )


def _run(url: str, tmp_path: Path) -> tuple[list[list[Statement]], list[Any]]:
    """The committed transactions of a random search of TRIALS trials, and its log."""
    plan = SQLPlanStorage(url)
    seen = transactions(plan)
    out = random_search(plan, tmp_path, TRIALS)
    assert [t["state"] for t in out["trials"]] == ["done"] * TRIALS
    _trials[:] = out["trials"]
    return seen, out["log"]


def test_a_decisions_log_records_are_written_with_the_trial_it_submits(
    sql_plan_url: str, tmp_path: Path
) -> None:
    seen, log = _run(sql_plan_url, tmp_path)
    assert sum(r["event"] == "submit" for r in log) == TRIALS
    new_trials = [i for i, tx in enumerate(seen) if _writes(tx, "trials", "insert into")]
    assert len(new_trials) == TRIALS
    # A decision is durable before it acts: when the n-th trial is recorded, n
    # submissions are logged (RandomSearch decides them all at once: the first
    # submission's transaction carries every record).
    logged = 0
    for n, i in enumerate(new_trials, 1):
        logged = sum(_submits(tx) for tx in seen[: i + 1])
        assert logged >= n
    log_only = [
        tx for tx in seen if _writes(tx, "logs") and not _writes(tx, "trials", "insert into")
    ]
    # The log's records are no transactions of their own but the run's first (its
    # version's mark, before the study's log was checked) and the completions no
    # decision followed, written when the run ends (was one a record: 25 here).
    assert len(log_only) <= 2


def test_a_trial_takes_about_four_write_transactions(sql_plan_url: str, tmp_path: Path) -> None:
    seen, _ = _run(sql_plan_url, tmp_path)
    writes = [
        tx
        for tx in seen
        if any(s.startswith(("insert", "update", "delete")) for s, _ in tx)
        # the counters alone: once a second of the clock while progress is reported
        # (tests/engine/test_count_writes.py), not per trial
        and not all(_writes([t], "stats") or _writes([t], "meta") for t in tx if t[0][0] in "iud")
    ]
    # Submission (path, trial row, request, log records); the batch's lease with its
    # trial's running state; the trial's end with what the round kept; the round's rest.
    assert len(writes) <= 5 * TRIALS  # was 9 a trial
    for tx in seen:  # a lease is taken with the running state of the trial it trains
        if _writes(tx, "leases", "insert into") and not _writes(tx, "studies"):
            assert any(s.startswith("update stagetree_trials ") for s, _ in tx) or not any(
                s.startswith("select stagetree_trials.") for s, _ in tx
            )


def test_a_trial_is_answered_after_its_checkpoint_and_metrics_are_durable(
    sql_plan_url: str, tmp_path: Path
) -> None:
    """The writes kept for the round's end are in the trial end's transaction when the
    end needs them: a trial stored done never lacks its metrics or its checkpoint's
    record, and a lease is released no earlier than the record of the checkpoint at its
    end."""
    seen, trials = _run(sql_plan_url, tmp_path)[0], _trials

    def first(table: str, verb: str, match: Any) -> int:
        return min(
            (
                i
                for i, tx in enumerate(seen)
                for s, params in tx
                if s.startswith(f"{verb} stagetree_{table} ") and match(s, params)
            ),
            default=len(seen),
        )

    def at(table: str, key: tuple[int, int]) -> int:  # the first insert of (node, step)
        return first(table, "insert into", lambda s, p: tuple(p[:2]) == key)

    for t in trials:
        done = first("trials", "update", lambda s, p, t=t: "done" in p and p[-1] == t["id"])
        assert done < len(seen)
        assert at("checkpoints", (t["node"], t["step"])) <= done
        assert at("metrics", (t["node"], t["step"])) <= done
    leases = {
        p[0]: (p[3], p[5])
        for tx in seen
        for s, p in tx
        if s.startswith("insert into stagetree_leases ") and p[3] is not None
    }
    assert leases
    for lease_id, (node, stop) in leases.items():
        released = first(
            "leases", "delete from", lambda s, p, i=lease_id: "owner" in s and i in p[1:]
        )
        assert at("checkpoints", (node, stop)) <= released
