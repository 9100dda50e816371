"""Branch checkpoints: the scheduler checkpoints where known nodes branch off a batch's
path, even before they have a request, so that later promotions never recompute."""

from __future__ import annotations

from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import NodeAdded, RequestAdded, RootAdded, Scheduler
from stagetree.work import (
    AddCheckpoint,
    BatchDone,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    WorkerReady,
)


def _setup(branch_checkpoints: bool) -> tuple[Scheduler, MemoryPlanStorage, list[object]]:
    plan = MemoryPlanStorage()
    a = plan.insert_trial("r", {"lr": Constant(0.1)}, 20, request=False)
    b = plan.insert_trial("r", {"lr": MultiStep(0.1, [12], 0.1)}, 20, request=False)
    assert b.new_nodes and b.new_nodes[0].branch_step == 12
    sched = Scheduler(branch_checkpoints=branch_checkpoints)
    out: list[object] = []
    out += sched.handle(RootAdded("r", {}))
    for n in plan.nodes("r"):
        out += sched.handle(NodeAdded(n))
    out += sched.handle(WorkerReady(0))
    # Only the first trial is requested now (e.g. a rung), up to step 20.
    out += sched.handle(RequestAdded(a.node, 20))
    return sched, plan, out


def test_batch_checkpoints_where_unrequested_nodes_branch() -> None:
    _, plan, out = _setup(True)
    (batch,) = [o for o in out if isinstance(o, RunBatch)]
    root = plan.nodes("r")[0].id
    assert (root, 12) in batch.checkpoint_at
    _, _, out_off = _setup(False)
    (plain,) = [o for o in out_off if isinstance(o, RunBatch)]
    assert (root, 12) not in plain.checkpoint_at


def test_node_added_ahead_of_a_running_batch_asks_for_a_checkpoint() -> None:
    sched, plan, out = _setup(True)
    (batch,) = [o for o in out if isinstance(o, RunBatch)]
    c = plan.insert_trial("r", {"lr": MultiStep(0.1, [15], 0.5)}, 20, request=False)
    (node,) = c.new_nodes
    added = sched.handle(NodeAdded(node))
    assert AddCheckpoint(batch.batch_id, 0, node.parent, 15, False) in added  # type: ignore[arg-type]


def test_path_into_a_child_checkpoints_where_its_parent_goes_on() -> None:
    # A trial on the root (inserted to 20: its path goes on past 12) and a trial that
    # branches off it at 12 and is requested first: its batch trains the root to 12 and
    # follows the child. The root's model at 12 is where the first trial resumes later
    # (a promotion), so the batch checkpoints it although it continues in the child.
    plan = MemoryPlanStorage()
    plan.insert_trial("r", {"lr": Constant(0.1)}, 20, request=False)
    b = plan.insert_trial("r", {"lr": MultiStep(0.1, [12], 0.1)}, 20, request=False)
    (child,) = b.new_nodes
    sched = Scheduler()
    sched.handle(RootAdded("r", {}))
    for n in plan.nodes("r"):
        sched.handle(NodeAdded(n))
    sched.handle(WorkerReady(0))
    (batch,) = [o for o in sched.handle(RequestAdded(child.id, 20)) if isinstance(o, RunBatch)]
    root = child.parent
    segments = [(s.node, s.start, s.stop) for s in batch.segments]
    assert segments == [(root, 0, 12), (child.id, 12, 20)]
    assert (root, 12) in batch.checkpoint_at


