"""The plan storage's read side at scale: ``Study.best()`` and ``Study.trials()`` of a
finished study of 1,000 to 100,000 trials, on memory, SQLite and PostgreSQL storage
(issue 24, items 2 and 3).

A finished study of N trials is filled once per storage (``--points`` metric points per
trial, ``attrs`` carrying the trainer version as a Study writes them); each read then
runs in a fresh process, so that its peak memory is its own:

* ``best``: what ``Study.best()`` reads (``reports.best_record``);
* ``final``: ``Study.trials(history=False)`` (``reports.trial_records(...,
  history=False)``);
* ``trials``: ``Study.trials()`` with every learning curve (for scale: not a goal).

Reported: CPU seconds of the read and the growth of the process's peak RSS during it
(MB), and that per trial (KiB).

Run ``python benchmarks/storage_scale.py --sizes 1000 10000 100000 --storage memory
sqlite postgresql --pg-url URL``; ``--profile READ`` prints a profile's top functions
of that read at the largest size instead. The PostgreSQL tables at URL are dropped and
filled again: give it a database of its own.

``--replay N ...`` instead runs a study (random search of N trials of ``--steps``
steps on 40 simulated workers, SQLite plan) and then resumes it in a new process, which
replays every logged decision: CPU and wall seconds and peak RSS growth of each run
(``--profile best`` prints the resumed run's profile). With ``--synthetic`` the finished
study is written in bulk instead (the tuner's decisions against a runner that answers at
once, then its trials, metrics and log as the engine writes them: a first run of 100,000
trials takes hours), and only the resumed run is measured.

``--before DIR --reads final best replay --sizes N`` times each read and the resumed run
with the stagetree of another checkout (DIR, say the main branch's) and with this one,
alternately (``--rounds``), on the same files: a before/after table with the load
average (the replay of the ``--synthetic`` file, on a fresh copy each run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

STUDY = "scale"
ROOT = "scale-root"
VERSION = "v1"
READS = ("best", "final", "trials")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def open_storage(url: str) -> Any:
    from stagetree.plan.registry import open_storage as _open

    return _open(url)


def fill(storage: Any, n: int, points: int) -> None:
    """A finished study of ``n`` trials (one constant ``x`` each, distinct) with a metric
    point at each of its ``points`` steps; trial rows and metrics in bulk on SQL
    storage (the API writes a transaction per trial)."""
    from stagetree.hp import Constant, dumps_hp
    from stagetree.plan.model import RequestState

    rng = random.Random(1)
    hps = [{"x": Constant(rng.random())} for _ in range(n)]
    storage.register_root(ROOT, {})
    inserted = storage.insert_trials(ROOT, [(hp, points) for hp in hps])
    storage.create_study(STUDY, {"metric": "acc", "mode": "max", "version": VERSION})

    def curve(x: float) -> list[tuple[int, dict[str, float]]]:
        out = []
        for s in range(1, points + 1):
            acc = s / (s + 5) * (1.0 - (x - 0.7) ** 2)
            out.append((s, {"acc": acc, "loss": 1 - acc}))
        return out

    attrs = {"version": VERSION, "opened": time.time()}
    if not hasattr(storage, "_tx"):
        items = [
            (ins.node, s, m, True)
            for hp, ins in zip(hps, inserted)
            for s, m in curve(float(hp["x"](0)))
        ]
        storage.put_metrics_many(items)
        for hp, ins in zip(hps, inserted):
            storage.set_request_state(ins.node, ins.step, RequestState.DONE)
            storage.add_trial(
                STUDY, ROOT, {}, hp, points, ins.node, ins.step, state="done", attrs=attrs
            )
        return
    from stagetree.plan import sql

    with storage._tx(write=True) as conn:
        for i in range(0, n, 5000):
            part = list(zip(hps, inserted))[i : i + 5000]
            conn.execute(
                sql._metrics.insert(),
                [
                    {"node": ins.node, "step": s, "root_key": ROOT, "data": json.dumps(m)}
                    for hp, ins in part
                    for s, m in curve(float(hp["x"](0)))
                ],
            )
            conn.execute(
                sql._trials.insert(),
                [
                    {
                        "id": i + j + 1,
                        "study": STUDY,
                        "root_key": ROOT,
                        "config": "{}",
                        "hp": dumps_hp(hp),
                        "steps": points,
                        "node": ins.node,
                        "step": ins.step,
                        "state": "done",
                        "attrs": json.dumps(attrs),
                        "created": time.time(),
                    }
                    for j, (hp, ins) in enumerate(part)
                ],
            )
        conn.execute(sql._requests.update().values(state=RequestState.DONE.value))


def read(storage: Any, what: str) -> int:
    """One read of the study, as the Study method reads it; the records it returns."""
    from stagetree.reports import trials as report_trials

    if what == "best":
        best = report_trials.best_record(storage, STUDY, "acc", "max", VERSION)
        assert best is not None and best.metrics
        return 1
    records = report_trials.trial_records(storage, STUDY, VERSION, history=what == "trials")
    return len(records)


def measure(storage: Any, n: int, points: int, what: str, profile: bool) -> dict[str, Any]:
    if what == "fill":
        t0 = time.perf_counter()
        fill(storage, n, points)
        return {"fill_s": time.perf_counter() - t0}
    base = _rss_mb()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        read(storage, what)
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        return {}
    t0, w0 = time.process_time(), time.perf_counter()
    count = read(storage, what)
    out = {"cpu_s": time.process_time() - t0, "wall_s": time.perf_counter() - w0}
    out["peak_mb"] = max(0.0, _peak_mb() - base)
    out["records"] = count
    return out


def _study_and_tuner(path: str, n: int, steps: int) -> tuple[Any, Any]:
    """The study and tuner of ``--replay``: random search of ``n`` trials of ``steps``
    steps on 40 simulated workers, SQLite plan at ``path``."""
    from stagetree.distributions import LogUniform, Uniform
    from stagetree.executors.simulated import LearningCurve, SimulatedExecutor, SimulatedTrainer
    from stagetree.space import RandomSpace
    from stagetree.study import Study
    from stagetree.tuners import RandomSearch

    space = RandomSpace({"lr": LogUniform(1e-4, 1e-1), "wd": Uniform(0.0, 0.1)})
    tuner = RandomSearch(space, "acc", steps=steps, num_trials=n, seed=0)
    executor = SimulatedExecutor(40, curve=LearningCurve(aliases={"acc": "accuracy"}))
    study = Study(
        "scale",
        SimulatedTrainer,
        storage=f"sqlite:///{path}",
        workers=40,
        checkpoint_dir=path + ".ckpt",
        executor=lambda: executor,
    )
    return study, tuner


def _curve(hp: dict[str, Any], steps: int) -> dict[int, dict[str, float]]:
    lr, wd = float(hp["lr"](0)), float(hp["wd"](0))
    return {
        s: {"acc": s / (s + 3) * (1 - wd) * (1 - abs(lr - 0.01)), "loss": lr}
        for s in range(1, steps + 1)
    }


class _InstantRunner:
    """A tuner's runner that answers every trial at once (a synthetic learning curve)
    and keeps the log and the trials: the decisions of a finished run, without one."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []
        self.trials: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {}

    async def submit(self, config: dict[str, Any], hp: dict[str, Any], steps: int) -> Any:
        from stagetree.hp import dumps_hp
        from stagetree.tuners.base import TrialResult

        self.trials[dumps_hp(hp)] = (config, hp, steps)
        history = _curve(hp, steps)
        return TrialResult(config, hp, steps, dict(history[steps]), history)

    def num_workers(self) -> int:
        return 40

    def check(self, config: dict[str, Any], hp: dict[str, Any]) -> None:
        pass

    def declare(self, trials: Any) -> None:
        pass

    def append_log(self, record: dict[str, Any]) -> None:
        self.log.append(record)

    def read_log(self) -> list[dict[str, Any]]:
        return []


