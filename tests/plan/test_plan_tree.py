"""The pure insertion walk (stagetree.plan.tree) and its caches, without storage."""

from __future__ import annotations

import itertools

import pytest
from plan_helpers import grid

import stagetree.plan
from stagetree.exceptions import InvalidTrialError
from stagetree.hp import Constant, Cosine, MultiStep, Piecewise, Sequence, dumps_hp, loads_hp
from stagetree.plan._seqcache import SeqCache
from stagetree.plan.model import Node
from stagetree.plan.tree import TreeIndex, check_items, insert, is_canonical, walk


class Ids:
    def __init__(self) -> None:
        self.next = 1

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def test_public_names() -> None:
    assert sorted(stagetree.plan.__all__) == sorted(
        [
            "SCHEMA_VERSION",
            "ActivityRecord",
            "BasePlanStorage",
            "CheckpointRecord",
            "Insertion",
            "MemoryPlanStorage",
            "Node",
            "PlanKeyError",
            "Request",
            "RequestError",
            "RequestState",
            "SQLPlanStorage",
            "open_storage",
        ]
    )
    for name in stagetree.plan.__all__:
        assert hasattr(stagetree.plan, name)


def test_walk_segments_give_canonical_steps() -> None:
    tree, ids = TreeIndex("r"), Ids()
    root = insert(tree, {"lr": Constant(0.1)}, 30, ids).node
    child = insert(tree, {"lr": MultiStep(0.1, [10], 0.1)}, 30, ids).node
    grand = insert(tree, {"lr": MultiStep(0.1, [10, 20], 0.1)}, 30, ids).node
    w = walk(tree, {"lr": MultiStep(0.1, [10, 20], 0.1)}, 30)
    # Root holds steps 0..10, the child 11..20, the grandchild 21..30.
    assert w.segments == ((root, 0, 10), (child, 11, 20), (grand, 21, 30))
    assert (w.end, w.diverge) == (grand, None)
    off = walk(tree, {"lr": MultiStep(0.1, [10, 25], 0.5)}, 30)
    assert (off.end, off.diverge) == (None, 10)
    assert off.segments == ((root, 0, 10),)
    assert walk(TreeIndex("empty"), {"lr": Constant(0.1)}, 3).segments == ()


def test_insert_creates_at_most_one_node() -> None:
    tree, ids = TreeIndex("r"), Ids()
    for hp, steps in grid(40):
        before = len(tree)
        ins = insert(tree, hp, steps, ids)
        assert len(tree) - before == len(ins.new_nodes) <= 1
        assert walk(tree, hp, steps).end == ins.node


def test_children_lookup_by_value() -> None:
    # Numbers by value (1 == 1.0), a bool apart (issue 25).
    tree, ids = TreeIndex("r"), Ids()
    insert(tree, {"bs": Constant(16)}, 10, ids)
    a = insert(tree, {"bs": Piecewise([16, 1], [4])}, 10, ids)
    b = insert(tree, {"bs": Piecewise([16, 1.0], [4])}, 10, ids)
    c = insert(tree, {"bs": Piecewise([16, True], [4])}, 10, ids)
    assert a.node == b.node != c.node
    assert tree.children(1) == [a.node, c.node]


def test_index_rejects_duplicates_and_orphans() -> None:
    tree = TreeIndex("r")
    tree.add(Node(1, "r", None, 0, {"lr": Constant(0.1)}))
    tree.add(Node(2, "r", 1, 5, {"lr": MultiStep(0.1, [5], 0.1)}))
    with pytest.raises(ValueError, match="duplicates sibling 2"):
        tree.add(Node(3, "r", 1, 5, {"lr": MultiStep(0.1, [5, 8], 0.1)}))
    with pytest.raises(ValueError, match="parent 9"):
        tree.add(Node(4, "r", 9, 5, {"lr": Constant(0.1)}))
    with pytest.raises(ValueError, match="already has root"):
        tree.add(Node(5, "r", None, 0, {"lr": Constant(0.1)}))
    with pytest.raises(ValueError, match="belongs to"):
        tree.add(Node(6, "other", 1, 5, {"lr": Constant(0.1)}))


def test_discard_after_undoes_nodes() -> None:
    tree, ids = TreeIndex("r"), Ids()
    insert(tree, {"lr": Constant(0.1)}, 10, ids)
    mark = tree.last_id
    new = insert(tree, {"lr": Constant(0.2)}, 10, ids)
    tree.discard_after(mark)
    assert list(tree.nodes) == [1] and tree.last_id == 1 and tree.children(1) == []
    assert walk(tree, {"lr": Constant(0.2)}, 10).end is None
    again = insert(tree, {"lr": Constant(0.2)}, 10, ids)
    assert again.new_nodes[0].id != new.node  # fresh id; the old one was never stored
    tree.discard_after(0)
    assert tree.root is None and tree.names is None and len(tree) == 0


