"""The driver's memory per trial: who holds the bytes that grow with the study.

Each run is one study of ``scale_bench.py`` (N trials on W simulated workers, 64 steps
a trial, in virtual time) in a process of its own, under ``tracemalloc``. When the
tuner is done (the engine, scheduler, tuner and study still open), the live Python
objects are counted by the line that allocated them: the innermost frame inside the
package (an allocation in the standard library is charged to the package's line that
called it). Between two sizes, a holder's slope is what it grew by per added trial; the
sum of the slopes is the driver's memory per trial. With a SQLite plan the plan itself
is on disk, so what grows is the driver's own; a memory plan adds the plan's objects.

``tracemalloc`` makes a study about 5x slower, so it bounds the sizes. ``--sizing walk``
runs the study untraced and, at its end, sizes what each holder reaches
(``sys.getsizeof`` over ``gc.get_referents``, each object counted once, with the first
holder that reaches it; classes, modules and functions are not followed): the plan,
the bounded caches, the simulated workers and checkpoint store, then the driver's own
(cost estimator, scheduler, engine, tuner, study). Its "driver's own" per trial is the
figure of the goal "driver memory under 2 KiB per trial plus the plan's own size", at
sizes ``tracemalloc`` cannot reach. ``--sizing detail`` is the walk with the driver's
holders also sized per attribute (``tuner.results``, ``engine._tree_keys``...: what
that attribute reaches that nothing walked before it did), largest growth per trial
first. Every run (any sizing) reports these groups.

A bounded cache (``hp._chunk``, an LRU cache of at most 512 chunks of a sequence's
values) grows while it fills and then stays at its bound: it is a constant, not memory
per trial, so it is a group of its own, reported with its size and left out of the
driver's per-trial figure (between two sizes where it is still filling its slope is
that of the filling, not of the study).

Run: ``python benchmarks/memory_scale.py [--n 1000 5000] [--tuners random asha]
[--storage sqlite memory] [--workers 40] [--sizing tracemalloc|walk|detail] [--top 15]
[--json FILE]``. A ``PYTHONPATH`` naming another checkout measures that checkout's code.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: a PYTHONPATH naming another checkout wins
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from scale_bench import _rss_kib, _tuner, open_study  # noqa: E402

FRAMES = 4

# Not followed by the walk: shared by everything, not a holder's.
_SHARED = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.CodeType,
    types.FrameType,
)
# The driver's own holders, in the order the walk gives them the objects they reach.
DRIVER = ("estimator", "scheduler", "engine", "tuner", "study")


def _walk(roots: Iterable[Any], seen: set[int]) -> tuple[int, int]:
    """Bytes and count of the objects ``roots`` reach that ``seen`` lacks (added)."""
    size = count = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SHARED):
            continue
        seen.add(id(obj))
        size += sys.getsizeof(obj)
        count += 1
        stack.extend(gc.get_referents(obj))
    return size, count


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """An object's attributes (instance dict, then slots), for a walk per attribute."""
    out = list(getattr(obj, "__dict__", {}).items())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out.append((name, getattr(obj, name)))
    return out


def holder_sizes(
    study: Any, tuner: Any, detail: dict[str, list[int]] | None = None
) -> dict[str, list[int]]:
    """``[bytes, objects]`` per holder at the end of a study (see the module doc); with
    ``detail``, the driver's holders are also sized per attribute into it
    (``"engine._tree_keys"``: what that attribute reaches that nothing before it did)."""
    engine = study._engine
    hp = sys.modules["stagetree.hp"]
    groups: list[tuple[str, list[Any]]] = [
        ("plan", [engine.storage]),
        ("bounded caches", [c for c in (getattr(hp, "_chunk", None),) if c is not None]),
        ("workers and store", [engine.executor, engine.store]),
        ("estimator", [engine.scheduler.estimator]),
        ("scheduler", [engine.scheduler]),
        ("engine", [engine]),
        ("tuner", [tuner]),
        ("study", [study]),
    ]
    seen: set[int] = set()
    gc.collect()
    out: dict[str, list[int]] = {}
    for name, roots in groups:
        if detail is not None and name in DRIVER:
            size = count = 0
            for root in roots:
                seen.add(id(root))
                size, count = size + sys.getsizeof(root), count + 1
                own = getattr(root, "__dict__", None)
                if own is not None:
                    seen.add(id(own))
                    size, count = size + sys.getsizeof(own), count + 1
                for attr, value in _attributes(root):
                    got = _walk([value], seen)
                    detail[f"{name}.{attr}"] = list(got)
                    size, count = size + got[0], count + got[1]
            out[name] = [size, count]
        else:
            out[name] = list(_walk(roots, seen))
    return out


