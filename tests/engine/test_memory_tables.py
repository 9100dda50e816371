"""The engine's per-node and per-request tables (issue 24, item 3): the nodes known to
the scheduler are bits, and the tables of waiting submissions do not keep the size of
their peak once every submission is answered; a study's trial digests are one table;
the tree index keeps no (root key, names) tuple per tree."""

from __future__ import annotations

import sys
import tempfile

import pytest
from memory_helpers import simulated_study

from stagetree.distributions import LogUniform
from stagetree.engine.core import DigestIds, NodeIds, TreeKeys, trial_digest
from stagetree.space import RandomSpace
from stagetree.tuners import RandomSearch

TRIALS = 60


def test_node_ids_are_a_set_of_bits() -> None:
    ids = NodeIds()
    for node in (0, 1, 9, 4096, 2**40, -3):
        assert node not in ids
        ids.add(node)
        assert node in ids
    assert 2 not in ids and 8 not in ids and 10 not in ids and 2**40 + 1 not in ids
    assert "9" not in ids and None not in ids
    many = NodeIds()
    for node in range(1, 100_001):
        many.add(node)
    assert all(node in many for node in range(1, 100_001)) and 100_001 not in many
    # A set of 100,000 ints holds about 4 MiB; bits about 12 KiB (grown by half again).
    assert sys.getsizeof(many._bits) < 30_000


def test_waiting_tables_shrink_when_every_submission_is_answered() -> None:
    space = RandomSpace(hp={"lr": LogUniform(1e-3, 0.3)}, fixed={"wd": LogUniform(1e-5, 1e-3)})  # type: ignore[dict-item]
    tuner = RandomSearch(space, "accuracy", steps=4, num_trials=TRIALS, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        study = simulated_study(tmp)
        try:
            study.tune(tuner)  # every trial waits at once, then all are answered
            engine = study._engine
            assert engine._waiters == {} and engine._waiting_steps == {}
            assert sys.getsizeof(engine._waiters) == sys.getsizeof({})
            assert sys.getsizeof(engine._waiting_steps) == sys.getsizeof({})
            nodes = engine.scheduler._nodes
            assert len(nodes) >= TRIALS and all(engine.knows_node(n) for n in nodes)
            assert not engine.knows_node(max(nodes) + 1)
            # the tree index: one entry per tree, no (root key, names) tuple each
            keys = engine._tree_keys
            assert len(keys) == TRIALS and len(keys._by_names) == 1
            trees = next(iter(keys._by_names.values()))
            assert all(type(k) is str and type(v) is str for k, v in trees.items())
        finally:
            study.close()


def test_digest_ids_map_digests_to_trial_ids_in_a_table() -> None:
    ids = DigestIds()
    keys = [trial_digest((f'{{"wd": {i}}}', "{}")) for i in range(3000)]
    for tid, key in enumerate(keys):
        ids[key] = tid
    ids[keys[5]] = 7  # a key set again keeps one slot
    assert len(ids) == 3000 and ids.get(keys[5]) == 7 and keys[5] in ids
    assert all(ids.get(k) == t for t, k in enumerate(keys) if t != 5)
    assert ids.get(bytes(16)) is None and ids.get(bytes(16), -1) == -1
    assert sorted(ids) == sorted(keys)
    # A dict of 16-byte keys holds about 100 bytes a trial; the table at most 72.
    assert sys.getsizeof(ids._table) / len(ids) < 75
    for bad in (b"short", "x" * 16):
        with pytest.raises(TypeError):
            ids.get(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ids[keys[0]] = -1


def test_tree_keys_are_a_mapping_of_root_key_and_names() -> None:
    keys = TreeKeys()
    a, b = frozenset({"lr"}), frozenset({"lr", "bs"})
    keys[("r1", a)] = "r1"
    keys[("r2", a)] = "r2"
    keys[("r1", b)] = "t1"
    assert len(keys) == 3 and keys[("r1", b)] == "t1" and keys.get(("r3", a)) is None
    assert sorted(keys.items(), key=lambda kv: kv[1]) == [
        (("r1", a), "r1"),
        (("r2", a), "r2"),
        (("r1", b), "t1"),
    ]
    assert keys.pop(("r1", b), None) == "t1" and keys.pop(("r1", b), None) is None
    assert len(keys) == 2 and len(keys._by_names) == 1  # an emptied name set goes
