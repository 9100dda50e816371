"""The tuners and the read side at scale: 1,000 to 100,000 trials (issue 24, item 2).

Three measurements, each in a fresh process (``--one``), so that peak memory is that of
one study:

* **tuners**: ASHA, Hyperband and random search driven by a virtual-time runner (each
  submission finishes after ``steps * U(0.5, 1.5)`` virtual seconds, one completion per
  event-loop turn, ``--workers`` slots for ASHA): the tuner's decisions (submissions,
  promotions) per CPU second, the CPU of the whole run, and the same run replayed
  from its log (a resumed study: every decision is checked against the log again);
* **reads**: a finished study of N trials (``--steps`` steps each, a metric point per
  step) in memory and in SQLite, read as ``Study.trials()`` and ``Study.best()`` read
  it (``reports.trial_records`` and ``reports.best_record``; ``trial_records(...,
  history=False)`` where the code has it): seconds and the growth of peak RSS;
* **optuna**: Optuna's own TPE ``ask`` (with one ``suggest_float``) per trial as the
  study grows, measured alone: TPE fits its estimators to every trial so far, so its
  cost per ask grows linearly in the study (not stagetree's to fix).

Run ``python benchmarks/tuner_scale.py [--sizes 1000 10000 100000] [--skip-over S]``;
it prints markdown tables. ``--skip-over`` leaves out the larger sizes of a row once
one size took longer than S CPU seconds (the quadratic code of old needs hours there).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

from stagetree.distributions import Uniform
from stagetree.space import RandomSpace
from stagetree.tuners import ASHA, Hyperband, RandomSearch, TrialResult, Tuner

SPACE = RandomSpace({"x": Uniform(0.0, 1.0)})
MAX_STEPS = 64
DECISIONS = ("submit", "promote", "continue", "stop", "exploit")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- tuners


class VirtualRunner:
    """A study in virtual time: a submission ends ``steps * U(0.5, 1.5)`` seconds after
    it starts; a driver task ends the earliest one per event-loop turn."""

    def __init__(self, workers: int, log: list[dict[str, Any]] | None = None) -> None:
        self.workers = workers
        self.rng = random.Random(0)
        self.now = 0.0
        self.heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self.seq = 0
        self.log: list[dict[str, Any]] = []
        self._previous = log or []
        self._driver: asyncio.Task[None] | None = None

    def num_workers(self) -> int:
        return self.workers

    def append_log(self, record: dict[str, Any]) -> None:
        self.log.append(record)

    def read_log(self) -> list[dict[str, Any]]:
        return self._previous

    def check(self, config: dict[str, Any], hp: dict[str, Any]) -> None:
        pass

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        pass

    async def _drive(self) -> None:
        while True:
            await asyncio.sleep(0)
            while self.heap:
                at, _, fut = heapq.heappop(self.heap)
                if not fut.done():
                    self.now = at
                    fut.set_result(None)
                    break

    async def submit(self, config: dict[str, Any], hp: dict[str, Any], steps: int) -> TrialResult:
        if self._driver is None:
            self._driver = asyncio.ensure_future(self._drive())
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self.heap, (self.now + steps * (0.5 + self.rng.random()), self.seq, fut))
        self.seq += 1
        await fut
        x = float(hp["x"](0))
        acc = steps / (steps + 5) * (1.0 - (x - 0.7) ** 2)
        return TrialResult(config, hp, steps, {"acc": acc})

    def stop(self) -> None:
        if self._driver is not None:
            self._driver.cancel()


def make_tuner(kind: str, n: int) -> Tuner:
    if kind == "asha":
        return ASHA(SPACE, "acc", min_steps=1, max_steps=MAX_STEPS, num_trials=n, eta=4)
    if kind == "hyperband":
        return Hyperband(SPACE, "acc", min_steps=1, max_steps=MAX_STEPS, num_trials=n, eta=4)
    if kind == "random":
        return RandomSearch(SPACE, "acc", steps=MAX_STEPS, num_trials=n)
    raise ValueError(kind)


def _timed_run(kind: str, n: int, workers: int, log: list[dict[str, Any]] | None) -> Any:
    runner = VirtualRunner(workers, log)

    async def main() -> None:
        try:
            await make_tuner(kind, n).run(runner)
        finally:
            runner.stop()

    t0 = time.process_time()
    asyncio.run(main())
    return runner, time.process_time() - t0


def measure_tuner(kind: str, n: int, workers: int) -> dict[str, Any]:
    base = _rss_mb()
    runner, cpu = _timed_run(kind, n, workers, None)
    decisions = sum(1 for r in runner.log if r["event"] in DECISIONS)
    peak = _peak_mb() - base
    _, replay = _timed_run(kind, n, workers, runner.log)
    return {
        "cpu_s": cpu,
        "decisions": decisions,
        "decisions_per_s": decisions / cpu if cpu else None,
        "replay_cpu_s": replay,
        "peak_mb": peak,
    }


# --------------------------------------------------------------------------- reads

STUDY = "scale"
ROOT = "scale-root"


def fill(storage: Any, n: int, steps: int) -> None:
    """A finished study of ``n`` trials (``x`` constant, distinct), a metric point per
    step along each, through the public API (trial rows in bulk on SQL storage)."""
    from stagetree.hp import Constant, dumps_hp
    from stagetree.plan import RequestState

    rng = random.Random(1)
    hps = [{"x": Constant(rng.random())} for _ in range(n)]
    storage.register_root(ROOT, {})
    inserted = storage.insert_trials(ROOT, [(hp, steps) for hp in hps])
    chunk: list[Any] = []
    for hp, ins in zip(hps, inserted):
        x = float(hp["x"](0))
        for s in range(1, steps + 1):
            acc = s / (s + 5) * (1.0 - (x - 0.7) ** 2)
            chunk.append((ins.node, s, {"acc": acc, "loss": 1 - acc}, True))
        if len(chunk) >= 50_000:
            storage.put_metrics_many(chunk)
            chunk = []
    storage.put_metrics_many(chunk)
    for ins in inserted:
        storage.set_request_state(ins.node, ins.step, RequestState.DONE)
    storage.create_study(STUDY, {"metric": "acc", "mode": "max"})
    rows = [
        (hp, ins.node, ins.step) for hp, ins in zip(hps, inserted)
    ]  # trial rows: one transaction on SQL storage (add_trial is one per trial)
    if hasattr(storage, "_tx"):
        from stagetree.plan import sql

        with storage._tx(write=True) as conn:
            conn.execute(
                sql._trials.insert(),
                [
                    {
                        "id": i + 1,
                        "study": STUDY,
                        "root_key": ROOT,
                        "config": "{}",
                        "hp": dumps_hp(hp),
                        "steps": steps,
                        "node": node,
                        "step": step,
                        "state": "done",
                        "attrs": "{}",
                        "created": time.time(),
                    }
                    for i, (hp, node, step) in enumerate(rows)
                ],
            )
    else:
        for hp, node, step in rows:
            storage.add_trial(STUDY, ROOT, {}, hp, steps, node, step, state="done")


def measure_reads(backend: str, n: int, steps: int, path: str) -> dict[str, Any]:
    from stagetree import reports
    from stagetree.plan import MemoryPlanStorage, SQLPlanStorage

    if backend == "memory":
        storage: Any = MemoryPlanStorage()
        fill(storage, n, steps)
    else:
        if not os.path.exists(path):
            fill(SQLPlanStorage(f"sqlite:///{path}"), n, steps)
        storage = SQLPlanStorage(f"sqlite:///{path}")
    out: dict[str, Any] = {}
    base = _rss_mb()
    t0 = time.process_time()
    if hasattr(reports, "best_record"):  # what Study.best reads
        best = reports.best_record(storage, STUDY, "acc", "max")
    else:
        best = reports.best_trial(reports.trial_records(storage, STUDY), "acc", "max")
    out["best_s"] = time.process_time() - t0
    out["best_mb"] = _peak_mb() - base
    assert best is not None
    del best
    try:
        t0 = time.process_time()
        records = reports.trial_records(storage, STUDY, history=False)
        out["final_s"] = time.process_time() - t0
        assert len(records) == n
        del records
    except TypeError:  # no history=False before issue 24
        out["final_s"] = None
    t0 = time.process_time()
    records = reports.trial_records(storage, STUDY)
    out["history_s"] = time.process_time() - t0
    out["history_mb"] = _peak_mb() - base
    assert len(records) == n
    return out


# --------------------------------------------------------------------------- optuna


def measure_optuna(sizes: list[int]) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    out: dict[str, Any] = {}
    window = 20
    for i in range(max(sizes)):
        t0 = time.process_time()
        trial = study.ask()
        x = trial.suggest_float("x", 0.0, 1.0)
        spent = time.process_time() - t0
        study.tell(trial, 1.0 - (x - 0.7) ** 2)
        for size in sizes:
            if size - window <= i < size:
                out[str(size)] = out.get(str(size), 0.0) + spent / window
    return out


# --------------------------------------------------------------------------- driver


def _child(args: list[str], timeout: float) -> dict[str, Any] | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as exc:
        print(exc.stderr, file=sys.stderr)
        raise
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--workers", type=int, default=1_000)
    parser.add_argument("--steps", type=int, default=16, help="steps per trial (reads)")
    parser.add_argument("--skip-over", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--tuners", nargs="*", default=["asha", "hyperband", "random"])
    parser.add_argument("--backends", nargs="*", default=["memory", "sqlite"])
    parser.add_argument("--optuna", type=int, nargs="*", default=[100, 1_000, 2_000])
    parser.add_argument(
        "--data", default=None, help="keep the SQLite studies here (reused by later runs)"
    )
    parser.add_argument("--one", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        what, *rest = args.one
        if what == "tuner":
            result = measure_tuner(rest[0], int(rest[1]), int(rest[2]))
        elif what == "reads":
            result = measure_reads(rest[0], int(rest[1]), int(rest[2]), rest[3])
        else:
            result = measure_optuna([int(x) for x in rest])
        print(json.dumps(result))
        return

    print("command: python benchmarks/tuner_scale.py " + shlex.join(sys.argv[1:]))
    print(f"\nTuners ({args.workers:,} workers for ASHA, {MAX_STEPS} steps, eta 4)\n")
    print("| tuner | trials | decisions | CPU s | decisions/s | replay CPU s | peak MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.tuners:
        for n in args.sizes:
            r = _child(["tuner", kind, str(n), str(args.workers)], args.timeout)
            if r is None:
                print(f"| {kind} | {n:,} | timed out after {args.timeout:.0f} s |||||")
                break
            print(
                f"| {kind} | {n:,} | {r['decisions']:,} | {_cell(r['cpu_s'])} | "
                f"{_cell(r['decisions_per_s'], 0)} | {_cell(r['replay_cpu_s'])} | "
                f"{_cell(r['peak_mb'], 0)} |",
                flush=True,
            )
            if r["cpu_s"] + r["replay_cpu_s"] > args.skip_over:
                break
    print(f"\nReads of a finished study ({args.steps} metric points per trial)\n")
    print(
        "| storage | trials | best() CPU s | best() peak MB | trials(history=False) CPU s | "
        "trials() CPU s | trials() peak MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or tmp
        os.makedirs(data, exist_ok=True)
        for backend in args.backends:
            for n in args.sizes:
                path = os.path.join(data, f"study-{n}-{args.steps}.db")
                r = _child(["reads", backend, str(n), str(args.steps), path], args.timeout)
                if r is None:
                    print(f"| {backend} | {n:,} | timed out after {args.timeout:.0f} s |||||")
                    break
                print(
                    f"| {backend} | {n:,} | {_cell(r['best_s'])} | {_cell(r['best_mb'], 0)} | "
                    f"{_cell(r['final_s'])} | {_cell(r['history_s'])} | "
                    f"{_cell(r['history_mb'], 0)} |",
                    flush=True,
                )
    if args.optuna:
        r = _child(["optuna", *map(str, args.optuna)], args.timeout)
        print("\nOptuna's TPE alone: ms per ask (one suggest_float) with N trials before it\n")
        print("| trials before | " + " | ".join(f"{n:,}" for n in args.optuna) + " |")
        print("|---|" + "---:|" * len(args.optuna))
        row = "-" if r is None else " | ".join(_cell(r[str(n)] * 1e3) for n in args.optuna)
        print(f"| ms per ask | {row} |")


if __name__ == "__main__":
    main()
