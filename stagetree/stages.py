"""Stage trees: the work that pending requests still need, merged and split into stages.

A request ``(node, S)`` asks for the model after ``S`` steps along the path from the
root of ``node``'s tree down to ``node``. Its remaining work starts at the latest
*available* model on that path at or before ``S``:

* a durable checkpoint ``(m, t)``: ``m`` is on the path and ``t`` lies in ``m``'s
  interval on it (``b_m < t <= `` branch step of the next path node, or ``t == 0`` at
  the root);
* a position a running batch has not reached yet but will pass, or a checkpoint it
  promised at a position it passed that is not durable yet (the work up to there is
  *covered* by that batch: no new stage, the batch is asked for a checkpoint there);
* otherwise a fresh model at step 0 of the root.

A checkpoint wins a tie with a running position. The requests' paths from their start
to their step are merged: a *stage* is a maximal interval ``[start, stop)`` of training
steps under one node, split where another merged path branches off. Requests inside a
stage are its evaluation points. Two requests whose merged paths overlap always start
from the same available model (the later one of them lies on both paths), so the
result is a forest of disjoint stages: one tree per starting model, each root carrying
its :class:`Origin`.

Everything here is pure: no I/O, no storage writes (except the throw-away memory plan
that :func:`merge_rate` builds). Building is iterative (plan trees can be thousands of
nodes deep) and memoised per ``(node, upper step)``, so requests that share a prefix
cost one dictionary look-up each.
"""

from __future__ import annotations

import gc
import time
import weakref
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import TYPE_CHECKING, Any

from stagetree.hp import step_values
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.model import Node, Request, RequestState

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage

__all__ = [
    "Covered",
    "Origin",
    "RunningPosition",
    "Stage",
    "StageTree",
    "Summary",
    "Work",
    "available_at",
    "bench_build",
    "build_stage_tree",
    "critical_path",
    "kwise_merge_rate",
    "merge_rate",
    "path_values",
    "render_tree",
    "summarize",
    "total_steps",
    "unique_steps",
    "work",
]

FRESH = "fresh"
CHECKPOINT = "checkpoint"
RUNNING = "running"


@dataclass(frozen=True)
class Origin:
    """The model a stage-tree root starts from.

    Attributes:
        kind: ``"fresh"`` (a new model at step 0 of the root), ``"checkpoint"`` (a
            durable checkpoint) or ``"running"`` (a position that running batch
            ``batch_id`` will pass; the tree waits for its checkpoint there).
        node: canonical node of the starting model.
        step: its step.
        batch_id: the running batch, for ``kind == "running"``.
    """

    kind: str
    node: int
    step: int
    batch_id: int | None = None

    @property
    def ready(self) -> bool:
        """Whether work can start from here now (not waiting for a running batch)."""
        return self.kind != RUNNING


@dataclass(frozen=True)
class RunningPosition:
    """A running batch as the builder sees it.

    Attributes:
        batch_id: the batch.
        segments: ``(node, start, stop)`` per segment, consecutive along one path.
        step: the model position the worker has reached; positions after it (up to the
            last segment's stop) are still to come and can be split off.
        saving: canonical ``(node, step)`` of checkpoints the batch promised at positions
            it has already passed but that are not durable yet (they will be).
    """

    batch_id: int
    segments: tuple[tuple[int, int, int], ...]
    step: int
    saving: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Covered:
    """A request whose model a running batch will pass exactly: it only needs that
    batch to evaluate (and checkpoint) there."""

    node: int
    step: int
    batch_id: int


