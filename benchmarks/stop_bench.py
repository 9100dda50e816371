"""Clean stops: what a stop loses and how long it takes (issue 23, item 6).

Three runs, each a fresh Python process (the script itself, ``--case NAME``), on a grid
of 3 trials x ``--steps`` steps of 20 ms (2 local workers unless said otherwise):

* ``budget``: ``tune(budget="20 steps")``, then a run without a budget;
* ``ctrl-c``: SIGINT once 30 steps were trained, then a run to the end; ``ctrl-c
  inline`` the same with the inline executor and 3000-step trials (a batch far longer
  than the stop; no second run);
* ``hung``: a trainer whose ``train()`` never returns, ``tune(budget="2s")``.

Printed: steps trained by the two runs, how many of them twice, and the seconds from the
signal (or the start of ``tune()``) to the process's exit. Run it with ``PYTHONPATH``
set to the checkout to measure.

Usage: ``python benchmarks/stop_bench.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FAKES = Path(__file__).resolve().parent.parent / "tests" / "fakes"
sys.path.insert(0, str(FAKES))

from failing_trainers import Counter  # noqa: E402  (tests/fakes)

from stagetree import Study  # noqa: E402
from stagetree.hp import Constant  # noqa: E402
from stagetree.space import GridSpace  # noqa: E402
from stagetree.tuners import GridSearch  # noqa: E402

LOG_ENV = "STAGETREE_STOP_LOG"


class StepTrainer(Counter):
    """The tests' ``Counter`` with 20 ms steps; appends ``lr:step`` to
    ``$STAGETREE_STOP_LOG`` at every ``train()``; never returns from ``train()`` at step
    ``config["hang_at"]`` when it is set."""

    def train(self) -> None:
        if self.config.get("hang_at") == self.t:
            time.sleep(3600)
        time.sleep(0.02)
        with open(os.environ[LOG_ENV], "a") as fh:
            fh.write(f"{self.lr}:{self.t}\n")
        super().train()


def _run(db: str, executor: str, steps: int, budget: str | None, hang: bool) -> None:
    """One run (a child process): tune the grid."""
    fixed: dict[str, list[Any]] = {"hang_at": [2]} if hang else {}
    space = GridSpace({"lr": [Constant(v) for v in (0.01, 0.02, 0.03)]}, fixed=fixed)
    workers = 2 if executor == "local" else None
    study = Study(
        "stop", StepTrainer, storage=f"sqlite:///{db}", workers=workers, executor=executor
    )
    print("TUNING", flush=True)
    study.tune(GridSearch(space, "w", steps=steps), budget=budget, progress=False)
    study.close()


def _steps(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _child(tmp: Path, case: str, executor: str, steps: int, budget: str = "") -> list[str]:
    return [
        sys.executable,
        __file__,
        "--case",
        case,
        "--db",
        str(tmp / "plan.db"),
        "--executor",
        executor,
        "--steps",
        str(steps),
        "--budget",
        budget,
    ]


def measure(case: str, executor: str, steps: int) -> str:
    with tempfile.TemporaryDirectory(prefix="stagetree-stop-") as name:
        tmp = Path(name)
        log = tmp / "trained.log"
        # The workers import the trainer's base class from tests/fakes too.
        path = os.pathsep.join(filter(None, (str(FAKES), os.environ.get("PYTHONPATH"))))
        env = {**os.environ, LOG_ENV: str(log), "PYTHONPATH": path}
        budget = {"budget": "20 steps", "hung": "2s"}.get(case, "")
        command = _child(tmp, case, executor, steps, budget)
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert proc.stdout is not None
        proc.stdout.readline()
        begin = time.monotonic()
        if case == "ctrl-c":
            while len(_steps(log)) < 30:
                time.sleep(0.02)
            begin = time.monotonic()
            proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=600)
        stop = time.monotonic() - begin
        first = len(_steps(log))
        both = twice = "-"
        if case != "hung" and steps <= 100:  # the second run trains what is left
            rerun = _child(tmp, case, executor, steps)
            subprocess.run(rerun, env=env, stdout=subprocess.DEVNULL, check=True, timeout=600)
            trained = _steps(log)
            both, twice = str(len(trained)), str(len(trained) - len(set(trained)))
        what = "tune() to exit" if case != "ctrl-c" else "signal to exit"
        return (
            f"| {case} | {executor} | {steps} | {first} | {both} | {twice} | {stop:.1f} ({what}) |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--executor", default="local", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=60, help=argparse.SUPPRESS)
    p.add_argument("--budget", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        _run(args.db, args.executor, args.steps, args.budget or None, args.case == "hung")
        return 0
    print(f"load {os.getloadavg()[0]:.1f}")
    print("| case | executor | steps/trial | first run | both runs | twice | seconds |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for case, executor, steps in [
        ("budget", "local", 60),
        ("ctrl-c", "local", 60),
        ("ctrl-c", "inline", 3000),
        ("hung", "local", 10),
    ]:
        print(measure(case, executor, steps), flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
