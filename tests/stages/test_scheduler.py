"""Scheduler decisions, event by event, without processes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

import stagetree.scheduler as scheduler_pkg
from stagetree.exceptions import SchedulerError
from stagetree.hp import Constant, MultiStep
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import (
    BasePolicy,
    CheckpointAvailable,
    CheckpointLost,
    CostEstimator,
    NodeAdded,
    RequestAdded,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RootAdded,
    Scheduler,
    make_policy,
)
from stagetree.scheduler.events import SaveSteps
from stagetree.stages import Stage, StageTree
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    CheckpointFailed,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    SplitMissed,
    WorkerLost,
    WorkerReady,
)


class Harness:
    """A scheduler fed from a memory plan, like the study layer does."""

    def __init__(self, workers: int | None = 1, **kwargs: Any) -> None:
        self.plan = MemoryPlanStorage()
        self.sched = Scheduler(num_workers=workers, **kwargs)
        self.roots: set[str] = set()

    def root(self, root: str) -> list[Any]:
        """Add plan tree ``root`` (once)."""
        if root in self.roots:
            return []
        self.roots.add(root)
        return self.sched.handle(RootAdded(root, {"seed": 0, "root": root}))

    def trial(
        self, hp: Mapping[str, Any], steps: int, root: str = "r", count: int = 1
    ) -> tuple[tuple[int, int], list[Any]]:
        out = self.root(root)
        ins = self.plan.insert_trial(root, hp, steps, request=False)
        for node in ins.new_nodes:
            out += self.sched.handle(NodeAdded(node))
        out += self.sched.handle(RequestAdded(ins.node, ins.step, count))
        return (ins.node, ins.step), out

    def __call__(self, event: Any) -> list[Any]:
        return self.sched.handle(event)


def only(out: list[Any], kind: type) -> list[Any]:
    return [x for x in out if isinstance(x, kind)]


def segs(batch: RunBatch) -> list[tuple[int, int, int]]:
    return [(s.node, s.start, s.stop) for s in batch.segments]


def finish(h: Harness, batch: RunBatch, metrics: bool = True) -> list[Any]:
    """Feed back a batch that runs to its end, in the order a worker reports."""
    out: list[Any] = []
    for seg in batch.segments:
        out += h(Progress(batch.batch_id, batch.worker, seg.node, seg.stop, 0.1))
    if metrics:
        for n, s in batch.evaluate_at:
            out += h(MetricsReported(batch.batch_id, batch.worker, n, s, {"loss": s / 1000}))
    for n, s in batch.checkpoint_at:
        out += h(CheckpointSaved(batch.batch_id, batch.worker, n, s, f"ck-{n}-{s}", 1, 0.0))
    out += h(
        BatchDone(batch.batch_id, batch.worker, 1.0, sum(s.stop - s.start for s in batch.segments))
    )
    return out


CONST = {"lr": Constant(0.1)}
AT50 = {"lr": MultiStep(0.1, [50], 0.1)}
AT70 = {"lr": MultiStep(0.1, [70], 0.5)}
AT150 = {"lr": MultiStep(0.1, [150], 0.1)}


def grid(h: Harness) -> dict[str, tuple[int, int]]:
    return {
        "const": h.trial(CONST, 100)[0],  # node 1
        "at50": h.trial(AT50, 120)[0],  # node 2: the longest path
        "at70": h.trial(AT70, 90)[0],  # node 3
    }


# --------------------------------------------------------------------------- assignment


def test_grid_runs_the_critical_path_then_siblings_from_the_branch_checkpoint() -> None:
    h = Harness(workers=None)
    ends = grid(h)
    assert h.sched.pending() == list(ends.values())
    (batch,) = h(WorkerReady(0))
    assert isinstance(batch, RunBatch)
    assert (batch.worker, batch.root_key, batch.config) == (0, "r", {"seed": 0, "root": "r"})
    assert (batch.start_step, batch.start_at, batch.start_checkpoint) == (0, None, None)
    assert segs(batch) == [(1, 0, 50), (2, 50, 120)]
    assert batch.segments[1].hp == AT50
    assert batch.evaluate_at == ((2, 120),)
    assert batch.checkpoint_at == ((1, 50), (2, 120))
    assert h.sched.pending() == [ends["const"], ends["at70"]]
    assert [r.origin.kind for r in h.sched.stage_tree().roots] == ["running"]  # type: ignore[union-attr]
    assert h.sched.idle_workers == []

    # a second worker has nothing ready: the rest waits for the checkpoint at 50
    assert h(WorkerReady(1)) == []
    assert h(Progress(batch.batch_id, 0, 1, 50, 0.1)) == []
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 50, "ck-50", 10, 0.1))
    (second,) = only(out, RunBatch)
    assert second.worker == 1
    assert (second.start_step, second.start_at, second.start_checkpoint) == (50, (1, 50), "ck-50")
    assert segs(second) == [(1, 50, 70), (1, 70, 100)]
    assert second.evaluate_at == ((1, 100),)
    assert second.checkpoint_at == ((1, 70), (1, 100))

    out = finish(h, second)
    assert RequestDone(1, 100, {"loss": 0.1}) in out
    (third,) = only(out, RunBatch)
    assert (third.worker, third.start_at, segs(third)) == (1, (1, 70), [(3, 70, 90)])
    assert third.checkpoint_at == ((3, 90),)
    finish(h, third)
    finish(h, batch)
    assert h.sched.idle()
    assert h.sched.steps_executed == h.sched.steps_planned == 120 + 50 + 20


def test_handle_all_decides_once_after_loading_a_plan() -> None:
    plan = MemoryPlanStorage()
    trials: list[tuple[dict[str, Any], int]] = [(CONST, 100), (AT50, 120), (AT70, 90)]
    ends = [plan.insert_trial("r", hp, n) for hp, n in trials]
    events: list[Any] = [RootAdded("r", {})]
    events += [NodeAdded(n) for n in plan.nodes()]
    events += [RequestAdded(e.node, e.step) for e in ends]
    events += [CheckpointAvailable(1, 60, "ck-60")]
    sched = Scheduler(num_workers=1)
    (batch,) = only(sched.handle_all(events), RunBatch)
    # one decision over the whole plan: the critical path, not the first trial alone
    assert [(s.node, s.start, s.stop) for s in batch.segments] == [(1, 0, 50), (2, 50, 120)]
    with pytest.raises(SchedulerError, match="does not accept"):
        sched.handle_all([object()])  # type: ignore[list-item]
    assert sched.pending() == [(1, 100), (3, 90)]


def test_two_workers_take_different_paths() -> None:
    h = Harness(workers=2)
    (_, out_a) = h.trial(CONST, 100, root="a")
    (_, out_b) = h.trial({"lr": Constant(0.2)}, 60, root="b")
    (a,) = only(out_a, RunBatch)
    (b,) = only(out_b, RunBatch)
    assert (a.worker, a.root_key, segs(a)) == (0, "a", [(1, 0, 100)])
    assert (b.worker, b.root_key, segs(b)) == (1, "b", [(2, 0, 60)])
    # a third trial waits for a free worker
    _, out = h.trial({"lr": Constant(0.3)}, 10, root="c")
    assert out == [] and h.sched.pending() == [(3, 10)]
    out = finish(h, b)
    (c,) = only(out, RunBatch)
    assert (c.worker, c.root_key) == (1, "c")


def test_critical_path_uses_measured_costs() -> None:
    h = Harness(workers=None)
    h.trial(CONST, 100, root="cheap")
    h.trial(CONST, 60, root="dear")
    # 60 steps at 3 s beat 100 steps at 1 s
    h.sched.estimator.observe(h.plan.node(2), 3.0)
    h.sched.estimator.observe(h.plan.node(1), 1.0)
    (first,) = h(WorkerReady(0))
    assert first.root_key == "dear"


def test_worker_whose_trainer_sits_at_the_start_is_preferred() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 100, root="a")
    (first,) = only(out, RunBatch)
    ((node, _), out) = h.trial(CONST, 50, root="r")
    (batch,) = only(out, RunBatch)
    assert (first.worker, batch.worker) == (0, 1)
    finish(h, batch)
    finish(h, first)
    # worker 1's trainer ends at (node, 50): a promotion resumes there on worker 1
    _, out = h.trial(CONST, 80, root="r")
    (promo,) = only(out, RunBatch)
    assert (promo.worker, promo.start_at, segs(promo)) == (1, (node, 50), [(node, 50, 80)])


def _held(h: Harness, trials: list[tuple[str, int]]) -> list[RunBatch]:
    """Train each ``(root, steps)`` trial of CONST to its end, one after another, and
    return their batches (each worker then holds the model its last batch ended at)."""
    done = []
    for root, steps in trials:
        (_, out) = h.trial(CONST, steps, root=root)
        (batch,) = only(out, RunBatch)
        finish(h, batch)
        done.append(batch)
    return done


def _requests(h: Harness, trials: list[tuple[str, int]]) -> list[Any]:
    """Add the trials' requests together: one decision after all of them."""
    events: list[Any] = []
    for root, steps in trials:
        if root not in h.roots:
            h.roots.add(root)
            events.append(RootAdded(root, {"seed": 0, "root": root}))
        ins = h.plan.insert_trial(root, CONST, steps, request=False)
        events += [NodeAdded(node) for node in ins.new_nodes]
        events.append(RequestAdded(ins.node, ins.step))
    return h.sched.handle_all(events)


