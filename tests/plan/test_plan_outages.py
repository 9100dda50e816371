"""Database outages: a plan storage rides through a restart of its PostgreSQL server
(transient errors retried with backoff inside the storage), fails past its window
with an error that names the outage, and a study's engine recovers once the database
is back.

Each test uses a throw-away PostgreSQL server of its own (``.ci/start_postgres.sh``),
so that restarting it disturbs nobody else; skipped where no server can be started.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError
from study_trainers import SlowLinearTrainer
from tcp_proxy import TCPProxy

from stagetree import Study
from stagetree.exceptions import StorageError, TrialFailedError
from stagetree.hp import Constant
from stagetree.plan import SQLPlanStorage
from stagetree.plan.sql import _transient
from stagetree.retry import DB_RETRY_ENV

ROOT = Path(__file__).resolve().parents[2]
R = "root"


@dataclass
class Postgres:
    """A PostgreSQL server of this module: its URL and data directory."""

    url: str
    data: str
    port: int

    def _ctl(self, *args: str) -> None:
        bindir = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1]
        command = " ".join([f"{bindir}/pg_ctl", "-D", self.data, *args])
        if os.getuid() == 0:
            subprocess.run(["su", "postgres", "-s", "/bin/bash", "-c", command], check=True)
        else:
            subprocess.run(["bash", "-c", command], check=True)

    def restart(self, down: float) -> None:
        """Stop the server (fast: sessions are terminated), wait ``down`` s, start it."""
        self._ctl("-m", "fast", "-w", "stop")
        time.sleep(down)
        options = f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-w", "-o", f"'{options}'", "-l", f"{self.data}/log", "start")

    def url_via(self, port: int) -> str:
        return self.url.replace(f":{self.port}/", f":{port}/")


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    if not glob.glob("/usr/lib/postgresql/*/bin/pg_ctl") or shutil.which("bash") is None:
        pytest.skip("no PostgreSQL server binaries here")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "start_postgres.sh")],
        env={**os.environ, "PGPORT": str(port)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot start a PostgreSQL server: {done.stderr[-500:]}")
    url, data = done.stdout.split()[:2]
    server = Postgres(url, data, port)
    try:
        yield server
    finally:
        server._ctl("-m", "immediate", "stop")
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def url(pg: Postgres) -> Iterator[str]:
    """The server's database, emptied of stagetree's tables."""
    plan = SQLPlanStorage(pg.url)
    plan.drop_all()
    plan.close()
    yield pg.url


def _in_background(fn: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def _cut_while_training(proxy: TCPProxy, url: str, study: str) -> None:
    """Cut ``proxy`` once a trial of ``study`` is being trained (read from ``url``, the
    database itself): the outage strikes the engine's driver, not a submission."""
    with SQLPlanStorage(url) as plan:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if "running" in [t["state"] for t in plan.trials(study)]:
                break
            time.sleep(0.02)
    proxy.cut()


# -- the storage ------------------------------------------------------------------------


def test_a_storage_rides_through_a_restart_of_postgresql(pg: Postgres, url: str) -> None:
    plan = SQLPlanStorage(url, retry_seconds=30)
    ins = plan.insert_trial(R, {"lr": Constant(0.1)}, 5)
    restart = _in_background(pg.restart, 1.0)
    written = 0
    while restart.is_alive() or written < 3:
        plan.put_metrics(ins.node, 5, {"loss": float(written)})
        assert plan.get_metrics(ins.node, 5) == {"loss": float(written)}
        written += 1
        time.sleep(0.02)
    restart.join()
    assert plan.request(ins.node, 5) is not None
    plan.close()


def test_an_outage_longer_than_the_window_names_it_and_the_storage_recovers(
    pg: Postgres, url: str
) -> None:
    proxy = TCPProxy(("127.0.0.1", pg.port))
    plan = SQLPlanStorage(pg.url_via(proxy.port), retry_seconds=1.0)
    try:
        ins = plan.insert_trial(R, {"lr": Constant(0.1)}, 5)
        proxy.cut()
        with pytest.raises(StorageError, match="unreachable for .* s.*" + DB_RETRY_ENV):
            plan.put_metrics(ins.node, 5, {"loss": 1.0})
        proxy.restore()
        plan.put_metrics(ins.node, 5, {"loss": 2.0})  # a new connection, no reopen
        assert plan.get_metrics(ins.node, 5) == {"loss": 2.0}
    finally:
        plan.close()
        proxy.close()


def test_a_busy_sqlite_file_is_transient_and_a_bad_statement_is_not() -> None:
    import sqlite3

    busy = OperationalError("BEGIN", {}, sqlite3.OperationalError("database is locked"))
    assert _transient(busy, pg=False)
    missing = OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: x"))
    assert not _transient(missing, pg=False)


