"""The dashboard's speed: first paint and live updates of the stage tree at 100, 1,000
and 10,000 trials, the data sent per update, and what an open dashboard costs a
running study.

    .venv/bin/python benchmarks/dashboard_bench.py [--sizes 100,1000,10000]
        [--pairs 3] [--no-throughput] [--plot benchmarks/out/dashboard_bench.png]

Everything runs as a user would run it: ``stagetree dashboard URL`` in its own
process, Debian's Chromium driven by Playwright (``/usr/bin/chromium``; nothing is
downloaded), and for the throughput a real study (``examples/digits.py``: ASHA over 16
trials of an MLP on digits, 2 workers) in its own process.

* **First paint**: from ``page.goto(/study/bench)`` until the page says the tree is
  drawn (``window.stagetree.ready``), on a finished synthetic study of N trials
  (``benchmarks/_synthetic_plan.py``), in a fresh browser context: the first load (the
  dashboard process has read nothing yet) and the median of two more; then one first
  load of each other view (curves, trials table, workers timeline).
* **Live update**: a trial is added to the plan by another process's handle (a new
  stage appears); the time from its commit until the page's tree has the new node,
  without a reload, and the bytes of the tree delta the page fetched for it.
* **Throughput**: the digits study's steps per second alone and with the dashboard's
  study page open in Chromium (live: long-poll and deltas), in alternating pairs on
  fresh storages; the ratio of medians, and the CPU the dashboard process used while
  the study ran (its share of one core), which does not depend on the machine's noise.

Goals (issue 11): 10,000 trials render in < 3 s; an update reaches the page < 1 s
after the plan changes; the study slows by < 2%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bar_plot, machine_info, markdown_table, median
from _synthetic_plan import STUDY, synthetic_hp, write_study

from stagetree.plan import open_storage

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
STAGETREE = Path(sys.executable).with_name("stagetree")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def dashboard(url: str) -> Iterator[tuple[str, int]]:
    """``stagetree dashboard URL`` in its own process; yields its address and pid."""
    port = _free_port()
    proc = subprocess.Popen(
        [str(STAGETREE), "dashboard", url, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    address = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(address + "api/studies", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read() if proc.stderr else ""
                    raise RuntimeError(f"the dashboard did not start: {err}") from None
                time.sleep(0.1)
        yield address, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _browser_cpu_seconds() -> float:
    """CPU time used so far by every Chromium process (the page's rendering)."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"chromium" in (proc / "cmdline").read_bytes():
                total += _cpu_seconds(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return total


def _wait_ready(page: Any) -> None:
    page.wait_for_function(
        "window.stagetree && window.stagetree.ready", polling="raf", timeout=60_000
    )


def render_row(browser: Any, trials: int, work: Path) -> dict[str, Any]:
    """First paint and live updates of a study of ``trials`` trials."""
    path = work / f"plan-{trials}.db"
    url = f"sqlite:///{path}"
    storage = open_storage(url)
    written = write_study(storage, trials)
    with dashboard(url) as (address, _pid):
        paints, tree_bytes = [], 0
        for attempt in range(3):
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            page = context.new_page()
            t0 = time.perf_counter()
            with page.expect_response(
                lambda r: "/api/studies/" in r.url and "/tree" in r.url, timeout=60_000
            ) as first:
                page.goto(f"{address}study/{STUDY}")
            _wait_ready(page)
            paints.append(time.perf_counter() - t0)
            tree_bytes = len(first.value.body())
            rendered = page.evaluate("window.stagetree.rendered")
            if attempt < 2:  # keep the last page open for the updates
                context.close()
        views = {}
        for view in ("curves", "trials", "workers"):  # one cold load of each other view
            ctx = browser.new_context(viewport={"width": 1280, "height": 800})
            other = ctx.new_page()
            t0 = time.perf_counter()
            other.goto(f"{address}study/{STUDY}/{view}")
            _wait_ready(other)
            views[view] = time.perf_counter() - t0
            ctx.close()
        # Live updates: another process's handle adds a trial (a new stage).
        extra = synthetic_hp(trials + 3, 60)[trials:]
        updates, update_bytes = [], []
        for hp in extra:
            before = page.evaluate("window.stagetree.tree.nodes.size")
            ins = storage.insert_trials("synthetic-root", [(hp, 60)])[0]
            with page.expect_response(lambda r: "/tree?after=" in r.url) as delta:
                t0 = time.perf_counter()
                storage.add_trial(
                    STUDY,
                    "synthetic-root",
                    {"model": "synthetic"},
                    hp,
                    60,
                    ins.node,
                    ins.step,
                    attrs={"version": "synthetic"},
                )
                page.wait_for_function(
                    f"window.stagetree.tree.nodes.size > {before}",
                    polling="raf",
                    timeout=30_000,
                )
                updates.append(time.perf_counter() - t0)
            update_bytes.append(len(delta.value.body()))
        context.close()
    storage.close()
    return {
        "trials": trials,
        "nodes": int(written["nodes"]),
        "drawn": rendered,
        "first_paint_s": paints[0],
        "again_s": median(paints[1:]),
        **{f"{view}_s": t for view, t in views.items()},
        "tree_kib": tree_bytes / 1024,
        "update_s": median(updates),
        "update_kib": median(update_bytes) / 1024,
    }


def _study_run(work: Path, tag: str) -> tuple[float, float, str]:
    """Run the digits study on a fresh storage in its own process, printing when it
    starts; returns (steps executed, seconds, storage URL) measured by that process."""
    url = f"sqlite:///{work / f'digits-{tag}.db'}"
    code = (
        "import json, sys, time; sys.path.insert(0, 'examples'); import digits\n"
        "t = time.perf_counter()\n"
        "with digits.study as s:\n"
        "    s.tune(digits.tuner)\n"
        "    n = s.stats()['steps_executed']\n"
        "print(json.dumps([n, time.perf_counter() - t]))\n"
    )
    env = {**os.environ, "STAGETREE_STORAGE": url}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout
    steps, seconds = json.loads(out.strip().splitlines()[-1])
    return float(steps), float(seconds), url


def throughput(browser: Any, pairs: int, work: Path) -> dict[str, Any]:
    """Steps/s of the digits study alone and with the dashboard open on it."""
    alone, watched, shares, browser_shares = [], [], [], []
    for i in range(pairs):
        steps, seconds, _ = _study_run(work, f"alone-{i}")
        alone.append(steps / seconds)
        url = f"sqlite:///{work / f'digits-watched-{i}.db'}"
        open_storage(url).close()  # the dashboard opens it before the study starts
        with dashboard(url) as (address, pid):
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            page = context.new_page()
            page.goto(f"{address}")  # the studies list: it shows the study when it appears
            _wait_ready(page)
            result: dict[str, Any] = {}

            def run(tag: str = f"watched-{i}", out: dict[str, Any] = result) -> None:
                out.update(zip(("steps", "seconds", "url"), _study_run(work, tag)))

            runner = threading.Thread(target=run)
            cpu0, web0, t0 = _cpu_seconds(pid), _browser_cpu_seconds(), time.perf_counter()
            runner.start()
            # Open the study page as soon as the study exists, and keep it open (live).
            page.wait_for_function(
                "document.body.innerText.includes('digits-asha')", timeout=60_000
            )
            page.goto(f"{address}study/digits-asha")
            while runner.is_alive():
                page.wait_for_timeout(200)
            runner.join()
            elapsed = time.perf_counter() - t0
            shares.append((_cpu_seconds(pid) - cpu0) / elapsed)
            browser_shares.append((_browser_cpu_seconds() - web0) / elapsed)
            context.close()
        watched.append(result["steps"] / result["seconds"])
    return {
        "alone_steps_per_s": median(alone),
        "watched_steps_per_s": median(watched),
        "slowdown": 1.0 - median(watched) / median(alone),
        "dashboard_cpu": median(shares),
        "browser_cpu": median(browser_shares),
        "alone": alone,
        "watched": watched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        sys.exit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    print(markdown_table(["fact", "value"], [[k, v] for k, v in machine_info().items()]))
    work = Path(tempfile.mkdtemp(prefix="stagetree-dashboard-bench-"))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            rows = [render_row(browser, int(n), work) for n in args.sizes.split(",")]
            print()
            print(
                markdown_table(
                    [
                        "trials",
                        "plan nodes",
                        "rows drawn",
                        "tree: first paint (s)",
                        "tree: again (s)",
                        "curves (s)",
                        "trials table (s)",
                        "workers (s)",
                        "tree (KiB)",
                        "update reaches page (s)",
                        "update (KiB)",
                    ],
                    [
                        [
                            r["trials"],
                            r["nodes"],
                            r["drawn"],
                            f"{r['first_paint_s']:.2f}",
                            f"{r['again_s']:.2f}",
                            f"{r['curves_s']:.2f}",
                            f"{r['trials_s']:.2f}",
                            f"{r['workers_s']:.2f}",
                            f"{r['tree_kib']:.0f}",
                            f"{r['update_s']:.2f}",
                            f"{r['update_kib']:.1f}",
                        ]
                        for r in rows
                    ],
                )
            )
            if not args.no_throughput:
                t = throughput(browser, args.pairs, work)
                print()
                print(
                    markdown_table(
                        ["digits study", "steps/s (median)", "runs"],
                        [
                            [
                                "alone",
                                f"{t['alone_steps_per_s']:.1f}",
                                ", ".join(f"{x:.1f}" for x in t["alone"]),
                            ],
                            [
                                "dashboard open",
                                f"{t['watched_steps_per_s']:.1f}",
                                ", ".join(f"{x:.1f}" for x in t["watched"]),
                            ],
                        ],
                    )
                )
                print(f"\nslowdown with the dashboard open: {100 * t['slowdown']:.1f}%")
                print(
                    "the dashboard process's CPU while the study ran: "
                    f"{100 * t['dashboard_cpu']:.1f}% of one core (median); Chromium's: "
                    f"{100 * t['browser_cpu']:.1f}%"
                )
            browser.close()
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            labels = [str(r["trials"]) for r in rows]
            bar_plot(
                args.plot,
                [
                    ("first paint", labels, [r["first_paint_s"] for r in rows], "seconds"),
                    ("live update", labels, [r["update_s"] for r in rows], "seconds"),
                    ("update size", labels, [r["update_kib"] for r in rows], "KiB"),
                ],
                title="stagetree dashboard by study size (trials)",
            )
            print(f"plot: {args.plot}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
