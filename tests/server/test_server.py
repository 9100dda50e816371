"""``stagetree serve`` end to end: a real server process on a free loopback port (the
inline executor, fast numpy trainers sent by value) and remote studies against it:
same results as local studies, failures, a server killed with -9 and restarted mid-tune,
a client killed with -9 whose requests are released after the lease, the token."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from study_trainers import LinearTrainer, SlowLinearTrainer

from stagetree import Study
from stagetree.exceptions import ServerError, TrialFailedError
from stagetree.hp import Constant, MultiStep
from stagetree.plan import open_storage
from stagetree.server import RemoteStudy
from stagetree.space import GridSpace
from stagetree.tuners import ASHA, SHA

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

FAKES = Path(__file__).resolve().parents[1] / "fakes"
CLI = Path(sys.executable).with_name("stagetree")
TTL = 1.5
LRS = [Constant(0.05), MultiStep(0.05, [3], 0.5), Constant(0.02), Constant(0.01)]


class Server:
    """A ``stagetree serve`` process of the tests (restartable on the same port)."""

    def __init__(self, directory: Path, executor: str = "inline", tls: bool = False) -> None:
        self.dir = directory
        self.executor = executor
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.options = ["--ssl-certfile", "cert.pem", "--ssl-keyfile", "key.pem"] if tls else []
        self.verify: Any = True
        if tls:
            self.verify = ssl.create_default_context(cafile=str(directory / "cert.pem"))
        self.storage = f"sqlite:///{directory / 'plan.db'}"
        self.token_file = directory / "plan.db.token"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "STAGETREE_LEASE_TTL": str(TTL)}
        env.pop("PYTHONPATH", None)  # the server cannot import the tests' trainers
        with (
            open(self.dir / f"out{self.starts}.txt", "wb") as out,
            open(self.dir / f"err{self.starts}.txt", "wb") as err,
        ):
            self.proc = subprocess.Popen(
                [
                    *(str(CLI), "serve", "--storage", self.storage),
                    *("--executor", self.executor, "--workers", "1", "--port", str(self.port)),
                    *self.options,
                ],
                cwd=self.dir,
                stdout=out,
                stderr=err,
                env=env,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            if self.token_file.exists():
                try:
                    headers = {"Authorization": f"Bearer {self.token}"}
                    info = httpx.get(f"{self.url}/v1/info", headers=headers, verify=self.verify)
                    if info.status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise AssertionError(f"the server did not start: {self.output()}")

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("*.txt")))

    def study(self, name: str, trainer: Any = LinearTrainer, **kw: Any) -> Study:
        study = Study(name, trainer, url=self.url, token=self.token, **kw)
        assert isinstance(study, RemoteStudy)
        return study


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("serve"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def local_study(name: str, trainer: Any = LinearTrainer) -> Study:
    return Study(name, trainer, storage="memory://", executor="inline", url="")


def by_hp(study: Study) -> dict[str, Any]:
    from stagetree.hp import dumps_hp

    return {dumps_hp(t.hp) + str(t.config): (t.steps, t.state, t.metrics) for t in study.trials()}


def sha() -> SHA:
    space = GridSpace({"lr": LRS}, fixed={"seed": [1, 2]})
    return SHA(space, "score", min_steps=2, max_steps=8, eta=2, num_trials=8)


def test_remote_sha_equals_local(server: Server) -> None:
    with local_study("sha") as local:
        want = local.tune(sha())
        want_trials = by_hp(local)
    with server.study("sha") as remote:
        got = remote.tune(sha())
        assert got == want
        assert by_hp(remote) == want_trials
        assert remote.stats()["steps_executed"] == remote.stats()["steps_unique"]


def test_a_remote_study_fuses_on_the_server(server: Server) -> None:
    """``fuse=True`` travels to the server: its workers train the siblings fused, and the
    results are those of an unfused local run (the numpy group updates member by
    member)."""
    from study_trainers import FusedLinearTrainer

    with local_study("fused", FusedLinearTrainer) as local:
        want = local.tune(sha())
    with server.study("fused", FusedLinearTrainer, fuse=True) as remote:
        got = remote.tune(sha())
        assert (got.hp, got.metrics["score"]) == (want.hp, want.metrics["score"])
        assert max(m.get("width", 1) for m in got.history.values()) > 1  # trained fused
        assert remote.stats()["fused_jobs"] >= 1
        assert remote.root_key({"seed": 1}, {"lr": Constant(0.01)}) != local.root_key(
            {"seed": 1}, {"lr": Constant(0.01)}
        )


def test_remote_asha_trials_match_local_training(server: Server) -> None:
    space = GridSpace({"lr": [*LRS, Constant(0.03)]}, fixed={"seed": [3]})
    tuner = ASHA(space, "score", min_steps=1, max_steps=8, eta=2, num_trials=5)
    with server.study("asha") as remote:
        best = remote.tune(tuner)
        trials = remote.trials()
    assert best is not None and len(trials) == 5
    with local_study("asha-check") as local:
        for t in trials:  # every remote trial's curve is what local training gives
            assert local.run(t.config, t.hp, t.steps).history == t.metrics


def test_failing_trainer_raises_trial_failed_with_the_worker_traceback(server: Server) -> None:
    with server.study("failing") as remote:
        with pytest.raises(TrialFailedError, match="boom in train at step 2") as info:
            remote.run({"seed": 0, "fail_train_at": 2}, {"lr": LRS[0]}, 4)
        assert "Traceback" in info.value.traceback and "study_trainers" in info.value.traceback
        (record,) = remote.trials()
        assert record.state == "failed" and record.error is not None
        assert record.error.type == "ValueError"


def test_server_killed_and_restarted_mid_tune(server: Server) -> None:
    """kill -9 mid-tune, restart on the same port and storage: the client's tune()
    reconnects, re-submits and finishes with the uninterrupted run's best trial."""
    space = GridSpace({"lr": LRS}, fixed={"seed": [7, 8]})

    def tuner() -> SHA:
        return SHA(space, "score", min_steps=4, max_steps=16, eta=2, num_trials=8)

    with local_study("restart", SlowLinearTrainer) as local:
        want = local.tune(tuner())
        want_trials = by_hp(local)
    remote = server.study("restart", SlowLinearTrainer)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["best"] = remote.tune(tuner())
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while True:  # kill once the first trials are done: the tuner is mid-way
        with open_storage(server.storage, readonly=True) as plan:
            done = [t for t in plan.trials("restart") if t["state"] == "done"]
        if len(done) >= 2:
            break
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.05)
    server.kill9()
    time.sleep(0.5)
    server.start()
    thread.join(timeout=90)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["best"] == want
    assert by_hp(remote) == want_trials
    remote.close()


