"""Replay of tuner decisions after a kill, and the ReplayingRunner helpers."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from tuner_fakes import FakeRunner, curve, decisions, kill_after

from stagetree.distributions import Uniform
from stagetree.hp import Constant, dumps_hp
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
    ReplayDivergedWarning,
    ReplayingRunner,
    Trial,
    TrialResult,
    Tuner,
)

SPACE = RandomSpace({"x": Uniform(0.0, 1.0)})


def asha(seed: int = 3, brackets: int = 1) -> ASHA:
    return ASHA(
        SPACE, "acc", min_steps=1, max_steps=64, num_trials=64, eta=4, seed=seed, brackets=brackets
    )


def run(tuner: Tuner, runner: FakeRunner) -> TrialResult | None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergedWarning)
        return asyncio.run(tuner.run(runner))


def calls(runner: FakeRunner) -> list[tuple[str, str, int]]:
    return [(repr(sorted(c.items())), dumps_hp(hp), steps) for c, hp, steps in runner.calls]


def check_asha_log(log: list[dict[str, Any]], tuner: ASHA, max_workers: int) -> None:
    """Independent oracle: the log is a valid run of the paper's Algorithm 2."""
    workers = 0
    levels, eta, nb = tuner.levels, tuner.eta, tuner.num_brackets
    rungs: list[list[dict[int, float]]] = [[{} for _ in levels] for _ in range(nb)]
    promoted: list[list[set[int]]] = [[set() for _ in levels] for _ in range(nb)]
    jobs: dict[int, tuple[int, int, int]] = {}
    in_flight: set[int] = set()
    started = 0

    def promotable() -> tuple[int, int, int] | None:
        for level in range(len(levels) - 2, -1, -1):
            for b in range(nb):
                rung = rungs[b][level]
                for t in sorted(rung, key=lambda t: (-rung[t], t))[: len(rung) // eta]:
                    if t not in promoted[b][level]:
                        return t, b, level
        return None

    for rec in log:
        if rec["event"] == "workers":
            workers = rec["n"]
            continue
        if rec["event"] == "done":
            assert rec["status"] == "ok"
            # a job only finishes while every worker was busy, or nothing was left to do
            assert len(in_flight) >= workers or (
                promotable() is None and started == tuner.num_trials
            )
            t, b, level = jobs[rec["key"]]
            in_flight.remove(rec["key"])
            trial = tuner.trials[t]
            rungs[b][level][t] = curve(trial.config, trial.hp, levels[level])
            continue
        assert rec["key"] == len(jobs)
        if rec["event"] == "promote":
            t, b, level = rec["trial"], rec["bracket"], rec["rung"] - 1
            assert promotable() == (t, b, level)  # top rung down, best first
            assert rec["steps"] == levels[level + 1]
            promoted[b][level].add(t)
            jobs[rec["key"]] = (t, b, level + 1)
        else:
            assert rec["event"] == "submit"
            assert promotable() is None  # promotion comes before new configurations
            assert rec["trial"] == started
            b = started % nb
            assert rec["bracket"] == b and rec["steps"] == levels[b]
            jobs[rec["key"]] = (started, b, b)
            started += 1
        assert rec["fp"] == tuner.trials[rec["trial"]].fingerprint
        in_flight.add(rec["key"])
        assert len(in_flight) <= workers <= max_workers
    assert not in_flight and promotable() is None and started == tuner.num_trials


def effective(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rec in log:
        if rec["event"] == "diverged":
            del out[rec["keep"] :]
        else:
            out.append(rec)
    return out


# --------------------------------------------------------------------------- ASHA replay


def test_uninterrupted_asha_runs_are_valid() -> None:
    for order_seed, brackets in ((0, 1), (1, 1), (2, 3)):
        runner = FakeRunner(workers=6, order_seed=order_seed)
        tuner = asha(brackets=brackets)
        run(tuner, runner)
        check_asha_log(runner.log, tuner, 6)


@pytest.mark.parametrize(("kill_at", "seed_a", "seed_b"), [(5, 1, 2), (30, 3, 4), (70, 5, 6)])
def test_asha_killed_and_resumed_replays_its_decisions(
    kill_at: int, seed_a: int, seed_b: int
) -> None:
    # reference: an uninterrupted run with completion order A
    ref = FakeRunner(order_seed=seed_a)
    ref_tuner = asha()
    run(ref_tuner, ref)
    # the same study killed after `kill_at` completions
    first = FakeRunner(order_seed=seed_a)
    kill_after(asha(), first, kill_at)
    log1 = list(first.log)
    assert 0 < len(log1) < len(ref.log)
    assert log1 == ref.log[: len(log1)]
    assert first.in_flight == 0 and first.cancelled > 0  # the kill cancelled running jobs
    # resumed with a different completion order, reading the first run's log
    second = FakeRunner(order_seed=seed_b, log=list(log1))
    tuner = asha()
    best = run(tuner, second)  # ReplayDivergedWarning would be an error here
    n1 = len([r for r in decisions(log1) if "fp" in r])  # the logged submissions
    assert calls(second)[:n1] == calls(ref)[:n1]
    promotions1 = sum(r["event"] == "promote" for r in log1)
    assert tuner.promotions[:promotions1] == ref_tuner.promotions[:promotions1]
    assert second.log[: len(log1)] == log1
    assert not [r for r in second.log if r["event"] == "diverged"]
    check_asha_log(second.log, tuner, 4)  # and it continued validly
    # completion order matters after the log (else this test would prove nothing)
    fresh_b = FakeRunner(order_seed=seed_b)
    run(asha(), fresh_b)
    assert decisions(fresh_b.log) != decisions(ref.log)
    # replaying the whole log takes exactly the same decisions and logs nothing new
    third = FakeRunner(order_seed=seed_b + 100, log=list(second.log))
    tuner3 = asha()
    best3 = run(tuner3, third)
    assert third.log == second.log
    assert calls(third) == calls(second)
    assert best3 == best and tuner3.rungs == tuner.rungs


class _Elastic(FakeRunner):
    """A cluster that grows from 2 to 8 workers, then shrinks to 3."""

    def num_workers(self) -> int:
        return 2 if self.completed < 15 else 8 if self.completed < 40 else 3


def test_asha_follows_a_changing_worker_count_and_replays_it() -> None:
    runner = _Elastic(order_seed=1)
    tuner = asha()
    run(tuner, runner)
    assert [r["n"] for r in runner.log if r["event"] == "workers"] == [2, 8, 3]
    assert runner.max_in_flight == 8
    check_asha_log(runner.log, tuner, 8)
    # resumed on a fixed-size cluster: the logged counts are replayed, then 4 applies
    first = _Elastic(order_seed=1)
    kill_after(asha(), first, 30)
    second = FakeRunner(order_seed=2, workers=4, log=list(first.log))
    tuner = asha()
    run(tuner, second)
    assert [r["n"] for r in second.log if r["event"] == "workers"] == [2, 8, 4]
    check_asha_log(second.log, tuner, 8)


def test_killed_twice_still_replays() -> None:
    runner = FakeRunner(order_seed=1)
    kill_after(asha(), runner, 10)
    runner = FakeRunner(order_seed=2, log=runner.log)
    kill_after(asha(), runner, 40)  # dies while replaying/continuing
    runner = FakeRunner(order_seed=3, log=runner.log)
    tuner = asha()
    run(tuner, runner)
    check_asha_log(runner.log, tuner, 4)


# --------------------------------------------------------------------------- every tuner

SYNC: dict[str, Callable[[], Tuner]] = {
    "grid": lambda: GridSearch(GridSpace({"x": [0.1, 0.4, 0.7, 0.9]}), "acc", steps=8),
    "random": lambda: RandomSearch(SPACE, "acc", steps=8, num_trials=10),
    "sha": lambda: SHA(SPACE, "acc", min_steps=1, max_steps=9, num_trials=18),
    "early_stop": lambda: EarlyStop(SPACE, "acc", schedule=[(2, 9), (4, 3), (8, 1)]),
    "pbt": lambda: PBT(SPACE, "acc", population=6, interval=2, steps=10, seed=4),
}
ASYNC: dict[str, Callable[[], Tuner]] = {
    "hyperband": lambda: Hyperband(SPACE, "acc", min_steps=1, max_steps=9, num_trials=20),
    "async_hyperband": lambda: AsyncHyperband(
        SPACE, "acc", min_steps=1, max_steps=16, num_trials=24
    ),
    "pbt_async": lambda: PBT(
        SPACE, "acc", population=6, interval=2, steps=10, seed=4, synchronous=False
    ),
    "median": lambda: MedianStopping(
        GridSpace({"x": [0.5, 0.7, 0.9]}, fixed={"penalty": [0.0, 0.4]}),
        "acc",
        steps=12,
        num_trials=6,
        eval_every=2,
        min_samples=2,
    ),
}


@pytest.mark.parametrize("name", [*SYNC, *ASYNC])
def test_every_tuner_resumes_without_diverging(name: str) -> None:
    make = {**SYNC, **ASYNC}[name]
    ref = FakeRunner(order_seed=1)
    ref_best = run(make(), ref)
    first = FakeRunner(order_seed=1)
    kill_after(make(), first, 2 if name == "grid" else 7)
    log1 = list(first.log)
    assert 0 < len(log1) < len(ref.log)
    second = FakeRunner(order_seed=2, log=list(log1))
    best = run(make(), second)
    n1 = len([r for r in decisions(log1) if "fp" in r])  # the logged submissions
    assert calls(second)[:n1] == calls(ref)[:n1]
    if name in SYNC:  # completion order cannot change a synchronous tuner's decisions
        assert decisions(second.log) == decisions(ref.log)
        assert best == ref_best
    elif name == "hyperband":  # brackets interleave differently, same decisions per bracket
        assert sorted(map(str, decisions(second.log))) == sorted(map(str, decisions(ref.log)))
        assert best == ref_best
    third = FakeRunner(order_seed=3, log=list(second.log))
    assert run(make(), third) == best
    assert third.log == second.log


# --------------------------------------------------------------------------- divergence


def test_changed_tuner_seed_diverges_with_a_warning_and_goes_on_live() -> None:
    first = FakeRunner(order_seed=1)
    kill_after(asha(seed=1), first, 20)
    second = FakeRunner(order_seed=2, log=list(first.log))
    tuner = asha(seed=2)
    with pytest.warns(ReplayDivergedWarning, match="record 1"):
        asyncio.run(tuner.run(second))
    diverged = [r for r in second.log if r["event"] == "diverged"]
    assert len(diverged) == 1 and diverged[0]["keep"] == 1
    check_asha_log(effective(second.log), tuner, 4)
    # the log written after the divergence replays cleanly
    third = FakeRunner(order_seed=3, log=list(second.log))
    run(asha(seed=2), third)
    assert third.log == second.log


def test_a_trial_that_fails_on_replay_diverges_at_its_completion() -> None:
    first = FakeRunner(order_seed=1)
    kill_after(asha(), first, 20)
    done = [i for i, r in enumerate(first.log) if r["event"] == "done"]
    second = FakeRunner(order_seed=1, log=list(first.log), fail_if=lambda c, h: True)
    with pytest.warns(ReplayDivergedWarning, match="'ok', now 'failed'"):
        asyncio.run(asha().run(second))
    diverged = [r for r in second.log if r["event"] == "diverged"]
    assert diverged[0]["keep"] == done[0]
    assert second.log[len(first.log) + 1] == {"event": "done", "key": 0, "status": "failed"}


# --------------------------------------------------------------------------- helpers


class _Instant:
    """A runner whose results are ready at once."""

    def __init__(self, log: list[dict[str, Any]] | None = None) -> None:
        self.log: list[dict[str, Any]] = [] if log is None else log

    async def submit(self, config: dict[str, Any], hp: dict[str, Any], steps: int) -> TrialResult:
        return TrialResult(config, hp, steps, {"acc": float(steps)}, {})

    def num_workers(self) -> int:
        return 0

    def append_log(self, record: dict[str, Any]) -> None:
        self.log.append(record)

    def read_log(self) -> list[dict[str, Any]]:
        return list(self.log)

    def check(self, config: dict[str, Any], hp: dict[str, Any]) -> None:
        pass

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        pass


def test_wait_first_returns_one_job_at_a_time_smallest_key_first() -> None:
    async def main() -> list[int]:
        ctx = ReplayingRunner(_Instant())
        assert ctx.num_workers() == 1  # never less than one
        trial = Trial(0, {}, {"x": Constant(0.5)})
        jobs = [ctx.submit(trial, s) for s in (3, 1, 2)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert all(j.task.done() for j in jobs)
        order = [j.key for j in await ctx.wait_all(jobs)]
        with pytest.raises(ValueError, match="at least one job"):
            await ctx.wait_first([])
        await ctx.aclose(True)
        return order

    assert asyncio.run(main()) == [0, 1, 2]


def test_diverged_records_truncate_the_log_that_is_replayed() -> None:
    log = [
        {"event": "stop", "trial": 0, "steps": 1},
        {"event": "stop", "trial": 1, "steps": 1},
        {"event": "diverged", "keep": 1, "reason": "test"},
        {"event": "stop", "trial": 2, "steps": 1},
    ]
    ctx = ReplayingRunner(_Instant(list(log)))
    ctx.record("stop", trial=0, steps=1)
    assert ctx.replaying
    ctx.record("stop", trial=2, steps=1)
    assert not ctx.replaying
    ctx.record("stop", trial=3, steps=1)
    assert ctx._runner.log[-1] == {"event": "stop", "trial": 3, "steps": 1}
    assert len(ctx._runner.log) == 5
