"""The storage contract, run against every backend: memory, SQLite and (when
``STAGETREE_TEST_DB_URL`` is set) PostgreSQL."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from plan_helpers import check_tree, grid, same_values

from stagetree.exceptions import InvalidTrialError, PlanKeyError, RequestError, StorageError
from stagetree.hp import Constant, Linear, MultiStep, Piecewise, Sequence
from stagetree.plan import (
    BasePlanStorage,
    CheckpointRecord,
    MemoryPlanStorage,
    RequestState,
    SQLPlanStorage,
)
from stagetree.plan.tree import path_segments

PG_URL = os.environ.get("STAGETREE_TEST_DB_URL")
R = "root-a"


@dataclass
class Backend:
    """A storage under test and how to open it again (None for memory)."""

    storage: BasePlanStorage
    reopen: Callable[[], BasePlanStorage] | None


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    opened: list[BasePlanStorage] = []

    def open_sql(url: str) -> BasePlanStorage:
        s = SQLPlanStorage(url)
        opened.append(s)
        return s

    if request.param == "memory":
        b = Backend(MemoryPlanStorage(), None)
    elif request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'plan.db'}"
        b = Backend(open_sql(url), lambda: open_sql(url))
    else:
        if not PG_URL:
            pytest.skip("set STAGETREE_TEST_DB_URL to run the PostgreSQL backend")
        fresh = SQLPlanStorage(PG_URL)
        fresh.drop_all()  # a fresh set of tables per test
        fresh.close()
        b = Backend(open_sql(PG_URL), lambda: open_sql(PG_URL))
    yield b
    b.storage.close()
    for s in opened:
        s.close()


@pytest.fixture
def plan(backend: Backend) -> BasePlanStorage:
    return backend.storage


def lr(x: Sequence) -> dict[str, Sequence]:
    return {"lr": x}


# -- insertion and sharing -------------------------------------------------------------


def test_first_trial_becomes_root(plan: BasePlanStorage) -> None:
    ins = plan.insert_trial(R, lr(Constant(0.1)), 50)
    assert (ins.node, ins.step) == (ins.new_nodes[0].id, 50)
    root = plan.node(ins.node)
    assert (root.parent, root.branch_step, root.root_key) == (None, 0, R)
    assert root.hp == {"lr": Constant(0.1)}
    assert plan.nodes(R) == [root]


def test_nodes_after_reads_what_was_appended_since_an_id(backend: Backend) -> None:
    """Polling for other processes' nodes reads from an id on, across trees, in id
    order, plus the ids asked again; a second handle sees the first one's nodes."""
    plan = backend.storage
    assert plan.last_node_id() == 0
    a = plan.insert_trial(R, lr(MultiStep(0.1, [10], 0.1)), 20)
    b = plan.insert_trial("other-root", lr(Constant(0.3)), 20)
    c = plan.insert_trial(R, lr(Constant(0.1)), 20)
    ids = [a.node, b.node, c.new_nodes[0].id]
    assert plan.last_node_id() == max(ids)
    reader = backend.reopen() if backend.reopen is not None else plan
    assert [n.id for n in reader.nodes_after(0)] == sorted(ids)
    assert [n.id for n in reader.nodes_after(ids[0])] == sorted(ids[1:])
    assert [n.id for n in reader.nodes_after(max(ids), also=[ids[0]])] == [ids[0]]
    assert reader.nodes_after(max(ids)) == []
    got = {n.id: n for n in reader.nodes_after(0)}
    assert got[b.node].root_key == "other-root" and got[ids[2]].parent == a.node
    assert got[ids[2]].hp == {"lr": Constant(0.1)}


def test_requests_on_reads_the_requests_of_given_nodes(backend: Backend) -> None:
    """An engine polls the requests on the nodes it leases, across trees, in (node,
    step) order, whatever their state; a second handle sees the first one's."""
    plan = backend.storage
    a = plan.insert_trial(R, lr(MultiStep(0.1, [10], 0.1)), 20)
    b = plan.insert_trial("other-root", lr(Constant(0.3)), 20)
    plan.add_request(a.node, 5)
    plan.release_request(b.node, 20)  # cancelled
    reader = backend.reopen() if backend.reopen is not None else plan
    got = [(r.node, r.step, r.state) for r in reader.requests_on([b.node, a.node])]
    assert got == [
        (a.node, 5, RequestState.PENDING),
        (a.node, 20, RequestState.PENDING),
        (b.node, 20, RequestState.CANCELLED),
    ]
    assert [(r.node, r.step) for r in reader.requests_on([b.node])] == [(b.node, 20)]
    assert reader.requests_on([]) == [] and reader.requests_on([10**6]) == []


def test_multistep_and_constant_share_until_the_milestone(plan: BasePlanStorage) -> None:
    a = plan.insert_trial(R, lr(MultiStep(0.1, [100], 0.1)), 120)
    b = plan.insert_trial(R, lr(Constant(0.1)), 120)
    assert len(b.new_nodes) == 1
    child = b.new_nodes[0]
    assert (child.parent, child.branch_step) == (a.node, 100)
    # Shared model up to step 100 (canonical node: deepest with branch_step < S).
    for step in (0, 1, 99, 100):
        assert plan.locate(R, lr(Constant(0.1)), step) == (a.node, step)
        assert plan.locate(R, lr(MultiStep(0.1, [100], 0.1)), step) == (a.node, step)
    assert plan.locate(R, lr(Constant(0.1)), 101) == (child.id, 101)
    assert plan.locate(R, lr(MultiStep(0.1, [100], 0.1)), 101) == (a.node, 101)
    assert plan.path(child.id) == [plan.node(a.node), child]


def test_trial_differing_at_step_zero_is_child_of_root_at_zero(plan: BasePlanStorage) -> None:
    root = plan.insert_trial(R, lr(Constant(0.1)), 10).node
    other = plan.insert_trial(R, lr(Constant(0.2)), 10)
    (node,) = other.new_nodes
    assert (node.parent, node.branch_step) == (root, 0)
    assert plan.locate(R, lr(Constant(0.2)), 0) == (root, 0)  # untrained model is shared
    assert plan.locate(R, lr(Constant(0.2)), 1) == (node.id, 1)
    third = plan.insert_trial(R, lr(Constant(0.3)), 10)
    assert (third.new_nodes[0].parent, third.new_nodes[0].branch_step) == (root, 0)


def test_identical_trials_share_node_and_request(plan: BasePlanStorage) -> None:
    a = plan.insert_trial(R, lr(Constant(0.1)), 30)
    b = plan.insert_trial(R, lr(Constant(0.1)), 30)
    # Equal by value, written differently: same model too.
    c = plan.insert_trial(R, lr(MultiStep(0.1, [500], 0.5)), 30)
    assert (a.node, a.step) == (b.node, b.step) == (c.node, c.step)
    assert b.new_nodes == () and c.new_nodes == ()
    req = plan.request(a.node, 30)
    assert req is not None and (req.refcount, req.state) == (3, RequestState.PENDING)
    assert len(plan.nodes(R)) == 1