def test_check_items_validates_the_whole_batch() -> None:
    tree = TreeIndex("r")
    with pytest.raises(InvalidTrialError, match=r"missing \['b'\]"):
        check_items(tree, [({"a": Constant(1), "b": Constant(2)}, 3), ({"a": Constant(1)}, 3)])
    out = check_items(tree, [({"a": 1}, 3)])
    assert out == [({"a": Constant(1)}, 3)]


def test_is_canonical() -> None:
    root = Node(1, "r", None, 0, {})
    child = Node(2, "r", 1, 0, {})
    later = Node(3, "r", 1, 7, {})
    assert is_canonical(root, 0) and is_canonical(root, 1)
    assert not is_canonical(child, 0) and is_canonical(child, 1)
    assert not is_canonical(later, 7) and is_canonical(later, 8)


@pytest.mark.parametrize(
    "hp",
    [
        {"lr": MultiStep(0.1, [100], 0.1), "bs": Constant(32), "opt": Constant("sgd")},
        {"x": Piecewise([1, 2.5, True], [3, 9]), "y": Cosine(0.1, 50)},
        {"z": Constant(0.1).then(Constant(0.01), 30)},
        {},
    ],
)
def test_seqcache_codec_matches_hp_codec(hp: dict[str, Sequence]) -> None:
    cache = SeqCache()
    text = cache.encode_hp(hp)
    assert text == dumps_hp(hp)
    assert cache.encode_hp(hp) == text  # cached path
    assert cache.decode_hp(text) == loads_hp(text) == hp


def test_seqcache_interns_and_memoises() -> None:
    cache = SeqCache(max_entries=10)
    a = cache.decode_hp(dumps_hp({"lr": Constant(0.1)}))["lr"]
    b = cache.decode_hp(dumps_hp({"lr": Constant(0.1), "bs": Constant(1)}))["lr"]
    assert a is b
    assert cache.value(Constant(1), 3) == (int, 1)
    assert cache.value(Constant(1.0), 3) == (int, 1)  # canonical (issue 25)
    assert cache.value(Constant(1.5), 3) == (float, 1.5)
    x, y = MultiStep(0.1, [7], 0.1), Constant(0.1)
    assert cache.first_difference(x, y, 20) == 7
    assert cache.first_difference(x, y, 7) is None
    # Filling past max_entries clears everything and keeps answering right.
    seqs = [Constant(i + 0.5) for i in range(30)]
    for s, t in itertools.pairwise(seqs):
        assert cache.first_difference(s, t, 5) == 0
        assert cache.value(s, 0) == (float, s(0))
    assert cache.first_difference(x, y, 20) == 7


def test_seqcache_decodes_many_texts_each_caller_its_own_dicts() -> None:
    """A bulk decode (a study's trial rows) with repeated, known and new texts: each
    row gets its own dict (changing one changes no other, nor the cache), equal
    sequences one object, and a cache filled past its bound keeps answering right."""
    cache = SeqCache(max_entries=4)
    texts = [dumps_hp({"lr": Constant(i / 8), "bs": Constant(32)}) for i in range(6)]
    first = cache.decode_hp_many(texts[:2])
    rows = cache.decode_hp_many([texts[0], texts[2], texts[0], *texts[3:], texts[1]])
    assert [loads_hp(t) for t in (texts[0], texts[2], texts[0], *texts[3:], texts[1])] == rows
    assert rows[0] is not rows[2] and rows[0] is not first[0]
    assert rows[0]["bs"] is rows[1]["bs"] and rows[0]["lr"] is rows[2]["lr"]
    rows[0]["lr"] = Constant(9)
    assert cache.decode_hp_many([texts[0]]) == [loads_hp(texts[0])]
    assert cache.decode_hp_many([]) == []


def test_legacy_siblings_spelled_apart_load_and_share() -> None:
    # A plan written while 1 and 1.0 were different values holds both as siblings: it
    # still loads, new trials walk into the older one, the other keeps its trials.
    tree = TreeIndex("r")
    tree.add(Node(1, "r", None, 0, {"bs": Constant(16)}))
    tree.add(Node(2, "r", 1, 4, {"bs": Piecewise([16, 1], [4])}))
    tree.add(Node(3, "r", 1, 4, {"bs": Piecewise([16, 1.0], [4])}))
    assert len(tree) == 3 and tree.children(1) == [2]
    assert walk(tree, {"bs": Piecewise([16, 1.0], [4])}, 10).end == 2
    tree.discard_after(2)  # undoing node 3 keeps node 2 the walk's child
    assert tree.children(1) == [2]
    assert walk(tree, {"bs": Piecewise([16, 1], [4])}, 10).end == 2
