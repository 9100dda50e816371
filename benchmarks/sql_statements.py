"""Statements the SQL plan receives per trial, by shape: the study of
``tests/fakes/sql_trace.random_search`` (a random search of 8-step trials on 4
simulated workers) on a fresh SQLite file, every statement counted (reads, BEGINs).

Usage: ``python benchmarks/sql_statements.py [TRIALS] [URL]`` from a checkout's root;
``URL``: a PostgreSQL database instead (its stagetree tables are emptied first).
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fakes"))

from sql_trace import random_search
from sqlalchemy import event

from stagetree.plan.sql import SQLPlanStorage


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    folder = Path(tempfile.mkdtemp())
    url = sys.argv[2] if len(sys.argv) > 2 else f"sqlite:///{folder / 'plan.db'}"
    plan = SQLPlanStorage(url)
    if len(sys.argv) > 2:
        plan.drop_all()
        plan = SQLPlanStorage(url)
    shapes: collections.Counter[str] = collections.Counter()

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        folded = " ".join(statement.split()).lower()
        shapes[re.sub(r"^select .*? from", "select .. from", folded)[:110]] += 1

    event.listen(plan._engine, "before_cursor_execute", note)
    random_search(plan, folder, trials)
    print(f"statements per trial: {sum(shapes.values()) / trials:.2f} ({trials} trials)")
    for shape, n in shapes.most_common(40):
        print(f"{n / trials:6.2f}  {shape}")


if __name__ == "__main__":
    main()
