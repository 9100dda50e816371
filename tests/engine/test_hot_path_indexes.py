"""Every statement a study sends to its SQL plan while it trains is answered from an
index (no table scan), so that its cost per trial does not grow with the study: checked
on SQLite with ``EXPLAIN QUERY PLAN``. Only the leases (live ones only: about one a
worker) and the studies are read whole."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import event

from stagetree.distributions import LogUniform
from stagetree.executors.simulated import LearningCurve, SimulatedExecutor, SimulatedTrainer
from stagetree.hp import Constant
from stagetree.plan import sql
from stagetree.space import RandomSpace
from stagetree.study import Study
from stagetree.tuners import RandomSearch

SMALL = ("stagetree_leases", "stagetree_studies", "stagetree_meta")


def test_a_study_on_sqlite_reads_and_writes_through_indexes(
    tmp_path: Path, monkeypatch: Any
) -> None:
    seen: dict[str, Any] = {}
    opened = sql.SQLPlanStorage.__init__

    def init(self: sql.SQLPlanStorage, *args: Any, **kwargs: Any) -> None:
        opened(self, *args, **kwargs)

        def note(conn: Any, cursor: Any, statement: str, params: Any, ctx: Any, many: bool) -> None:
            seen.setdefault(statement, params[0] if many and params else params)

        event.listen(self._engine, "before_cursor_execute", note)

    monkeypatch.setattr(sql.SQLPlanStorage, "__init__", init)
    executor = SimulatedExecutor(4, curve=LearningCurve(aliases={"acc": "accuracy"}))
    space = RandomSpace(hp={"lr": Constant(LogUniform(1e-3, 0.3))})  # type: ignore[arg-type]
    with Study(
        "s",
        SimulatedTrainer,
        storage=f"sqlite:///{tmp_path / 'plan.db'}",
        workers=4,
        checkpoint_dir=str(tmp_path / "ckpt"),
        executor=lambda: executor,
    ) as study:
        study.tune(RandomSearch(space, "acc", steps=16, num_trials=12, seed=0))
    db = sqlite3.connect(tmp_path / "plan.db")
    scans = []
    for statement, params in seen.items():
        if not statement.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "INSERT")):
            continue
        for row in db.execute("EXPLAIN QUERY PLAN " + statement, params or ()):
            detail = str(row[-1])
            if detail.startswith("SCAN ") and not detail.split()[1].startswith(SMALL):
                scans.append((detail, " ".join(statement.split())[:200]))
    db.close()
    assert scans == []