def test_numbers_share_by_value(plan: BasePlanStorage) -> None:
    # Issue 25: 1 and 1.0 are one value; True is not a number.
    a = plan.insert_trial(R, {"bs": Constant(1)}, 5)
    b = plan.insert_trial(R, {"bs": Constant(1.0)}, 5)
    c = plan.insert_trial(R, {"bs": Constant(True)}, 5)
    assert a.node == b.node != c.node
    assert plan.node(c.node).branch_step == 0


def test_other_names_get_a_tree_of_their_own(plan: BasePlanStorage) -> None:
    # Issue 25: the tree's first name set keeps the key, another set gets its own.
    assert plan.tree_names(R) is None
    assert plan.tree_key(R, ["lr"]) == R == plan.tree_key(R, ["momentum", "lr"])
    plan.insert_trial(R, {"lr": Constant(0.1)}, 5)
    assert plan.tree_names(R) == ("lr",)
    assert plan.tree_key(R, ["lr"]) == R
    other = plan.tree_key(R, ["momentum", "lr"])
    assert other not in (R, plan.tree_key(R, ["learning_rate"]))
    assert other == plan.tree_key(R, ["lr", "momentum"])  # order does not matter
    ins = plan.insert_trial(other, {"lr": Constant(0.1), "momentum": Constant(0.9)}, 5)
    assert plan.node(ins.node).root_key == other and plan.tree_names(other) == ("lr", "momentum")
    assert plan.tree_key(R, ["lr"]) == R  # the first tree stays where it was


def test_plain_values_become_constants(plan: BasePlanStorage) -> None:
    a = plan.insert_trial(R, {"bs": 32, "lr": Constant(0.1)}, 5)  # type: ignore[dict-item]
    b = plan.insert_trial(R, {"bs": Constant(32), "lr": Constant(0.1)}, 5)
    assert a.node == b.node
    assert plan.node(a.node).hp["bs"] == Constant(32)


def test_promotion_extends_the_path(plan: BasePlanStorage) -> None:
    short = plan.insert_trial(R, lr(Constant(0.1)), 50)
    decayed = plan.insert_trial(R, lr(MultiStep(0.1, [100], 0.1)), 50)
    assert (decayed.node, decayed.step, decayed.new_nodes) == (short.node, 50, ())
    promoted = plan.insert_trial(R, lr(MultiStep(0.1, [100], 0.1)), 150)
    (node,) = promoted.new_nodes
    assert (node.parent, node.branch_step) == (short.node, 100)
    assert (promoted.node, promoted.step) == (node.id, 150)
    again = plan.insert_trial(R, lr(Constant(0.1)), 150)
    assert (again.node, again.step, again.new_nodes) == (short.node, 150, ())
    req = plan.request(short.node, 50)
    assert req is not None and req.refcount == 2


def test_branch_step_edges(plan: BasePlanStorage) -> None:
    root = plan.insert_trial(R, lr(Constant(0.1)), 0)
    assert (root.node, root.step) == (root.new_nodes[0].id, 0)
    child = plan.insert_trial(R, lr(MultiStep(0.1, [7], 0.1)), 7)
    # Values agree on [0, 7): no new node for a 7-step trial.
    assert (child.node, child.new_nodes) == (root.node, ())
    eight = plan.insert_trial(R, lr(MultiStep(0.1, [7], 0.1)), 8)
    assert eight.new_nodes[0].branch_step == 7
    assert plan.locate(R, lr(MultiStep(0.1, [7], 0.1)), 7) == (root.node, 7)


def test_deep_path_and_children_of_children(plan: BasePlanStorage) -> None:
    seqs = [
        Piecewise([1.0, 2.0, 3.0], [10, 20]),
        Piecewise([1.0, 2.0, 4.0], [10, 20]),
        Piecewise([1.0, 5.0, 3.0], [10, 20]),
        Piecewise([1.0, 2.0, 4.0, 5.0], [10, 20, 30]),
    ]
    ins = [plan.insert_trial(R, {"x": s}, 40) for s in seqs]
    n = [i.node for i in ins]
    nodes = {i.node: plan.node(i.node) for i in ins}
    assert nodes[n[1]].parent == n[0] and nodes[n[1]].branch_step == 20
    assert nodes[n[2]].parent == n[0] and nodes[n[2]].branch_step == 10
    assert nodes[n[3]].parent == n[1] and nodes[n[3]].branch_step == 30
    assert [p.id for p in plan.path(n[3])] == [n[0], n[1], n[3]]
    check_tree(plan, R)


def test_sibling_invariant_and_value_sharing_on_a_grid(plan: BasePlanStorage) -> None:
    trials = grid(40)
    rng = random.Random(3)
    rng.shuffle(trials)
    out = plan.insert_trials(R, trials)
    assert len({(i.node, i.step) for i in out}) == len(trials)
    assert len(plan.nodes(R)) == len(trials)
    check_tree(plan, R)
    # Sharing by value: two trials share the model after S steps iff their values
    # agree on [0, S).
    for _ in range(300):
        (a, _), (b, _) = rng.sample(trials, 2)
        s = rng.randrange(0, 41)
        shared = plan.locate(R, a, s) == plan.locate(R, b, s)
        assert shared == same_values(a, b, s), (a, b, s)


def test_batch_equals_one_by_one(backend: Backend) -> None:
    trials = grid(30)
    batch = backend.storage.insert_trials(R, trials)
    other = MemoryPlanStorage()
    single = [other.insert_trial(R, hp, steps) for hp, steps in trials]
    assert [(i.node, i.step) for i in batch] == [(i.node, i.step) for i in single]
    assert [len(i.new_nodes) for i in batch] == [len(i.new_nodes) for i in single]


def test_name_mismatch_rejected_before_any_write(plan: BasePlanStorage) -> None:
    with pytest.raises(InvalidTrialError, match=r"missing \['momentum'\], unexpected \['mom'\]"):
        plan.insert_trials(
            R,
            [
                ({"lr": Constant(0.1), "momentum": Constant(0.9)}, 10),
                ({"lr": Constant(0.2), "mom": Constant(0.9)}, 10),
            ],
        )
    assert plan.nodes(R) == [] and plan.requests() == []
    plan.insert_trial(R, {"lr": Constant(0.1), "momentum": Constant(0.9)}, 10)
    with pytest.raises(InvalidTrialError, match="momentum"):
        plan.insert_trial(R, {"lr": Constant(0.1)}, 10)
    with pytest.raises(InvalidTrialError, match="momentum"):
        plan.locate(R, {"lr": Constant(0.1)}, 10)
    assert len(plan.nodes(R)) == 1
    # Another tree may have other names.
    plan.insert_trial("root-b", {"wd": Constant(0.0)}, 10)


@pytest.mark.parametrize("steps", [-1, 1.5, True, "3"])
def test_bad_steps_rejected(plan: BasePlanStorage, steps: object) -> None:
    with pytest.raises(InvalidTrialError, match="steps"):
        plan.insert_trial(R, lr(Constant(0.1)), steps)  # type: ignore[arg-type]


def test_bad_hp_values_rejected(plan: BasePlanStorage) -> None:
    with pytest.raises(InvalidTrialError, match="'lr'"):
        plan.insert_trial(R, {"lr": [0.1, 0.2]}, 3)  # type: ignore[dict-item]
    assert plan.nodes() == []