class Stage:
    """Training steps ``[start, stop)`` under plan node ``node``.

    Attributes:
        node: the plan node whose sequences the stage follows.
        start: first training step (the model at ``start`` is the input).
        stop: end; the model at ``stop`` is canonical ``(node, stop)``.
        parent: the stage whose end is this stage's start, None for a root. Held
            weakly (no reference cycles, so a dropped tree is freed at once): keep the
            :class:`StageTree` or the stages themselves while walking upwards.
        children: stages continuing from this stage's end, by (start, node).
        evaluate_at: sorted request steps in ``(start, stop]`` (``[start]`` for an
            evaluation-only root, ``start == stop``).
        cost: estimated cost: steps x cost per step of ``node``.
        origin: where a root starts from; None for other stages.
    """

    __slots__ = (
        "__weakref__",
        "_parent",
        "children",
        "cost",
        "evaluate_at",
        "node",
        "origin",
        "start",
        "stop",
    )

    def __init__(
        self,
        node: int,
        start: int,
        stop: int,
        parent: Stage | None = None,
        children: list[Stage] | None = None,
        evaluate_at: list[int] | None = None,
        cost: float = 0.0,
        origin: Origin | None = None,
    ) -> None:
        self.node = node
        self.start = start
        self.stop = stop
        self.parent = parent
        self.children: list[Stage] = [] if children is None else children
        self.evaluate_at: list[int] = [] if evaluate_at is None else evaluate_at
        self.cost = cost
        self.origin = origin

    @property
    def parent(self) -> Stage | None:
        """The stage this one continues (see the class docstring)."""
        ref = self._parent
        return None if ref is None else ref()

    @parent.setter
    def parent(self, stage: Stage | None) -> None:
        self._parent = None if stage is None else weakref.ref(stage)

    def __repr__(self) -> str:
        return (
            f"Stage(node={self.node}, start={self.start}, stop={self.stop}, "
            f"evaluate_at={self.evaluate_at}, cost={self.cost}, origin={self.origin})"
        )

    @property
    def steps(self) -> int:
        """Number of training steps."""
        return self.stop - self.start

    def subtree(self) -> Iterator[Stage]:
        """This stage and every stage below it, depth first (iterative)."""
        stack = [self]
        while stack:
            stage = stack.pop()
            yield stage
            stack.extend(reversed(stage.children))

    def requests_below(self) -> int:
        """Evaluation points in this stage and below it."""
        return sum(len(s.evaluate_at) for s in self.subtree())

    def root(self) -> Stage:
        """The root of this stage's tree."""
        stage = self
        while stage.parent is not None:
            stage = stage.parent
        return stage


class StageTree:
    """A forest of stages (see the module docstring).

    Attributes:
        stages: every stage, parents before children (each root's subtree in turn, in
            root order); listed on first use when built with ``stages=None``.
        roots: stages without a parent, by (start, node).
        covered: requests that running batches will pass exactly (no stage).
        nodes: the plan nodes the tree was built from.

    ``ready`` and ``waiting``: the ready and waiting roots in root order, when the
    builder knows them (:meth:`ready_roots` and :meth:`waiting_roots` then skip the
    scan of every root).
    """

    __slots__ = ("_ready", "_stages", "_waiting", "covered", "nodes", "roots")

    def __init__(
        self,
        stages: list[Stage] | None,
        roots: list[Stage],
        covered: list[Covered],
        nodes: Mapping[int, Node],
        *,
        ready: list[Stage] | None = None,
        waiting: list[Stage] | None = None,
    ) -> None:
        self._stages = stages
        self.roots = roots
        self.covered = covered
        self.nodes = nodes
        self._ready = ready
        self._waiting = waiting

    @property
    def stages(self) -> list[Stage]:
        """Every stage, parents before children."""
        if self._stages is None:
            self._stages = [s for r in self.roots for s in r.subtree()]
        return self._stages

    def __repr__(self) -> str:
        return f"StageTree(stages={self.stages!r}, roots={self.roots!r}, covered={self.covered!r})"

    def ready_roots(self) -> list[Stage]:
        """Roots that can start now (fresh or from a durable checkpoint)."""
        if self._ready is not None:
            return list(self._ready)
        return [r for r in self.roots if r.origin is None or r.origin.ready]

    def waiting_roots(self) -> list[Stage]:
        """Roots that wait for a checkpoint of a running batch."""
        if self._waiting is not None:
            return list(self._waiting)
        return [r for r in self.roots if r.origin is not None and not r.origin.ready]

    @property
    def total_steps(self) -> int:
        """Training steps the stages hold (what the pending requests still cost)."""
        return sum(s.stop - s.start for s in self.stages)

    def __len__(self) -> int:
        return len(self.stages)


def _is_canonical(node: Node, step: int) -> bool:
    return step > node.branch_step or (node.parent is None and step == 0)