def test_a_tie_goes_to_the_model_a_worker_holds() -> None:
    h = Harness(workers=1)
    _, y = _held(h, [("x", 50), ("y", 50)])
    assert y.segments[0].node == 2  # worker 0 holds y's model at (2, 50)
    # Both promotions cost the same: the one that continues the held model runs first,
    # without a load (before: the first in the tree's order, loading x's checkpoint).
    (first,) = only(_requests(h, [("x", 100), ("y", 100)]), RunBatch)
    assert (first.worker, first.start_at, first.root_key) == (0, (2, 50), "y")


def test_a_worker_holding_ready_work_is_kept_for_it() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 50, root="x")
    (x,) = only(out, RunBatch)
    (_, out) = h.trial(CONST, 30, root="z")
    (z,) = only(out, RunBatch)
    finish(h, x)
    finish(h, z)
    assert (x.worker, z.worker) == (0, 1)
    # worker 0 holds x at (1, 50); the longest path (a fresh trial) goes to worker 1,
    # which holds nothing that ready work continues, and x's promotion continues on
    # worker 0 (before: the fresh trial took worker 0, and x's model was loaded on 1).
    out = only(_requests(h, [("q", 200), ("x", 100)]), RunBatch)
    by_root = {b.root_key: b for b in out}
    assert by_root["q"].worker == 1
    assert (by_root["x"].worker, by_root["x"].start_at) == (0, (1, 50))