@dataclass(frozen=True, eq=False)
class Boom(Sequence):
    """A sequence whose values cannot be computed (simulates a failure mid-batch)."""

    value: float = 0.0

    def _value(self, t: int) -> float:
        raise RuntimeError("boom")


def test_failed_batch_writes_nothing_and_leaves_cache_consistent(plan: BasePlanStorage) -> None:
    plan.insert_trial(R, lr(Constant(0.1)), 10)
    with pytest.raises(RuntimeError, match="boom"):
        plan.insert_trials(R, [(lr(Constant(0.2)), 10), (lr(Boom()), 10)])
    assert len(plan.nodes(R)) == 1
    assert len(plan.requests()) == 1
    again = plan.insert_trial(R, lr(Constant(0.2)), 10)
    assert len(again.new_nodes) == 1
    assert plan.locate(R, lr(Constant(0.2)), 10) == (again.node, 10)
    check_tree(plan, R)


def test_locate_without_path(plan: BasePlanStorage) -> None:
    assert plan.locate(R, lr(Constant(0.1)), 5) is None
    plan.insert_trial(R, lr(Constant(0.1)), 5)
    assert plan.locate(R, lr(Constant(0.2)), 5) is None
    assert plan.locate(R, lr(Constant(0.2)), 0) is not None
    assert plan.nodes(R)[0].id == plan.locate(R, lr(Constant(0.1)), 1000)[0]  # type: ignore[index]


def test_trees_are_independent_and_ids_unique(plan: BasePlanStorage) -> None:
    a = plan.insert_trial("a", lr(Constant(0.1)), 5)
    b = plan.insert_trial("b", lr(Constant(0.1)), 5)
    c = plan.insert_trial("a", lr(Constant(0.2)), 5)
    assert len({a.node, b.node, c.node}) == 3
    assert [n.id for n in plan.nodes("a")] == [a.node, c.node]
    assert [n.id for n in plan.nodes()] == sorted([a.node, b.node, c.node])
    assert [r.node for r in plan.requests("b")] == [b.node]
    assert plan.root_keys() == ["a", "b"]


def test_unknown_node(plan: BasePlanStorage) -> None:
    with pytest.raises(PlanKeyError, match="no node 42"):
        plan.node(42)
    with pytest.raises(PlanKeyError):
        plan.add_request(42, 1)
    with pytest.raises(PlanKeyError):
        plan.put_metrics(42, 1, {"x": 1.0})


def test_insert_without_request(plan: BasePlanStorage) -> None:
    ins = plan.insert_trial(R, lr(Constant(0.1)), 5, request=False)
    assert plan.request(ins.node, 5) is None and plan.requests() == []


# -- roots -----------------------------------------------------------------------------


def test_roots(plan: BasePlanStorage) -> None:
    config = {"optimizer": "sgd", "wd": 1e-4, "layers": [64, 32]}
    plan.register_root(R, config)
    plan.register_root(R, dict(reversed(config.items())))  # idempotent
    assert plan.root_config(R) == config
    with pytest.raises(StorageError, match="another config"):
        plan.register_root(R, {"optimizer": "adam"})
    with pytest.raises(PlanKeyError, match="not registered"):
        plan.root_config("nope")
    assert plan.root_keys() == [R]
    got = plan.root_config(R)
    got["optimizer"] = "changed"
    assert plan.root_config(R)["optimizer"] == "sgd"


# -- requests --------------------------------------------------------------------------


def test_request_life_cycle(plan: BasePlanStorage) -> None:
    n = plan.insert_trial(R, lr(Constant(0.1)), 10, request=False).node
    req = plan.add_request(n, 10)
    assert (req.refcount, req.state) == (1, RequestState.PENDING)
    assert plan.add_request(n, 10, count=2).refcount == 3
    assert plan.release_request(n, 10, count=2).state == RequestState.PENDING
    cancelled = plan.release_request(n, 10)
    assert (cancelled.refcount, cancelled.state) == (0, RequestState.CANCELLED)
    revived = plan.add_request(n, 10)
    assert (revived.refcount, revived.state) == (1, RequestState.PENDING)
    assert plan.set_request_state(n, 10, "scheduled").state == RequestState.SCHEDULED
    assert plan.release_request(n, 10).state == RequestState.CANCELLED  # scheduled too
    plan.add_request(n, 10)
    plan.set_request_state(n, 10, RequestState.DONE)
    assert plan.add_request(n, 10).state == RequestState.DONE  # done stays done
    plan.release_request(n, 10, 2)
    done = plan.request(n, 10)
    assert done is not None and (done.refcount, done.state) == (0, RequestState.DONE)


def test_failed_request_revives_without_error(plan: BasePlanStorage) -> None:
    n = plan.insert_trial(R, lr(Constant(0.1)), 10).node
    failed = plan.set_request_state(n, 10, RequestState.FAILED, error="Traceback: boom")
    assert (failed.state, failed.error) == (RequestState.FAILED, "Traceback: boom")
    stored = plan.request(n, 10)
    assert stored is not None and stored.error == "Traceback: boom"
    assert plan.release_request(n, 10).state == RequestState.FAILED  # final: kept
    revived = plan.add_request(n, 10)
    assert (revived.state, revived.error, revived.refcount) == (RequestState.PENDING, None, 1)
    # Inserting the trial again revives a failed request the same way.
    plan.set_request_state(n, 10, RequestState.FAILED, error="again")
    plan.insert_trial(R, lr(Constant(0.1)), 10)
    again = plan.request(n, 10)
    assert again is not None and (again.state, again.error, again.refcount) == (
        RequestState.PENDING,
        None,
        2,
    )


def test_request_errors(plan: BasePlanStorage) -> None:
    root = plan.insert_trial(R, lr(Constant(0.1)), 10).node
    child = plan.insert_trial(R, lr(MultiStep(0.1, [5], 0.1)), 10).node
    with pytest.raises(RequestError, match="holds 1"):
        plan.release_request(root, 10, 2)
    with pytest.raises(PlanKeyError, match="no request"):
        plan.release_request(root, 3)
    with pytest.raises(PlanKeyError, match="no request"):
        plan.set_request_state(root, 3, "done")
    with pytest.raises(ValueError, match="not canonical"):
        plan.add_request(child, 5)  # (child, 5) is the root's model
    with pytest.raises(ValueError):
        plan.set_request_state(root, 10, "bogus")
    assert plan.add_request(root, 0).refcount == 1  # the root at step 0 is canonical
    assert plan.add_request(child, 6).refcount == 1


def test_requests_filters_and_copies(plan: BasePlanStorage) -> None:
    a = plan.insert_trial("a", lr(Constant(0.1)), 10).node
    b = plan.insert_trial("b", lr(Constant(0.1)), 10).node
    plan.add_request(a, 5)
    plan.set_request_state(a, 5, "scheduled")
    assert [(r.node, r.step) for r in plan.requests()] == [(a, 5), (a, 10), (b, 10)]
    assert [(r.node, r.step) for r in plan.requests("a", states=["pending"])] == [(a, 10)]
    assert [(r.node, r.step) for r in plan.requests(states={RequestState.SCHEDULED})] == [(a, 5)]
    assert plan.requests("a", states=[]) == []
    got = plan.request(a, 10)
    assert got is not None
    got.refcount = 99
    assert plan.request(a, 10).refcount == 1  # type: ignore[union-attr]


