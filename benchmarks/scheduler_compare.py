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

Policies: ``critical_path`` (the product's: the longest remaining path as one batch,
up to its first branch point once the tree's depth bounds the study; see
``CriticalPathPolicy``), ``critical_path_unbatched`` (its first stage only: the thesis's
setting), ``bfs``, ``thr``; the matrix adds ``critical_path_whole`` (the whole path
always, the default before issue 25).

Columns: makespan (hours), device-hours, makespan / lower bound, makespan / tree-depth
bound (grids: ``paper_studies.depth_bound``, which sees that no step starts before the
steps above it), executed / unique steps, batches and checkpoint loads; "vs thr": THR's
makespan / the policy's.

Run: ``python benchmarks/scheduler_compare.py [--workers 40] [--large] [--plot PNG]`` (the plot
goes to ``benchmarks/out/scheduler_compare.png`` by default; it needs matplotlib).

Where the policy matters (``--matrix``): the thesis's studies at 40 workers leave the
policies nothing to choose (a few trunks bound the grid; ASHA has about as many pending
requests as workers). The matrix runs workloads that do leave a choice (few workers,
step costs that differ 16x with the batch size, deep trees that branch every few steps,
two studies on one pool), each over several seeds, and prints per workload the mean
makespan of each policy and the default's ratio to the best of BFS and THR (min, mean,
max over the seeds; above 1 the default is slower). ``--trace WORKLOAD,WORKERS,SEED``
(``,POLICY`` for another than the default) prints the decisions of the default and of
the best baseline side by side (when each worker started and ended which stages from
which model, and each worker's idle stretches), to see where the default falls behind.
``--known-costs`` gives the scheduler every step cost exactly instead of learning them
(what the policy does with right estimates).
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

from stagetree.distributions import Choice  # noqa: E402
from stagetree.executors.simulated import SimulatedExecutor, StepCost  # noqa: E402
from stagetree.hp import Constant, MultiStep, Piecewise  # noqa: E402
from stagetree.plan.model import Node  # noqa: E402
from stagetree.scheduler.cost import CostEstimator  # noqa: E402
from stagetree.scheduler.policies import BasePolicy, make_policy  # noqa: E402
from stagetree.space import GridSpace, RandomSpace  # noqa: E402
from stagetree.stages import Stage, StageTree, critical_path  # noqa: E402
from stagetree.tools.simulate import SimResult, format_table, simulate  # noqa: E402
from stagetree.tuners import ASHA, GridSearch, Hyperband, RandomSearch, Tuner  # noqa: E402
from stagetree.work import BatchDone, BatchFailed, RunBatch  # noqa: E402


class UnbatchedCriticalPath(BasePolicy):
    """Critical path without batching: the first stage of the longest remaining path
    (one stage per decision, as BFS and THR; the thesis's fair comparison)."""

    name = "critical_path_unbatched"

    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        return critical_path(tree, roots)[:1]


class WholeCriticalPath(BasePolicy):
    """The whole longest remaining path as one batch, whatever the workers (the default
    before it stopped at the first branch point in a depth-bound study)."""

    name = "critical_path_whole"

    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        return critical_path(tree, roots)


POLICIES = ("critical_path", "critical_path_unbatched", "bfs", "thr")
_EXTRA: dict[str, type[BasePolicy]] = {
    p.name: p for p in (UnbatchedCriticalPath, WholeCriticalPath)
}


def _policy(name: str) -> BasePolicy:
    return _EXTRA[name]() if name in _EXTRA else make_policy(name)


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


# ----------------------------------------------------------------- where the policy matters

DEEP_STEPS = 28
# Learning-rate decays every few steps and batch sizes 32-512 (a step at 32 costs 16x one
# at 512): a deep tree whose branches differ widely in cost.
_DEEP_LR = ([4], [4, 8], [4, 8, 12], [4, 8, 12, 16], [4, 8, 12, 16, 20], [8], [8, 16], [12],
            [12, 24], [16], [20])  # fmt: skip
_DEEP_BS = (Constant(32), Piecewise([32, 128], [6]), Piecewise([32, 512], [18]), Constant(512))


def _hetero() -> dict[str, Any]:
    """Seconds per step proportional to 1 / batch size (1 s at 128)."""
    return {"step_cost": StepCost(1.0, {"batch_size": (128.0, -1.0)})}


def deep_space() -> GridSpace:
    """44 trials in one plan tree, branching at steps 4, 6, 8, 12, 16, 18, 20, 24."""
    return GridSpace(
        hp={"lr": [MultiStep(0.1, m, 0.5) for m in _DEEP_LR], "batch_size": list(_DEEP_BS)},
        fixed={"wd": [1e-4]},
    )


def deep_random_space() -> RandomSpace:
    """The deep space drawn at random (a seed gives another subset of it)."""
    return RandomSpace(
        hp={
            "lr": MultiStep(
                init=0.1,
                milestones=Choice([list(m) for m in _DEEP_LR]),  # type: ignore[arg-type]
                gamma=0.5,
            ),
            "batch_size": Choice(list(_DEEP_BS)),
        },
        fixed={"wd": 1e-4},
    )


def shallow_space() -> GridSpace:
    """36 trials in 3 plan trees (the golden traces' grid): few branch points."""
    return GridSpace(
        hp={
            "lr": [MultiStep(0.1, [6], 0.1), MultiStep(0.1, [9], 0.1),
                   MultiStep(0.1, [6, 12], 0.1), Constant(0.1)],
            "batch_size": [Constant(128), Piecewise([128, 256], [4]),
                           Piecewise([128, 256], [10])],
        },
        fixed={"wd": [1e-4, 1e-3, 1e-2]},
    )  # fmt: skip


Make = Callable[[int], "Tuner | list[Tuner]"]
# name -> (tuner(s) from a seed, worker counts, simulator options)
WORKLOADS: dict[str, tuple[Make, tuple[int, ...], Callable[[], dict[str, Any]]]] = {
    "shallow grid (36)": (
        lambda seed: GridSearch(shallow_space(), "accuracy", steps=16), (3, 6, 8), dict),
    "shallow random (60)": (
        lambda seed: RandomSearch(shallow_space(), "accuracy", steps=16, num_trials=60,
                                  seed=seed), (3, 6), dict),
    "deep grid, costs 16x (44)": (
        lambda seed: GridSearch(deep_space(), "accuracy", steps=DEEP_STEPS), (4, 6, 8), _hetero),
    "deep random, costs 16x (40)": (
        lambda seed: RandomSearch(deep_random_space(), "accuracy", steps=DEEP_STEPS,
                                  num_trials=40, seed=seed), (4, 8), _hetero),
    "ASHA shallow (36)": (
        lambda seed: ASHA(shallow_space(), "accuracy", min_steps=2, max_steps=16, num_trials=36,
                          eta=2, seed=seed), (3, 8), dict),
    "Hyperband shallow (36)": (
        lambda seed: Hyperband(shallow_space(), "accuracy", min_steps=2, max_steps=16,
                               num_trials=36, seed=seed), (4, 8), dict),
    "ASHA ResNet-20 (147)": (
        lambda seed: _asha(treeml_space(), 147, seed), (8,), _resnet20_options),
    "two studies: grid + ASHA": (
        lambda seed: [GridSearch(shallow_space(), "accuracy", steps=16),
                      ASHA(shallow_space(), "accuracy", min_steps=2, max_steps=16,
                           num_trials=36, eta=2, seed=seed)], (4, 6, 8), dict),
}  # fmt: skip
MATRIX_POLICIES = ("critical_path", "critical_path_whole", "critical_path_unbatched", "bfs", "thr")
BASELINES = ("bfs", "thr")


KNOWN_COSTS = False  # --known-costs


def _simulate(workload: str, workers: int, seed: int, policy: str) -> SimResult:
    make, _workers, options = WORKLOADS[workload]
    chosen: Any = _policy(policy)
    opts = options()
    if not KNOWN_COSTS:
        return simulate(None, make(seed), workers, True, policy=chosen, **opts)
    # The scheduler predicts each node's step cost exactly (the simulator's own model at
    # the node's branch step) instead of learning it: what the policy does with right
    # estimates.
    step_cost = opts.get("step_cost") or StepCost()
    learnt = CostEstimator.cost

    def known(self: CostEstimator, node: Node) -> float:
        values = {n: q(node.branch_step) if callable(q) else q for n, q in node.hp.items()}
        return float(step_cost(self._roots.get(node.root_key, {}), values))

    CostEstimator.cost = known  # type: ignore[method-assign]
    try:
        return simulate(None, make(seed), workers, True, policy=chosen, **opts)
    finally:
        CostEstimator.cost = learnt  # type: ignore[method-assign]


# policy -> (makespan, what the tuner ran: steps requested, unique, executed) per seed
Spans = dict[str, list[tuple[float, tuple[int, int, int]]]]


def matrix(seeds: Sequence[int], only: Sequence[str] = ()) -> list[tuple[str, int, Spans]]:
    """Makespans (virtual seconds) and the steps the tuner ran per workload, worker count
    and policy, one per seed."""
    rows = []
    for name, (_make, counts, _options) in WORKLOADS.items():
        if only and name not in only:
            continue
        for workers in counts:
            spans: Spans = {p: [] for p in MATRIX_POLICIES}
            for seed in seeds:
                for policy in MATRIX_POLICIES:
                    r = _simulate(name, workers, seed, policy)
                    ran = (r.steps_requested, r.steps_unique, r.steps_executed)
                    spans[policy].append((r.makespan, ran))
            rows.append((name, workers, spans))
            print(f"  {name} W={workers}: done", file=sys.stderr)
    return rows


TIE = 0.005  # makespans within 0.5 % tie (a checkpoint load, a result's arrival order)


def matrix_table(rows: Sequence[tuple[str, int, Spans]]) -> str:
    """Mean makespan per policy; the default's ratio to the best baseline per seed; its
    wins, ties and losses, and of the losses those where the tuner ran other trials or
    steps (an adaptive tuner decides from the order results arrive in)."""
    headers = ["workload", "W", "seeds", *MATRIX_POLICIES, "cp / best(bfs,thr) min",
               "mean", "max", "cp wins/ties/losses", "losses, tuner ran other steps"]  # fmt: skip
    body = []
    for name, workers, spans in rows:
        n = len(spans["critical_path"])
        ratios, other = [], 0
        for i in range(n):
            cp, steps = spans["critical_path"][i]
            best = min(BASELINES, key=lambda b: spans[b][i][0])
            ratios.append(cp / spans[best][i][0])
            if ratios[-1] > 1 + TIE and steps != spans[best][i][1]:
                other += 1
        wins = sum(r < 1 - TIE for r in ratios)
        losses = sum(r > 1 + TIE for r in ratios)
        body.append(
            [name, workers, n]
            + [round(sum(m for m, _ in spans[p]) / n, 1) for p in MATRIX_POLICIES]
            + [f"{min(ratios):.3f}", f"{sum(ratios) / n:.3f}", f"{max(ratios):.3f}"]
            + [f"{wins}/{n - wins - losses}/{losses}", other]
        )
    return format_table(headers, body)


def decisions(workload: str, workers: int, seed: int, policy: str) -> tuple[SimResult, list[str]]:
    """The result and every batch the policy started: virtual time it started and ended,
    worker, the model it started from (node, step; "-" fresh) and its segments (node:
    start-stop); then each worker's idle stretches of at least ``IDLE_GAP`` seconds
    (before its first batch, between batches, after its last until the makespan)."""
    started: list[tuple[float, RunBatch]] = []
    ended: dict[int, float] = {}  # batch id -> virtual time of its BatchDone/BatchFailed
    submit, events = SimulatedExecutor.submit, SimulatedExecutor.events

    def recording(self: SimulatedExecutor, instruction: Any) -> None:
        if isinstance(instruction, RunBatch):
            started.append((self.now, instruction))
        submit(self, instruction)

    def ends(self: SimulatedExecutor, timeout: float | None = None) -> list[Any]:
        out = events(self, timeout)
        for event in out:
            if isinstance(event, (BatchDone, BatchFailed)):
                ended[event.batch_id] = self.now
        return out

    SimulatedExecutor.submit = recording  # type: ignore[method-assign]
    SimulatedExecutor.events = ends  # type: ignore[method-assign]
    try:
        result = _simulate(workload, workers, seed, policy)
    finally:
        SimulatedExecutor.submit = submit  # type: ignore[method-assign]
        SimulatedExecutor.events = events  # type: ignore[method-assign]
    log = []
    free = dict.fromkeys(range(workers), 0.0)  # worker -> when its last batch ended
    gaps: dict[int, list[str]] = {w: [] for w in range(workers)}
    for now, batch in started:
        start = batch.start_at
        end = ended.get(batch.batch_id, result.makespan)
        segments = " ".join(f"{s.node}:{s.start}-{s.stop}" for s in batch.segments)
        log.append(
            f"{now:8.2f}-{end:6.2f} w{batch.worker} from {start if start else '-'} {segments}"
        )
        if now - free[batch.worker] >= IDLE_GAP:
            gaps[batch.worker].append(f"{free[batch.worker]:.2f}-{now:.2f}")
        free[batch.worker] = end
    for w, end in free.items():
        if result.makespan - end >= IDLE_GAP:
            gaps[w].append(f"{end:.2f}-{result.makespan:.2f}")
    idle = workers * result.makespan - result.device_hours * 3600 / result.devices_per_worker
    log.append(f"idle: {idle:.2f} worker-seconds; stretches of {IDLE_GAP} s or more:")
    log += [f"  w{w}: {' '.join(g)}" for w, g in gaps.items() if g]
    return result, log


IDLE_GAP = 0.5  # seconds: idle stretches the trace lists


def trace(spec: str) -> str:
    """``WORKLOAD,WORKERS,SEED[,POLICY]`` (the workload by a prefix of its name): the
    decisions of ``POLICY`` (default: the default policy) beside those of the best
    baseline, and where each left workers idle."""
    prefix, workers, seed, *rest = spec.split(",")
    chosen = rest[0] if rest else "critical_path"
    name = next(n for n in WORKLOADS if n.startswith(prefix))
    runs = {p: decisions(name, int(workers), int(seed), p) for p in (chosen, *BASELINES)}
    best = min(BASELINES, key=lambda p: runs[p][0].makespan)
    lines = [f"{name}, W={workers}, seed {seed}"]
    for policy in (chosen, best):
        r, log = runs[policy]
        lines += [
            f"\n{policy}: makespan {r.makespan:.2f} s, {int(r.stats['batches'])} "
            f"batches, {r.steps_executed} steps executed, {int(r.stats['ckpt_loads'])} "
            "checkpoint loads",
            *log,
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--plot", default=str(OUT / "scheduler_compare.png"), help="PNG to write")
    parser.add_argument("--large", action="store_true", help="also the 672-trial grid")
    parser.add_argument("--matrix", action="store_true", help="where the policy matters")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per workload (--matrix)")
    parser.add_argument("--only", action="append", default=[], help="workload (--matrix)")
    parser.add_argument(
        "--trace", help="WORKLOAD,WORKERS,SEED[,POLICY]: the decisions, side by side"
    )
    parser.add_argument(
        "--known-costs", action="store_true", help="the scheduler knows every step cost"
    )
    args = parser.parse_args(argv)
    global KNOWN_COSTS
    KNOWN_COSTS = args.known_costs
    if args.trace:
        print(trace(args.trace))
        return 0
    if args.matrix:
        begin = time.perf_counter()
        print(matrix_table(matrix(range(args.seeds), args.only)))
        print(f"\n{time.perf_counter() - begin:.0f} s", file=sys.stderr)
        return 0
    rows = run(args.workers, args.large)
    print(table(rows))
    if plot(rows, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
