"""Time to first paint of the dashboard's views in Chromium, over the real back end.

A finished grid study of ``N`` trials is written straight into a SQLite plan
(``_synthetic_plan.write_study``: nothing trains). The dashboard
(:func:`stagetree.dashboard.serve.start_dashboard`, as ``stagetree dashboard`` would run)
serves it on a free loopback port; Playwright drives Debian's Chromium
(``/usr/bin/chromium``, never a downloaded browser) to the study's page and waits for
``window.stagetree.ready`` (set after the view's first paint).

Per size: plan nodes, the size of the tree's JSON, the server's time to answer ``/tree``
(its tree of that revision cached), time to first paint of the stage tree (navigation
start to ready, ``performance.now()``): on the first load (cold: the server builds the
tree), and the median and worst of ``--repeats`` loads of a fresh page after it; rows
drawn (subtrees past ~1,500 rows are collapsed); and one load each of the learning
curves, the trials table and the workers timeline. The goal: 10,000 trials render in
< 3 s.

Run: ``.venv/bin/python benchmarks/dashboard_render.py [--trials 100 1000 10000]
[--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from _synthetic_plan import STUDY, write_study

from stagetree.dashboard.serve import start_dashboard
from stagetree.plan import open_storage

CHROMIUM = "/usr/bin/chromium"
VIEWS = ("curves", "trials", "workers")


def tree_answer(base: str) -> tuple[float, int]:
    """Seconds and bytes of a /tree answer."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{base}api/studies/{STUDY}/tree") as resp:
        body = resp.read()
    seconds = time.perf_counter() - t0
    json.loads(body)
    return seconds, len(body)


def paint(browser: object, base: str, repeats: int, view: str = "") -> tuple[list[float], int]:
    """Times (s) from navigation start to a view's first paint, and the tree rows drawn."""
    times = []
    rendered = 0
    for _ in range(repeats):
        page = browser.new_page(viewport={"width": 1280, "height": 800})  # type: ignore[attr-defined]
        page.goto(f"{base}study/{STUDY}{view}")
        page.wait_for_function("window.stagetree && window.stagetree.ready", timeout=60_000)
        times.append(page.evaluate("performance.now()") / 1000)
        rendered = page.evaluate("window.stagetree.rendered")
        # let the page's later reads (the summary, the header) finish before the next load
        page.wait_for_function(
            "document.getElementById('storage-url').textContent"
            " && document.getElementById('study-facts').textContent",
            timeout=120_000,
        )
        page.close()
    return times, rendered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    rows = []
    others = []
    with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for n in args.trials:
            url = f"sqlite:///{Path(tmp) / f'plan-{n}.db'}"
            t0 = time.perf_counter()
            with open_storage(url) as storage:
                nodes = int(write_study(storage, n)["nodes"])
            print(f"{n} trials: plan written in {time.perf_counter() - t0:.1f} s", flush=True)
            server = start_dashboard(url)
            try:
                # the first load finds nothing cached on the server: it builds the tree
                (cold,), _ = paint(browser, server.url, 1)
                answer, size = tree_answer(server.url)
                times, rendered = paint(browser, server.url, args.repeats)
                views = [paint(browser, server.url, 1, f"/{v}")[0][0] for v in VIEWS]
            finally:
                server.stop()
            rows.append(
                (n, nodes, size, answer, cold, statistics.median(times), max(times), rendered)
            )
            others.append((n, views))
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
    print()
    print("| trials | learning curves | trials table | workers timeline |")
    print("|---:|---:|---:|---:|")
    for n, views in others:
        print(f"| {n:,} | " + " | ".join(f"{t:.2f} s" for t in views) + " |")


if __name__ == "__main__":
    main()