# -- a study ----------------------------------------------------------------------------

TRIALS = [0.01, 0.02, 0.03]
STEPS = 60  # 20 ms steps: 1.2 s a trial, trained one after another


def _run_all(study: Study) -> list[dict[str, float]]:
    async def go() -> list[Any]:
        return await asyncio.gather(
            *(study.submit({"seed": 1}, {"lr": lr}, STEPS) for lr in TRIALS)
        )

    return [r.metrics for r in study._drive(go())]


def _expected(tmp_path: Path) -> list[dict[str, float]]:
    with Study(
        "expected",
        SlowLinearTrainer,
        storage="memory://",
        executor="inline",
        checkpoint_dir=str(tmp_path / "expected"),
    ) as study:
        return _run_all(study)


def test_a_study_rides_through_a_restart_of_postgresql(
    pg: Postgres, url: str, tmp_path: Path
) -> None:
    expected = _expected(tmp_path)
    with Study(
        "restart",
        SlowLinearTrainer,
        storage=url,
        executor="inline",
        checkpoint_dir=str(tmp_path / "ckpt"),
    ) as study:
        study.open()
        restart = threading.Timer(0.5, pg.restart, args=(1.0,))
        restart.start()
        got = _run_all(study)
        restart.join()
        assert got == expected
        assert [t.state for t in study.trials()] == ["done"] * len(TRIALS)


def test_past_the_window_a_study_fails_with_the_outage_and_resumes_exact(
    pg: Postgres, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _expected(tmp_path)
    monkeypatch.setenv(DB_RETRY_ENV, "1")
    proxy = TCPProxy(("127.0.0.1", pg.port))
    study = Study(
        "outage",
        SlowLinearTrainer,
        storage=pg.url_via(proxy.port),
        executor="inline",
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    try:
        study.open()
        _in_background(_cut_while_training, proxy, url, "outage")
        with pytest.raises(TrialFailedError, match=r"engine failed.*unreachable for"):
            study.run({"seed": 1}, {"lr": TRIALS[0]}, STEPS)
        proxy.restore()
        # The same study (its engine stopped on the error) runs again once the
        # database is back, and every trial is exact.
        assert _run_all(study) == expected
        assert [t.state for t in study.trials()] == ["done"] * len(TRIALS)
    finally:
        study.close()
        proxy.close()


# -- a server ---------------------------------------------------------------------------


def test_a_servers_engine_recovers_once_the_database_is_back(
    pg: Postgres, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    from stagetree.hp import MultiStep
    from stagetree.server.app import create_app
    from stagetree.server.hub import Hub, HubConfig
    from stagetree.server.protocol import PROTOCOL_VERSION, hp_to_json
    from stagetree.server.trainers import trainer_payload

    monkeypatch.setenv(DB_RETRY_ENV, "1")
    proxy = TCPProxy(("127.0.0.1", pg.port))
    hub = Hub(HubConfig(pg.url_via(proxy.port), executor="inline", ttl=30.0))
    auth = {"Authorization": "Bearer token-0123456789abcdef"}
    try:
        with TestClient(create_app(hub, auth["Authorization"][7:]), headers=auth) as client:
            body = {
                "name": "srv",
                "trainer": trainer_payload(SlowLinearTrainer),
                "protocol": PROTOCOL_VERSION,
            }
            sid = client.post("/v1/studies", json=body).json()["session"]
            url_ = f"/v1/sessions/{sid}/submissions"

            def submit(sub_id: str, lr: Any, after: int) -> dict[str, Any]:
                one = {"id": sub_id, "config": {}, "hp": hp_to_json({"lr": lr}), "steps": 60}
                assert client.post(url_, json=one).status_code == 200
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    got = client.get(
                        f"/v1/sessions/{sid}/results", params={"after": after, "timeout": 2}
                    ).json()["events"]
                    if got:
                        return dict(got[0])
                raise AssertionError("no answer")

            _in_background(_cut_while_training, proxy, url, "srv")
            failed = submit("t0", Constant(0.05), 0)
            # The engine's driver met the outage (not the submission's own call).
            assert "engine failed" in failed["error"]["message"]
            assert "unreachable for" in failed["error"]["message"]
            proxy.restore()
            # Every later submission of that trainer version is served by a fresh engine.
            done = submit("t1", MultiStep(0.05, [30], 0.5), failed["seq"])
            assert "error" not in done or not done["error"], done
            assert done["result"]["metrics"]
    finally:
        hub.close()
        proxy.close()
