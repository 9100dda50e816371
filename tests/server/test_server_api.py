"""The tuning server's HTTP API in process (starlette's TestClient): authentication,
versions, limits, every malformed request, sessions, long-polls, leases, trainers; and
a RemoteStudy talking to the app in process."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

with warnings.catch_warnings():  # starlette >= 1 prefers httpx2 for its test client
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from study_trainers import LinearTrainer, SlowLinearTrainer

from stagetree import Study
from stagetree.exceptions import (
    AuthError,
    InvalidTrialError,
    ServerError,
    ServerUnavailableError,
    StudyBusyError,
    TrialFailedError,
    VersionMismatchError,
)
from stagetree.hp import Constant, MultiStep
from stagetree.identity import trainer_fingerprint
from stagetree.server import RemoteStudy
from stagetree.server._http import Connection
from stagetree.server.app import create_app
from stagetree.server.hub import Hub, HubConfig
from stagetree.server.protocol import (
    BODY_LIMIT,
    PROTOCOL_VERSION,
    error_from_json,
    hp_to_json,
)
from stagetree.server.trainers import trainer_payload
from stagetree.space import GridSpace
from stagetree.tuners import SHA
from stagetree.web.hosts import allowed_hosts

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LRS = [Constant(0.05), MultiStep(0.05, [3], 0.5), Constant(0.02), Constant(0.01)]


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    hub = Hub(HubConfig(f"sqlite:///{tmp_path}/plan.db", executor="inline", ttl=2.0))
    yield hub
    hub.close()


@pytest.fixture
def client(hub: Hub) -> Iterator[TestClient]:
    with TestClient(create_app(hub, TOKEN), headers=AUTH) as client:
        yield client


def open_session(client: TestClient, name: str = "s", trainer: Any = LinearTrainer) -> str:
    body = {"name": name, "trainer": trainer_payload(trainer), "protocol": PROTOCOL_VERSION}
    response = client.post("/v1/studies", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["session"])


def trial(lr: Any = LRS[0], steps: int = 4, sub_id: str = "t0", **config: Any) -> dict[str, Any]:
    return {
        "id": sub_id,
        "config": {"seed": 0, **config},
        "hp": hp_to_json({"lr": lr}),
        "steps": steps,
    }


def error(response: Any, status: int, kind: str | None = None) -> str:
    """The message of an error response, after checking its status and type."""
    assert response.status_code == status, response.text
    body = response.json()["error"]
    if kind is not None:
        assert body["type"] == kind, body
    assert TOKEN not in response.text
    return str(body["message"])


def wait_events(client: TestClient, sid: str, count: int, after: int = 0) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(events) < count and time.monotonic() < deadline:
        got = client.get(f"/v1/sessions/{sid}/results", params={"after": after, "timeout": 2})
        assert got.status_code == 200, got.text
        events = got.json()["events"]
    return events


# ------------------------------------------------------------------------ authentication


def test_every_request_needs_the_token(hub: Hub) -> None:
    app = create_app(hub, TOKEN)
    with TestClient(app) as bare:
        assert "Authorization" in error(bare.get("/v1/info"), 401, "AuthError")
        assert "malformed" in error(bare.get("/v1/info", headers={"Authorization": "Basic x"}), 401)
        assert "malformed" in error(bare.get("/v1/info", headers={"Authorization": "Bearer"}), 401)
        assert "wrong token" in error(
            bare.get("/v1/info", headers={"Authorization": "Bearer nope"}), 403
        )
        # Unknown routes and sessions are not revealed without the token either.
        error(bare.post("/v1/sessions/x/submissions", json={}), 401)
        info = bare.get("/v1/info", headers=AUTH)
        assert info.status_code == 200
        assert info.json()["protocol"] == PROTOCOL_VERSION
        assert info.json()["stagetree"]
    assert isinstance(
        error_from_json(403, {"error": {"type": "AuthError", "message": "m"}}), AuthError
    )


def test_versions_are_exchanged(client: TestClient) -> None:
    message = error(
        client.get("/v1/info", headers={"X-Stagetree-Protocol": "999"}), 400, "VersionMismatchError"
    )
    assert "999" in message and f"protocol {PROTOCOL_VERSION}" in message
    body = {"name": "s", "trainer": trainer_payload(LinearTrainer), "protocol": 999}
    error(client.post("/v1/studies", json=body), 400, "VersionMismatchError")
    exc = error_from_json(400, client.get("/v1/info", headers={"X-Stagetree-Protocol": "0"}).json())
    assert isinstance(exc, VersionMismatchError)


# ----------------------------------------------------------------------------- bad input


def test_body_size_limits(client: TestClient) -> None:
    sid = open_session(client)
    big = json.dumps({**trial(), "config": {"seed": 0, "pad": "x" * BODY_LIMIT}})
    message = error(
        client.post(f"/v1/sessions/{sid}/submissions", content=big), 413, "PayloadTooLarge"
    )
    assert "1 MiB" in message

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(BODY_LIMIT // 1000 + 2):
            yield b" " * 1000

    error(client.post(f"/v1/sessions/{sid}/submissions", content=chunks()), 413)
    # A study-opening request may carry a large pickled trainer (up to 64 MiB).
    body = {"name": "s", "trainer": trainer_payload(LinearTrainer), "protocol": PROTOCOL_VERSION}
    body["client"] = "x" * (2 * BODY_LIMIT)
    assert client.post("/v1/studies", json=body).status_code == 200
    assert client.get(f"/v1/sessions/{sid}/trials").json()["trials"] == []


def test_malformed_requests_name_the_problem_and_write_nothing(client: TestClient) -> None:
    sid = open_session(client)
    url = f"/v1/sessions/{sid}/submissions"
    assert "not JSON" in error(client.post(url, content=b"{nope"), 400, "BadRequest")
    assert "JSON object" in error(client.post(url, json=[1, 2]), 400, "BadRequest")
    assert "'colour'" in error(client.post(url, json={**trial(), "colour": 1}), 400, "BadRequest")
    assert "'steps'" in error(client.post(url, json={"id": "a", "config": {}, "hp": {}}), 400)
    assert "'config'" in error(client.post(url, json={**trial(), "config": [1]}), 400)
    for steps in (-1, "3", 2.5, True, None):
        message = error(
            client.post(url, json={**trial(), "steps": steps}), 400, "InvalidTrialError"
        )
        assert "steps must be a non-negative int" in message
    error(
        client.post(url, json={**trial(), "hp": {"lr": {"type": "Nope"}}}),
        400,
        "InvalidSequenceError",
    )
    error(client.post(url, json={**trial(), "id": "../x"}), 400, "BadRequest")
    nan = json.dumps(trial(seed=float("nan")))  # NaN is JSON to Python: refused as locally
    assert "fixed configuration" in error(client.post(url, content=nan), 400, "InvalidTrialError")
    assert "unknown session" in error(
        client.post("/v1/sessions/nope/submissions", json=trial()), 404, "SessionNotFound"
    )
    error(client.delete(f"{url}/never-submitted"), 404, "SubmissionNotFound")
    error(client.get("/v1/nothing-here"), 404)
    error(client.put("/v1/info"), 405)
    error(client.get(f"/v1/sessions/{sid}/results", params={"after": "x"}), 400)
    error(client.get(f"/v1/sessions/{sid}/best"), 400)
    error(client.post(f"/v1/sessions/{sid}/declare", json={"trials": [1]}), 400)
    error(
        client.post(
            f"/v1/sessions/{sid}/tuning", json={"metric": "score", "mode": "up", "tuner": "x"}
        ),
        400,
    )
    assert client.get(f"/v1/sessions/{sid}/trials").json()["trials"] == []  # nothing written
    # Names that differ from the study's trials, once it has one.
    assert client.post(url, json=trial()).status_code == 200
    wait_events(client, sid, 1)
    message = error(
        client.post(
            url, json={**trial(sub_id="t1"), "hp": hp_to_json({"lr": LRS[0], "momentum": 0.9})}
        ),
        400,
        "InvalidTrialError",
    )
    assert "momentum" in message
    error(
        client.post(
            f"/v1/sessions/{sid}/check", json={"config": {"seed": 0, "x": 1}, "hp": trial()["hp"]}
        ),
        400,
        "InvalidTrialError",
    )
    assert len(client.get(f"/v1/sessions/{sid}/trials").json()["trials"]) == 1
    for bad in ({"name": "", "trainer": {}, "protocol": 1}, {"name": "s", "protocol": 1}):
        error(client.post("/v1/studies", json=bad), 400, "BadRequest")
    bad_weight = {
        "name": "s",
        "trainer": trainer_payload(LinearTrainer),
        "protocol": 1,
        "weight": -1,
    }
    assert "weight" in error(client.post("/v1/studies", json=bad_weight), 400, "ValueError")


def test_a_trainer_the_server_cannot_load_is_refused(client: TestClient) -> None:
    payload = {
        "ref": "no_such_module_here:Trainer",
        "value": base64.b64encode(b"not a pickle").decode(),
        "fingerprint": "0123456789abcdef",
    }
    body = {"name": "s", "trainer": payload, "protocol": PROTOCOL_VERSION}
    message = error(client.post("/v1/studies", json=body), 400, "TrainerUnavailable")
    assert "no_such_module_here" in message and "unpickle" in message
    body["trainer"] = {**payload, "value": "%%%"}
    assert "base64" in error(client.post("/v1/studies", json=body), 400, "TrainerUnavailable")
    body["trainer"] = {**payload, "ref": "__main__:T", "value": None, "value_error": "lock"}
    assert "could not pickle it (lock)" in error(client.post("/v1/studies", json=body), 400)
    body["trainer"] = {**payload, "extra": 1}
    error(client.post("/v1/studies", json=body), 400, "BadRequest")
    exc = error_from_json(400, client.post("/v1/studies", json=body).json())
    assert isinstance(exc, ServerError) and exc.status == 400


def test_one_class_per_trainer_version(client: TestClient, hub: Hub) -> None:
    open_session(client, "a")
    # A ref that imports other code than the client's: the pickled value is used.
    payload = trainer_payload(SlowLinearTrainer)
    payload["ref"] = "study_trainers:LinearTrainer"
    body = {"name": "b", "trainer": payload, "protocol": PROTOCOL_VERSION}
    assert client.post("/v1/studies", json=body).status_code == 200
    open_session(client, "c")
    classes = hub.registry._classes
    assert classes[trainer_fingerprint(LinearTrainer)] is LinearTrainer  # imported
    slow = classes[trainer_fingerprint(SlowLinearTrainer)]
    assert slow.__qualname__ == "SlowLinearTrainer"
    trainers = {s.name: s.trainer for s in hub._studies.values()}
    assert trainers["a"] is trainers["c"] is LinearTrainer  # one engine for both
    # The weight goes to the server's study (fair share across studies).
    heavy = {"name": "d", "trainer": trainer_payload(LinearTrainer), "protocol": 1, "weight": 2.5}
    assert client.post("/v1/studies", json=heavy).status_code == 200
    assert [s.weight for s in hub._studies.values() if s.name == "d"] == [2.5]


# ---------------------------------------------------------------- submissions, long-polls


def test_submit_then_long_poll_for_the_result(client: TestClient, tmp_path: Path) -> None:
    sid = open_session(client)
    url = f"/v1/sessions/{sid}/submissions"
    answer = client.post(url, json=trial(LRS[1], 6)).json()
    assert answer["id"] == "t0" and answer["started"] is True
    assert client.post(url, json=trial(LRS[1], 6)).json()["started"] is False  # idempotent
    (event,) = wait_events(client, sid, 1)
    assert event["id"] == "t0" and event["seq"] == 1
    assert answer["event"] in (None, event)  # it may have ended within the answer's wait
    with Study("local", LinearTrainer, storage="memory://", executor="inline", url="") as local:
        expected = local.run({"seed": 0}, {"lr": LRS[1]}, 6)
    assert event["result"]["metrics"] == expected.metrics
    # The plan answers it now: another submission of it comes back with its answer.
    again = client.post(url, json=trial(LRS[1], 6, sub_id="t1")).json()
    assert again["event"]["id"] == "t1"
    assert again["event"]["result"]["metrics"] == expected.metrics
    (event,) = wait_events(client, sid, 1, after=1)  # the long-poll carries it too
    assert event == again["event"]
    # Acknowledged events are dropped; an empty poll waits for its timeout.
    started = time.monotonic()
    got = client.get(f"/v1/sessions/{sid}/results", params={"after": 2, "timeout": 0.3})
    assert got.json()["events"] == []
    assert time.monotonic() - started >= 0.25
    assert client.delete(f"{url}/t0").json() == {"cancelled": False}  # already finished


def test_failed_trial_event_carries_the_traceback(client: TestClient) -> None:
    sid = open_session(client)
    client.post(f"/v1/sessions/{sid}/submissions", json=trial(fail_train_at=2))
    (event,) = wait_events(client, sid, 1)
    exc = error_from_json(400, {"error": event["error"]})
    assert isinstance(exc, TrialFailedError)
    assert "boom in train at step 2" in str(exc) and "Traceback" in exc.traceback


def test_one_session_tunes_a_study_at_a_time(client: TestClient) -> None:
    a, b = open_session(client), open_session(client)
    begin = {"metric": "score", "mode": "max", "tuner": "SHA", "horizon": 8}
    assert client.post(f"/v1/sessions/{a}/tuning", json=begin).status_code == 200
    busy = client.post(f"/v1/sessions/{b}/tuning", json=begin)
    assert isinstance(error_from_json(409, busy.json()), StudyBusyError)
    error(busy, 409, "StudyBusyError")
    client.delete(f"/v1/sessions/{a}/tuning")
    assert client.post(f"/v1/sessions/{b}/tuning", json=begin).status_code == 200
    client.delete(f"/v1/sessions/{b}")  # closing a session releases its lease
    assert client.post(f"/v1/sessions/{a}/tuning", json=begin).status_code == 200


def test_a_silent_session_is_reaped_and_its_requests_released(tmp_path: Path) -> None:
    hub = Hub(HubConfig(f"sqlite:///{tmp_path}/plan.db", executor="inline", ttl=0.6))
    with TestClient(create_app(hub, TOKEN), headers=AUTH) as client:
        quiet, alive = (
            open_session(client, "quiet", SlowLinearTrainer),
            open_session(client, "alive", SlowLinearTrainer),
        )
        begin = {"metric": "score", "mode": "max", "tuner": "SHA"}
        client.post(f"/v1/sessions/{quiet}/tuning", json=begin)
        client.post(f"/v1/sessions/{quiet}/submissions", json=trial(Constant(0.03), 60))
        client.post(f"/v1/sessions/{alive}/submissions", json=trial(LRS[2], 3))
        events = wait_events(client, alive, 1)  # polling keeps "alive" alive
        assert "result" in events[0]
        deadline = time.monotonic() + 10
        while quiet in hub._sessions:  # asking the quiet session would renew it
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert client.get(f"/v1/sessions/{quiet}/trials").status_code == 404
        # Its trial was cancelled and its request released; its tuning lease is free.
        again = open_session(client, "quiet", SlowLinearTrainer)
        (record,) = client.get(f"/v1/sessions/{again}/trials").json()["trials"]
        assert record["state"] == "cancelled"
        assert client.post(f"/v1/sessions/{again}/tuning", json=begin).status_code == 200
        (study,) = [s for s in hub._studies.values() if s.name == "quiet"]
        storage = study._engine.storage
        requests = {r.step: r for r in storage.requests(study.root_key({"seed": 0}))}
        assert requests[60].refcount == 0  # "alive"'s request at step 3 keeps its own
        assert requests[3].refcount == 1


# ------------------------------------------------------------------------- RemoteStudy


@pytest.fixture
def remote(client: TestClient) -> Iterator[Any]:
    """RemoteStudy objects whose HTTP goes to the app in process."""
    made: list[RemoteStudy] = []

    def make(name: str, trainer: Any = LinearTrainer) -> RemoteStudy:
        study = Study(name, trainer, url="http://testserver", token=TOKEN)
        assert isinstance(study, RemoteStudy)
        conn = Connection("http://testserver", TOKEN, give_up=5)
        conn._client = _Shared(client)  # type: ignore[assignment]
        study._conn = conn
        made.append(study)
        return study

    yield make
    for study in made:
        study.close()
    for study in made:  # no request may be in flight when the test client stops
        if study._poller is not None:
            study._poller.join(timeout=10)
            assert not study._poller.is_alive()


class _Shared:
    """The test client as a RemoteStudy's HTTP client, which closing the study leaves
    open (the other studies use it too)."""

    def __init__(self, client: TestClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def close(self) -> None:
        pass


@pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")
def test_remote_study_has_the_local_api(remote: Any, tmp_path: Path) -> None:
    space = GridSpace({"lr": LRS}, fixed={"seed": [1]})
    local = Study(
        "x", LinearTrainer, storage=f"sqlite:///{tmp_path}/l.db", executor="inline", url=""
    )
    with local:
        want = local.tune(SHA(space, "score", min_steps=2, max_steps=8, eta=2, num_trials=4))
        want_trials = {json.dumps(hp_to_json(t.hp)): t for t in local.trials()}
        want_state = local.state(want.config, want.hp, want.steps)
        want_stats = local.stats()
    study = remote("x")
    best = study.tune(SHA(space, "score", min_steps=2, max_steps=8, eta=2, num_trials=4))
    assert best == want
    trials = study.trials()
    assert len(trials) == len(want_trials)
    for t in trials:
        w = want_trials[json.dumps(hp_to_json(t.hp))]
        assert (t.config, t.steps, t.state, t.metrics) == (w.config, w.steps, w.state, w.metrics)
    record = study.best("score")
    assert record is not None and record.hp == want.hp
    assert study.eval(want.config, want.hp, want.steps) == want.metrics
    assert study.eval(want.config, {"lr": Constant(0.3)}, 2) is None
    state = study.state(want.config, want.hp, want.steps)
    assert state is not None and want_state is not None
    assert (state["w"] == want_state["w"]).all() and state["t"] == want_state["t"]
    assert study.state(want.config, {"lr": Constant(0.3)}, 2) is None
    stats = study.stats()
    for key in ("trials", "steps_requested", "steps_unique", "steps_executed"):
        assert stats[key] == want_stats[key], key
        assert type(stats[key]) is int, key  # counts stay ints over HTTP
    assert study.progress()["finished"] == 4
    assert type(study.progress()["finished"]) is int
    assert study.num_workers == 1
    assert study.failures() == []
    with pytest.raises(InvalidTrialError, match="momentum"):
        study.run({"seed": 1}, {"lr": LRS[0], "momentum": 0.9}, 2)
    with pytest.raises(InvalidTrialError, match="steps"):
        study.run({"seed": 1}, {"lr": LRS[0]}, -1)
    with pytest.raises(ValueError, match="mode"):
        study.best("score", "up")
    with pytest.raises(TrialFailedError, match="boom in train") as info:
        remote("failing").run({"seed": 0, "fail_train_at": 1}, {"lr": LRS[0]}, 3)
    assert "Traceback" in info.value.traceback
    (failure,) = remote("failing").failures()
    assert failure[1].type == "ValueError"


def test_remote_study_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagetree.server import client as client_module

    monkeypatch.setattr(client_module, "_WARNED", set())
    with pytest.warns(client_module.RemoteArgumentWarning, match="storage, workers"):
        study = Study("s", LinearTrainer, storage="sqlite:///x.db", workers=3, url="http://h:1")
    assert isinstance(study, RemoteStudy)
    with pytest.warns(client_module.RemoteArgumentWarning, match="devices_per_worker ignored"):
        Study("s", LinearTrainer, devices_per_worker=2, url="http://h:1")
    with pytest.raises(ValueError, match="url"):
        Study("s", LinearTrainer, url="ftp://h")
    monkeypatch.setenv("STAGETREE_TOKEN", "from-env-0123456789")
    assert Study("s", LinearTrainer, url="http://h:1")._token == "from-env-0123456789"
    assert Study("s", LinearTrainer, url="http://h:1", token="t" * 20)._token == "t" * 20
    assert type(Study("s", LinearTrainer, url="", storage="memory://")) is Study


def test_unreachable_server_gives_up_after_the_reconnect_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from conftest import free_port

    monkeypatch.setenv("STAGETREE_RECONNECT_TIMEOUT", "1")
    url = f"http://127.0.0.1:{free_port()}"
    study = Study("s", LinearTrainer, url=url, token=TOKEN)
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="tried for") as info:
        study.trials()
    assert 0.5 < time.monotonic() - started < 5
    assert url in str(info.value) and TOKEN not in str(info.value)
    study.close()


@pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")
def test_cancelling_a_remote_submission_cancels_it_on_the_server(remote: Any, hub: Hub) -> None:
    study = remote("cancel", SlowLinearTrainer)

    async def main() -> None:
        task = asyncio.ensure_future(study.submit({"seed": 0}, {"lr": LRS[0]}, 40))
        while not study.trials():
            await asyncio.sleep(0.02)
        assert Study.cancel(task)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while study.trials()[0].state != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert study._pending == {}


def test_importing_stagetree_imports_no_web_framework() -> None:
    code = (
        "import sys, stagetree, stagetree.server, stagetree.server.client; "
        "print(sorted({'starlette', 'uvicorn', 'httpx'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_run_and_serve_refuse_bad_token_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagetree.cli import main
    from stagetree.engine.settings import current_overrides

    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    short = tmp_path / "short.token"
    short.write_text("abc\n")
    for token_file in (tmp_path / "missing.token", short):
        args = ["run", str(script), "--url", "http://127.0.0.1:1", "--token-file", str(token_file)]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert str(token_file) in err and "abc" not in err
        assert current_overrides().url is None
        serve = [
            "serve",
            "--storage",
            f"sqlite:///{tmp_path}/p.db",
            "--token-file",
            str(token_file),
        ]
        assert main(serve) == 2
        assert str(token_file) in capsys.readouterr().err
    assert not (tmp_path / "p.db").exists()


def test_numbers_out_of_range_and_deep_bodies_are_400_not_500(client: TestClient) -> None:
    sid = open_session(client)
    url = f"/v1/sessions/{sid}/submissions"
    for steps in (10**30, 2**63):
        message = error(
            client.post(url, json={**trial(), "steps": steps}), 400, "InvalidTrialError"
        )
        assert "steps must be a non-negative int (at most 2**63-1)" in message
    point = {"config": {"seed": 0}, "hp": trial()["hp"], "step": 10**30}
    for path in ("eval", "state"):
        error(client.post(f"/v1/sessions/{sid}/{path}", json=point), 400, "InvalidTrialError")
    deep = b'{"config": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "nested" in error(client.post(url, content=deep), 400, "BadRequest")
    nested: Any = 0
    for _ in range(200):
        nested = [nested]
    body = {**trial(), "config": {"seed": nested}}
    assert "nested" in error(client.post(url, json=body), 400, "BadRequest")
    assert client.get(f"/v1/sessions/{sid}/trials").json()["trials"] == []  # nothing written


def test_a_loopback_server_refuses_foreign_host_and_origin(
    hub: Hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # serve() wires the check: capture the app it would run.
    from stagetree.server import serve as serve_module

    apps: list[Any] = []

    class _NoServer:
        def run(self, sockets: Any) -> None:
            pass

    def capture(app: Any, **options: Any) -> _NoServer:
        apps.append(app)
        return _NoServer()

    monkeypatch.setattr(serve_module, "quiet_server", capture)
    url = f"sqlite:///{tmp_path}/served.db"
    assert serve_module.serve(url, executor="inline", port=0, out=io.StringIO()) == 0
    [app] = apps
    auth = {"Authorization": f"Bearer {(tmp_path / 'served.db.token').read_text().strip()}"}
    with TestClient(app, base_url="http://127.0.0.1:8642") as local:
        assert local.get("/v1/info").status_code == 401  # past the guard: the token
        for host in ("evil.example", "evil.example:8642", "127.0.0.1.evil.example"):
            refused = local.get("/v1/info", headers={"Host": host, **auth})
            assert refused.status_code == 403 and "--allowed-host" in refused.text
            assert refused.json()["error"]["type"] == "HostRefused"
        for host in ("localhost:8642", "127.0.0.1", "[::1]:8642"):
            assert local.get("/v1/info", headers={"Host": host, **auth}).status_code == 200
        foreign = local.get("/v1/info", headers={"Origin": "http://evil.example", **auth})
        assert "refused Origin" in foreign.json()["error"]["message"]
        assert local.get("/", headers={"Origin": "null"}).status_code == 403
        same = local.get("/v1/info", headers={"Origin": "http://localhost:8642", **auth})
        assert same.status_code == 200
    allowed = create_app(hub, TOKEN, allowed_hosts("127.0.0.1", ["box.lan"]))
    with TestClient(allowed, base_url="http://box.lan:8642", headers=AUTH) as named:
        assert named.get("/v1/info").status_code == 200
    with TestClient(create_app(hub, TOKEN, allowed_hosts("0.0.0.0")), headers=AUTH) as anyhost:
        assert anyhost.get("/v1/info").status_code == 200  # off loopback: the token guards
