"""The driver's memory per trial (issue 24, item 3): the records a study keeps one of
per trial carry no per-instance ``__dict__``, and what the engine keeps per trial
shares what the trials have in common."""

from __future__ import annotations

import gc
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

from stagetree.distributions import Choice, LogUniform, Uniform
from stagetree.executors.simulated import SimulatedExecutor, SimulatedTrainer
from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.model import Node
from stagetree.scheduler import cost
from stagetree.scheduler.cost import CostEstimator
from stagetree.space import RandomSpace
from stagetree.study import Study
from stagetree.tuners import ASHA, RandomSearch, Trial, TrialResult
from stagetree.tuners.base import Job

TRIALS = 12


def _study(tmp: str) -> tuple[Study, RandomSearch]:
    space = RandomSpace(
        hp={"lr": MultiStep(init=LogUniform(1e-3, 0.3), milestones=[4], gamma=0.1)},  # type: ignore[arg-type]
        fixed={"wd": LogUniform(1e-5, 1e-3)},
    )
    tuner = RandomSearch(space, "accuracy", steps=8, num_trials=TRIALS, seed=0)
    study = _open(tmp)
    study.tune(tuner)
    return study, tuner


def _open(tmp: str, storage: Any = None) -> Study:
    """A study on 4 simulated workers, its plan in SQLite under ``tmp`` by default."""
    executor = SimulatedExecutor(4)
    return Study(
        "mem",
        SimulatedTrainer,
        storage=f"sqlite:///{Path(tmp) / 'plan.db'}" if storage is None else storage,
        workers=4,
        checkpoint_dir=str(Path(tmp) / "ckpt"),
        executor=lambda: executor,
    )


def _slotted(obj: Any) -> bool:
    return not hasattr(obj, "__dict__")


def test_per_trial_records_have_no_instance_dict() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study, tuner = _study(tmp)
        try:
            assert len(tuner.results) == TRIALS
            assert all(_slotted(r) for _, r in tuner.results)
            assert all(_slotted(t) for t in tuner.trials.values())
            nodes = list(study._engine.scheduler._nodes.values())
            assert len(nodes) >= TRIALS and all(_slotted(n) for n in nodes)
        finally:
            study.close()


def test_records_kept_per_trial_are_slotted_classes() -> None:
    for cls in (TrialResult, Trial, Node, Job):
        assert "__slots__" in vars(cls), cls


def test_engine_keeps_one_copy_of_a_studys_hp_names() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study, _ = _study(tmp)
        try:
            keys = study._engine._tree_keys
            assert len(keys) == TRIALS  # a tree per fixed config
            assert len({id(names) for _, names in keys}) == 1
            # The tree's key is the root key itself, not a second equal string.
            assert all(tree is base for (base, _), tree in keys.items())
        finally:
            study.close()


# -- the cost estimator: per node a key (one per configuration) and array entries -----


def _nodes(n: int) -> list[Node]:
    """``n`` plan nodes of distinct configurations, four to a tree."""
    return [
        Node(
            10_000 + i,
            f"root{i // 4}",
            None,
            0,
            {
                "lr": Constant(0.1 * (1 + i % 997) / 997),
                "batch_size": Constant(128 + 128 * (i % 2)),
                "wd": Constant(1e-4 * (1 + i % 13)),
            },
        )
        for i in range(n)
    ]