# -- checkpoints -----------------------------------------------------------------------


def test_checkpoints(plan: BasePlanStorage) -> None:
    a = plan.insert_trial("a", lr(Constant(0.1)), 10).node
    b = plan.insert_trial("b", lr(Constant(0.1)), 10).node
    rec = plan.put_checkpoint(a, 5, "file:///ckpt/a5", 1234)
    assert isinstance(rec, CheckpointRecord) and (rec.ref, rec.nbytes) == ("file:///ckpt/a5", 1234)
    plan.put_checkpoint(b, 10, "b10", 5_000_000_000)  # > 2**32 bytes
    assert plan.checkpoint(a, 5) == rec
    assert set(plan.checkpoints()) == {(a, 5), (b, 10)}
    assert plan.checkpoints("b")[(b, 10)].nbytes == 5_000_000_000
    newer = plan.put_checkpoint(a, 5, "a5-v2", 99)
    assert plan.checkpoints("a") == {(a, 5): newer}
    assert newer.created >= rec.created
    assert plan.remove_checkpoint(a, 5) is True
    assert plan.remove_checkpoint(a, 5) is False
    assert plan.checkpoint(a, 5) is None and list(plan.checkpoints()) == [(b, 10)]
    with pytest.raises(ValueError, match="not canonical"):
        child = plan.insert_trial("a", lr(MultiStep(0.1, [3], 0.1)), 10).node
        plan.put_checkpoint(child, 3, "x", 1)


# -- metrics ---------------------------------------------------------------------------


def test_metrics_roundtrip_with_nan_and_inf(plan: BasePlanStorage) -> None:
    n = plan.insert_trial(R, lr(Constant(0.1)), 10).node
    assert plan.get_metrics(n, 5) is None
    plan.put_metrics(n, 5, {"loss": math.nan, "acc": 0.5, "big": math.inf, "small": -math.inf})
    got = plan.get_metrics(n, 5)
    assert got is not None and math.isnan(got["loss"])
    assert (got["acc"], got["big"], got["small"]) == (0.5, math.inf, -math.inf)
    plan.put_metrics(n, 5, {"acc": 0.75, "f1": 1})  # merged, ints become floats
    got = plan.get_metrics(n, 5)
    assert got is not None and (got["acc"], got["f1"], sorted(got)) == (
        0.75,
        1.0,
        ["acc", "big", "f1", "loss", "small"],
    )
    with pytest.raises(ValueError, match="'acc'"):
        plan.put_metrics(n, 5, {"acc": "high"})  # type: ignore[dict-item]


def test_metrics_along_the_path(plan: BasePlanStorage) -> None:
    const, decay = lr(Constant(0.1)), lr(MultiStep(0.1, [10], 0.1))
    root = plan.insert_trial(R, const, 20).node
    child = plan.insert_trial(R, decay, 20).node
    other = plan.insert_trial(R, lr(Constant(0.3)), 20).node
    plan.put_metrics(root, 0, {"acc": 0.1})
    plan.put_metrics(root, 5, {"acc": 0.5})
    plan.put_metrics(root, 10, {"acc": 0.6})
    plan.put_metrics(root, 15, {"acc": 0.65})  # the constant branch only
    plan.put_metrics(child, 15, {"acc": 0.7})
    plan.put_metrics(child, 20, {"acc": 0.8, "loss": math.nan})
    plan.put_metrics(other, 5, {"acc": 0.0})
    got = plan.metrics_along(R, decay, 20)
    assert sorted(got) == [0, 5, 10, 15, 20]
    assert [got[s]["acc"] for s in (0, 5, 10, 15, 20)] == [0.1, 0.5, 0.6, 0.7, 0.8]
    assert math.isnan(got[20]["loss"])
    assert plan.metrics_along(R, decay, 15) == {s: got[s] for s in (0, 5, 10, 15)}
    assert {s: m["acc"] for s, m in plan.metrics_along(R, const, 100).items()} == {
        0: 0.1,
        5: 0.5,
        10: 0.6,
        15: 0.65,
    }
    # A path that leaves the tree at step 10 still sees the shared prefix.
    leaves = lr(MultiStep(0.1, [10], 0.5))
    assert plan.locate(R, leaves, 20) is None
    assert sorted(plan.metrics_along(R, leaves, 20)) == [0, 5, 10]
    assert plan.metrics_along("empty", decay, 20) == {}


def test_path_metrics_are_the_curve_of_the_trial_ending_there(plan: BasePlanStorage) -> None:
    const, decay = lr(Constant(0.1)), lr(MultiStep(0.1, [10], 0.1))
    deeper = lr(MultiStep(0.1, [10, 15], 0.1))
    for hp in (const, decay, deeper, lr(Constant(0.3))):
        plan.insert_trial(R, hp, 20)
    for hp in (const, decay, deeper):
        for step in range(0, 21, 3):
            node, at = plan.locate(R, hp, step) or (0, 0)
            plan.put_metrics(node, at, {"acc": node + step / 100, "loss": math.nan})
    for hp in (const, decay, deeper):
        for steps in (0, 9, 12, 16, 20):
            at = plan.locate(R, hp, steps)
            assert at is not None
            got = plan.path_metrics(*at)
            want = plan.metrics_along(R, hp, steps)
            assert list(got) == list(want) and repr(got) == repr(want)
    assert len(plan.path_metrics(*(plan.locate(R, deeper, 20) or (0, 0)))) > 3


def test_node_links_are_where_the_nodes_hang(plan: BasePlanStorage) -> None:
    """``node_links`` gives each node of one tree its id, parent and branch step, as
    ``nodes`` has them (without their sequences), and cuts the same paths."""
    for hp in (lr(Constant(0.1)), lr(MultiStep(0.1, [10], 0.1)), lr(MultiStep(0.1, [10, 15], 0.1))):
        plan.insert_trial(R, hp, 20)
    plan.insert_trial("other", lr(Constant(0.2)), 5)
    nodes = {n.id: n for n in plan.nodes(R)}
    links = plan.node_links(R)
    assert links == {i: (n.id, n.parent, n.branch_step) for i, n in nodes.items()}
    assert all(link.id == i for i, link in links.items())
    for node in nodes:
        assert path_segments(links, node, 20) == path_segments(nodes, node, 20)
    assert plan.node_links("absent") == {}


def test_light_rows_own_their_attrs(plan: BasePlanStorage) -> None:
    plan.create_study("s", {})
    attrs = {"version": "v1", "error": {"type": "E"}}
    ids = [plan.add_trial("s", R, {}, lr(Constant(x)), 4, None, None, attrs=attrs) for x in (1, 2)]
    for light in (True, False):
        rows = plan.trials("s", light=light)
        rows[0]["attrs"]["version"] = "changed"
        rows[0]["attrs"]["error"]["type"] = "changed"
        assert [r["attrs"] for r in rows[1:]] == [attrs]
        assert plan.trial(ids[0])["attrs"] == attrs


