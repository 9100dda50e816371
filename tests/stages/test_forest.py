"""The scheduler's stage tree kept per plan tree (``StageForest``): after any sequence
of changes it equals a whole build over the same inputs."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import pytest
from counting import counting

from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.plan.model import Node
from stagetree.scheduler.cost import CostEstimator
from stagetree.scheduler.forest import StageForest
from stagetree.scheduler.policies import CriticalPathPolicy
from stagetree.stages import (
    RunningPosition,
    StageTree,
    build_stage_tree,
    critical_path,
    path_values,
)

Key = tuple[int, int]


def plan(seed: int, from_zero: bool = False) -> tuple[dict[int, Node], list[Key]]:
    """Nodes of four plan trees whose trials share prefixes, and canonical positions on
    them (requests and checkpoints are drawn among those). ``from_zero``: most trials
    differ from step 0 on (their first learning rate drawn among four)."""
    rng = random.Random(seed)
    storage = MemoryPlanStorage()
    for root in ("a", "b", "c", "d"):
        items = []
        for _ in range(6):
            first = rng.choice([0.1, 0.2, 0.3, 0.4]) if from_zero else 0.1
            lr = MultiStep(first, sorted(rng.sample(range(2, 14), rng.randint(0, 2))), 0.5)
            bs = rng.choice([Constant(64), Piecewise([64, 128], [rng.randint(2, 12)])])
            items.append(({"lr": lr, "bs": bs}, rng.randint(4, 16)))
        storage.insert_trials(root, items, request=False)
    nodes = {n.id: n for n in storage.nodes()}
    keys: list[Key] = []
    for node in nodes.values():
        first = 0 if node.parent is None else node.branch_step + 1
        keys.extend((node.id, t) for t in range(first, 17))
    return nodes, keys


def path_of(nodes: dict[int, Node], key: Key) -> tuple[tuple[int, int, int], ...]:
    """The segments ``(node, start, stop)`` from step 0 of ``key``'s tree to ``key``."""
    node, stop = nodes[key[0]], key[1]
    out = []
    while True:
        start = node.branch_step if node.parent is not None else 0
        if start < stop:
            out.append((node.id, start, stop))
        if node.parent is None:
            return tuple(reversed(out))
        stop = node.branch_step
        node = nodes[node.parent]


def snapshot(tree: StageTree) -> dict[str, Any]:
    """Everything a decision may read of a stage tree, by value."""
    index = {id(s): i for i, s in enumerate(tree.stages)}

    def stages(items: list[Any]) -> list[int]:
        return [index[id(s)] for s in items]

    return {
        "stages": [
            (
                s.node,
                s.start,
                s.stop,
                list(s.evaluate_at),
                s.cost,
                s.origin,
                None if s.parent is None else index[id(s.parent)],
                stages(s.children),
            )
            for s in tree.stages
        ],
        "roots": stages(tree.roots),
        "ready": stages(tree.ready_roots()),
        "waiting": stages(tree.waiting_roots()),
        "covered": list(tree.covered),
    }


def change(
    rng: random.Random,
    forest: StageForest,
    keys: list[Key],
    requests: dict[Key, None],
    checkpoints: set[Key],
    op: float,
    cuts: tuple[float, float, float],
) -> bool:
    """A request added (``op`` below ``cuts[0]``) or settled (below ``cuts[1]``), or a
    checkpoint added (below ``cuts[2]``), in the forest and the plain inputs alike.
    False: ``op`` is above them all."""
    if op < cuts[0]:
        key = rng.choice(keys)
        if key not in requests:
            requests[key] = None
            forest.add_request(key)
    elif op < cuts[1] and requests:
        key = rng.choice(list(requests))
        del requests[key]
        forest.remove_request(key)
    elif op < cuts[2]:
        key = rng.choice(keys)
        if key not in checkpoints:
            checkpoints.add(key)
            forest.add_checkpoint(key)
    else:
        return False
    return True


def add_checkpoints(forest: StageForest, checkpoints: set[Key], keys: Iterable[Key]) -> None:
    """The checkpoints at ``keys`` become durable (those not yet), in both."""
    for key in keys:
        if key not in checkpoints:
            checkpoints.add(key)
            forest.add_checkpoint(key)


def lose_checkpoint(rng: random.Random, forest: StageForest, checkpoints: set[Key]) -> None:
    """A durable checkpoint at random is gone, in both."""
    key = rng.choice(sorted(checkpoints))
    checkpoints.discard(key)
    forest.remove_checkpoint(key)


