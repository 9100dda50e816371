"""The insertion walk of a plan tree, shared by every storage backend.

Pure code: a :class:`TreeIndex` is an in-memory view of one append-only tree; the
functions here read it and add nodes to it, and never perform I/O. A backend loads its
nodes into an index (incrementally: nodes only ever get added), runs :func:`insert` or
:func:`walk` on it inside its transaction, and persists the nodes the walk created.

Walk (sharing by value, DESIGN.md "Semantics"): at node ``N`` whose branch step is
``b``, ``d`` is the first step in ``[b, T)`` where the trial's values differ from
``N.hp``'s for any name. No difference: the trial ends in ``N`` (canonical
``(N, T)``). Otherwise the trial continues in the child of ``N`` that branches at ``d``
with the trial's values at ``d``; siblings branching at one step differ at that step,
so there is at most one such child. Without one the walk diverges: :func:`insert`
creates that child with the trial's ``hp``, which the trial then follows to ``T``, so
one insertion creates at most one node.

A node's ``hp`` agrees with its path before its branch step (it was created by a trial
that followed the path there), and so does a trial that reached the node. Hence a
difference on ``[0, T)`` between the two is a difference on ``[b, T)``, which lets the
walk memoise differences per pair of sequences over ``[0, T)``
(:class:`~stagetree.plan._seqcache.SeqCache`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stagetree.exceptions import InvalidSequenceError, InvalidTrialError
from stagetree.hp import Sequence, as_sequence, written_value
from stagetree.plan._seqcache import SeqCache
from stagetree.plan.model import Node, NodeLink

__all__ = [
    "MAX_STEPS",
    "Insertion",
    "TreeIndex",
    "Walk",
    "check_items",
    "check_steps",
    "check_trial",
    "curve_along",
    "insert",
    "is_canonical",
    "names_key",
    "path_segments",
    "walk",
]


@dataclass(frozen=True)
class Insertion:
    """Where an inserted trial ends.

    Attributes:
        node: canonical node of the trial's model after ``step`` steps.
        step: the trial's step count.
        new_nodes: nodes this insertion created (empty or one node).
    """

    node: int
    step: int
    new_nodes: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Walk:
    """Result of following a trial through existing nodes.

    Attributes:
        segments: ``(node, first, last)`` per node on the trial's path, root first: the
            steps ``first..last`` (inclusive) whose canonical node is ``node``.
        end: canonical node of the trial after all its steps; None when the path leaves
            the existing tree (or the tree is empty).
        diverge: when ``end`` is None and the tree is not empty, the step at which the
            trial leaves the last node of ``segments`` without a matching child.
    """

    segments: tuple[tuple[int, int, int], ...]
    end: int | None
    diverge: int | None


class TreeIndex:
    """In-memory view of one plan tree: nodes by id and children by branch point.

    Attributes:
        root_key: the tree's key.
        names: sorted hyper-parameter names of the tree (None while empty).
        root: the root node (None while empty).
        nodes: every node by id.
        last_id: largest node id in the index (0 while empty); backends refresh the
            index by loading nodes of this tree with a larger id.
    """

    def __init__(self, root_key: str, cache: SeqCache | None = None) -> None:
        self.root_key = root_key
        self.names: tuple[str, ...] | None = None
        self.root: Node | None = None
        self.nodes: dict[int, Node] = {}
        self.last_id = 0
        # parent id -> {(branch_step, values at branch_step): child id}
        self._children: dict[int, dict[tuple[int, tuple[Any, ...]], int]] = {}
        self.cache = cache if cache is not None else SeqCache()

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, node: Node) -> None:
        """Add a node whose parent (if any) is already in the index."""
        if node.root_key != self.root_key:
            raise ValueError(f"node {node.id} belongs to {node.root_key!r}, not {self.root_key!r}")
        if node.id in self.nodes:
            return
        if node.parent is None:
            if self.root is not None:
                raise ValueError(f"tree {self.root_key!r} already has root {self.root.id}")
            self.root = node
            self.names = tuple(sorted(node.hp))
        else:
            if node.parent not in self.nodes:
                raise ValueError(f"node {node.id}: parent {node.parent} is not in the index")
            key = (node.branch_step, self.values_at(node.hp, node.branch_step))
            siblings = self._children.setdefault(node.parent, {})
            if key in siblings:
                if not _spelled_apart(self.nodes[siblings[key]], node):
                    raise ValueError(
                        f"node {node.id} duplicates sibling {siblings[key]} at step "
                        f"{node.branch_step}"
                    )
                # A plan written while 1 and 1.0 were different values may hold both:
                # the older sibling is the one new trials walk into; the other keeps
                # serving the trials already on it (reached by its id).
            else:
                siblings[key] = node.id
        self.nodes[node.id] = node
        self.last_id = max(self.last_id, node.id)

    def add_all(self, nodes: Iterable[Node]) -> None:
        """Add nodes in id order (parents come before their children)."""
        for node in sorted(nodes, key=lambda n: n.id):
            self.add(node)

    def discard_after(self, last_id: int) -> None:
        """Forget nodes with an id above ``last_id`` (undo of a failed transaction)."""
        doomed = sorted((i for i in self.nodes if i > last_id), reverse=True)
        for node_id in doomed:
            node = self.nodes.pop(node_id)
            self._children.pop(node_id, None)
            if node.parent is None:
                self.root = None
                self.names = None
            else:
                siblings = self._children.get(node.parent, {})
                key = (node.branch_step, self.values_at(node.hp, node.branch_step))
                if siblings.get(key) == node_id:
                    siblings.pop(key)
        self.last_id = max(self.nodes, default=0)

    def values_at(self, hp: Mapping[str, Sequence], step: int) -> tuple[Any, ...]:
        """Values of ``hp`` at ``step`` in name order: ``(type, canonical value)`` pairs
        (``1`` and ``1.0`` are one value, ``True`` another; see ``stagetree.hp``)."""
        names = self.names if self.names is not None else tuple(sorted(hp))
        value = self.cache.value
        return tuple([value(hp[name], step) for name in names])

    def child(self, parent: int, step: int, values: tuple[Any, ...]) -> int | None:
        """The child of ``parent`` branching at ``step`` with ``values`` there, if any."""
        siblings = self._children.get(parent)
        return None if siblings is None else siblings.get((step, values))

    def children(self, parent: int) -> list[int]:
        """Ids of ``parent``'s children in id order."""
        return sorted(self._children.get(parent, {}).values())

    def path(self, node_id: int) -> list[Node]:
        """Nodes from the root to ``node_id``."""
        out: list[Node] = []
        current: int | None = node_id
        while current is not None:
            node = self.nodes[current]
            out.append(node)
            current = node.parent
        out.reverse()
        return out