def test_checkpointed_request_without_metrics_is_evaluated_only() -> None:
    h = Harness(workers=1)
    h(RootAdded("r", {}))
    h.roots.add("r")
    ins = h.plan.insert_trial("r", CONST, 40, request=False)
    h(NodeAdded(ins.new_nodes[0]))
    h(CheckpointAvailable(ins.node, 40, "ck-40"))
    (batch,) = h(RequestAdded(ins.node, 40))
    assert batch.segments == () and batch.start_at == (ins.node, 40)
    assert (batch.start_checkpoint, batch.evaluate_at, batch.checkpoint_at) == (
        "ck-40",
        ((1, 40),),
        (),
    )


# --------------------------------------------------------------------------- live split


def test_request_branching_ahead_of_a_running_batch_splits_it() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 20, 0.1))
    _, out = h.trial(AT50, 120)
    assert out == [AddCheckpoint(batch.batch_id, 0, 1, 50, evaluate=False)]
    assert h.sched.idle_workers == [1]
    # a request exactly on the running path: evaluate there too
    _, out = h.trial(CONST, 40)
    assert out == [AddCheckpoint(batch.batch_id, 0, 1, 40, evaluate=True)]
    assert h.sched.running[batch.batch_id].evaluate_at == {(1, 40), (1, 100)}
    # the same request again changes nothing
    assert h.trial(CONST, 40)[1] == []
    assert h.sched.live_requests[(1, 40)] == 2

    h(Progress(batch.batch_id, 0, 1, 40, 0.1))
    # settled once the checkpoint promised at (1, 40) is durable too
    assert h(MetricsReported(batch.batch_id, 0, 1, 40, {"loss": 1.0})) == []
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 40, "ck-40", 1, 0.0))
    assert out == [RequestDone(1, 40, {"loss": 1.0})]
    h(Progress(batch.batch_id, 0, 1, 50, 0.1))
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 50, "ck-50", 1, 0.0))
    (branch,) = only(out, RunBatch)
    assert (branch.worker, branch.start_at, segs(branch)) == (1, (1, 50), [(2, 50, 120)])


def test_a_round_without_an_idle_worker_reads_no_held_models_and_builds_no_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(workers=1)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h.trial(AT50, 120)  # waits for the batch's checkpoint at 50
    forest = h.sched._forest
    calls: list[object] = []
    held_starts = forest.held_starts
    monkeypatch.setattr(forest, "held_starts", lambda held: calls.append(held) or held_starts(held))
    builds = forest.builds
    h(Progress(batch.batch_id, 0, 1, 30, 0.1))
    assert h(CheckpointSaved(batch.batch_id, 0, 1, 30, "ck-30", 1, 0.0)) == []
    assert h.sched.idle_workers == []
    # the models idle workers hold are read by an assignment only
    assert calls == []
    assert forest.builds == builds


def test_a_round_without_an_idle_worker_still_splits_and_aborts() -> None:
    h = Harness(workers=1)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 20, 0.1))
    assert h.sched.idle_workers == []
    _, out = h.trial(AT50, 120)
    assert out == [AddCheckpoint(batch.batch_id, 0, 1, 50, evaluate=False)]
    out = h(RequestCancelled(1, 100, 1))
    assert only(out, Abort) == []  # the request at (2, 120) still waits for (1, 50)
    out = h(RequestCancelled(2, 120, 1))
    assert only(out, Abort) == [Abort(batch.batch_id, 0)]


