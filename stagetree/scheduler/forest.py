"""The scheduler's stage tree, kept between decisions one plan tree at a time.

A stage tree is a forest whose parts never mix plan trees: a request's path, the
checkpoints and running positions it may start from all lie in its own plan tree
(one root key). :class:`StageForest` keeps the stage tree of each plan tree built
(:func:`stagetree.stages.build_stage_tree` over that tree's inputs only) and builds
again only the plan trees whose inputs changed since the last decision:

* live requests and durable checkpoints, which the scheduler reports as they come and
  go (:meth:`StageForest.add_request`, ...);
* what running and saving batches contribute (their positions, promised evaluations,
  pending checkpoints, models idle workers hold): few, so compared per plan tree at
  every decision.

The roots of all plan trees stay sorted in one list (the order a whole build gives
them), and the stages' costs are computed again only when the cost estimator's
predictions may have moved. The result equals a whole build over every input: the same
stages, roots, covered requests, order and costs (``tests/stages/test_forest.py``
checks it against :func:`~stagetree.stages.build_stage_tree`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.plan.model import Node
from stagetree.stages import Covered, RunningPosition, Stage, StageTree, build_stage_tree

__all__ = ["StageForest"]

Key = tuple[int, int]
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

    def add(self, stage: Stage) -> None:
        key = _order(stage)
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.stages.insert(i, stage)

    def remove(self, stage: Stage) -> None:
        i = bisect_left(self.keys, _order(stage))
        assert self.stages[i] is stage
        del self.keys[i]
        del self.stages[i]


@dataclass
class _Part:
    """The built stage tree of one plan tree."""

    roots: list[Stage]
    covered: list[Covered]
    version: Any
    # Stages by plan node, for computing costs again.
    by_node: dict[int, list[Stage]] = field(default_factory=dict)


class StageForest:
    """The stage tree of a scheduler's state, kept per plan tree (see the module
    docstring).

    Args:
        nodes: the scheduler's plan nodes by id (the same mapping, kept up to date).
    """

    def __init__(self, nodes: Mapping[int, Node]) -> None:
        self._nodes = nodes
        # Live requests per root key: request -> sequence number (the order of the
        # scheduler's live requests, which a whole build iterates).
        self._requests: dict[str, dict[Key, int]] = {}
        self._seq: dict[Key, int] = {}
        self._next = 0
        self._checkpoints: dict[str, set[Key]] = {}
        # Checkpoints not checked yet (a whole build refuses an unknown node or a
        # position that is not canonical, and so does the next decision).
        self._unchecked: set[Key] = set()
        self._version: Any = None  # of the estimator, when every cost was last computed
        self._dirty: set[str] = set()
        self._parts: dict[str, _Part] = {}
        self._covered: dict[str, list[Covered]] = {}
        self._volatile: dict[str, Any] = {}  # last signature of keys with running work
        self._all = _Sorted()
        self._ready = _Sorted()
        self._waiting = _Sorted()

    # -- inputs ----------------------------------------------------------------------

    def _root_key(self, node: int) -> str:
        return self._nodes[node].root_key

    def add_request(self, key: Key) -> None:
        """A new live request (the scheduler checked its node)."""
        root_key = self._root_key(key[0])
        self._requests.setdefault(root_key, {})[key] = self._next
        self._seq[key] = self._next
        self._next += 1
        self._dirty.add(root_key)

    def remove_request(self, key: Key) -> None:
        """A live request settled or was cancelled."""
        root_key = self._root_key(key[0])
        del self._requests[root_key][key]
        del self._seq[key]
        self._dirty.add(root_key)

    def add_checkpoint(self, key: Key) -> None:
        """A durable checkpoint."""
        self._unchecked.add(key)

    def remove_checkpoint(self, key: Key) -> None:
        """A checkpoint that is gone (lost, unreadable)."""
        self._unchecked.discard(key)
        node = self._nodes.get(key[0])
        if node is not None:
            self._checkpoints.get(node.root_key, set()).discard(key)
            self._dirty.add(node.root_key)

    # -- the tree --------------------------------------------------------------------

    def tree(
        self,
        running: Iterable[RunningPosition],
        promised: set[Key],
        memory: Iterable[Key],
        cost: Callable[[Node], float],
        version: Any,
    ) -> StageTree:
        """The stage tree of every live request not in ``promised``, from the durable
        checkpoints, the models in ``memory`` (counted as durable) and the ``running``
        positions; stage costs from ``cost``, whose predictions stay what they are
        while ``version`` does (None: they may change at any call).

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
            self._checkpoints.setdefault(node.root_key, set()).add(key)
            self._dirty.add(node.root_key)
        volatile: dict[str, tuple[list[RunningPosition], set[Key], set[Key]]] = {}

        def part(root_key: str) -> tuple[list[RunningPosition], set[Key], set[Key]]:
            got = volatile.get(root_key)
            if got is None:
                got = volatile[root_key] = ([], set(), set())
            return got

        for pos in running:
            if pos.segments or pos.saving:  # else it offers no position
                first = pos.segments[0][0] if pos.segments else pos.saving[0][0]
                part(self._root_key(first))[0].append(pos)
        for key in promised:
            part(self._root_key(key[0]))[1].add(key)
        for key in memory:
            part(self._root_key(key[0]))[2].add(key)
        signatures = {
            k: (tuple(r), frozenset(p), frozenset(m)) for k, (r, p, m) in volatile.items()
        }
        dirty = self._dirty
        for k in self._volatile.keys() | signatures.keys():
            if self._volatile.get(k) != signatures.get(k):
                dirty.add(k)
        self._volatile = signatures
        for root_key in dirty:
            running_k, promised_k, memory_k = volatile.get(root_key, ((), set(), set()))
            self._rebuild(root_key, running_k, promised_k, memory_k, cost, version)
        dirty.clear()
        if version is None or version != self._version:
            self._recost(cost, version)
            self._version = version
        covered = [c for cs in self._covered.values() for c in cs]
        if len(self._covered) > 1:
            covered.sort(key=lambda c: self._seq[(c.node, c.step)])
        return StageTree(
            None,
            list(self._all.stages),
            covered,
            self._nodes,
            ready=list(self._ready.stages),
            waiting=list(self._waiting.stages),
        )

    def _rebuild(
        self,
        root_key: str,
        running: Iterable[RunningPosition],
        promised: set[Key],
        memory: set[Key],
        cost: Callable[[Node], float],
        version: Any,
    ) -> None:
        old = self._parts.pop(root_key, None)
        if old is not None:
            for root in old.roots:
                self._all.remove(root)
                (self._ready if root.origin is None or root.origin.ready else self._waiting).remove(
                    root
                )
        self._covered.pop(root_key, None)
        requests = [k for k in self._requests.get(root_key, ()) if k not in promised]
        if not requests:
            if not self._requests.get(root_key, True):
                del self._requests[root_key]
            return
        checkpoints = self._checkpoints.get(root_key, set()) | memory
        built = build_stage_tree(self._nodes, requests, checkpoints, running, cost)
        by_node: dict[int, list[Stage]] = {}
        for stage in built.stages:
            by_node.setdefault(stage.node, []).append(stage)
        self._parts[root_key] = _Part(built.roots, built.covered, version, by_node)
        if built.covered:
            self._covered[root_key] = built.covered
        for root in built.roots:
            self._all.add(root)
            (self._ready if root.origin is None or root.origin.ready else self._waiting).add(root)

    def _recost(self, cost: Callable[[Node], float], version: Any) -> None:
        """Costs of every stage from the estimator's current predictions (as a build
        computes them: steps times the node's cost per step)."""
        nodes = self._nodes
        for part in self._parts.values():
            if version is not None and part.version == version:
                continue
            part.version = version
            for node, stages in part.by_node.items():
                c = float(cost(nodes[node]))
                for stage in stages:
                    stage.cost = (stage.stop - stage.start) * c
