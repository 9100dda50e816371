"""Behaviour of every tuner against the fake runner of ``tuner_fakes``."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from tuner_fakes import FakeRunner, curve, decisions

import stagetree.tuners as tuners
from stagetree.distributions import Choice, Uniform
from stagetree.exceptions import TunerError
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
    TrialResult,
    Tuner,
    hyperband_split,
    rung_levels,
)

SPACE = RandomSpace({"x": Uniform(0.0, 1.0)})
GRID = GridSpace({"x": [0.1, 0.3, 0.5, 0.7, 0.9]})


def run(tuner: Tuner, runner: FakeRunner) -> TrialResult | None:
    return asyncio.run(tuner.run(runner))


def x_of(result: TrialResult | Any) -> float:
    return float(result.hp["x"](0))


def true_acc(tuner: Tuner, tid: int, steps: int) -> float:
    trial = tuner.trials[tid]
    return curve(trial.config, trial.hp, steps)


def best_sampled_x(tuner: Tuner) -> float:
    """x closest to 0.7 among the trials the tuner created: the best under the curve."""
    return min((x_of(t) for t in tuner.trials.values()), key=lambda x: abs(x - 0.7))


def submissions(runner: FakeRunner) -> list[tuple[float, int]]:
    return [(float(hp["x"](0)), steps) for _, hp, steps in runner.calls]


# --------------------------------------------------------------------------- API


def test_exports_are_the_intended_names() -> None:
    assert set(tuners.__all__) == {
        "ASHA",
        "PBT",
        "SHA",
        "AsyncHyperband",
        "EarlyStop",
        "GridSearch",
        "Hyperband",
        "Job",
        "JobQueue",
        "MedianStopping",
        "RandomSearch",
        "ReplayDivergedWarning",
        "ReplayingRunner",
        "Trial",
        "TrialResult",
        "TrialRunner",
        "Tuner",
        "draw_specs",
        "hyperband_split",
        "rung_levels",
    }
    for name in tuners.__all__:
        assert getattr(tuners, name) is not None


def test_fake_runner_satisfies_the_protocol() -> None:
    assert isinstance(FakeRunner(), tuners.TrialRunner)


def test_rung_levels() -> None:
    assert rung_levels(1, 64, 4) == [1, 4, 16, 64]
    assert rung_levels(1, 10, 3) == [1, 3, 9, 10]
    assert rung_levels(2, 2, 3) == [2]
    # max_rungs keeps the top rung at max_steps and drops the highest lower rungs
    assert rung_levels(1, 1024, 4, max_rungs=5) == [1, 4, 16, 64, 1024]
    assert rung_levels(1, 1024, 4, max_rungs=1) == [1024]


def test_hyperband_split() -> None:
    # the classic Hyperband bracket sizes for R=27, eta=3: n = 27, 12, 6, 4
    assert hyperband_split(49, 4, 3) == [27, 12, 6, 4]
    for n in (1, 5, 10, 100, 333):
        split = hyperband_split(n, 4, 3)
        assert sum(split) == n
        assert split == sorted(split, reverse=True)


# --------------------------------------------------------------------------- validation


def _asha(**kw: Any) -> ASHA:
    args: dict[str, Any] = {"min_steps": 1, "max_steps": 16, "num_trials": 8, **kw}
    return ASHA(SPACE, "acc", **args)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: _asha(eta=1), "eta"),
        (lambda: SHA(SPACE, "acc", min_steps=1, max_steps=9, num_trials=9, eta=1), "eta"),
        (lambda: Hyperband(SPACE, "acc", min_steps=1, max_steps=9, num_trials=9, eta=0), "eta"),
        (lambda: _asha(min_steps=20), "min_steps"),
        (lambda: _asha(min_steps=0), "min_steps"),
        (lambda: SHA(SPACE, "acc", min_steps=10, max_steps=9, num_trials=9), "min_steps"),
        (lambda: _asha(num_trials=0), "num_trials"),
        (lambda: RandomSearch(SPACE, "acc", steps=5, num_trials=0), "num_trials"),
        (lambda: MedianStopping(SPACE, "acc", steps=5, num_trials=0), "num_trials"),
        (lambda: _asha(mode="maximize"), "mode"),
        (lambda: GridSearch(GRID, "acc", "up", steps=3), "mode"),
        (lambda: GridSearch(GRID, "acc", steps=0), "steps"),
        (lambda: _asha(brackets=5), "brackets"),
        (lambda: _asha(max_rungs=0), "max_rungs"),
        (lambda: _asha(max_concurrent=0), "max_concurrent"),
        (lambda: EarlyStop(SPACE, "acc", schedule=[]), "schedule"),
        (lambda: EarlyStop(SPACE, "acc", schedule=[(5, 8), (5, 4)]), "strictly increasing"),
        (lambda: EarlyStop(SPACE, "acc", schedule=[(5, 8), (3, 4)]), "strictly increasing"),
        (lambda: EarlyStop(SPACE, "acc", schedule=[(5, 0)]), "schedule[0] n"),
        (lambda: PBT(SPACE, "acc", population=1, interval=2, steps=10), "population"),
        (lambda: PBT(SPACE, "acc", population=4, interval=0, steps=10), "interval"),
        (lambda: PBT(SPACE, "acc", population=4, interval=2, steps=10, quantile=0.7), "quantile"),
        (lambda: PBT(SPACE, "acc", population=4, interval=2, steps=10, perturb=1.5), "perturb"),
        (lambda: MedianStopping(SPACE, "acc", steps=5, num_trials=3, eval_every=0), "eval_every"),
        (lambda: MedianStopping(SPACE, "acc", steps=5, num_trials=3, grace_steps=6), "grace_steps"),
        (lambda: GridSearch(GRID, "", steps=3), "metric"),
    ],
)
def test_invalid_arguments_raise_tuner_error_naming_them(make: Any, name: str) -> None:
    with pytest.raises(TunerError, match=name.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_tuner_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        _asha(eta=1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: GridSearch(GRID, "acc", steps=3),
        lambda: _asha(),
        lambda: SHA(SPACE, "acc", min_steps=1, max_steps=9, num_trials=9),
        lambda: MedianStopping(SPACE, "acc", steps=4, num_trials=4, eval_every=2),
        lambda: PBT(SPACE, "acc", population=4, interval=2, steps=6),
    ],
)
def test_metric_never_returned_raises_naming_it_and_the_returned_names(make: Any) -> None:
    runner = FakeRunner(metric_names=("accuracy", "xent"))
    with pytest.raises(TunerError, match=r"'acc'.*\['accuracy', 'xent'\]"):
        run(make(), runner)
    assert runner.in_flight == 0  # the failed tuner cancelled what it had in flight


# --------------------------------------------------------------------------- grid / random


def test_grid_search_trains_every_trial_and_finds_the_best() -> None:
    runner = FakeRunner()
    tuner = GridSearch(GRID, "acc", steps=10)
    best = run(tuner, runner)
    assert best is not None and x_of(best) == 0.7 and best.steps == 10
    assert sorted(submissions(runner)) == [(x, 10) for x in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert runner.max_in_flight == 5  # everything at once: the plan merges best that way
    assert best.metrics["acc"] == pytest.approx(curve({}, {"x": Constant(0.7)}, 10))


def test_grid_search_min_mode_and_max_concurrent() -> None:
    runner = FakeRunner()
    best = run(GridSearch(GRID, "loss", "min", steps=4, max_concurrent=2), runner)
    assert best is not None and x_of(best) == 0.7
    assert runner.max_in_flight == 2
    assert len(runner.calls) == 5


def test_random_search_is_seeded_and_finds_the_best_sample() -> None:
    r1, r2, r3 = FakeRunner(order_seed=1), FakeRunner(order_seed=2), FakeRunner()
    t1 = RandomSearch(SPACE, "acc", steps=6, num_trials=12, seed=5)
    best = run(t1, r1)
    run(RandomSearch(SPACE, "acc", steps=6, num_trials=12, seed=5), r2)
    run(RandomSearch(SPACE, "acc", steps=6, num_trials=12, seed=6), r3)
    assert sorted(submissions(r1)) == sorted(submissions(r2))
    assert sorted(submissions(r1)) != sorted(submissions(r3))
    assert best is not None and x_of(best) == best_sampled_x(t1)
    assert len(r1.calls) == 12 and r1.trained_steps == 72


# --------------------------------------------------------------------------- SHA


def test_sha_rungs_keep_the_top_third_and_resume() -> None:
    runner = FakeRunner()
    tuner = SHA(SPACE, "acc", min_steps=1, max_steps=27, num_trials=27, eta=3, seed=1)
    best = run(tuner, runner)
    (rungs,) = tuner.rung_trials
    assert [len(r) for r in rungs] == [27, 9, 3, 1]
    for k in range(1, 4):
        prev = sorted(rungs[k - 1], key=lambda t: -true_acc(tuner, t, tuner.levels[k - 1]))
        assert sorted(rungs[k]) == sorted(prev[: len(rungs[k])])
    assert best is not None and best.steps == 27 and x_of(best) == best_sampled_x(tuner)
    # promotion resumes: 27*1 + 9*(3-1) + 3*(9-3) + 1*(27-9)
    assert runner.trained_steps == 81
    assert [s for _, s in submissions(runner)] == [1] * 27 + [3] * 9 + [9] * 3 + [27]


def test_sha_never_promotes_nan_or_failed_trials() -> None:
    def nan_if(config: dict[str, Any], hp: dict[str, Any]) -> bool:
        return 0.6 < hp["x"](0) < 0.7

    def fail_if(config: dict[str, Any], hp: dict[str, Any]) -> bool:
        return 0.7 <= hp["x"](0) < 0.8

    runner = FakeRunner(nan_if=nan_if, fail_if=fail_if)
    tuner = SHA(SPACE, "acc", min_steps=1, max_steps=9, num_trials=27, eta=3, seed=2)
    best = run(tuner, runner)
    bad = {t for t, trial in tuner.trials.items() if 0.6 < x_of(trial) < 0.8}
    assert bad, "the seed must draw some NaN/failing trials for the test to mean something"
    (rungs,) = tuner.rung_trials
    assert not bad & set(rungs[1] + rungs[2])
    assert len(rungs[1]) == 9
    assert best is not None and math.isfinite(best.metrics["acc"])
    assert not 0.6 < x_of(best) < 0.8


def test_all_nan_gives_no_best() -> None:
    runner = FakeRunner(nan_if=lambda c, h: True)
    tuner = SHA(SPACE, "acc", min_steps=1, max_steps=9, num_trials=9)
    assert run(tuner, runner) is None
    assert tuner.rung_trials[0][1:] == [[], []]


# --------------------------------------------------------------------------- Hyperband


def test_hyperband_brackets() -> None:
    runner = FakeRunner()
    tuner = Hyperband(SPACE, "acc", min_steps=1, max_steps=27, num_trials=49, eta=3, seed=4)
    best = run(tuner, runner)
    sizes = [[len(r) for r in b] for b in tuner.rung_trials]
    assert sizes == [[27, 9, 3, 1], [12, 4, 1], [6, 2], [4]]
    firsts: dict[float, int] = {}
    for _, hp, steps in runner.calls:
        firsts.setdefault(float(hp["x"](0)), steps)
    # bracket b starts its trials at rung b
    assert sorted(firsts.values()) == [1] * 27 + [3] * 12 + [9] * 6 + [27] * 4
    assert best is not None and best.steps == 27 and x_of(best) == best_sampled_x(tuner)


# --------------------------------------------------------------------------- ASHA


def test_asha_rung_sizes_follow_the_paper() -> None:
    """eta=4, 64 configurations: rungs of about 64, 16, 4, 1 -- never fewer, since every
    configuration in the final top quarter of a rung has been promoted, and only a few
    more (configurations promoted early that later fell out of the top quarter)."""
    for order_seed in range(3):
        runner = FakeRunner(workers=8, order_seed=order_seed)
        tuner = ASHA(SPACE, "acc", min_steps=1, max_steps=64, num_trials=64, seed=order_seed)
        best = run(tuner, runner)
        (rungs,) = tuner.rungs
        sizes = [len(r) for r in rungs]
        assert sizes[0] == 64
        for k in range(1, 4):
            assert sizes[k - 1] // 4 <= sizes[k] <= sizes[k - 1] // 4 + sizes[k - 1] // 8 + 1
            top = sorted(rungs[k - 1], key=lambda t: -rungs[k - 1][t])[: sizes[k - 1] // 4]
            assert set(top) <= set(rungs[k])
        assert runner.max_in_flight <= 8
        assert best is not None and best.steps == 64 and x_of(best) == best_sampled_x(tuner)
        # rung values are the true curve values at the rung's steps
        for k, rung in enumerate(rungs):
            for t, v in rung.items():
                assert v == true_acc(tuner, t, tuner.levels[k])


def test_asha_one_worker_is_sequential() -> None:
    runner = FakeRunner(workers=1)
    tuner = ASHA(SPACE, "acc", min_steps=1, max_steps=16, num_trials=16, eta=4)
    run(tuner, runner)
    assert runner.max_in_flight == 1
    sizes = [len(r) for r in tuner.rungs[0]]
    assert sizes[0] == 16 and 4 <= sizes[1] <= 6 and 1 <= sizes[2] <= 2


def test_asha_is_reproducible_and_seeded() -> None:
    def go(seed: int, order: int) -> FakeRunner:
        runner = FakeRunner(order_seed=order)
        run(ASHA(SPACE, "acc", min_steps=1, max_steps=16, num_trials=20, seed=seed), runner)
        return runner

    assert go(1, 7).log == go(1, 7).log
    assert decisions(go(1, 7).log) != decisions(go(2, 7).log)


def test_asha_never_promotes_nan() -> None:
    runner = FakeRunner(nan_if=lambda c, h: h["x"](0) > 0.5)
    tuner = ASHA(SPACE, "acc", min_steps=1, max_steps=16, num_trials=32, eta=4, seed=3)
    best = run(tuner, runner)
    (rungs,) = tuner.rungs
    nan_trials = {t for t, trial in tuner.trials.items() if x_of(trial) > 0.5}
    assert nan_trials & set(rungs[0])
    assert not nan_trials & (set(rungs[1]) | set(rungs[2]))
    assert all(rungs[0][t] == -math.inf for t in nan_trials)
    assert best is not None and x_of(best) <= 0.5


def test_asha_failed_trials_count_in_the_rung_but_are_not_promoted() -> None:
    runner = FakeRunner(fail_if=lambda c, h: h["x"](0) < 0.3)
    tuner = ASHA(SPACE, "acc", min_steps=1, max_steps=16, num_trials=32, eta=4, seed=3)
    run(tuner, runner)
    failed = {t for t, trial in tuner.trials.items() if x_of(trial) < 0.3}
    (rungs,) = tuner.rungs
    assert failed and failed <= set(rungs[0])
    assert not failed & set(rungs[1])
    assert len(rungs[0]) == 32


def test_async_hyperband_assigns_brackets_round_robin() -> None:
    runner = FakeRunner()
    tuner = AsyncHyperband(SPACE, "acc", min_steps=1, max_steps=64, num_trials=40, seed=2)
    best = run(tuner, runner)
    assert tuner.num_brackets == 4 == len(tuner.levels)
    new = [r for r in runner.log if r["event"] == "submit"]
    assert [r["bracket"] for r in new] == [i % 4 for i in range(40)]
    assert [r["steps"] for r in new] == [tuner.levels[i % 4] for i in range(40)]
    for b, rungs in enumerate(tuner.rungs):
        assert all(not rungs[level] for level in range(b))  # bracket b starts at rung b
        assert len(rungs[b]) == 10
    assert best is not None and best.steps == 64


# --------------------------------------------------------------------------- median stopping

MEDIAN_GRID = GridSpace({"x": [0.6, 0.65, 0.7, 0.75, 0.8]}, fixed={"penalty": [0.0, 0.5]})


def test_median_stopping_stops_bad_trials_only() -> None:
    for seed in range(6):
        runner = FakeRunner(workers=4, order_seed=seed)
        tuner = MedianStopping(
            MEDIAN_GRID,
            "acc",
            steps=20,
            num_trials=10,
            grace_steps=4,
            eval_every=2,
            seed=seed,
            compare="reached",  # the rule before issue 25 (see the test after next)
        )
        best = run(tuner, runner)
        stopped = {t for t, _ in tuner.stopped}
        penalized = {t for t, trial in tuner.trials.items() if trial.config["penalty"] > 0}
        assert stopped <= penalized
        assert all(step >= 4 for _, step in tuner.stopped)  # grace period
        assert best is not None and x_of(best) == 0.7 and best.config["penalty"] == 0.0
        assert runner.max_in_flight <= 4
        stops = [r for r in runner.log if r["event"] == "stop"]
        assert [(r["trial"], r["steps"]) for r in stops] == tuner.stopped
        # a stopped trial is never submitted again; the others ran chunk by chunk to 20
        for tid, step in tuner.stopped:
            fp = tuner.trials[tid].fingerprint
            steps = [r["steps"] for r in runner.log if r.get("fp") == fp]
            assert steps == list(range(2, step + 1, 2))
        for tid in set(tuner.trials) - stopped:
            fp = tuner.trials[tid].fingerprint
            assert [r["steps"] for r in runner.log if r.get("fp") == fp] == list(range(2, 21, 2))
        if seed == 5:  # good trials came first: every penalized one is stopped
            assert stopped == penalized


def test_median_stopping_rule_uses_running_averages() -> None:
    tuner = MedianStopping(SPACE, "acc", steps=10, num_trials=5, min_samples=2, compare="reached")
    tuner._history = {
        0: {2: 0.5, 4: 0.7},  # running average at 4: 0.6
        1: {2: 0.3, 4: 0.5},  # 0.4
        2: {2: 0.2, 4: 0.45},  # best 0.45 < median(0.6, 0.4) = 0.5 -> stop
        3: {2: 0.2},  # has not reached step 4: not a sample
    }
    assert tuner.should_stop(2, 4)
    assert not tuner.should_stop(1, 4)  # best 0.5 == median(0.6, 0.325): not below
    tuner.min_samples = 3
    assert not tuner.should_stop(2, 4)


def test_median_stopping_compares_with_completed_trials_by_default() -> None:
    # Vizier's rule (issue 25): the median of the running averages of *completed*
    # trials at step s; running or stopped trials are no samples.
    tuner = MedianStopping(SPACE, "acc", steps=10, num_trials=9, min_samples=2)
    assert tuner.compare == "completed"
    tuner._history = {
        0: {2: 0.5, 4: 0.7, 10: 0.8},  # completed; running average at 4: 0.6
        1: {2: 0.3, 4: 0.5, 10: 0.6},  # completed; 0.4
        2: {2: 0.2, 4: 0.45},  # best 0.45 < median(0.6, 0.4) = 0.5 -> stop
        3: {2: 0.1, 4: 0.1},  # running: no sample
        4: {2: 0.1, 4: 0.1},  # stopped: no sample
    }
    tuner._completed = {0, 1}
    assert tuner.should_stop(2, 4)
    # Today's rule counts the running and stopped ones: median(0.6, 0.4, 0.1, 0.1) = 0.25.
    tuner.compare = "reached"
    assert not tuner.should_stop(2, 4)
    tuner.compare = "completed"
    tuner._completed = {0}  # one completed trial is fewer than min_samples
    assert not tuner.should_stop(2, 4)
    with pytest.raises(TunerError, match="compare"):
        MedianStopping(SPACE, "acc", steps=10, num_trials=2, compare="all")


def test_median_stopping_waits_for_completed_trials() -> None:
    # Today's rule ("reached") stops trials after their first chunk here, before any
    # trial completed; the default waits for min_samples completed trials.
    stops_seen = 0
    for seed in range(4):
        runner = FakeRunner(workers=4, order_seed=seed)
        tuner = MedianStopping(
            MEDIAN_GRID, "acc", steps=20, num_trials=10, eval_every=2, min_samples=3, seed=seed
        )
        run(tuner, runner)
        finals = [i for i, r in enumerate(runner.log) if r.get("steps") == 20]
        stops = [i for i, r in enumerate(runner.log) if r["event"] == "stop"]
        assert all(i > finals[2] for i in stops)  # after the third completed trial
        stopped = {t for t, _ in tuner.stopped}
        assert stopped <= {t for t, trial in tuner.trials.items() if trial.config["penalty"] > 0}
        stops_seen += len(stops)
    assert stops_seen > 0


# --------------------------------------------------------------------------- PBT


def test_pbt_exploits_copy_the_donor_prefix_and_perturb_after() -> None:
    runner = FakeRunner()
    tuner = PBT(SPACE, "acc", population=8, interval=5, steps=30, seed=3)
    best = run(tuner, runner)
    assert tuner.exploits
    for e in tuner.exploits:
        new, donor, t = tuner.trials[e["trial"]], tuner.trials[e["donor"]], e["step"]
        assert new.config == donor.config
        assert new.hp["x"].values(0, t) == donor.hp["x"].values(0, t)
        assert e["mutations"]["x"] in ("perturb", "resample")
        assert new.hp["x"] == Then(donor.hp["x"], Constant(new.hp["x"](t)), t)
        assert 0.0 <= new.hp["x"](t) <= 1.0  # within the space's Uniform(0, 1)
        if e["mutations"]["x"] == "perturb":  # by 0.2 of the width, clipped
            moved = abs(new.hp["x"](t) - donor.hp["x"](t))
            assert moved == pytest.approx(0.2) or new.hp["x"](t) in (0.0, 1.0)
    # no checkpoint copying, yet every step is trained once: each generation trains
    # every member `interval` new steps, a new trial resuming from its donor's prefix
    assert runner.trained_steps == 8 * 30
    assert best is not None and best.steps == 30


def test_pbt_asynchronous_exploits_per_member() -> None:
    # Issue 25: with synchronous=False a member is ranked and exploited as soon as it
    # finishes its interval, against the others' latest values, without waiting for
    # the generation; the exploit continues the donor from the donor's latest step.
    early = 0
    for seed in range(4):
        runner = FakeRunner(workers=2, order_seed=seed)
        tuner = PBT(
            SPACE,
            "acc",
            population=8,
            interval=5,
            steps=30,
            seed=seed,
            max_concurrent=2,
            synchronous=False,
        )
        best = run(tuner, runner)
        assert tuner.exploits and best is not None and best.steps == 30
        # an exploit decided while a member of the first interval still trains
        first = {r["key"] for r in runner.log if r["event"] == "submit" and r["steps"] == 5}
        last_done = max(
            i for i, r in enumerate(runner.log) if r["event"] == "done" and r["key"] in first
        )
        exploits = [i for i, r in enumerate(runner.log) if r["event"] == "exploit"]
        early += exploits[0] < last_done
        for e in tuner.exploits:
            new, donor, t = tuner.trials[e["trial"]], tuner.trials[e["donor"]], e["step"]
            assert t % 5 == 0 and 0 < t < 30
            assert new.hp["x"].values(0, t) == donor.hp["x"].values(0, t)
            assert new.hp["x"] == Then(donor.hp["x"], Constant(new.hp["x"](t)), t)
        # every member of the final population reached the end: slots are never lost
        finals = [r for r in runner.log if r.get("steps") == 30]
        assert len({r["trial"] for r in finals}) == 8
    assert early >= 2  # never with synchronous generations
    with pytest.raises(TunerError, match="synchronous"):
        PBT(SPACE, "acc", population=4, interval=5, steps=30, synchronous="no")


def test_pbt_donors_come_from_the_top_quantile() -> None:
    runner = FakeRunner()
    tuner = PBT(SPACE, "acc", population=8, interval=4, steps=12, quantile=0.25, seed=1)
    run(tuner, runner)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in tuner.exploits:
        by_step.setdefault(e["step"], []).append(e)
    assert set(by_step) == {4, 8}
    members = sorted(t for t in tuner.trials if t < 8)
    for t in (4, 8):
        values = {m: true_acc(tuner, m, t) for m in members}
        ranked = sorted(members, key=lambda m: -values[m])
        assert len(by_step[t]) == 2  # ceil(8 * 0.25)
        for e in by_step[t]:
            assert e["donor"] in ranked[:2] and e["replaces"] in ranked[-2:]
        members = [next((e["trial"] for e in by_step[t] if e["replaces"] == m), m) for m in members]
    assert [r["event"] for r in decisions(runner.log)].count("exploit") == 4


def test_pbt_nan_members_are_replaced_and_never_donors() -> None:
    runner = FakeRunner(nan_if=lambda c, h: h["x"](0) < 0.5)
    tuner = PBT(SPACE, "acc", population=6, interval=3, steps=9, seed=0)
    best = run(tuner, runner)
    nan = {t for t, trial in tuner.trials.items() if x_of(trial) < 0.5}
    initial_nan = {t for t in nan if t < 6}
    assert initial_nan
    assert not {e["donor"] for e in tuner.exploits} & nan
    assert initial_nan <= {e["replaces"] for e in tuner.exploits if e["step"] == 3}
    assert best is not None and math.isfinite(best.metrics["acc"])


def test_pbt_plain_sequences_are_copied_and_hp_to_mutate() -> None:
    space = RandomSpace({"x": Uniform(0.0, 1.0), "opt": Choice(["sgd", "adam"]), "m": 0.9})
    tuner = PBT(space, "acc", population=4, interval=2, steps=6, seed=2)
    run(tuner, FakeRunner())
    assert tuner.exploits
    for e in tuner.exploits:
        new, donor, t = tuner.trials[e["trial"]], tuner.trials[e["donor"]], e["step"]
        assert new.hp["m"] == donor.hp["m"]  # fixed by the space: never mutated
        assert set(e["mutations"]) == {"opt", "x"}
        assert new.hp["opt"](t) in ("sgd", "adam")
    only_x = PBT(space, "acc", population=4, interval=2, steps=6, seed=2, hp_to_mutate="x")
    run(only_x, FakeRunner())
    for e in only_x.exploits:
        assert only_x.trials[e["trial"]].hp["opt"] == only_x.trials[e["donor"]].hp["opt"]
    with pytest.raises(TunerError, match="'lr'"):
        PBT(space, "acc", population=4, interval=2, steps=6, hp_to_mutate=["lr"])
    with pytest.raises(TunerError, match=r"'m'.*no distribution"):
        PBT(space, "acc", population=4, interval=2, steps=6, hp_to_mutate="m")


def test_pbt_grid_entries_move_to_a_neighbouring_option() -> None:
    space = GridSpace({"x": [0.5, 0.6, 0.7, 0.8], "bs": [32, 64]})
    tuner = PBT(space, "acc", population=4, interval=2, steps=6, seed=0)
    run(tuner, FakeRunner())
    assert tuner.exploits
    for e in tuner.exploits:
        t = e["step"]
        new, donor = tuner.trials[e["trial"]], tuner.trials[e["donor"]]
        value = new.hp["bs"](t)
        assert isinstance(value, int) and value in (32, 64)
        x, dx = new.hp["x"](t), donor.hp["x"](t)
        assert x in (0.5, 0.6, 0.7, 0.8)
        if e["mutations"]["x"] == "perturb":  # a neighbour in the grid's order
            assert abs(round(x * 10) - round(dx * 10)) == 1


def test_pbt_is_reproducible() -> None:
    def go(order: int) -> list[Any]:
        tuner = PBT(SPACE, "acc", population=6, interval=3, steps=12, seed=9)
        runner = FakeRunner(order_seed=order)
        run(tuner, runner)
        return decisions(runner.log)

    # generations are synchronous: even the completion order does not matter
    assert go(0) == go(1)


# --------------------------------------------------------------------------- EarlyStop


def test_early_stop_keeps_the_best_n() -> None:
    runner = FakeRunner()
    tuner = EarlyStop(SPACE, "acc", seed=4)
    best = run(tuner, runner)
    (rungs,) = tuner.rung_trials
    assert [len(r) for r in rungs] == [8, 4]
    ranked = sorted(rungs[0], key=lambda t: -true_acc(tuner, t, 5))
    assert sorted(rungs[1]) == sorted(ranked[:4])
    assert [s for _, s in submissions(runner)] == [5] * 8 + [10] * 4
    assert best is not None and best.steps == 10 and x_of(best) == best_sampled_x(tuner)


def test_early_stop_custom_schedule_on_a_grid() -> None:
    tuner = EarlyStop(GRID, "loss", "min", schedule=[(2, 5), (4, 3), (8, 1)])
    best = run(tuner, FakeRunner())
    assert [len(r) for r in tuner.rung_trials[0]] == [5, 3, 1]
    kept = {x_of(tuner.trials[t]) for t in tuner.rung_trials[0][1]}
    assert kept == {0.5, 0.7, 0.9}
    assert best is not None and x_of(best) == 0.7 and best.steps == 8


def test_median_stopping_takes_each_completed_trials_average_once_per_step() -> None:
    # The rule over completed trials keeps their running averages sorted per step (their
    # histories no longer change): a check neither scans every trial nor re-averages.
    import random
    import statistics

    rng = random.Random(3)
    tuner = MedianStopping(SPACE, "acc", steps=8, num_trials=400, min_samples=3)
    averaged: list[int] = []
    plain = MedianStopping._average
    tuner._average = lambda hist, step: (averaged.append(1), plain(hist, step))[1]  # type: ignore[method-assign]

    def scan(tid: int, step: int) -> bool:  # the rule as a scan of every trial
        best = max((v for s, v in tuner._history[tid].items() if s <= step), default=-1e9)
        averages = []
        for other in tuner._completed - {tid}:
            vals = [v for s, v in tuner._history[other].items() if s <= step]
            averages.append(sum(vals) / len(vals))
        return len(averages) >= 3 and best < statistics.median(averages)

    for tid in range(300):
        tuner._history[tid] = {s: rng.random() for s in (2, 4, 6, 8)}
        tuner._complete(tid)
        probe = 1000 + tid
        tuner._history[probe] = {s: rng.random() for s in (2, 4)}
        before = len(averaged)
        assert tuner.should_stop(probe, 4) == scan(probe, 4)
        assert len(averaged) - before <= 1  # only the trial completed since the last check


def test_draw_specs_encodes_no_text_for_distinct_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    # A random space's draws are distinct TrialSpecs already: their texts (a JSON
    # encoding of each config and sequence) are compared only where some are equal.
    import warnings

    from stagetree.distributions import LogUniform
    from stagetree.exceptions import StagetreeWarning
    from stagetree.hp import Constant
    from stagetree.space import RandomSpace, TrialSpec
    from stagetree.tuners import base as tuner_base

    texts = [0]
    real = tuner_base._spec_key

    def counted(spec: object) -> str:
        texts[0] += 1
        return real(spec)

    monkeypatch.setattr(tuner_base, "_spec_key", counted)
    space = RandomSpace(hp={"lr": Constant(LogUniform(1e-4, 1.0))}, fixed={"bs": 64})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drawn = tuner_base.draw_specs(space, 200, seed=3)
    assert len(drawn) == 200 and texts[0] == 0  # on main: 200

    class Repeating:  # a space whose draws repeat (equal values, unequal objects)
        def sample(self, n: int, seed: int) -> list[TrialSpec]:
            return [TrialSpec({"bs": 64}, {"lr": 0.1 * (i % 3)}) for i in range(n)]

    with pytest.warns(StagetreeWarning, match="only 3 are distinct"):
        tuner_base.draw_specs(Repeating(), 9, seed=0)
    assert texts[0] == 9