def test_split_missed_plans_a_recomputation() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 20, 0.1))
    _, out = h.trial(AT50, 120)
    assert out == [AddCheckpoint(batch.batch_id, 0, 1, 50)]
    out = h(SplitMissed(batch.batch_id, 0, 1, 50))
    (again,) = only(out, RunBatch)
    assert (again.worker, again.start_at, segs(again)) == (1, None, [(1, 0, 50), (2, 50, 120)])
    assert h.sched.running[batch.batch_id].checkpoint_at == {(1, 100)}


def test_request_on_a_passed_checkpoint_waits_for_it_to_be_durable() -> None:
    h = Harness(workers=None)
    grid(h)
    (batch,) = h(WorkerReady(0))
    assert (1, 50) in batch.checkpoint_at
    h(Progress(batch.batch_id, 0, 2, 60, 0.1))  # passed 50; checkpoint not durable yet
    assert h(WorkerReady(1)) == h(WorkerReady(2)) == []
    # exactly at the passed checkpoint: no AddCheckpoint (it would be missed)
    (key, out) = h.trial(CONST, 50)
    assert key == (1, 50) and out == []
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 50, "ck-50", 1, 0.0))
    runs = only(out, RunBatch)
    assert [(r.worker, r.start_at, segs(r), r.evaluate_at) for r in runs] == [
        (1, (1, 50), [(1, 50, 70), (1, 70, 100)], ((1, 100),)),
        (2, (1, 50), [], ((1, 50),)),  # evaluation only
    ]
    assert only(out, AddCheckpoint) == []  # node 3 waits for worker 1's (1, 70)


def _behind_a_batch(save_steps: frozenset[int]) -> tuple[Harness, RunBatch]:
    """A batch trains node 1 to step 100 and has passed step 40 when a request for
    step 40 of the same path comes (a lower ASHA bracket's rung on the path of a
    higher bracket's trial)."""
    h = Harness(workers=2)
    if save_steps:
        h.root("r")
        h(SaveSteps("r", save_steps))
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 60, 0.1))
    return h, batch


def test_a_request_behind_a_batch_at_a_save_step_starts_from_its_checkpoint() -> None:
    h, batch = _behind_a_batch(frozenset({10, 40, 250}))
    assert batch.checkpoint_at == ((1, 10), (1, 40), (1, 100))  # 250: not on the path
    (key, out) = h.trial(CONST, 40)
    assert key == (1, 40) and out == []  # waits for the checkpoint the batch took at 40
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 40, "ck-40", 1, 0.0))
    (run,) = only(out, RunBatch)
    assert (run.start_at, segs(run), run.evaluate_at) == ((1, 40), [], ((1, 40),))
    assert h.sched.steps_planned == 100  # no step trained twice


def test_without_save_steps_a_request_behind_a_batch_trains_its_prefix_again() -> None:
    """What the save steps prevent: the batch passed step 40 without a checkpoint."""
    h, batch = _behind_a_batch(frozenset())
    assert batch.checkpoint_at == ((1, 100),)
    (_, out) = h.trial(CONST, 40)
    (run,) = only(out, RunBatch)
    assert (run.start_at, segs(run)) == (None, [(1, 0, 40)])


def test_save_steps_add_up_per_tree() -> None:
    h = Harness(workers=1)
    h.root("r")
    h(SaveSteps("r", frozenset({30})))
    h(SaveSteps("r", frozenset({60})))
    h(SaveSteps("other", frozenset({50})))  # another tree's steps
    (_, out) = h.trial(CONST, 100)
    assert only(out, RunBatch)[0].checkpoint_at == ((1, 30), (1, 60), (1, 100))
    off = Harness(workers=1, branch_checkpoints=False)  # no extra checkpoints at all
    off.root("r")
    off(SaveSteps("r", frozenset({30})))
    (_, out) = off.trial(CONST, 100)
    assert only(out, RunBatch)[0].checkpoint_at == ((1, 100),)


def test_split_missed_keeps_what_the_batch_itself_promised() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h.trial(CONST, 50)  # on the path: AddCheckpoint(evaluate=True) at 50
    h(SplitMissed(batch.batch_id, 0, 1, 50))
    assert h.sched.running[batch.batch_id].checkpoint_at == {(1, 100)}
    assert h.sched.running[batch.batch_id].position == 51
    assert h.sched.running[batch.batch_id].evaluate_at == {(1, 100)}
    # a stray answer about the batch's own end changes no promise
    h(SplitMissed(batch.batch_id, 0, 1, 100))
    assert h.sched.running[batch.batch_id].checkpoint_at == {(1, 100)}