def _running(rng: random.Random, nodes: dict[int, Node], keys: list[Key]) -> list[RunningPosition]:
    """Up to three running batches on random paths (so that some roots wait for them),
    with checkpoints promised at positions they passed (canonical, on their path)."""
    running = []
    for batch_id in range(rng.randint(0, 3)):
        segments = path_of(nodes, rng.choice(keys))
        if not segments:
            continue
        step = rng.randint(segments[0][1], segments[-1][2])
        passed = [(n, t) for n, a, b in segments for t in range(a + 1, min(b, step) + 1)]
        saving = tuple(k for k in passed if rng.random() < 0.2)
        running.append(RunningPosition(batch_id + 1, segments, step, saving))
    return running


def _held(
    rng: random.Random, forest: StageForest, ready: list[Any]
) -> tuple[set[Key], list[Any], list[Any]]:
    """Some starts of ready roots held by idle workers at random; the roots starting
    there (the forest's ``held_starts``) and the policy's order (those first)."""
    from_ckpt = [r for r in ready if r.origin is not None and r.origin.kind == "checkpoint"]
    held = {(r.origin.node, r.origin.step) for r in from_ckpt if rng.random() < 0.4}
    _, first = forest.held_starts(held)
    return held, first, first + [r for r in ready if r not in first]


def _churn(
    seed: int, rng_seed: int
) -> tuple[
    dict[int, Node], list[Key], random.Random, StageForest, CostEstimator, dict[Key, None], set[Key]
]:
    """What the churn tests change: ``plan(seed)``'s nodes and keys, their random stream,
    a forest with nothing requested, a fresh estimator, and no requests or checkpoints."""
    nodes, keys = plan(seed)
    return nodes, keys, random.Random(rng_seed), StageForest(nodes), CostEstimator(), {}, set()


def assert_whole_build(
    forest: StageForest,
    estimator: CostEstimator,
    requests: dict[Key, None],
    checkpoints: set[Key],
    running: list[RunningPosition],
    promised: set[Key],
    memory: set[Key],
    shared: bool = False,
) -> None:
    """A decision's tree from ``forest`` equals a whole build over the same inputs
    (``shared``: the tree over the forest's own root lists, and its kept ready roots)."""
    got = forest.tree(running, promised, memory, estimator.cost, estimator.version, shared=shared)
    want = build_stage_tree(
        forest._nodes,
        [k for k in requests if k not in promised],
        checkpoints | memory,
        running,
        estimator.cost,
    )
    assert snapshot(got) == snapshot(want)
    if shared:
        assert got.roots is forest._all.stages
        index = {id(s): i for i, s in enumerate(got.stages)}
        assert [index[id(r)] for r in forest.ready_roots] == snapshot(want)["ready"]


@pytest.mark.parametrize("seed", range(6))
def test_forest_equals_a_whole_build_after_every_change(seed: int) -> None:
    nodes, keys, rng, forest, estimator, requests, checkpoints = _churn(seed, seed)
    node_list = list(nodes.values())
    for _ in range(150):
        op = rng.random()
        if change(rng, forest, keys, requests, checkpoints, op, (0.35, 0.5, 0.62)):
            pass
        elif op < 0.7 and checkpoints:
            key = rng.choice(sorted(checkpoints))
            checkpoints.discard(key)
            forest.remove_checkpoint(key)
        elif op < 0.8:  # the costs move
            estimator.observe(rng.choice(node_list), rng.uniform(0.5, 2.0))
        # What running and saving batches contribute changes at every decision.
        running = _running(rng, nodes, keys)
        promised = {k for k in requests if rng.random() < 0.1}
        memory = {k for k in rng.sample(keys, 3) if rng.random() < 0.3}
        assert_whole_build(forest, estimator, requests, checkpoints, running, promised, memory)