def _holder(tb: tracemalloc.Traceback, package: str) -> str:
    """The innermost frame inside the package, as ``module/path.py:line``."""
    for frame in reversed(tb):  # most recent call first
        name = frame.filename
        if package in name:
            return f"{name[name.rindex(package) :]}:{frame.lineno}"
    frame = tb[-1]
    return f"(outside) {Path(frame.filename).name}:{frame.lineno}"


def run_one(
    kind: str, n: int, workers: int, storage: str, sizing: str = "tracemalloc"
) -> dict[str, Any]:
    """One study (in this process), under tracemalloc unless ``sizing`` is ``walk``:
    bytes per allocating line (tracemalloc) and per holder at its end."""
    from stagetree.executors.simulated import LearningCurve, SimulatedExecutor

    package = str(Path(sys.modules["stagetree"].__file__ or "").parent.parent) + os.sep
    tuner = _tuner(kind, n)
    executor = SimulatedExecutor(workers, curve=LearningCurve(aliases={"acc": "accuracy"}))
    traced = sizing == "tracemalloc"
    detail: dict[str, list[int]] | None = {} if sizing == "detail" else None
    if traced:
        tracemalloc.start(FRAMES)
    snap, peak = None, 0
    with tempfile.TemporaryDirectory(prefix="memory-scale-") as tmp:
        study = open_study(storage, tmp, workers, executor)
        cpu0 = time.process_time()
        try:
            study.tune(tuner)
            cpu = time.process_time() - cpu0
            gc.collect()
            if traced:  # study, engine and tuner still open
                snap = tracemalloc.take_snapshot()
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
            groups = holder_sizes(study, tuner, detail)
        finally:
            study.close()
    holders: dict[str, list[int]] = {}
    for stat in snap.statistics("traceback") if snap is not None else ():
        got = holders.setdefault(_holder(stat.traceback, package), [0, 0])
        got[0] += stat.size
        got[1] += stat.count
    return {
        "code": package.rstrip(os.sep),
        "tuner": kind,
        "n": n,
        "workers": workers,
        "storage": storage,
        "sizing": sizing,
        "cpu_s": cpu,
        "traced": sum(s for s, _ in holders.values()),
        "peak_traced": peak,
        "peak_rss_kib": _rss_kib(),
        "holders": holders,
        "groups": groups,
        "detail": detail or {},
    }


def _child(args: list[str], timeout: float) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--one", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def slopes(small: dict[str, Any], large: dict[str, Any]) -> dict[str, float]:
    """Bytes per added trial per holder between two runs."""
    dn = large["n"] - small["n"]
    keys = set(small["holders"]) | set(large["holders"])
    return {
        k: (large["holders"].get(k, [0, 0])[0] - small["holders"].get(k, [0, 0])[0]) / dn
        for k in keys
    }


def _groups_report(runs: list[dict[str, Any]]) -> list[str]:
    """The holders' sizes per N and, between the smallest and the largest N, per added
    trial, with the driver's own (the bounded caches, the plan and the workers apart)."""
    names = list(runs[0]["groups"])
    out = ["", "| holder (walk) | " + " | ".join(f"N = {r['n']:,}" for r in runs) + " | B/trial |"]
    out.append("|---|" + "---:|" * (len(runs) + 1))
    small, large = runs[0], runs[-1]
    dn = (large["n"] - small["n"]) or 1
    rows = [(k, [r["groups"][k][0] for r in runs]) for k in names]
    rows.append(("**driver's own**", [sum(r["groups"][k][0] for k in DRIVER) for r in runs]))
    for k, sizes in rows:
        per = (sizes[-1] - sizes[0]) / dn if len(runs) > 1 else float("nan")
        cells = " | ".join(f"{b / 2**20:,.2f} MiB" for b in sizes)
        out.append(f"| {k} | {cells} | {per:,.0f} |")
    return out