def _estimator_bytes(n: int) -> int:
    """Bytes an estimator holds after seeing ``n`` nodes (a third measured) and
    predicting all of them (the nodes themselves made before counting)."""
    nodes = _nodes(n)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        est = CostEstimator()
        for r in range(n // 4 + 1):
            est.register_root(f"root{r}", {"depth": r % 3, "opt": "sgd"})
        for i, node in enumerate(nodes):
            est.index(node)
            if i % 3 == 0:
                est.observe(node, 0.01 * (1 + i % 7))
        est.costs(nodes)
        est._cache.clear()  # predictions, dropped at the next measurement anyway
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def test_the_cost_estimator_holds_well_under_a_kib_per_node() -> None:
    # Was about 2.1 KiB a node: a nested configuration key, a features dict, a key
    # cache entry and a list per key; now a flat key, array entries and an index.
    per_node = (_estimator_bytes(3000) - _estimator_bytes(1000)) / 2000
    assert per_node < 1200, per_node


def test_the_cost_estimator_keeps_one_key_per_configuration() -> None:
    est = CostEstimator()
    est.register_root("r", {"depth": 2})
    a = Node(1, "r", None, 0, {"lr": Constant(0.1)})
    b = Node(2, "r", 1, 4, {"lr": MultiStep(0.5, [4], 0.2)})  # 0.1 from step 4
    c = Node(3, "r", 1, 4, {"lr": Constant(0.2)})
    keys = est._dense_keys
    assert keys[est.index(a)] is keys[est.index(b)]
    assert keys[est.index(c)] != keys[est.index(a)]
    # (name, type name, value) per entry: one string per name and per type name
    assert keys[est.index(c)][3] is keys[est.index(a)][3] == "hp.lr"
    assert keys[est.index(c)][4] is keys[est.index(a)][4] == "float"
    est.observe(b, 0.5)
    assert est.cost(a) == est.cost(b) == 0.5


# -- the tuner's results and the engine's per-trial records -----------------------------


def test_results_share_their_trials_config_and_hp_and_history() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study, tuner = _study(tmp)
        try:
            for tid, result in tuner.results:
                trial = tuner.trials[tid]
                assert result.config is trial.config and result.hp is trial.hp
                # the metrics at the result's steps are its history's entry, not a copy
                assert result.metrics is result.history[result.steps]
        finally:
            study.close()


def test_the_engine_keeps_a_digest_per_trial_and_one_root_key_string() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study, tuner = _study(tmp)
        try:
            engine, slot = study._engine, study._study_slot
            assert len(slot.trial_ids) == TRIALS
            assert all(isinstance(k, bytes) and len(k) == 16 for k in slot.trial_ids)
            trial = tuner.trials[0]
            config, hp = dict(trial.config), dict(trial.hp)
            assert slot.root_key(config, hp) is slot.root_key(dict(config), dict(hp))
            assert engine._root_trainers == {}  # every tree is the default trainer's
        finally:
            study.close()


def test_asha_trees_share_one_set_of_saved_steps() -> None:
    space = RandomSpace(hp={"lr": LogUniform(1e-3, 0.3)}, fixed={"wd": LogUniform(1e-5, 1e-3)})  # type: ignore[dict-item]
    tuner = ASHA(space, "accuracy", min_steps=2, max_steps=8, num_trials=TRIALS, eta=2, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        study = _open(tmp)
        try:
            study.tune(tuner)
            saves = study._engine._root_saves
            assert len(saves) == TRIALS
            assert len({id(steps) for steps in saves.values()}) == 1
        finally:
            study.close()


# -- the four modules together, per trial -------------------------------------------------

_MODULES = ("scheduler/cost.py", "engine/core.py", "study.py", "tuners/base.py")


def _module_bytes(n: int) -> int:
    """Bytes allocated on lines of ``_MODULES`` and alive at the end of an ``n``-trial
    random study (memory plan: the plan's own objects are the plan's modules')."""
    space = RandomSpace(
        hp={
            "lr": MultiStep(init=LogUniform(1e-3, 0.3), milestones=Choice([[4], [6]]), gamma=0.1),  # type: ignore[arg-type]
            "batch_size": Choice([Constant(128), Piecewise([128, 256], [5])]),
        },
        fixed={"wd": Uniform(0.0, 1e-3)},
    )
    tuner = RandomSearch(space, "accuracy", steps=8, num_trials=n, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        study = _open(tmp, MemoryPlanStorage())
        tracemalloc.start(1)
        try:
            study.tune(tuner)
            gc.collect()
            snap = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
            study.close()
    root = Path(cost.__file__).parent.parent  # the package
    filters = [tracemalloc.Filter(True, str(root / m)) for m in _MODULES]
    return sum(s.size for s in snap.filter_traces(filters).statistics("filename"))


def test_the_driver_modules_hold_a_bounded_number_of_bytes_per_trial() -> None:
    # The estimator, the engine, the study and the tuner held about 4.8 KB per trial
    # of this study; about 2.3 KB now (the plan's objects and the sequences' cache
    # are other modules').
    _module_bytes(10)  # imports and first-use caches
    per_trial = (_module_bytes(90) - _module_bytes(30)) / 60
    assert per_trial < 3500, per_trial
