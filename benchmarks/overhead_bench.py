"""Per-step framework overhead of the Worker, with a trainer whose ``train()`` does nothing.

Prints a table of median per-step overhead in microseconds:

* ``bare loop``: a plain ``for`` loop calling the same no-op ``train()`` (the floor);
* ``Worker.run``: the worker loop directly (in this process, no-op ``poll``);
* ``LocalExecutor``: the same loop inside a worker process, polling its instruction
  pipe every step (measured inside the process, reported through ``evaluate()``);
* ``... + 3 sequences``: the same with three sequential hyper-parameters (one of them
  changing every step, so ``setup`` is called every step).

"Per step" is the interval between consecutive ``train()`` calls; the median over all
steps of a run, then the median over repeats; "over floor" subtracts the bare loop
(the no-op trainer records a timestamp per call). "mean" is the run's total time per step
(median over repeats): it also carries what the median skips, such as sequence values
computed once per 1024 steps and throttled Progress events.

Run: ``.venv/bin/python benchmarks/overhead_bench.py [--steps N] [--repeats R]``.

``--trials 300 1000 3000`` measures the driver's cost per trial instead (issue 24): a
``RandomSearch`` study of N trials of ``--trial-steps`` steps each (every trial its own
plan tree) with a trivial trainer (``TrivialTrainer``: no work, its metric is its
learning rate) on 2 real local worker processes, against Optuna's ask/tell loop of the
same N trials (``RandomSampler``, one ``suggest_float``, a ``report`` per step), each on
the in-memory and the SQLite storage, each (system, storage, N) in a fresh process.
``--child stagetree N STEPS URL`` runs one stagetree study on the database at ``URL``
(PostgreSQL; its stagetree tables are emptied first).
Measured: CPU seconds of the driver's process (the engine, scheduler, tuner and plan
storage; not the workers) per trial, and the growth exponent of CPU in N (1: constant
cost per trial). With ``--per-step S2`` the stagetree study also runs with ``S2`` steps
a trial at the smallest N: the driver's cost per step is the difference per extra step.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from stagetree.checkpoints import CheckpointStore
from stagetree.executors import LocalExecutor
from stagetree.executors.worker import Worker
from stagetree.hp import Constant, Cosine, MultiStep
from stagetree.trainer import Trainer
from stagetree.work import BatchDone, MetricsReported, RunBatch, Segment

_perf = time.perf_counter


class NoOpTrainer(Trainer):
    """``train()`` only records when it was called."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.stamps: list[float] = []
        self._append = self.stamps.append

    def setup(self, hp: Mapping[str, Any]) -> None:
        pass

    def train(self) -> None:
        self._append(_perf())

    def evaluate(self) -> dict[str, float]:
        return {
            "median_us": median_interval_us(self.stamps),
            "mean_us": mean_interval_us(self.stamps),
        }

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def median_interval_us(stamps: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return statistics.median(gaps) * 1e6


def mean_interval_us(stamps: list[float]) -> float:
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e6


def _batch(batch_id: int, steps: int, hp: Mapping[str, Any]) -> RunBatch:
    return RunBatch(
        batch_id=batch_id,
        worker=0,
        root_key=f"bench-{batch_id}",  # a new root each time: fresh trainer
        config={},
        start_step=0,
        start_at=None,
        start_checkpoint=None,
        segments=(Segment(1, 0, steps, hp),),
        evaluate_at=((1, steps),),
    )


HP_NONE: dict[str, Any] = {}
HP_THREE: dict[str, Any] = {
    "lr": Cosine(0.1, 10**9),  # changes every step
    "momentum": Constant(0.9),
    "wd": MultiStep(1e-4, [10**8], 0.1),
}


class TrivialTrainer(Trainer):
    """A trainer that does nothing: a step costs no time, its metric is its lr."""

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = float(hp["lr"])

    def train(self) -> None:
        pass

    def evaluate(self) -> dict[str, float]:
        return {"loss": self.lr}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def stagetree_trials(n: int, steps: int, storage: str, tmp: str) -> float:
    """Driver CPU seconds of a random search of ``n`` trials on 2 local workers."""
    from stagetree.distributions import LogUniform
    from stagetree.space import RandomSpace
    from stagetree.study import Study
    from stagetree.tuners import RandomSearch

    url = "memory://" if storage == "memory" else f"sqlite:///{tmp}/plan.db"
    if "://" in storage:  # a database URL (PostgreSQL): emptied first
        from stagetree.plan.sql import SQLPlanStorage

        url = storage
        SQLPlanStorage(url).drop_all()
    space = RandomSpace(hp={"lr": Constant(LogUniform(1e-4, 1.0))})  # type: ignore[arg-type]
    tuner = RandomSearch(space, "loss", mode="min", steps=steps, num_trials=n, seed=0)
    with Study(
        "overhead", TrivialTrainer, storage=url, workers=2, checkpoint_dir=f"{tmp}/ckpt"
    ) as study:
        study.open()
        cpu = time.process_time()
        study.tune(tuner, progress=False)
        return time.process_time() - cpu


def optuna_trials(n: int, steps: int, storage: str, tmp: str) -> float:
    """CPU seconds of Optuna's ask/tell loop over ``n`` trials (random sampler)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = None if storage == "memory" else f"sqlite:///{tmp}/optuna.db"
    study = optuna.create_study(storage=url, sampler=optuna.samplers.RandomSampler(seed=0))
    cpu = time.process_time()
    for _ in range(n):
        trial = study.ask()
        lr = trial.suggest_float("lr", 1e-4, 1.0, log=True)
        for step in range(steps):
            trial.report(lr, step)
        study.tell(trial, lr)
    return time.process_time() - cpu


def growth(points: list[tuple[int, float]]) -> float:
    """Least-squares exponent k of cpu ~ n^k."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(max(c, 1e-9)) for _, c in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 1.0


def _one(system: str, n: int, steps: int, storage: str) -> float:
    """One measurement in a fresh process (its own imports, caches and memory)."""
    cmd = [sys.executable, __file__, "--child", system, str(n), str(steps), storage]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode:
        raise RuntimeError(f"{system} {n} {storage} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def per_trial(sizes: list[int], steps: int, more_steps: int | None) -> None:
    """The driver's cost per trial against Optuna's (see the module docstring)."""
    print(f"driver CPU per trial, ms ({steps} steps a trial; 2 local workers for stagetree)")
    print(f"{'system':<10} {'storage':<7} " + " ".join(f"{n:>9}" for n in sizes) + "  exponent")
    for storage in ("memory", "sqlite"):
        for system in ("stagetree", "optuna"):
            points = [(n, _one(system, n, steps, storage)) for n in sizes]
            cells = " ".join(f"{cpu / n * 1e3:>9.3f}" for n, cpu in points)
            k = growth(points) if len(points) > 1 else float("nan")
            print(f"{system:<10} {storage:<7} {cells}  {k:8.2f}", flush=True)
    if more_steps:
        n = sizes[0]
        for storage in ("memory", "sqlite"):
            base = _one("stagetree", n, steps, storage)
            more = _one("stagetree", n, more_steps, storage)
            us = (more - base) / (n * (more_steps - steps)) * 1e6
            print(
                f"stagetree {storage}: driver per step {us:.1f} us ({n} trials, {steps} vs "
                f"{more_steps} steps)",
                flush=True,
            )


def bare_loop(steps: int) -> dict[str, float]:
    trainer = NoOpTrainer({})
    for _ in range(steps):
        trainer.train()
    return trainer.evaluate()


def via_worker(steps: int, hp: Mapping[str, Any]) -> Mapping[str, float]:
    events: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(0, NoOpTrainer, CheckpointStore(tmp), events.append)
        worker.run(_batch(1, steps, hp))
        [metrics] = [e for e in events if isinstance(e, MetricsReported)]
        worker.close()
    return metrics.metrics


def via_local_executor(
    ex: LocalExecutor, batch_id: int, steps: int, hp: Mapping[str, Any]
) -> Mapping[str, float]:
    ex.submit(_batch(batch_id, steps, hp))
    metrics = None
    while True:
        for event in ex.events(timeout=60):
            if isinstance(event, MetricsReported):
                metrics = event.metrics
            if isinstance(event, BatchDone):
                assert metrics is not None
                return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trials", type=int, nargs="+", help="the per-trial benchmark's sizes")
    parser.add_argument("--trial-steps", type=int, default=4)
    parser.add_argument("--per-step", type=int, default=None, metavar="S2")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        system, n, trial_steps, storage = args.child
        run = stagetree_trials if system == "stagetree" else optuna_trials
        with tempfile.TemporaryDirectory() as tmp:
            print(run(int(n), int(trial_steps), storage, tmp))
        return
    if args.trials:
        per_trial(args.trials, args.trial_steps, args.per_step)
        return
    steps, repeats = args.steps, args.repeats

    rows: list[tuple[str, list[Mapping[str, float]]]] = []
    rows.append(("bare loop (floor)", [bare_loop(steps) for _ in range(repeats)]))
    rows.append(("Worker.run", [via_worker(steps, HP_NONE) for _ in range(repeats)]))
    rows.append(("Worker.run + 3 sequences", [via_worker(steps, HP_THREE) for _ in range(repeats)]))
    with tempfile.TemporaryDirectory() as tmp:
        ex = LocalExecutor(
            "benchmarks/overhead_bench.py:NoOpTrainer",
            num_workers=1,
            checkpoint_dir=tmp,
            devices=[],
            threads_per_worker=1,
        )
        with ex:
            ex.events(timeout=120)  # WorkerReady
            local = [via_local_executor(ex, i, steps, HP_NONE) for i in range(repeats)]
            local3 = [via_local_executor(ex, 100 + i, steps, HP_THREE) for i in range(repeats)]
    rows.append(("LocalExecutor worker process", local))
    rows.append(("LocalExecutor + 3 sequences", local3))

    floor = statistics.median(r["median_us"] for r in rows[0][1])
    print(f"{steps} steps x {repeats} repeats; per-step interval between train() calls")
    print(f"{'path':<32} {'median us':>10} {'over floor':>11} {'mean us':>8}")
    for name, runs in rows:
        med = statistics.median(r["median_us"] for r in runs)
        mean = statistics.median(r["mean_us"] for r in runs)
        print(f"{name:<32} {med:>10.2f} {med - floor:>11.2f} {mean:>8.2f}")


if __name__ == "__main__":
    main()