def test_request_beyond_a_running_batch_continues_from_its_end() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    _, out = h.trial(CONST, 150)
    assert out == []  # the batch already checkpoints at its end
    assert h.sched.stage_tree().waiting_roots()[0].start == 100
    h(Progress(batch.batch_id, 0, 1, 100, 0.1))
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 100, "ck-100", 1, 0.0))
    (more,) = only(out, RunBatch)
    assert (more.start_at, segs(more)) == ((1, 100), [(1, 100, 150)])


def test_batch_done_without_its_promised_checkpoint_replans() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 20, 0.1))
    h.trial(AT50, 120)
    h(Progress(batch.batch_id, 0, 1, 100, 0.1))
    h(MetricsReported(batch.batch_id, 0, 1, 100, {"loss": 0.0}))
    h(CheckpointSaved(batch.batch_id, 0, 1, 100, "ck-100", 1, 0.0))
    out = h(BatchDone(batch.batch_id, 0, 1.0, 100))  # (1, 50) is still being written
    assert only(out, RunBatch) == []  # waits for that write, off the batch's end
    out = h(CheckpointFailed(batch.batch_id, 0, 1, 50, "OSError: disk full"))
    (again,) = only(out, RunBatch)
    assert (again.start_at, segs(again)) == (None, [(1, 0, 50), (2, 50, 120)])
    assert h.sched.saving == {}


# ------------------------------------------------------------- checkpoint writes after the end


def test_work_from_a_checkpoint_still_being_written_waits_for_it_elsewhere() -> None:
    h = Harness(workers=2)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 20, 0.1))
    h.trial(AT50, 120)
    h(Progress(batch.batch_id, 0, 1, 100, 0.1))
    h(MetricsReported(batch.batch_id, 0, 1, 100, {"loss": 0.0}))
    out = h(BatchDone(batch.batch_id, 0, 1.0, 100))  # its writes at 50 and 100 go on
    assert only(out, RunBatch) == [] and only(out, RequestDone) == []
    assert h.sched.saving == {batch.batch_id: frozenset({(1, 50), (1, 100)})}
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 50, "ck-50", 1, 0.0))
    (more,) = only(out, RunBatch)
    assert (more.start_at, more.start_checkpoint) == ((1, 50), "ck-50")
    assert segs(more) == [(2, 50, 120)]
    # The trial at 100 is done once its model is durable too.
    out = h(CheckpointSaved(batch.batch_id, 0, 1, 100, "ck-100", 1, 0.0))
    assert [(d.node, d.step) for d in only(out, RequestDone)] == [(1, 100)]
    assert h.sched.saving == {}


def _ended_unwritten(workers: int) -> Harness:
    """A trial of 100 steps trained on worker 0, whose batch ended before the write of
    its checkpoint at 100 did."""
    h = Harness(workers=workers)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 100, 0.1))
    h(MetricsReported(batch.batch_id, 0, 1, 100, {"loss": 0.0}))
    h(BatchDone(batch.batch_id, 0, 1.0, 100))
    assert h.sched.saving == {batch.batch_id: frozenset({(1, 100)})}
    return h


def test_the_worker_holding_a_model_continues_it_before_its_write_ends() -> None:
    h = _ended_unwritten(workers=1)
    (_, out) = h.trial(AT150, 200)  # continues the model at 100, not written yet
    (more,) = only(out, RunBatch)
    assert (more.worker, more.start_at, more.start_checkpoint) == (0, (1, 100), None)
    assert segs(more) == [(1, 100, 150), (2, 150, 200)]


def test_a_lost_worker_takes_its_pending_writes_with_it() -> None:
    h = _ended_unwritten(workers=2)
    out = h(WorkerLost(0, None, "killed"))
    # Its model died with the worker: the trial is not reported finished without it,
    # it is trained again on the other worker (issue 23: a finished trial finds its
    # model).
    assert only(out, RequestDone) == []
    assert h.sched.saving == {}
    (again,) = only(out, RunBatch)
    assert again.worker == 1 and again.start_at is None
    assert segs(again) == [(1, 0, 100)]


# --------------------------------------------------------------------------- preemption


def test_cancelling_every_request_of_a_batch_aborts_it() -> None:
    h = Harness(workers=1)
    (key, out) = h.trial(CONST, 100, count=2)
    (batch,) = only(out, RunBatch)
    assert h(RequestCancelled(*key)) == []  # one reference is left
    assert h(RequestCancelled(*key)) == [Abort(batch.batch_id, 0)]
    assert h.sched.running[batch.batch_id].aborted
    assert h(RequestCancelled(*key)) == []  # already settled: ignored
    # the aborted batch covers nothing: a new request is planned afresh once idle
    _, out = h.trial(CONST, 100)
    assert out == []
    out = h(BatchDone(batch.batch_id, 0, 1.0, 10))
    (again,) = only(out, RunBatch)
    assert again.start_at is None