@pytest.mark.parametrize("seed", range(4))
def test_shared_tree_and_kept_ready_roots_equal_a_whole_build_after_every_change(
    seed: int,
) -> None:
    """The tree a decision reads without copies (the forest's own root lists) and the
    ready roots it keeps equal a whole build after every change, checkpoints made
    durable where batches promised them (ready in place) included."""
    nodes, keys, rng, forest, estimator, requests, checkpoints = _churn(seed, seed + 100)
    running: list[RunningPosition] = []
    for _ in range(150):
        op = rng.random()
        if change(rng, forest, keys, requests, checkpoints, op, (0.35, 0.5, 0.6)):
            pass
        elif op < 0.75 and running:
            # A promised model becomes durable: the roots waiting for it become ready.
            add_checkpoints(forest, checkpoints, rng.choice(running).saving)
        elif op < 0.85 and checkpoints:
            lose_checkpoint(rng, forest, checkpoints)
        else:
            running = _running(rng, nodes, keys)
        assert_whole_build(forest, estimator, requests, checkpoints, running, set(), set(), True)


def test_forest_refuses_what_a_whole_build_refuses() -> None:
    nodes, keys = plan(0)
    forest = StageForest(nodes)
    child = next(n for n in nodes.values() if n.parent is not None)
    forest.add_request(keys[0])
    forest.add_checkpoint((child.id, child.branch_step))  # not canonical on its node
    with pytest.raises(ValueError, match="not canonical"):
        forest.tree([], set(), (), lambda n: 1.0, None)
    forest.remove_checkpoint((child.id, child.branch_step))
    forest.add_checkpoint((10_000, 3))
    with pytest.raises(ValueError, match="not among the plan nodes"):
        forest.tree([], set(), (), lambda n: 1.0, None)


def _spans(path: list[Any]) -> list[tuple[int, int, int]]:
    return [(s.node, s.start, s.stop) for s in path]


@pytest.mark.parametrize("seed", range(6))
def test_kept_critical_path_and_lazy_costs_equal_a_whole_build(seed: int) -> None:
    # The scheduler's critical path from the kept tree (leaf costs as arrays from the
    # estimator, values of deeper roots kept per plan tree, costs computed only where
    # read) is the path critical_path finds on a whole build, held-first order included.
    nodes, keys, rng, forest, estimator, requests, checkpoints = _churn(seed, 100 + seed)
    node_list = list(nodes.values())
    for _ in range(150):
        op = rng.random()
        if change(rng, forest, keys, requests, checkpoints, op, (0.4, 0.55, 0.7)):
            pass
        elif op < 0.9:  # the costs move (a fit over the configurations' features)
            estimator.observe(rng.choice(node_list), rng.uniform(0.5, 2.0))
        else:  # a root's config changes the configuration of its nodes
            estimator.register_root(rng.choice("abcd"), {"depth": rng.randint(1, 4)})
        got = forest.tree(
            [],
            set(),
            (),
            estimator.cost,
            estimator.version,
            estimator.costs,
            estimator=estimator,
            lazy=rng.random() < 0.7,
        )
        want = build_stage_tree(nodes, list(requests), checkpoints, [], estimator.cost)
        ready = got.ready_roots()
        held, first, order = _held(rng, forest, ready)
        from_ckpt = [r for r in ready if r.origin is not None and r.origin.kind == "checkpoint"]
        assert first == [r for r in from_ckpt if (r.origin.node, r.origin.step) in held]
        path = forest.critical_path(got, ready, first)
        assert path is not None
        spans = {(s.node, s.start, s.stop): s for s in want.roots}
        want_order = [spans[(r.node, r.start, r.stop)] for r in order]
        assert _spans(path) == _spans(critical_path(want, want_order))
        # The chosen path's costs are current even in a lazy tree.
        assert [s.cost for s in path] == [s.cost for s in critical_path(want, want_order)]
        forest.ensure_costs()
        assert snapshot(got) == snapshot(want)


