"""Scheduling policies compared in the virtual-time simulator: critical path (Hippo),
critical path without batching, BFS and THR (most children first), stage-based, 40
simulated workers.

The TreeML thesis compared them on ResNet-20 (learning rate and batch size as
sequences, merge rate 3.55) with critical path *without batching* (one stage per
decision, as BFS and THR take, for fairness) and found critical path 1.27x faster than
THR on ASHA and similar on grid search. Studies here
(``benchmarks/paper_spaces.treeml_space``, 147 trials, p = 3.54; cost model of
``benchmarks/paper_studies.py``'s ResNet-20):

* grid: every trial trained to 120 epochs, all submitted at once;
* ASHA: the same 147 trials, reduction 4, 15 to 120 epochs;
* with ``--large``, also ASHA on the ResNet-56 space (448 trials, p = 2.45).

Policies: ``critical_path`` (the product's: the longest remaining path, whole, as one
batch), ``critical_path_unbatched`` (its first stage only: the thesis's setting),
``bfs``, ``thr``.

Columns: makespan (hours), device-hours, makespan / lower bound, makespan / tree-depth
bound (grids: ``paper_studies.depth_bound``, which sees that no step starts before the
steps above it), executed / unique steps, batches and checkpoint loads; "vs thr": THR's
makespan / the policy's.

Run: ``python benchmarks/scheduler_compare.py [--workers 40] [--large] [--plot PNG]`` (the plot
goes to ``benchmarks/out/scheduler_compare.png`` by default; it needs matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_spaces import resnet56_space, treeml_space  # noqa: E402
from paper_studies import (  # noqa: E402
    OUT,
    WORKERS,
    _asha,
    _resnet20_options,
    _resnet_options,
    depth_bound,
)

from stagetree.scheduler.policies import BasePolicy, make_policy  # noqa: E402
from stagetree.stages import Stage, StageTree, critical_path  # noqa: E402
from stagetree.tools.simulate import SimResult, format_table, simulate  # noqa: E402
from stagetree.tuners import GridSearch, Tuner  # noqa: E402


class UnbatchedCriticalPath(BasePolicy):
    """Critical path without batching: the first stage of the longest remaining path
    (one stage per decision, as BFS and THR; the thesis's fair comparison)."""

    name = "critical_path_unbatched"

    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        return critical_path(tree, roots)[:1]


POLICIES = ("critical_path", "critical_path_unbatched", "bfs", "thr")


def _policy(name: str) -> BasePolicy:
    return UnbatchedCriticalPath() if name == UnbatchedCriticalPath.name else make_policy(name)


def studies(large: bool = False) -> list[tuple[str, Callable[[], Tuner], dict[str, Any]]]:
    space = treeml_space()
    n = len(space)
    out: list[tuple[str, Callable[[], Tuner], dict[str, Any]]] = [
        (f"grid (ResNet-20, {n})", lambda: GridSearch(space, "accuracy", steps=120),
         _resnet20_options()),
        (f"ASHA (ResNet-20, {n})", lambda: _asha(space, n, 0), _resnet20_options()),
    ]  # fmt: skip
    if large:
        resnet = resnet56_space()
        out.append(("ASHA (ResNet-56, 448)", lambda: _asha(resnet, 448, 0), _resnet_options()))
    return out


DEPTH: dict[str, float] = {}  # study -> paper_studies.depth_bound of its grid


def run(workers: int, large: bool = False) -> list[tuple[str, str, SimResult, float]]:
    rows = []
    for name, make, options in studies(large):
        grid = make()
        if isinstance(grid, GridSearch):  # the tree's shape bounds a grid's makespan
            trials = list(grid.space)
            DEPTH[name] = depth_bound(trials, grid.steps, options["step_cost"], workers, 1.0)
        for policy in POLICIES:
            begin = time.perf_counter()
            chosen: Any = _policy(policy)  # simulate() passes a policy instance through
            result = simulate(None, make(), workers, True, policy=chosen, **options)
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
        "makespan/depth bound",
        "vs thr",
        "executed/unique",
        "batches",
        "ckpt loads",
        "real s",
    ]
    thr = {name: r.makespan for name, policy, r, _s in rows if policy == "thr"}
    return format_table(
        headers,
        [
            [
                name,
                policy,
                r.makespan_hours,
                r.device_hours,
                r.bound_ratio,
                round(r.makespan / DEPTH[name], 2) if name in DEPTH else "-",
                round(thr[name] / r.makespan, 2) if name in thr else "-",
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
    width = 0.2
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
            ax.bar([j + (i - 1.5) * width for j in range(len(names))], values, width, label=policy)
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