def fill_run(path: str, n: int, steps: int) -> dict[str, Any]:
    """A finished ``--replay`` study of ``n`` trials written in bulk (a first run of
    100,000 trials takes hours here): the tuner's decisions against an instant runner,
    their trials' paths, metrics at every step, trial rows and log records, as the
    engine writes them."""
    import asyncio

    from stagetree.hp import dumps_hp
    from stagetree.plan import sql
    from stagetree.plan.model import RequestState

    t0 = time.perf_counter()
    study, tuner = _study_and_tuner(path, n, steps)
    runner = _InstantRunner()
    asyncio.run(tuner.run(runner))
    study.open()
    engine, slot = study._engine, study._study_slot
    storage = engine.storage
    trials = list(runner.trials.values())
    names = frozenset(trials[0][1])
    with engine.lock:
        root = engine._tree_key(slot.root_key({}, trials[0][1]), names)
        engine._ensure_row(slot)
    storage.register_root(root, {})
    inserted = storage.insert_trials(root, [(hp, st) for _, hp, st in trials])
    attrs = json.dumps({"version": slot.version, "opened": time.time()}, sort_keys=True)
    with storage._tx(write=True) as conn:
        first = 1
        for i in range(0, len(trials), 5000):
            part = list(zip(trials, inserted))[i : i + 5000]
            conn.execute(
                sql._metrics.insert(),
                [
                    {"node": ins.node, "step": s, "root_key": root, "data": json.dumps(m)}
                    for (_, hp, st), ins in part
                    for s, m in _curve(hp, st).items()
                ],
            )
            conn.execute(
                sql._trials.insert(),
                [
                    {
                        "id": first + i + j,
                        "study": slot.name,
                        "root_key": root,
                        "config": json.dumps(cfg, sort_keys=True, separators=(",", ":")),
                        "hp": dumps_hp(hp),
                        "steps": st,
                        "node": ins.node,
                        "step": ins.step,
                        "state": "done",
                        "attrs": attrs,
                        "created": time.time(),
                    }
                    for j, ((cfg, hp, st), ins) in enumerate(part)
                ],
            )
        conn.execute(sql._requests.update().values(state=RequestState.DONE.value))
        conn.execute(
            sql._logs.insert(),
            [
                {
                    "study": slot.name,
                    "seq": k,
                    "record": json.dumps(r, sort_keys=True, separators=(",", ":")),
                }
                for k, r in enumerate(runner.log)
            ],
        )
    study.close()
    return {"fill_s": time.perf_counter() - t0, "log": len(runner.log)}


