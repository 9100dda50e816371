"""``stagetree dashboard`` and ``stagetree run --dashboard``: clear errors before
anything listens (bad URL, newer schema, port in use, no token off loopback, missing
web packages), the address printed (never the token), and a clean stop."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from conftest import free_port

from stagetree import cli, extras
from stagetree.dashboard import check_web, start_dashboard
from stagetree.exceptions import StagetreeError
from stagetree.plan import SQLPlanStorage

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "dashboard-token-0123456789"


def _plan(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with SQLPlanStorage(url) as storage:
        storage.create_study("s", {})
    return url


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"stagetree {argv[0]}: error: ") and err.count("\n") == 1
    return err


def test_a_storage_that_cannot_be_opened(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nope.db"
    err = _fails(["dashboard", f"sqlite:///{missing}"], capsys)
    assert f"{missing} does not exist" in err
    assert not missing.exists()  # never created
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    assert "file is not a database" in _fails(["dashboard", f"sqlite:///{junk}"], capsys)
    assert "unknown scheme" in _fails(["dashboard", "mysql://x/y"], capsys)
    assert "memory" in _fails(["dashboard", "memory://"], capsys)


def test_a_database_of_a_newer_schema(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = _plan(tmp_path)
    with sqlite3.connect(tmp_path / "plan.db") as conn:
        conn.execute("UPDATE stagetree_meta SET value = '7' WHERE key = 'schema_version'")
    err = _fails(["dashboard", url], capsys)
    assert "schema version 7" in err and "newer stagetree" in err


def test_a_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = _plan(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        err = _fails(["dashboard", url, "--port", str(port)], capsys)
    assert f"127.0.0.1:{port}" in err and "in use" in err and "--port" in err
    assert cli.main(["dashboard", url, "--port", "70000"]) == cli.EXIT_USAGE
    assert "expected a port number 0-65535" in capsys.readouterr().err


def test_other_hosts_need_a_token(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = _plan(tmp_path)
    err = _fails(["dashboard", url, "--host", "0.0.0.0"], capsys)
    assert "refusing to serve the dashboard on 0.0.0.0 without --token-file" in err
    short = tmp_path / "short.token"
    short.write_text("abc")
    err = _fails(["dashboard", url, "--token-file", str(short)], capsys)
    assert str(short) in err and "abc" not in err.replace(str(short), "")


def test_missing_web_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    # Installed from an index: the extra's name is what installs it.
    monkeypatch.setattr(extras, "installation", lambda: extras.Installation("index"))
    with pytest.raises(StagetreeError, match=r"pip install 'stagetree\[dashboard\]'"):
        check_web()
    with pytest.raises(StagetreeError, match="uvicorn is missing"):
        start_dashboard("sqlite:///whatever.db")


def _read(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_start_dashboard_with_a_token(tmp_path: Path) -> None:
    url = _plan(tmp_path)
    token_file = tmp_path / "dash.token"
    token_file.write_text(TOKEN + "\n")
    with start_dashboard(url, token_file=token_file) as server:
        assert server.url.startswith("http://127.0.0.1:") and TOKEN not in server.url
        assert _read(server.url + "api/studies")[0] == 401
        status, body = _read(server.url + "api/studies", TOKEN)
        assert status == 200 and b'"name":"s"' in body
        assert _read(server.url)[0] == 200
    with pytest.raises(OSError):
        _read(server.url + "api/studies", TOKEN)  # stopped


def test_the_command_prints_the_address_and_never_the_token(tmp_path: Path) -> None:
    url = _plan(tmp_path)
    token_file = tmp_path / "dash.token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    command = ["dashboard", url, "--port", str(port), "--token-file", str(token_file)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagetree.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        address = f"http://127.0.0.1:{port}/"
        assert line.startswith(f"stagetree dashboard: {address} (storage {url}, read-only)")
        assert str(token_file.resolve()) in line and TOKEN not in line
        deadline = time.monotonic() + 10
        while True:
            try:
                status, _ = _read(address + "api/studies", TOKEN)
                break
            except OSError:
                assert time.monotonic() < deadline, "the dashboard did not answer"
                time.sleep(0.05)
        assert status == 200
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "stagetree dashboard: stopped" in out and TOKEN not in out + err


TRAINER = """
import json, sys, urllib.request
sys.path.insert(0, {tests!r})
from study_trainers import LinearTrainer
from stagetree import Study
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch


class Peeking(LinearTrainer):
    # Reads the dashboard's tree of its own study while it trains.
    def train(self):
        if {peek!r} and self.t == 3:
            url = "http://127.0.0.1:{port}/api/studies/dash/tree"
            with urllib.request.urlopen(url, timeout=10) as response:
                nodes = json.load(response)["nodes"]
            with open({seen!r}, "a") as fh:
                fh.write(" ".join(n["state"] for n in nodes) + "\\n")
        return super().train()


study = Study("dash", Peeking, storage={url!r}, executor="inline")
space = GridSpace({{"lr": [Constant(0.1), MultiStep(0.1, [5], 0.5)]}}, fixed={{"seed": [0]}})
tuner = GridSearch(space, metric="score", steps=10)
"""


@pytest.mark.parametrize("storage", ["sqlite", "memory"])
def test_run_with_the_dashboard(tmp_path: Path, storage: str) -> None:
    import io

    url = f"sqlite:///{tmp_path / 'plan.db'}" if storage == "sqlite" else "memory://"
    script, seen, port = tmp_path / "study.py", tmp_path / "seen.txt", free_port()
    peek = storage == "sqlite"  # (a memory plan is read under the engine's lock)
    tests = str(Path(__file__).parents[1] / "fakes")
    code = TRAINER.format(tests=tests, url=url, port=port, seen=str(seen), peek=peek)
    script.write_text(textwrap.dedent(code))
    out = io.StringIO()
    assert cli.run_script(script, progress=False, check=False, out=out, dashboard=port) == 0
    text = out.getvalue()
    first = text.splitlines()[0]
    address = f"http://127.0.0.1:{port}/"
    assert first == f"stagetree run: dashboard at {address}"
    assert "best score:" in text.split(first, 1)[1]  # printed before the report
    if peek:  # the trainer read its own study's tree from the dashboard while it ran
        # (training, or pending when the engine records an inline batch's start only
        # after the driver's round that runs it)
        states = seen.read_text().split()
        assert len(states) == 2 and set(states) <= {"pending", "training"}
    with pytest.raises(OSError):
        _read(address + "api/studies")  # stopped with the run


def test_run_dashboard_options() -> None:
    args = cli.build_parser().parse_args(["run", "x.py", "--dashboard"])
    assert args.dashboard and args.dashboard_port == 8643
    args = cli.build_parser().parse_args(["run", "x.py", "--dashboard-port", "0"])
    assert args.dashboard_port == 0 and not args.dashboard
