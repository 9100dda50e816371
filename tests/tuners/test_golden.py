"""Golden decision traces: every tuner takes exactly the decisions it took when the
traces were recorded.

Each case runs a tuner against the fake runner of ``tuner_fakes`` (a deterministic
completion order per seed) and compares the whole log it wrote (submissions,
promotions, completions, stops, exploits, worker counts) and the best trial with
``golden/<case>.json``. The traces pin decisions while the tuners' bookkeeping is made
incremental; set ``STAGETREE_REGEN_GOLDEN=1`` to write them again after an intended
change of behaviour.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tuner_fakes import FakeRunner

from stagetree.distributions import Uniform
from stagetree.hp import Constant, Then
from stagetree.space import GridSpace, RandomSpace
from stagetree.tuners import (
    ASHA,
    PBT,
    SHA,
    AsyncHyperband,
    EarlyStop,
    GridSearch,
    Hyperband,
    MedianStopping,
    RandomSearch,
    Tuner,
)

GOLDEN = Path(__file__).parent / "golden"
SEEDS = (0, 1, 2)
SPACE = RandomSpace({"x": Uniform(0.0, 1.0)})
GRID = GridSpace({"x": [round(0.05 * i, 2) for i in range(16)]})
# 24 trials sharing their first 4 steps in groups of 6: a sharing study trains each
# group's first rung once
SHARED = GridSpace(
    hp={"x": [Then(Constant(0.1 * (i % 4)), Constant(0.04 * i), 4) for i in range(24)]}
)


class SharingRunner(FakeRunner):
    """A fake study that shares prefixes (``Study(share=True)``)."""

    def shares_work(self) -> bool:
        return True


def _nan_or_fail(kind: str) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    offset = 0.0 if kind == "nan" else 0.5

    def pred(config: dict[str, Any], hp: dict[str, Any]) -> bool:
        x = float(hp["x"](0))
        return offset <= x < offset + 0.08

    return pred


Case = Callable[[int], tuple[Tuner, FakeRunner]]

CASES: dict[str, Case] = {
    "grid": lambda s: (
        GridSearch(GRID, "acc", steps=6, max_concurrent=5),
        FakeRunner(order_seed=s),
    ),
    "random": lambda s: (
        RandomSearch(SPACE, "acc", steps=6, num_trials=30, seed=s),
        FakeRunner(order_seed=s),
    ),
    "sha": lambda s: (
        SHA(SPACE, "acc", min_steps=1, max_steps=9, num_trials=27, seed=s, max_concurrent=5),
        FakeRunner(order_seed=s),
    ),
    "hyperband": lambda s: (
        Hyperband(SPACE, "loss", "min", min_steps=1, max_steps=9, num_trials=40, seed=s),
        FakeRunner(order_seed=s),
    ),
    "early_stop": lambda s: (
        EarlyStop(SPACE, "acc", schedule=[(2, 12), (4, 6), (8, 2)], seed=s, max_concurrent=4),
        FakeRunner(order_seed=s),
    ),
    "asha": lambda s: (
        ASHA(SPACE, "acc", min_steps=1, max_steps=16, num_trials=60, eta=2, seed=s),
        FakeRunner(order_seed=s, workers=5),
    ),
    "asha_brackets_min": lambda s: (
        ASHA(
            SPACE,
            "loss",
            "min",
            min_steps=1,
            max_steps=27,
            num_trials=50,
            eta=3,
            seed=s,
            brackets=2,
        ),
        FakeRunner(order_seed=s, workers=3),
    ),
    "asha_nan_failures": lambda s: (
        ASHA(SPACE, "acc", min_steps=1, max_steps=16, num_trials=40, eta=2, seed=s),
        FakeRunner(
            order_seed=s, workers=4, nan_if=_nan_or_fail("nan"), fail_if=_nan_or_fail("fail")
        ),
    ),
    "asha_shared": lambda s: (
        ASHA(SHARED, "acc", min_steps=4, max_steps=16, num_trials=24, eta=2, seed=s),
        SharingRunner(order_seed=s, workers=3),
    ),
    "async_hyperband": lambda s: (
        AsyncHyperband(SPACE, "acc", min_steps=1, max_steps=27, num_trials=50, eta=3, seed=s),
        FakeRunner(order_seed=s, workers=6),
    ),
    "pbt": lambda s: (
        PBT(SPACE, "acc", population=8, interval=2, steps=10, seed=s),
        FakeRunner(order_seed=s),
    ),
    "median": lambda s: (
        MedianStopping(
            SPACE, "acc", steps=8, num_trials=20, eval_every=2, seed=s, compare="reached"
        ),
        FakeRunner(order_seed=s, workers=4),
    ),
}


def trace(name: str, seed: int) -> dict[str, Any]:
    """The log and best result of case ``name`` run with ``seed``."""
    tuner, runner = CASES[name](seed)
    best = asyncio.run(tuner.run(runner))
    out: dict[str, Any] = {"log": runner.log, "best": None}
    if best is not None:
        value = best.metrics[tuner.metric]
        out["best"] = {
            "x": float(best.hp["x"](0)),
            "steps": best.steps,
            "value": None if math.isnan(value) else round(value, 12),
        }
    return out


def _path(name: str) -> Path:
    return GOLDEN / f"{name}.json"


@pytest.mark.parametrize("name", sorted(CASES))
def test_decisions_match_the_golden_trace(name: str) -> None:
    got = {str(seed): trace(name, seed) for seed in SEEDS}
    path = _path(name)
    if os.environ.get("STAGETREE_REGEN_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, separators=(",", ":"), sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    for seed in SEEDS:
        g, w = got[str(seed)], want[str(seed)]
        assert g["best"] == w["best"], f"{name} seed {seed}: best"
        assert len(g["log"]) == len(w["log"]), f"{name} seed {seed}: log length"
        for i, (a, b) in enumerate(zip(g["log"], w["log"])):
            assert a == b, f"{name} seed {seed}: record {i} differs"
