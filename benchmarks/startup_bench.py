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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stagetree.torch.examples import DigitsTrainer

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
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
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
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(workers)],
                capture_output=True,
                text=True,
                check=True,
                env=env,
                timeout=600,
            ).stdout
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
