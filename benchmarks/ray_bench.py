"""The Ray executor against the local one: start-up, per-step overhead, a whole study.

Prints markdown tables (and writes a plot with ``--plot PATH``):

* start-up: seconds from building the executor to every worker's ``WorkerReady``
  (local processes; Ray actors on a running one-machine Ray; and the Ray start itself);
* per-step framework overhead inside a worker, with a trainer whose ``train()`` does
  nothing (the median interval between ``train()`` calls, measured in the worker):
  ``Worker.run`` in this process (the floor of the worker loop), a local worker
  process, a Ray actor;
* the same study (a grid of digits trials sharing prefixes, ``GridSearch``) on 2 local
  worker processes, 2 Ray actors on one Ray node, and 2 Ray actors on two Ray nodes
  (``ray.cluster_utils.Cluster``: a head without CPUs and two 1-CPU nodes, workers
  pinned by custom resources): wall-clock of ``study.tune``, executed and unique steps.

Goals (issue 9): per-step overhead on Ray within 2x of local; the Ray study within 1.3x
of the local one's wall-clock at equal workers.

Run: ``.venv/bin/python benchmarks/ray_bench.py [--steps N] [--repeats R] [--plot PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bar_plot, fmt, load_average, machine_info, markdown_table
from overhead_bench import HP_NONE, _batch, via_local_executor, via_worker

from stagetree import Study
from stagetree.executors import LocalExecutor
from stagetree.executors.base import BaseExecutor
from stagetree.executors.ray import RayExecutor
from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.space import GridSpace
from stagetree.torch.examples import DigitsTrainer
from stagetree.tuners import GridSearch
from stagetree.work import BatchDone, MetricsReported, WorkerReady

NOOP = str(Path(__file__).resolve().parent / "overhead_bench.py") + ":NoOpTrainer"
_perf = time.perf_counter


def _ready(ex: BaseExecutor, n: int, timeout: float = 300.0) -> None:
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("workers did not start")
        seen |= {e.worker for e in ex.events(timeout=1.0) if isinstance(e, WorkerReady)}


def _run_batch(ex: BaseExecutor, batch_id: int, steps: int) -> dict[str, float]:
    ex.submit(_batch(batch_id, steps, HP_NONE))
    metrics: Any = None
    while True:
        for event in ex.events(timeout=60):
            if isinstance(event, MetricsReported):
                metrics = event.metrics
            if isinstance(event, BatchDone):
                return dict(metrics)


def startup_and_overhead(steps: int, repeats: int) -> tuple[list[Any], list[Any]]:
    import ray

    startup: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        begin = _perf()
        local = LocalExecutor(NOOP, 2, checkpoint_dir=tmp, devices=[], threads_per_worker=1)
        local.start()
        _ready(local, 2)
        startup.append(("local: 2 worker processes", _perf() - begin))
        per_local = [via_local_executor(local, i, steps, HP_NONE) for i in range(repeats)]
        local.close()

        begin = _perf()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        startup.append(("ray.init (one-machine Ray, once per cluster)", _perf() - begin))
        begin = _perf()
        actors = RayExecutor(NOOP, 2, checkpoint_dir=tmp, worker_resources={"CPU": 1})
        actors.start()
        _ready(actors, 2)
        startup.append(("ray: 2 worker actors", _perf() - begin))
        per_ray = [_run_batch(actors, i, steps) for i in range(repeats)]
        actors.close()
        ray.shutdown()
    floor = [via_worker(steps, HP_NONE) for _ in range(repeats)]
    overhead = []
    for name, runs in (
        ("Worker.run in this process (floor)", floor),
        ("LocalExecutor worker process", per_local),
        ("RayExecutor actor", per_ray),
    ):
        overhead.append(
            (
                name,
                statistics.median(r["median_us"] for r in runs),
                statistics.median(r["mean_us"] for r in runs),
            )
        )
    return startup, overhead


def study_space() -> GridSpace:
    return GridSpace(
        hp={
            "lr": [Constant(0.1), MultiStep(0.1, [4], 0.5), MultiStep(0.1, [8], 0.5)],
            "batch_size": [32, Piecewise([32, 64], [6])],
        },
        fixed={"hidden": [64], "batches_per_step": [6], "seed": [0]},
    )


def run_study(executor: Any, root: Path, steps: int) -> dict[str, Any]:
    study = Study(
        "bench",
        DigitsTrainer,
        storage=f"sqlite:///{root / 'plan.db'}",
        checkpoint_dir=root / "ckpt",
        workers=2,
        threads_per_worker=1,
        executor=executor,
    )
    try:
        begin = _perf()
        study.open()
        study._engine.ensure_started()
        assert study._engine.executor is not None
        _ready_through_engine(study)
        started = _perf() - begin
        load = load_average()
        begin = _perf()
        study.tune(GridSearch(study_space(), "accuracy", "max", steps=steps))
        wall = _perf() - begin
        stats = study.stats()
    finally:
        study.close()
    return {
        "startup": started,
        "wall": wall,
        "executed": stats["steps_executed"],
        "unique": stats["steps_unique"],
        "requested": stats["steps_requested"],
        "load": load,
    }


def _ready_through_engine(study: Study) -> None:
    """Wait until the engine's scheduler knows every worker (its driver thread takes
    the executor's events)."""
    deadline = time.monotonic() + 300
    while len(study._engine.scheduler._workers) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("workers did not start")
        time.sleep(0.05)