def test_a_batch_stays_while_a_waiting_stage_needs_its_checkpoint() -> None:
    h = Harness(workers=1)
    (const, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    (at50, out) = h.trial(AT50, 120)
    assert out == [AddCheckpoint(batch.batch_id, 0, 1, 50)]
    assert h(RequestCancelled(*const)) == []  # at50 still waits for (1, 50)
    assert h(RequestCancelled(*at50)) == [Abort(batch.batch_id, 0)]


def test_finished_training_is_not_aborted() -> None:
    h = Harness(workers=1)
    (key, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 100, 0.1))
    assert h(RequestCancelled(*key)) == []


# --------------------------------------------------------------------------- failures


def test_failure_fails_only_requests_that_depend_on_the_failed_step() -> None:
    h = Harness(workers=None)
    ends = grid(h)
    (batch,) = h(WorkerReady(0))
    assert segs(batch) == [(1, 0, 50), (2, 50, 120)]
    h(Progress(batch.batch_id, 0, 1, 50, 0.1))
    h(CheckpointSaved(batch.batch_id, 0, 1, 50, "ck-50", 1, 0.0))
    out = h(BatchFailed(batch.batch_id, 0, 2, 80, "ValueError: boom", "Traceback ...boom"))
    assert only(out, RequestFailed) == [
        RequestFailed(*ends["at50"], "ValueError: boom", "Traceback ...boom", "training step 80")
    ]
    assert ends["at50"] not in h.sched.live_requests
    # the siblings continue from the checkpoint at 50
    (nxt,) = only(out, RunBatch)
    assert nxt.start_at == (1, 50)


def test_failure_before_the_branch_fails_every_dependent() -> None:
    h = Harness(workers=None, max_retries=1)
    ends = grid(h)
    (batch,) = h(WorkerReady(0))
    out = h(BatchFailed(batch.batch_id, 0, 1, 30, "E", "tb"))
    assert only(out, RequestFailed) == []  # first failure: retried
    (retry,) = only(out, RunBatch)
    assert segs(retry) == segs(batch)
    out = h(BatchFailed(retry.batch_id, 0, 1, 30, "E", "tb"))
    failed = only(out, RequestFailed)
    assert sorted((f.node, f.step) for f in failed) == sorted(ends.values())
    assert all(f.traceback == "tb" for f in failed)
    assert h.sched.idle()


def test_failure_while_loading_fails_what_needs_that_checkpoint() -> None:
    h = Harness(workers=None)
    h(RootAdded("r", {}))
    h.roots.add("r")
    a = h.plan.insert_trial("r", CONST, 30, request=False)
    b = h.plan.insert_trial("r", AT50, 100, request=False)
    h(NodeAdded(a.new_nodes[0]))
    h(NodeAdded(b.new_nodes[0]))
    h(CheckpointAvailable(1, 50, "bad"))
    h(RequestAdded(1, 30))
    h(RequestAdded(b.node, 100))
    out = h(WorkerReady(0))
    # critical path first: 50 steps from (1, 50) to 100 on node 2
    (batch,) = only(out, RunBatch)
    assert batch.start_checkpoint == "bad"
    out = h(BatchFailed(batch.batch_id, 0, 1, 50, "CheckpointError", "tb"))
    assert [(f.node, f.step) for f in only(out, RequestFailed)] == [(2, 100)]
    assert (1, 30) in h.sched.live_requests


def test_unreadable_start_checkpoint_is_dropped_and_work_replanned() -> None:
    h = Harness(workers=None)
    h(RootAdded("r", {}))
    h.roots.add("r")
    a = h.plan.insert_trial("r", CONST, 100, request=False)
    h(NodeAdded(a.new_nodes[0]))
    h(CheckpointAvailable(1, 30, "ck-30"))
    h(CheckpointAvailable(1, 60, "corrupt"))
    h(RequestAdded(1, 100))
    (batch,) = h(WorkerReady(0))
    assert batch.start_checkpoint == "corrupt"
    failed = BatchFailed(batch.batch_id, 0, 1, 60, "CheckpointError: bad checksum", "tb")
    object.__setattr__(failed, "kind", "checkpoint")  # field added to work.py by the lead
    out = h(failed)
    assert only(out, RequestFailed) == []
    (again,) = only(out, RunBatch)
    assert (again.start_checkpoint, segs(again)) == ("ck-30", [(1, 30, 100)])
    assert h.sched.checkpoints == {(1, 30): "ck-30"}