def run_study(path: str, n: int, steps: int, profile: bool) -> dict[str, Any]:
    """Random search of ``n`` trials of ``steps`` steps on 40 simulated workers (virtual
    time) with the SQLite plan at ``path``: the first run when the file is new, else a
    resumed one, which replays every decision of the log (every trial's result is
    stored). CPU and wall seconds of ``tune()``, the growth of peak RSS per trial."""
    resumed = os.path.exists(path)
    base = _rss_mb()
    study, tuner = _study_and_tuner(path, n, steps)
    prof = None
    if profile and resumed:  # the replay's profile
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0, w0 = time.process_time(), time.perf_counter()
    try:
        study.tune(tuner)
    finally:
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
        if prof is not None:
            import pstats

            prof.disable()
            stats = pstats.Stats(prof, stream=sys.stderr)
            stats.sort_stats("tottime").print_stats(15)
            stats.sort_stats("cumulative").print_stats("stagetree", 40)
        study.close()
    grown = max(0.0, _peak_mb() - base)
    return {"resumed": resumed, "cpu_s": cpu, "wall_s": wall, "peak_mb": grown}


def _child(args: list[str], code: str | None = None) -> dict[str, Any]:
    """``--one args`` in a fresh process; with ``code``, against the stagetree of that
    checkout (``--before``)."""
    cmd = [sys.executable, __file__, "--one", *args]
    env = None if code is None else {**os.environ, "PYTHONPATH": os.path.abspath(code)}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{' '.join(args)} failed")
    if done.stderr:
        sys.stderr.write(done.stderr)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _url(backend: str, n: int, data: str, pg_url: str | None) -> str:
    if backend == "memory":
        return "memory:"
    if backend == "sqlite":
        return f"sqlite:///{os.path.join(data, f'study-{n}.db')}"
    if pg_url is None:
        raise SystemExit("--pg-url is needed for postgresql")
    return pg_url


