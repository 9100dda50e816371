"""A fake dashboard back end: the JSON of ``docs/dashboard-api.md`` over a synthetic study,
and the static pages of ``stagetree/dashboard/static``.

For developing the front end without a storage, and for rendering trees too large to
train in a test (``benchmarks/dashboard_render.py``). The synthetic plan is a random
binary-ish tree: every trial is a leaf, every split a branch step; ``advance()`` trains
the next pending node (a new revision), so live updates can be watched.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STATIC = Path(__file__).resolve().parent.parent / "stagetree" / "dashboard" / "static"


class FakeStudy:
    """A synthetic study of ``trials`` trials over ``max_step`` steps, trained in node
    order by ``advance()``."""

    def __init__(self, name: str, trials: int, max_step: int = 30, seed: int = 0) -> None:
        self.name = name
        self.max_step = max_step
        self.rng = random.Random(seed)
        self.nodes: dict[int, dict[str, Any]] = {}
        self.changed: dict[int, int] = {}  # node id -> revision of its last change
        self.trial_nodes: dict[int, list[int]] = {}
        self.lr: dict[int, float] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.batch_seq: dict[str, int] = {}
        self._next = 0  # the next node advance() trains
        self._build(trials)

    def _build(self, trials: int) -> None:
        # one root shared by all trials, split recursively at random steps
        next_id = 0
        stack: list[tuple[int | None, int, list[int], float]] = [
            (None, 0, list(range(trials)), 0.1)
        ]
        self.expo: dict[int, float] = {}  # training "exposure" at a node's start
        while stack:
            parent, start, tids, lr = stack.pop()
            nid = next_id
            next_id += 1
            node = {
                "id": nid,
                "parent": parent,
                "root": 0,
                "start": start,
                "end": self.max_step,
                "done": start,
                "state": "pending",
                "worker": None,
                "checkpoints": [],
                "trials": list(tids),
                "others": 0,
                "label": f"lr={lr:g}" if parent is None else f"lr → {lr:g}@{start}",
            }
            self.nodes[nid] = node
            self.lr[nid] = lr
            if parent is None:
                self.expo[nid] = 0.0
            else:
                p = self.nodes[parent]
                self.expo[nid] = self.expo[parent] + (start - p["start"]) * self.lr[parent]
            for t in tids:
                self.trial_nodes.setdefault(t, []).append(nid)
            if len(tids) > 1 and start < self.max_step - 1:
                rest = self.max_step - start
                split = start + max(1, int(rest * self.rng.uniform(0.15, 0.5)))
                node["end"] = split
                cut = max(1, min(len(tids) - 1, len(tids) // 2 + self.rng.randint(-1, 1)))
                for i, part in enumerate((tids[:cut], tids[cut:])):
                    stack.append((nid, split, part, round(lr * (0.6 if i else 1.5), 6)))
        for node in self.nodes.values():
            self.changed[node["id"]] = 1

    # ---------------------------------------------------------------- training
    def advance(self, revision: int, now: float) -> int | None:
        """Train the next node in id order (parents come before their children)."""
        while self._next < len(self.nodes) and self.nodes[self._next]["state"] == "trained":
            self._next += 1
        if self._next >= len(self.nodes):
            return None
        node = self.nodes[self._next]
        node["state"] = "trained"
        node["worker"] = None
        node["done"] = node["end"]
        node["checkpoints"] = [node["end"]]
        self.changed[node["id"]] = revision
        key = f"fake/{len(self.batches)}"
        self.batches[key] = {
            "key": key,
            "worker": str(len(self.batches) % 2),
            "location": "fakehost:1",
            "root": 0,
            "segments": [[node["id"], node["start"], node["end"]]],
            "start_step": node["start"],
            "stop_step": node["end"],
            "started": now - 1.5,
            "ended": now,
            "state": "done",
            "load_seconds": 0.2,
            "busy_seconds": 1.5,
            "saves": [[now - 0.05, node["end"], 0.05]],
            "trials": node["trials"][:50],
        }
        self.batch_seq[key] = revision
        return int(node["id"])

    def train_all(self) -> None:
        while self.advance(1, time.time()) is not None:
            pass

    def set_training(self, nid: int, worker: str, revision: int) -> None:
        node = self.nodes[nid]
        node["state"] = "training"
        node["worker"] = worker
        node["done"] = (node["start"] + node["end"]) // 2
        self.changed[nid] = revision

    # ---------------------------------------------------------------- views
    def metric(self, nid: int, step: int) -> float:
        node = self.nodes[nid]
        e = self.expo[nid] + (step - node["start"]) * self.lr[nid]
        hot = 0.05 if self.lr[nid] > 0.2 else 0.0
        wobble = 0.02 * math.sin(3 * e) + hot * (step - node["start"])
        return round(1.0 - 0.9 * math.exp(-e) - 0.01 * wobble, 5)

    def trial_steps(self, tid: int) -> int:
        return self.max_step

    def trial_state(self, tid: int) -> str:
        path = self.trial_nodes[tid]
        states = {self.nodes[n]["state"] for n in path}
        if states == {"trained"}:
            return "done"
        return "running" if "trained" in states or "training" in states else "pending"

    def trial_metric(self, tid: int) -> float | None:
        last = self.nodes[self.trial_nodes[tid][-1]]
        return self.metric(last["id"], last["done"]) if last["done"] > last["start"] else None

    def best(self) -> tuple[float | None, int | None]:
        scored = [(m, t) for t in self.trial_nodes if (m := self.trial_metric(t)) is not None]
        if not scored:
            return None, None
        m, t = max(scored)
        return m, t

    def steps(self) -> tuple[int, int, int]:
        requested = len(self.trial_nodes) * self.max_step
        unique = sum(n["end"] - n["start"] for n in self.nodes.values())
        executed = sum(n["done"] - n["start"] for n in self.nodes.values())
        return requested, unique, executed

    def summary(self) -> dict[str, Any]:
        states = [self.trial_state(t) for t in self.trial_nodes]
        requested, unique, executed = self.steps()
        best, best_trial = self.best()
        return {
            "name": self.name,
            "created": 1763900000.0,
            "state": "finished" if all(s == "done" for s in states) else "running",
            "trials": len(states),
            "finished": states.count("done"),
            "running": states.count("running"),
            "failed": 0,
            "pending": states.count("pending"),
            "cancelled": 0,
            "metric": "accuracy",
            "mode": "max",
            "best": best,
            "best_trial": best_trial,
            "best_step": self.max_step if best is not None else None,
            "steps_requested": requested,
            "steps_unique": unique,
            "steps_executed": executed,
            "merge_rate": round(requested / unique, 3) if unique else None,
            "device_seconds": round(executed * 0.1, 2),
            "saving": round(requested / executed, 3) if executed else None,
            "workers": {"0": "fakehost:1", "1": "fakehost:1"},
        }

    def savings(self) -> dict[str, Any]:
        requested, unique, executed = self.steps()
        return {
            "alone": {"steps": requested, "device_seconds": requested * 0.1},
            "ran": {"steps": executed, "device_seconds": executed * 0.1},
            "ratio": round(requested / executed, 3) if executed else None,
            "seconds_per_step": 0.1 if executed else None,
            "estimate": None
            if executed
            else {
                "steps_alone": requested,
                "steps_unique": unique,
                "merge_rate": round(requested / unique, 3),
                "workers": 2,
                "makespan_seconds": unique * 0.1 / 2,
                "source": "simulator",
            },
        }

    def node_detail(self, nid: int) -> dict[str, Any]:
        node = self.nodes[nid]
        lr = self.lr[nid]
        metrics = [
            [s, {"accuracy": self.metric(nid, s), "loss": round(1 - self.metric(nid, s), 5)}]
            for s in range(node["start"] + 1, node["done"] + 1)
        ]
        return {
            "node": node,
            "hp": {
                "lr": [[node["start"], node["end"], lr]],
                "momentum": [[node["start"], node["end"], 0.9]],
            },
            "metrics": metrics,
            "trials": [
                {"id": t, "steps": self.max_step, "state": self.trial_state(t)}
                for t in node["trials"][:100]
            ],
        }

    def curves(self, metric: str) -> dict[str, Any]:
        segments = {}
        for nid, node in self.nodes.items():
            pts = []
            for s in range(node["start"] + 1, node["done"] + 1):
                v = self.metric(nid, s)
                pts.append([s, v if metric == "accuracy" else round(1 - v, 5)])
            segments[str(nid)] = pts
        _best, best_trial = self.best()
        return {
            "metric": metric,
            "mode": "max" if metric == "accuracy" else "min",
            "metrics": ["accuracy", "loss"],
            "best_trial": best_trial,
            "segments": segments,
            "trials": [
                {
                    "id": t,
                    "state": self.trial_state(t),
                    "steps": self.max_step,
                    "rung": 10 if t % 3 == 0 else self.max_step,
                    "nodes": path,
                }
                for t, path in self.trial_nodes.items()
            ],
        }

    def trials(self) -> dict[str, Any]:
        rows = []
        for t, path in self.trial_nodes.items():
            state = self.trial_state(t)
            m = self.trial_metric(t)
            rows.append(
                {
                    "id": t,
                    "state": state,
                    "steps": self.max_step,
                    "config": {"seed": 0, "wd": 1e-4},
                    "hp": {"lr": " → ".join(f"{self.lr[n]:g}" for n in path)},
                    "metrics": {} if m is None else {"accuracy": m, "loss": round(1 - m, 5)},
                    "error": None,
                    "checkpoint": f"/api/studies/{self.name}/trials/{t}/checkpoint"
                    if state == "done"
                    else None,
                }
            )
        return {"metric": "accuracy", "trials": rows}


class FakeBackend:
    """The revision counter, the studies, and the long-poll condition."""

    def __init__(self, studies: list[FakeStudy], url: str = "sqlite:///fake.db") -> None:
        self.url = url
        self.studies = {s.name: s for s in studies}
        self.revision = 1
        self.lock = threading.Lock()
        self.snapshots_from = 1  # tree?after= below this answers full

    def bump(self) -> int:
        with self.lock:
            self.revision += 1
            return self.revision

    def advance(self, name: str) -> int | None:
        study = self.studies[name]
        rev = self.bump()
        return study.advance(rev, time.time())


def create_fake_app(backend: FakeBackend) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    def j(body: dict[str, Any], status: int = 200) -> JSONResponse:
        return JSONResponse({"revision": backend.revision, **body}, status_code=status)

    def study_or_404(request: Request) -> FakeStudy | JSONResponse:
        name = request.path_params["name"]
        if name not in backend.studies:
            names = ", ".join(backend.studies)
            return JSONResponse(
                {"error": f"no study {name!r} in {backend.url}; studies: {names}"},
                status_code=404,
            )
        return backend.studies[name]

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def changes(request: Request) -> Response:
        after = int(request.query_params.get("after", 0))
        timeout = min(float(request.query_params.get("timeout", 25)), 60)
        deadline = time.monotonic() + timeout
        while backend.revision <= after and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return j({})

    async def studies(request: Request) -> Response:
        return j(
            {
                "url": backend.url,
                "studies": [s.summary() for s in backend.studies.values()],
                "totals": {
                    "steps_requested": 0,
                    "steps_unique": 0,
                    "steps_executed": 0,
                    "device_seconds": 0.0,
                },
            }
        )

    async def study(request: Request) -> Response:
        s = study_or_404(request)
        if isinstance(s, Response):
            return s
        return j({"study": s.summary(), "savings": s.savings()})

    async def tree(request: Request) -> Response:
        s = study_or_404(request)
        if isinstance(s, Response):
            return s
        after = request.query_params.get("after")
        if after is None or int(after) < backend.snapshots_from:
            nodes = list(s.nodes.values())
            full = True
        else:
            nodes = [s.nodes[n] for n, rev in s.changed.items() if rev > int(after)]
            full = False
        return j(
            {
                "full": full,
                "max_step": s.max_step,
                "roots": ["fakeroot"],
                "nodes": nodes,
                "removed": [],
            }
        )

    async def node(request: Request) -> Response:
        s = study_or_404(request)
        if isinstance(s, Response):
            return s
        nid = int(request.path_params["nid"])
        if nid not in s.nodes:
            return JSONResponse({"error": f"no node {nid}"}, status_code=404)
        return j(s.node_detail(nid))

    async def curves(request: Request) -> Response:
        s = study_or_404(request)
        if isinstance(s, Response):
            return s
        return j(s.curves(request.query_params.get("metric", "accuracy")))

    async def trials(request: Request) -> Response:
        s = study_or_404(request)
        if isinstance(s, Response):
            return s
        return j(s.trials())

    async def timeline(request: Request) -> Response:
        s = study_or_404(request)
        if isinstance(s, Response):
            return s
        after = int(request.query_params.get("after", 0))
        batches = [b for k, b in s.batches.items() if s.batch_seq[k] > after]
        busy: dict[str, float] = {}
        for b in s.batches.values():
            busy[b["worker"]] = busy.get(b["worker"], 0.0) + b["busy_seconds"]
        return j(
            {
                "seq": backend.revision,
                "now": time.time(),
                "batches": batches,
                "workers": [
                    {"worker": w, "busy_seconds": v, "idle_seconds": 0.5}
                    for w, v in sorted(busy.items())
                ],
            }
        )

    async def checkpoint(request: Request) -> Response:
        return Response(b"fake", media_type="application/octet-stream")

    return Starlette(
        routes=[
            Route("/", index),
            Route("/study/{name}", index),
            Route("/study/{name}/{view}", index),
            Route("/api/changes", changes),
            Route("/api/studies", studies),
            Route("/api/studies/{name}", study),
            Route("/api/studies/{name}/tree", tree),
            Route("/api/studies/{name}/nodes/{nid}", node),
            Route("/api/studies/{name}/curves", curves),
            Route("/api/studies/{name}/trials", trials),
            Route("/api/studies/{name}/timeline", timeline),
            Route("/api/studies/{name}/trials/{tid}/checkpoint", checkpoint),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )


@contextmanager
def serve_fake(backend: FakeBackend, port: int = 0) -> Iterator[str]:
    """Serve the fake on 127.0.0.1 in a background thread; yields its base URL."""
    import socket

    import uvicorn

    if port == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
    config = uvicorn.Config(
        create_fake_app(backend), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


if __name__ == "__main__":  # python tests/dashboard_fake.py [PORT] [TRIALS]: serve by hand
    import sys

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8643
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    demo = FakeStudy("demo", n)
    for _ in range(len(demo.nodes) // 2):
        demo.advance(1, time.time() - 10)
    backend = FakeBackend([demo, FakeStudy("fresh", 6, seed=3)])
    with serve_fake(backend, port) as url:
        print(url, flush=True)
        while True:
            time.sleep(2)
            backend.advance("demo")
