"""RayExecutor faults (issue 23): a start is bounded (``ray.init`` included) and a failed
one is tried again by the next run; idle workers give their resources back and are
taken back on demand. A one-machine Ray of the module's own with one CPU."""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_local import private_ray

import stagetree.executors.ray as ray_module
from stagetree import Study
from stagetree.exceptions import ExecutorError
from stagetree.executors.ray import RayExecutor
from stagetree.hp import Constant

# The executor tests' trainer, from their module.
sys.path.insert(0, str(Path(__file__).parent))
from test_ray_executor import Adder

pytestmark = pytest.mark.timeout(180)


class _SilentRay:
    """A ``ray`` module whose ``init`` never returns (a cluster that accepts the
    connection and never answers, or a loopback address Ray rewrote)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.initialized = False

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **kwargs: Any) -> None:
        self.gate.wait()

    def shutdown(self) -> None:
        self.initialized = False


def test_ray_init_that_never_answers_fails_within_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    silent = _SilentRay()
    monkeypatch.setattr(ray_module, "import_ray", lambda: silent)
    monkeypatch.setattr(ray_module, "_probe", lambda address, timeout=5.0: None)
    try:
        ex = RayExecutor(
            Adder, 1, address="127.0.0.1:6379", checkpoint_dir=tmp_path, start_timeout=1
        )
        with pytest.raises(
            ExecutorError, match=r"no answer from a Ray cluster at '127.0.0.1:6379'"
        ) as err:
            ex.start()
        assert "loopback" in str(err.value) and "--node-ip-address" in str(err.value)
        other = RayExecutor(
            Adder, 1, address="10.0.0.1:6379", checkpoint_dir=tmp_path, start_timeout=1
        )
        with pytest.raises(ExecutorError, match=r"within 1 s") as err:
            other.start()
        assert "loopback" not in str(err.value)
    finally:
        silent.gate.set()


def test_an_executor_that_connects_itself_trains_and_shuts_its_ray_down(tmp_path: Path) -> None:
    # ray.init runs in a thread of the executor's (bounded by start_timeout): the Ray
    # it started answers the driver thread's calls, and close() shuts it down.
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray cluster already")
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    init = {"num_cpus": 1, "include_dashboard": False, "log_to_driver": False, "_temp_dir": folder}
    executor = RayExecutor(address="local", num_workers=1, start_timeout=120, init_kwargs=init)
    url = f"sqlite:///{tmp_path / 'p.db'}"
    try:
        with Study("own", Adder, storage=url, executor=executor) as study:
            assert study.run({}, {"lr": Constant(0.5)}, 4).metrics["total"] == 2.0
            assert ray.is_initialized()
        assert not ray.is_initialized()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def one_cpu() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray cluster already")
    with private_ray(ray, num_cpus=1):
        yield ray


def _free_cpus(ray: Any, want: float, within: float = 60.0) -> bool:
    """Wait until the cluster has ``want`` CPUs free (False when it has not by then)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= want:
            return True
        time.sleep(0.1)
    return False


def test_a_start_that_times_out_while_the_cpus_are_held_is_tried_again(
    one_cpu: Any, tmp_path: Path
) -> None:
    ray = one_cpu

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> bool:
            return True

    holder = Holder.remote()
    assert ray.get(holder.ping.remote(), timeout=60)
    executor = RayExecutor(worker_resources={"CPU": 1}, num_workers=1, start_timeout=2)
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Study("held", Adder, storage=url, executor=executor) as study:
        with pytest.raises(ExecutorError, match=r"no worker actor started within 2 s"):
            study.run({}, {"lr": Constant(0.5)}, 4)
        ray.kill(holder)
        assert _free_cpus(ray, 1.0)
        # The next start makes a new executor from the study's (a slow machine may take
        # over 2 s to start an actor: no time limit needed to show the retry).
        executor.start_timeout = 120
        # The same study, once the cluster has room: started again, trained.
        assert study.run({}, {"lr": Constant(0.5)}, 4).metrics["total"] == 2.0
        assert study.run({}, {"lr": Constant(0.25)}, 4).metrics["total"] == 1.0


def test_idle_workers_are_released_and_taken_back(one_cpu: Any, tmp_path: Path) -> None:
    ray = one_cpu
    assert _free_cpus(ray, 1.0)
    executor = RayExecutor(worker_resources={"CPU": 1}, num_workers=1, idle_release=0.5)
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Study("idle", Adder, storage=url, executor=executor) as study:
        assert study.run({}, {"lr": Constant(0.5)}, 4).metrics["total"] == 2.0
        # Idle: the actor stops and the CPU goes back to the cluster.
        assert _free_cpus(ray, 1.0), "the idle worker kept its CPU"
        # On demand: a new actor, and training continues from the plan.
        assert study.run({}, {"lr": Constant(0.5)}, 8).metrics["total"] == 4.0
        assert _free_cpus(ray, 1.0)
        assert study.run({}, {"lr": Constant(1.0)}, 3).metrics["total"] == 3.0
