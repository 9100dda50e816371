"""The per-worker and per-batch state the scheduler keeps across decisions (idle workers
by position, running batches by promised evaluation, those that promise nothing live):
equal to the state listed from scratch (``forest_check.check``) on the event orders
that the simulated runs rarely produce, and the decisions that depend on it."""

from __future__ import annotations

import random
from typing import Any

import pytest
from forest_check import check, checked_forest
from test_scheduler_sim import Sim, random_trials

from stagetree.hp import Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import (
    NodeAdded,
    RequestAdded,
    RequestCancelled,
    RequestDone,
    RootAdded,
    Scheduler,
)
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    WorkerLost,
    WorkerReady,
)

__all__ = ["checked_forest"]  # the fixture, used by name below


def _one_trial(
    workers: int,
    steps: tuple[int, ...],
    plan: MemoryPlanStorage | None = None,
    sched: Scheduler | None = None,
) -> tuple[Scheduler, int, RunBatch]:
    """A scheduler (``sched``, or one with ``workers`` workers) with one trial of 20
    steps that asks for results at ``steps``, and the batch it started."""
    plan = plan or MemoryPlanStorage()
    ins = plan.insert_trial("r", {"lr": 0.1}, 20, request=False)
    events: list[Any] = [RootAdded("r", {}), *(NodeAdded(n) for n in ins.new_nodes)]
    events += [RequestAdded(ins.node, t) for t in steps]
    sched = sched or Scheduler(num_workers=workers)
    out = sched.handle_all(events)
    (batch,) = [b for b in out if isinstance(b, RunBatch)]
    check(sched)
    return sched, ins.node, batch


def test_late_metrics_of_a_lost_batch_abort_its_retry() -> None:
    """A lost worker's metrics arrive after its batch was planned again elsewhere: the
    request settles, and the retry, which promises nothing live any more, is aborted at
    the next decision."""
    plan = MemoryPlanStorage()
    sched, node, first = _one_trial(2, (20,), plan)
    out = sched.handle(WorkerLost(first.worker, first.batch_id, "gone"))
    (retry,) = [b for b in out if isinstance(b, RunBatch)]
    check(sched)
    out = sched.handle(MetricsReported(first.batch_id, first.worker, node, 20, {"loss": 0.5}))
    assert RequestDone(node, 20, {"loss": 0.5}) in out
    check(sched)
    other = plan.insert_trial("r", {"lr": 0.2}, 20, request=False)
    events: list[Any] = [NodeAdded(n) for n in other.new_nodes]
    out = sched.handle_all([*events, RequestAdded(other.node, 20)])
    assert Abort(retry.batch_id, retry.worker) in out
    check(sched)


def test_request_cancelled_and_asked_again_in_one_round_keeps_its_batch() -> None:
    """A request cancelled and asked for again before the next decision: the batch that
    evaluates it is not aborted."""
    sched, node, batch = _one_trial(1, (20,))
    out = sched.handle_all([RequestCancelled(node, 20), RequestAdded(node, 20)])
    assert not [x for x in out if isinstance(x, Abort)]
    check(sched)
    out = sched.handle(RequestCancelled(node, 20))
    assert Abort(batch.batch_id, batch.worker) in out
    check(sched)


def test_metrics_after_the_checkpoint_is_durable() -> None:
    """Metrics at a point whose checkpoint is already durable settle at once: the batch
    no longer promises that evaluation, and is aborted once its last live request goes."""
    sched, node, batch = _one_trial(1, (10, 20))
    w, b = batch.worker, batch.batch_id
    for t in range(1, 11):
        sched.handle(Progress(b, w, node, t, 0.1))
    sched.handle(CheckpointSaved(b, w, node, 10, "ck10", 1, 0.0))
    out = sched.handle(MetricsReported(b, w, node, 10, {"loss": 0.5}))
    assert RequestDone(node, 10, {"loss": 0.5}) in out
    check(sched)
    out = sched.handle(RequestCancelled(node, 20))
    assert Abort(b, w) in out
    check(sched)