def test_metrics_of_a_whole_tree_in_one_read(plan: BasePlanStorage) -> None:
    const, decay = lr(Constant(0.1)), lr(MultiStep(0.1, [10], 0.1))
    root = plan.insert_trial(R, const, 20).node
    child = plan.insert_trial(R, decay, 20).node
    elsewhere = plan.insert_trial("root-b", const, 5).node
    plan.put_metrics_many(
        [
            (root, 5, {"acc": 0.5}, True),
            (root, 3, {"loss": 1.0}, False),  # train() metrics only: on the curve too
            (child, 20, {"acc": 0.8, "loss": math.inf}, True),
            (elsewhere, 5, {"acc": 0.0}, True),
        ]
    )
    got = plan.metrics(R)
    assert got == {root: {3: {"loss": 1.0}, 5: {"acc": 0.5}}, child: {20: got[child][20]}}
    assert list(got[root]) == [3, 5] and got[child][20]["loss"] == math.inf
    assert plan.metrics(R, [child]) == {child: got[child]}
    assert plan.metrics(R, [elsewhere]) == {}  # another tree's node
    assert plan.metrics("empty") == {}
    assert plan.metric_steps(R) == {root: 5, child: 20}
    assert plan.metric_steps("root-b") == {elsewhere: 5}
    assert plan.metric_steps("empty") == {}


def test_metrics_at_many_keys_in_one_read(plan: BasePlanStorage) -> None:
    const, decay = lr(Constant(0.1)), lr(MultiStep(0.1, [10], 0.1))
    root = plan.insert_trial(R, const, 700).node
    child = plan.insert_trial(R, decay, 20).node
    elsewhere = plan.insert_trial("root-b", const, 5).node
    curve = [(root, s, {"acc": s / 1000}, s % 2 == 0) for s in range(1, 701)]  # odd: train()
    plan.put_metrics_many(
        [
            *curve,
            (child, 20, {"acc": math.nan, "loss": -math.inf}, True),
            (elsewhere, 5, {"acc": 0.0}, True),
        ]
    )
    # More keys than one query takes; duplicates, missing steps and unknown nodes.
    keys = [(root, s) for s in range(700, 0, -1)]
    keys += [(root, 3), (child, 20), (child, 19), (elsewhere, 5), (10_000, 1)]
    got = plan.metrics_at(keys)
    assert list(got) == sorted({*((root, s) for s in range(1, 701)), (child, 20), (elsewhere, 5)})
    assert got[(root, 3)] == {"acc": 0.003} and got[(root, 700)] == {"acc": 0.7}  # no mark
    assert math.isnan(got[(child, 20)]["acc"]) and got[(child, 20)]["loss"] == -math.inf
    whole = plan.metrics(R)
    assert all(got[(n, s)] == whole[n][s] for n, s in got if n != elsewhere)
    got[(root, 3)]["acc"] = 1.0  # a copy
    assert plan.metrics_at([(root, 3)]) == {(root, 3): {"acc": 0.003}}
    assert plan.metrics_at([]) == {} and plan.metrics_at([(child, 11)]) == {}


def test_put_metrics_many_records_a_learning_curve(backend: Backend) -> None:
    plan = backend.storage
    const, decay = lr(Constant(0.1)), lr(MultiStep(0.1, [3], 0.1))
    root = plan.insert_trial(R, const, 6).node
    child = plan.insert_trial(R, decay, 6).node
    plan.put_metrics_many(
        [
            (root, 1, {"train_loss": 1.0}, False),
            (root, 2, {"train_loss": 0.9, "acc": 0.2}, True),
            (root, 3, {"train_loss": 0.8}, False),
            (child, 4, {"train_loss": 0.7, "acc": math.nan}, True),
            (child, 5, {"train_loss": 0.6}, False),
        ]
    )
    plan.put_metrics_many([])  # nothing to do
    # Steps with train() metrics only are on the curve but answer no request.
    assert plan.get_metrics(root, 1) is None and plan.get_metrics(root, 3) is None
    assert plan.get_metrics(root, 2) == {"train_loss": 0.9, "acc": 0.2}
    curve = plan.metrics_along(R, decay, 6)
    assert sorted(curve) == [1, 2, 3, 4, 5]
    assert [curve[s]["train_loss"] for s in range(1, 6)] == [1.0, 0.9, 0.8, 0.7, 0.6]
    assert math.isnan(curve[4]["acc"]) and curve[1] == {"train_loss": 1.0}
    # Evaluating a partial step completes it; train() metrics never unmark an evaluated one.
    plan.put_metrics(root, 3, {"acc": 0.3})
    plan.put_metrics_many([(root, 2, {"train_loss": 0.95}, False)])
    assert plan.get_metrics(root, 3) == {"train_loss": 0.8, "acc": 0.3}
    assert plan.get_metrics(root, 2) == {"train_loss": 0.95, "acc": 0.2}
    # One key twice in one call: merged in order.
    plan.put_metrics_many([(child, 6, {"a": 1.0}, False), (child, 6, {"a": 2.0, "b": 3.0}, True)])
    assert plan.get_metrics(child, 6) == {"a": 2.0, "b": 3.0}
    if backend.reopen is not None:
        again = backend.reopen()
        assert again.metrics_along(R, decay, 6) == plan.metrics_along(R, decay, 6)
        assert again.get_metrics(child, 5) is None
        assert again.get_metrics(root, 3) == {"train_loss": 0.8, "acc": 0.3}


def test_put_metrics_many_checks_every_item_before_writing(plan: BasePlanStorage) -> None:
    root = plan.insert_trial(R, lr(MultiStep(0.1, [3], 0.1)), 6).node
    child = plan.insert_trial(R, lr(Constant(0.1)), 6).node
    bad_items: list[list[tuple[int, int, dict[str, float], bool]]] = [
        [(root, 1, {"a": 1.0}, False), (child, 2, {"a": 1.0}, False)],  # not canonical
        [(root, 1, {"a": 1.0}, False), (root, 2, {"stagetree:partial": 1.0}, False)],
    ]
    for items in bad_items:
        with pytest.raises(ValueError):
            plan.put_metrics_many(items)
    with pytest.raises(PlanKeyError):
        plan.put_metrics_many([(root, 1, {"a": 1.0}, True), (999, 1, {"a": 1.0}, True)])
    assert plan.metrics_along(R, lr(MultiStep(0.1, [3], 0.1)), 6) == {}


# -- accounting ------------------------------------------------------------------------


def test_stats(plan: BasePlanStorage) -> None:
    assert plan.stats() == {} and plan.stats("s1") == {}
    plan.add_stats("s1", steps_executed=10, device_seconds=1.5)
    plan.add_stats("s1", steps_executed=5)
    plan.add_stats("s2", steps_executed=1, ckpt_bytes=2**40)
    plan.add_stats("s2")
    assert plan.stats("s1") == {"device_seconds": 1.5, "steps_executed": 15.0}
    assert plan.stats() == {"ckpt_bytes": 2.0**40, "device_seconds": 1.5, "steps_executed": 16.0}


# -- studies and logs ------------------------------------------------------------------