VICTIM = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from study_trainers import SlowLinearTrainer
from stagetree import Study
from stagetree.hp import Constant

study = Study("victim", SlowLinearTrainer, url={url!r}, token={token!r})

async def main():
    tasks = [asyncio.ensure_future(study.submit({{"seed": 5}}, {{"lr": Constant(lr)}}, 300))
             for lr in (0.05, 0.04)]
    while len(study.trials()) < 2:
        await asyncio.sleep(0.05)
    print("submitted", flush=True)
    await asyncio.gather(*tasks)

asyncio.run(main())
"""


@pytest.fixture
def local_server(tmp_path: Path) -> Iterator[Server]:
    """A server whose workers are processes (a batch nobody needs any more is aborted)."""
    server = Server(tmp_path, executor="local")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_killed_client_is_released_after_the_lease(local_server: Server, tmp_path: Path) -> None:
    """A client killed with -9: after the session lease its requests are released and its
    trials cancelled in the plan; another client's request on the same path is served."""
    server = local_server
    script = tmp_path / "victim.py"
    script.write_text(VICTIM.format(tests=str(FAKES), url=server.url, token=server.token))
    victim = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "submitted"
        bystander = server.study("bystander", SlowLinearTrainer)
        outcome: dict[str, Any] = {}

        def shared_prefix() -> None:  # on the victim's first trial's path
            outcome["result"] = bystander.run({"seed": 5}, {"lr": Constant(0.05)}, 10)

        thread = threading.Thread(target=shared_prefix)
        thread.start()
        time.sleep(0.3)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed = time.monotonic()
        thread.join(timeout=30)
        result = outcome["result"]
    finally:
        if victim.poll() is None:
            victim.kill()
    view = server.study("victim", SlowLinearTrainer)
    deadline = time.monotonic() + 20
    while {t.state for t in view.trials()} != {"cancelled"}:
        assert time.monotonic() < deadline, view.trials()
        time.sleep(0.1)
    assert time.monotonic() - killed >= TTL * 0.9  # not before the lease ran out
    with open_storage(server.storage, readonly=True) as plan:
        root = view.root_key({"seed": 5})
        requests = {r.step: r for r in plan.requests(root)}
    assert requests[300].refcount == 0
    assert requests[10].refcount == 1
    with local_study("reference", SlowLinearTrainer) as local:
        assert result.metrics == local.run({"seed": 5}, {"lr": Constant(0.05)}, 10).metrics
    bystander.close()
    view.close()


def test_stagetree_run_url_runs_a_script_on_the_server(server: Server, tmp_path: Path) -> None:
    script = tmp_path / "study.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(FAKES)!r})
            from study_trainers import LinearTrainer
            from stagetree import Study
            from stagetree.hp import Constant
            from stagetree.space import GridSpace
            from stagetree.tuners import GridSearch

            study = Study("by-run", LinearTrainer, storage="sqlite:///ignored.db", workers=2)
            tuner = GridSearch(GridSpace({{"lr": [Constant(0.05), Constant(0.02)]}},
                                          fixed={{"seed": [0]}}), "score", steps=3)
            """
        )
    )
    done = subprocess.run(
        [
            *(str(CLI), "run", str(script), "--url", server.url),
            *("--token-file", str(server.token_file), "--no-progress"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("STAGETREE_")},
    )
    assert done.returncode == 0, done.stderr
    assert "best score" in done.stdout
    assert "storage, workers ignored" in done.stderr  # the server's settings apply
    assert not (tmp_path / "ignored.db").exists()
    with server.study("by-run") as remote:
        assert {t.state for t in remote.trials()} == {"done"}


def test_serve_refuses_a_public_host_without_a_token_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *(str(CLI), "serve", "--host", "0.0.0.0", "--port", str(free_port())),
            *("--storage", f"sqlite:///{tmp_path / 'plan.db'}"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "refusing to listen on 0.0.0.0 without --token-file" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no storage, no token file


def test_the_token_file_is_private_and_the_token_never_printed(server: Server) -> None:
    assert stat.S_IMODE(server.token_file.stat().st_mode) == 0o600
    output = server.output()
    assert str(server.token_file) in output
    assert server.token not in output


def test_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--ssl-certfile/--ssl-keyfile serve HTTPS; a client trusts a self-signed
    certificate through SSL_CERT_FILE, and without it fails at once, saying so."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    server = Server(tmp_path, tls=True)
    server.start()
    try:
        with pytest.raises(ServerError, match="SSL_CERT_FILE"):
            server.study("tls").trials()
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))
        with server.study("tls") as remote:
            assert remote.run({"seed": 0}, {"lr": LRS[0]}, 2).steps == 2
    finally:
        server.stop()