def _node(nodes: Mapping[int, Node], node_id: int, what: str) -> Node:
    node = nodes.get(node_id)
    if node is None:
        raise ValueError(f"{what} refers to node {node_id}, which is not among the plan nodes")
    return node


def build_stage_tree(
    nodes: Mapping[int, Node],
    requests: Iterable[tuple[int, int]],
    checkpoints: Iterable[tuple[int, int]] = (),
    running: Iterable[RunningPosition] = (),
    cost: Callable[[Node], float] | None = None,
) -> StageTree:
    """Merge pending requests into a forest of stages.

    Args:
        nodes: plan nodes by id (every node on a request's path must be there).
        requests: canonical ``(node, step)`` of pending requests; duplicates are merged.
        checkpoints: canonical ``(node, step)`` of durable checkpoints.
        running: running batches whose future positions count as available.
        cost: estimated seconds per step of a node; 1.0 per step when None.

    Returns:
        The stage tree (see the module docstring).

    Raises:
        ValueError: a request or checkpoint on an unknown node or not canonical.
    """
    # The build allocates tens of thousands of small objects at once; generational
    # collections triggered halfway would walk them (and the whole plan) for nothing.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build(nodes, requests, checkpoints, running, cost)
    finally:
        if enabled:
            gc.enable()


_Ckpts = dict[int, list[int]]
_Runs = dict[int, list[tuple[int, int, int]]]


def _sources(
    nodes: Mapping[int, Node],
    checkpoints: Iterable[tuple[int, int]],
    running: Iterable[RunningPosition],
) -> tuple[_Ckpts, _Runs]:
    """The models a build may start from: durable checkpoint steps per node (sorted),
    and per node the positions ``(lo, hi, batch)`` running batches will pass or have
    promised a checkpoint at (in batch order).

    Raises:
        ValueError: a checkpoint on an unknown node or not canonical.
    """
    ckpts: _Ckpts = defaultdict(list)
    for m, t in checkpoints:
        if not _is_canonical(_node(nodes, m, "a checkpoint"), t):
            raise ValueError(f"checkpoint (node {m}, step {t}) is not canonical")
        ckpts[m].append(t)
    for steps in ckpts.values():
        steps.sort()
    # node -> (lo, hi, batch) positions lo..hi (canonical on node) a batch will pass.
    runs: _Runs = defaultdict(list)
    for r in sorted(running, key=lambda r: r.batch_id):
        for m, s0, s1 in r.segments:
            lo = max(s0, r.step) + 1
            if lo <= s1:
                runs[m].append((lo, s1, r.batch_id))
        for m, t in r.saving:
            runs[m].append((t, t, r.batch_id))
    return ckpts, runs


def _available(ckpts: _Ckpts, runs: _Runs, m: int, node: Node, upper: int) -> Origin | None:
    """Latest available model on ``m`` at a position in its interval, <= upper."""
    best: Origin | None = None
    best_p = -1
    steps = ckpts.get(m)
    if steps:
        i = bisect_right(steps, upper)
        if i:
            p = steps[i - 1]
            if p > node.branch_step or (node.parent is None and p == 0):
                best, best_p = Origin(CHECKPOINT, m, p), p
    spans = runs.get(m)
    if spans:
        for lo, hi, batch in spans:
            if lo <= upper:
                p = min(hi, upper)
                if p > best_p:  # strict: a checkpoint wins a tie
                    best, best_p = Origin(RUNNING, m, p, batch), p
    return best


def available_at(
    nodes: Mapping[int, Node],
    queries: Iterable[tuple[int, int]],
    checkpoints: Iterable[tuple[int, int]],
    running: Iterable[RunningPosition],
) -> list[Origin | None]:
    """What a build over ``checkpoints`` and ``running`` finds as the latest available
    model on node ``m`` at or before step ``upper``, for each ``(m, upper)`` of
    ``queries`` (None: none on ``m``). A build asks this along each request's path,
    from the request up to where it finds one; two sets of inputs that answer every
    such question alike build equal trees over the same requests.

    Raises:
        ValueError: a checkpoint on an unknown node or not canonical.
    """
    ckpts, runs = _sources(nodes, checkpoints, running)
    return [_available(ckpts, runs, m, nodes[m], upper) for m, upper in queries]


