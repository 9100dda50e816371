"""Benchmark of the search plan: inserting a grid of trials into a SQLite plan.

Run ``python benchmarks/plan_bench.py [--trials N] [--batch B]``; prints the command
and a markdown table. Each measurement is one function returning a row of columns, so
a new column (e.g. the stage-tree build time) is one more function in ``MEASUREMENTS``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import shlex
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stagetree.hp import Constant, MultiStep, Piecewise, Sequence
from stagetree.plan import SQLPlanStorage

STEPS = 120
ROOT = "bench"

Trial = tuple[dict[str, Sequence], int]


def grid_trials(n: int) -> list[Trial]:
    """``n`` distinct trials of a grid (lr x batch size x momentum) with many shared
    prefixes: every lr is 0.1 until step 30, momenta switch at distinct milestones."""
    lrs: list[Sequence] = [Constant(0.1)] + [
        MultiStep(0.1, [m], g) for m in (30, 60, 90) for g in (0.1, 0.2, 0.5)
    ]
    batches: list[Sequence] = [Constant(32), Constant(64)] + [
        Piecewise([32, 64], [b]) for b in (40, 80)
    ]
    per_momentum = max(1, -(-n // (len(lrs) * len(batches))))
    switch = [5 + (i * 7) % 110 for i in range(per_momentum)]  # distinct-ish milestones
    momenta: list[Sequence] = [
        Piecewise([0.9, round(0.5 + 0.001 * i, 3)], [switch[i]]) for i in range(per_momentum)
    ]
    grid = itertools.product(lrs, batches, momenta)
    return [({"lr": lr, "batch_size": bs, "momentum": mom}, STEPS) for lr, bs, mom in grid][:n]


@dataclass
class Context:
    """What measurements share: the trials, options and results so far."""

    trials: list[Trial]
    batch: int
    tmpdir: str
    row: dict[str, Any] = field(default_factory=dict)


def _insert_all(ctx: Context, path: str) -> SQLPlanStorage:
    plan = SQLPlanStorage(f"sqlite:///{path}")
    for i in range(0, len(ctx.trials), ctx.batch):
        plan.insert_trials(ROOT, ctx.trials[i : i + ctx.batch])
    return plan


def measure_insert(ctx: Context) -> dict[str, Any]:
    """Throughput of ``insert_trials`` in batches into a fresh SQLite file."""
    path = tmpdir_file(ctx, "insert")
    start = time.perf_counter()
    plan = _insert_all(ctx, path)
    seconds = time.perf_counter() - start
    nodes = len(plan.nodes(ROOT))
    requests = len(plan.requests(ROOT))
    plan.close()
    return {
        "trials": len(ctx.trials),
        "batch": ctx.batch,
        "nodes": nodes,
        "requests": requests,
        "insert s": f"{seconds:.2f}",
        "trials/s": f"{len(ctx.trials) / seconds:,.0f}",
    }


def measure_reinsert(ctx: Context) -> dict[str, Any]:
    """Throughput of inserting the same trials again in a fresh process-level cache
    (a second storage object): every trial is found, none is created."""
    path = tmpdir_file(ctx, "insert")
    plan = SQLPlanStorage(f"sqlite:///{path}")
    start = time.perf_counter()
    for i in range(0, len(ctx.trials), ctx.batch):
        plan.insert_trials(ROOT, ctx.trials[i : i + ctx.batch])
    seconds = time.perf_counter() - start
    plan.close()
    return {"re-insert trials/s": f"{len(ctx.trials) / seconds:,.0f}"}


def measure_stage_tree(ctx: Context) -> dict[str, Any]:
    """Seconds to build the stage tree over every pending request of the plan (one per
    trial), as the scheduler does on each decision: best of three."""
    from stagetree.stages import bench_build

    plan = SQLPlanStorage(f"sqlite:///{tmpdir_file(ctx, 'insert')}")
    best = min(bench_build(plan, [ROOT]) for _ in range(3))
    plan.close()
    return {"stage tree s": f"{best:.3f}"}


def measure_memory(ctx: Context) -> dict[str, Any]:
    """Peak Python allocations (tracemalloc) while inserting into a fresh file, and the
    process's peak resident set size."""
    tracemalloc.start()
    plan = _insert_all(ctx, tmpdir_file(ctx, "traced"))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    plan.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"peak alloc MiB": f"{peak / 2**20:.1f}", "peak RSS MiB": f"{rss:.0f}"}


def tmpdir_file(ctx: Context, name: str) -> str:
    return os.path.join(ctx.tmpdir, f"{name}.db")


MEASUREMENTS: list[Callable[[Context], dict[str, Any]]] = [
    measure_insert,
    measure_reinsert,
    measure_stage_tree,
    measure_memory,
]


def markdown(rows: list[dict[str, Any]]) -> str:
    """Rows (dicts with the same keys) as a markdown table."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=10_000, help="number of trials")
    parser.add_argument("--batch", type=int, default=1_000, help="trials per insert_trials")
    args = parser.parse_args(argv)
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    trials = grid_trials(args.trials)
    with tempfile.TemporaryDirectory() as tmpdir:
        ctx = Context(trials, args.batch, tmpdir)
        for measure in MEASUREMENTS:
            ctx.row.update(measure(ctx))
    print()
    print(markdown([ctx.row]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
