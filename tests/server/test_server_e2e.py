"""Two people share one tuning box (issue 10, item 6), end to end with real processes: a
``stagetree serve`` process with three local workers on a free loopback port and two
client processes (tests/fakes/server_client.py) with overlapping spaces and weights 2:1.

* The union of their steps is executed exactly once, each client's results are
  bit-identical to training its trials alone, and while both have pending work the
  workers' time splits about 2:1.
* ``kill -9`` of the server mid-study and a restart: both clients finish by themselves
  with identical results, and nothing finished is trained again.
* ``kill -9`` of one client: its requests are released after the lease TTL, the other
  client finishes unaffected.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from server_client import STEPS, key, space
from study_trainers import LinearTrainer

from stagetree import Study, open_storage
from stagetree.plan.scopes import study_scope
from stagetree.stages import unique_steps

pytest.importorskip("starlette")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

HERE = Path(__file__).resolve().parents[1] / "fakes"
TTL = 3.0  # the server's lease TTL: a dead client's requests go after this


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["STAGETREE_LEASE_TTL"] = str(TTL)
    env.pop("STAGETREE_URL", None)
    return env


class Box:
    """A tuning server process on a free port of 127.0.0.1 over one SQLite plan."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.storage = f"sqlite:///{tmp}/plan.db"
        self.token_file = tmp / "token"
        self.token_file.write_text(secrets.token_urlsafe(24))
        self.token_file.chmod(0o600)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / "server.log"

    def start(self) -> None:
        exe = Path(sys.executable).with_name("stagetree")
        cmd = [str(exe), "serve", "--storage", self.storage, "--workers", "3"]
        cmd += ["--port", str(self.port), "--token-file", str(self.token_file)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=_env())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise AssertionError(f"the server did not start: {self.log.read_text()}")

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self, name: str, weight: float, which: str, barriers: list[Path]) -> Client:
        return Client(self, name, weight, which, barriers)


class Client:
    """A client process submitting space ``which`` as study ``name``."""

    def __init__(self, box: Box, name: str, weight: float, which: str, barriers: list[Path]):
        self.name = name
        self.out = box.tmp / f"{name}.json"
        self.ready = Path(str(self.out) + ".ready")
        self.log = box.tmp / f"{name}.log"
        cmd = [sys.executable, str(HERE / "server_client.py"), box.url, str(box.token_file)]
        cmd += [name, str(weight), which, str(self.out), *map(str, barriers)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=_env())

    def wait(self, timeout: float = 180) -> dict[str, dict[str, float]]:
        rc = self.proc.wait(timeout=timeout)
        assert rc == 0, self.log.read_text()
        return dict(json.loads(self.out.read_text()))


@pytest.fixture(scope="module")
def alone() -> dict[str, dict[str, float]]:
    """Every trial of both spaces trained alone (no sharing, in this process)."""
    out = {}
    with Study("alone", LinearTrainer, storage="memory://", share=False, executor="inline") as st:
        for which in ("a", "b"):
            for config, hp in space(which):
                out[key(config, hp)] = st.run(config, hp, STEPS).metrics
    return out


@pytest.fixture()
def box(tmp_path: Path) -> Iterator[Box]:
    server = Box(tmp_path)
    server.start()
    yield server
    server.stop()


def _start_pair(box: Box) -> tuple[Client, Client]:
    go = box.tmp / "go"
    a = box.client("alice", 2.0, "a", [go])
    b = box.client("bob", 1.0, "b", [go])
    deadline = time.monotonic() + 120
    while not (a.ready.exists() and b.ready.exists()):
        assert a.proc.poll() is None, a.log.read_text()
        assert b.proc.poll() is None, b.log.read_text()
        assert time.monotonic() < deadline, "the clients did not connect"
        time.sleep(0.05)
    go.write_text("go")
    return a, b