def _build(
    nodes: Mapping[int, Node],
    requests: Iterable[tuple[int, int]],
    checkpoints: Iterable[tuple[int, int]],
    running: Iterable[RunningPosition],
    cost: Callable[[Node], float] | None,
) -> StageTree:
    ckpts, runs = _sources(nodes, checkpoints, running)
    memo: dict[tuple[int, int], Origin] = {}
    intervals: dict[int, dict[int, int]] = defaultdict(dict)  # node -> lo -> hi
    origins: dict[tuple[int, int], Origin] = {}
    points: list[tuple[int, int]] = []
    zero: list[tuple[int, int, Origin]] = []
    covered: list[Covered] = []

    for n, s in dict.fromkeys(requests):
        node = nodes.get(n)
        if node is None or not (s > node.branch_step or (node.parent is None and s == 0)):
            _node(nodes, n, "a request")
            raise ValueError(f"request (node {n}, step {s}) is not canonical")
        m, upper = n, s
        trail: list[tuple[int, int]] = []
        while True:
            origin = memo.get((m, upper))
            if origin is not None:
                break
            trail.append((m, upper))
            node = nodes[m]
            origin = _available(ckpts, runs, m, node, upper)
            if origin is not None:
                break
            if node.parent is None:
                origin = Origin(FRESH, m, 0)
                break
            upper = node.branch_step
            m = node.parent
            if m not in nodes:
                _node(nodes, m, f"the path of node {n}")
        for m2, up2 in trail:
            memo[(m2, up2)] = origin
            lo = origin.step if origin.node == m2 else nodes[m2].branch_step
            if lo < up2:
                table = intervals[m2]
                if table.get(lo, -1) < up2:
                    table[lo] = up2
        if origin.node == n and origin.step == s:
            if origin.kind == RUNNING:
                assert origin.batch_id is not None
                covered.append(Covered(n, s, origin.batch_id))
            else:
                zero.append((n, s, origin))
        else:
            points.append((n, s))
            origins[(origin.node, origin.step)] = origin

    def canonical_above(node: Node) -> int:
        """Canonical node of position ``node.branch_step`` (strictly above ``node``)."""
        b = node.branch_step
        q = nodes[node.parent]  # type: ignore[index]
        while q.branch_step >= b and q.parent is not None:
            q = nodes[q.parent]
        return q.id

    # Where pieces of a node are cut: branch steps of continuations entered from it.
    splits: dict[int, list[int]] = defaultdict(list)
    entry: dict[tuple[int, int], tuple[int, Origin | None]] = {}
    for m, table in intervals.items():
        node = nodes[m]
        for lo in table:
            if lo == node.branch_step and node.parent is not None:
                q = canonical_above(node)
                origin = origins.get((q, lo))
                entry[(m, lo)] = (q, origin)
                if origin is None:
                    splits[q].append(lo)
            else:
                entry[(m, lo)] = (m, origins[(m, lo)])
    for q, cuts in splits.items():
        splits[q] = sorted(set(cuts))

    per_cost: dict[int, float] = {}

    def step_cost(m: int) -> float:
        c = per_cost.get(m)
        if c is None:
            c = per_cost[m] = 1.0 if cost is None else float(cost(nodes[m]))
        return c

    stages: list[Stage] = []
    by_end: dict[tuple[int, int], Stage] = {}
    by_node: dict[int, tuple[list[int], list[Stage]]] = {}
    firsts: list[tuple[Stage, int, int, Origin | None]] = []  # first piece, q, lo, origin
    for m, table in intervals.items():
        cuts = splits.get(m, [])
        starts: list[int] = []
        pieces: list[Stage] = []
        c = step_cost(m)
        for lo in sorted(table):
            hi = table[lo]
            i = bisect_right(cuts, lo)
            bounds = [lo]
            while i < len(cuts) and cuts[i] < hi:
                bounds.append(cuts[i])
                i += 1
            bounds.append(hi)
            prev: Stage | None = None
            for a, b in pairwise(bounds):
                stage = Stage(m, a, b, cost=(b - a) * c)
                if prev is None:
                    q, origin = entry[(m, lo)]
                    firsts.append((stage, q, lo, origin))
                else:
                    stage.parent = prev
                    prev.children.append(stage)
                by_end[(m, b)] = stage
                starts.append(a)
                pieces.append(stage)
                stages.append(stage)
                prev = stage
        by_node[m] = (starts, pieces)

    roots: list[Stage] = []
    for stage, q, lo, origin in firsts:
        if origin is not None:
            stage.origin = origin
            roots.append(stage)
        else:
            parent = by_end[(q, lo)]
            stage.parent = parent
            parent.children.append(stage)

    for n, s in points:
        starts, pieces = by_node[n]
        stage = pieces[bisect_left(starts, s) - 1]
        stage.evaluate_at.append(s)
    for n, s, origin in zero:
        stage = Stage(n, s, s, evaluate_at=[s], origin=origin)
        stages.append(stage)
        roots.append(stage)

    for stage in stages:
        if len(stage.children) > 1:
            stage.children.sort(key=lambda c: (c.start, c.node))
        if len(stage.evaluate_at) > 1:
            stage.evaluate_at.sort()
    roots.sort(key=lambda r: (r.start, r.node, r.stop))
    ordered = [s for r in roots for s in r.subtree()]
    return StageTree(ordered, roots, covered, nodes)


