"""The driver's memory per trial (issue 24, item 3): the records a study keeps one of
per trial carry no per-instance ``__dict__``, and what the engine keeps per trial
shares what the trials have in common."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from stagetree.distributions import LogUniform
from stagetree.executors.simulated import SimulatedExecutor, SimulatedTrainer
from stagetree.hp import MultiStep
from stagetree.plan.model import Node
from stagetree.space import RandomSpace
from stagetree.study import Study
from stagetree.tuners import RandomSearch, Trial, TrialResult
from stagetree.tuners.base import Job

TRIALS = 12


def _study(tmp: str) -> tuple[Study, RandomSearch]:
    space = RandomSpace(
        hp={"lr": MultiStep(init=LogUniform(1e-3, 0.3), milestones=[4], gamma=0.1)},  # type: ignore[arg-type]
        fixed={"wd": LogUniform(1e-5, 1e-3)},
    )
    tuner = RandomSearch(space, "accuracy", steps=8, num_trials=TRIALS, seed=0)
    executor = SimulatedExecutor(4)
    study = Study(
        "mem",
        SimulatedTrainer,
        storage=f"sqlite:///{Path(tmp) / 'plan.db'}",
        workers=4,
        checkpoint_dir=str(Path(tmp) / "ckpt"),
        executor=lambda: executor,
    )
    study.tune(tuner)
    return study, tuner


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
