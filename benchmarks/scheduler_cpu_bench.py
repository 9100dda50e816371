"""The scheduler's own CPU per trial in simulated studies (issues 22 and 24).

Runs a study through ``simulate`` (virtual time: the same decisions at every run) and
counts the driver thread's CPU inside ``Scheduler.handle_all`` (every event applied and
every decision taken), per trial:

* ``random N``: a ``RandomSearch`` of N trials of 4 steps on 2 workers, one drawn
  learning rate a trial (``overhead_bench.py --trials``'s study);
* ``grid xR``: ``study_bench.py``'s grid (24 trials sharing prefixes, 16 steps) on 2
  workers, R times in one process.

The cyclic garbage collector is off in the measured process: its passes (over the whole
heap, imported modules included) land in whichever call allocates past its threshold,
and blur a comparison of a few hundred microseconds a trial (see ``overhead_bench.py``
for the whole process's CPU with it on).

Each checkout runs in its own process, the checkouts alternately, so that the figures
of one table were measured side by side::

    python benchmarks/scheduler_cpu_bench.py --checkout before=../main --checkout after=.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import gc, sys, time
sys.path.append(sys.argv[3])
gc.disable()  # its pauses land wherever an allocation crosses a threshold
from stagetree.scheduler import core
from stagetree.tools.simulate import simulate

spent = [0.0]
real = core.Scheduler.handle_all

def handle_all(self, events):
    began = time.thread_time()
    try:
        return real(self, events)
    finally:
        spent[0] += time.thread_time() - began

core.Scheduler.handle_all = handle_all
kind, size = sys.argv[1], int(sys.argv[2])
if kind == "random":
    from stagetree.distributions import LogUniform
    from stagetree.hp import Constant
    from stagetree.space import RandomSpace
    from stagetree.tuners import RandomSearch

    space = RandomSpace(hp={"lr": Constant(LogUniform(1e-4, 1.0))})
    simulate(space, RandomSearch(space, "loss", mode="min", steps=4, num_trials=size, seed=0),
             workers=2)
    trials = size
else:
    import study_bench
    from stagetree.tuners import GridSearch

    space, steps = study_bench.lr_space(False, 1)
    for _ in range(size):
        simulate(space, GridSearch(space, "accuracy", mode="max", steps=steps), workers=2)
    trials = size * len(list(space))
print(spent[0] / trials * 1e6)
"""


def run(path: str, kind: str, size: int) -> float:
    """Scheduler CPU microseconds per trial of one study in a fresh process."""
    root = os.path.abspath(path)
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(  # from the checkout's root: ``-c`` imports from there first
        [sys.executable, "-c", CHILD, kind, str(size), here],
        env={**os.environ, "PYTHONPATH": root},
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{path} {kind} {size} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--random", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument("--grid", type=int, default=20, help="grid studies per process")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    checkouts = [c.split("=", 1) for c in args.checkout]
    cases = [("random", n) for n in args.random] + [("grid", args.grid)]
    print("scheduler CPU per trial, us (median of runs; runs in brackets)")
    for kind, size in cases:
        got: dict[str, list[float]] = {name: [] for name, _ in checkouts}
        for _ in range(args.repeats):
            for name, path in checkouts:
                got[name].append(run(path, kind, size))
        label = f"{kind} {size}" if kind == "random" else f"grid x{size}"
        cells = [
            f"{name} {statistics.median(v):.1f} [{' '.join(f'{x:.1f}' for x in v)}]"
            for name, v in got.items()
        ]
        first = statistics.median(got[checkouts[0][0]])
        ratios = [f"{statistics.median(v) / first:.2f}" for v in list(got.values())[1:]]
        print(f"{label:<12} " + " | ".join(cells) + f" | ratio {' '.join(ratios)}", flush=True)


if __name__ == "__main__":
    main()