def _detail_report(runs: list[dict[str, Any]], top: int) -> list[str]:
    """The driver's holders per attribute, largest growth per added trial first."""
    small, large = runs[0], runs[-1]
    dn = (large["n"] - small["n"]) or 1
    keys = set(small["detail"]) | set(large["detail"])
    per = {
        k: (large["detail"].get(k, [0, 0])[0] - small["detail"].get(k, [0, 0])[0]) / dn
        for k in keys
    }
    out = ["", "| attribute (walk) | B/trial | objects/trial |", "|---|---:|---:|"]
    for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        objs = (large["detail"].get(k, [0, 0])[1] - small["detail"].get(k, [0, 0])[1]) / dn
        out.append(f"| `{k}` | {v:,.0f} | {objs:,.2f} |")
    return out


def report(rows: list[dict[str, Any]], top: int) -> str:
    """Per tuner and storage: the sizes' totals, bytes per trial, and the top holders."""
    out = []
    for key in sorted({(r["tuner"], r["storage"], r["workers"]) for r in rows}):
        runs = sorted(
            (r for r in rows if (r["tuner"], r["storage"], r["workers"]) == key),
            key=lambda r: r["n"],
        )
        out.append(f"\n### {key[0]}, {key[1]} plan, W = {key[2]} ({runs[0]['code']})\n")
        out.append(f"sizing: {runs[0]['sizing']}\n")
        if runs[0]["sizing"] == "tracemalloc":
            out.append("| N | CPU s | traced MiB | peak traced MiB | peak RSS MiB |")
            out.append("|---:|---:|---:|---:|---:|")
            for r in runs:
                out.append(
                    f"| {r['n']:,} | {r['cpu_s']:.1f} | {r['traced'] / 2**20:.1f} "
                    f"| {r['peak_traced'] / 2**20:.1f} | {r['peak_rss_kib'] / 1024:.0f} |"
                )
        else:
            out.append("| N | CPU s | peak RSS MiB |")
            out.append("|---:|---:|---:|")
            for r in runs:
                out.append(f"| {r['n']:,} | {r['cpu_s']:.1f} | {r['peak_rss_kib'] / 1024:.0f} |")
        out.extend(_groups_report(runs))
        if runs[0]["sizing"] == "detail":
            out.extend(_detail_report(runs, top))
        if len(runs) < 2 or runs[0]["sizing"] != "tracemalloc":
            continue
        small, large = runs[0], runs[-1]
        dn = large["n"] - small["n"]
        per = slopes(small, large)
        total = (large["traced"] - small["traced"]) / dn
        rss = (large["peak_rss_kib"] - small["peak_rss_kib"]) * 1024 / dn
        out.append(
            f"\nPer added trial (N {small['n']:,} -> {large['n']:,}): traced "
            f"{total:,.0f} B, peak traced "
            f"{(large['peak_traced'] - small['peak_traced']) / dn:,.0f} B, peak RSS {rss:,.0f} B\n"
        )
        by_module: dict[str, float] = {}
        for k, v in per.items():
            by_module[k.rsplit(":", 1)[0]] = by_module.get(k.rsplit(":", 1)[0], 0.0) + v
        out.append("| module | B/trial | share |")
        out.append("|---|---:|---:|")
        for k, v in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"| `{k}` | {v:,.0f} | {v / total if total else 0:.0%} |")
        out.append("")
        out.append("| holder (allocating line) | B/trial | share |")
        out.append("|---|---:|---:|")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"| `{k}` | {v:,.0f} | {v / total if total else 0:.0%} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[1000, 5000])
    p.add_argument("--tuners", nargs="+", default=["random", "asha"])
    p.add_argument("--storage", nargs="+", choices=("memory", "sqlite"), default=["sqlite"])
    p.add_argument("--workers", type=int, default=40)
    p.add_argument(
        "--sizing",
        choices=("tracemalloc", "walk", "detail"),
        default="tracemalloc",
        help="tracemalloc: per allocating line (slow); walk: per holder only, untraced; "
        "detail: the walk, the driver's holders also per attribute",
    )
    p.add_argument("--top", type=int, default=15, help="holders shown per study")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument(
        "--one", nargs=5, metavar=("TUNER", "N", "W", "STORAGE", "SIZING"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.one:
        kind, n, w, storage, sizing = args.one
        print(json.dumps(run_one(kind, int(n), int(w), storage, sizing)))
        return
    rows = []
    for kind in args.tuners:
        for storage in args.storage:
            for n in sorted(args.n):
                got = _child([kind, str(n), str(args.workers), storage, args.sizing], args.timeout)
                print(
                    f"{kind} N={n} {storage}: {'timeout' if got is None else 'done'}",
                    file=sys.stderr,
                    flush=True,
                )
                if got is not None:
                    rows.append(got)
    print(report(rows, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