#: The most steps a trial may have: a step is a 64-bit integer in every plan storage.
MAX_STEPS = 2**63 - 1


def check_steps(steps: Any, what: str = "steps") -> int:
    """``steps`` when it is an int in ``0..MAX_STEPS`` (not a bool).

    Raises:
        InvalidTrialError: naming ``what`` and the value.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS:
        shown = str(steps) if isinstance(steps, int) else repr(steps)
        raise InvalidTrialError(
            f"{what} must be a non-negative int (at most 2**63-1), got {shown:.60}"
        )
    return steps


def _spelled_apart(a: Node, b: Node) -> bool:
    """Whether two siblings with equal values at their branch step tell them apart by
    how a number is written there (``1`` and ``1.0``): distinct values to plans written
    before numbers were compared by value, so both can be in such a plan."""
    step = a.branch_step
    return any(
        type(written_value(a.hp[n], step)) is not type(written_value(b.hp[n], step)) for n in a.hp
    )


def check_trial(index: TreeIndex, hp: Mapping[str, Any], steps: int) -> dict[str, Sequence]:
    """Check that ``(hp, steps)`` fits the tree; returns ``hp`` with plain values turned
    into :class:`~stagetree.hp.Constant`.

    Raises:
        InvalidTrialError: bad ``steps``, a value that is not a sequence, or names that
            differ from the tree's.
    """
    check_steps(steps)
    if not isinstance(hp, Mapping):
        raise InvalidTrialError(f"hp must be a mapping of name -> Sequence, got {type(hp)}")
    out: dict[str, Sequence] = {}
    for name, value in hp.items():
        if not isinstance(name, str):
            raise InvalidTrialError(f"hyper-parameter names must be str, got {name!r}")
        if isinstance(value, Sequence):
            out[name] = value
            continue
        try:
            out[name] = as_sequence(value)
        except InvalidSequenceError as exc:
            raise InvalidTrialError(f"hyper-parameter {name!r}: {exc}") from None
    if index.names is not None and tuple(sorted(out)) != index.names:
        missing = sorted(set(index.names) - set(out))
        extra = sorted(set(out) - set(index.names))
        raise InvalidTrialError(
            f"hyper-parameter names differ from tree {index.root_key!r}: "
            f"missing {missing}, unexpected {extra}"
        )
    return out


def check_items(
    index: TreeIndex, items: Iterable[tuple[Mapping[str, Any], int]]
) -> list[tuple[dict[str, Sequence], int]]:
    """:func:`check_trial` over a batch, before anything is written: an empty tree takes
    the first item's names, which the others must match."""
    probe = TreeIndex(index.root_key)
    probe.names = index.names
    out = []
    for hp, steps in items:
        checked = check_trial(probe, hp, steps)
        if probe.names is None:
            probe.names = tuple(sorted(checked))
        out.append((checked, steps))
    return out


def walk(index: TreeIndex, hp: Mapping[str, Sequence], steps: int) -> Walk:
    """Follow a trial through the existing tree without changing it.

    Args:
        index: the tree.
        hp: the trial's sequences by name (checked with :func:`check_trial`).
        steps: the trial's step count.

    Returns:
        The path's segments, and where it ends or leaves the tree.
    """
    return _walk(index, check_trial(index, hp, steps), steps)


