"""The dashboard's JSON API (``docs/dashboard-api.md``) in process, with Starlette's
TestClient over SQLite plans written by real (inline) studies: every view against the
read side it is built on (:mod:`stagetree.reports`, the storage), tree deltas, the
long-poll, the token, checkpoint downloads, and that the dashboard never writes nor
gets in the way of a study training in another process."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
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

from study_trainers import LinearTrainer

from stagetree import Study, reports
from stagetree.dashboard import start_dashboard
from stagetree.dashboard.app import TOKEN_COOKIE, create_dashboard_app
from stagetree.hp import Constant, Exponential, MultiStep
from stagetree.plan import BasePlanStorage, SQLPlanStorage, open_storage
from stagetree.reports import views
from stagetree.server.app import create_app
from stagetree.server.hub import Hub, HubConfig
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

FAKES = Path(__file__).resolve().parents[1] / "fakes"
ROOT = Path(__file__).resolve().parents[2]
LRS = [Constant(0.05), MultiStep(0.05, [3], 0.5), MultiStep(0.05, [6], 0.01), Constant(0.02)]
TOKEN = "dashboard-token-0123456789"


def _grid(lrs: list[Any], steps: int, **fixed: list[Any]) -> GridSearch:
    return GridSearch(GridSpace({"lr": lrs}, fixed={"seed": [0], **fixed}), "score", steps=steps)


def _tune(url: str, name: str, tuner: GridSearch) -> None:
    with Study(name, LinearTrainer, storage=url, executor="inline") as study:
        study.tune(tuner)


def _run_studies(url: str) -> None:
    """``demo`` (4 trials of 10 steps), ``other`` (2 of them to 12 steps: sharing the
    tree with demo), ``fails`` (one trial fails at step 2, one succeeds)."""
    _tune(url, "demo", _grid(LRS, 10))
    _tune(url, "other", _grid(LRS[:2], 12))
    _tune(url, "fails", _grid([Constant(0.05)], 4, fail_train_at=[100, 2]))


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('dash') / 'plan.db'}"
    _run_studies(url)
    return url


@contextlib.contextmanager
def _client(url: str, token: str | None = None) -> Iterator[tuple[TestClient, BasePlanStorage]]:
    storage = open_storage(url, readonly=True)
    app = create_dashboard_app(lambda: contextlib.nullcontext(storage), url=url, token=token)
    try:
        with TestClient(app) as client:
            yield client, storage
    finally:
        storage.close()


@pytest.fixture
def api(plan: str) -> Iterator[tuple[TestClient, BasePlanStorage]]:
    with _client(plan) as pair:
        yield pair


def _get(client: TestClient, path: str, status: int = 200) -> Any:
    response = client.get(path)
    assert response.status_code == status, response.text
    return response.json()


def _roots(storage: BasePlanStorage, study: str) -> list[str]:
    return list(dict.fromkeys(t["root_key"] for t in reports.trial_rows(storage, study)))


# --------------------------------------------------------------------------- studies


def test_studies_are_the_numbers_of_stagetree_status(api: tuple[TestClient, Any]) -> None:
    client, storage = api
    body = _get(client, "/api/studies")
    assert body["revision"] == storage.revision() > 0
    assert [s["name"] for s in body["studies"]] == ["demo", "other", "fails"]
    for summary in body["studies"]:
        st = reports.study_status(storage, summary["name"])
        assert st.numbers is not None
        for key in ("trials", "finished", "running", "failed", "best_trial", "best_step"):
            assert summary[key] == getattr(st, key), key
        assert summary["best"] == pytest.approx(st.best)
        assert summary["steps_requested"] == st.steps_requested
        assert summary["steps_unique"] == st.steps_unique
        assert summary["steps_executed"] == round(st.numbers["steps_executed"])
        assert summary["device_seconds"] == pytest.approx(st.numbers["device_seconds"])
        assert summary["merge_rate"] == pytest.approx(st.steps_requested / st.steps_unique)
        assert summary["metric"] == "score" and summary["mode"] == "max"
        assert summary["pending"] == summary["cancelled"] == 0
    demo, other, fails = body["studies"]
    assert demo["state"] == other["state"] == "finished"
    assert demo["steps_requested"] == 40 and demo["steps_unique"] == 31
    assert fails["failed"] == 1 and fails["finished"] == 1 and fails["state"] == "finished"
    totals = reports.storage_status(storage, "x").totals
    assert body["totals"] == {
        "steps_requested": round(totals["steps_requested"]),
        "steps_unique": round(totals["steps_unique"]),
        "steps_executed": round(totals["steps_executed"]),
        "device_seconds": pytest.approx(totals["device_seconds"]),
    }


def test_study_detail_and_savings(api: tuple[TestClient, Any]) -> None:
    client, storage = api
    body = _get(client, "/api/studies/demo")
    assert body["study"]["name"] == "demo" and body["revision"] == storage.revision()
    saving = body["savings"]
    executed = body["study"]["steps_executed"]
    assert saving["alone"]["steps"] == 40 and saving["ran"]["steps"] == executed == 31
    assert saving["ratio"] == pytest.approx(40 / 31)
    assert saving["seconds_per_step"] > 0
    assert saving["alone"]["device_seconds"] == pytest.approx(40 * saving["seconds_per_step"])
    # One rate on both sides: alone / ran in device-seconds is the ratio in steps.
    ran = saving["ran"]["device_seconds"]
    assert saving["seconds_per_step"] == pytest.approx(ran / saving["ran"]["steps"])
    assert saving["estimate"] is None  # it ran


def test_a_study_that_has_not_run_gets_the_simulators_estimate(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    with SQLPlanStorage(url) as storage:
        storage.create_study("planned", {"metric": "score", "mode": "max"})
        for lr in LRS:
            hp = {"lr": lr}
            ins = storage.insert_trial("root", hp, 10)
            storage.add_trial("planned", "root", {}, hp, 10, ins.node, ins.step)
    with _client(url) as (client, storage):
        body = _get(client, "/api/studies/planned")
        assert body["study"]["state"] == "idle" and body["study"]["pending"] == 4
        estimate = body["savings"]["estimate"]
        assert estimate["steps_alone"] == 40 and estimate["steps_unique"] == 31
        assert estimate["merge_rate"] == pytest.approx(40 / 31)
        assert estimate["workers"] == 1 and estimate["source"] == "simulator"
        assert estimate["makespan_seconds"] == pytest.approx(31.0)  # 1 s a step, 1 worker
        tree = _get(client, "/api/studies/planned/tree")
        assert {n["state"] for n in tree["nodes"]} == {"pending"}
        assert all(n["done"] == n["start"] for n in tree["nodes"])


# --------------------------------------------------------------------------- the tree


def test_the_tree_is_the_plan(api: tuple[TestClient, Any]) -> None:
    client, storage = api
    tree = _get(client, "/api/studies/demo/tree")
    assert tree["full"] is True and tree["removed"] == []
    roots = _roots(storage, "demo")
    assert tree["roots"] == roots
    plan_nodes = {n.id: n for root in roots for n in storage.nodes(root)}
    nodes = {n["id"]: n for n in tree["nodes"]}
    assert sorted(nodes) == sorted(plan_nodes) and len(nodes) == 4
    checkpoints = {key for root in roots for key in storage.checkpoints(root)}
    for n in tree["nodes"]:
        plan_node = plan_nodes[n["id"]]
        assert (n["parent"], n["start"]) == (plan_node.parent, plan_node.branch_step)
        assert n["state"] == "trained" and n["worker"] is None
        assert n["checkpoints"] == sorted(s for node, s in checkpoints if node == n["id"])
        assert n["start"] <= n["done"] <= n["end"] <= tree["max_step"] == 12
    root = next(n for n in tree["nodes"] if n["parent"] is None)
    # Trials 2 and 3 branch off the root at steps 3 and 6; trial 4 (lr 0.02) branches at
    # step 0 and trains none of the root's steps. The two of "other" continue to 12.
    assert root["trials"] == [1, 2, 3] and root["others"] == 2
    assert (root["done"], root["end"], root["label"]) == (12, 12, "lr=0.05")
    decay = next(n for n in tree["nodes"] if n["start"] == 3)
    assert decay["trials"] == [2] and decay["others"] == 1 and decay["label"] == "lr=0.025"
    other = _get(client, "/api/studies/other/tree")
    assert {n["id"] for n in other["nodes"]} == set(nodes)  # the same tree, seen from other
    assert next(n for n in other["nodes"] if n["id"] == root["id"])["trials"] == [5, 6]


def test_a_failed_trial_fails_its_node(api: tuple[TestClient, Any]) -> None:
    client, _ = api
    tree = _get(client, "/api/studies/fails/tree")
    assert len(tree["roots"]) == 2  # fail_train_at is a fixed hyper-parameter
    states = sorted(n["state"] for n in tree["nodes"])
    assert states == ["failed", "trained"]


def test_a_running_batch_marks_its_nodes_training(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    with SQLPlanStorage(url) as storage:
        storage.create_study("s", {})
        node = storage.insert_trial("root", {"lr": Constant(0.1)}, 10).node
        storage.add_trial("s", "root", {}, {"lr": Constant(0.1)}, 10, node, 10)
        now = time.time()
        start = {"kind": "start", "root_key": "root", "worker": 0, "time": now}
        segments = {"segments": [[node, 0, 10]], "start_step": 0, "stop_step": 10}
        storage.claim("live", "root", [(node, 0, 10)], ttl=60)
        storage.record_activity(
            [
                {**start, "owner": "live", "batch": 1, "data": {**segments, "location": "h:1"}},
                # an engine that died long ago, without an end record
                {**start, "owner": "dead", "batch": 1, "time": now - 600, "data": segments},
            ]
        )
        storage.put_metrics_many([(node, 4, {"loss": 1.0}, False)])
    with _client(url) as (client, _):
        (only,) = _get(client, "/api/studies/s/tree")["nodes"]
        # Batches of two processes: workers are named by where they run.
        assert (only["state"], only["worker"], only["done"]) == ("training", "h:1/0", 4)
        batches = {b["key"]: b for b in _get(client, "/api/studies/s/timeline")["batches"]}
        assert batches["live/1"]["state"] == "running" and batches["live/1"]["ended"] is None
        assert batches["live/1"]["busy_seconds"] >= 0 and batches["live/1"]["trials"] == [1]
        assert batches["dead/1"]["state"] == "lost"


def test_tree_delta_sends_only_what_changed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    _tune(url, "demo", _grid(LRS, 10))
    with _client(url) as (client, _):
        before = _get(client, "/api/studies/demo/tree")
        same = _get(client, f"/api/studies/demo/tree?after={before['revision']}")
        assert same["full"] is False and same["nodes"] == []
        _tune(url, "more", _grid(LRS[1:3], 14))  # two of its trials, to 14 steps
        after = _get(client, "/api/studies/demo/tree")
        assert after["revision"] > before["revision"]
        delta = _get(client, f"/api/studies/demo/tree?after={before['revision']}")
        assert delta["full"] is False and delta["revision"] == after["revision"]
        old = {n["id"]: n for n in before["nodes"]}
        changed = [n for n in after["nodes"] if old.get(n["id"]) != n]
        assert delta["nodes"] == changed
        assert 0 < len(changed) < len(after["nodes"])  # the root and trial 1 did not change
        assert {n["id"] for n in changed} >= {n["id"] for n in after["nodes"] if n["end"] == 14}
        # A revision the server never kept: the whole tree.
        assert _get(client, "/api/studies/demo/tree?after=1")["full"] is True


def test_a_tree_built_from_the_last_one_shares_its_unchanged_nodes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    _tune(url, "demo", _grid(LRS, 10))
    with open_storage(url, readonly=True) as storage:
        before = views.stage_tree(storage, "demo")
    _tune(url, "more", _grid(LRS[1:3], 14))
    with open_storage(url, readonly=True) as storage:
        data = views.read_tree(storage, "demo")
        fresh, shared = views.build_tree(data), views.build_tree(data, before)
    assert shared == fresh  # the same tree, whatever it was built from
    old = {n["id"]: n for n in before["nodes"]}
    for n in shared["nodes"]:
        assert (n is old.get(n["id"])) == (n == old.get(n["id"]))  # unchanged: the old object
    assert any(n is old.get(n["id"]) for n in shared["nodes"])
    assert views.tree_delta(before, shared) == views.tree_delta(before, fresh)
    assert views.tree_delta(before, shared)["nodes"] == [
        n for n in fresh["nodes"] if old.get(n["id"]) != n
    ]


def test_answers_of_the_plan_alone_are_kept_while_the_revision_stays(tmp_path: Path) -> None:
    from stagetree.dashboard.app import AnswerCache

    url = f"sqlite:///{tmp_path}/plan.db"
    _tune(url, "demo", _grid(LRS, 10))
    with _client(url) as (client, _):
        first = client.get("/api/studies/demo/curves?metric=loss")
        assert client.get("/api/studies/demo/curves?metric=loss").content == first.content
        assert client.get("/api/studies/demo/curves").json()["metric"] == "score"
        trials = client.get("/api/studies/demo/trials").json()
        _tune(url, "more", _grid(LRS[:1], 12))  # trains the root on to step 12
        later = client.get("/api/studies/demo/curves?metric=loss").json()
        assert later["revision"] > first.json()["revision"]
        root = str(later["trials"][0]["nodes"][0])
        assert max(s for s, _ in later["segments"][root]) == 12  # the new points
        assert client.get("/api/studies/demo/trials").json()["revision"] > trials["revision"]
    cache = AnswerCache(size=1)
    cache.put(("a",), 0, b"x")
    assert cache.get(("a",), 0) is None  # a storage that keeps no revision
    cache.put(("a",), 3, b"x")
    assert cache.get(("a",), 3) == b"x" and cache.get(("a",), 4) is None
    cache.put(("b",), 3, b"y")
    assert cache.get(("a",), 3) is None and cache.get(("b",), 3) == b"y"


def test_node_detail(api: tuple[TestClient, Any]) -> None:
    client, storage = api
    tree = _get(client, "/api/studies/demo/tree")
    node = next(n for n in tree["nodes"] if n["start"] == 6)  # MultiStep(0.05, [6], 0.01)
    body = _get(client, f"/api/studies/demo/nodes/{node['id']}")
    assert body["node"] == node
    assert body["hp"] == {"lr": [[6, 10, pytest.approx(0.0005)]]}
    plan = storage.metrics(tree["roots"][0], [node["id"]])[node["id"]]
    assert [s for s, _ in body["metrics"]] == sorted(plan) == [7, 8, 9, 10]
    assert body["trials"] == [{"id": 3, "steps": 10, "state": "done"}]
    root = next(n for n in tree["nodes"] if n["parent"] is None)
    assert _get(client, f"/api/studies/demo/nodes/{root['id']}")["hp"] == {"lr": [[0, 12, 0.05]]}
    assert "no node 999" in _get(client, "/api/studies/demo/nodes/999", 404)["error"]


def test_value_runs_are_bounded_and_contiguous() -> None:
    runs = views.value_runs(Exponential(1.0, 0.99), 0, 1000)
    assert len(runs) == views.MAX_RUNS
    assert runs[0][0] == 0 and runs[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
    assert views.value_runs(MultiStep(0.1, [5, 8], 0.5), 2, 10) == [
        [2, 5, 0.1],
        [5, 8, 0.05],
        [8, 10, 0.025],
    ]
    assert views.compact(MultiStep(0.1, [20], 0.1), 0, 30) == "0.1 → 0.01@20"
    assert views.compact(Constant(0.1), 5, 5) == "0.1"
    assert views.compact(Exponential(1.0, 0.5), 0, 30).endswith("(30 values)")


# --------------------------------------------------------------------------- curves


def test_curves_are_shared_segments(api: tuple[TestClient, Any]) -> None:
    client, storage = api
    body = _get(client, "/api/studies/demo/curves")
    assert (body["metric"], body["mode"], body["metrics"]) == ("score", "max", ["loss", "score"])
    assert body["best_trial"] == reports.study_status(storage, "demo").best_trial == 1
    records = {r.id: r for r in reports.trial_records(storage, "demo")}
    assert [t["id"] for t in body["trials"]] == sorted(records)
    for trial in body["trials"]:
        rec = records[trial["id"]]
        assert trial["state"] == rec.state and trial["steps"] == trial["rung"] == rec.steps
        points, previous = [], -1
        for node, end in zip(trial["nodes"], trial["ends"]):
            points += [p for p in body["segments"].get(str(node), []) if previous < p[0] <= end]
            previous = end
        expected = [[s, m["score"]] for s, m in sorted(rec.metrics.items()) if "score" in m]
        assert points == [[s, pytest.approx(v)] for s, v in expected]
    root = body["trials"][0]["nodes"][0]
    assert all(t["nodes"][0] == root for t in body["trials"])  # one shared root segment
    loss = _get(client, "/api/studies/demo/curves?metric=loss")
    assert loss["metric"] == "loss" and loss["mode"] == "min" and loss["best_trial"] == 1


# --------------------------------------------------------------------------- trials


def test_trials_table(api: tuple[TestClient, Any]) -> None:
    client, storage = api
    body = _get(client, "/api/studies/demo/trials")
    assert body["metric"] == "score"
    rows = {t["id"]: t for t in body["trials"]}
    assert rows[2]["hp"] == {"lr": "0.05 → 0.025@3"} and rows[1]["hp"] == {"lr": "0.05"}
    for rec in reports.trial_records(storage, "demo"):
        row = rows[rec.id]
        assert (row["state"], row["steps"], row["config"]) == ("done", 10, {"seed": 0})
        assert row["metrics"] == pytest.approx(rec.metrics[10])
        assert row["error"] is None
        assert row["checkpoint"] == f"/api/studies/demo/trials/{rec.id}/checkpoint"
    failed = next(t for t in _get(client, "/api/studies/fails/trials")["trials"] if t["error"])
    assert failed["state"] == "failed" and failed["checkpoint"] is None
    assert failed["error"].startswith("ValueError: boom in train at step 2")


def test_checkpoint_download_is_the_stored_file(api: tuple[TestClient, Any], plan: str) -> None:
    client, storage = api
    trial = storage.trial(2)
    ref = storage.checkpoint(trial["node"], trial["step"]).ref
    stored = (Path(plan[len("sqlite:///") :] + ".checkpoints") / ref).read_bytes()
    response = client.get("/api/studies/demo/trials/2/checkpoint")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.headers["content-disposition"] == (
        "attachment; filename=demo-trial-2-step-10.ckpt"
    )
    assert response.content == stored
    failed = next(t["id"] for t in reports.trial_rows(storage, "fails") if t["state"] == "failed")
    assert (
        "no checkpoint"
        in _get(client, f"/api/studies/fails/trials/{failed}/checkpoint", 404)["error"]
    )
    assert (
        "no trial 5 in study 'demo'"
        in _get(client, "/api/studies/demo/trials/5/checkpoint", 404)["error"]
    )


# --------------------------------------------------------------------------- timeline


def test_timeline_after_the_study_ran(api: tuple[TestClient, Any]) -> None:
    client, storage = api
    body = _get(client, "/api/studies/demo/timeline")
    records = storage.activity(0, _roots(storage, "demo"))
    assert body["seq"] == max(r.seq for r in records) and body["now"] > 0
    keys = {f"{r.owner}/{r.batch}" for r in records if r.kind == "start"}
    assert {b["key"] for b in body["batches"]} == keys
    assert {b["state"] for b in body["batches"]} == {"done"}
    ran = [b for b in body["batches"] if b["trials"]]
    assert sorted({t for b in ran for t in b["trials"]}) == [1, 2, 3, 4]
    for b in body["batches"]:
        assert b["ended"] >= b["started"] and b["busy_seconds"] >= 0
        assert b["worker"] == "0" and b["location"] and b["root"] == 0
        assert all(b["start_step"] <= s[1] <= s[2] <= b["stop_step"] for s in b["segments"])
        assert all(len(save) == 3 for save in b["saves"])
    assert sum(len(b["saves"]) for b in body["batches"]) == sum(
        1 for r in records if r.kind == "save"
    )
    (worker,) = body["workers"]
    assert worker["busy_seconds"] == pytest.approx(sum(b["busy_seconds"] for b in body["batches"]))
    later = _get(client, f"/api/studies/demo/timeline?after={body['seq']}")
    assert later["batches"] == [] and later["seq"] == body["seq"]
    assert len(later["workers"]) == 1
    failed = _get(client, "/api/studies/fails/timeline")["batches"]
    assert sorted(b["state"] for b in failed) == ["done", "failed"]


# --------------------------------------------------------------------------- errors


def test_not_found_and_bad_requests(api: tuple[TestClient, Any], plan: str) -> None:
    client, _ = api
    for path in ("", "/tree", "/curves", "/trials", "/timeline", "/nodes/1"):
        message = _get(client, f"/api/studies/nope{path}", 404)["error"]
        assert message == f"no study 'nope' in {plan}; studies: demo, other, fails"
    assert "no such endpoint" in _get(client, "/api/nothing", 404)["error"]
    assert "'after'" in _get(client, "/api/studies/demo/tree?after=x", 400)["error"]
    assert "'timeout'" in _get(client, "/api/changes?timeout=-1", 400)["error"]
    for page in ("/", "/study/demo", "/study/demo/tree"):
        response = client.get(page)
        assert response.status_code == 200 and "text/html" in response.headers["content-type"]


# --------------------------------------------------------------------------- the token


def test_the_token_guards_every_api_request(plan: str) -> None:
    with _client(plan, token=TOKEN) as (client, _):
        assert "token" in _get(client, "/api/studies", 401)["error"]
        assert _get(client, "/api/studies/demo/tree", 401)
        bad = client.get("/api/studies", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 403
        good = client.get("/api/studies", headers={"Authorization": f"Bearer {TOKEN}"})
        assert good.status_code == 200
        assert client.get("/").status_code == 200  # the pages hold no data
        assert client.get("/?token=nope", follow_redirects=False).status_code == 403
        # ?token= on a page: a cookie for the browser, and the token out of the address.
        response = client.get("/study/demo?token=" + TOKEN + "&x=1", follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"] == "/study/demo?x=1"
        cookie = response.headers["set-cookie"]
        assert cookie.startswith(f"{TOKEN_COOKIE}={TOKEN};")
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
        assert client.get("/api/studies").status_code == 200  # the cookie carries it
        client.cookies.clear()
        assert client.get("/api/studies").status_code == 401
        assert client.get(f"/api/studies?token={TOKEN}").status_code == 200


def test_ids_and_cursors_out_of_range_are_404_and_400(api: tuple[TestClient, Any]) -> None:
    client, _ = api
    huge = "99999999999999999999"
    for path in (f"/trials/{huge}/checkpoint", f"/nodes/{huge}", f"/trials/{2**63}/checkpoint"):
        assert _get(client, f"/api/studies/demo{path}", 404)["error"]
    assert "'after'" in _get(client, f"/api/studies/demo/tree?after={huge}", 400)["error"]
    assert "'after'" in _get(client, f"/api/changes?after={huge}", 400)["error"]
    assert "'after'" in _get(client, f"/api/studies/demo/timeline?after={huge}", 400)["error"]


def _raw_get(base: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
    import http.client

    host, port = base.split("//")[1].rstrip("/").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_a_loopback_dashboard_answers_only_this_machines_names(plan: str) -> None:
    # DNS rebinding: a page of evil.example, now resolving to 127.0.0.1, asks the
    # dashboard (no token on loopback) for the studies and a checkpoint.
    with start_dashboard(plan) as server:
        port = server.url.rstrip("/").rsplit(":", 1)[1]
        for path in ("/api/studies", "/api/studies/demo/trials/1/checkpoint", "/"):
            status, body = _raw_get(server.url, path, {"Host": f"evil.example:{port}"})
            assert status == 403 and "refused Host" in body and "--allowed-host" in body
        status, body = _raw_get(
            server.url,
            "/api/studies",
            {"Host": f"127.0.0.1:{port}", "Origin": "http://evil.example"},
        )
        assert status == 403 and "refused Origin" in body
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
            assert _raw_get(server.url, "/api/studies", {"Host": host})[0] == 200
        origin = {"Host": f"127.0.0.1:{port}", "Origin": f"http://localhost:{port}"}
        assert _raw_get(server.url, "/api/studies", origin)[0] == 200
    with start_dashboard(plan, allowed_hosts=["dash.lan"]) as named:
        assert _raw_get(named.url, "/api/studies", {"Host": "dash.lan:80"})[0] == 200
        assert _raw_get(named.url, "/api/studies", {"Host": "other.lan"})[0] == 403


# --------------------------------------------------------------------------- never writes


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_dashboard_never_writes(plan: str) -> None:
    db = Path(plan[len("sqlite:///") :])
    digest = _sha(db)
    with open_storage(plan, readonly=True) as other:
        revision = other.revision()
    with _client(plan) as (client, storage):
        assert storage.readonly
        paths = [
            "/api/studies",
            "/api/studies/demo",
            "/api/studies/demo/tree",
            "/api/studies/demo/tree?after=1",
            "/api/studies/demo/nodes/1",
            "/api/studies/demo/curves",
            "/api/studies/demo/trials",
            "/api/studies/demo/trials/1/checkpoint",
            "/api/studies/demo/timeline",
            "/api/changes?after=0",
            "/api/studies/nope",
        ]
        for _ in range(10):
            for path in paths:
                assert client.get(path).status_code in (200, 404)
        assert storage.revision() == revision
    with open_storage(plan, readonly=True) as other:
        assert other.revision() == revision
    assert _sha(db) == digest


# --------------------------------------------------------------------------- long-poll


def test_long_poll_returns_when_the_revision_changes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    with SQLPlanStorage(url) as writer:
        writer.create_study("s", {})
        revision = writer.revision()
        with _client(url) as (client, _):
            began = time.monotonic()
            quiet = _get(client, f"/api/changes?after={revision}&timeout=0.4")
            assert quiet == {"revision": revision}
            assert 0.35 < time.monotonic() - began < 3

            def write() -> None:
                time.sleep(0.3)
                writer.add_stats("test", n=1)

            thread = threading.Thread(target=write)
            began = time.monotonic()
            thread.start()
            changed = _get(client, f"/api/changes?after={revision}&timeout=20")
            thread.join()
            assert changed["revision"] > revision
            assert time.monotonic() - began < 5
            # Already past the cursor: at once.
            began = time.monotonic()
            assert _get(client, "/api/changes?after=0&timeout=20")["revision"] > revision
            assert time.monotonic() - began < 2


def test_stopping_the_server_ends_open_long_polls(plan: str) -> None:
    server = start_dashboard(plan)
    host, port = server.url.split("//")[1].rstrip("/").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"GET /api/changes?after=999999&timeout=60 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        )
        time.sleep(0.3)
        began = time.monotonic()
        server.stop()
        assert time.monotonic() - began < 4
        sock.settimeout(2)
        assert b'{"revision":' in sock.recv(4096)


# --------------------------------------------------------------------------- the server


def test_the_tuning_server_serves_the_dashboard(tmp_path: Path) -> None:
    from stagetree.server.protocol import PROTOCOL_VERSION
    from stagetree.server.trainers import trainer_payload

    url = f"sqlite:///{tmp_path}/plan.db"
    _tune(url, "demo", _grid(LRS, 4))
    hub = Hub(HubConfig(url, executor="inline", ttl=5.0))
    try:
        with TestClient(create_app(hub, TOKEN)) as client:
            assert client.get("/api/studies").status_code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            # No study open on the server yet: a read-only handle of its storage.
            body = client.get("/api/studies", headers=auth).json()
            assert [s["name"] for s in body["studies"]] == ["demo"]
            assert client.get("/").status_code == 200
            assert client.get("/v1/info").status_code == 401  # the API is unchanged
            assert client.get("/v1/nothing", headers=auth).status_code == 404
            opened = client.post(
                "/v1/studies",
                headers=auth,
                json={
                    "name": "remote",
                    "trainer": trainer_payload(LinearTrainer),
                    "protocol": PROTOCOL_VERSION,
                },
            )
            assert opened.status_code == 200, opened.text
            # Now through the studies' engine.
            tree = client.get("/api/studies/demo/tree", headers=auth).json()
            with open_storage(url, readonly=True) as storage:
                assert len(tree["nodes"]) == len(storage.nodes(tree["roots"][0])) == 3
            (study,) = hub._studies.values()
            used: list[bool] = []
            reading = study.reading

            @contextlib.contextmanager
            def spy() -> Iterator[BasePlanStorage]:
                used.append(True)
                with reading() as storage:
                    yield storage

            study.reading = spy  # type: ignore[method-assign]
            assert client.get("/api/studies/demo", headers=auth).status_code == 200
            assert used  # the server's engine, its lock held
    finally:
        hub.close()


# --------------------------------------------------------------------------- concurrency


STUDY_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from study_trainers import SlowLinearTrainer
from stagetree import Study
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

lrs = [Constant(0.05), MultiStep(0.05, [10], 0.5), MultiStep(0.05, [20], 0.1), Constant(0.02)]
space = GridSpace({{"lr": lrs}}, fixed={{"seed": [0]}})
with Study("live", SlowLinearTrainer, storage={url!r}, executor="inline") as study:
    study.tune(GridSearch(space, "score", steps=30))
print("study done")
"""


