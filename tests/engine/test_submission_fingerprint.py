"""A submission's fingerprint (the key of its trial in the replay log and the budget's
count of trials) is computed once: the study's runner takes the one its tuner logged."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.distributions import Choice
from stagetree.hp import Constant
from stagetree.records import trial_fingerprint
from stagetree.space import RandomSpace
from stagetree.tuners import RandomSearch
from stagetree.tuners import base as tuner_base

SPACE = RandomSpace({"lr": Choice([0.001, 0.01, 0.1, 0.2])})


def test_a_submission_computes_its_fingerprint_once(monkeypatch: pytest.MonkeyPatch) -> None:
    computed: list[str] = []

    def counted(config: Any, hp: Any) -> str:
        computed.append(fp := trial_fingerprint(config, hp))
        return fp

    monkeypatch.setattr(tuner_base, "trial_fingerprint", counted)
    tuner = RandomSearch(SPACE, "loss", mode="min", steps=2, num_trials=4, seed=0)
    with Study("fp", LinearTrainer, storage="memory://", executor="simulated") as study:
        study.tune(tuner, budget="10 trials")  # a budget counts trials by fingerprint
        log = study.read_log()
        run = study.last_run
    submitted = [r["fp"] for r in log if r.get("event") == "submit"]
    assert len(submitted) == 4
    assert computed == submitted  # on main: twice each
    assert run is not None and run.trials == 4


def test_the_fingerprint_is_computed_for_other_dicts() -> None:
    config, hp = {"seed": 1}, {"lr": Constant(0.1)}
    want = trial_fingerprint(config, hp)

    async def main() -> list[str]:
        tuner_base.SUBMITTED.set((config, hp, "logged"))
        return [
            tuner_base.submitted_fingerprint(config, hp),
            tuner_base.submitted_fingerprint(dict(config), hp),  # equal, not the same
            tuner_base.submitted_fingerprint(config, dict(hp)),
        ]

    assert asyncio.run(main()) == ["logged", want, want]
    assert tuner_base.submitted_fingerprint(config, hp) == want  # outside that task
