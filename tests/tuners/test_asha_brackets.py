"""ASHA as in the paper's production section: brackets s = 0, 1, 2 with new
configurations assigned in proportion to the inverse of a bracket's budget,
asynchronous Hyperband looping through ASHA brackets, and infinite-horizon ASHA
(``max_steps=None``)."""

from __future__ import annotations

import asyncio
import itertools
import warnings
from typing import Any

import pytest
from branching_spaces import MIXED
from tuner_fakes import FakeRunner, kill_after

from stagetree.distributions import Choice, Uniform
from stagetree.exceptions import ReplayDivergedWarning, TunerError
from stagetree.executors.simulated import SimulatedTrainer
from stagetree.hp import MultiStep, Piecewise
from stagetree.space import GridSpace, RandomSpace
from stagetree.study import Study
from stagetree.tuners import ASHA, AsyncHyperband, TrialResult, Tuner
from stagetree.tuners.asha import _Unbounded, bracket_shares

SPACE = RandomSpace({"x": Uniform(0.0, 1.0)})


def run(tuner: Tuner, runner: FakeRunner) -> TrialResult | None:
    return asyncio.run(tuner.run(runner))


def new_trials(runner: FakeRunner) -> list[dict[str, Any]]:
    return [r for r in runner.log if r["event"] == "submit"]


# --------------------------------------------------------------------------- shares


def test_production_shares_for_eta_4_and_5_rungs() -> None:
    """Bracket s has 5 - s rungs and trains 4**(4 - s) configurations at a budget of
    about (5 - s) full trainings: shares proportional to 4**(4-s) / (5-s), i.e.
    51.2 : 16 : 5.33 (the rule of the paper's production system)."""
    shares = bracket_shares(3, 5, 4)
    assert sum(shares) == pytest.approx(1.0)
    assert [round(100 * s, 1) for s in shares] == [70.6, 22.1, 7.4]
    assert shares == pytest.approx([51.2 / 72.5333, 16 / 72.5333, 5.3333 / 72.5333], abs=1e-4)


def test_infinite_horizon_shares_tend_to_eta() -> None:
    assert bracket_shares(3, None, 4) == pytest.approx([16 / 21, 4 / 21, 1 / 21])
    # the finite shares approach them as the rungs grow
    far = bracket_shares(3, 40, 4)
    assert far == pytest.approx(bracket_shares(3, None, 4), abs=0.02)


def test_new_configurations_follow_the_shares_at_every_prefix() -> None:
    runner = FakeRunner(workers=8, order_seed=1)
    tuner = ASHA(
        SPACE,
        "acc",
        min_steps=1,
        max_steps=256,
        num_trials=400,
        eta=4,
        brackets=3,
        allocation="budget",
        seed=3,
    )
    best = run(tuner, runner)
    assert len(tuner.levels) == 5
    shares = tuner.shares
    brackets = [r["bracket"] for r in new_trials(runner)]
    assert len(brackets) == 400
    for n in range(1, 401):
        for b in range(3):
            assert abs(brackets[:n].count(b) - shares[b] * n) < 1.0
    # bracket s starts its configurations at rung s
    for r in new_trials(runner):
        assert r["rung"] == r["bracket"] and r["steps"] == tuner.levels[r["bracket"]]
    for b, rungs in enumerate(tuner.rungs):
        assert all(not rungs[level] for level in range(b))
    assert best is not None and best.steps == 256


def test_round_robin_stays_available() -> None:
    runner = FakeRunner(workers=4)
    tuner = ASHA(
        SPACE, "acc", min_steps=1, max_steps=64, num_trials=30, brackets=3, allocation="round_robin"
    )
    run(tuner, runner)
    assert [r["bracket"] for r in new_trials(runner)] == [i % 3 for i in range(30)]


def test_default_brackets_never_exceed_the_rungs() -> None:
    tuner = ASHA(SPACE, "acc", min_steps=1, max_steps=4, num_trials=8, eta=4)
    assert tuner.num_brackets <= len(tuner.levels) == 2


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"allocation": "fifo"}, "allocation"),
        ({"brackets": 0}, "brackets"),
        ({"brackets": 6}, "brackets"),
    ],
)
def test_bad_bracket_arguments_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(TunerError, match=name):
        ASHA(SPACE, "acc", min_steps=1, max_steps=256, num_trials=8, **kwargs)


def test_async_hyperband_can_use_hyperband_proportions() -> None:
    """Asynchronous Hyperband loops through ASHA's brackets, one per rung; with the
    budget allocation they get Hyperband's proportions (more to the exploratory ones)."""
    runner = FakeRunner(workers=6)
    tuner = AsyncHyperband(
        SPACE, "acc", min_steps=1, max_steps=27, num_trials=80, eta=3, allocation="budget"
    )
    best = run(tuner, runner)
    counts = [0] * 4
    for r in new_trials(runner):
        counts[r["bracket"]] += 1
    assert counts == sorted(counts, reverse=True) and sum(counts) == 80
    for b in range(4):
        assert abs(counts[b] - 80 * tuner.shares[b]) < 1.0
    assert best is not None and best.steps == 27


