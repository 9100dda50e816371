"""Start-up latency: seconds from ``study.tune(...)`` to the first training step, for the
first study of a Python process (cold: worker processes are spawned, import torch,
scikit-learn and the trainer, and warm up) and for the second study of the same process
(warm: the first study's worker processes come back from the pool, see
:func:`stagetree.executors.local.shutdown_pool`).

Each measurement runs in a fresh Python process (``--child``), which opens two studies one
after the other (separate storages, the same trainer and worker count) with
:class:`~stagetree.torch.examples.DigitsTrainer`. The trainer appends ``pid time`` to a
file at every ``train()``; "first step" is the earliest call after ``tune()`` was
entered, "all workers" the latest of the workers' first calls (every worker training).
Medians over ``--repeats`` fresh processes.

Run: ``.venv/bin/python benchmarks/startup_bench.py [--workers 1 2 4] [--repeats 3]``
(``--no-pool``: the same with the pool off, every study starts its workers;
``--start-method forkserver``: workers forked from a fork server that imported torch once).

``--vs-optuna``: time to the first result of a small task, stagetree against Optuna, as a
new user's script runs it: a fresh Python process per system that imports torch and the
trainer, tunes 16 trials of :class:`~stagetree.torch.examples.DigitsTrainer` (a random
learning rate and momentum, up to 8 steps) with TPE and successive halving (stagetree:
``ASHA(eta=2, sampler=TPESampler(seed=0))``, 2 local workers, a fresh SQLite file;
Optuna: ``TPESampler(seed=0)`` and ``SuccessiveHalvingPruner(reduction_factor=2)``, its
default of one trial at a time, in-memory storage), each reporting after every step.
Seconds from the process's start: imports done, the first ``evaluate()`` result (any
process), the whole run (the process's exit; and, per run, its part after the first
result), all processes gone (its output closed:
the processes it started, which hold its output, exited too, as a pipeline such as
``python script.py | tee log`` waits for); the systems alternate order between repeats.
"main process CPU s": the CPU-seconds of the script's own process up to its end, all
its threads (stagetree's driver; for Optuna, also the training).
``--checkout NAME=PATH`` (repeatable) runs stagetree from each checkout in turn (a
before and an after in one session), e.g. ``--checkout before=../main --checkout
after=.``. ``STAGETREE_FORK_DRIVER=0`` in the environment: the workers fork from a fresh
fork server, not from one forked from the script's process.

``--timeline``: where the stagetree run of ``--vs-optuna`` spends its time, per checkout:
seconds from the process's start to each mark (imports done, ``Study()``, ``tune()``
entered, the storage opened, the fork server forked and done importing, each worker's
start, the first result, the last result, the Optuna bridge's close, ``tune()``
returned, closed; then the exit's stages: the script's end, threads joined, the first
exit hook, the pool's workers stopped, stagetree's exit hooks done, all exit hooks done
(the interpreter's teardown follows), the process's exit), from wrappers that the child
installs around those functions (medians over ``--repeats``), and per run the tail
after the first result (``= ...`` rows). Functions a checkout lacks are left out.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# The first exit hook registered (before torch imports multiprocessing, whose hook would
# run after it), so the last to run: the interpreter's teardown follows it.
atexit.register(lambda: _mark("exit hooks: all done"))

from stagetree.torch.examples import DigitsTrainer  # noqa: E402

STAMPS_ENV = "STAGETREE_BENCH_STAMPS"


class StampingDigitsTrainer(DigitsTrainer):
    """DigitsTrainer that appends ``pid time.time()`` to ``$STAGETREE_BENCH_STAMPS`` at
    every ``train()`` (a few microseconds against a step's milliseconds)."""

    def train(self) -> dict[str, float]:
        path = os.environ.get(STAMPS_ENV)
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {time.time()}\n")
        return super().train()


class FirstResultDigitsTrainer(DigitsTrainer):
    """DigitsTrainer that appends ``pid time.time()`` to ``$STAGETREE_BENCH_STAMPS`` at
    every ``evaluate()``: the times at which results exist."""

    def evaluate(self) -> dict[str, float]:
        out = super().evaluate()
        path = os.environ.get(STAMPS_ENV)
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {time.time()}\n")
        return out


FIRST_TRIALS, FIRST_STEPS = 16, 8
FIRST_FIXED = {"optimizer": "momentum", "hidden": 64, "batches_per_step": 4, "seed": 0}


def first_result_stagetree(root: Path) -> None:
    """The small task with stagetree (see ``--vs-optuna``)."""
    import optuna

    from stagetree import Study
    from stagetree.distributions import LogUniform, Uniform
    from stagetree.space import RandomSpace
    from stagetree.tuners import ASHA

    space = RandomSpace(
        {"lr": LogUniform(0.01, 0.5), "momentum": Uniform(0.5, 0.95)}, fixed=FIRST_FIXED
    )
    tuner = ASHA(
        space,
        "accuracy",
        mode="max",
        min_steps=1,
        max_steps=FIRST_STEPS,
        eta=2,
        num_trials=FIRST_TRIALS,
        seed=0,
        sampler=optuna.samplers.TPESampler(seed=0),
    )
    study = Study("first", FirstResultDigitsTrainer, storage=f"sqlite:///{root}/s.db", workers=2)
    with study:
        study.tune(tuner, progress=False)


def first_result_optuna(root: Path) -> None:
    """The small task with Optuna (see ``--vs-optuna``)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def objective(trial: optuna.Trial) -> float:
        hp = {
            "lr": trial.suggest_float("lr", 0.01, 0.5, log=True),
            "momentum": trial.suggest_float("momentum", 0.5, 0.95),
        }
        trainer = FirstResultDigitsTrainer(FIRST_FIXED)
        accuracy = 0.0
        for step in range(FIRST_STEPS):
            trainer.setup(hp)
            trainer.train()
            accuracy = trainer.evaluate()["accuracy"]
            trial.report(accuracy, step + 1)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return accuracy

    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.SuccessiveHalvingPruner(
            min_resource=1, reduction_factor=2, min_early_stopping_rate=0
        ),
    )
    study.optimize(objective, n_trials=FIRST_TRIALS)


TIMELINE_ENV = "STAGETREE_BENCH_TIMELINE"
# (module, attribute path, mark): the functions the timeline wraps (entry "> ", exit "< ").
TIMELINE_MARKS = [
    ("stagetree.study", "Study.__init__", "Study()"),
    ("stagetree.study_api", "StudyAPI.tune", "tune()"),
    ("stagetree.study", "Study._attach", "storage opened"),
    ("stagetree.executors.local", "_server_context", "fork server started"),
    ("stagetree.executors._driverfork", "_preload", "fork server imports"),
    ("stagetree.executors._process", "_serve", "worker serves"),
    ("stagetree.tuners.optuna_bridge", "SamplerBridge.close", "Optuna bridge closed"),
    ("stagetree.study", "Study.close", "close"),
    # Called by the pool's exit hook too (the last call is the one shown).
    ("stagetree.executors._pool", "shutdown_slots", "workers stopped"),
    ("multiprocessing.util", "_run_finalizers", "multiprocessing's finalizers"),
    ("threading", "_shutdown", "threads joined"),
]
# Marks shown at their last time (the others at their first).
TIMELINE_LAST = {"> workers stopped", "< workers stopped", "last result", "< worker serves *"}


def _mark(what: str) -> None:
    path = os.environ.get(TIMELINE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {time.time()} {what}\n")


def _install_timeline() -> None:
    """Wrap :data:`TIMELINE_MARKS` to write their entries and exits (a checkout that
    lacks one is timed without it); the first ``evaluate()`` of each process too."""
    import functools
    import importlib

    # Registered before stagetree's exit hooks (the imports below register theirs), so
    # it runs after them.
    atexit.register(_mark, "exit hooks: stagetree's done")
    for module, attr, what in TIMELINE_MARKS:
        try:
            owner: Any = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            orig = getattr(owner, name)
        except (ImportError, AttributeError):
            continue

        def wrapped(*a: Any, _orig: Any = orig, _what: str = what, **k: Any) -> Any:
            _mark(f"> {_what}")
            try:
                return _orig(*a, **k)
            finally:
                _mark(f"< {_what}")

        setattr(owner, name, functools.wraps(orig)(wrapped))
    evaluate = FirstResultDigitsTrainer.evaluate
    seen: list[int] = []

    def first_evaluate(self: FirstResultDigitsTrainer) -> dict[str, float]:
        out = evaluate(self)
        if os.getpid() not in seen:
            seen.append(os.getpid())
            _mark("first result (this process)")
        _mark("last result")
        return out

    FirstResultDigitsTrainer.evaluate = first_evaluate  # type: ignore[method-assign]


def first_result_child(system: str) -> None:
    imported = time.time()
    _mark("imports done")
    if system == "stagetree" and os.environ.get(TIMELINE_ENV):
        _install_timeline()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        {"stagetree": first_result_stagetree, "optuna": first_result_optuna}[system](root)
    print(json.dumps({"imported": imported, "cpu": time.process_time()}), flush=True)
    _mark("script done")
    atexit.register(_mark, "exit hooks: first")


def _run_child(args: list[str], env: dict[str, str]) -> str:
    """The stdout of this script run in a fresh process with ``args``."""
    cmd = [sys.executable, __file__, *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, check=True, env=env, timeout=600
    ).stdout


def _run_timed(args: list[str], env: dict[str, str]) -> tuple[str, float, float]:
    """``(stdout, its exit, all gone)`` of this script run in a fresh process with
    ``args``: the seconds until the process exited, and until its output closed (the
    processes it started, which inherit its output, gone too)."""
    cmd = [sys.executable, __file__, *args]
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    exited: list[float] = []

    def watch() -> None:
        proc.wait()
        exited.append(time.time())

    watcher = threading.Thread(target=watch)
    watcher.start()
    out, err = proc.communicate(timeout=600)
    closed = time.time()
    watcher.join()
    if proc.returncode:
        sys.stderr.write(err[-4000:])  # the child's traceback
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return out, exited[0] - started, closed - started


def first_result(repeats: int, checkouts: list[str]) -> None:
    """Runs ``--vs-optuna``: both systems, ``repeats`` fresh processes each; stagetree
    once per ``NAME=PATH`` of ``checkouts`` (``PYTHONPATH=PATH``: a before and an after
    measured alternately in one session), or as installed when there is none."""
    from _common import fmt, load_average, machine_info, markdown_table

    paths = dict(c.split("=", 1) for c in checkouts)
    stagetrees = [f"stagetree {name}" for name in paths] or ["stagetree"]
    systems = [*stagetrees, "optuna"]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    load = [load_average()]
    for repeat in range(repeats):
        for system in systems if repeat % 2 == 0 else systems[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                stamps = Path(tmp) / "stamps"
                stamps.touch()
                env = dict(os.environ, **{STAMPS_ENV: str(stamps)})
                name = system.removeprefix("stagetree ")
                if name in paths:
                    env["PYTHONPATH"] = os.path.abspath(paths[name])
                started = time.time()
                out, exited, gone = _run_timed(["--first-result", system.split()[0]], env)
                times = [float(line.split()[1]) for line in stamps.read_text().splitlines()]
            child = json.loads(out.strip().splitlines()[-1])
            runs[system].append(
                {
                    "imports": child["imported"] - started,
                    "first": min(times) - started,
                    "whole": exited,
                    "gone": gone,
                    "cpu": child["cpu"],
                }
            )
    load.append(load_average())

    def med(system: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[system])

    rows = [
        [
            system,
            fmt(med(system, "imports")),
            fmt(med(system, "first")),
            fmt(statistics.median(r["first"] - r["imports"] for r in runs[system])),
            fmt(med(system, "whole")),
            fmt(statistics.median(r["whole"] - r["first"] for r in runs[system])),
            fmt(med(system, "gone")),
            fmt(med(system, "cpu")),
        ]
        for system in systems
    ]
    for system in stagetrees:
        rows.append(
            [
                f"{system} / optuna",
                *(fmt(med(system, k) / med("optuna", k)) for k in ("imports", "first")),
                "",
                fmt(med(system, "whole") / med("optuna", "whole")),
                "",
                fmt(med(system, "gone") / med("optuna", "gone")),
                "",
            ]
        )
    print(", ".join(f"{k}: {v}" for k, v in machine_info().items()))
    print(f"load average before / after: {load[0]} / {load[1]}; median of {repeats}\n")
    header = [
        "system",
        "imports s",
        "first result s",
        "first result - imports s",
        "whole run s",
        "whole run - first result s",
        "all processes gone s",
        "main process CPU s",
    ]
    print(markdown_table(header, rows))


def timeline(repeats: int, checkouts: list[str]) -> None:
    """Runs ``--timeline``: the stagetree run of ``--vs-optuna`` with marks, ``repeats``
    fresh processes per checkout (alternating), medians of each mark's first time."""
    from _common import fmt, load_average, machine_info, markdown_table

    paths = dict(c.split("=", 1) for c in checkouts) or {"stagetree": ""}
    marks: dict[str, dict[str, list[float]]] = {name: {} for name in paths}
    load = [load_average()]
    for repeat in range(repeats):
        for name in list(paths) if repeat % 2 == 0 else list(paths)[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                log = Path(tmp) / "timeline"
                log.touch()
                env = dict(os.environ, **{TIMELINE_ENV: str(log), STAMPS_ENV: os.devnull})
                if paths[name]:
                    env["PYTHONPATH"] = os.path.abspath(paths[name])
                started = time.time()
                _, exited, _ = _run_timed(["--first-result", "stagetree"], env)
                first: dict[str, float] = {}
                driver = None
                for line in log.read_text().splitlines():
                    pid, t, what = line.split(" ", 2)
                    driver = driver or pid  # the first mark is the driver's
                    kind = (
                        what if pid == driver or what.startswith(("first", "last")) else f"{what} *"
                    )
                    if kind in TIMELINE_LAST:
                        first[kind] = float(t) - started
                    else:
                        first.setdefault(kind, float(t) - started)
                first["process exit"] = exited
                if "last result" in first:  # per run: the tail after the first result
                    head = first["first result (this process)"]
                    first["= last result - first result"] = first["last result"] - head
                    first["= process exit - first result"] = exited - head
            for kind, t in first.items():
                marks[name].setdefault(kind, []).append(t)
    load.append(load_average())
    order = sorted(
        {k for m in marks.values() for k in m},
        key=lambda k: min(statistics.median(m[k]) for m in marks.values() if k in m),
    )
    rows = [
        [kind, *(fmt(statistics.median(m[kind])) if kind in m else "" for m in marks.values())]
        for kind in order
    ]
    print(", ".join(f"{k}: {v}" for k, v in machine_info().items()))
    print(f"load average before / after: {load[0]} / {load[1]}; median of {repeats}")
    print("seconds from the process's start; > entered, < returned; * in a child process\n")
    print(markdown_table(["mark", *marks], rows))


def _one_study(name: str, workers: int, stamps: Path, root: Path) -> dict[str, float]:
    from stagetree import Study
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import ASHA

    space = GridSpace(
        {"lr": [Constant(0.1), Constant(0.05)]},
        fixed={"hidden": [16], "batches_per_step": [1], "seed": list(range(2 * workers))},
    )
    tuner = ASHA(space, "accuracy", min_steps=1, max_steps=2, eta=2, num_trials=len(space))
    opened = time.time()
    with Study(
        name, StampingDigitsTrainer, storage=f"sqlite:///{root}/{name}.db", workers=workers
    ) as s:
        begin = time.time()
        s.tune(tuner)
    firsts: dict[str, float] = {}
    for line in stamps.read_text().splitlines():
        pid, t = line.split()
        if float(t) >= begin:
            firsts[pid] = min(firsts.get(pid, float("inf")), float(t))
    return {
        "first": min(firsts.values()) - begin,
        "all": max(firsts.values()) - begin if len(firsts) >= workers else float("nan"),
        "open": begin - opened,
    }


def child(workers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stamps = root / "stamps"
        stamps.touch()
        os.environ[STAMPS_ENV] = str(stamps)  # before the first study: the pool key
        cold = _one_study("cold", workers, stamps, root)
        warm = _one_study("warm", workers, stamps, root)
    print(json.dumps({"cold": cold, "warm": warm}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-pool", action="store_true", help="STAGETREE_WORKER_IDLE=0")
    parser.add_argument(
        "--start-method",
        choices=["spawn", "forkserver"],
        default="forkserver",
        help="of the workers",
    )
    parser.add_argument("--vs-optuna", action="store_true", help="time to the first result")
    parser.add_argument(
        "--timeline", action="store_true", help="where --vs-optuna's stagetree run spends its time"
    )
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="with --vs-optuna or --timeline: stagetree from this checkout "
        "(PYTHONPATH=PATH), repeatable",
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first-result", choices=["stagetree", "optuna"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_result:
        first_result_child(args.first_result)
        return
    if args.vs_optuna:
        first_result(args.repeats, args.checkout)
        return
    if args.timeline:
        timeline(args.repeats, args.checkout)
        return
    if args.child:
        child(args.child)
        return
    from _common import fmt, machine_info, markdown_table

    env = dict(os.environ)
    if args.no_pool:
        env["STAGETREE_WORKER_IDLE"] = "0"
    env["STAGETREE_START_METHOD"] = args.start_method
    rows: list[list[Any]] = []
    for workers in args.workers:
        runs = []
        for _ in range(args.repeats):
            out = _run_child(["--child", str(workers)], env)
            runs.append(json.loads(out.strip().splitlines()[-1]))

        def med(kind: str, key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[kind][key] for r in runs)

        rows.append(
            [
                workers,
                fmt(med("cold", "first")),
                fmt(med("cold", "all")),
                fmt(med("warm", "first")),
                fmt(med("warm", "all")),
                fmt(med("cold", "open")),
            ]
        )
    print(", ".join(f"{k}: {v}" for k, v in machine_info().items()))
    print(
        f"start method: {args.start_method}; pool: {'off' if args.no_pool else 'on'}; "
        f"median of {args.repeats} processes\n"
    )
    header = [
        "workers",
        "cold: first step s",
        "cold: all workers s",
        "warm: first step s",
        "warm: all workers s",
        "Study() open s",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
