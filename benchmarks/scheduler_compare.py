"""Scheduling policies compared in the virtual-time simulator: critical path (Hippo),
BFS and THR (most children first), stage-based, 40 simulated workers.

Studies (see ``benchmarks/paper_studies.py`` for the spaces and cost models):

* grid: the ResNet-56 example grid (``examples/resnet56_space.py``, 120 trials of
  120 epochs), every trial submitted at once;
* ASHA: ResNet-56, 448 trials, reduction 4, 15 to 120 epochs;
* with ``--large``, also the extended ResNet-56 grid, 672 trials of 120 epochs (about
  two minutes: the scheduler rebuilds a stage tree of up to 672 requests for every
  decision).

Columns: makespan (hours), device-hours, makespan / lower bound, executed / unique
steps, batches and checkpoint loads.

Run: ``python benchmarks/scheduler_compare.py [--workers 40] [--large] [--plot PNG]`` (the plot
goes to ``benchmarks/out/scheduler_compare.png`` by default; it needs matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_studies import OUT, WORKERS, _asha, _resnet_options, resnet56_space  # noqa: E402

from stagetree.simulate import SimResult, format_table, simulate  # noqa: E402
from stagetree.space import GridSpace  # noqa: E402
from stagetree.tuners import GridSearch, Tuner  # noqa: E402

POLICIES = ("critical_path", "bfs", "thr")


def studies(large: bool = False) -> list[tuple[str, Callable[[], Tuner]]]:
    example: GridSpace = runpy.run_path(str(ROOT / "examples" / "resnet56_space.py"))["space"]
    extended = resnet56_space()
    out: list[tuple[str, Callable[[], Tuner]]] = [
        ("grid (ResNet-56, 120)", lambda: GridSearch(example, "accuracy", steps=120)),
        ("ASHA (ResNet-56, 448)", lambda: _asha(extended, 448, 0)),
    ]
    if large:
        out.insert(
            1, ("grid (ResNet-56, 672)", lambda: GridSearch(extended, "accuracy", steps=120))
        )
    return out


def run(workers: int, large: bool = False) -> list[tuple[str, str, SimResult, float]]:
    rows = []
    for name, make in studies(large):
        for policy in POLICIES:
            begin = time.perf_counter()
            result = simulate(None, make(), workers, True, policy=policy, **_resnet_options())
            seconds = time.perf_counter() - begin
            rows.append((name, policy, result, seconds))
            print(f"  {name} {policy}: {seconds:.1f} s", file=sys.stderr)
    return rows


def table(rows: Sequence[tuple[str, str, SimResult, float]]) -> str:
    headers = [
        "study",
        "policy",
        "makespan h",
        "device-h",
        "makespan/LB",
        "executed/unique",
        "batches",
        "ckpt loads",
        "real s",
    ]
    return format_table(
        headers,
        [
            [
                name,
                policy,
                r.makespan_hours,
                r.device_hours,
                r.bound_ratio,
                f"{r.steps_executed}/{r.steps_unique}",
                int(r.stats["batches"]),
                int(r.stats["ckpt_loads"]),
                round(seconds, 1),
            ]
            for name, policy, r, seconds in rows
        ],
    )


def plot(rows: Sequence[tuple[str, str, SimResult, float]], path: str) -> bool:
    """Makespan and device-hours per study, one bar per policy."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: skipping the plot {path}", file=sys.stderr)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for name, *_ in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    for ax, (label, value) in zip(
        axes,
        (
            ("makespan (h)", lambda r: r.makespan_hours),
            ("device-hours", lambda r: r.device_hours),
        ),
    ):
        for i, policy in enumerate(POLICIES):
            values = [
                next(value(r) for nm, p, r, _s in rows if nm == n and p == policy) for n in names
            ]
            ax.bar([j + (i - 1) * width for j in range(len(names))], values, width, label=policy)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"Scheduling policies, {rows[0][2].workers} simulated workers")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--plot", default=str(OUT / "scheduler_compare.png"), help="PNG to write")
    parser.add_argument("--large", action="store_true", help="also the 672-trial grid")
    args = parser.parse_args(argv)
    rows = run(args.workers, args.large)
    print(table(rows))
    if plot(rows, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