def test_update_study_meta_merges_latest_wins(plan: BasePlanStorage) -> None:
    plan.create_study("s", {"metric": "acc", "mode": "max", "version": "v1"})
    merged = plan.update_study_meta("s", {"metric": "loss", "mode": "min"})
    assert merged == {"metric": "loss", "mode": "min", "version": "v1"}
    assert plan.studies()[0]["meta"] == merged
    with pytest.raises(PlanKeyError):
        plan.update_study_meta("nope", {})
    with pytest.raises(ValueError):
        plan.update_study_meta("s", {"bad": object()})
    assert plan.studies()[0]["meta"] == merged


def test_studies_and_trials(plan: BasePlanStorage) -> None:
    assert plan.create_study("s", {"tuner": "asha", "eta": 4}) is True
    assert plan.create_study("s", {"tuner": "other"}) is False
    assert plan.create_study("t", {}) is True
    assert [(s["name"], s["meta"]) for s in plan.studies()] == [
        ("s", {"eta": 4, "tuner": "asha"}),
        ("t", {}),
    ]
    hp = {"lr": MultiStep(0.1, [5], 0.1), "bs": Constant(32)}
    n = plan.insert_trial(R, hp, 10).node
    t1 = plan.add_trial("s", R, {"wd": 0.0}, hp, 10, n, 10)
    t2 = plan.add_trial("s", R, {"wd": 0.1}, hp, 5, None, None, attrs={"rung": 0})
    t3 = plan.add_trial("t", R, {}, hp, 5, None, None)
    assert len({t1, t2, t3}) == 3
    trials = plan.trials("s")
    assert [t["id"] for t in trials] == [t1, t2]
    first = trials[0]
    assert (first["study"], first["root_key"], first["config"], first["steps"]) == (
        "s",
        R,
        {"wd": 0.0},
        10,
    )
    assert (first["node"], first["step"], first["state"], first["attrs"]) == (n, 10, "pending", {})
    assert first["hp"] == hp
    updated = plan.update_trial(t2, steps=20, node=n, step=20, state="done", attrs={"rung": 1})
    assert (updated["steps"], updated["node"], updated["step"]) == (20, n, 20)
    assert (updated["state"], updated["attrs"]) == ("done", {"rung": 1})
    assert plan.trials("s")[1] == updated == plan.trial(t2)
    # Light rows: the same without their config and sequences.
    light = plan.trials("s", light=True)
    assert light == [
        {k: v for k, v in t.items() if k not in ("config", "hp")} for t in plan.trials("s")
    ]
    light[1]["attrs"]["rung"] = 7  # a copy
    assert plan.trials("s", light=True)[1]["attrs"] == {"rung": 1}
    assert list(plan.trials("s")[0]) == [
        *("id", "study", "root_key", "config", "hp", "steps", "node", "step", "state"),
        *("attrs", "created"),
    ]
    with pytest.raises(PlanKeyError, match="no trial"):
        plan.trial(10_000)
    assert plan.update_trial(t2)["steps"] == 20
    with pytest.raises(PlanKeyError, match="no trial"):
        plan.update_trial(10_000, state="done")
    with pytest.raises(PlanKeyError, match="no study"):
        plan.add_trial("nope", R, {}, hp, 5, None, None)
    assert plan.trials("nope") == [] == plan.trials("nope", light=True)


def test_decision_log(plan: BasePlanStorage) -> None:
    plan.create_study("s", {})
    plan.create_study("t", {})
    assert plan.append_log("s", {"op": "submit", "trial": 1}) == 0
    assert plan.append_log("t", {"op": "other"}) == 0
    assert plan.append_log("s", {"op": "promote", "score": math.nan}) == 1
    assert plan.append_log("s", {"op": "stop", "nested": {"a": [1, 2]}}) == 2
    log = plan.read_log("s")
    assert [r["op"] for r in log] == ["submit", "promote", "stop"]
    assert math.isnan(log[1]["score"]) and log[2]["nested"] == {"a": [1, 2]}
    assert plan.read_log("t") == [{"op": "other"}]
    assert plan.read_log("unknown") == []
    with pytest.raises(PlanKeyError, match="no study"):
        plan.append_log("unknown", {})
    with pytest.raises(ValueError, match="JSON"):
        plan.append_log("s", {"obj": object()})


def test_last_log_record_of_an_event_is_read_from_the_end(backend: Backend) -> None:
    plan = backend.storage
    plan.create_study("s", {})
    plan.create_study("t", {})
    assert plan.last_log("s") is None and plan.last_log("s", "trainer") is None
    records: list[dict[str, Any]] = [
        {"event": "trainer", "version": "a"},
        {"event": "submit", "key": 0, "note": {"event": "trainer", "version": "x"}},
        {"event": "trainer", "version": "b"},
        {"event": "submit", "key": 1, "config": {"event": "exploit"}},
        {"event": "odd_name%", "n": 1},
        {"event": "workers", "n": 4, "reason": '"event":"trainer" in a string'},
    ]
    for rec in records:
        plan.append_log("s", rec)
    plan.append_log("t", {"event": "exploit"})
    reader = backend.reopen() if backend.reopen is not None else plan
    assert reader.last_log("s") == records[-1]
    assert reader.last_log("s", "trainer") == records[2]  # not the nested ones
    assert reader.last_log("s", "submit") == records[3]
    assert reader.last_log("s", "odd_name%") == records[4]
    assert reader.last_log("s", "exploit") is None  # only nested in s; t's is t's
    assert reader.last_log("t", "exploit") == {"event": "exploit"}
    assert reader.last_log("unknown") is None and reader.last_log("unknown", "x") is None


# -- life cycle ------------------------------------------------------------------------


def test_closed_storage_refuses_work(plan: BasePlanStorage) -> None:
    plan.close()
    with pytest.raises(StorageError, match="closed"):
        plan.insert_trial(R, lr(Constant(0.1)), 5)
    plan.close()  # idempotent


def test_reopen_keeps_everything(backend: Backend) -> None:
    if backend.reopen is None:
        pytest.skip("memory storage does not persist")
    plan = backend.storage
    plan.register_root(R, {"opt": "sgd"})
    trials = grid(40)
    ins = plan.insert_trials(R, trials)
    root = ins[0].node
    plan.add_request(root, 3)
    plan.set_request_state(root, 3, "failed", error="oops")
    plan.put_checkpoint(root, 3, "ref3", 33)
    plan.put_metrics(root, 3, {"loss": math.nan, "acc": 0.25})
    plan.add_stats("x", steps_executed=7)
    plan.create_study("s", {"k": 1})
    plan.add_trial("s", R, {"opt": "sgd"}, trials[0][0], 40, root, 40)
    plan.append_log("s", {"i": 0})
    before = (
        plan.nodes(),
        plan.requests(),
        plan.checkpoints(),
        plan.stats(),
        plan.studies(),
        plan.trials("s"),
    )
    plan.close()
    again = backend.reopen()
    after = (
        again.nodes(),
        again.requests(),
        again.checkpoints(),
        again.stats(),
        again.studies(),
        again.trials("s"),
    )
    assert after == before
    assert [n.hp for n in after[0]] == [n.hp for n in before[0]]
    assert again.root_config(R) == {"opt": "sgd"}
    metrics = again.get_metrics(root, 3)
    assert metrics is not None and math.isnan(metrics["loss"]) and metrics["acc"] == 0.25
    assert again.read_log("s") == [{"i": 0}]
    # The reopened plan (cold cache) finds the same nodes and extends the same tree.
    reins = again.insert_trials(R, trials)
    assert [(i.node, i.step) for i in reins] == [(i.node, i.step) for i in ins]
    assert all(i.new_nodes == () for i in reins)
    assert again.request(ins[5].node, 40).refcount == 2  # type: ignore[union-attr]
    new = again.insert_trial(R, {"lr": Constant(0.5), "momentum": Constant(0.9)}, 40)
    assert new.new_nodes[0].id == max(n.id for n in before[0]) + 1
    check_tree(again, R)