def path_values(roots: Iterable[Stage]) -> dict[int, tuple[float, int]]:
    """The best (cost, steps) of a path from each stage with children down to a leaf,
    by ``id`` of the stage, over the subtrees of ``roots`` (a leaf's is its own: cost
    and steps, not listed). What :func:`critical_path` compares."""
    # Children first; most roots of a large study are leaves: no walk, no entry.
    order: list[Stage] = []
    stack = [r for r in roots if r.children]
    while stack:
        stage = stack.pop()
        order.append(stage)
        stack.extend(c for c in stage.children if c.children)
    best: dict[int, tuple[float, int]] = {}
    get = best.get
    for stage in reversed(order):
        below = max([get(id(c)) or (c.cost + 0.0, c.stop - c.start) for c in stage.children])
        best[id(stage)] = (stage.cost + below[0], stage.stop - stage.start + below[1])
    return best


def critical_path(stage_tree: StageTree, roots: Iterable[Stage] | None = None) -> list[Stage]:
    """The longest remaining root-to-leaf path by estimated cost.

    Args:
        stage_tree: the forest.
        roots: roots to choose among (default: every root of the forest).

    Returns:
        Stages from a root down to a leaf; empty when there are no roots. Ties go to the
        path with more steps, then to the earlier root / child.
    """
    roots = list(stage_tree.roots if roots is None else roots)
    if not roots:
        return []
    best = path_values(roots)
    get = best.get

    def values(stages: list[Stage]) -> list[tuple[float, int]]:
        return [get(id(s)) or (s.cost + 0.0, s.stop - s.start) for s in stages]

    def pick(candidates: list[Stage]) -> Stage:
        # The first of the greatest (``max`` keeps the first on a tie, as ``>`` does).
        vals = values(candidates)
        return candidates[max(range(len(vals)), key=vals.__getitem__)]

    path = [pick(roots)]
    while path[-1].children:
        path.append(pick(path[-1].children))
    return path


def total_steps(requests: Iterable[tuple[int, int]]) -> int:
    """Sum of the requests' steps (each trained alone from step 0)."""
    return sum(step for _, step in requests)


def unique_steps(nodes: Mapping[int, Node], requests: Iterable[tuple[int, int]]) -> int:
    """Steps covered by the union of the requests' paths from step 0: the
    ``total_steps`` of their stage tree without checkpoints, counted without building
    it (each node holds the steps from its branch step up to the furthest step a path
    through it needs; a walk up a path stops at a node an earlier walk went through).

    Raises:
        ValueError: a request on an unknown node or not canonical.
    """
    need: dict[int, int] = {}  # node -> the furthest step a path needs it trained to
    for n, s in requests:
        node = _node(nodes, n, "a request")
        if not _is_canonical(node, s):
            raise ValueError(f"request (node {n}, step {s}) is not canonical")
        up = s
        while True:
            seen = node.id in need
            if not seen or need[node.id] < up:
                need[node.id] = up
            if seen or node.parent is None:
                break
            up = node.branch_step
            node = _node(nodes, node.parent, f"the path of node {n}")
    return sum(
        max(up - (nodes[m].branch_step if nodes[m].parent is not None else 0), 0)
        for m, up in need.items()
    )


