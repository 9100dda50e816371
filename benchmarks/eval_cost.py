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

A second table times ``train()`` and ``evaluate()`` of the demo's trainer in this
process, interleaved (one thread, median per call): their ratio is what evaluating
every step adds to each step, and it is far less sensitive to a busy machine than the
end-to-end runs.

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
    with (
        tempfile.TemporaryDirectory() as tmp,
        Study(
            f"eval-cost-{eval_every}",
            DigitsTrainer,
            storage=f"sqlite:///{tmp}/plan.db",
            workers=workers,
            eval_every=eval_every,
        ) as study,
    ):
        begin = time.perf_counter()
        study.tune(GridSearch(mod.space, "accuracy", steps=mod.MAX_STEPS))
        wall = time.perf_counter() - begin
        stats = study.stats()
        points = sum(1 for t in study.trials() for m in t.metrics.values() if "accuracy" in m)
    return {
        "wall": wall,
        "device": stats["device_seconds"],
        "steps": stats["steps_executed"],
        "points": float(points),
    }


def per_call(steps: int) -> tuple[float, float]:
    """Median seconds of one ``train()`` and one ``evaluate()`` of the demo trainer."""
    from stagetree.torch import deterministic

    mod = demo()
    spec = next(iter(mod.space))
    config, hp = spec.config, spec.hp
    train: list[float] = []
    evaluate: list[float] = []
    with deterministic(threads=1):
        trainer = DigitsTrainer(config)
        trainer.setup({name: seq(0) for name, seq in hp.items()})
        for _ in range(steps):
            begin = time.perf_counter()
            trainer.train()
            middle = time.perf_counter()
            trainer.evaluate()
            train.append(middle - begin)
            evaluate.append(time.perf_counter() - middle)
    t, e = median(train), median(evaluate)
    assert t is not None and e is not None
    return t, e


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50, help="steps of the per-call timing")
    args = parser.parse_args()

    train_s, eval_s = per_call(args.calls)

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
    print()
    print(
        markdown_table(
            ["one call (demo trainer, 1 thread)", "ms"],
            [["train() (8 minibatches of 64)", 1000 * train_s], ["evaluate()", 1000 * eval_s]],
        )
    )
    print()
    print(f"evaluate() / train(): {fmt(100 * eval_s / train_s, 1)} %")


if __name__ == "__main__":
    main()