def studies(steps: int, repeats: int) -> list[dict[str, Any]]:
    import ray
    from ray.cluster_utils import Cluster

    rows: list[dict[str, Any]] = []

    def measure(label: str, make: Any) -> None:
        runs = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_study(make(), Path(tmp), steps))
        rows.append({"setup": label, **{k: _med(runs, k) for k in runs[0] if k != "load"}})
        rows[-1]["load"] = runs[-1]["load"]

    measure("local: 2 processes", lambda: "local")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        measure("ray: 1 node, 2 actors", lambda: RayExecutor(worker_resources={"CPU": 1}))
    finally:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=1, resources={"node_a": 1})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        measure(
            "ray: 2 nodes, 1 actor each",
            lambda: RayExecutor(
                worker_resources=[{"CPU": 1, "node_a": 1}, {"CPU": 1, "node_b": 1}]
            ),
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def _med(runs: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in runs]
    return statistics.median(values) if isinstance(values[0], (int, float)) else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="no-op steps per batch")
    parser.add_argument("--study-steps", type=int, default=12, help="steps per study trial")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    args = parser.parse_args(argv)
    info = machine_info()
    print(f"machine: {info}\n")

    startup, overhead = startup_and_overhead(args.steps, args.repeats)
    print("### Start-up\n")
    print(markdown_table(["what", "seconds"], startup))
    floor = overhead[0][1]
    local = overhead[1][1]
    print(f"\n### Per-step overhead ({args.steps} no-op steps x {args.repeats})\n")
    print(
        markdown_table(
            ["path", "median us", "over floor us", "mean us", "x local"],
            [
                (n, med, med - floor, mean, med / local if local else None)
                for n, med, mean in overhead
            ],
        )
    )
    ray_med = overhead[2][1]
    print(
        f"\ngoal: Ray per-step overhead within 2x of local: {ray_med / local:.2f}x -> "
        f"{'met' if ray_med <= 2 * local else 'missed'}"
    )

    rows = studies(args.study_steps, args.repeats)
    base = rows[0]["wall"]
    print(f"\n### The same study ({args.study_steps} steps per trial, 2 workers)\n")
    print(
        markdown_table(
            ["setup", "wall s", "x local", "worker start-up s", "executed", "unique", "requested"],
            [
                (
                    r["setup"],
                    r["wall"],
                    r["wall"] / base,
                    r["startup"],
                    int(r["executed"]),
                    int(r["unique"]),
                    int(r["requested"]),
                )
                for r in rows
            ],
        )
    )
    for r in rows[1:]:
        ratio = r["wall"] / base
        print(
            f"goal: {r['setup']} within 1.3x of local: {ratio:.2f}x -> "
            f"{'met' if ratio <= 1.3 else 'missed'} (load {r['load']})"
        )
    if args.plot:
        bar_plot(
            args.plot,
            [
                ("start-up", [s for s, _ in startup], [v for _, v in startup], "seconds"),
                (
                    "per-step overhead",
                    [n for n, _, _ in overhead],
                    [m for _, m, _ in overhead],
                    "median us / step",
                ),
                ("study wall-clock", [r["setup"] for r in rows], [r["wall"] for r in rows], "s"),
            ],
            "RayExecutor vs LocalExecutor",
            notes={1: [fmt(m, 1) for _, m, _ in overhead]},
        )
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
