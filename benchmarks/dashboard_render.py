"""Time to first paint of the dashboard's stage tree in Chromium, over the real back end.

A synthetic plan is written straight into an in-memory storage (nothing trains): trial
``i`` follows a piecewise-constant ``lr`` whose value after step ``10 k`` depends on bit
``k`` of ``i``, so trials sharing their low bits share a prefix and ``N`` trials make a
binary tree of about ``2 N`` nodes. The first half of the trials are marked trained
(requests done, metrics and a checkpoint at their last step). The dashboard
(:func:`stagetree.dashboard.serve.start_dashboard`, reading that storage) serves it on a
free loopback port; Playwright drives Debian's Chromium (``/usr/bin/chromium``, never a
downloaded browser) to ``/study/big`` and waits for ``window.stagetree.ready`` (set after
the first paint of the tree).

Per size: plan nodes, the size of the tree's JSON, the server's time to answer ``/tree``
(its tree of that revision cached), time to first paint in the page (navigation start to
ready, ``performance.now()``): on the first load (cold: the server builds the tree), and
the median and worst of ``--repeats`` loads of a fresh page after it; and rows drawn
(subtrees past ~1,500 rows are collapsed). The goal: 10,000 trials render in < 3 s.

Run: ``.venv/bin/python benchmarks/dashboard_render.py [--trials 100 1000 10000]
[--repeats 3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
import urllib.request

from stagetree.dashboard.serve import start_dashboard
from stagetree.hp import Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.plan.model import RequestState

CHROMIUM = "/usr/bin/chromium"
STUDY = "big"
ROOT = "bench-root"


def build_plan(trials: int) -> MemoryPlanStorage:
    """A plan of ``trials`` trials in one tree, half of them trained."""
    bits = max(1, math.ceil(math.log2(max(trials, 2))))
    steps = 10 * bits + 10
    storage = MemoryPlanStorage()
    storage.register_root(ROOT, {"seed": 0})
    storage.create_study(STUDY, {"metric": "score", "mode": "max"})
    items = []
    for i in range(trials):
        values = [0.1]
        for k in range(bits):
            values.append(round(values[-1] * (0.5 if (i >> k) & 1 else 0.9), 12))
        milestones = [10 * (k + 1) for k in range(bits)]
        items.append(({"lr": Piecewise(values, milestones)}, steps))
    inserted = storage.insert_trials(ROOT, items)
    for i, ((hp, _), where) in enumerate(zip(items, inserted)):
        trained = i < trials // 2
        tid = storage.add_trial(
            STUDY,
            ROOT,
            {"seed": 0},
            hp,
            steps,
            where.node,
            where.step,
            state="done" if trained else "pending",
        )
        if trained:
            storage.put_metrics_many([(where.node, steps, {"score": -1.0 / (1 + tid)}, True)])
            storage.put_checkpoint(where.node, steps, f"bench-{tid}", 1)
            storage.set_request_state(where.node, steps, RequestState.DONE)
    return storage


def tree_answer(base: str) -> tuple[float, int]:
    """Seconds and bytes of a /tree answer."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{base}api/studies/{STUDY}/tree") as resp:
        body = resp.read()
    seconds = time.perf_counter() - t0
    json.loads(body)
    return seconds, len(body)


def paint(browser: object, base: str, repeats: int) -> tuple[list[float], int]:
    """Times (s) from navigation start to the tree's first paint, and the rows drawn."""
    times = []
    rendered = 0
    for _ in range(repeats):
        page = browser.new_page(viewport={"width": 1280, "height": 800})  # type: ignore[attr-defined]
        page.goto(f"{base}study/{STUDY}")
        page.wait_for_function("window.stagetree && window.stagetree.ready", timeout=60_000)
        times.append(page.evaluate("performance.now()") / 1000)
        rendered = page.evaluate("window.stagetree.rendered")
        page.close()
    return times, rendered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for n in args.trials:
            t0 = time.perf_counter()
            storage = build_plan(n)
            built = time.perf_counter() - t0
            nodes = len(storage.nodes(ROOT))
            server = start_dashboard(
                "memory://", reader=lambda s=storage: contextlib.nullcontext(s)
            )
            try:
                # the first load finds nothing cached on the server: it builds the tree
                (cold,), _ = paint(browser, server.url, 1)
                answer, size = tree_answer(server.url)
                times, rendered = paint(browser, server.url, args.repeats)
            finally:
                server.stop()
            rows.append(
                (n, nodes, size, answer, cold, statistics.median(times), max(times), rendered)
            )
            print(f"{n} trials: plan built in {built:.1f} s", flush=True)
        browser.close()
    print()
    print(
        "| trials | plan nodes | tree JSON | /tree answer | first paint, cold "
        "| first paint, median | worst | rows drawn |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, nodes, size, answer, cold, med, worst, rendered in rows:
        print(
            f"| {n:,} | {nodes:,} | {size / 1e6:.2f} MB | {answer:.2f} s | {cold:.2f} s "
            f"| {med:.2f} s | {worst:.2f} s | {rendered:,} |"
        )


if __name__ == "__main__":
    main()
