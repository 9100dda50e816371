"""The driver's cost as a study grows: N trials on W simulated workers, in virtual time.

Each run is one study through the real ``Study``, engine, scheduler, tuner and plan
storage over the virtual-time executor (as ``stagetree.simulate`` runs it), in a
process of its own (so that its peak memory is its own). Measured: the driver's wall
and CPU seconds for the whole study, decisions (batches the scheduler started) per
CPU second, and the process's peak resident memory, with what it grew by per trial.
Per tuner, worker count and storage, the growth exponent ``k`` of CPU ~ N^k is fitted
over the sizes run (least squares on the logarithms).

Studies (64 steps a trial, as a ResNet-style run of 64 epochs):

* ``grid``: a grid with shared prefixes: 10 learning-rate schedules (step decays whose
  milestones share their beginnings) x 4 batch-size schedules per plan tree, and N / 40
  plan trees (a fixed weight decay per tree); every trial trained to 64 steps.
* ``random``: random search over drawn learning rates (and milestones from a short
  list), batch-size schedules and a continuous weight decay (each trial its own tree).
* ``asha``: ASHA over the random space, 4 to 64 steps, reduction 4.
* ``hyperband``: Hyperband over the random space, 4 to 64 steps, reduction 4.

Run: ``python benchmarks/scale_bench.py [--n 1000 10000 100000] [--max-n 3000]
[--workers 40 200 1000] [--tuners grid random asha hyperband] [--storage memory
sqlite] [--profile] [--plot PNG] [--json FILE] [--progress BATCHES]``. ``--max-n`` caps
the sizes for a quick run; ``--timeout`` stops a run that takes longer (shown as
``>T``). ``--profile`` runs the largest size of each tuner once more under cProfile and
prints its top 10 functions by own time. ``--progress B`` prints each run's batches started and CPU
seconds every ``B`` batches (a long run stopped by ``--timeout`` still says how far it
got). One run alone: ``--one TUNER N W STORAGE PROFILE`` (PROFILE 0 or 1) prints its
figures as JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # Last: a PYTHONPATH naming another checkout measures that checkout's code.
    sys.path.append(str(ROOT))

TUNERS = ("grid", "random", "asha", "hyperband")
STEPS = 64


def _space(kind: str, n: int) -> Any:
    from stagetree.distributions import Choice, LogUniform, Uniform
    from stagetree.hp import Constant, MultiStep, Piecewise
    from stagetree.space import GridSpace, RandomSpace

    if kind == "grid":
        trees = max(1, n // 40)
        lrs = [MultiStep(0.1, ms, 0.1) for ms in ([16], [24], [32], [40], [48])]
        lrs += [MultiStep(0.1, [m, 56], 0.1) for m in (16, 24, 32, 40, 48)]
        bss = [Constant(128)] + [Piecewise([128, 256], [d]) for d in (20, 36, 52)]
        return GridSpace(
            hp={"lr": lrs, "batch_size": bss},
            fixed={"wd": [round(1e-5 * (i + 1), 10) for i in range(trees)]},
        )
    return RandomSpace(
        hp={
            # A MultiStep of distributions: a RandomSpace draws its init and milestones.
            "lr": MultiStep(
                init=LogUniform(1e-3, 0.3),  # type: ignore[arg-type]
                milestones=Choice([[32], [48], [32, 48]]),  # type: ignore[arg-type]
                gamma=0.1,
            ),
            "batch_size": Choice([Constant(128), Piecewise([128, 256], [40])]),
        },
        fixed={"wd": Uniform(0.0, 1e-3)},
    )


def _tuner(kind: str, n: int) -> Any:
    from stagetree.tuners import ASHA, GridSearch, Hyperband, RandomSearch

    space = _space(kind, n)
    if kind == "grid":
        return GridSearch(space, "acc", steps=STEPS)
    if kind == "random":
        return RandomSearch(space, "acc", steps=STEPS, num_trials=n, seed=0)
    if kind == "asha":
        return ASHA(space, "acc", min_steps=4, max_steps=STEPS, num_trials=n, eta=4, seed=0)
    if kind == "hyperband":
        return Hyperband(space, "acc", min_steps=4, max_steps=STEPS, num_trials=n, eta=4, seed=0)
    raise ValueError(f"unknown tuner {kind!r}")


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def open_study(storage: str, tmp: str, workers: int, executor: Any) -> Any:
    """The benchmark's study over ``executor``: its plan in memory, or in SQLite under
    ``tmp`` (checkpoints under ``tmp`` either way)."""
    from stagetree.executors.simulated import SimulatedTrainer
    from stagetree.plan.memory import MemoryPlanStorage
    from stagetree.study import Study

    plan: Any = MemoryPlanStorage() if storage == "memory" else f"sqlite:///{Path(tmp) / 'plan.db'}"
    return Study(
        "scale",
        SimulatedTrainer,
        storage=plan,
        workers=workers,
        checkpoint_dir=str(Path(tmp) / "ckpt"),
        executor=lambda: executor,
    )


def run_one(
    kind: str, n: int, workers: int, storage: str, profile: bool = False, progress: int = 0
) -> dict[str, Any]:
    """One study (in this process): its figures, and a profile's top with ``profile``.
    ``progress``: print the batches started and the CPU seconds so far to stderr every
    ``progress`` batches (0: never), so that a run stopped early still says how far it
    got."""
    from stagetree.executors.simulated import LearningCurve, SimulatedExecutor
    from stagetree.work import RunBatch, RunFused

    tuner = _tuner(kind, n)
    base = _rss_kib()
    executor = SimulatedExecutor(workers, curve=LearningCurve(aliases={"acc": "accuracy"}))
    decisions = instants = 0
    window = (0.0, 0)  # CPU seconds and instants at the last progress line
    submit, events = executor.submit, executor.events

    def counting(instruction: Any) -> None:
        nonlocal decisions, window
        if isinstance(instruction, (RunBatch, RunFused)):
            decisions += 1
            if progress and decisions % progress == 0:
                cpu = time.process_time() - cpu0
                # Per batch over the window: CPU, and the virtual instants delivered (each
                # costs a driver round; they grow as the workers drift out of step).
                per = (cpu - window[0]) / progress * 1e3, (instants - window[1]) / progress
                window = (cpu, instants)
                print(f"{kind} N={n} W={workers}: {decisions} batches, since the line "
                      f"before {per[0]:.2f} ms CPU and {per[1]:.2f} instants per batch, "
                      f"virtual clock {executor.now:.0f} s, {cpu:.1f} s CPU",
                      file=sys.stderr, flush=True)  # fmt: skip
        submit(instruction)

    def timed(timeout: float | None = None) -> Any:
        nonlocal instants
        got = events(timeout)
        instants += bool(got)
        return got

    executor.submit = counting  # type: ignore[method-assign]
    executor.events = timed  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        study = open_study(storage, tmp, workers, executor)
        prof = cProfile.Profile() if profile else None
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            study.tune(tuner)
        finally:
            if prof is not None:
                prof.disable()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            study.close()
    out: dict[str, Any] = {
        "code": str(Path(sys.modules["stagetree"].__file__ or "").parent.parent),
        "tuner": kind,
        "n": n,
        "workers": workers,
        "storage": storage,
        "cpu_s": cpu,
        "wall_s": wall,
        "decisions": decisions,
        "instants": instants,
        "virtual_s": executor.now,
        "peak_rss_mib": _rss_kib() / 1024,
        "rss_per_trial_kib": max(0, _rss_kib() - base) / n,
    }
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
        out["profile"] = text.getvalue()
    return out


def _child(args: list[str], timeout: float, progress: int = 0) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--one", *args, "--progress", str(progress)]
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, str(ROOT)]))
    try:
        done = subprocess.run(
            cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=env, check=False
        )  # stderr (progress, errors) passes through
    except subprocess.TimeoutExpired:
        return None
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed (its stderr is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def growth(points: Sequence[tuple[int, float]]) -> float | None:
    """The exponent k of y ~ N^k, by least squares on the logarithms (None: < 2 sizes)."""
    pts = [(math.log(n), math.log(y)) for n, y in points if y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table, with the fitted exponents."""
    fits: dict[tuple[str, int, str], float | None] = {}
    for key in {(r["tuner"], r["workers"], r["storage"]) for r in rows}:
        pts = [
            (r["n"], r["cpu_s"])
            for r in rows
            if (r["tuner"], r["workers"], r["storage"]) == key and r.get("cpu_s") is not None
        ]
        fits[key] = growth(pts)
    head = (
        "| tuner | N | W | storage | driver CPU s | wall s | decisions/s | peak RSS MiB "
        "| KiB/trial | growth k |"
    )
    lines = [head, "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(
        rows, key=lambda r: (TUNERS.index(r["tuner"]), r["storage"], r["workers"], r["n"])
    ):
        k = fits[(r["tuner"], r["workers"], r["storage"])]
        if r.get("cpu_s") is None:
            lines.append(
                f"| {r['tuner']} | {r['n']:,} | {r['workers']} | {r['storage']} "
                f"| >{r['timeout']:.0f} | | | | | |"
            )
            continue
        rate = r["decisions"] / r["cpu_s"] if r["cpu_s"] else 0.0
        lines.append(
            f"| {r['tuner']} | {r['n']:,} | {r['workers']} | {r['storage']} | {r['cpu_s']:.1f} "
            f"| {r['wall_s']:.1f} | {rate:,.0f} | {r['peak_rss_mib']:.0f} "
            f"| {r['rss_per_trial_kib']:.1f} | {'' if k is None else f'{k:.2f}'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Driver CPU against N, log-log, a line per tuner, worker count and storage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["tuner"], r["workers"], r["storage"]) for r in rows}):
        pts = sorted(
            (r["n"], r["cpu_s"])
            for r in rows
            if (r["tuner"], r["workers"], r["storage"]) == key and r.get("cpu_s") is not None
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]} W={key[1]} {key[2]}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("trials N")
    ax.set_ylabel("driver CPU seconds")
    ax.set_title("stagetree driver cost in virtual time (64 steps a trial)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--max-n", type=int, default=None, help="leave out sizes above this")
    p.add_argument("--workers", type=int, nargs="+", default=[40, 200, 1000])
    p.add_argument("--tuners", nargs="+", choices=TUNERS, default=list(TUNERS))
    p.add_argument(
        "--storage", nargs="+", choices=("memory", "sqlite"), default=["memory", "sqlite"]
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    p.add_argument("--profile", action="store_true", help="profile the largest N per tuner")
    p.add_argument("--plot", default=None, help="write a log-log plot of CPU against N here")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument(
        "--progress",
        type=int,
        default=0,
        help="print batches started and CPU seconds every this many batches (0: never)",
    )
    p.add_argument(
        "--one", nargs=5, metavar=("TUNER", "N", "W", "STORAGE", "PROFILE"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.one:
        kind, n, w, storage, prof = args.one
        print(json.dumps(run_one(kind, int(n), int(w), storage, prof == "1", args.progress)))
        return
    sizes = sorted(n for n in args.n if args.max_n is None or n <= args.max_n)
    rows: list[dict[str, Any]] = []
    for kind in args.tuners:
        for storage in args.storage:
            for w in args.workers:
                for n in sizes:
                    got = _child([kind, str(n), str(w), storage, "0"], args.timeout, args.progress)
                    row = got or {
                        "tuner": kind,
                        "n": n,
                        "workers": w,
                        "storage": storage,
                        "timeout": args.timeout,
                    }
                    rows.append(row)
                    cpu = "timeout" if got is None else f"{got['cpu_s']:.1f} s CPU ({got['code']})"
                    print(f"{kind} N={n} W={w} {storage}: {cpu}", file=sys.stderr, flush=True)
                    if got is None:
                        break  # larger sizes take longer still
    print(table(rows))
    if args.profile:
        for kind in args.tuners:
            done = [r for r in rows if r["tuner"] == kind and r.get("cpu_s") is not None]
            if not done:
                continue
            top = max(done, key=lambda r: (r["n"], -r["workers"]))
            got = _child(
                [kind, str(top["n"]), str(top["workers"]), top["storage"], "1"], args.timeout
            )
            if got is not None:
                where = f"N={top['n']}, W={top['workers']}, {top['storage']}"
                print(f"\n### {kind}, {where}: top 10 by own time\n")
                print(got["profile"])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