def _trial_requests(
    trials: Iterable[tuple[str, Mapping[str, Any], int]],
) -> tuple[dict[int, Node], list[tuple[int, int]]]:

    storage = MemoryPlanStorage()
    grouped: dict[str, list[tuple[Mapping[str, Any], int]]] = defaultdict(list)
    for root_key, hp, steps in trials:
        grouped[root_key].append((hp, steps))
    requests: list[tuple[int, int]] = []
    for root_key, items in grouped.items():
        for ins in storage.insert_trials(root_key, items, request=False):
            requests.append((ins.node, ins.step))
    return {n.id: n for n in storage.nodes()}, requests


def _rate(total: int, unique: int) -> float:
    return total / unique if unique else 1.0


def merge_rate(trials: Iterable[tuple[str, Mapping[str, Any], int]]) -> float:
    """Total steps / unique steps of trials ``(root_key, hp, steps)``.

    ``hp`` maps names to sequences (plain values count as constants). 1.0 when no step
    is trained at all.
    """
    nodes, requests = _trial_requests(trials)
    return _rate(total_steps(requests), unique_steps(nodes, requests))


def kwise_merge_rate(studies: Seq[Iterable[tuple[str, Mapping[str, Any], int]]]) -> float:
    """Merge rate of several studies together: the sum of their total steps over the
    unique steps of their union (what sharing across studies saves)."""
    return merge_rate(chain.from_iterable(studies))


@dataclass(frozen=True)
class Summary:
    """Sharing statistics of a plan (what ``stagetree explain`` prints).

    Attributes:
        trials: trials counted.
        total_steps: sum of their steps (each trained alone).
        unique_steps: steps of the union of their paths.
        merge_rate: ``total_steps / unique_steps`` (1.0 when nothing is trained).
        nodes: plan nodes of the selected trees.
        checkpoints: durable checkpoints of the selected trees.
        pending_requests: requests still pending or scheduled.
        pending_steps: training steps the pending requests still need (stage tree).
    """

    trials: int
    total_steps: int
    unique_steps: int
    merge_rate: float
    nodes: int
    checkpoints: int
    pending_requests: int
    pending_steps: int


def _plan_view(
    storage: BasePlanStorage, root_keys: Iterable[str] | None
) -> tuple[list[str], dict[int, Node], list[Request], list[tuple[int, int]]]:
    keys = list(storage.root_keys() if root_keys is None else root_keys)
    nodes: dict[int, Node] = {}
    requests: list[Request] = []
    ckpts: list[tuple[int, int]] = []
    for key in keys:
        nodes.update((n.id, n) for n in storage.nodes(key))
        requests.extend(storage.requests(key))
        ckpts.extend(storage.checkpoints(key))
    return keys, nodes, requests, ckpts


_LIVE = (RequestState.PENDING, RequestState.SCHEDULED)


def summarize(
    storage: BasePlanStorage, root_keys: Iterable[str] | None = None, study: str | None = None
) -> Summary:
    """Sharing statistics of the plan's trees.

    Trials are the storage's trial records (of ``study``, or of every study); a plan
    without trial records counts each request that is not cancelled as one trial.

    Args:
        storage: the plan.
        root_keys: trees to include (default: all).
        study: count only this study's trials.
    """
    keys, nodes, requests, ckpts = _plan_view(storage, root_keys)
    wanted = set(keys)
    names = [study] if study is not None else [s["name"] for s in storage.studies()]
    trials = [
        t for name in names for t in storage.trials(name, light=True) if t["root_key"] in wanted
    ]
    if trials or study is not None:
        count = len(trials)
        steps_sum = sum(int(t["steps"]) for t in trials)
        ends = [(int(t["node"]), int(t["step"])) for t in trials if t["node"] is not None]
    else:
        ends = [(r.node, r.step) for r in requests if r.state != RequestState.CANCELLED]
        steps_sum, count = total_steps(ends), len(ends)
    ends = [e for e in ends if e[0] in nodes]
    unique = unique_steps(nodes, ends)
    live = [(r.node, r.step) for r in requests if r.state in _LIVE]
    pending = build_stage_tree(nodes, live, ckpts).total_steps
    return Summary(
        trials=count,
        total_steps=steps_sum,
        unique_steps=unique,
        merge_rate=_rate(steps_sum, unique),
        nodes=len(nodes),
        checkpoints=len(ckpts),
        pending_requests=len(live),
        pending_steps=pending,
    )


