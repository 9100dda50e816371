"""Workers that own several devices (``devices_per_worker``): the local executor pins
each worker process to devices of its own, the study plumbs the setting through, and
the trainer sees them. No GPU is needed: device ids are given (``devices=``) or the
visible devices faked, and the trainer reports what it sees."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from stagetree.executors import LocalExecutor, worker_devices
from stagetree.executors import local as local_module
from stagetree.executors.devices import device_groups
from stagetree.hp import Constant
from stagetree.study import Study
from stagetree.trainer import Trainer
from stagetree.work import MetricsReported, WorkerReady

sys.path.insert(0, str(Path(__file__).parent))
from test_local_executor import _batch, _ended, _of, _until


class DeviceProbe(Trainer):
    """Reports the devices its worker owns: ``n`` of them, ``mask`` = sum of ``2**id``,
    and whether ``CUDA_VISIBLE_DEVICES`` lists the same ids."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.t = 0

    def setup(self, hp: Mapping[str, Any]) -> None:
        pass

    def train(self) -> None:
        self.t += 1

    def evaluate(self) -> dict[str, float]:
        ids = worker_devices()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return {
            "t": float(self.t),
            "n": float(len(ids)),
            "mask": float(sum(2 ** int(i) for i in ids)),
            "same": float(visible == ",".join(ids)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t = int(state["t"])


def test_device_groups() -> None:
    ids = ["0", "1", "2", "3", "4", "5"]
    # One device per worker: round-robin, as before (workers may share a device).
    assert device_groups(ids[:2], 1, 3) == ["0", "1", "0"]
    assert device_groups(ids[:2], 1, None) == ["0", "1"]
    assert device_groups([], 1, None) == [None]
    assert device_groups([], 1, 2) == [None, None]
    # k devices per worker: disjoint groups; workers default to devices // k.
    assert device_groups(ids, 2, None) == ["0,1", "2,3", "4,5"]
    assert device_groups(ids, 4, None) == ["0,1,2,3"]
    assert device_groups(ids, 3, 1) == ["0,1,2"]
    with pytest.raises(ValueError, match=r"devices_per_worker=4 needs at least 4 devices, but 2"):
        device_groups(ids[:2], 4, None)
    with pytest.raises(ValueError, match="needs at least 2 devices, but 0 are visible"):
        device_groups([], 2, None)
    with pytest.raises(ValueError, match=r"4 workers x devices_per_worker=2 need 8 devices"):
        device_groups(ids, 2, 4)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="devices_per_worker must be a positive int"):
            device_groups(ids, bad, None)  # type: ignore[arg-type]


def test_local_workers_own_disjoint_devices(tmp_path: Path) -> None:
    """Three workers with two devices each: each worker process sees its own two."""
    with LocalExecutor(
        DeviceProbe,
        checkpoint_dir=tmp_path / "ckpt",
        devices=[3, 4, 5, 6, 7, 8],
        devices_per_worker=2,
        threads_per_worker=1,
    ) as ex:
        assert ex.num_workers == 3 and ex.devices == ["3,4", "5,6", "7,8"]
        _until(ex, lambda ev: len(_of(ev, WorkerReady)) == 3)
        for w in range(3):
            ex.submit(_batch(10 + w, w, 1, node=w + 1, evaluate_at=((w + 1, 1),)))
        events = _until(ex, _ended({10, 11, 12}))
    seen = {e.worker: e.metrics for e in _of(events, MetricsReported)}
    assert {w: (m["n"], int(m["mask"]), m["same"]) for w, m in seen.items()} == {
        0: (2.0, 2**3 + 2**4, 1.0),
        1: (2.0, 2**5 + 2**6, 1.0),
        2: (2.0, 2**7 + 2**8, 1.0),
    }


def test_local_executor_device_errors(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"checkpoint_dir": tmp_path}
    with pytest.raises(ValueError, match=r"devices_per_worker=3 needs at least 3 devices"):
        LocalExecutor(DeviceProbe, devices=["0", "1"], devices_per_worker=3, **kw)
    with pytest.raises(ValueError, match=r"3 workers x devices_per_worker=2 need 6 devices"):
        LocalExecutor(DeviceProbe, 3, devices=["0", "1", "2", "3"], devices_per_worker=2, **kw)
    with pytest.raises(ValueError, match="devices_per_worker must be a positive int"):
        LocalExecutor(DeviceProbe, devices=["0"], devices_per_worker=0, **kw)
    # One device per worker is unchanged: more workers than devices share them.
    ex = LocalExecutor(DeviceProbe, 3, devices=["0", "1"], **kw)
    assert ex.devices == ["0", "1", "0"] and ex.devices_per_worker == 1
    ex.close()


def _probe_study(tmp_path: Path, name: str, **kw: Any) -> Study:
    return Study(
        name,
        DeviceProbe,
        storage=f"sqlite:///{tmp_path}/plan.db",
        checkpoint_dir=tmp_path / "ckpt",
        threads_per_worker=1,
        **kw,
    )


def test_study_devices_per_worker_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Study(devices_per_worker=2)`` on four visible devices: two workers, each trial
    trained on one worker's own pair."""
    monkeypatch.setattr(local_module, "_visible_cuda_devices", lambda: ["0", "1", "2", "3"])
    with _probe_study(tmp_path, "pairs", devices_per_worker=2) as study:

        async def main() -> list[Any]:
            runs = [study.submit({"seed": s}, {"lr": Constant(0.1)}, 2) for s in range(4)]
            return list(await asyncio.gather(*runs))

        results = asyncio.run(main())
        assert study.num_workers == 2
    assert all(r.metrics["n"] == 2.0 and r.metrics["same"] == 1.0 for r in results)
    assert {int(r.metrics["mask"]) for r in results} <= {0b0011, 0b1100}


def test_study_devices_per_worker_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, 1.5, True, None):
        with pytest.raises(ValueError, match="devices_per_worker must be an int >= 1"):
            _probe_study(tmp_path, "bad", devices_per_worker=bad)
    monkeypatch.setattr(local_module, "_visible_cuda_devices", lambda: ["0", "1", "2"])
    with (
        _probe_study(tmp_path, "toomany", workers=2, devices_per_worker=2) as study,
        pytest.raises(ValueError, match=r"2 workers x devices_per_worker=2 need 4 devices"),
    ):
        study.run({"seed": 0}, {"lr": Constant(0.1)}, 1)
    with (
        _probe_study(tmp_path, "inline", executor="inline", devices_per_worker=2) as study,
        pytest.raises(ValueError, match="inline executor"),
    ):
        study.run({"seed": 0}, {"lr": Constant(0.1)}, 1)