# --------------------------------------------------------------------------- infinite horizon


def test_infinite_horizon_rungs_grow_without_end() -> None:
    """eta=2, 128 configurations: rungs 1, 2, 4, ..., 128 (eight of them, past
    ``max_rungs=5``), each promotion growing the trial's budget by eta."""
    runner = FakeRunner(workers=4, order_seed=2)
    tuner = ASHA(SPACE, "acc", min_steps=1, max_steps=None, num_trials=128, eta=2, seed=1)
    best = run(tuner, runner)
    assert tuner.horizon == 0
    assert tuner.levels == [2**k for k in range(len(tuner.levels))]
    assert len(tuner.levels) >= 8 > tuner.max_rungs
    (rungs,) = tuner.rungs
    sizes = [len(r) for r in rungs]
    assert sizes[0] == 128 and sizes[-1] >= 1
    assert all(sizes[k] >= sizes[k - 1] // 2 for k in range(1, len(sizes)))
    assert sizes[-1] < 2  # the last rung holds fewer than eta: nothing more to promote
    # a promoted trial's budget grows by eta each time
    steps: dict[int, list[int]] = {}
    for r in runner.log:
        if r["event"] in ("submit", "promote"):
            steps.setdefault(r["trial"], []).append(r["steps"])
    assert max(len(s) for s in steps.values()) == len(tuner.levels)
    for s in steps.values():
        assert all(b == 2 * a for a, b in itertools.pairwise(s))
    assert best is not None and best.steps == tuner.levels[-1]


def test_infinite_horizon_with_brackets() -> None:
    runner = FakeRunner(workers=4)
    tuner = ASHA(
        SPACE,
        "acc",
        min_steps=1,
        max_steps=None,
        num_trials=60,
        eta=3,
        brackets=3,
        allocation="budget",
    )
    run(tuner, runner)
    assert tuner.shares == pytest.approx(bracket_shares(3, None, 3))
    assert {r["steps"] for r in new_trials(runner)} == {1, 3, 9}


def test_async_hyperband_without_max_steps_needs_brackets() -> None:
    with pytest.raises(TunerError, match="brackets"):
        AsyncHyperband(SPACE, "acc", min_steps=1, max_steps=None, num_trials=8)


def test_without_num_trials_a_grid_is_taken_whole() -> None:
    grid = GridSpace({"x": [0.1 * i for i in range(10)]})
    tuner = ASHA(grid, "acc", min_steps=1, max_steps=None, num_trials=None, eta=3)
    assert tuner.bounded
    runner = FakeRunner(workers=3)
    run(tuner, runner)
    assert len(new_trials(runner)) == 10


def test_an_unbounded_search_needs_a_budget() -> None:
    """A random space without num_trials never ends by itself: Study.tune refuses it
    without a budget (a clear error, nothing trained), and a budget ends it."""
    tuner = ASHA(SPACE, "accuracy", min_steps=1, max_steps=None, num_trials=None, eta=3)
    assert not tuner.bounded
    with Study(
        "endless", SimulatedTrainer, storage="memory://", executor="simulated", workers=2
    ) as study:
        with pytest.raises(TunerError, match=r"num_trials.*budget"):
            study.tune(tuner)
        assert study.stats()["steps_executed"] == 0
        best = study.tune(tuner, budget="25 trials")
        assert best is not None
        assert study.last_run is not None and study.last_run.trials == 25


def test_unbounded_draws_match_the_bounded_ones() -> None:
    """Configuration i of an unbounded search is configuration i of
    ``space.sample(n, seed)``: the same seed draws the same trials either way."""
    sampled = list(SPACE.sample(12, 5))
    xs = [float(s.hp["x"](0)) for s in sampled]
    tuner = ASHA(SPACE, "acc", min_steps=1, max_steps=9, num_trials=None, eta=3, seed=5)
    drawn = tuner_specs(tuner, 12)
    assert drawn == xs


def tuner_specs(tuner: ASHA, n: int) -> list[float]:
    specs = _Unbounded(tuner.space, tuner.seed)
    return [float(specs[i].hp["x"](0)) for i in range(n)]


def test_a_finite_random_space_without_num_trials_ends_when_used_up() -> None:
    small = RandomSpace({"x": Choice([0.2, 0.5, 0.7])})
    runner = FakeRunner(workers=2)
    run(ASHA(small, "acc", min_steps=1, max_steps=9, num_trials=None, eta=3), runner)
    assert len(new_trials(runner)) == 3


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_production_brackets_train_each_step_once(seed: int) -> None:
    """Several brackets share prefixes between them (a trial of bracket 2 trains a
    path on which a bracket-0 trial asks for a lower rung later)."""
    stats = _exactness(16, seed)
    assert stats["steps_executed"] == stats["steps_unique"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_infinite_horizon_trains_each_step_once(seed: int) -> None:
    stats = _exactness(None, seed, brackets=1)
    assert stats["steps_executed"] == stats["steps_unique"]


def test_multiple_brackets_lose_nothing() -> None:
    """What holds today with production brackets: every bracket runs, no split is
    missed, no step is lost, and sharing still saves steps."""
    for max_steps in (16, None):
        stats = _exactness(max_steps, 0)
        assert stats["splits_missed"] == 0 and stats["steps_lost"] == 0
        assert stats["steps_unique"] <= stats["steps_executed"] < stats["steps_requested"]


def _exactness(max_steps: int | None, seed: int, brackets: int = 3) -> dict[str, float]:
    tuner = ASHA(
        MIXED,
        "accuracy",
        min_steps=1,
        max_steps=max_steps,
        num_trials=40,
        eta=2,
        brackets=brackets,
        allocation="budget",
        seed=seed,
    )
    with Study(
        "exact", SimulatedTrainer, storage="memory://", executor="simulated", workers=3
    ) as study:
        study.tune(tuner)
        stats = study.stats()
    assert {b for b, rungs in enumerate(tuner.rungs) if any(rungs)} == set(range(brackets))
    return stats


@pytest.mark.slow
@pytest.mark.parametrize(
    ("max_steps", "brackets", "trials", "seed"), [(8, 3, 12, 1), (None, 1, 40, 3)]
)
def test_real_training_from_rung_checkpoints_equals_training_alone(
    max_steps: int | None, brackets: int, trials: int, seed: int
) -> None:
    """Real torch: with production brackets and with the infinite horizon, the results
    of a shared study (requests served from rung and branch checkpoints, each step
    trained once) equal those of the same study with every trial on its own. (Without
    the insertion horizon, the infinite-horizon case trained 61 steps for 59 unique.)"""
    pytest.importorskip("torch")
    from stagetree.torch.examples import DigitsTrainer

    # Sequences that change value between rungs, a small and quick network
    space = RandomSpace(
        hp={
            "lr": MultiStep(
                init=Choice([0.03, 0.05, 0.1]),
                milestones=Choice([[3], [5], [3, 6], [6]]),
                gamma=Choice([0.1, 0.3]),
            ),
            "momentum": Choice([0.0, Piecewise([0.0, 0.5], [5])]),
        },
        fixed={"hidden": 16, "batches_per_step": 2, "seed": 3},
    )
    results = []
    for share in (True, False):
        tuner = ASHA(
            space,
            "accuracy",
            min_steps=1,
            max_steps=max_steps,
            num_trials=trials,
            eta=2,
            brackets=brackets,
            allocation="budget",
            seed=seed,
        )
        with Study(
            f"torch-{share}",
            DigitsTrainer,
            storage="memory://",
            executor="inline",
            workers=3,
            share=share,
        ) as study:
            study.tune(tuner)
            stats = study.stats()
        results.append([(tid, r.steps, r.metrics) for tid, r in tuner.results])
        if share:
            assert stats["steps_executed"] == stats["steps_unique"] < stats["steps_requested"]
    assert results[0] == results[1]


# --------------------------------------------------------------------------- replay


@pytest.mark.parametrize("max_steps", [64, None])
def test_killed_and_resumed_production_asha_replays_its_decisions(max_steps: int | None) -> None:
    """The allocation is a function of the trials created so far: a study killed and
    started again replays the same brackets, then goes on live without diverging."""

    def make() -> ASHA:
        return ASHA(
            SPACE,
            "acc",
            min_steps=1,
            max_steps=max_steps,
            num_trials=40,
            eta=2,
            brackets=3,
            allocation="budget",
            seed=4,
        )

    ref = FakeRunner(order_seed=1, workers=3)
    run(make(), ref)
    first = FakeRunner(order_seed=1, workers=3)
    kill_after(make(), first, 9)
    logged = list(first.log)
    assert 0 < len(logged) < len(ref.log)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergedWarning)
        second = FakeRunner(order_seed=2, workers=3, log=list(logged))
        best = run(make(), second)
        third = FakeRunner(order_seed=3, workers=3, log=list(second.log))
        assert run(make(), third) == best
    assert second.log[: len(logged)] == logged
    assert third.log == second.log
    brackets = [r["bracket"] for r in new_trials(second)]
    assert brackets == [r["bracket"] for r in new_trials(ref)]  # same shares, same order
