"""The engine's ledger writes each study's step counts once per round of events (one
transaction), not once per progress report: on SQLite that was most of a large
study's driver time."""

from __future__ import annotations

from stagetree.engine.ledger import Ledger
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.scopes import study_scope


class CountingPlan(MemoryPlanStorage):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def add_stats_many(self, deltas):  # type: ignore[no-untyped-def]
        self.writes += 1
        super().add_stats_many(deltas)


def test_counts_of_a_round_are_written_once_and_add_up() -> None:
    plan = CountingPlan()
    ledger = Ledger(plan, "owner", lambda: 0.0)
    ledger.study_versions.update({"a": "v1", "b": "v1"})
    usage = {"a": 0.0, "b": 0.0}
    for step in range(1, 11):  # ten progress reports, each charging a step to a (and b)
        after = {"a": float(step), "b": usage["b"] + step % 2}
        assert ledger.count_studies(usage, after, rate=0.5) == {
            name: 1.0 for name in after if after[name] > usage[name]
        }
        usage = after
    assert plan.writes == 0 and plan.stats(study_scope("a", "v1")).get("steps_executed", 0) == 0
    ledger.write_counts()
    assert plan.writes == 1
    a, b = plan.stats(study_scope("a", "v1")), plan.stats(study_scope("b", "v1"))
    assert (a["steps_executed"], a["device_seconds"]) == (10, 5.0)
    assert (b["steps_executed"], b["device_seconds"]) == (5, 2.5)
    ledger.write_counts()  # nothing new: no transaction
    assert plan.writes == 1


def test_counts_are_written_at_most_every_given_seconds_of_the_clock() -> None:
    plan = CountingPlan()
    now = [0.0]
    ledger = Ledger(plan, "owner", lambda: now[0])
    ledger.study_versions["a"] = "v1"
    for step in range(1, 31):  # a report every 0.1 s for 3 s, written at most once a second
        ledger.count_studies({"a": step - 1.0}, {"a": float(step)}, rate=1.0)
        ledger.write_counts(every=1.0)
        now[0] += 0.1
    assert plan.writes == 3
    ledger.write_counts()  # unthrottled: what is kept is written at once
    assert plan.writes == 4
    assert plan.stats(study_scope("a", "v1"))["steps_executed"] == 30