def test_simulated_study_devices_per_worker() -> None:
    """``Study(executor="simulated", devices_per_worker=k)`` builds k-device simulated
    workers."""
    from stagetree.executors.simulated import SimulatedExecutor, SimulatedTrainer

    with Study(
        "sim", SimulatedTrainer, storage="memory://", executor="simulated", devices_per_worker=4
    ) as study:
        study.run({"seed": 0}, {"lr": Constant(0.1)}, 3)
        executor = study._engine.executor
        assert isinstance(executor, SimulatedExecutor) and executor.devices_per_worker == 4
        assert executor.device_seconds == pytest.approx(4 * sum(executor.busy_seconds))
        # The study's accounting counts the four devices too.
        assert study.stats()["device_seconds"] == pytest.approx(executor.device_seconds)


def test_worker_devices_reads_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert worker_devices() == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert worker_devices() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert worker_devices() == []


def _cuda_devices() -> int:
    """How many CUDA devices torch sees here (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class CudaProbe(DeviceProbe):
    """DeviceProbe that also trains on the worker's first CUDA device, and reports how
    many devices torch sees inside the worker."""

    def train(self) -> None:
        import torch

        x = torch.arange(4.0, device="cuda:0")
        self.t += int((x * 2).sum().item() == 12.0)

    def evaluate(self) -> dict[str, float]:
        import torch

        return {**super().evaluate(), "torch_sees": float(torch.cuda.device_count())}


@pytest.mark.skipif(_cuda_devices() == 0, reason="needs CUDA")
def test_workers_pinned_to_real_cuda_devices(tmp_path: Path) -> None:
    """On a real GPU machine: one worker per device, each sees exactly its own device
    (torch counts one), trains on it, and ``worker_devices()`` names it; with all the
    devices per worker, one worker sees them all."""
    count = _cuda_devices()
    with Study(
        "cuda",
        CudaProbe,
        storage=f"sqlite:///{tmp_path}/plan.db",
        checkpoint_dir=tmp_path / "ckpt",
        threads_per_worker=1,
    ) as study:

        async def main() -> list[Any]:
            runs = [study.submit({"seed": s}, {"lr": Constant(0.1)}, 2) for s in range(count)]
            return list(await asyncio.gather(*runs))

        results = asyncio.run(main())
        assert study.num_workers == count
    for r in results:
        assert (r.metrics["t"], r.metrics["n"], r.metrics["torch_sees"]) == (2.0, 1.0, 1.0)
        assert r.metrics["same"] == 1.0
    with Study(
        "cuda-all",
        CudaProbe,
        storage=f"sqlite:///{tmp_path}/all.db",
        checkpoint_dir=tmp_path / "ckpt-all",
        devices_per_worker=count,
    ) as study:
        result = study.run({"seed": 0}, {"lr": Constant(0.1)}, 2)
        assert study.num_workers == 1
    assert (result.metrics["n"], result.metrics["torch_sees"]) == (float(count), float(count))
    with (
        Study(
            "cuda-toomany",
            CudaProbe,
            storage=f"sqlite:///{tmp_path}/over.db",
            devices_per_worker=count + 1,
        ) as study,
        pytest.raises(ValueError, match=f"devices_per_worker={count + 1} needs at least"),
    ):
        study.run({"seed": 0}, {"lr": Constant(0.1)}, 1)
