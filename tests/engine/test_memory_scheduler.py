"""The scheduler's tables per plan tree (issue 24, item 3): equal save-step sets are one
object, a tree's config is a tuple (not a dict), a tree's durable checkpoints in the
stage forest a tuple (not a set), and the tables of live requests do not keep the size
of their peak once every request settled."""

from __future__ import annotations

import sys
import tempfile
from array import array
from typing import Any

from memory_helpers import reached_bytes, simulated_study

from stagetree.distributions import LogUniform
from stagetree.scheduler.core import Scheduler
from stagetree.scheduler.events import RootAdded
from stagetree.space import RandomSpace
from stagetree.tuners import ASHA, RandomSearch

TRIALS = 60


def _space() -> RandomSpace:
    return RandomSpace(hp={"lr": LogUniform(1e-3, 0.3)}, fixed={"wd": LogUniform(1e-5, 1e-3)})  # type: ignore[dict-item]


def test_per_tree_tables_hold_no_set_or_dict_per_tree() -> None:
    tuner = ASHA(_space(), "accuracy", min_steps=2, max_steps=8, num_trials=TRIALS, eta=2)
    with tempfile.TemporaryDirectory() as tmp:
        study = simulated_study(tmp)
        try:
            study.tune(tuner)
            engine = study._engine
            scheduler = engine.scheduler
            saves = scheduler._save_steps
            assert len(saves) >= TRIALS // 2
            # one frozenset object per distinct set of steps, shared by the trees
            assert len({id(s) for s in saves.values()}) == len(set(saves.values()))
            trees = len(scheduler._roots)
            assert trees >= TRIALS
            # What the tables reach that the plan, the estimator (the configs' values),
            # the nodes and the checkpoints' keys and references do not: about 700
            # bytes a tree with a dict, a frozenset and a set each; about 200 now.
            seen: set[int] = set()
            reached_bytes(
                [engine.storage, scheduler.estimator, scheduler._nodes, scheduler._checkpoints],
                seen,
            )
            seen.update(id(k) for k in scheduler._roots._rows)  # the root keys
            tables = [scheduler._roots, saves, scheduler._forest._checkpoints]
            assert reached_bytes(tables, seen) / trees < 300
        finally:
            study.close()


def test_configs_keep_the_config_as_it_came() -> None:
    scheduler = Scheduler(num_workers=1)
    value: list[int] = [1]
    config: dict[str, Any] = {"b": 2.5, "a": value, "c": "x"}
    scheduler.handle(RootAdded("r", config))
    scheduler.handle(RootAdded("s", {"b": 1.0, "a": 3, "c": "y"}))
    got = scheduler._roots.get("r")
    assert got == config and list(got) == ["b", "a", "c"] and got is not config
    assert got["a"] is value  # the values are kept, not copied (as before)
    got["b"] = 0.0  # a copy: what the caller does with it changes nothing kept
    assert scheduler._roots.get("r")["b"] == 2.5
    rows = scheduler._roots._rows
    assert rows["r"][0] is rows["s"][0]  # one tuple of names for both trees
    assert "r" in scheduler._roots and "t" not in scheduler._roots


def test_request_tables_shrink_when_every_request_settled() -> None:
    tuner = RandomSearch(_space(), "accuracy", steps=4, num_trials=TRIALS, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        study = simulated_study(tmp)
        try:
            study.tune(tuner)  # every trial is a live request at once, then all settle
            scheduler = study._engine.scheduler
            forest = scheduler._forest
            empty = sys.getsizeof({})
            for table in (
                scheduler._requests,
                scheduler._claims,
                forest._seq,
                forest._requests,
                forest._parts,
                forest._covered,
            ):
                assert table == {} and sys.getsizeof(table) == empty
            ready = forest._ready
            assert ready.stages == [] and ready.origins == {}
            for column in (ready.dense, ready.value, ready.stamp):
                assert len(column) == 0
                assert sys.getsizeof(column) == sys.getsizeof(array(column.typecode))
        finally:
            study.close()
