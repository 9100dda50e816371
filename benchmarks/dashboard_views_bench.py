"""The dashboard's read side, in process: how long each JSON view of
``docs/dashboard-api.md`` takes on a finished synthetic study of 100, 1,000 and 10,000
trials (``benchmarks/_synthetic_plan.py``) in SQLite, through the dashboard's own app
(Starlette's test client: the views, their caches, JSON and gzip; no browser, no
network).

    .venv/bin/python benchmarks/dashboard_views_bench.py [--sizes 100,1000,10000]
        [--repeat 3] [--cache DIR]

Seconds, the median of ``--repeat`` runs; two tables:

* **First request** (each on a fresh app over a fresh read-only handle, the read
  side's process-wide caches emptied, as a newly started ``stagetree dashboard`` has):
  ``studies``, ``study``, ``tree``, ``curves``, ``trials``, ``timeline``
  (``/api/studies``, ``/api/studies/bench``, ``.../tree``, ...), and ``paint``:
  ``study`` and ``tree`` requested at once (two threads), as the study page does at
  first paint.
* **After a change** (a dashboard that has served every view once): another handle
  adds one trial (its path, then its row: two commits), then each view is asked again,
  the tree and the timeline as deltas (``tree?after=``, ``timeline?after=``);
  ``update`` is ``study`` + ``tree Δ`` + ``timeline Δ``, what a page asks for on a
  live update, and ``update (states)`` the same after three requests failed (three
  commits; their nodes turn ``failed``).

Plans are written once into ``--cache`` (default: ``$TMPDIR/stagetree-views-bench``)
and copied for each run, so that the changes never accumulate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, markdown_table
from _synthetic_plan import STUDY, synthetic_hp, write_study

from stagetree import hp
from stagetree.plan import BasePlanStorage, RequestState, open_storage
from stagetree.reports import views

with warnings.catch_warnings():  # starlette >= 1 prefers httpx2 for its test client
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from stagetree.dashboard.app import create_dashboard_app

_ROOT = "synthetic-root"
_STEPS = 60


def plan_file(cache: Path, trials: int) -> Path:
    """The cached plan of ``trials`` trials (written when missing)."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"plan-{trials}.db"
    if not path.exists():
        partial = path.with_suffix(".tmp")
        partial.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open_storage(f"sqlite:///{partial}") as storage:
            write_study(storage, trials, steps=_STEPS)
        partial.rename(path)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return path


