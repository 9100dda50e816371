"""The scheduler's stage tree, kept between decisions one plan tree at a time.

A stage tree is a forest whose parts never mix plan trees: a request's path, the
checkpoints and running positions it may start from all lie in its own plan tree
(one root key). :class:`StageForest` keeps the stage tree of each plan tree built
(:func:`stagetree.stages.build_stage_tree` over that tree's inputs only) and builds
again only the plan trees whose inputs changed since the last decision:

* live requests and durable checkpoints, which the scheduler reports as they come and
  go (:meth:`StageForest.add_request`, ...);
* running and saving batches' positions and promised evaluations, which the scheduler
  reports for the batches that changed since the last decision
  (:meth:`StageForest.set_batch`): kept per plan tree, so that one batch's progress
  marks its own plan tree only, not every plan tree with a running batch;
* the models idle workers hold that count as durable (compared with the last
  decision's: only the plan trees of those that came or went are marked).

Within a plan tree, the requests are kept in groups that share no stage: a group is
the requests whose paths have their first steps on the same node (the *anchor*, see
:meth:`StageForest._anchor`). Paths of different anchors meet at step 0 of the root at
most, where no stage lies, so a build over the plan tree is the union of the builds over
its groups; a plan tree of trials that each differ from step 0 (a random search) is one
group per trial, and a decision after one trial's change builds that trial's stages
only, not those of every pending trial. Inputs are kept per group, those at step 0 of
the root (which every group of the plan tree reads) per plan tree.

A group whose inputs changed is built again only if the build would read them
differently. A build asks, at a fixed set of steps per plan node (the requests' steps
and the branch points above them, :func:`_queries`), for the latest available model at
or before that step (:func:`~stagetree.stages.available_at`); where every answer is
the same (a running batch moved between two such steps, a checkpoint no such step
sees), the kept tree is the tree a build gives. Where the answers differ only in that a
model a running batch promised is now a durable checkpoint at the same position, a
build gives the kept tree with those roots starting from the checkpoint: they are
moved from waiting to ready instead (the path that changed), unless the model is
itself requested (then a build covers it differently, and builds).

The roots of all plan trees stay sorted in one list (the order a whole build gives
them), and the stages' costs are computed again only when the cost estimator's
predictions may have moved, and then (:meth:`StageForest.tree` with ``lazy``) only
where they are read. :meth:`StageForest.critical_path` finds the critical-path policy's
choice without a walk of every root: the ready roots' steps and nodes are kept in flat
arrays, a leaf's value comes from the estimator's predictions as an array
(:meth:`~stagetree.scheduler.cost.CostEstimator.cost_array`), and the value of a root
with children is kept until the costs move, then computed again for all such roots at
once as arrays over their stages (kept per plan tree as arrays when it is built). For
the critical-path policy's depth-bound cut, the forest also keeps every plan node's
steps in its stages (updated as plan trees are built again): the remaining work is then
one dot product with the estimator's predictions (:meth:`StageForest.work`), and the
cut is decided with the policy's own rule
(:meth:`~stagetree.scheduler.policies.CriticalPathPolicy.cut`) on kept values instead
of a walk of every stage. The result equals a whole build over every input: the same
stages, roots, covered requests, order and costs (``tests/stages/test_forest.py``
checks it against :func:`~stagetree.stages.build_stage_tree`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from stagetree.plan.model import Node
from stagetree.scheduler.policies import CriticalPathPolicy
from stagetree.stages import (
    CHECKPOINT,
    RUNNING,
    Covered,
    Origin,
    RunningPosition,
    Stage,
    StageTree,
    available_at,
    build_stage_tree,
    critical_path,
    path_values,
)

__all__ = ["StageForest"]

Key = tuple[int, int]
# Inputs are kept by group: an anchor node's id (:meth:`StageForest._anchor`), or a plan
# tree's root key for those every group of the tree reads (step 0 of its root).
Group = int | str
Slot = tuple[int, int]  # a batch's place in the order a build lists running positions
_Order = tuple[int, int, int]


def _order(stage: Stage) -> _Order:
    """A root's place in a whole build's root order (unique: see ``stages._build``)."""
    return (stage.start, stage.node, stage.stop)


class _Sorted:
    """Roots kept in root order."""

    __slots__ = ("keys", "stages")

    def __init__(self) -> None:
        self.keys: list[_Order] = []
        self.stages: list[Stage] = []

    def add(self, stage: Stage) -> int:
        key = _order(stage)
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.stages.insert(i, stage)
        return i

    def remove(self, stage: Stage) -> int:
        i = bisect_left(self.keys, _order(stage))
        assert self.stages[i] is stage
        del self.keys[i]
        del self.stages[i]
        return i

    def index(self, stage: Stage) -> int:
        i = bisect_left(self.keys, _order(stage))
        assert self.stages[i] is stage
        return i


_DTYPES = {"q": np.int64, "b": np.int8, "d": np.float64}
#: Up to this many plan nodes, a part's steps are added to the work one by one.
_FEW = 8
#: Up to this many stages in their plan trees, roots with children are valued by a walk.
_FEW_STAGES = 64


class _Ready(_Sorted):
    """Ready roots in root order, with what the critical path of a leaf needs kept in
    flat arrays (cheap to insert into, read as numpy arrays): its node's dense index in
    the cost estimator, its steps, and whether it has children; and for a root with
    children its best (cost, steps) below, with the cost epoch it was computed at (-1:
    not yet), so that a decision reads the values of unchanged roots as arrays. Counted
    as they come and go: the roots with children, and the roots of each length (a
    decision over leaves of one length needs no arrays for either)."""

    __slots__ = (
        "deep",
        "deeps",
        "dense",
        "lengths",
        "origins",
        "stamp",
        "steps",
        "value",
        "value_steps",
    )

    def __init__(self) -> None:
        super().__init__()
        # Roots that start from a durable checkpoint, by its key.
        self.origins: dict[Key, list[Stage]] = {}
        self.dense = array("q")
        self.steps = array("q")
        self.deep = array("b")
        self.value = array("d")
        self.value_steps = array("q")
        self.stamp = array("q")
        self.deeps = 0
        self.lengths: dict[int, int] = {}

    def put(self, stage: Stage, dense: int) -> None:
        i = self.add(stage)
        origin = stage.origin
        if origin is not None and origin.kind == CHECKPOINT:
            self.origins.setdefault((origin.node, origin.step), []).append(stage)
        self.dense.insert(i, dense)
        length = stage.stop - stage.start
        self.steps.insert(i, length)
        self.lengths[length] = self.lengths.get(length, 0) + 1
        self.deep.insert(i, 1 if stage.children else 0)
        self.deeps += 1 if stage.children else 0
        self.value.insert(i, 0.0)
        self.value_steps.insert(i, 0)
        self.stamp.insert(i, -1)

    def take(self, stage: Stage) -> None:
        i = self.remove(stage)
        origin = stage.origin
        if origin is not None and origin.kind == CHECKPOINT:
            key = (origin.node, origin.step)
            same = self.origins[key]
            same.remove(stage)
            if not same:
                del self.origins[key]
        del self.dense[i]
        length = self.steps.pop(i)
        left = self.lengths[length] - 1
        if left:
            self.lengths[length] = left
        else:
            del self.lengths[length]
        self.deeps -= self.deep.pop(i)
        del self.value[i]
        del self.value_steps[i]
        del self.stamp[i]
        if not self.stages:
            # An array keeps the buffer of its peak size (random search has every
            # trial ready at once): start small again.
            self.dense, self.steps, self.deep = array("q"), array("q"), array("b")
            self.value, self.value_steps, self.stamp = array("d"), array("q"), array("q")
            self.origins, self.lengths = {}, {}

    @staticmethod
    def numpy(values: array[Any]) -> np.ndarray:
        """A copy of ``values`` as a numpy array (no view is left to block a resize)."""
        return np.frombuffer(values, dtype=_DTYPES[values.typecode]).copy()


class Estimator(Protocol):
    """What the kept critical path needs of a cost estimator
    (:class:`~stagetree.scheduler.cost.CostEstimator`)."""

    version: Any

    def index(self, node: Node) -> int: ...

    def cost_array(self, dense: np.ndarray) -> np.ndarray: ...


@dataclass
class _Part:
    """The built stage tree of one plan tree."""

    roots: list[Stage]
    covered: list[Covered]
    version: Any
    # Stages by plan node, for computing costs again.
    by_node: dict[int, list[Stage]] = field(default_factory=dict)
    # Best (cost, steps) below each root with children, at ``version``'s costs.
    values: dict[int, tuple[float, int]] = field(default_factory=dict)
    # Each root with children's stages (by ``id`` of the root, once valued), parents
    # first, as arrays: the index of its node in ``by_node``'s order, its steps, its
    # parent's position (-1: the root) and its height (0: a leaf).
    shapes: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    # Its stages' steps per plan node (in ``by_node``'s order) and those nodes' dense
    # indices in the estimator (None: no estimator): its share of the remaining work.
    steps: np.ndarray | None = None
    dense: np.ndarray | None = None
    count: int = 0  # stages
    # What the build read: the requests in order, the checkpoints and running
    # positions; the steps it may ask for an available model at (:func:`_queries`) and
    # the answers there, worked out when first compared (None: not yet).
    requests: tuple[Key, ...] = ()
    read: tuple[set[Key], tuple[RunningPosition, ...]] = (set(), ())
    queries: list[Key] | None = None
    answers: list[Origin | None] | None = None


def _queries(nodes: Mapping[int, Node], requests: Iterable[Key]) -> list[Key]:
    """The ``(node, upper)`` pairs at which a build over ``requests`` may ask for the
    latest available model at or before ``upper`` on that node: each request, then the
    branch point on every node above it."""
    seen: dict[Key, None] = {}
    for m, upper in requests:
        while (m, upper) not in seen:
            seen[(m, upper)] = None
            node = nodes[m]
            if node.parent is None:
                break
            m, upper = node.parent, node.branch_step
    return list(seen)


def _shape(root: Stage, local: Mapping[int, int]) -> tuple[np.ndarray, ...]:
    """``root``'s subtree as :attr:`_Part.shapes` keeps it (``local``: node -> its
    index in the part's ``by_node`` order)."""
    stages = list(root.subtree())  # parents first
    at = {id(s): i for i, s in enumerate(stages)}
    parent = [-1] + [at[id(s.parent)] for s in stages[1:]]
    height = [0] * len(stages)
    for i in range(len(stages) - 1, 0, -1):
        p = parent[i]
        height[p] = max(height[p], height[i] + 1)
    return (
        np.array([local[s.node] for s in stages], dtype=np.int64),
        np.array([float(s.stop - s.start) for s in stages]),
        np.array(parent, dtype=np.int64),
        np.array(height, dtype=np.int64),
    )


