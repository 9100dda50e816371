"""Shared helper of the transaction tests (no tests here): what a SQL plan commits."""

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

# One statement (white space folded, lower case) and its parameters' values, in order.
Statement = tuple[str, Any]


def transactions(plan: SQLPlanStorage) -> list[list[Statement]]:
    """The statements of each transaction ``plan`` commits from now on (a list per
    commit, filled as they commit; rolled-back ones are left out)."""
    done: list[list[Statement]] = []
    current: list[Statement] = []

    def note(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        # The values in the statement's order, whatever the driver's parameter style.
        values = tuple(params.values()) if isinstance(params, dict) else params
        current.append((" ".join(statement.split()).lower(), values))

    def commit(conn: Any) -> None:
        done.append(list(current))
        current.clear()

    def rollback(conn: Any) -> None:
        current.clear()

    event.listen(plan._engine, "before_cursor_execute", note)
    event.listen(plan._engine, "commit", commit)
    event.listen(plan._engine, "rollback", rollback)
    return done


def writes(tx: list[Statement], table: str, verb: str = "") -> bool:
    """Whether ``tx`` inserts, updates or deletes (only ``verb`` when given) rows of
    ``table`` (its name without the ``stagetree_`` prefix)."""
    verbs = (verb,) if verb else ("insert into", "update", "delete from")
    return any(s.startswith(tuple(f"{v} stagetree_{table} " for v in verbs)) for s, _ in tx)


def random_search(plan: SQLPlanStorage, tmp_path: Path, trials: int) -> dict[str, Any]:
    """Tune study ``"s"`` (version ``"v"``) on ``plan`` with a ``RandomSearch`` of
    ``trials`` trials of 8 steps on 4 simulated workers; returns its trial rows
    (``"trials"``) and its tuner log (``"log"``), read before the study closes."""
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
        study.tune(RandomSearch(space, "acc", steps=8, num_trials=trials, seed=0))
        return {"trials": plan.trials("s"), "log": plan.read_log("s")}
    finally:
        study.close()


def statements(plan: SQLPlanStorage) -> list[str]:
    """Every statement ``plan`` sends from now on (white space folded, lower case),
    committed or not, reads included."""
    seen: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(" ".join(statement.split()).lower())

    event.listen(plan._engine, "before_cursor_execute", note)
    return seen