def _walk(index: TreeIndex, hp: Mapping[str, Sequence], steps: int) -> Walk:
    node = index.root
    if node is None:
        return Walk((), None, None)
    # The hot loop of insertion: cache look-ups are inlined (SeqCache's tables are keyed
    # by object ids; a miss goes through its methods, which fill them).
    cache = index.cache
    diffs, values = cache.diffs, cache.values
    names = index.names or ()
    trial = [(name, hp[name], id(hp[name])) for name in names]
    segments: list[tuple[int, int, int]] = []
    while True:
        b = node.branch_step
        first = 0 if node.parent is None else b + 1
        d: int | None = None
        if b < steps:
            node_hp = node.hp
            for name, seq, seq_id in trial:
                other = node_hp[name]
                if other is seq:
                    continue
                key = (id(other), seq_id, steps)
                e = diffs[key] if key in diffs else cache.first_difference(other, seq, steps)
                if e is not None and (d is None or e < d):
                    d = e
        if d is None:
            segments.append((node.id, first, steps))
            return Walk(tuple(segments), node.id, None)
        if d < b:
            # Node and trial both agree with the path before b (module docstring).
            raise AssertionError(f"trial differs from node {node.id} at step {d} < {b}")
        segments.append((node.id, first, d))
        at = []
        for _, seq, seq_id in trial:
            vkey = (seq_id, d)
            at.append(values[vkey] if vkey in values else cache.value(seq, d))
        nxt = index.child(node.id, d, tuple(at))
        if nxt is None:
            return Walk(tuple(segments), None, d)
        node = index.nodes[nxt]


def insert(
    index: TreeIndex,
    hp: Mapping[str, Sequence],
    steps: int,
    new_id: Callable[[], int],
    *,
    checked: bool = False,
) -> Insertion:
    """Insert a trial into the tree, creating at most one node.

    Args:
        index: the tree; a created node is added to it.
        hp: the trial's sequences by name.
        steps: the trial's step count.
        new_id: returns a fresh node id (called only when a node is created).
        checked: ``hp`` already went through :func:`check_trial` (skip it).

    Returns:
        The trial's canonical ``(node, steps)`` and the created nodes.

    Raises:
        InvalidTrialError: the trial's names differ from the tree's, or bad ``steps``.
    """
    if not checked:
        hp = check_trial(index, hp, steps)
    result = _walk(index, hp, steps)
    if result.end is not None:
        return Insertion(result.end, steps)
    if result.diverge is None:  # empty tree: the trial becomes the root
        node = Node(new_id(), index.root_key, None, 0, dict(hp))
    else:
        parent = result.segments[-1][0]
        node = Node(new_id(), index.root_key, parent, result.diverge, dict(hp))
    index.add(node)
    return Insertion(node.id, steps, (node,))


def names_key(root_key: str, names: Iterable[str]) -> str:
    """The key of the tree of trials with hyper-parameter ``names`` under ``root_key``
    (a trainer version and fixed config) when ``root_key``'s own tree has other names:
    a different name set is a different configuration, so it never shares."""
    text = f"{root_key}|hp-names|{json.dumps(sorted(names))}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def is_canonical(node: Node, step: int) -> bool:
    """Whether ``(node, step)`` is the canonical key of a model (``branch_step < step``,
    or the root at step 0)."""
    return step > node.branch_step or (node.parent is None and step == 0)


def path_segments(
    nodes: Mapping[int, Node] | Mapping[int, NodeLink], node: int, step: int
) -> list[tuple[int, int, int]]:
    """``(node, first, last)`` per node of the path that ends at the canonical
    ``(node, step)``, root first: the steps ``first..last`` (inclusive) whose model is
    keyed by that node (what :func:`walk` returns for the trial).

    Raises:
        KeyError: a node of the path is not in ``nodes``.
    """
    chain = [nodes[node]]
    while chain[-1].parent is not None:
        chain.append(nodes[chain[-1].parent])
    chain.reverse()
    out: list[tuple[int, int, int]] = []
    for i, n in enumerate(chain):
        first = 0 if n.parent is None else n.branch_step + 1
        last = chain[i + 1].branch_step if i + 1 < len(chain) else step
        if last >= first:
            out.append((n.id, first, last))
    return out


def curve_along(
    segments: Iterable[tuple[int, int, int]],
    metrics: Mapping[int, Mapping[int, Mapping[str, float]]],
    steps_of: dict[int, list[int]],
) -> dict[int, dict[str, float]]:
    """The metrics of a tree (``{node: {step: metrics}}``) on a path's ``segments``
    (:func:`path_segments`), by step, each a copy: what ``metrics_along`` gives for the
    trial that path ends. ``steps_of`` caches each node's sorted metric steps between
    calls (a reader cutting many paths from one read of a tree)."""
    out: dict[int, dict[str, float]] = {}
    for node, first, last in segments:
        points = metrics.get(node)
        if not points:
            continue
        steps = steps_of.get(node)
        if steps is None:
            steps = steps_of[node] = sorted(points)
        lo, hi = bisect.bisect_left(steps, first), bisect.bisect_right(steps, last)
        for step in steps[lo:hi]:
            out[step] = dict(points[step])
    return out