class StageForest:
    """The stage tree of a scheduler's state, kept per plan tree (see the module
    docstring).

    Args:
        nodes: the scheduler's plan nodes by id (the same mapping, kept up to date).
    """

    def __init__(self, nodes: Mapping[int, Node]) -> None:
        self._nodes = nodes
        # Live requests per group (anchor): request -> sequence number (the order of the
        # scheduler's live requests, which a whole build iterates).
        self._requests: dict[int, dict[Key, int]] = {}
        self._seq: dict[Key, int] = {}
        self._next = 0
        # Durable checkpoints per group, as a tuple (a set holds at least 216 bytes;
        # each change marks the group for a build, which reads them all anyway).
        self._checkpoints: dict[Group, tuple[Key, ...]] = {}
        # Checkpoints not checked yet (a whole build refuses an unknown node or a
        # position that is not canonical, and so does the next decision).
        self._unchecked: set[Key] = set()
        self._version: Any = None  # of the estimator, when every cost was last computed
        self._dirty: set[int] = set()
        self._parts: dict[int, _Part] = {}
        self._covered: dict[int, list[Covered]] = {}
        self._volatile: dict[Group, Any] = {}  # last signature of the per-call inputs
        # Batches' inputs, kept per plan tree as the scheduler reports them
        # (:meth:`set_batch`): positions by slot, and promised evaluations with the
        # number of batches that promise each; and what each slot last reported.
        self._positions: dict[Group, dict[Slot, RunningPosition]] = {}
        self._promises: dict[int, dict[Key, int]] = {}
        self._batches: dict[Slot, tuple[Group | None, RunningPosition | None, frozenset[Key]]] = {}
        self._compared = 0
        # The models in memory at the last decision, and by plan tree.
        self._memory: set[Key] = set()
        self._memory_by_tree: dict[Group, set[Key]] = {}
        self._anchors: dict[int, int] = {}  # node -> its anchor (:meth:`_anchor`)
        self._all = _Sorted()
        self._ready = _Ready()
        self._waiting = _Sorted()
        # Costs not computed yet (a lazy :meth:`tree`): the arguments to compute them.
        self._pending: tuple[Callable[[Node], float], Any, Any] | None = None
        # The estimator whose dense indices ``_ready`` holds (None: no indices).
        self._estimator: Estimator | None = None
        # Stage costs move together when the estimator's version does: the epoch counts
        # those moves (the values ``_ready`` keeps are current at this epoch only).
        self._epoch = 0
        self._epoch_of: Any = None
        # The remaining work, kept for the critical-path policy's depth-bound cut: the
        # steps of every stage per plan node by dense index (integers, so += and -=
        # stay exact), the number of stages, and the work at (estimator version,
        # change count) once computed.
        self._steps_at = np.zeros(64)
        self._dense_of: dict[int, int] = {}  # plan node -> dense index in the estimator
        self._count = 0
        self._changes = 0
        self._work_at: tuple[Any, int] | None = None
        self._work = (0.0, 0)
        self._builds = 0
        self._settled = 0

    @property
    def builds(self) -> int:
        """Plan trees built so far (a kept tree whose inputs read the same is not)."""
        return self._builds

    @property
    def settled(self) -> int:
        """Plan trees updated in place where running batches' models became durable."""
        return self._settled

    @property
    def compared(self) -> int:
        """Plan trees whose inputs the last :meth:`tree` looked at again (those whose
        requests, checkpoints or batches' inputs changed since the decision before)."""
        return self._compared

    # -- inputs ----------------------------------------------------------------------

    def _root_key(self, node: int) -> str:
        return self._nodes[node].root_key

    def _anchor(self, node: int) -> int:
        """The group of requests on ``node``: the highest node on its path with steps
        of its own (paths of different anchors meet at step 0 of the root at most, so
        their stages never mix: they are built apart). Kept per node."""
        got = self._anchors.get(node)
        if got is not None:
            return got
        nodes, trail, m = self._nodes, [], node
        while True:
            got = self._anchors.get(m)
            if got is not None:
                break
            trail.append(m)
            at = nodes[m]
            if at.parent is None:
                got = m
                break
            b, q = at.branch_step, nodes[at.parent]
            while q.branch_step >= b and q.parent is not None:  # the node of position b
                q = nodes[q.parent]
            if q.parent is None and b == 0:
                got = m  # nothing above but the root's step 0
                break
            m = q.id
        for m in trail:
            self._anchors[m] = got
        return got

    def _group(self, key: Key) -> Group:
        """The group a model at ``key`` may start builds of: its anchor's, or every
        group of its plan tree (by root key) for step 0 of a root."""
        node = self._nodes[key[0]]
        if node.parent is None and key[1] == 0:
            return node.root_key
        return self._anchor(key[0])

    def _position_group(self, position: RunningPosition) -> Group:
        """The group of a running batch's position (those of the positions it offers)."""
        for key in position.saving:
            if isinstance(self._group(key), str):
                return self._nodes[key[0]].root_key
        for m, s0, s1 in position.segments:
            if max(s0, position.step) + 1 <= s1:
                return self._anchor(m)
        first = position.segments[0][0] if position.segments else position.saving[0][0]
        return self._anchor(first)

    def _touch(self, group: Group) -> None:
        """Compare ``group`` (every group of a plan tree, for a root key) at the next
        :meth:`tree`."""
        if isinstance(group, int):
            self._dirty.add(group)
        else:
            self._dirty.update(
                g for g in self._requests if isinstance(g, int) and self._root_key(g) == group
            )

    def add_request(self, key: Key) -> None:
        """A new live request (the scheduler checked its node)."""
        group = self._anchor(key[0])
        self._requests.setdefault(group, {})[key] = self._next
        self._seq[key] = self._next
        self._next += 1
        self._dirty.add(group)

    def remove_request(self, key: Key) -> None:
        """A live request settled or was cancelled."""
        group = self._anchor(key[0])
        del self._requests[group][key]
        del self._seq[key]
        if not self._seq:
            self._seq = {}  # a dict keeps the table of its peak size: start small again
        self._dirty.add(group)

    def add_checkpoint(self, key: Key) -> None:
        """A durable checkpoint."""
        self._unchecked.add(key)

    def remove_checkpoint(self, key: Key) -> None:
        """A checkpoint that is gone (lost, unreadable)."""
        self._unchecked.discard(key)
        if key[0] in self._nodes:
            group = self._group(key)
            kept = self._checkpoints.get(group, ())
            if key in kept:
                left = tuple(k for k in kept if k != key)
                if left:
                    self._checkpoints[group] = left
                else:
                    del self._checkpoints[group]
            self._touch(group)

    def set_batch(
        self, slot: Slot, position: RunningPosition | None, evaluate: Iterable[Key] = ()
    ) -> None:
        """What the batch in ``slot`` offers now: its ``position`` (None: none, it ended
        or was aborted) and the evaluations it promised. A plan tree's positions are
        listed in slot order. Only the plan trees whose inputs change are compared at
        the next :meth:`tree`."""
        was = self._batches.get(slot)
        promised = frozenset(evaluate)
        root_key: Group | None = None
        if position is not None and (position.segments or position.saving):
            root_key = self._position_group(position)
        else:
            position = None  # it offers no position
        # The same promises (a batch that moved on): their counts, so every build's
        # input but the positions', stay what they are.
        same = was is not None and was[2] == promised
        if was is not None:
            old_key, old_position, old_promised = was
            if old_key == root_key and old_position == position and same:
                return
            if old_key is not None:
                del self._positions[old_key][slot]
                if isinstance(old_key, str) and not self._positions[old_key]:
                    del self._positions[old_key]  # no group's rebuild drops it
                self._touch(old_key)
            if not same:
                self._promise(old_promised, -1)
        if root_key is not None and position is not None:
            self._positions.setdefault(root_key, {})[slot] = position
            self._touch(root_key)
        if not same:
            self._promise(promised, 1)
        if root_key is None and not promised:
            self._batches.pop(slot, None)
        else:
            self._batches[slot] = (root_key, position, promised)

    def _promise(self, keys: frozenset[Key], sign: int) -> None:
        for key in keys:
            root_key = self._anchor(key[0])
            counts = self._promises.setdefault(root_key, {})
            n = counts.get(key, 0) + sign
            if n:
                counts[key] = n
            else:
                del counts[key]
            self._dirty.add(root_key)

    def batch_inputs(self) -> dict[str, tuple[tuple[RunningPosition, ...], frozenset[Key]]]:
        """The running batches' inputs per plan tree as kept: positions in batch order,
        promised evaluations (plan trees with neither left out)."""
        by_tree: dict[str, tuple[dict[Slot, RunningPosition], set[Key]]] = {}
        for group in self._positions.keys() | self._promises.keys():
            tree = group if isinstance(group, str) else self._root_key(group)
            positions, promised = by_tree.setdefault(tree, ({}, set()))
            positions.update(self._positions.get(group, {}))
            if isinstance(group, int):
                promised.update(self._promises.get(group, ()))
        out = {}
        for tree, (positions, promised) in by_tree.items():
            running = tuple(positions[b] for b in sorted(positions))
            if running or promised:
                out[tree] = (running, frozenset(promised))
        return out

    # -- the tree --------------------------------------------------------------------

    def tree(
        self,
        running: Iterable[RunningPosition],
        promised: set[Key],
        memory: Iterable[Key],
        cost: Callable[[Node], float],
        version: Any,
        costs: Callable[[list[Node]], list[float]] | None = None,
        *,
        estimator: Estimator | None = None,
        lazy: bool = False,
        shared: bool = False,
    ) -> StageTree:
        """The stage tree of every live request not in ``promised``, from the durable
        checkpoints, the models in ``memory`` (counted as durable) and the ``running``
        positions, after those of the batches (:meth:`set_batch`, whose promised
        evaluations are left out too: ``running`` and ``promised`` hold any others, few,
        compared at every call); stage costs from ``cost``, whose predictions stay what they are
        while ``version`` does (None: they may change at any call). ``costs``, when
        given, is ``cost`` over a list of nodes at once (the same floats).

        ``estimator``: the estimator behind ``cost`` and ``version``, for
        :meth:`critical_path`. ``lazy``: leave the stages' costs as they are until
        :meth:`ensure_costs` (or :meth:`critical_path`, for the path it returns).
        ``shared``: the tree's roots, ready and waiting roots are the forest's own
        lists (no copy: the next call changes them; read them, never change them),
        for a decision that is done before the next call.

        Raises:
            ValueError: a checkpoint on a node that is not among the plan nodes.
        """
        for key in list(self._unchecked):
            node = self._nodes.get(key[0])
            if node is None:
                raise ValueError(
                    f"a checkpoint refers to node {key[0]}, which is not among the plan nodes"
                )
            if not (key[1] > node.branch_step or (node.parent is None and key[1] == 0)):
                raise ValueError(f"checkpoint (node {key[0]}, step {key[1]}) is not canonical")
            self._unchecked.discard(key)
            group = self._group(key)
            kept = self._checkpoints.get(group, ())
            if key not in kept:
                self._checkpoints[group] = (*kept, key)
            self._touch(group)
        dirty = self._dirty
        # The models in memory: only the groups of those that came or went.
        now = set(memory)
        for key in now ^ self._memory:
            group = self._group(key)
            held = self._memory_by_tree.setdefault(group, set())
            if key in now:
                held.add(key)
            else:
                held.discard(key)
                if not held:
                    del self._memory_by_tree[group]
            self._touch(group)
        self._memory = now
        volatile: dict[Group, tuple[list[RunningPosition], set[Key]]] = {}
        running = running if isinstance(running, (list, tuple)) else list(running)
        if running or promised or self._volatile:  # the scheduler passes none
            for pos in running:
                if pos.segments or pos.saving:  # else it offers no position
                    group = self._position_group(pos)
                    volatile.setdefault(group, ([], set()))[0].append(pos)
            for key in promised:
                volatile.setdefault(self._anchor(key[0]), ([], set()))[1].add(key)
            signatures = {k: (tuple(r), frozenset(p)) for k, (r, p) in volatile.items()}
            for k in self._volatile.keys() | signatures.keys():
                if self._volatile.get(k) != signatures.get(k):
                    self._touch(k)
            self._volatile = signatures
        if estimator is not self._estimator:
            self._reindex(estimator)
        self._compared = len(dirty)
        for group in dirty:
            tree = self._root_key(group)
            running_k, promised_k = volatile.get(group, ((), set()))
            running_k = list(running_k) + volatile.get(tree, ([], set()))[0]
            # With the models at step 0 of the root, which every group of the tree reads.
            memory_k = self._memory_by_tree.get(group, set())
            memory_k = memory_k.union(
                self._memory_by_tree.get(tree, ()), self._checkpoints.get(tree, ())
            )
            # The batches' positions come first, in slot order.
            positions = self._positions.get(group)
            if positions is not None and not positions:
                del self._positions[group]
            tree_positions = self._positions.get(tree)
            if tree_positions:
                positions = {**tree_positions, **(positions or {})}
            if positions:
                running_k = [positions[b] for b in sorted(positions)] + running_k
            promises = self._promises.get(group)
            if promises:
                promised_k = promised_k | promises.keys()
            elif promises is not None:
                del self._promises[group]
            self._rebuild(group, running_k, promised_k, memory_k, cost, version)
        dirty.clear()
        self._shrink()
        self._pending = None
        if version is None or version != self._version:
            if lazy:
                self._pending = (cost, version, costs)
            else:
                self._recost(cost, version, costs)
                self._version = version
        covered = [c for cs in self._covered.values() for c in cs]
        if len(self._covered) > 1:
            covered.sort(key=lambda c: self._seq[(c.node, c.step)])
        if shared:
            # A decision reads them before the next call: copies of every root (half
            # of a Hyperband study's trials are ready at once) per decision would make
            # its cost grow with the study.
            return StageTree(
                None,
                self._all.stages,
                covered,
                self._nodes,
                ready=self._ready.stages,
                waiting=self._waiting.stages,
            )
        return StageTree(
            None,
            list(self._all.stages),
            covered,
            self._nodes,
            ready=list(self._ready.stages),
            waiting=list(self._waiting.stages),
        )

    @property
    def ready_roots(self) -> list[Stage]:
        """The ready roots of the last :meth:`tree`, in root order: the forest's own
        list (no copy; the next :meth:`tree` changes it), kept as plan trees are built
        again (read it, never change it)."""
        return self._ready.stages

    def _shrink(self) -> None:
        """Make the per-tree tables that emptied small again: a dict keeps the table
        of its peak size (random search has every trial live at once), and a plan tree
        whose work ended has no entry left in them."""
        if not self._requests:
            self._requests = {}
            self._anchors = {}  # a cache: nothing live to look up again soon
        if not self._parts:
            self._parts, self._covered = {}, {}
        if not self._positions:
            self._positions = {}
        if not self._promises:
            self._promises = {}
        if not self._batches:
            self._batches = {}

    def _rebuild(
        self,
        root_key: int,
        running: Iterable[RunningPosition],
        promised: set[Key],
        memory: set[Key],
        cost: Callable[[Node], float],
        version: Any,
    ) -> None:
        """Build the stage tree of group ``root_key`` (an anchor's id) again, unless the
        build would read what the kept one read (a running batch moved between the steps
        the build asks about)."""
        running = tuple(running)
        requests = tuple(k for k in self._requests.get(root_key, ()) if k not in promised)
        checkpoints = memory.union(self._checkpoints.get(root_key, ()))
        old = self._parts.get(root_key)
        if old is not None and requests == old.requests:
            if old.queries is None or old.answers is None:
                old.queries = _queries(self._nodes, requests)
                old.answers = available_at(self._nodes, old.queries, *old.read)
            answers = available_at(self._nodes, old.queries, checkpoints, running)
            if answers == old.answers or self._settle(old, old.answers, answers):
                return
        if old is not None:
            del self._parts[root_key]
            self._tally(old, -1)
            for root in old.roots:
                self._all.remove(root)
                if root.origin is None or root.origin.ready:
                    self._ready.take(root)
                else:
                    self._waiting.remove(root)
        self._covered.pop(root_key, None)
        if not requests:
            if not self._requests.get(root_key, True):
                del self._requests[root_key]
            return
        self._builds += 1
        built = build_stage_tree(self._nodes, requests, checkpoints, running, cost)
        by_node: dict[int, list[Stage]] = {}
        steps: dict[int, int] = {}  # per node, in ``by_node``'s order
        for stage in built.stages:
            node = stage.node
            group = by_node.get(node)
            if group is None:
                by_node[node] = [stage]
                steps[node] = stage.stop - stage.start
            else:
                group.append(stage)
                steps[node] += stage.stop - stage.start
        part = self._parts[root_key] = _Part(built.roots, built.covered, version, by_node)
        part.count = len(built.stages)
        part.requests, part.read = requests, (checkpoints, running)
        self._weigh(part, list(steps.values()))
        self._tally(part, 1)
        if built.covered:
            self._covered[root_key] = built.covered
        for root in built.roots:
            self._all.add(root)
            if root.origin is None or root.origin.ready:
                self._ready.put(root, self._dense(root))
            else:
                self._waiting.add(root)

    def _settle(
        self, part: _Part, before: list[Origin | None], answers: list[Origin | None]
    ) -> bool:
        """Update ``part`` in place where ``answers`` differ from its own only in models
        of running batches that are now durable checkpoints at the same positions (and
        not requested themselves): its roots waiting there become ready, from the
        checkpoint, as a build gives them. False: another change (build again)."""
        durable: dict[Origin, Origin] = {}
        for was, now in zip(before, answers):
            if was != now:
                if (
                    was is None
                    or now is None
                    or was.kind != RUNNING
                    or now.kind != CHECKPOINT
                    or (was.node, was.step) != (now.node, now.step)
                ):
                    return False
                durable[was] = now
        requested = set(part.requests)
        if any((o.node, o.step) in requested for o in durable):
            return False  # a covered request becomes an evaluation from the checkpoint
        for root in part.roots:
            now = durable.get(root.origin) if root.origin is not None else None
            if now is not None:
                self._waiting.remove(root)
                root.origin = now
                self._ready.put(root, self._dense(root))
        part.answers = answers
        self._settled += 1
        return True

    def held_starts(self, held: Collection[Key]) -> tuple[set[Key], list[Stage]]:
        """Of the models ``held`` (by idle workers), those some ready root starts from
        as a durable checkpoint; and those roots, in root order."""
        origins = self._ready.origins
        if len(held) > len(origins):  # walk the smaller side (held may be every worker)
            starts = {k for k in origins if k in held}
        else:
            starts = {k for k in held if k in origins}
        roots = [r for k in starts for r in origins[k]]
        roots.sort(key=self._ready.index)
        return starts, roots

    def _dense(self, root: Stage) -> int:
        return -1 if self._estimator is None else self._index(root.node)

    def _index(self, node: int) -> int:
        """``node``'s dense index in the estimator (there must be one), with room for it
        in the kept steps per node."""
        got = self._dense_of.get(node)
        if got is None:
            assert self._estimator is not None
            got = self._dense_of[node] = self._estimator.index(self._nodes[node])
            size = len(self._steps_at)
            if got >= size:
                grown = np.zeros(max(2 * size, got + 1))
                grown[:size] = self._steps_at
                self._steps_at = grown
        return got

    def _reindex(self, estimator: Estimator | None) -> None:
        """Dense indices of the ready roots and of every part's nodes in ``estimator``
        (another one than before)."""
        self._estimator = estimator
        self._dense_of.clear()
        self._epoch_of = object()  # another estimator: no kept value is current
        self._ready.dense = array("q", [self._dense(r) for r in self._ready.stages])
        self._steps_at[:] = 0.0
        self._changes += 1
        for part in self._parts.values():
            self._weigh(part)
            self._add_steps(part, 1)

    def _weigh(self, part: _Part, steps: list[int] | None = None) -> None:
        """``part``'s steps per plan node (``steps``, when known, in ``by_node``'s
        order) and their dense indices in the estimator."""
        if self._estimator is None:
            part.steps = part.dense = None
            return
        by_node = part.by_node
        if steps is None:
            steps = [sum(s.stop - s.start for s in stages) for stages in by_node.values()]
        dense_of = self._dense_of
        index = [dense_of.get(n) for n in by_node]
        if None in index:
            index = [self._index(n) for n in by_node]
        part.dense = np.array(index, dtype=np.int64)
        part.steps = np.array(steps, dtype=np.float64)

    def _tally(self, part: _Part, sign: int) -> None:
        """Count ``part``'s stages and steps in (``sign`` 1) or out (-1) of the work."""
        self._count += sign * part.count
        self._changes += 1
        self._add_steps(part, sign)

    def _add_steps(self, part: _Part, sign: int) -> None:
        if part.dense is None or part.steps is None:
            return
        if len(part.dense) <= _FEW:
            # A trial's own tree has a node or two: element by element is cheaper than
            # fancy indexing, and the same sums (whole numbers, exact either way).
            at = self._steps_at
            for i, steps in zip(part.dense.tolist(), part.steps.tolist()):
                at[i] += sign * steps
            return
        # A part's nodes are distinct: one index each, no repeated index to add up.
        self._steps_at[part.dense] += sign * part.steps

    def work(self) -> tuple[float, float]:
        """The remaining work (the sum of every stage's cost at the estimator's current
        predictions) and a bound on how far it may be from that sum added up stage by
        stage in any order (each sum of n terms rounds by at most n units in the last
        place of the total; this one and that one together, with a margin of 4).

        Array work over the plan nodes with stages (no walk of the stages); kept until
        the estimator's version or the forest changes. Needs the estimator of the last
        :meth:`tree` (with dense indices).
        """
        estimator = self._estimator
        assert estimator is not None
        at = (estimator.version, self._changes)
        if self._work_at != at:
            live = np.flatnonzero(self._steps_at)
            total = float(self._steps_at[live] @ estimator.cost_array(live)) if len(live) else 0.0
            self._work = (total, len(live))
            self._work_at = at
        total, terms = self._work
        return total, (self._count + terms + 4) * 2.0**-51 * total

    def _recost(
        self,
        cost: Callable[[Node], float],
        version: Any,
        costs: Callable[[list[Node]], list[float]] | None = None,
        parts: Iterable[_Part] | None = None,
    ) -> None:
        """Costs of every stage (of ``parts``: default all) from the estimator's current
        predictions (as a build computes them: steps times the node's cost per step)."""
        nodes = self._nodes
        stale = [
            part
            for part in (self._parts.values() if parts is None else parts)
            if version is None or part.version != version
        ]
        if costs is None:
            costs = lambda ns: [float(cost(n)) for n in ns]  # noqa: E731
        groups = [stages for part in stale for stages in part.by_node.values()]
        per_step = costs([nodes[stages[0].node] for stages in groups])
        for stages, c in zip(groups, per_step):
            c = float(c)
            for stage in stages:
                stage.cost = (stage.stop - stage.start) * c
        for part in stale:
            part.version = version
            part.values.clear()

    def ensure_costs(self) -> None:
        """Compute the costs a lazy :meth:`tree` left as they were."""
        if self._pending is not None:
            cost, version, costs = self._pending
            self._recost(cost, version, costs)
            self._version = version
            self._pending = None

    def _part_of(self, root: Stage) -> _Part:
        return self._parts[self._anchor(root.node)]

    def _costed(self, part: _Part) -> None:
        """``part``'s costs current (after a lazy :meth:`tree`)."""
        if self._pending is not None:
            cost, version, costs = self._pending
            self._recost(cost, version, costs, [part])

    def _deep_value(self, root: Stage) -> tuple[float, int]:
        """Best (cost, steps) from ``root`` (with children) down, as
        :func:`~stagetree.stages.critical_path` computes it; kept per part until its
        costs change."""
        part = self._part_of(root)
        self._costed(part)
        got = part.values.get(id(root))
        if got is None:
            best = path_values([root])
            got = part.values[id(root)] = best[id(root)]
        return got

    def _deep_values(self, roots: list[Stage]) -> list[tuple[float, int]]:
        """:meth:`_deep_value` of each of ``roots`` at the estimator's current
        predictions: by a walk where their plan trees hold few stages (a grid's tree of
        a few dozen: the arrays' set-up costs more than the walk), else
        :meth:`_deep_arrays`."""
        parts = {id(part): part for part in map(self._part_of, roots)}
        if sum(part.count for part in parts.values()) <= _FEW_STAGES:
            return [self._deep_value(root) for root in roots]
        return self._deep_arrays(roots)

    def _deep_arrays(self, roots: list[Stage]) -> list[tuple[float, int]]:
        """:meth:`_deep_value` of each of ``roots`` at the estimator's current
        predictions, as array work over all their stages at once (their parts' stage
        costs are left for :meth:`_costed`): the same floats as
        :func:`~stagetree.stages.path_values` (a stage's cost is its steps times its
        node's prediction, and its value its cost plus the greatest (cost, steps) of its
        children's, level by level from the leaves up). Needs the estimator's dense
        indices."""
        estimator = self._estimator
        assert estimator is not None
        if not roots:
            return []
        parts = [self._part_of(root) for root in roots]
        shapes = []
        for root, part in zip(roots, parts):
            shape = part.shapes.get(id(root))
            if shape is None:
                local = {node: i for i, node in enumerate(part.by_node)}
                shape = part.shapes[id(root)] = _shape(root, local)
            shapes.append(shape)
        sizes = [len(shape[1]) for shape in shapes]
        starts = np.zeros(len(shapes), dtype=np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        dense = np.concatenate(
            [part.dense[shape[0]] for part, shape in zip(parts, shapes)]  # type: ignore[index]
        )
        steps = np.concatenate([shape[1] for shape in shapes])
        parent = np.concatenate([shape[2] for shape in shapes])
        height = np.concatenate([shape[3] for shape in shapes])
        cost = steps * estimator.cost_array(dense)
        value, count = cost + 0.0, steps.copy()
        child = np.flatnonzero(parent >= 0)
        above = parent[child] + np.repeat(starts, sizes)[child]
        level = height[above]
        for h in range(1, int(height.max()) + 1):
            at = level == h
            kids, up = child[at], above[at]
            # The greatest (cost, steps) of each parent's children: last in its group.
            order = np.lexsort((count[kids], value[kids], up))
            kids, up = kids[order], up[order]
            last = np.append(up[1:] != up[:-1], True)
            kids, up = kids[last], up[last]
            value[up] = cost[up] + value[kids]
            count[up] = steps[up] + count[kids]
        return list(zip(value[starts].tolist(), count[starts].astype(np.int64).tolist()))

    def _length(self, root: Stage) -> float:
        """The longest path's cost from ``root`` down, as ``CriticalPathPolicy._paths``
        computes it (the same floats as :func:`~stagetree.stages.path_values`)."""
        if root.children:
            return self._deep_value(root)[0]
        self._costed(self._part_of(root))
        return root.cost + 0.0

    def critical_path(
        self,
        tree: StageTree,
        ready: list[Stage],
        first: list[Stage],
        policy: CriticalPathPolicy | None = None,
    ) -> list[Stage] | None:
        """``critical_path(tree, first + rest)`` without walking every root: ``ready``
        is the last :meth:`tree`'s ready roots, ``first`` some of them (in root order)
        and ``rest`` the others. Leaves' values come from the estimator as arrays,
        those of roots with children from the kept parts.

        ``policy``: the path as that policy runs it (``policy.choose(tree, first +
        rest)``), its depth-bound cut decided on the kept work and root values.

        None: not possible here (no estimator with dense indices, or ``version`` is
        None), or the kept work is too close to where the cut changes its answer to
        tell (:meth:`work`'s slack): ask the policy on the whole tree.
        """
        if self._estimator is None or self._estimator.version is None:
            return None
        if not ready:
            return []
        r = self._ready
        if len(ready) != len(r.stages):
            return None
        held = len(first)
        steps = r.numpy(r.steps)
        per_step = self._estimator.cost_array(r.numpy(r.dense))
        cost = steps * per_step
        cost += 0.0  # no -0.0 (as a walk's sums give)
        if r.deeps:
            deep = r.numpy(r.deep).astype(bool)
            # The estimator version the stages' costs are (or will be) computed at.
            at = self._version if self._pending is None else self._pending[1]
            if at != self._epoch_of:
                self._epoch += 1
                self._epoch_of = at
            epoch = self._epoch
            todo = np.flatnonzero(deep & (r.numpy(r.stamp) != epoch)).tolist()
            for i, value in zip(todo, self._deep_values([r.stages[i] for i in todo])):
                r.value[i], r.value_steps[i] = value
                r.stamp[i] = epoch
            cost = np.where(deep, r.numpy(r.value), cost)
            steps = np.where(deep, r.numpy(r.value_steps), steps)
        # The roots' values before the held ones are set aside (only they change cost).
        values = cost.copy() if policy is not None and held else cost
        chosen: Stage | None = None
        top: tuple[float, int] | None = None
        if held:
            at = [r.index(root) for root in first]
            for i in at:
                v = (float(cost[i]), int(steps[i]))
                if top is None or v > top:
                    chosen, top = r.stages[i], v
            cost[at] = -np.inf
        if held < len(ready):
            if not r.deeps and len(r.lengths) == 1:
                # Leaves of one length: a tie on cost is one on steps too, the first
                # of the greatest wins.
                i = int(np.argmax(cost))
            else:
                m = cost.max()
                tied = np.flatnonzero(cost == m)
                if len(tied) > 1:
                    s = steps[tied]
                    tied = tied[s == s.max()]
                i = int(tied[0])
            v = (float(cost[i]), int(steps[i]))
            if top is None or v > top:
                chosen = r.stages[i]
        assert chosen is not None
        self._costed(self._part_of(chosen))
        path = critical_path(tree, [chosen])
        if policy is None or not policy.may_cut(path):
            return path
        # The depth-bound cut's inputs, as CriticalPathPolicy._paths finds them on the
        # whole tree: the longest path from every root (ready and waiting), from every
        # root but the chosen one, and the remaining work.
        i = r.index(chosen)
        own = float(values[i])
        values[i] = -np.inf
        other = max(float(values.max()), 0.0)
        for root in self._waiting.stages:
            other = max(other, self._length(root))
        work, slack = self.work()
        return policy.cut(path, max(other, own), other, work, slack)
