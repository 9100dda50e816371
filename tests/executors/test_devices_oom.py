"""Device needs and out-of-memory recovery end to end (TreeML §5.2), on CPU: local
worker processes pinned to faked device ids (a mixed cluster), and trainers that raise
the real ``torch.cuda.OutOfMemoryError`` when their worker has too few devices."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from stagetree.exceptions import TrialFailedError
from stagetree.executors import local as local_module
from stagetree.executors.devices import (
    device_count,
    device_groups,
    is_out_of_memory,
    trainer_devices,
    worker_devices,
)
from stagetree.hp import Constant
from stagetree.plan.scopes import devices_scope, learned_devices
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.tools.simulate import simulate
from stagetree.trainer import Trainer
from stagetree.tuners import GridSearch

torch = pytest.importorskip("torch")


class NeedsTwoDevices(Trainer):
    """Runs out of memory (the real CUDA exception class) on a worker with fewer than
    ``config["need"]`` devices; every out-of-memory error is logged to a file, so that
    a test can count them across worker processes."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.t = 0

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = float(hp["lr"])

    def train(self) -> None:
        if len(worker_devices()) < int(self.config["need"]):
            with open(self.config["log"], "a") as log:
                log.write(f"{','.join(worker_devices())}\n")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        self.t += 1

    def evaluate(self) -> dict[str, float]:
        return {"t": float(self.t), "n": float(len(worker_devices()))}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t = int(state["t"])


class DeclaresItsNeed(NeedsTwoDevices):
    """Declares what it needs, as a function of the fixed config."""

    @staticmethod
    def devices_needed(config: Mapping[str, Any]) -> int:
        return int(config["need"])


def _study(tmp_path: Path, trainer: type, devices: list[int], name: str = "oom") -> Study:
    return Study(
        name,
        trainer,
        storage=f"sqlite:///{tmp_path}/plan.db",
        checkpoint_dir=tmp_path / "ckpt",
        threads_per_worker=1,
        devices_per_worker=devices,
    )


def _run(study: Study, config: dict[str, Any], lrs: list[float]) -> list[Any]:
    async def main() -> list[Any]:
        runs = [study.submit(config, {"lr": Constant(lr)}, 3) for lr in lrs]
        return list(await asyncio.gather(*runs))

    return asyncio.run(main())


def test_helpers() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    wrapped = ValueError("step failed")
    wrapped.__cause__ = torch.cuda.OutOfMemoryError("x")
    assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(None)
    assert trainer_devices(NeedsTwoDevices, {"need": 2}) == 1
    assert trainer_devices(DeclaresItsNeed, {"need": 3}) == 3

    class Fixed(Trainer):
        devices_needed = 4

    assert trainer_devices(Fixed, {}) == 4
    Fixed.devices_needed = 0
    with pytest.raises(ValueError, match="devices_needed must be a positive int"):
        trainer_devices(Fixed, {})
    assert device_count(None) == 1 and device_count("") == 1 and device_count("3,4") == 2
    assert device_groups(["a", "b", "c", "d"], [1, 2], None) == ["a", "b,c"]
    with pytest.raises(ValueError, match=r"needs 5 devices, but 4"):
        device_groups(["a", "b", "c", "d"], [1, 4], None)
    with pytest.raises(ValueError, match="lists 2 workers, but num_workers=3"):
        device_groups(["a", "b", "c"], [1, 2], 3)


def test_out_of_memory_retries_on_twice_the_devices_and_is_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixed cluster of a one-device and a two-device worker: a trial that needs two
    devices runs out of memory on the small one, is trained again on the large one, and
    the need is kept in the plan, so that a second run of the study (same tree) goes to
    the large worker at once."""
    monkeypatch.setattr(local_module, "_visible_cuda_devices", lambda: ["0", "1", "2"])
    log = tmp_path / "oom.log"
    config = {"need": 2, "log": str(log)}
    with _study(tmp_path, NeedsTwoDevices, [1, 2]) as study:
        (result,) = _run(study, config, [0.1])
        assert study.num_workers == 2
        root_key = study._engine.storage.root_keys()[0]
        assert learned_devices(study._engine.storage.stats(devices_scope(root_key))) == 2
    assert result.metrics == {"t": 3.0, "n": 2.0}
    assert log.read_text().splitlines() == ["0"]  # once, on the one-device worker
    # Another run on the same storage: the need is read from the plan.
    with _study(tmp_path, NeedsTwoDevices, [1, 2]) as study:
        results = _run(study, config, [0.2, 0.3])
    assert [r.metrics["n"] for r in results] == [2.0, 2.0]
    assert log.read_text().splitlines() == ["0"]  # no new out-of-memory error


def test_a_declared_need_never_goes_to_a_smaller_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "_visible_cuda_devices", lambda: ["0", "1", "2"])
    log = tmp_path / "oom.log"
    with _study(tmp_path, DeclaresItsNeed, [1, 2]) as study:
        results = _run(study, {"need": 2, "log": str(log)}, [0.1, 0.2])
    assert [r.metrics["n"] for r in results] == [2.0, 2.0]
    assert not log.exists()


def test_out_of_memory_on_the_largest_worker_fails_naming_the_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "_visible_cuda_devices", lambda: ["0", "1", "2"])
    config = {"need": 4, "log": str(tmp_path / "oom.log")}
    with (
        _study(tmp_path, NeedsTwoDevices, [1, 2]) as study,
        pytest.raises(TrialFailedError, match="needs more than 2 devices"),
    ):
        study.run(config, {"lr": Constant(0.1)}, 3)
    with (
        _study(tmp_path, DeclaresItsNeed, [1, 2], name="declared") as study,
        pytest.raises(TrialFailedError, match="needs 4 devices per worker, but the largest"),
    ):
        study.run(config, {"lr": Constant(0.1)}, 3)


def test_simulator_models_needs_and_a_mixed_cluster() -> None:
    """Trials whose model needs two devices (``memory_devices``) on a cluster of one-
    and two-device workers: the tree that needs two runs out of memory once, learns it,
    and trains on the two-device worker; results are those of any cluster."""

    def grid() -> GridSearch:
        space = GridSpace(
            hp={"lr": [Constant(0.1), Constant(0.2), Constant(0.3)]},
            fixed={"width": [1, 2]},
        )
        return GridSearch(space, "accuracy", steps=12)

    kw: dict[str, Any] = {"memory_devices": lambda config: int(config["width"])}
    mixed = simulate(None, grid(), devices_per_worker=[1, 1, 2], **kw)
    assert mixed.workers == 3 and mixed.worker_devices == (1, 1, 2) and mixed.devices == 4
    assert mixed.trials == 6
    large = simulate(None, grid(), workers=2, devices_per_worker=2, **kw)
    assert mixed.best == large.best  # the same results on any cluster
    small = simulate(None, grid(), workers=2, **kw)
    assert small.best is not None and small.best.config["width"] == 1  # width 2 failed