def test_worker_lost_replans_from_the_latest_checkpoint() -> None:
    h = Harness(workers=None)
    h.trial(CONST, 50)
    (key, _) = h.trial(CONST, 100)
    h(WorkerReady(0))
    batch = h.sched.running[1]
    assert batch.segments == ((1, 0, 100),)
    h(Progress(1, 0, 1, 50, 0.1))
    h(MetricsReported(1, 0, 1, 50, {"loss": 0.5}))
    h(CheckpointSaved(1, 0, 1, 50, "ck-50", 1, 0.0))
    h(Progress(1, 0, 1, 70, 0.1))
    assert h(WorkerLost(0, 1, "killed")) == []  # nobody left to run it
    assert h.sched.workers == [] and h.sched.pending() == [key]
    (batch2,) = h(WorkerReady(5))
    assert (batch2.worker, batch2.start_at, segs(batch2)) == (5, (1, 50), [(1, 50, 100)])
    # late events of the lost batch: metrics still count, steps too
    assert h(MetricsReported(1, 0, 1, 100, {"loss": 0.1})) == [RequestDone(1, 100, {"loss": 0.1})]
    h(Progress(1, 0, 1, 80, 0.1))
    assert h.sched.steps_executed == 80


def test_checkpoint_lost_is_planned_around() -> None:
    h = Harness(workers=None)
    h(RootAdded("r", {}))
    h.roots.add("r")
    a = h.plan.insert_trial("r", CONST, 100, request=False)
    h(NodeAdded(a.new_nodes[0]))
    h(CheckpointAvailable(1, 60, "ck-60"))
    h(CheckpointAvailable(1, 40, "ck-40"))
    h(RequestAdded(1, 100))
    h(CheckpointLost(1, 60))
    assert h.sched.checkpoints == {(1, 40): "ck-40"}
    (batch,) = h(WorkerReady(0))
    assert batch.start_at == (1, 40)


# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize("name", ["bfs", "thr"])
def test_baseline_policies_run_one_stage_per_batch(name: str) -> None:
    h = Harness(workers=None, policy=name)
    grid(h)
    (batch,) = h(WorkerReady(0))
    assert segs(batch) == [(1, 0, 50)]
    assert batch.checkpoint_at == ((1, 50),)
    out = finish(h, batch)
    (nxt,) = only(out, RunBatch)
    # bfs: earliest start, tree order -> node 1's continuation; thr: the stage with the
    # most children -> the same one here (two children at 70)
    assert segs(nxt) == [(1, 50, 70)]


def test_custom_policy_and_bad_names() -> None:
    class Last(BasePolicy):
        name = "last"

        def choose(self, tree: StageTree, roots: list[Stage]) -> list[Stage]:  # type: ignore[override]
            return [roots[-1]]

    h = Harness(workers=None, policy=Last())
    h.trial(CONST, 10, root="a")
    h.trial(CONST, 10, root="b")
    (batch,) = h(WorkerReady(0))
    assert batch.root_key == "b"
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("fifo")


# --------------------------------------------------------------------------- errors


def test_bad_events_raise_scheduler_errors() -> None:
    h = Harness(workers=1)
    with pytest.raises(SchedulerError, match="does not accept"):
        h("hello")
    with pytest.raises(SchedulerError, match="unknown node"):
        h(RequestAdded(42, 10))
    h.trial(CONST, 60)
    (key, _) = h.trial(AT50, 60)
    with pytest.raises(SchedulerError, match="not canonical"):
        h(RequestAdded(2, 50))
    with pytest.raises(SchedulerError, match="holds 1"):
        h(RequestCancelled(*key, count=2))
    with pytest.raises(SchedulerError, match="was not added"):
        h(NodeAdded(h.plan.node(1).__class__(9, "zzz", None, 0, {})))
    with pytest.raises(ValueError, match="max_retries"):
        Scheduler(max_retries=-1)


def test_estimator_learns_from_progress() -> None:
    est = CostEstimator()
    h = Harness(workers=1, estimator=est)
    (_, out) = h.trial(CONST, 10)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 5, 0.25))
    assert est.cost(h.plan.node(1)) == pytest.approx(0.25)


def test_public_names() -> None:
    assert sorted(scheduler_pkg.__all__) == [
        "BFSPolicy",
        "BasePolicy",
        "BatchInfo",
        "CheckpointAvailable",
        "CheckpointLost",
        "CostEstimator",
        "CriticalPathPolicy",
        "Event",
        "NodeAdded",
        "Notice",
        "PlanEvent",
        "RequestAdded",
        "RequestCancelled",
        "RequestDone",
        "RequestFailed",
        "RootAdded",
        "Scheduler",
        "StudyWeight",
        "ThroughputPolicy",
        "make_policy",
    ]
    assert all(hasattr(scheduler_pkg, name) for name in scheduler_pkg.__all__)


