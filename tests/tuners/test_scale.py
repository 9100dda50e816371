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