def _grown_tree(grow_while_training: bool) -> tuple[RunBatch, int]:
    """A root trial, one branching off it at 8, and one branching off that at 12 (added
    before any batch, or after one trained the tree); then the root trial is requested
    from its step-1 checkpoint to 16. Returns that batch and the root node."""
    plan = MemoryPlanStorage()
    a = plan.insert_trial("r", {"lr": Constant(0.1)}, 20, request=False)
    plan.insert_trial("r", {"lr": MultiStep(0.1, [8], 0.5)}, 20, request=False)
    late = {"lr": MultiStep(0.1, [8, 12], 0.5)}  # follows the 8-node, branches at 12
    if not grow_while_training:
        plan.insert_trial("r", late, 20, request=False)
    sched = Scheduler()
    sched.handle(RootAdded("r", {}))
    known: set[int] = set()

    def add_nodes() -> None:
        for n in plan.nodes("r"):
            if n.id not in known:
                known.add(n.id)
                sched.handle(NodeAdded(n))

    add_nodes()
    sched.handle(WorkerReady(0))
    (first,) = [o for o in sched.handle(RequestAdded(a.node, 1)) if isinstance(o, RunBatch)]
    sched.handle(MetricsReported(first.batch_id, 0, a.node, 1, {"score": 1.0}))
    sched.handle(CheckpointSaved(first.batch_id, 0, a.node, 1, "ck-1", 1, 0.0))
    sched.handle(BatchDone(first.batch_id, 0, 1.0, 1))
    if grow_while_training:  # a configuration proposed from the first result
        plan.insert_trial("r", late, 20, request=False)
        add_nodes()
    out = sched.handle(RequestAdded(a.node, 16))
    (batch,) = [o for o in out if isinstance(o, RunBatch)]
    assert [(s.node, s.start, s.stop) for s in batch.segments] == [(a.node, 1, 16)]
    return batch, a.node


def test_a_tree_that_grows_while_training_checkpoints_where_it_branches_elsewhere() -> None:
    # Trials proposed from results (a model-based sampler) cannot be inserted ahead:
    # once the tree got a node after training started, a batch also checkpoints at the
    # steps where the tree branches elsewhere (12, off the 8-node), where later trials
    # are likely to branch off its own path.
    batch, root = _grown_tree(True)
    assert (root, 8) in batch.checkpoint_at and (root, 12) in batch.checkpoint_at
    # A tree known in advance keeps to its own branch points.
    batch, root = _grown_tree(False)
    assert (root, 8) in batch.checkpoint_at and (root, 12) not in batch.checkpoint_at


def _speculative(save_seconds: float) -> set[tuple[int, int]]:
    """Checkpoints of a batch of the root trial (1 ms a step measured) where nothing
    branches off its path, in a tree where trials proposed while it trains branch off
    another path at steps 3..18, several of them at 8 and 12."""
    plan = MemoryPlanStorage()
    a = plan.insert_trial("r", {"lr": Constant(0.1)}, 20, request=False)
    b = plan.insert_trial("r", {"lr": Piecewise([0.1, 0.05], [1])}, 20, request=False)
    sched = Scheduler()
    sched.handle(RootAdded("r", {}))
    for n in plan.nodes("r"):
        sched.handle(NodeAdded(n))
    sched.handle(WorkerReady(0))
    (first,) = [o for o in sched.handle(RequestAdded(b.node, 2)) if isinstance(o, RunBatch)]
    for seg in first.segments:
        sched.handle(Progress(first.batch_id, 0, seg.node, seg.stop, 0.001))
    sched.handle(MetricsReported(first.batch_id, 0, b.node, 2, {"score": 1.0}))
    for node, step in first.checkpoint_at:
        sched.handle(CheckpointSaved(first.batch_id, 0, node, step, f"ck{step}", 1, save_seconds))
    sched.handle(BatchDone(first.batch_id, 0, 1.0, 2))
    known = {n.id for n in plan.nodes("r")}
    for i, d in enumerate([*range(3, 19), 8, 12, 12]):  # off b's path, at d
        hp = {"lr": Piecewise([0.1, 0.05, 0.001 * (i + 1)], [1, d])}
        (node,) = plan.insert_trial("r", hp, 20, request=False).new_nodes
        assert node.parent == b.node and node.id not in known
        sched.handle(NodeAdded(node))
    out = sched.handle(RequestAdded(a.node, 20))
    (batch,) = [o for o in out if isinstance(o, RunBatch)]
    assert [(s.node, s.start, s.stop) for s in batch.segments] == [(a.node, 1, 20)]
    return set(batch.checkpoint_at) - {(a.node, 20)}


def test_a_growing_tree_saves_few_guesses_where_steps_are_cheap() -> None:
    # Saves cost 1000 steps: a batch saves only a few checkpoints at guessed branch
    # points, where most nodes branch first (12, then 8, then the earliest).
    assert {step for _, step in _speculative(1.0)} == {12, 8, 3, 4}
    # Saves cost next to nothing: every step where the tree branches elsewhere.
    assert {step for _, step in _speculative(1e-9)} == set(range(3, 19))