# --------------------------------------------------------------------- periodic checkpoints


def test_checkpoint_every_adds_periodic_points_to_a_batch() -> None:
    h = Harness(workers=1, checkpoint_every=30)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    assert batch.checkpoint_at == ((1, 30), (1, 60), (1, 90), (1, 100))
    off = Harness(workers=1, checkpoint_every=None)
    (_, out) = off.trial(CONST, 100)
    assert only(out, RunBatch)[0].checkpoint_at == ((1, 100),)


def test_checkpoint_every_auto_follows_the_measured_costs() -> None:
    h = Harness(workers=1)  # "auto": nothing measured yet, no periodic points
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    assert batch.checkpoint_at == ((1, 100),)
    assert h.sched.periodic_interval("r", 100) is None
    h(Progress(batch.batch_id, 0, 1, 100, 5.0))  # 5 s a step
    h(CheckpointSaved(batch.batch_id, 0, 1, 100, "ck", 1, 1.0))  # 1 s a save
    # 5% of a 400-step trial is 20 steps (100 s); saves every 20 steps cost 1% or less.
    assert h.sched.periodic_interval("r", 400) == 20
    # 0.5 s steps: 20 steps are 10 s, and a crash may lose a minute (120 steps).
    fast = Harness(workers=1)
    (_, out) = fast.trial(CONST, 100)
    (first,) = only(out, RunBatch)
    fast(Progress(first.batch_id, 0, 1, 100, 0.5))
    fast(CheckpointSaved(first.batch_id, 0, 1, 100, "ck", 1, 0.1))
    assert fast.sched.periodic_interval("r", 400) == 120
    assert fast.sched.periodic_interval("r", 100) is None  # a short trial: none
    cheap = Harness(workers=1)  # 1 ms steps: saves every 10000 steps, none in 400
    (_, out) = cheap.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    cheap(Progress(batch.batch_id, 0, 1, 100, 0.001))
    cheap(CheckpointSaved(batch.batch_id, 0, 1, 100, "ck", 1, 0.1))
    assert cheap.sched.periodic_interval("r", 400) is None


@pytest.mark.parametrize("bad", [0, -3, 2.5, "often", True])
def test_bad_checkpoint_every_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="checkpoint_every"):
        Scheduler(num_workers=1, checkpoint_every=bad)


def test_a_finished_request_whose_model_is_not_stored_stays_pending_and_is_trained_again() -> None:
    # The store went down: the write of the model a request finished with failed
    # after the batch ended. The request is not reported done without its model; it
    # is planned again (the worker that holds the model continues from it).
    h = Harness(workers=1)
    (_, out) = h.trial(CONST, 100)
    (batch,) = only(out, RunBatch)
    h(Progress(batch.batch_id, 0, 1, 100, 0.1))
    out = h(MetricsReported(batch.batch_id, 0, 1, 100, {"loss": 0.0}))
    out += h(BatchDone(batch.batch_id, 0, 1.0, 100))
    assert only(out, RequestDone) == []  # waits for its model
    out = h(CheckpointFailed(batch.batch_id, 0, 1, 100, "CheckpointError: store down"))
    assert only(out, RequestDone) == []
    (again,) = only(out, RunBatch)
    assert (1, 100) in again.checkpoint_at
    out = h(MetricsReported(again.batch_id, 0, 1, 100, {"loss": 0.0}))
    out += h(CheckpointSaved(again.batch_id, 0, 1, 100, "ck-100", 1, 0.0))
    out += h(BatchDone(again.batch_id, 0, 1.0, 0))
    assert [(d.node, d.step) for d in only(out, RequestDone)] == [(1, 100)]


def test_a_request_whose_model_is_never_stored_fails_after_a_few_tries() -> None:
    h = Harness(workers=1)
    (_, out) = h.trial(CONST, 10)
    (batch,) = only(out, RunBatch)
    failed: list[Any] = []
    for _ in range(10):
        h(Progress(batch.batch_id, 0, 1, 10, 0.1))
        h(MetricsReported(batch.batch_id, 0, 1, 10, {"loss": 0.0}))
        h(BatchDone(batch.batch_id, 0, 1.0, 10))
        out = h(CheckpointFailed(batch.batch_id, 0, 1, 10, "CheckpointError: disk full"))
        assert only(out, RequestDone) == []
        failed = only(out, RequestFailed)
        if failed:
            break
        (batch,) = only(out, RunBatch)
    (fail,) = failed
    assert (fail.node, fail.step) == (1, 10)
    assert "could not be stored (5 tries)" in fail.error and "disk full" in fail.error
