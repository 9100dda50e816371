"""Plans on disk written before numbers shared by value (issue 25) keep working."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from stagetree.hp import Constant, MultiStep, Piecewise, Warmup, dumps_hp
from stagetree.plan import SQLPlanStorage

R = "root"


def test_a_plan_with_integral_floats_is_found_again(tmp_path: Path) -> None:
    # The stored JSON keeps the spelling (128.0, a warm-up from 0.0): the same trials
    # find their nodes and metrics again, nothing is planned anew.
    url = f"sqlite:///{tmp_path / 'p.db'}"
    trials = [
        {"bs": MultiStep(128.0, [40], 2.0), "lr": Warmup(5, 0.1)},
        {"bs": Constant(128.0), "lr": Warmup(5, 0.1)},
        {"bs": Constant(128.0), "lr": Constant(1.0)},
    ]
    plan = SQLPlanStorage(url)
    ends = [plan.insert_trial(R, hp, 60) for hp in trials]
    for end in ends:
        plan.put_metrics(end.node, end.step, {"acc": 0.5})
    texts = [dumps_hp(n.hp) for n in plan.nodes(R)]
    plan.close()
    assert '"value":128.0' in "".join(texts)
    again = SQLPlanStorage(url)
    for hp, end in zip(trials, ends):
        ins = again.insert_trial(R, hp, 60, request=False)
        assert (ins.node, ins.step, ins.new_nodes) == (end.node, end.step, ())
        assert again.get_metrics(ins.node, ins.step) == {"acc": 0.5}
    again.close()


def test_a_plan_with_both_spellings_still_loads(tmp_path: Path) -> None:
    # Written before: Piecewise([16, 2], [4]) was stored as [16, 2.0] beside [16, 2],
    # two siblings then. Emulated by rewriting a stored node's JSON.
    path = tmp_path / "p.db"
    plan = SQLPlanStorage(f"sqlite:///{path}")
    plan.insert_trial(R, {"bs": Constant(16)}, 10)
    first = plan.insert_trial(R, {"bs": Piecewise([16, 2], [4])}, 10)
    second = plan.insert_trial(R, {"bs": Piecewise([16, 3], [4])}, 10)
    plan.put_metrics(second.node, 10, {"acc": 0.25})
    plan.close()
    legacy = dumps_hp({"bs": Piecewise([16, 2.0], [4])})
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE stagetree_nodes SET hp = ? WHERE id = ?", (legacy, second.node))
    again = SQLPlanStorage(f"sqlite:///{path}")
    assert len(again.nodes(R)) == 3
    ins = again.insert_trial(R, {"bs": Piecewise([16, 2.0], [4])}, 10, request=False)
    assert (ins.node, ins.new_nodes) == (first.node, ())
    assert again.get_metrics(second.node, 10) == {"acc": 0.25}  # its trials keep it
    again.close()