def bench_build(storage: BasePlanStorage, root_keys: Iterable[str] | None = None) -> float:
    """Seconds to build the stage tree of the plan's pending requests (for benchmarks)."""
    _, nodes, requests, ckpts = _plan_view(storage, root_keys)
    live = [(r.node, r.step) for r in requests if r.state in _LIVE]
    t0 = time.perf_counter()
    build_stage_tree(nodes, live, ckpts)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- rendering


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _hp_at(hp: Mapping[str, Any], name: str, step: int) -> Any:
    value = hp.get(name)
    return value(step) if callable(value) else value


def _changes(nodes: Mapping[int, Node], node: Node) -> str:
    """``name=value`` of hyper-parameters whose value changes at the node's branch."""
    b = node.branch_step
    parent = nodes.get(node.parent) if node.parent is not None else None
    parts = []
    for name in sorted(node.hp):
        value = _hp_at(node.hp, name, b)
        if parent is None or _hp_at(parent.hp, name, b) != value:
            parts.append(f"{name}={_fmt(value)}")
    return " ".join(parts)


def _origin_text(origin: Origin | None) -> str:
    if origin is None or origin.kind == FRESH:
        return "from scratch"
    if origin.kind == CHECKPOINT:
        return f"from checkpoint (node {origin.node}, step {origin.step})"
    return f"after batch {origin.batch_id} at (node {origin.node}, step {origin.step})"


_MAX_INDENT = 32


def _indent(depth: int) -> str:
    if depth <= _MAX_INDENT:
        return "  " * depth
    return f"{'  ' * _MAX_INDENT}(depth {depth}) "


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" if k == 1 else f"{k} {word}s"


def _lines_stage_tree(tree: StageTree) -> Iterator[str]:
    below: dict[int, int] = {}
    for stage in reversed(tree.stages):
        below[id(stage)] = len(stage.evaluate_at) + sum(below[id(c)] for c in stage.children)
    stack: list[tuple[Stage, int]] = [(r, 0) for r in reversed(tree.roots)]
    while stack:
        stage, depth = stack.pop()
        node = tree.nodes[stage.node]
        text = f"{_indent(depth)}node {stage.node} [{stage.start}, {stage.stop})"
        if stage.start == node.branch_step:
            changes = _changes(tree.nodes, node)
            if changes:
                text += f" {changes}"
        text += f"  {_plural(below[id(stage)], 'request')} below"
        if stage.evaluate_at:
            text += f", evaluate at {', '.join(map(str, stage.evaluate_at))}"
        if stage.origin is not None:
            text += f"  ({_origin_text(stage.origin)})"
        yield text
        stack.extend((c, depth + 1) for c in reversed(stage.children))


def _lines_nodes(nodes: Mapping[int, Node], requests: Iterable[tuple[int, int]]) -> Iterator[str]:
    children: dict[int, list[Node]] = defaultdict(list)
    roots: list[Node] = []
    for node in sorted(nodes.values(), key=lambda n: n.id):
        if node.parent is None or node.parent not in nodes:
            roots.append(node)
        else:
            children[node.parent].append(node)
    extent: dict[int, int] = {n.id: n.branch_step for n in nodes.values()}
    own: dict[int, int] = defaultdict(int)
    for n, s in requests:
        if n in extent:
            own[n] += 1
            extent[n] = max(extent[n], s)
    order: list[Node] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(children[node.id])
    below: dict[int, int] = {}
    for node in reversed(order):
        below[node.id] = own[node.id] + sum(below[c.id] for c in children[node.id])
        if node.parent is not None and node.parent in extent:
            extent[node.parent] = max(extent[node.parent], node.branch_step)
    walk: list[tuple[Node, int]] = [(r, 0) for r in reversed(roots)]
    while walk:
        node, depth = walk.pop()
        text = f"{_indent(depth)}node {node.id} [{node.branch_step}, {extent[node.id]})"
        changes = _changes(nodes, node)
        if changes:
            text += f" {changes}"
        text += f"  {_plural(below[node.id], 'request')} below"
        yield text
        walk.extend((c, depth + 1) for c in reversed(children[node.id]))