def test_workers_that_come_later_with_more_devices_make_a_mixed_cluster() -> None:
    """Whether the workers differ in devices is kept, and worked out again when a worker
    comes: a stage goes to the smallest idle worker that fits once they differ."""
    plan = MemoryPlanStorage()
    sched = Scheduler(num_workers=None)
    sched.handle(WorkerReady(0, devices=1))
    sched, _, first = _one_trial(0, (20,), plan, sched)
    assert first.worker == 0
    sched.handle_all([WorkerReady(1, devices=4), WorkerReady(2, devices=1)])
    check(sched)
    other = plan.insert_trial("r", {"lr": 0.2}, 20, request=False)
    events: list[Any] = [NodeAdded(n) for n in other.new_nodes]
    out = sched.handle_all([*events, RequestAdded(other.node, 20)])
    (second,) = [b for b in out if isinstance(b, RunBatch)]
    assert second.worker == 2
    check(sched)


def test_a_failed_batch_lets_go_of_its_checkpoints() -> None:
    """A batch that fails is planned again (a retry): the failed one no longer stands
    for the checkpoints it was asked for, the retry does."""
    sched = Scheduler(num_workers=1, max_retries=1)
    sched, node, batch = _one_trial(1, (10, 20), sched=sched)
    sched.handle(Progress(batch.batch_id, batch.worker, node, 3, 0.1))
    out = sched.handle(BatchFailed(batch.batch_id, batch.worker, node, 3, "boom", ""))
    (retry,) = [b for b in out if isinstance(b, RunBatch)]
    assert retry.batch_id != batch.batch_id
    check(sched)
    assert sched._promising[(node, 10)] == {retry.batch_id}


def test_a_lost_worker_takes_its_saving_batches_with_it() -> None:
    """A batch ended with its last checkpoint still being written, then its worker is
    lost: the write never comes, the batch is forgotten, its request planned again."""
    sched, node, batch = _one_trial(2, (20,))
    w, b = batch.worker, batch.batch_id
    for t in range(1, 21):
        sched.handle(Progress(b, w, node, t, 0.1))
    sched.handle(MetricsReported(b, w, node, 20, {"loss": 0.5}))
    sched.handle(BatchDone(b, w, 1.0, 20))
    assert sched.is_saving(b)
    check(sched)
    out = sched.handle(WorkerLost(w, None, "gone"))
    assert not sched.is_saving(b)
    assert [x.evaluate_at for x in out if isinstance(x, RunBatch)] == [((node, 20),)]
    check(sched)


def test_a_trial_that_waits_for_a_running_batch_asks_it_for_a_checkpoint() -> None:
    """Without branch checkpoints, a trial that branches off ahead of a running batch
    waits for it: the batch is asked for a checkpoint at the branch point, and that
    checkpoint, once durable, is no longer pending."""
    plan = MemoryPlanStorage()
    sched = Scheduler(num_workers=2, branch_checkpoints=False)
    ins = plan.insert_trial("r", {"lr": Piecewise([0.1, 0.1], [15])}, 20, request=False)
    events: list[Any] = [RootAdded("r", {}), *(NodeAdded(n) for n in ins.new_nodes)]
    out = sched.handle_all([*events, RequestAdded(ins.node, 20)])
    (batch,) = [b for b in out if isinstance(b, RunBatch)]
    w, b = batch.worker, batch.batch_id
    sched.handle(Progress(b, w, ins.node, 2, 0.1))
    other = plan.insert_trial("r", {"lr": Piecewise([0.1, 0.01], [10])}, 20, request=False)
    events = [NodeAdded(n) for n in other.new_nodes]
    out = sched.handle_all([*events, RequestAdded(other.node, 20)])
    (asked,) = [x for x in out if isinstance(x, AddCheckpoint)]
    assert (asked.batch_id, asked.step) == (b, 10)
    check(sched)
    for t in range(3, 11):
        sched.handle(Progress(b, w, asked.node, t, 0.1))
    out = sched.handle(CheckpointSaved(b, w, asked.node, 10, "ck", 1, 0.0))
    check(sched)
    assert (asked.node, 10) not in sched.running[b].checkpoint_at
    assert [x.start_at for x in out if isinstance(x, RunBatch)] == [(asked.node, 10)]


