"""A trial's submission (its row and its request) and its end (its metrics, its
request's state and its own state) are one transaction each on the SQL plan: a
transaction costs the driver a commit, and a trial made about twenty of them, most of
its cost on SQLite. Together they also never leave a trial without its request, or one
reported finished whose state or metrics are not stored yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event

from stagetree.distributions import LogUniform
from stagetree.executors.simulated import LearningCurve, SimulatedExecutor, SimulatedTrainer
from stagetree.hp import Constant
from stagetree.plan.sql import SQLPlanStorage
from stagetree.space import RandomSpace
from stagetree.study import Study
from stagetree.tuners import RandomSearch

TRIALS = 12


def _transactions(plan: SQLPlanStorage) -> list[list[str]]:
    """The statements of each committed transaction (a list per commit), recorded."""
    done: list[list[str]] = []
    current: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        current.append(" ".join(statement.split()).lower())

    def commit(conn: Any) -> None:
        done.append(list(current))
        current.clear()

    def rollback(conn: Any) -> None:
        current.clear()

    event.listen(plan._engine, "before_cursor_execute", note)
    event.listen(plan._engine, "commit", commit)
    event.listen(plan._engine, "rollback", rollback)
    return done


def _writes(tx: list[str], table: str) -> bool:
    return any(
        s.startswith((f"insert into stagetree_{table} ", f"update stagetree_{table} ")) for s in tx
    )


def test_a_trial_is_submitted_and_ended_in_one_transaction_each(
    sql_plan_url: str, tmp_path: Path
) -> None:
    plan = SQLPlanStorage(sql_plan_url)
    seen = _transactions(plan)
    executor = SimulatedExecutor(4, curve=LearningCurve(aliases={"acc": "accuracy"}))
    space = RandomSpace(hp={"lr": Constant(LogUniform(1e-3, 0.3))})  # type: ignore[arg-type]
    study = Study(
        "s",
        SimulatedTrainer,
        storage=plan,
        workers=4,
        checkpoint_dir=str(tmp_path / "ckpt"),
        executor=lambda: executor,
        version="v",
    )
    try:
        study.tune(RandomSearch(space, "acc", steps=8, num_trials=TRIALS, seed=0))
        trials = plan.trials("s")
    finally:
        study.close()
    assert [t["state"] for t in trials] == ["done"] * TRIALS
    new_trials = [
        tx for tx in seen if any(s.startswith("insert into stagetree_trials ") for s in tx)
    ]
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
