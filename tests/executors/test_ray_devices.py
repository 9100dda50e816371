"""Ray workers that own several GPUs: ``worker_resources={"GPU": k}`` (or a study's
``devices_per_worker=k``) gives each actor k GPUs of its own, which its trainer sees
through ``CUDA_VISIBLE_DEVICES``. A one-machine Ray declaring four logical GPUs (no GPU
needed: Ray assigns logical GPU ids and sets the variable all the same)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_local import private_ray

from stagetree import Study
from stagetree.hp import Constant
from stagetree.work import MetricsReported, WorkerReady

sys.path.insert(0, str(Path(__file__).parent))
from test_devices import DeviceProbe
from test_local_executor import _batch, _ended, _of, _until


@pytest.fixture(scope="module")
def ray_gpus() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray cluster already")
    with private_ray(ray, num_cpus=2, num_gpus=4):
        yield ray


def _mask(metrics: dict[str, float]) -> tuple[float, int, float]:
    return metrics["n"], int(metrics["mask"]), metrics["same"]


def test_actors_with_two_gpus_see_two_of_their_own(ray_gpus: Any, tmp_path: Path) -> None:
    from stagetree.executors.ray import RayExecutor

    # No worker count: as many actors as fit, 4 GPUs / 2.
    with RayExecutor(DeviceProbe, checkpoint_dir=tmp_path, worker_resources={"GPU": 2}) as ex:
        assert ex.num_workers == 2
        _until(ex, lambda ev: len(_of(ev, WorkerReady)) == 2)
        for w in range(2):
            ex.submit(_batch(10 + w, w, 1, node=w + 1, evaluate_at=((w + 1, 1),)))
        events = _until(ex, _ended({10, 11}))
    seen = [_mask(e.metrics) for e in _of(events, MetricsReported)]
    assert len(seen) == 2 and all(n == 2.0 and same == 1.0 for n, _, same in seen)
    a, b = (mask for _, mask, _ in seen)
    assert a & b == 0 and a | b == 0b1111  # disjoint pairs of the four GPUs


def test_study_devices_per_worker_asks_ray_for_k_gpus(ray_gpus: Any, tmp_path: Path) -> None:
    with Study(
        "ray-pairs",
        DeviceProbe,
        storage=f"sqlite:///{tmp_path}/p.db",
        executor="ray",
        devices_per_worker=4,
    ) as study:

        async def main() -> list[Any]:
            runs = [study.submit({"seed": s}, {"lr": Constant(0.1)}, 1) for s in range(2)]
            return list(await asyncio.gather(*runs))

        results = asyncio.run(main())
        assert study.num_workers == 1  # one actor holds all four GPUs
        # Device-seconds count the actor's four GPUs.
        assert study._engine.executor.devices_per_worker == 4  # type: ignore[union-attr]
    assert [_mask(r.metrics) for r in results] == [(4.0, 0b1111, 1.0)] * 2