@pytest.mark.usefixtures("checked_forest")
def test_kept_state_equals_scratch_with_live_splits() -> None:
    """Trials that ask for their last step only (so running batches are split for the
    ones that branch off ahead of them), cancellations and lost workers: before every
    stage tree the kept state equals the state listed from scratch."""
    splits = 0
    for seed in range(6):
        rng = random.Random(700 + seed)
        sim = Sim(workers=rng.randint(1, 4))
        trials = random_trials(rng, 15, horizon=100)
        for trial in trials:
            trial.rungs = (trial.steps,)
        for trial in rng.sample(trials, 3):
            trial.leave = trial.arrive + rng.randint(0, 40)
        sim.run(trials, rng=rng, lose_prob=0.01)
        check(sim.sched)
        splits += sim.splits
    assert splits > 0


def _pick_from_scratch(sched: Scheduler, start: Any, need: int) -> int:
    """The worker ``_pick_worker`` chose before it read the idle workers by position: a
    walk of every idle worker, sorted."""
    if start in sched._memory:
        return sched._memory[start]
    idle = sorted(sched._idle)
    if sched._devices and len({sched.worker_devices(w) for w in idle}) > 1:
        idle = [w for w in idle if sched.worker_devices(w) >= need]
        idle.sort(key=sched.worker_devices)
    if start is not None:
        for worker in idle:
            if sched._worker_at.get(worker) == start:
                return worker
    for worker in idle:
        if sched._worker_at.get(worker) not in sched._held_starts:
            return worker
    return idle[0]


def test_picked_workers_equal_the_walk_of_every_idle_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many workers, trials that continue models idle workers hold: every worker picked
    is the one the walk of every idle worker picks."""
    pick = Scheduler._pick_worker
    picks: list[int] = []

    def checked(self: Scheduler, start: Any, need: int = 1) -> int:
        want = _pick_from_scratch(self, start, need)
        got = pick(self, start, need)
        assert got == want
        picks.append(got)
        return got

    monkeypatch.setattr(Scheduler, "_pick_worker", checked)
    for seed in range(6):
        rng = random.Random(900 + seed)
        sim = Sim(workers=rng.randint(4, 10))
        sim.run(random_trials(rng, 30, horizon=120))
        assert sim.metrics.keys() == sim.requested
    assert len(picks) > 100


@pytest.mark.parametrize("mixed", [False, True])
def test_picked_worker_equals_the_walk_on_random_idle_workers(mixed: bool) -> None:
    """Idle and busy workers at random positions (several at one), random held starts
    and devices: the worker picked is the one the walk of every idle worker picks."""
    rng = random.Random(11 + mixed)
    positions: list[Any] = [(1, 4), (1, 8), (2, 8)]
    for _ in range(400):
        n = rng.randint(1, 12)
        sched = Scheduler(num_workers=n)
        if mixed:
            sched.handle_all([WorkerReady(w, devices=rng.choice((1, 2))) for w in range(n)])
        for w in range(n):
            if w and rng.random() < 0.3:
                sched._idle.discard(w)
            at = rng.choice([*positions, None])
            if at is not None:
                sched._worker_at[w] = at
            sched._place(w)
        sched._held_starts = set(rng.sample(positions, rng.randint(0, 3)))
        start = rng.choice([*positions, None])
        need = rng.choice((1, 2))
        assert sched._pick_worker(start, need) == _pick_from_scratch(sched, start, need)