def render_tree(
    source: StageTree | Mapping[int, Node] | Iterable[Node],
    max_lines: int = 40,
    requests: Iterable[tuple[int, int] | Request] = (),
) -> str:
    """An indented text tree of a stage tree or of plan nodes.

    Each line shows the node, its step interval, the hyper-parameter values that
    change where it branches (all values at a root), and the number of requests below.
    Stage-tree roots also say where they start from.

    Args:
        source: a :class:`StageTree`, or plan nodes (a mapping by id or an iterable).
        max_lines: lines to print at most; the rest collapse into ``... N more``.
        requests: for plan nodes, ``(node, step)`` pairs or :class:`Request` records
            (their count below each node is shown, and they extend node intervals).

    Returns:
        The tree as text (no trailing newline); ``(empty)`` for an empty tree.
    """
    if max_lines < 1:
        raise ValueError(f"max_lines must be >= 1, got {max_lines}")
    if isinstance(source, StageTree):
        lines = _lines_stage_tree(source)
    else:
        nodes = dict(source) if isinstance(source, Mapping) else {n.id: n for n in source}
        pairs = [(r.node, r.step) if isinstance(r, Request) else r for r in requests]
        lines = _lines_nodes(nodes, pairs)
    out: list[str] = []
    more = 0
    for line in lines:
        if len(out) < max_lines:
            out.append(line)
        else:
            more += 1
    if more:
        out.append(f"... {more} more")
    return "\n".join(out) if out else "(empty)"


# --------------------------------------------------------------------------- work bounds


@dataclass(frozen=True)
class Work:
    """Training seconds of a set of trials (see :func:`work`).

    Attributes:
        longest_path: the longest trial, trained alone.
        unique_work: the union of the trials' paths (each shared step once).
        requested_work: every trial trained alone from step 0.
        lower_bound: ``max(longest_path, unique_work / workers)``.
    """

    longest_path: float
    unique_work: float
    requested_work: float
    lower_bound: float


def work(
    nodes: Mapping[int, Node],
    roots: Mapping[str, Mapping[str, Any]],
    ends: Seq[tuple[int, int]],
    step_cost: Callable[[Mapping[str, Any], Mapping[str, Any]], float],
    workers: int,
) -> Work:
    """Training seconds of the trials ending at ``ends`` and the makespan lower bound.

    Args:
        nodes: plan nodes by id (every node on the ends' paths).
        roots: fixed config of every root key.
        ends: canonical ``(node, step)`` each trial reached (one entry per trial).
        step_cost: seconds of one step, ``(config, values) -> float``.
        workers: number of workers.
    """
    counts: dict[tuple[int, int], int] = {}
    for end in ends:
        counts[end] = counts.get(end, 0) + 1
    tree = build_stage_tree(nodes, list(counts))
    finish: dict[int, float] = {}
    cache: dict[tuple[int, tuple[Any, ...]], float] = {}
    unique = requested = longest = 0.0
    for stage in tree.stages:  # parents before children
        node = nodes[stage.node]
        config = roots[node.root_key]
        names = sorted(node.hp)
        columns = [step_values(node.hp[n], stage.start, stage.stop) for n in names]
        parent = stage.parent
        done = finish[id(parent)] if parent is not None else 0.0
        at = {stage.start: done}
        for i in range(stage.stop - stage.start):
            row = tuple(col[i] for col in columns)
            key = (id(config), tuple((type(v).__name__, v) for v in row))
            c = cache.get(key)
            if c is None:
                c = cache[key] = float(step_cost(config, dict(zip(names, row))))
            done += c
            at[stage.start + i + 1] = done
        for t in stage.evaluate_at:
            requested += at[t] * counts.get((stage.node, t), 0)
        finish[id(stage)] = done
        unique += done - at[stage.start]
        longest = max(longest, done)
    return Work(longest, unique, requested, max(longest, unique / max(1, workers)))