@pytest.mark.parametrize("seed", range(8))
def test_kept_work_and_depth_bound_cut_equal_the_policy_on_a_whole_build(seed: int) -> None:
    # The forest keeps the remaining work (steps per plan node, priced by the estimator
    # as arrays) and the roots' path values, so that the critical-path policy's choice,
    # its depth-bound cut at a branch point included, needs no walk of the tree: after
    # any sequence of changes it is the policy's choice on a whole build.
    nodes, keys, rng, forest, estimator, requests, checkpoints = _churn(seed, 200 + seed)
    node_list = list(nodes.values())
    cuts = undecided = 0
    for _ in range(150):
        op = rng.random()
        if change(rng, forest, keys, requests, checkpoints, op, (0.4, 0.55, 0.65)):
            pass
        elif op < 0.72 and checkpoints:
            key = rng.choice(sorted(checkpoints))
            checkpoints.discard(key)
            forest.remove_checkpoint(key)
        elif op < 0.92:  # the costs move
            estimator.observe(rng.choice(node_list), rng.uniform(0.5, 2.0))
        running = _running(rng, nodes, keys)
        promised = {k for k in requests if rng.random() < 0.1}
        got = forest.tree(
            running,
            promised,
            (),
            estimator.cost,
            estimator.version,
            estimator.costs,
            estimator=estimator,
            lazy=rng.random() < 0.7,
        )
        want = build_stage_tree(
            nodes, [k for k in requests if k not in promised], checkpoints, running, estimator.cost
        )
        work, slack = forest.work()
        exact = sum(s.cost for s in reversed(want.stages))  # as the policy adds it up
        assert abs(work - exact) <= slack
        if not estimator.measured:  # one per step: the kept steps, exactly
            assert work == want.total_steps
        ready = got.ready_roots()
        if not ready:
            continue
        _, first, order = _held(rng, forest, ready)
        policy = CriticalPathPolicy()
        policy.workers = rng.choice([1, 2, 3, 8, 40])
        path = forest.critical_path(got, ready, first, policy)
        spans = {(s.node, s.start, s.stop): s for s in want.roots}
        want_order = [spans[(r.node, r.start, r.stop)] for r in order]
        want_path = policy.choose(want, want_order)
        if path is None:  # too close to the rule's threshold for the kept work
            undecided += 1
            continue
        assert _spans(path) == _spans(want_path)
        cuts += len(want_path) < len(critical_path(want, want_order))
    assert cuts > 0  # the rule did stop some paths at a branch point
    assert undecided <= 2


def _lazy_tree(
    forest: StageForest, estimator: CostEstimator, running: list[RunningPosition]
) -> StageTree:
    """The forest's tree with ``estimator``'s costs left to compute where read."""
    return forest.tree(
        running,
        set(),
        (),
        estimator.cost,
        estimator.version,
        estimator.costs,
        estimator=estimator,
        lazy=True,
    )


def test_roots_with_children_are_valued_again_only_when_their_costs_move() -> None:
    # A decision reads the kept values of roots with children as arrays: the next one at
    # the same costs values no root again; after a measurement every such root is.
    nodes, keys = plan(3)
    forest = StageForest(nodes)
    estimator = CostEstimator()
    for key in keys[::5]:
        forest.add_request(key)
    valued: list[Any] = []
    kept = forest._deep_values
    forest._deep_values = lambda roots: valued.extend(roots) or kept(roots)  # type: ignore[method-assign]

    def decide() -> list[Any]:
        got = _lazy_tree(forest, estimator, [])
        valued.clear()
        path = forest.critical_path(got, got.ready_roots(), [])
        assert path
        return [r for r in got.ready_roots() if r.children]

    deep = decide()
    assert deep and len(valued) == len(deep)
    decide()
    assert valued == []
    estimator.observe(next(iter(nodes.values())), 2.0)
    assert len(decide()) == len(valued)


def _reads(nodes: dict[int, Node], requests: list[Key]) -> set[Key]:
    """The (node, step) pairs at which a build over ``requests`` may look for the
    latest available model: each request, then the branch point of every node above."""
    out: set[Key] = set()
    for m, upper in requests:
        while (m, upper) not in out:
            out.add((m, upper))
            node = nodes[m]
            if node.parent is None:
                break
            m, upper = node.parent, node.branch_step
    return out


def _one_batch(
    seed: int, root: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[int, Node], StageForest, list[Key], tuple[tuple[int, int, int], ...], list[int]]:
    """``count`` requests on plan tree ``root`` of ``plan(seed)`` in a new forest, the
    path of the deepest (a batch's segments) and the builds the forest makes from now
    on (one entry each)."""
    import stagetree.scheduler.forest as forest_module

    builds: list[int] = []
    whole = forest_module.build_stage_tree
    monkeypatch.setattr(forest_module, "build_stage_tree", lambda *a: builds.append(1) or whole(*a))
    nodes, keys = plan(seed)
    forest = StageForest(nodes)
    own = [k for k in keys if nodes[k[0]].root_key == root]
    requests = random.Random(seed).sample(own, count)
    for key in requests:
        forest.add_request(key)
    target = max(requests, key=lambda k: (len(path_of(nodes, k)), k))
    return nodes, forest, requests, path_of(nodes, target), builds


