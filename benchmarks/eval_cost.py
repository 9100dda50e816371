"""What learning curves cost: the digits demo with ``evaluate()`` every step
(``Study(eval_every=1)``, the default) against evaluation at the requested steps only
(``eval_every=0``).

The study is the demo's (``examples/digits.py``: its search space, DigitsTrainer, two
workers), tuned by a grid search that trains every trial to the demo's 16 steps, so
that both settings train exactly the same steps (the table shows it). The two settings
run alternately, ``--repeats`` times each, on fresh storages; the table gives medians.

* ``wall s``: ``study.tune`` from start to end (worker start-up included, equal for
  both);
* ``device s``: the workers' busy seconds (``study.stats()["device_seconds"]``:
  training, evaluation, checkpoint capture and loads);
* ``curve points``: steps with ``evaluate()`` metrics over all trials' curves.

Run: ``.venv/bin/python benchmarks/eval_cost.py [--workers 2] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import fmt, machine_info, markdown_table, median

from stagetree import Study
from stagetree.torch.examples import DigitsTrainer
from stagetree.tuners import GridSearch

ROOT = Path(__file__).resolve().parent.parent


def demo() -> Any:
    """The demo module (its Study is inert until used; only its space is taken)."""
    spec = importlib.util.spec_from_file_location("digits_demo", ROOT / "examples" / "digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_once(eval_every: int, workers: int) -> dict[str, float]:
    mod = demo()
    with tempfile.TemporaryDirectory() as tmp:
        with Study(
            f"eval-cost-{eval_every}",
            DigitsTrainer,
            storage=f"sqlite:///{tmp}/plan.db",
            workers=workers,
            eval_every=eval_every,
        ) as study:
            begin = time.perf_counter()
            study.tune(GridSearch(mod.space, "accuracy", steps=mod.MAX_STEPS))
            wall = time.perf_counter() - begin
            stats = study.stats()
            points = sum(
                1 for t in study.trials() for m in t.metrics.values() if "accuracy" in m
            )
    return {
        "wall": wall,
        "device": stats["device_seconds"],
        "steps": stats["steps_executed"],
        "points": float(points),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    runs: dict[int, list[dict[str, float]]] = {1: [], 0: []}
    for i in range(args.repeats):
        for eval_every in (1, 0) if i % 2 == 0 else (0, 1):
            runs[eval_every].append(run_once(eval_every, args.workers))
            print(f"  run {i + 1}, eval_every={eval_every}: {runs[eval_every][-1]}", flush=True)

    def med(eval_every: int, key: str) -> float:
        value = median(r[key] for r in runs[eval_every])
        assert value is not None
        return value

    rows = []
    for eval_every, label in ((0, "requested steps only (eval_every=0)"), (1, "every step (1)")):
        rows.append(
            [
                label,
                int(med(eval_every, "steps")),
                int(med(eval_every, "points")),
                med(eval_every, "wall"),
                med(eval_every, "device"),
                med(eval_every, "device") / med(eval_every, "steps"),
            ]
        )
    info = machine_info()
    print()
    print(
        f"digits demo space, grid to 16 steps, {args.workers} workers, median of "
        f"{args.repeats}; {info['nproc']} cores ({info['cpu']}), load {info['load']}"
    )
    print()
    print(
        markdown_table(
            ["evaluate()", "steps", "curve points", "wall s", "device s", "device s/step"],
            rows,
        )
    )
    extra_wall = med(1, "wall") / med(0, "wall") - 1
    extra_device = med(1, "device") / med(0, "device") - 1
    print()
    print(
        f"evaluating every step: wall {fmt(100 * extra_wall, 1)} %, "
        f"device-seconds {fmt(100 * extra_device, 1)} %"
    )


if __name__ == "__main__":
    main()
