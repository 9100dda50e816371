"""The SQL plan's writes on an engine's hot path take a fixed number of statements,
whatever the number of rows they carry (a statement a row, or a read before each
write, made every round of events cost more as studies and counters grew)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from stagetree.exceptions import PlanKeyError
from stagetree.hp import Constant
from stagetree.plan import SQLPlanStorage

PG_URL = os.environ.get("STAGETREE_TEST_DB_URL")


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'plan.db'}"
    if not PG_URL:
        pytest.skip("set STAGETREE_TEST_DB_URL to run the PostgreSQL backend")
    SQLPlanStorage(PG_URL).drop_all()
    return PG_URL


def _statements(plan: SQLPlanStorage) -> list[str]:
    seen: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(plan._engine, "before_cursor_execute", note)
    return seen


def test_counters_of_many_scopes_take_one_statement(url: str) -> None:
    plan = SQLPlanStorage(url)
    try:
        plan.add_stats("s0", steps=1.0)
        seen = _statements(plan)
        plan.add_stats_many({"s0": {"steps": 2.0}})
        one = len(seen)
        seen.clear()
        many = {f"s{i}": {"steps": 1.0, "device_seconds": 0.5, "other": 3.0} for i in range(8)}
        plan.add_stats_many(many)
        assert len(seen) == one  # 24 counters, 8 of them new: as many statements as one
        assert plan.stats("s0") == {"device_seconds": 0.5, "other": 3.0, "steps": 4.0}
        assert plan.stats("s7") == {"device_seconds": 0.5, "other": 3.0, "steps": 1.0}
        assert plan.stats()["steps"] == 11.0
    finally:
        plan.close()


def test_atomically_commits_its_calls_once_or_not_at_all(url: str) -> None:
    plan = SQLPlanStorage(url)
    try:
        plan.create_study("s", {})
        ins = plan.insert_trial("r", {}, 4, request=False)
        before = plan.revision()
        commits: list[int] = []  # every transaction, reads too
        event.listen(plan._engine, "commit", lambda conn: commits.append(1))

        def write() -> int:
            tid = plan.add_trial("s", "r", {}, {}, 4, ins.node, ins.step)
            plan.add_request(ins.node, ins.step)
            plan.update_trial(tid, state="running")
            return tid

        tid = plan.atomically(write)
        assert len(commits) == 1 and plan.revision() == before + 1
        assert plan.trial(tid)["state"] == "running"
        assert plan.request(ins.node, ins.step) is not None

        def broken() -> None:
            plan.add_trial("s", "r", {"x": 1}, {}, 4, ins.node, ins.step)
            plan.put_metrics(ins.node, ins.step, {"acc": 1.0})
            raise RuntimeError("crash")

        with pytest.raises(RuntimeError):
            plan.atomically(broken)
        assert len(plan.trials("s")) == 1  # nothing of it was written
        assert plan.get_metrics(ins.node, ins.step) is None
        assert plan.revision() == before + 1

        plan.insert_trial("q", {"lr": Constant(0.2)}, 4, request=False)

        def planted() -> None:  # a new path, then a crash: the tree holds no trace of it
            plan.insert_trial("q", {"lr": Constant(0.1)}, 4, request=False)
            raise RuntimeError("crash")

        with pytest.raises(RuntimeError):
            plan.atomically(planted)
        assert plan.locate("q", {"lr": Constant(0.1)}, 4) is None
        again = plan.insert_trial("q", {"lr": Constant(0.1)}, 4, request=False)
        assert plan.locate("q", {"lr": Constant(0.1)}, 4) == (again.node, 4)
        assert plan.node(again.node).root_key == "q"
    finally:
        plan.close()


def test_update_trial_decides_on_the_callers_read(url: str) -> None:
    """``update_trial(seen=...)`` reads nothing: unchanged, it writes nothing; changed,
    it sends one statement and returns the row as written."""
    plan = SQLPlanStorage(url)
    try:
        plan.create_study("s", {})
        ins = plan.insert_trial("r", {}, 4, request=False)
        tid = plan.add_trial("s", "r", {}, {}, 4, ins.node, ins.step, attrs={"a": 1})
        seen = _statements(plan)
        row = plan.trial(tid)
        del seen[:]
        assert plan.update_trial(tid, state="pending", attrs={"a": 1}, seen=row) == row
        assert seen == []
        out = plan.update_trial(tid, state="done", attrs={"b": 2}, seen=row)
        assert out["state"] == "done" and out["attrs"] == {"b": 2}
        trials = [s for s in seen if "stagetree_trials" in s]
        assert len(trials) == 1 and trials[0].lstrip().upper().startswith("UPDATE")
        assert plan.trial(tid) == out
        with pytest.raises(PlanKeyError):
            plan.update_trial(tid + 1, state="done", seen=row)
    finally:
        plan.close()