def test_two_handles_see_each_other(backend: Backend) -> None:
    if backend.reopen is None:
        pytest.skip("memory storage is one handle")
    a, b = backend.storage, backend.reopen()
    x = a.insert_trial(R, lr(Constant(0.1)), 10)
    y = b.insert_trial(R, lr(Constant(0.2)), 10)  # b's cache refreshes inside its write
    z = a.insert_trial(R, lr(Constant(0.2)), 10)
    assert y.new_nodes[0].parent == x.node
    assert (z.node, z.new_nodes) == (y.node, ())
    assert b.request(y.node, 10).refcount == 2  # type: ignore[union-attr]
    assert [n.id for n in a.nodes(R)] == [n.id for n in b.nodes(R)] == [x.node, y.node]
    assert b.path(y.node)[0].id == x.node
    check_tree(b, R)


def test_values_are_linear_sequences_too(plan: BasePlanStorage) -> None:
    # Non-piecewise-constant sequences share only where values are identical.
    a = plan.insert_trial(R, lr(Linear(0.0, 1.0, 10)), 12)
    b = plan.insert_trial(R, lr(Linear(0.0, 1.0, 20)), 12)
    assert plan.node(b.node).branch_step == 1  # both start at 0.0, differ from step 1
    assert plan.node(b.node).parent == a.node


# -- trials are unique, leases ---------------------------------------------------------


def test_unique_add_trial_is_idempotent_per_study_root_config_hp(backend: Backend) -> None:
    plan = backend.storage
    plan.create_study("s", {})
    plan.create_study("t", {})
    hp = lr(Constant(0.1))
    first = plan.add_trial("s", R, {"wd": 0.0}, hp, 10, None, None, unique=True)
    again = plan.add_trial("s", R, {"wd": 0.0}, lr(Constant(0.1)), 20, None, None, unique=True)
    other = backend.reopen() if backend.reopen is not None else plan
    assert other.add_trial("s", R, {"wd": 0.0}, hp, 10, None, None, unique=True) == first
    assert again == first
    assert plan.add_trial("t", R, {"wd": 0.0}, hp, 10, None, None, unique=True) != first
    assert plan.add_trial("s", R, {"wd": 0.1}, hp, 10, None, None, unique=True) != first
    dup = plan.add_trial("s", R, {"wd": 0.0}, hp, 10, None, None)  # not unique: a new row
    assert dup != first
    assert plan.add_trial("s", R, {"wd": 0.0}, hp, 10, None, None, unique=True) == first
    assert len(plan.trials("s")) == 3
    assert plan.trial(first)["steps"] == 10  # the caller updates steps itself


def test_stats_of_several_scopes_are_added_in_one_write(plan: BasePlanStorage) -> None:
    plan.add_stats("engine", steps_executed=2.0)
    before = plan.revision()
    plan.add_stats_many(
        {"engine": {"steps_executed": 3.0, "device_seconds": 1.5}, "root:r": {"steps_executed": 3}}
    )
    assert plan.revision() == before + 1  # one transaction for every scope
    assert plan.stats("engine") == {"device_seconds": 1.5, "steps_executed": 5.0}
    assert plan.stats("root:r") == {"steps_executed": 3.0}
    plan.add_stats_many({})
    plan.add_stats_many({"engine": {}})
    assert plan.stats("engine") == {"device_seconds": 1.5, "steps_executed": 5.0}


def _final_points_study(plan: BasePlanStorage) -> dict[str, int]:
    """Study ``s`` (and ``t``) with trials at their final points, one with a NaN there,
    one whose row's end lags, one outside the tree, one ending early: their ids."""
    plan.create_study("s", {})
    plan.create_study("t", {})
    a = plan.insert_trial(R, lr(Constant(0.1)), 4)
    b = plan.insert_trial(R, lr(Constant(0.2)), 6)
    plan.put_metrics_many(
        [(a.node, s, {"m": s / 10}, True) for s in range(1, 5)]
        + [(b.node, 6, {"m": math.nan}, False)]
    )
    version = {"version": "v1"}
    ids = {
        "done": plan.add_trial("s", R, {}, lr(Constant(0.1)), 4, a.node, 4, attrs=version),
        "nan": plan.add_trial("s", R, {}, lr(Constant(0.2)), 6, b.node, 6, state="done"),
        "lags": plan.add_trial("s", R, {}, lr(Constant(0.1)), 8, a.node, 4, attrs=version),
        "out": plan.add_trial("s", R, {}, lr(Constant(0.3)), 4, None, None),
        "early": plan.add_trial("s", R, {}, lr(Constant(0.1)), 2, a.node, 2, attrs={"v": [1]}),
    }
    plan.add_trial("t", R, {}, lr(Constant(0.1)), 4, a.node, 4)  # another study's
    return ids


def test_final_metrics_of_a_study_are_its_rows_final_points(backend: Backend) -> None:
    plan = backend.storage
    ids = _final_points_study(plan)
    found = plan.final_metrics("s")
    assert sorted(found) == [ids["done"], ids["nan"], ids["early"]]
    assert found[ids["done"]] == {"m": 0.4} and found[ids["early"]] == {"m": 0.2}
    assert math.isnan(found[ids["nan"]]["m"])
    assert plan.final_metrics("nosuch") == {}


def test_trial_ends_are_the_light_rows_with_their_final_points(backend: Backend) -> None:
    plan = backend.storage
    ids = _final_points_study(plan)
    ends = plan.trial_ends("s")
    assert [e.id for e in ends] == list(ids.values())
    rows = plan.trials("s", light=True)
    assert [(e.steps, e.node, e.step, dict(e.attrs)) for e in ends] == [
        (t["steps"], t["node"], t["step"], t["attrs"]) for t in rows
    ]
    finals = {e.id: e.final for e in ends}
    assert finals[ids["done"]] == {"m": 0.4} and finals[ids["early"]] == {"m": 0.2}
    assert finals[ids["lags"]] is None and finals[ids["out"]] is None
    assert math.isnan((finals[ids["nan"]] or {})["m"])
    assert {k for k, v in finals.items() if v is not None} == plan.final_metrics("s").keys()
    assert plan.trial_ends("nosuch") == []


