"""What a batch's claim costs the SQL plan in statements (each costs the driver about
0.1 ms on SQLite, on the cores the workers train on, at every batch end): its
transaction deleted the expired leases although there were none, and read the metrics
of each request the batch evaluates and the checkpoint records of its nodes apart. Now
the expired leases are deleted only when the lease read finds some, and one read of the
checkpoint records answers both questions (metrics read only where a record is)."""

from __future__ import annotations

import time
from pathlib import Path

from sql_trace import random_search, transactions

from stagetree.hp import Constant, Piecewise
from stagetree.plan.sql import SQLPlanStorage

TRIALS = 8


def test_a_claim_sends_one_read_of_checkpoints_and_no_delete(
    sql_plan_url: str, tmp_path: Path
) -> None:
    plan = SQLPlanStorage(sql_plan_url)
    done = transactions(plan)
    out = random_search(plan, tmp_path, TRIALS)
    assert [t["state"] for t in out["trials"]] == ["done"] * TRIALS
    claims = [tx for tx in done if any(s.startswith("insert into stagetree_leases") for s, _ in tx)]
    assert len(claims) >= TRIALS
    for tx in claims:
        sent = [s for s, _ in tx]
        assert not [s for s in sent if s.startswith("delete from stagetree_leases")], sent
        assert not [s for s in sent if "from stagetree_metrics" in s], sent
        assert len([s for s in sent if "from stagetree_checkpoints" in s]) <= 1, sent


def test_a_claim_still_deletes_expired_leases(sql_plan_url: str) -> None:
    plan = SQLPlanStorage(sql_plan_url)
    a = plan.insert_trial("r", {"lr": Constant(0.1)}, 8, request=False)
    old = plan.claim("other", "r", [(a.node, 0, 4)], 0.05)
    assert old.ok
    time.sleep(0.1)
    mine = plan.claim("me", "r", [(a.node, 0, 4)], 30.0)
    assert mine.ok  # the expired lease is no conflict
    assert [lease.owner for lease in plan.leases(live_only=False)] == ["me"]


def test_a_trial_row_written_decodes_its_sequences_through_the_cache(tmp_path: Path) -> None:
    # A batch's start and a trial's end write the trial's row, which comes back decoded:
    # its sequences decoded afresh each time cost about a fifth of the write. Through
    # the handle's sequence cache they are the cache's shared objects, as trials() gives.
    plan = SQLPlanStorage(f"sqlite:///{tmp_path / 'p.db'}")
    plan.create_study("s", {})
    hp = {"lr": Piecewise([0.1, 0.03, 0.003], [8, 12])}
    tid = plan.add_trial("s", "r", {"seed": 0}, hp, 16, None, None)
    running = plan.update_trial(tid, state="running", only_from="pending")
    done = plan.update_trial(tid, state="done", only_from="running")
    read = plan.trial(tid)
    assert running["hp"] == done["hp"] == read["hp"] == hp
    assert running["hp"]["lr"] is done["hp"]["lr"] is read["hp"]["lr"]
    assert read["hp"]["lr"] is plan.trials("s")[0]["hp"]["lr"]
