"""The tuners' bookkeeping at scale: per-decision work that does not walk the study."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from typing import Any

from stagetree.hp import Constant
from stagetree.ranking import ranked_ids
from stagetree.tuners import ReplayingRunner, Trial, TrialResult
from stagetree.tuners.asha import _RungRank


class _Instant:
    """A runner whose results are ready after one loop turn."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []

    async def submit(self, config: dict[str, Any], hp: dict[str, Any], steps: int) -> TrialResult:
        await asyncio.sleep(0)
        return TrialResult(config, hp, steps, {"acc": float(steps)}, {})

    def num_workers(self) -> int:
        return 1

    def append_log(self, record: dict[str, Any]) -> None:
        self.log.append(record)

    def read_log(self) -> list[dict[str, Any]]:
        return []

    def check(self, config: dict[str, Any], hp: dict[str, Any]) -> None:
        pass

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        pass


class _Unwalkable(dict):  # type: ignore[type-arg]
    """Jobs in flight that may be looked up but not walked: walking them per decision
    costs O(jobs in flight), which is what wait_first must not do."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("wait_first walked every job in flight")

    def keys(self) -> Any:
        raise AssertionError("wait_first walked every job in flight")


def test_wait_first_looks_jobs_up_without_walking_the_jobs_in_flight() -> None:
    async def main() -> list[int]:
        ctx = ReplayingRunner(_Instant())
        trial = Trial(0, {}, {"x": Constant(0.5)})
        in_flight = _Unwalkable()
        for s in (3, 1, 2, 5):
            in_flight[ctx.submit(trial, s)] = None
        order = []
        while len(in_flight):
            job = await ctx.wait_first(in_flight)
            dict.__delitem__(in_flight, job)
            order.append(job.key)
        await ctx.aclose(True)
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3]


def _brute_promotable(values: dict[int, float], promoted: set[int], eta: int) -> int | None:
    for tid in ranked_ids(values)[: len(values) // eta]:
        if values[tid] > -math.inf and tid not in promoted:
            return tid
    return None


def test_incremental_rung_ranks_as_the_sorted_rung_does() -> None:
    rng = random.Random(7)
    for eta in (2, 3, 4):
        rank = _RungRank(eta)
        values: dict[int, float] = {}
        promoted: set[int] = set()
        for tid in range(400):
            # ties, failures (-inf) and ordinary values
            value = rng.choice([-math.inf, 0.5, float(rng.randint(0, 20)), rng.random()])
            values[tid] = value
            rank.add(tid, value)
            ordered = sorted(values.values(), reverse=True)
            assert rank.threshold() == ordered[max(1, len(values) // eta) - 1]
            while True:
                want = _brute_promotable(values, promoted, eta)
                assert rank.promotable() == want
                if want is None or rng.random() < 0.3:
                    break
                rank.promote()
                promoted.add(want)


def test_median_reached_keeps_the_running_averages_per_step_as_trials_advance() -> None:
    # compare="reached" takes the median over every trial that reached the step: the
    # averages are kept sorted per checked step and updated from the trials whose
    # history changed, so a check neither scans every trial nor re-averages them all.
    import statistics
    from types import SimpleNamespace

    from stagetree.tuners import MedianStopping

    rng = random.Random(5)
    tuner = MedianStopping(None, "acc", steps=8, num_trials=10**6, compare="reached")
    averaged: list[int] = []
    plain = MedianStopping._average
    tuner._average = lambda hist, step: (averaged.append(1), plain(hist, step))[1]  # type: ignore[method-assign]
    curves: dict[int, dict[int, float]] = {}

    def report(tid: int, steps: int) -> None:  # a chunk of trial ``tid`` ends at ``steps``
        curve = curves.setdefault(tid, {})
        for s in range(1, steps + 1):
            curve.setdefault(s, rng.choice([rng.random(), -math.inf, 0.5]))
        if rng.random() < 0.05:  # a point below the end reported again, changed
            curve[rng.randint(1, steps)] = rng.random()
        history = {s: {"acc": v} for s, v in curve.items()}
        result = TrialResult({}, {}, steps, {"acc": curve[steps]}, history)
        tuner._merge(tid, SimpleNamespace(result=lambda: result))  # type: ignore[arg-type]

    def scan(tid: int, step: int) -> bool:  # the rule as a scan of every trial
        own = [v for s, v in tuner._history.get(tid, {}).items() if s <= step]
        best = max(own, default=-math.inf)
        averages = []
        for other, hist in tuner._history.items():
            if other != tid and hist and max(hist) >= step:
                avg = plain(hist, step)
                if avg is not None:
                    averages.append(avg)
        return len(averages) >= tuner.min_samples and best < statistics.median(averages)

    for tid in range(400):
        report(tid, 2)
        other = rng.randrange(tid + 1)
        reached = max(curves[other])
        if reached < 8:
            report(other, reached + 2)
        for probe in (tid, other):
            step = max(curves[probe])
            before = len(averaged)
            assert tuner.should_stop(probe, step) == scan(probe, step)
            assert len(averaged) - before <= 2 * 4  # the changed trials, per checked step
