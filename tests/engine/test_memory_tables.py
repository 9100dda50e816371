"""The engine's per-node and per-request tables (issue 24, item 3): the nodes known to
the scheduler are bits, and the tables of waiting submissions do not keep the size of
their peak once every submission is answered; a study's trial digests are one table."""

from __future__ import annotations

import sys
import tempfile

import pytest
from memory_helpers import simulated_study

from stagetree.distributions import LogUniform
from stagetree.engine.core import DigestIds, NodeIds, trial_digest
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
