"""The batches' inputs the forest keeps across decisions (``StageForest.
set_batch``): equal to the ones listed from scratch after random event sequences, and a
decision after one batch's progress looks at that batch's plan tree only."""

from __future__ import annotations

import random
from typing import Any

import pytest
from forest_check import check, checked_forest
from test_scheduler_sim import Sim, random_trials

from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import NodeAdded, RequestAdded, RootAdded, Scheduler
from stagetree.work import Progress, RunBatch

__all__ = ["checked_forest"]  # the fixture, used by name below


@pytest.mark.usefixtures("checked_forest")
@pytest.mark.parametrize("seed", range(6))
def test_kept_batch_inputs_equal_scratch_at_every_decision(seed: int) -> None:
    """Arrivals, cancellations, live splits, lost workers: before every stage tree the
    kept positions and promises per plan tree (running and saving batches) and the
    models in memory equal the ones listed from scratch."""
    rng = random.Random(300 + seed)
    sim = Sim(workers=rng.randint(1, 4))
    trials = random_trials(rng, 20, horizon=150)
    for trial in rng.sample(trials, 5):
        trial.leave = trial.arrive + rng.randint(0, 60)
    sim.run(trials, rng=rng, lose_prob=0.01)
    check(sim.sched)
    assert sim.sched.running == {}
    assert sim.sched._forest.batch_inputs() == {}


def _started(trees: int) -> tuple[Scheduler, list[RunBatch]]:
    """A scheduler with one trial per plan tree, each running on its own worker."""
    plan = MemoryPlanStorage()
    events: list[Any] = []
    for i in range(trees):
        events.append(RootAdded(f"r{i}", {}))
        ins = plan.insert_trial(f"r{i}", {"lr": 0.1}, 20, request=False)
        events += [NodeAdded(n) for n in ins.new_nodes]
        events += [RequestAdded(ins.node, 10), RequestAdded(ins.node, 20)]
    sched = Scheduler(num_workers=trees)
    out = sched.handle_all(events)
    return sched, [b for b in out if isinstance(b, RunBatch)]


def test_one_batch_progress_compares_one_plan_tree() -> None:
    """Eight plan trees running: a decision after one batch's progress compares the
    inputs of that batch's plan tree only (before: every plan tree with running work)."""
    sched, batches = _started(8)
    assert len(batches) == 8
    first = batches[0]
    sched.handle(Progress(first.batch_id, first.worker, first.segments[0].node, 3, 0.1))
    sched.stage_tree()
    assert sched._forest.compared == 1


def test_a_batch_that_moves_on_leaves_its_promises_counted_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Progress moves a batch's position, not what it promised: the decision after it
    neither takes its promises out of the counts nor puts them back (two walks of them
    per touched batch before), and asks the forest for no per-call inputs (the scheduler
    reports every batch through set_batch); the tree stays the one a scratch build
    gives."""
    from counting import counting

    from stagetree.scheduler.forest import StageForest

    sched, batches = _started(4)
    promises = counting(monkeypatch, StageForest, "_promise")
    kept = sched._forest._volatile
    for step in (3, 5, 7):
        for batch in batches:
            node = batch.segments[0].node
            sched.handle(Progress(batch.batch_id, batch.worker, node, step, 0.1))
            check(sched)
            sched.stage_tree()
    assert promises[0] == 0
    assert sched._forest._volatile is kept  # no signatures of per-call inputs made again
