"""Re-running a finished study: what a script costs when every trial is answered from
the storage, against its first run.

Each run is a fresh Python process (``--child``) that imports stagetree and a trainer,
opens a study on a SQLite file, tunes an ASHA grid with 2 local workers and closes the
study (``with study:``); the second process on the same file trains nothing. The child
times its phases with ``time.perf_counter``; the parent times the whole process, so
"exit" is what the interpreter's exit took after the script's last line (atexit hooks,
worker processes stopping). Medians over ``--repeats`` fresh storages.

Run: ``python benchmarks/rerun_bench.py [--repeats 3] [--trainer numpy|digits]
[--no-close]`` (``--no-close``: the script calls ``study.tune()`` without ``with
study:``, and the engine is closed at exit; ``digits``: the PyTorch digits trainer, as in
``examples/digits.py``).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before any import: the child's imports are timed from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

PHASES = ("imports", "study", "tune", "close", "exit", "total")


def _child(directory: str, trainer_name: str, close: bool) -> None:
    import numpy as np

    from stagetree import Study, Trainer
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import ASHA

    class LinearTrainer(Trainer):
        """SGD on a small generated linear regression (a step costs microseconds)."""

        def __init__(self, config: Mapping[str, Any]) -> None:
            super().__init__(config)
            rng = np.random.default_rng(int(config["seed"]))
            self.x = rng.normal(size=(64, 4))
            self.y = self.x @ np.array([1.0, -2.0, 0.5, 3.0])
            self.w = np.zeros(4)
            self.lr = 0.01

        def setup(self, hp: Mapping[str, Any]) -> None:
            self.lr = float(hp["lr"])

        def train(self) -> dict[str, float]:
            self.w = self.w - self.lr * 2 * self.x.T @ (self.x @ self.w - self.y) / 64
            return {}

        def evaluate(self) -> dict[str, float]:
            return {"score": -float(np.mean((self.x @ self.w - self.y) ** 2))}

        def state_dict(self) -> dict[str, Any]:
            return {"w": self.w.copy()}

        def load_state_dict(self, state: Mapping[str, Any]) -> None:
            self.w = np.array(state["w"])

    trainer: Any = LinearTrainer
    lrs = [0.003, 0.01, 0.03, 0.1]
    fixed: dict[str, list[Any]] = {"seed": [0, 1]}
    metric = "score"
    if trainer_name == "digits":
        from stagetree.torch.examples import DigitsTrainer

        trainer, metric = DigitsTrainer, "accuracy"
        fixed.update(hidden=[16], batches_per_step=[1])
    imported = time.perf_counter()
    space = GridSpace({"lr": [Constant(lr) for lr in lrs]}, fixed=fixed)
    tuner = ASHA(
        space, metric, mode="max", min_steps=1, max_steps=8, eta=2, num_trials=len(space), seed=0
    )
    url = f"sqlite:///{os.path.join(directory, 'plan.db')}"
    study = Study("rerun", trainer, storage=url, workers=2)
    opened = time.perf_counter()
    study.tune(tuner, progress=False)
    tuned = time.perf_counter()
    if close:
        study.close()
    closed = time.perf_counter()
    times = {
        "imports": imported - _T0,
        "study": opened - imported,
        "tune": tuned - opened,
        "close": closed - tuned,
        "script": closed - _T0,
        "ended_at": time.time(),  # the wall clock, which the parent shares
    }
    print(json.dumps(times), flush=True)


def _run(directory: str, trainer: str, close: bool) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", directory, "--trainer", trainer]
    if not close:
        cmd.append("--no-close")
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    total, exited = time.perf_counter() - started, time.time()
    times: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    times["exit"] = max(0.0, exited - times.pop("ended_at"))
    # The interpreter's start, before the child's first line, counts as imports.
    times["imports"] += max(0.0, total - times.pop("script") - times["exit"])
    times["total"] = total
    return times


def _row(name: str, runs: list[dict[str, float]]) -> str:
    cells = [f"{statistics.median(r[p] for r in runs):.2f}" for p in PHASES]
    beyond = statistics.median(r["total"] - r["imports"] for r in runs)
    return f"| {name} | " + " | ".join(cells) + f" | {beyond:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer", choices=("numpy", "digits"), default="numpy")
    parser.add_argument("--no-close", action="store_true")
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.trainer, not args.no_close)
        return
    first: list[dict[str, float]] = []
    again: list[dict[str, float]] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as directory:
            first.append(_run(directory, args.trainer, not args.no_close))
            again.append(_run(directory, args.trainer, not args.no_close))
    how = "tune() without close" if args.no_close else "with study:"
    print(f"trainer {args.trainer}, 2 workers, {how}; seconds, medians of {args.repeats}")
    print("| run | " + " | ".join(PHASES) + " | beyond imports |")
    print("|---|" + "---:|" * (len(PHASES) + 1))
    print(_row("first run", first))
    print(_row("re-run", again))


if __name__ == "__main__":
    main()