@pytest.mark.parametrize("seed", range(8))
def test_a_moving_batch_builds_its_plan_tree_again_only_where_a_build_reads(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A running batch's position moves at every Progress. The kept tree is built again
    # only when the move passes a step the build looks at (a request, a branch point on
    # the batch's path, a checkpoint it was asked for); after every move it equals a
    # whole build.
    nodes, forest, requests, segments, builds = _one_batch(seed, "a", 6, monkeypatch)
    on_path = {m for m, _, _ in segments}
    asked: set[Key] = set()  # checkpoints the batch was asked for (as Scheduler._split)
    crossings = 0
    first, last = segments[0][1], segments[-1][2]
    for step in range(first, last + 1):
        saving = tuple(sorted(k for k in asked if k[1] <= step))
        running = [RunningPosition(1, segments, step, saving)]
        before = len(builds)
        got = forest.tree(running, set(), (), lambda n: 1.0, 0)
        want = build_stage_tree(nodes, requests, set(), running, lambda n: 1.0)
        assert snapshot(got) == snapshot(want)
        read = {(m, t) for m, t in _reads(nodes, requests) if m in on_path} | asked
        if step > first and not any(t in (step, step + 1) for _, t in read):
            assert len(builds) == before  # a move no build can see
        crossings += len(builds) > before
        for root in got.waiting_roots():
            assert root.origin is not None
            asked.add((root.origin.node, root.origin.step))
        asked.update((c.node, c.step) for c in got.covered)
    assert crossings < last - first


@pytest.mark.parametrize("seed", range(8))
def test_a_promised_model_made_durable_readies_its_roots_without_a_build(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A running batch passes positions where waiting roots start and is asked for
    # checkpoints there; once one is durable, the roots waiting for it start from it.
    # The kept tree is updated in place (no build), unless the model is requested
    # itself, and equals a whole build.
    nodes, forest, requests, segments, builds = _one_batch(seed, "b", 8, monkeypatch)
    asked: set[Key] = set()
    durable: set[Key] = set()
    promoted = 0
    for step in range(segments[0][1], segments[-1][2] + 1):
        for made in (False, True):
            if made:  # the checkpoints it passed are written
                passed = {k for k in asked if k[1] < step}
                if not passed:
                    continue
                for key in passed:
                    forest.add_checkpoint(key)
                durable |= passed
                asked -= passed
            saving = tuple(sorted(k for k in asked if k[1] <= step))
            running = [RunningPosition(1, segments, step, saving)]
            before = len(builds)
            got = forest.tree(running, set(), (), lambda n: 1.0, 0)
            want = build_stage_tree(nodes, requests, durable, running, lambda n: 1.0)
            assert snapshot(got) == snapshot(want)
            if made and not passed & set(requests):
                assert len(builds) == before
                promoted += 1
            for root in got.waiting_roots():
                assert root.origin is not None
                asked.add((root.origin.node, root.origin.step))
            asked.update((c.node, c.step) for c in got.covered if c.step > step)
    # Each in-place update was one of those decisions (the others read alike).
    assert forest.settled <= promoted


@pytest.mark.parametrize("seed", range(6))
def test_roots_valued_as_arrays_equal_path_values_to_the_bit(seed: int) -> None:
    # The values of roots with children, computed over all their stages at once from
    # the estimator's predictions, are the floats path_values gives on costed stages.
    nodes, keys, rng, forest, estimator, requests, checkpoints = _churn(seed, 300 + seed)
    node_list = list(nodes.values())
    compared = 0
    for _ in range(60):
        if not change(rng, forest, keys, requests, checkpoints, rng.random(), (0.5, 0.6, 0.7)):
            estimator.observe(rng.choice(node_list), rng.uniform(0.5, 2.0))
        got = _lazy_tree(forest, estimator, _running(rng, nodes, keys))
        deep = [r for r in got.ready_roots() if r.children]
        values = forest._deep_values(deep)
        arrays = forest._deep_arrays(deep)  # the arrays whatever the trees' size
        forest.ensure_costs()
        best = path_values(deep)
        assert values == [best[id(r)] for r in deep]
        assert arrays == values
        compared += len(deep)
    assert compared > 0


def test_roots_with_children_in_small_trees_are_valued_by_a_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A grid of a few dozen trials is one tree of a few dozen stages: valuing its roots
    # with children as arrays (a sort per level) costs more than walking them. The
    # decisions stay the whole build's.
    import numpy as np

    sorts = counting(monkeypatch, np, "lexsort")
    nodes, keys, rng, forest, estimator, requests, checkpoints = _churn(2, 77)
    node_list = list(nodes.values())
    valued = 0
    for _ in range(60):
        if not change(rng, forest, keys, requests, checkpoints, rng.random(), (0.5, 0.6, 0.7)):
            estimator.observe(rng.choice(node_list), rng.uniform(0.5, 2.0))
        got = _lazy_tree(forest, estimator, [])
        ready = got.ready_roots()
        if not ready:
            continue
        assert max(part.count for part in forest._parts.values()) <= 64  # small trees
        path = forest.critical_path(got, ready, [])
        assert path is not None
        forest.ensure_costs()
        want = build_stage_tree(nodes, list(requests), checkpoints, [], estimator.cost)
        assert _spans(path) == _spans(critical_path(want, want.ready_roots()))
        valued += any(r.children for r in ready)
    assert valued > 0
    assert sorts[0] == 0  # on main: one sort per level of the trees at each valuation


def test_a_decision_over_leaves_of_one_length_takes_the_first_of_the_greatest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A random search has every trial ready at once, each a leaf of the same length:
    # the critical path is the first root of the greatest cost (a tie on cost is one
    # on steps too), found without the mask of roots with children or the tie-break
    # arrays; it stays the whole build's path as lengths and costs change.
    import numpy as np

    from stagetree.scheduler import forest as forest_module

    rng = random.Random(5)
    nodes = {
        i: Node(i, f"t{i}", None, 0, {"lr": Constant(rng.choice([0.1, 0.2, 0.3, 0.5]))})
        for i in range(120)
    }
    forest = StageForest(nodes)
    estimator = CostEstimator()
    requests: list[Key] = []
    for i in range(100):
        requests.append((i, 4))
        forest.add_request((i, 4))
    scans = counting(monkeypatch, np, "flatnonzero")
    reads = counting(monkeypatch, forest_module._Ready, "numpy")
    for round_ in range(40):
        got = _lazy_tree(forest, estimator, [])
        ready = got.ready_roots()
        scans[0] = reads[0] = 0
        path = forest.critical_path(got, ready, [])
        assert path is not None
        want = build_stage_tree(nodes, list(requests), set(), [], estimator.cost)
        assert _spans(path) == _spans(critical_path(want, want.ready_roots()))
        one_length = len({r.stop - r.start for r in ready}) == 1
        if one_length:
            assert scans[0] == 0 and reads[0] == 2  # on main: 1 and 3
        estimator.observe(nodes[rng.randrange(120)], rng.choice([1.0, 2.0]))
        if round_ == 20:  # another length: the tie-break on steps again
            requests.append((110, 8))
            forest.add_request((110, 8))
        if round_ == 30:
            requests.remove((110, 8))
            forest.remove_request((110, 8))
    assert scans[0] == 0


def test_a_small_part_adds_its_steps_to_the_work_element_by_element() -> None:
    # Each trial's tree (a node or two) enters and leaves the remaining work at every
    # build: fancy indexing into the steps per node costs more than the few sums it
    # does. The kept work stays the sum of every stage's cost.
    import numpy as np

    class Counting(np.ndarray):
        fancy = 0

        def __setitem__(self, key: Any, value: Any) -> None:
            if isinstance(key, np.ndarray):
                Counting.fancy += 1
            super().__setitem__(key, value)

    nodes = {i: Node(i, f"t{i}", None, 0, {"lr": Constant(0.01 * (i + 1))}) for i in range(50)}
    forest = StageForest(nodes)
    estimator = CostEstimator()
    for i in range(30):
        estimator.observe(nodes[i], 0.5 + 0.01 * i)
    got = _lazy_tree(forest, estimator, [])  # the estimator's dense indices
    forest._steps_at = np.zeros(4096).view(Counting)
    for i in range(40):
        forest.add_request((i, 3 + i % 4))
        if i % 3 == 0:
            got = _lazy_tree(forest, estimator, [])
    got = _lazy_tree(forest, estimator, [])
    forest.remove_request((7, 3 + 7 % 4))
    got = _lazy_tree(forest, estimator, [])
    assert Counting.fancy == 0  # on main: one per part added or taken out
    forest.ensure_costs()
    work, slack = forest.work()
    assert abs(work - sum(s.cost for s in got.stages)) <= slack
