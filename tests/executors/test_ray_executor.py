"""RayExecutor: bad input refused with an error naming the problem, before any work;
studies and the command line choose it by name or as an object. A one-machine Ray
(``num_cpus=2``) for the module."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from ray_local import private_ray

from stagetree import Study, extras
from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import ExecutorError
from stagetree.executors import executor_names, make_executor
from stagetree.executors.base import ExecutorOptions
from stagetree.executors.ray import RayExecutor
from stagetree.hp import Constant
from stagetree.trainer import Trainer


class Adder(Trainer):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.total = 0.0
        self.lr = 0.0

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = hp.get("lr", self.lr)

    def train(self) -> None:
        self.total += self.lr

    def evaluate(self) -> dict[str, float]:
        return {"total": self.total}

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.total = float(state["total"])


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    with private_ray(ray, num_cpus=2):
        yield ray


def test_unknown_executor_name_lists_the_known_ones(tmp_path: Path) -> None:
    assert "ray" in executor_names()
    with pytest.raises(ValueError, match=r"unknown executor 'rey'.*'ray'"):
        Study("s", Adder, storage=f"sqlite:///{tmp_path}/p.db", executor="rey")
    assert not (tmp_path / "p.db").exists()


def test_ray_not_installed_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    # Installed from an index: the extra's name is what installs it.
    monkeypatch.setattr(extras, "installation", lambda: extras.Installation("index"))
    ex = RayExecutor(Adder, 1, checkpoint_dir=tmp_path)
    with pytest.raises(ExecutorError, match=r"pip install 'stagetree\[ray\]'"):
        ex.start()
    # Through a study: refused at its first submission, before any training.
    study = Study("s", Adder, storage=f"sqlite:///{tmp_path}/p.db", executor="ray")
    try:
        with pytest.raises(ExecutorError, match=r"stagetree\[ray\]"):
            study.run({}, {"lr": Constant(1.0)}, 2)
    finally:
        study.close()


def test_no_cluster_at_the_address(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray cluster already")
    ex = RayExecutor(Adder, 1, address="127.0.0.1:9", checkpoint_dir=tmp_path)
    with pytest.raises(ExecutorError, match=r"no Ray cluster at '127.0.0.1:9'.*ray start --head"):
        ex.start()
    assert not ray.is_initialized()


def test_resources_no_node_has_are_refused(ray_runtime: Any, tmp_path: Path) -> None:
    ex = RayExecutor(Adder, 1, checkpoint_dir=tmp_path, worker_resources={"GPU": 1})
    with pytest.raises(ExecutorError, match=r"no node of the Ray cluster has .*'GPU': 1"):
        ex.start()
    ex = RayExecutor(Adder, 1, checkpoint_dir=tmp_path, worker_resources={"CPU": 64})
    with pytest.raises(ExecutorError, match="would wait forever"):
        ex.start()
    with pytest.raises(ValueError, match="worker_resources"):
        RayExecutor(Adder, worker_resources={})
    with pytest.raises(ValueError, match="lists 2 workers but num_workers=3"):
        RayExecutor(Adder, 3, worker_resources=[{"CPU": 1}, {"CPU": 1}])


class _DriverOnlyStore(CheckpointStore):
    """A checkpoint location that exists only for the driver: workers unpickle it as
    another (empty) directory, as a local path looks from another machine."""

    elsewhere = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (CheckpointStore, (self.elsewhere, self.budget_bytes))


def test_checkpoint_location_workers_cannot_reach_is_refused(
    ray_runtime: Any, tmp_path: Path
) -> None:
    store = _DriverOnlyStore(tmp_path / "driver")
    store.elsewhere = str(tmp_path / "worker-view")
    ex = RayExecutor(Adder, 1, checkpoint_dir=store)
    with pytest.raises(ExecutorError, match=r"cannot reach the checkpoint location .*shared"):
        ex.start()
    # The marker is removed again; a location every worker reaches is accepted (one
    # machine: a local path is reachable).
    assert store.refs() == []
    with RayExecutor(Adder, 1, checkpoint_dir=tmp_path / "shared") as ok:
        assert ok.num_workers == 1


def test_trainer_that_cannot_be_pickled_names_the_attribute(tmp_path: Path) -> None:
    class Locked(Adder):
        guard = threading.Lock()

    with pytest.raises(ValueError, match=r"attribute .*Locked\.guard cannot be pickled"):
        RayExecutor(Locked, 1, checkpoint_dir=tmp_path)


def test_worker_versions_that_differ_from_the_driver_are_refused(
    ray_runtime: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagetree.executors.ray as ray_module

    real = ray_module._versions()
    monkeypatch.setattr(ray_module, "driver_versions", lambda: {"python": "3.9.1", "ray": "2.0.0"})
    ex = RayExecutor(Adder, 1, checkpoint_dir=tmp_path)
    pattern = (
        rf"runs Python {real['python']} with Ray {real['ray']}, but this driver runs "
        r"Python 3\.9\.1 with Ray 2\.0\.0"
    )
    with pytest.raises(ExecutorError, match=pattern):
        ex.start()


def test_executor_object_is_bound_to_the_study(ray_runtime: Any, tmp_path: Path) -> None:
    given = RayExecutor(worker_resources={"CPU": 1}, num_workers=2)
    options = ExecutorOptions(Adder, None, tmp_path, None)
    bound = make_executor(given, options)
    assert isinstance(bound, RayExecutor) and bound is not given
    assert bound.num_workers == 2 and bound.spec is not None
    with pytest.raises(ValueError, match="needs a trainer"):
        given.start()
    study = Study("bound", Adder, storage=f"sqlite:///{tmp_path}/p.db", executor=given)
    try:
        result = study.run({}, {"lr": Constant(0.5)}, 4)
        assert result.metrics["total"] == 2.0
        locations = study._engine.executor.worker_locations()  # type: ignore[union-attr]
        assert sorted(locations) == [0, 1]
    finally:
        study.close()


def test_cli_run_on_ray_and_status_shows_the_nodes(
    ray_runtime: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The command line tests' script writer, from their own test folder.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
    from test_cli_run import _script

    from stagetree.cli import main
    from stagetree.engine.settings import Overrides, current_overrides

    url = f"sqlite:///{tmp_path / 'plan.db'}"
    path = _script(
        tmp_path,
        """
        tuner = GridSearch(space, metric="score", steps=10)
        study = Study("tiny", Tiny, storage="sqlite:///unused.db", executor="inline")
        """,
    )
    ckpt = tmp_path / "shared-ckpt"
    args = ["run", str(path), "--executor", "ray", "--checkpoints", str(ckpt)]
    assert main([*args, "--storage", url, "--workers", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "best score" in out and "workers lost" not in out
    assert list(ckpt.iterdir()), "checkpoints went elsewhere"
    assert current_overrides() == Overrides()
    assert main(["status", "--storage", url]) == 0
    status = capsys.readouterr().out
    assert "workers" in status and "(node " in status and "(last seen)" in status
    assert main([*args, "--executor", "rey", "--storage", url]) == 2
    assert "unknown executor 'rey'" in capsys.readouterr().err


def test_core_imports_without_ray_and_exports_the_intended_names() -> None:
    import subprocess

    import stagetree.executors as executors

    assert sorted(executors.__all__) == [
        "BaseExecutor",
        "ExecutorOptions",
        "InlineExecutor",
        "LocalExecutor",
        "RayExecutor",
        "SimulatedExecutor",
        "TrainerSpec",
        "executor_names",
        "make_executor",
        "register_executor",
        "worker_devices",
    ]
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import stagetree, stagetree.cli, stagetree.executors\n"
        "from stagetree.executors import RayExecutor\n"
        "RayExecutor(worker_resources={'CPU': 1})\n"
        "assert 'ray' in stagetree.executors.executor_names()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_progress_display_shows_where_workers_run() -> None:
    import io

    from stagetree.progress import ProgressDisplay, progress_line

    class FakeStudy:
        def progress(self) -> dict[str, float]:
            return {"trials": 2, "finished": 1, "steps_requested": 20, "steps_executed": 5}

        def worker_locations(self) -> dict[int, str]:
            return {1: "b (node 222)", 0: "a (node 111)"}

    display = ProgressDisplay(FakeStudy(), out=io.StringIO(), rich_output=False)
    state = display.poll()
    assert state is not None
    assert state.workers == ("0 on a (node 111)", "1 on b (node 222)")
    assert progress_line(state).endswith("| workers 0 on a (node 111), 1 on b (node 222)")


def test_default_resources_and_how_trainers_travel(tmp_path: Path) -> None:
    from stagetree.executors.ray import default_resources

    assert default_resources([{"CPU": 8}, {"CPU": 8, "GPU": 2}]) == {"GPU": 1.0}
    assert default_resources([{"CPU": 8}]) == {"CPU": 1.0}
    torch_examples = pytest.importorskip("stagetree.torch.examples")
    # The same mechanism as local workers: library classes by import path, the user's
    # own by value.
    by_ref = RayExecutor(torch_examples.DigitsTrainer, 1, checkpoint_dir=tmp_path)
    assert by_ref.spec is not None and not by_ref.spec.by_value
    by_value = RayExecutor(Adder, 1, checkpoint_dir=tmp_path)
    assert by_value.spec is not None and by_value.spec.by_value


def test_ray_workers_train_fused_jobs(ray_runtime: Any, tmp_path: Path) -> None:
    """A fused job on a Ray actor: siblings train as one job, results as unfused."""
    from study_trainers import FusedLinearTrainer, submit_together

    from stagetree.hp import Piecewise

    def grid(study: Study) -> list[float]:
        trials = [({}, {"lr": Piecewise([0.01, lr], [3])}) for lr in (0.02, 0.04)]
        return [r.metrics["score"] for r in submit_together(study, trials, 8)]

    with Study(
        "fused",
        FusedLinearTrainer,
        storage=f"sqlite:///{tmp_path}/p.db",
        executor="ray",
        workers=1,
        fuse=True,
    ) as study:
        fused = grid(study)
        with study.reading() as storage:
            widths = [
                (a.data or {}).get("fused", 1) for a in storage.activity() if a.kind == "start"
            ]
    with Study("exact", FusedLinearTrainer, storage="memory://", executor="inline") as ref:
        assert grid(ref) == fused
    assert widths == [1, 2, 2]