@contextlib.contextmanager
def fresh_copy(path: Path) -> Iterator[str]:
    """A copy of the plan at ``path``, as a URL, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="views-bench-") as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        yield f"sqlite:///{copy}"


def forget() -> None:
    """Empty the process-wide caches of the read side (the values and labels of
    sequences), as a newly started dashboard process has them."""
    views.compact.cache_clear()
    views._label.cache_clear()
    hp._chunk.cache_clear()


@contextlib.contextmanager
def client(url: str) -> Iterator[TestClient]:
    """A fresh dashboard app over a fresh read-only handle of ``url``."""
    storage = open_storage(url, readonly=True)
    app = create_dashboard_app(lambda: contextlib.nullcontext(storage), url=url)
    try:
        with TestClient(app) as c:
            yield c
    finally:
        storage.close()


def _fetch(c: TestClient, path: str) -> bytes:
    """The body of ``GET path`` (gzip, as a browser asks for it), not parsed."""
    response = c.get(path, headers={"Accept-Encoding": "gzip"})
    if response.status_code != 200:
        raise RuntimeError(f"GET {path}: {response.status_code} {response.text[:200]}")
    return response.content


def _get(c: TestClient, path: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_fetch(c, path))
    return data


def add_trial(writer: BasePlanStorage, trials: int) -> None:
    """One new trial of the study, as an engine adds it: its path, then its row."""
    hp = synthetic_hp(trials + 1, _STEPS)[trials]
    ins = writer.insert_trials(_ROOT, [(hp, _STEPS)])[0]
    writer.add_trial(
        STUDY,
        _ROOT,
        {"model": "synthetic"},
        hp,
        _STEPS,
        ins.node,
        ins.step,
        attrs={"version": "synthetic"},
    )


def fail_requests(writer: BasePlanStorage) -> None:
    """Three done requests failed (three commits), spread over the tree."""
    done = writer.requests(_ROOT, states=[RequestState.DONE])
    for r in done[:: max(len(done) // 3, 1)][:3]:
        writer.set_request_state(r.node, r.step, RequestState.FAILED, "bench")


def first_requests(url: str) -> dict[str, float]:
    """Table 1: the first request of each view, each on a fresh app."""
    out: dict[str, float] = {}
    s = f"/api/studies/{STUDY}"
    for column, endpoint in (
        ("studies", "/api/studies"),
        ("study", s),
        ("tree", f"{s}/tree"),
        ("curves", f"{s}/curves"),
        ("trials", f"{s}/trials"),
        ("timeline", f"{s}/timeline"),
    ):
        forget()
        with client(url) as c:
            t0 = time.perf_counter()
            _fetch(c, endpoint)
            out[column] = time.perf_counter() - t0
    forget()
    with client(url) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        jobs = [pool.submit(_fetch, c, e) for e in (s, f"{s}/tree")]
        for job in jobs:
            job.result()
        out["paint"] = time.perf_counter() - t0
    return out


def after_changes(url: str, trials: int) -> dict[str, float]:
    """Table 2: every view again after one trial was added, and a live update after
    three requests failed, on a dashboard that has served every view once."""
    out: dict[str, float] = {}
    s = f"/api/studies/{STUDY}"
    forget()  # what the first requests left behind (a dashboard has one handle)
    gc.collect()
    with client(url) as c, open_storage(url) as writer:
        for endpoint in ("/api/studies", s, f"{s}/curves", f"{s}/trials"):
            _fetch(c, endpoint)
        revision = int(_get(c, f"{s}/tree")["revision"])
        seq = int(_get(c, f"{s}/timeline")["seq"])
        add_trial(writer, trials)
        bodies: dict[str, bytes] = {}
        for column, endpoint in (
            ("study", s),
            ("tree Δ", f"{s}/tree?after={revision}"),
            ("timeline Δ", f"{s}/timeline?after={seq}"),
            ("studies", "/api/studies"),
            ("curves", f"{s}/curves"),
            ("trials", f"{s}/trials"),
        ):
            t0 = time.perf_counter()
            bodies[column] = _fetch(c, endpoint)
            out[column] = time.perf_counter() - t0
        out["update"] = out["study"] + out["tree Δ"] + out["timeline Δ"]
        delta = json.loads(bodies["tree Δ"])
        assert delta["full"] is False and delta["nodes"], "the tree's delta was not kept"
        revision, seq = int(delta["revision"]), int(json.loads(bodies["timeline Δ"])["seq"])
        fail_requests(writer)
        t0 = time.perf_counter()
        _fetch(c, s)
        delta = _get(c, f"{s}/tree?after={revision}")
        _fetch(c, f"{s}/timeline?after={seq}")
        out["update (states)"] = time.perf_counter() - t0
        assert delta["full"] is False and len(delta["nodes"]) >= 3, "no failed nodes"
    return out


def one_run(path: Path, trials: int) -> dict[str, float]:
    """Every column once, over fresh copies of the plan."""
    with fresh_copy(path) as url:
        out = first_requests(url)
    with fresh_copy(path) as url:
        out.update({f"after: {k}": v for k, v in after_changes(url, trials).items()})
    return out


FIRST = ("studies", "study", "tree", "paint", "curves", "trials", "timeline")
AFTER = (
    "studies",
    "study",
    "tree Δ",
    "timeline Δ",
    "curves",
    "trials",
    "update",
    "update (states)",
)


def _cells(runs: list[dict[str, float]], keys: tuple[str, ...], prefix: str = "") -> list[str]:
    return [f"{statistics.median(r[prefix + k] for r in runs):.3f}" for k in keys]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "stagetree-views-bench"
    )
    args = parser.parse_args()
    one_run(plan_file(args.cache, 100), 100)  # imports and first-call costs, not timed
    first, after = [], []
    for trials in (int(x) for x in args.sizes.split(",")):
        path = plan_file(args.cache, trials)
        runs = [one_run(path, trials) for _ in range(args.repeat)]

        first.append([f"{trials:,}", *_cells(runs, FIRST)])
        after.append([f"{trials:,}", *_cells(runs, AFTER, "after: ")])
        print(f"{trials} trials done", file=sys.stderr)
    info = machine_info()
    print(f"seconds, median of {args.repeat}; {info.get('cpu', '')} ({info.get('python', '')})")
    print("\nFirst request (a fresh dashboard):\n")
    print(markdown_table(["trials", *FIRST], first))
    print("\nAfter a change (one trial added; states: three requests failed):\n")
    print(markdown_table(["trials", *AFTER], after))


if __name__ == "__main__":
    main()
