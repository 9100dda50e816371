"""Fair share end to end in one process: two studies on one engine (same storage and
trainer), three local worker processes, weights 2:1. While both have pending work, the
workers' time splits about 2:1; a stage both need is trained once (the union of their
steps is executed exactly once); a study alone gets every worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from study_trainers import SlowLinearTrainer

from stagetree import Study, open_storage
from stagetree.hp import Constant, MultiStep
from stagetree.plan.scopes import study_scope
from stagetree.stages import unique_steps

STEPS = 40


def _trials(seeds: range, shared: list[int]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"seed": 0}, {"lr": MultiStep(0.05, [m], 0.5)}) for m in shared
    ]
    return out + [({"seed": s}, {"lr": Constant(0.03)}) for s in seeds]


def test_two_studies_on_one_engine_split_the_workers_by_weight(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    heavy = Study("heavy", SlowLinearTrainer, storage=url, workers=3, weight=2.0)
    light = Study("light", SlowLinearTrainer, storage=url, workers=3, weight=1.0)
    a_trials = _trials(range(10, 22), [20, 30])
    b_trials = _trials(range(30, 42), [30])
    snapshots: list[tuple[float, float]] = []

    async def watch(tasks: list[asyncio.Future[Any]]) -> None:
        while not all(t.done() for t in tasks):
            with heavy._engine.reading() as storage:
                a = storage.stats(study_scope("heavy", heavy.version)).get("steps_executed", 0)
                b = storage.stats(study_scope("light", light.version)).get("steps_executed", 0)
                states = [t["state"] for n in ("heavy", "light") for t in storage.trials(n)]
            light_pending = [t for t in tasks[len(a_trials) :] if not t.done()]
            heavy_pending = [t for t in tasks[: len(a_trials)] if not t.done()]
            if light_pending and heavy_pending and states:
                snapshots.append((a, b))
            await asyncio.sleep(0.1)

    async def main() -> None:
        heavy._engine.ensure_started()
        tasks = [asyncio.ensure_future(heavy.submit(c, h, STEPS)) for c, h in a_trials]
        tasks += [asyncio.ensure_future(light.submit(c, h, STEPS)) for c, h in b_trials]
        await asyncio.gather(watch(tasks), *tasks)

    try:
        t0 = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - t0 < 120
    finally:
        heavy.close()
        light.close()
    with open_storage(url, readonly=True) as storage:
        trials = storage.trials("heavy") + storage.trials("light")
        nodes = {n.id: n for r in {t["root_key"] for t in trials} for n in storage.nodes(r)}
        unique = unique_steps(nodes, [(t["node"], t["step"]) for t in trials])
        assert storage.stats("engine")["steps_executed"] == unique  # shared once
    a, b = snapshots[-1]
    assert b > 0 and 1.3 <= a / b <= 3.2, snapshots


class _Doubled(SlowLinearTrainer):
    """Another trainer (another model): the loss of twice the targets."""

    def evaluate(self) -> dict[str, float]:
        out = super().evaluate()
        return {k: 2 * v for k, v in out.items()}


def test_studies_of_two_trainers_share_one_worker_pool(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    one = Study("one", SlowLinearTrainer, storage=url, workers=2)
    two = Study("two", _Doubled, storage=url, workers=2)
    trials = _trials(range(1, 4), [5])

    async def main() -> list[Any]:
        return list(
            await asyncio.gather(
                *(one.submit(c, h, 10) for c, h in trials),
                *(two.submit(c, h, 10) for c, h in trials),
            )
        )

    try:
        results = asyncio.run(main())
        assert one._engine is two._engine  # one engine, one pool of two workers
        assert one.num_workers == 2
    finally:
        one.close()
        two.close()
    with Study("alone", SlowLinearTrainer, storage="memory://", executor="inline") as ref:
        alone = [ref.run(c, h, 10).metrics for c, h in trials]
    assert [r.metrics for r in results[: len(trials)]] == alone
    assert [r.metrics for r in results[len(trials) :]] == [
        {k: 2 * v for k, v in m.items()} for m in alone
    ]


def test_a_study_joining_an_engine_is_told_which_arguments_it_ignores(tmp_path: Path) -> None:
    import warnings

    import pytest

    from stagetree.exceptions import StagetreeWarning

    url = f"sqlite:///{tmp_path}/plan.db"
    first = Study("a", SlowLinearTrainer, storage=url, executor="inline", eval_every=1)
    other = Study("b", SlowLinearTrainer, storage=url, executor="inline", eval_every=3)
    same = Study("c", SlowLinearTrainer, storage=url, executor="inline", eval_every=1)
    try:
        first.open()
        with pytest.warns(StagetreeWarning, match=r"eval_every=3 \(it uses 1\) ignored"):
            other.open()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            same.open()  # the same arguments: nothing to say
    finally:
        for study in (first, other, same):
            study.close()
