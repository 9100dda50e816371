"""The per-worker and per-batch state the scheduler keeps across decisions (idle workers
by position, running batches by promised evaluation, those that promise nothing live):
equal to the state listed from scratch (``forest_check.check``) on the event orders
that the simulated runs rarely produce, and the decisions that depend on it."""

from __future__ import annotations

from typing import Any

from forest_check import check

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
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    WorkerLost,
)


def _one_trial(
    workers: int, steps: tuple[int, ...], plan: MemoryPlanStorage | None = None
) -> tuple[Scheduler, int, RunBatch]:
    """A scheduler with one trial of 20 steps that asks for results at ``steps``, and
    the batch it started."""
    plan = plan or MemoryPlanStorage()
    ins = plan.insert_trial("r", {"lr": 0.1}, 20, request=False)
    events: list[Any] = [RootAdded("r", {}), *(NodeAdded(n) for n in ins.new_nodes)]
    events += [RequestAdded(ins.node, t) for t in steps]
    sched = Scheduler(num_workers=workers)
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
