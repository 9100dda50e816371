"""Device needs and out-of-memory recovery in the scheduler (TreeML §5.2): a tree's
stages go only to workers with the devices it needs, and an out-of-memory failure
doubles the need up to the largest worker instead of failing the trial."""

from __future__ import annotations

from typing import Any

from stagetree.hp import Constant
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import NodeAdded, RequestAdded, RequestFailed, RootAdded, Scheduler
from stagetree.scheduler.events import DevicesLearned
from stagetree.work import BatchFailed, FusedOutOfMemory, RunBatch, WorkerReady

CONST = {"lr": Constant(0.1)}
OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def _trial(
    sched: Scheduler, plan: MemoryPlanStorage, root: str = "r", devices: int = 1, steps: int = 10
) -> tuple[list[Any], tuple[int, int]]:
    out = sched.handle(RootAdded(root, {"root": root}, devices=devices))
    ins = plan.insert_trial(root, CONST, steps, request=False)
    for node in ins.new_nodes:
        out += sched.handle(NodeAdded(node))
    out += sched.handle(RequestAdded(ins.node, ins.step))
    return out, (ins.node, ins.step)


def _cluster(devices: list[int]) -> tuple[Scheduler, MemoryPlanStorage]:
    sched = Scheduler()
    for w, k in enumerate(devices):
        assert sched.handle(WorkerReady(w, k)) == []
    return sched, MemoryPlanStorage()


def _runs(out: list[Any]) -> list[RunBatch]:
    return [x for x in out if isinstance(x, RunBatch)]


def _oom(batch: RunBatch, node: int) -> BatchFailed:
    return BatchFailed(batch.batch_id, batch.worker, node, 0, OOM, "tb", kind="oom")


def test_a_declared_need_goes_to_a_worker_with_enough_devices() -> None:
    sched, plan = _cluster([1, 1, 2, 4])
    (batch,) = _runs(_trial(sched, plan, "big", devices=2)[0])
    assert batch.worker == 2  # the smallest worker with two devices
    (other,) = _runs(_trial(sched, plan, "small")[0])
    assert other.worker == 0  # the large workers stay free for the large needs
    assert sched.devices_needed("big") == 2 and sched.worker_devices(3) == 4


def test_a_need_waits_for_a_large_enough_worker_to_be_free() -> None:
    sched, plan = _cluster([1, 2])
    (first,) = _runs(_trial(sched, plan, "a", devices=2)[0])
    assert first.worker == 1
    out, _ = _trial(sched, plan, "b", devices=2)
    assert _runs(out) == []  # worker 0 is idle but too small
    assert sched.idle_workers == [0]


def test_out_of_memory_doubles_the_need_up_to_the_largest_worker() -> None:
    sched, plan = _cluster([1, 2, 4])
    out, (node, _) = _trial(sched, plan)
    (batch,) = _runs(out)
    assert batch.worker == 0
    out = sched.handle(_oom(batch, node))
    assert [x for x in out if isinstance(x, DevicesLearned)] == [DevicesLearned("r", 2)]
    assert not [x for x in out if isinstance(x, RequestFailed)]
    (again,) = _runs(out)
    assert again.worker == 1  # twice the devices
    out = sched.handle(_oom(again, node))
    assert DevicesLearned("r", 4) in out
    (last,) = _runs(out)
    assert last.worker == 2
    # Out of memory on the largest worker: the trial fails, naming the need.
    out = sched.handle(_oom(last, node))
    (failed,) = [x for x in out if isinstance(x, RequestFailed)]
    assert "OutOfMemoryError" in failed.error and "needs more than 4 devices" in failed.error
    assert sched.idle()


def test_out_of_memory_is_not_counted_as_a_retry() -> None:
    sched, plan = _cluster([1, 2])
    sched.max_retries = 0
    out, (node, _) = _trial(sched, plan)
    (batch,) = _runs(out)
    out = sched.handle(_oom(batch, node))
    assert _runs(out) and not [x for x in out if isinstance(x, RequestFailed)]


def test_a_need_larger_than_every_worker_fails_with_the_need() -> None:
    sched, plan = _cluster([1, 2])
    out, key = _trial(sched, plan, "huge", devices=8)
    (failed,) = [x for x in out if isinstance(x, RequestFailed)]
    assert (failed.node, failed.step) == key
    assert "needs 8 devices" in failed.error and "largest worker has 2" in failed.error
    # Other trees still run.
    assert _runs(_trial(sched, plan, "ok")[0])


def test_uniform_workers_decide_as_before() -> None:
    """Without needs, workers announced with one device each are picked as before (the
    lowest idle id), so golden traces stay as they are."""
    sched, plan = _cluster([1, 1, 1])
    picks = [_runs(_trial(sched, plan, f"r{i}")[0])[0].worker for i in range(3)]
    assert picks == [0, 1, 2]


def test_a_fused_job_out_of_memory_halves_the_trees_fused_width() -> None:
    sched, plan = _cluster([1])
    _trial(sched, plan, "r")
    out = sched.handle(FusedOutOfMemory(0, "r", 8))
    assert out == [DevicesLearned("r", 1, 4)]
    assert sched.handle(FusedOutOfMemory(0, "r", 8)) == []  # known already
    assert sched.handle(FusedOutOfMemory(0, "r", 4)) == [DevicesLearned("r", 1, 2)]