def _read(box: Box) -> dict[str, Any]:
    """What the plan says now: trial states and the per-study and total accounting."""
    with open_storage(box.storage, readonly=True) as storage:
        states = {n: [t["state"] for t in storage.trials(n)] for n in ("alice", "bob")}
        return {
            "states": states,
            "alice": _served(storage, "alice"),
            "bob": _served(storage, "bob"),
            "executed": storage.stats("engine").get("steps_executed", 0.0),
        }


def _served(storage: Any, name: str) -> float:
    """Steps trained for study ``name``'s requests (its own accounting scope)."""
    trials = storage.trials(name)
    if not trials:
        return 0.0
    scope = study_scope(name, trials[0]["attrs"]["version"])
    return float(storage.stats(scope).get("steps_executed", 0.0))


def _unique(box: Box) -> int:
    with open_storage(box.storage, readonly=True) as storage:
        trials = storage.trials("alice") + storage.trials("bob")
        nodes = {n.id: n for root in {t["root_key"] for t in trials} for n in storage.nodes(root)}
        return unique_steps(nodes, [(t["node"], t["step"]) for t in trials])


def _pending(states: list[str]) -> bool:
    return len(states) == 8 and any(s in ("pending", "running") for s in states)


def test_two_clients_share_stages_exactly_once_and_split_workers_by_weight(
    box: Box, alone: dict[str, dict[str, float]]
) -> None:
    a, b = _start_pair(box)
    contended = None  # the last accounting seen while both studies had pending work
    while a.proc.poll() is None or b.proc.poll() is None:
        now = _read(box)
        if all(_pending(now["states"][n]) for n in ("alice", "bob")):
            contended = now
        time.sleep(0.2)
    res_a, res_b = a.wait(), b.wait()
    for results in (res_a, res_b):
        assert results == {k: alone[k] for k in results}  # bit-identical to alone
    box.stop()  # every batch has reported (accounting complete)
    assert _read(box)["executed"] == _unique(box)  # the union, exactly once
    assert contended is not None and contended["bob"] > 0
    ratio = contended["alice"] / contended["bob"]
    assert 1.3 <= ratio <= 3.2, contended


def test_a_killed_server_restarts_and_both_clients_finish(
    box: Box, alone: dict[str, dict[str, float]]
) -> None:
    a, b = _start_pair(box)
    deadline = time.monotonic() + 120
    while sum(s == "done" for st in _read(box)["states"].values() for s in st) < 3:
        assert time.monotonic() < deadline, "no trial finished"
        time.sleep(0.1)
    box.kill()
    with open_storage(box.storage, readonly=True) as storage:
        done = {
            key(t["config"], t["hp"]): t["id"]
            for n in ("alice", "bob")
            for t in storage.trials(n)
            if t["state"] == "done"
        }
    time.sleep(1.0)  # the clients notice and retry
    box.start()
    res_a, res_b = a.wait(), b.wait()
    for results in (res_a, res_b):
        assert results == {k: alone[k] for k in results}
    box.stop()
    # Nothing finished is trained again: at most what the three workers were training
    # past their last checkpoints when the server died is recomputed.
    assert done
    assert _read(box)["executed"] <= _unique(box) + 3 * STEPS


def test_a_killed_client_releases_its_requests_and_the_other_finishes(
    box: Box, alone: dict[str, dict[str, float]]
) -> None:
    a, b = _start_pair(box)
    time.sleep(0.5)
    b.proc.kill()  # kill -9: no goodbye
    b.proc.wait()
    res_a = a.wait()
    assert res_a == {k: alone[k] for k in res_a}
    deadline = time.monotonic() + 10 * TTL
    while True:
        with open_storage(box.storage, readonly=True) as storage:
            bob = storage.trials("bob")
            live = {
                (r.node, r.step)
                for r in storage.requests()
                if r.refcount > 0 and r.state.value in ("pending", "scheduled")
            }
        # bob's own trials (seeds 20..25) have no live request any more
        own = {(t["node"], t["step"]) for t in bob if t["config"]["seed"] >= 20}
        if not (own & live):
            break
        assert time.monotonic() < deadline, f"bob's requests were not released: {own & live}"
        time.sleep(0.5)