def replay(sizes: list[int], steps: int, data: str, profile: bool, synthetic: bool) -> None:
    """A study of each size run (or with ``synthetic``, written in bulk: see
    :func:`fill_run`), then resumed (its log replayed), each in a process of its own; a
    table of both."""
    print("| trials | run | CPU s | wall s | peak MB | KiB/trial |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in sizes:
        path = os.path.join(data, f"study-{'bulk' if synthetic else 'run'}-{n}-{steps}.db")
        if synthetic and not os.path.exists(path):
            filled = _child([path, str(n), str(steps), "fillrun", "0"])
            print(
                f"filled {n}: {filled['fill_s']:.1f} s, {filled['log']} log records",
                file=sys.stderr,
            )
        for _ in range(1 if synthetic else 2):
            r = _child([path, str(n), str(steps), "study", "1" if profile else "0"])
            run = "resumed" if r["resumed"] else "first"
            print(
                f"| {n:,} | {run} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} | {r['peak_mb']:.0f} | "
                f"{r['peak_mb'] * 1024 / n:.2f} |",
                flush=True,
            )


def before_after(
    sizes: list[int], reads: list[str], data: str, before: str, rounds: int, steps: int
) -> None:
    """Each read (``final``, ``best``: SQLite, ``--points`` 16) and the resumed run of
    ``--replay`` sizes (``replay`` in ``reads``; ``--synthetic`` file) timed with the
    stagetree of checkout ``before`` and with this one, alternately, ``rounds`` times,
    each run in a fresh process (a replay on a fresh copy of the same filled file);
    CPU seconds, wall seconds, peak MB growth and the ratio of the CPU medians."""
    import shutil
    import statistics

    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    print(
        "| trials | what | CPU s before | CPU s after | ratio | wall s before / after "
        "| peak MB before / after |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in sizes:
        for what in reads:
            if what == "replay":
                filled = os.path.join(data, f"study-bulk-{n}-{steps}.db")
                if not os.path.exists(filled):
                    _child([filled, str(n), str(steps), "fillrun", "0"])
                path = os.path.join(data, f"resumed-{n}-{steps}.db")
                args = [path, str(n), str(steps), "study", "0"]
            else:
                url = _url("sqlite", n, data, None)
                if not os.path.exists(url.split("///", 1)[1]):
                    _child([url, str(n), "16", "fill", "0"])
                args = [url, str(n), "16", what, "0"]
            runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for _ in range(rounds):
                for side, code in (("before", before), ("after", None)):
                    if what == "replay":
                        shutil.copyfile(filled, path)
                    runs[side].append(_child(args, code))
            cpu = {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()}

            def listed(side: str, key: str, fmt: str, runs: dict[str, Any] = runs) -> str:
                return ", ".join(format(r[key], fmt) for r in runs[side])

            print(
                f"| {n:,} | {what} | {listed('before', 'cpu_s', '.2f')} | "
                f"{listed('after', 'cpu_s', '.2f')} | {cpu['before'] / cpu['after']:.2f}x | "
                f"{listed('before', 'wall_s', '.0f')} / {listed('after', 'wall_s', '.0f')} | "
                f"{listed('before', 'peak_mb', '.0f')} / {listed('after', 'peak_mb', '.0f')} |",
                flush=True,
            )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--storage", nargs="+", default=["memory", "sqlite"])
    p.add_argument("--reads", nargs="+", default=["best", "final"], choices=(*READS, "replay"))
    p.add_argument("--points", type=int, default=16)
    p.add_argument("--data", default=None, help="folder of the SQLite files (kept)")
    p.add_argument("--pg-url", default=None)
    p.add_argument("--profile", default=None, choices=READS)
    p.add_argument("--one", nargs=5, metavar=("URL", "N", "POINTS", "WHAT", "PROFILE"))
    p.add_argument("--replay", type=int, nargs="+", default=None, metavar="N")
    p.add_argument("--steps", type=int, default=4, help="steps per trial of --replay")
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="--replay: write the finished study in bulk instead of running it first",
    )
    p.add_argument(
        "--before",
        default=None,
        metavar="DIR",
        help="time --reads (final, best, replay) with the stagetree of checkout DIR and "
        "with this one, alternately (--rounds times), on the same SQLite files",
    )
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.one and args.one[3] == "fillrun":
        path, n, steps, _, _ = args.one
        print(json.dumps(fill_run(path, int(n), int(steps))))
        return
    if args.one and args.one[3] == "study":
        path, n, steps, _, prof = args.one
        print(json.dumps(run_study(path, int(n), int(steps), prof == "1")))
        return
    if args.one:
        url, n, points, what, prof = args.one
        storage = open_storage(url)
        if url == "memory:" and what != "fill":  # a memory study lives in its process
            fill(storage, int(n), int(points))
        print(json.dumps(measure(storage, int(n), int(points), what, prof == "1")))
        return
    data = args.data or tempfile.mkdtemp(prefix="storage-scale-")
    os.makedirs(data, exist_ok=True)
    if args.before:
        before_after(args.sizes, args.reads, data, args.before, args.rounds, args.steps)
        return
    if args.replay:
        replay(args.replay, args.steps, data, args.profile is not None, args.synthetic)
        return
    rows = []
    for backend in args.storage:
        for n in args.sizes:
            url = _url(backend, n, data, args.pg_url)
            if backend == "postgresql":
                storage = open_storage(url)
                storage.drop_all()
                storage.close()
            fresh = backend == "postgresql" or (
                backend == "sqlite" and not os.path.exists(url.split("///", 1)[1])
            )
            if fresh:
                filled = _child([url, str(n), str(args.points), "fill", "0"])
                print(f"filled {backend} {n}: {filled['fill_s']:.1f} s", file=sys.stderr)
            if args.profile:
                if n == max(args.sizes):
                    _child([url, str(n), str(args.points), args.profile, "1"])
                continue
            for what in args.reads:
                r = _child([url, str(n), str(args.points), what, "0"])
                rows.append((backend, n, what, r))
                print(
                    f"{backend} {n} {what}: {r['cpu_s']:.2f} CPU s, {r['wall_s']:.2f} wall s, "
                    f"{r['peak_mb']:.0f} MB",
                    file=sys.stderr,
                )
    if rows:
        print(f"load average: {os.getloadavg()[0]:.1f}")
        print("| storage | trials | read | CPU s | wall s | peak MB | KiB/trial |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for backend, n, what, r in rows:
            kib = r["peak_mb"] * 1024 / n
            print(
                f"| {backend} | {n:,} | {what} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} | "
                f"{r['peak_mb']:.0f} | {kib:.2f} |"
            )


if __name__ == "__main__":
    main()