def test_a_study_in_another_process_trains_while_the_dashboard_polls_hard(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    with SQLPlanStorage(url):
        pass  # the tables exist before the dashboard opens them read-only
    script = tmp_path / "live.py"
    script.write_text(textwrap.dedent(STUDY_SCRIPT.format(tests=str(FAKES), url=url)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    statuses: list[int] = []
    errors: list[str] = []
    with _client(url) as (client, _):

        def poll(paths: list[str]) -> None:
            while proc.poll() is None:
                for path in paths:
                    response = client.get(path)
                    statuses.append(response.status_code)
                    if response.status_code not in (200, 404):
                        errors.append(response.text)

        live = "/api/studies/live"
        pollers = [
            threading.Thread(target=poll, args=([f"{live}/tree", "/api/changes?timeout=0"],)),
            threading.Thread(target=poll, args=(["/api/studies", f"{live}/timeline"],)),
            threading.Thread(target=poll, args=([f"{live}/curves", f"{live}/trials"],)),
        ]
        began = time.monotonic()
        for t in pollers:
            t.start()
        out, err = proc.communicate(timeout=120)
        for t in pollers:
            t.join()
        elapsed = time.monotonic() - began
        tree = _get(client, f"{live}/tree")
    assert proc.returncode == 0, err
    assert "study done" in out
    assert "locked" not in err.lower() and "busy" not in err.lower()
    assert errors == []
    assert len(statuses) / elapsed > 20  # polled hard: dozens of requests a second
    with open_storage(url, readonly=True) as storage:
        assert len(tree["nodes"]) == len(storage.nodes(tree["roots"][0])) == 4
    assert {n["state"] for n in tree["nodes"]} == {"trained"}


def test_schema_checks_happen_before_reading(tmp_path: Path) -> None:
    # (The CLI's clear messages are in test_dashboard_cli.py; the views need a plan.)
    db = tmp_path / "plan.db"
    SQLPlanStorage(f"sqlite:///{db}").close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE stagetree_meta SET value = '999' WHERE key = 'schema_version'")
    from stagetree.exceptions import SchemaVersionError

    with pytest.raises(SchemaVersionError, match="newer"):
        start_dashboard(f"sqlite:///{db}")


def test_the_pace_of_live_updates_follows_what_answers_cost() -> None:
    from stagetree.dashboard.app import Pacer

    pacer = Pacer(factor=1.0, most=2.0, half_life=2.0)
    assert pacer.gap(0.0) == 0.0  # nothing measured: at once
    pacer.record(0.5, now=10.0)
    assert pacer.gap(10.0) == 0.5
    pacer.record(0.01, now=10.0)
    assert pacer.gap(10.0) == 0.5  # the largest recent cost counts...
    assert pacer.gap(12.0) == pytest.approx(0.25)  # ...halving every half-life
    pacer.record(10.0, now=12.0)
    assert pacer.gap(12.0) == 2.0  # bounded


def test_announced_branches_are_declared_not_work_to_do(tmp_path: Path) -> None:
    """A trial a tuner announced (``Study.declare``) and never submitted is a
    ``declared`` node, and the stage it branches from is ``wanted`` only as far as the
    submitted trial's requests go: past that it is not work still to do."""
    url = f"sqlite:///{tmp_path}/plan.db"
    with Study("announce", LinearTrainer, storage=url, executor="inline") as study:
        study.begin_tuning("score", "max", "test", horizon=20)
        study.declare([({}, {"lr": MultiStep(0.05, [15], 0.5)})])
        study.run({}, {"lr": Constant(0.05)}, 10)
        study.end_tuning()
    storage = open_storage(url, readonly=True)
    nodes = {n["id"]: n for n in views.stage_tree(storage, "announce")["nodes"]}
    (root,) = [n for n in nodes.values() if n["parent"] is None]
    (child,) = [n for n in nodes.values() if n["parent"] is not None]
    assert child["state"] == "declared" and child["start"] == 15 and child["trials"] == []
    assert root["state"] == "trained" and root["done"] == 10
    assert root["wanted"] == 10 and root["end"] == 15  # 10..15 only carries the branch


def test_the_saving_is_the_steps_saved_of_the_reports(api: tuple[TestClient, Any]) -> None:
    """One definition of the saving: (executed + steps saved) / executed, steps saved as
    `stagetree run`'s report and `stagetree status` count them (the finished trials'
    requested steps less those executed): a failed trial's steps are no saving, and
    work still to do never is (before: requested / executed, whatever had finished)."""
    client, storage = api
    for summary in _get(client, "/api/studies")["studies"]:
        numbers = reports.study_status(storage, summary["name"]).numbers
        assert numbers is not None
        executed, saved = summary["steps_executed"], round(numbers["steps_saved"])
        assert summary["saving"] == pytest.approx((executed + saved) / executed)
        detail = _get(client, f"/api/studies/{summary['name']}")["savings"]
        assert detail["ratio"] == pytest.approx(summary["saving"])
        assert detail["saved"]["steps"] == saved
        assert detail["alone"]["steps"] == executed + saved
    fails = _get(client, "/api/studies/fails")
    # One trial failed at its start: nothing was spared, whatever it requested.
    assert fails["study"]["steps_requested"] > fails["study"]["steps_executed"]
    assert fails["study"]["saving"] == 1.0 and fails["savings"]["saved"]["steps"] == 0