def test_trial_finals_are_the_rows_with_their_final_points(backend: Backend) -> None:
    plan = backend.storage
    ids = _final_points_study(plan)
    plan.add_trial("s", R, {"wd": [0.1, {"a": 1}]}, lr(Linear(0.1, 0.0, 10)), 4, None, None)
    finals = plan.trial_finals("s")
    rows = plan.trials("s")
    assert [f.id for f in finals] == [t["id"] for t in rows]
    fields = ("config", "hp", "steps", "node", "step", "state", "attrs")
    assert [(f.config, f.hp, f.steps, f.node, f.step, f.state, dict(f.attrs)) for f in finals] == [
        tuple(t[k] for k in fields) for t in rows
    ]
    assert all(type(v) is type(t["hp"][k]) for f, t in zip(finals, rows) for k, v in f.hp.items())
    ends = {e.id: e.final for e in plan.trial_ends("s")}
    by_id = {f.id: f.final for f in finals}
    assert {k: v is None for k, v in by_id.items()} == {k: v is None for k, v in ends.items()}
    assert by_id[ids["done"]] == {"m": 0.4} and by_id[ids["lags"]] is None
    assert math.isnan((by_id[ids["nan"]] or {})["m"])
    finals[0].config["changed"] = 1  # each row's own config and sequences
    finals[0].hp.clear()
    assert plan.trial_finals("s")[0].config == {} and plan.trial_finals("s")[0].hp
    assert plan.trial_finals("nosuch") == []


def test_claim_is_all_or_nothing_and_respects_other_owners(backend: Backend) -> None:
    a = backend.storage
    b = backend.reopen() if backend.reopen is not None else a
    got = a.claim("A", R, [(1, 0, 10), (2, 10, 20), (3, 5, 5)], ttl=30)
    assert got.ok and [(x.node, x.start, x.stop, x.owner) for x in got.granted] == [
        (1, 0, 10, "A"),
        (2, 10, 20, "A"),
    ]
    lease = got.granted[0]
    assert lease.scope == R and lease.pid == os.getpid() and lease.expires > lease.created
    # another owner overlapping one segment gets nothing, and learns who stands in the way
    denied = b.claim("B", R, [(4, 0, 5), (1, 9, 12)], ttl=30)
    assert not denied.ok and denied.granted == ()
    assert [(x.owner, x.node) for x in denied.conflicts] == [("A", 1)]
    assert [x.node for x in a.leases(R)] == [1, 2]
    # adjacent ranges and other nodes do not overlap; the same owner never conflicts
    assert b.claim("B", R, [(1, 10, 12), (4, 0, 5)], ttl=30).ok
    assert a.claim("A", R, [(1, 0, 10)], ttl=30).ok
    assert sorted(x.owner for x in b.leases()) == ["A", "A", "A", "B", "B"]
    assert a.release("A", [got.granted[1].id]) == 1
    assert b.claim("B", R, [(2, 0, 20)], ttl=30).ok
    assert a.release("A") == 2
    assert {x.owner for x in a.leases()} == {"B"}
    assert a.leases("other-root") == []


def test_leases_expire_and_renew(backend: Backend) -> None:
    a = backend.storage
    b = backend.reopen() if backend.reopen is not None else a
    assert a.claim("A", R, [(1, 0, 10)], ttl=0.3).ok
    assert a.claim("A", R, [(2, 0, 10)], ttl=0.3).ok
    assert a.renew("A", ttl=30) == 2
    time.sleep(0.4)
    assert len(b.leases(R)) == 2  # renewed: still live
    assert not b.claim("B", R, [(1, 0, 10)], ttl=30).ok
    assert a.renew("A", ttl=0.1) == 2
    time.sleep(0.2)
    assert b.leases(R) == [] and len(b.leases(R, live_only=False)) == 2
    assert b.claim("B", R, [(1, 0, 10)], ttl=30).ok  # the dead owner's lease is gone
    assert [x.owner for x in b.leases(R, live_only=False)] == ["B"]
    assert a.renew("A", ttl=30) == 0


def test_study_leases(backend: Backend) -> None:
    a = backend.storage
    b = backend.reopen() if backend.reopen is not None else a
    first = a.claim_study("A", "s", ttl=30)
    assert first.ok and first.granted[0].node is None and first.granted[0].scope == "s"
    again = a.claim_study("A", "s", ttl=60)  # renewed, not duplicated
    assert again.ok and again.granted[0].id == first.granted[0].id
    busy = b.claim_study("B", "s", ttl=30)
    assert not busy.ok and busy.conflicts[0].owner == "A"
    assert busy.conflicts[0].describe().endswith(f":{os.getpid()}")
    assert b.claim_study("B", "t", ttl=30).ok
    # a study lease never blocks stage claims, nor the other way round
    assert b.claim("B", "s", [(1, 0, 10)], ttl=30).ok
    a.release("A")
    assert b.claim_study("B", "s", ttl=30).ok
    assert a.renew("A", 1) == 0 and b.renew("B", 0.05) == 3
    time.sleep(0.1)
    assert a.claim_study("A", "s", ttl=30).ok  # B's expired


# -- change feed: revision and worker activity -------------------------------------------


def _act(kind: str, batch: int = 1, root: str = R, **fields: Any) -> dict[str, Any]:
    return {
        "owner": "engine-a",
        "batch": batch,
        "kind": kind,
        "worker": 0,
        "root_key": root,
        "time": 100.0 + batch,
        **fields,
    }


def test_revision_grows_with_every_change_but_a_heartbeat(backend: Backend) -> None:
    a = backend.storage
    other = backend.reopen() if backend.reopen is not None else a
    start = a.revision()
    a.insert_trial(R, lr(Constant(0.1)), 10)
    after_insert = other.revision()  # another handle (process) sees it
    assert after_insert > start
    a.put_metrics(1, 10, {"acc": 0.5})
    assert other.revision() > after_insert
    a.claim("A", R, [(1, 0, 10)], ttl=30)
    claimed = other.revision()
    assert a.renew("A", ttl=30) == 1
    assert other.revision() == claimed  # a heartbeat changes nothing a reader shows
    a.request(1, 10), a.nodes(R), a.activity()
    assert other.revision() == claimed  # reads change nothing


def test_activity_is_an_ordered_log_with_a_cursor(backend: Backend) -> None:
    a = backend.storage
    other = backend.reopen() if backend.reopen is not None else a
    segs = {"segments": [[1, 0, 10]], "start_step": 0, "stop_step": 10, "location": "h:1"}
    a.record_activity([_act("start", data=segs), _act("start", batch=2, root="root-b")])
    a.record_activity(
        [
            _act("save", node=1, step=10, seconds=0.25, data={"nbytes": 7}),
            _act("done", seconds=1.5, data={"steps": 10, "load_seconds": 0.0}),
        ]
    )
    a.record_activity([])  # nothing: no transaction needed
    log = other.activity()
    assert [r.kind for r in log] == ["start", "start", "save", "done"]
    assert [r.seq for r in log] == sorted({r.seq for r in log})
    first = log[0]
    assert (first.owner, first.batch, first.worker, first.root_key) == ("engine-a", 1, 0, R)
    assert first.data == segs and first.node is None and first.time == 101.0
    save = log[2]
    assert (save.node, save.step, save.seconds, save.data) == (1, 10, 0.25, {"nbytes": 7})
    assert [r.kind for r in other.activity(after=log[1].seq)] == ["save", "done"]
    assert [r.batch for r in other.activity(root_keys=["root-b"])] == [2]
    assert other.activity(after=log[-1].seq) == []
    with pytest.raises(ValueError, match="unknown activity kind 'bogus'"):
        a.record_activity([_act("bogus")])
    assert len(other.activity()) == 4  # the refused record wrote nothing
