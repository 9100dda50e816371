"""How long a tuner waits for its decisions to be planned: ``study.tune(ASHA(...))`` on
a trainer whose steps cost next to nothing (executor ``"inline"``), so the wall-clock is
the engine's latency between a submission and its planning, once per decision (each
first submission, promotion and new trial after a result).

Each checkout runs in its own process, the checkouts alternately, so that the figures
of one table were measured side by side::

    python benchmarks/decision_bench.py --checkout before=../main --checkout after=.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, tempfile, time
from stagetree import Study, Trainer
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.tuners import ASHA

class Tiny(Trainer):
    def __init__(self, config):
        super().__init__(config)
        self.t, self.lr = 0, 0.0
    def setup(self, hp):
        self.lr = float(hp["lr"])
    def train(self):
        self.t += 1
        return {}
    def evaluate(self):
        return {"score": self.lr * self.t}
    def state_dict(self):
        return {"t": self.t, "lr": self.lr}
    def load_state_dict(self, state):
        self.t, self.lr = int(state["t"]), float(state["lr"])

trials = int(sys.argv[1])
space = GridSpace({"lr": [Constant(0.01 * i) for i in range(1, trials + 1)]}, fixed={"seed": [0]})
with tempfile.TemporaryDirectory() as d:
    with Study("s", Tiny, storage=f"sqlite:///{d}/p.db", executor="inline",
               checkpoint_dir=f"{d}/ck") as study:
        began = time.perf_counter()
        study.tune(ASHA(space, "score", min_steps=1, max_steps=16, num_trials=trials, eta=2))
        wall = time.perf_counter() - began
        jobs = sum(1 for r in study.read_log() if r.get("event") in ("submit", "promote"))
print(json.dumps({"wall": wall, "jobs": jobs}))
"""


def run(path: str, trials: int) -> dict[str, float]:
    """One tune in a fresh process with stagetree from ``path``."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(trials)],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    checkouts = [c.split("=", 1) for c in args.checkout]
    walls: dict[str, list[float]] = {name: [] for name, _ in checkouts}
    jobs: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, path in checkouts:
            r = run(path, args.trials)
            walls[name].append(r["wall"])
            jobs[name] = r["jobs"]
    print(f"load average {os.getloadavg()[0]:.2f}; median of {args.repeats}")
    print("| checkout | jobs | tune() s | ms per job |")
    print("|---|---:|---:|---:|")
    for name, _ in checkouts:
        wall = statistics.median(walls[name])
        per = wall / jobs[name] * 1e3 if jobs[name] else float("nan")
        print(f"| {name} | {jobs[name]:.0f} | {wall:.2f} | {per:.1f} |")


if __name__ == "__main__":
    main()
