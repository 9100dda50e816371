"""``stagetree serve --executor ray --address ADDR --idle-release S`` (issue 23): the
cluster and the idle release reach the one RayExecutor every study of the server
shares; an address without Ray is refused before anything is written; a failed worker
start fails one submission, not every later one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from flaky_executor import flaky_factory
from study_trainers import LinearTrainer

import stagetree.server.serve as serve_module
from stagetree.cli import main
from stagetree.executors.ray import RayExecutor
from stagetree.hp import Constant
from stagetree.server.hub import Hub, HubConfig
from stagetree.server.trainers import trainer_payload

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")


class _Made(BaseException):
    """Stops serve() once its hub is made (nothing listens for clients)."""


def _hub_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    made: list[Any] = []

    def fake_hub(config: Any) -> None:
        made.append(config)
        raise _Made

    monkeypatch.setattr(serve_module, "Hub", fake_hub)
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with pytest.raises(_Made):
        main(["serve", "--storage", url, "--port", str(free_port()), *args])
    return made[0]


def test_serve_address_and_idle_release_reach_the_ray_executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _hub_config(
        tmp_path,
        monkeypatch,
        "--executor",
        "ray",
        "--address",
        "10.1.2.3:6379",
        "--idle-release",
        "5",
    )
    executor = config.executor
    assert isinstance(executor, RayExecutor)
    assert executor.address == "10.1.2.3:6379" and executor.idle_release == 5.0
    # Default: released after a minute idle; 0: never.
    default = _hub_config(tmp_path, monkeypatch, "--executor", "ray").executor
    assert default.address is None and default.idle_release == serve_module.DEFAULT_IDLE_RELEASE
    never = _hub_config(tmp_path, monkeypatch, "--executor", "ray", "--idle-release", "0").executor
    assert never.idle_release is None
    # Other executors keep their name.
    assert _hub_config(tmp_path, monkeypatch, "--executor", "inline").executor == "inline"


def test_serve_address_without_ray_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    args = ["serve", "--storage", url, "--port", str(free_port()), "--address", "h:6379"]
    assert main(args) == 2
    assert (
        "--address is a Ray cluster's: it needs --executor ray, not local"
        in capsys.readouterr().err
    )
    assert main([*args, "--executor", "ray", "--idle-release", "-1"]) == 2
    assert "--idle-release must be > 0 seconds" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_worker_start_fails_that_submission_and_the_next_one_trains(
    tmp_path: Path,
) -> None:
    # Every client of the server's engine hung after a failed start; now the submission
    # that started the workers gets the error, and the next one starts them again.
    factory = flaky_factory(["no room on the cluster"], tmp_path / "ck")
    hub = Hub(HubConfig(f"sqlite:///{tmp_path / 'plan.db'}", executor=factory, ttl=30.0))
    try:
        session = hub.open("s", trainer_payload(LinearTrainer), None, True, 1.0, "test")
        hp = {"lr": Constant(0.01)}
        for sub_id in ("t0", "t1"):
            assert hub.submit(session, sub_id, {"seed": 0}, hp, 5)
            deadline = time.monotonic() + 30
            while sub_id not in session.finished and time.monotonic() < deadline:
                time.sleep(0.05)
        first, second = session.events
        assert first["id"] == "t0" and "no room on the cluster" in str(first["error"])
        assert second["id"] == "t1" and second["result"]["steps"] == 5
    finally:
        hub.close()
