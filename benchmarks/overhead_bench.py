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
"""

from __future__ import annotations

import argparse
import itertools
import statistics
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
    args = parser.parse_args()
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
