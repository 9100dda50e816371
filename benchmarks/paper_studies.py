"""The Hippo paper's studies, run in the virtual-time simulator, side by side with its figures.

Every study runs twice with the same tuner and seed on the paper's cluster, 40 devices
(five machines x 8 GPUs): stage-based (stagetree: shared stages, critical-path
scheduling) and trial-based (``share=False``: every trial trains alone, promotions
resume it from its checkpoint; the paper's "Hippo-trial" column). The real plan,
scheduler and tuners take every decision; training is replaced by a step-cost model and
a synthetic learning curve (``stagetree.tools.simulate``).

Spaces: ``benchmarks/paper_spaces.py`` (the paper's Tables 2-4 completed so that the
trial counts and whole-space merge rates match its Table 1 within 1 %; every choice is
in that module's docstring).

The paper's accounting, as modelled here:

* Tuners as Table 1 gives them: SHA and ASHA with reduction 4, 15 to 120 epochs (rungs
  15, 60, 120), 448 trials; grid search to 120 epochs (MobileNetV2) and 27,000 steps
  (BERT-Base, simulated in units of 100 steps).
* Cluster: 40 devices. ResNet-56, MobileNetV2 and ResNet-20 run one trial (one batch of
  stages) per device: 40 workers of 1 device. BERT-Base trials do not fit one GPU (the
  paper trains them data-parallel): 10 workers of 4 devices each (half a machine,
  NVLink), every step ``1 + 3 e`` times faster with a stated data-parallel efficiency
  ``e = 0.9`` (3.7x), and every busy second counted on 4 devices.
* The best trial's 100 extra epochs (ResNet-56 and MobileNetV2, as the paper counts
  them): after the tuner returns, its best trial trains 100 more epochs (120 to 220) on
  one worker, its sequences continued; both systems pay it (each its own best trial),
  in device-hours and end to end (it can only start once the best is known). The
  columns "study only" leave it out.
* Evaluation matched between the systems: both evaluate several times per epoch on the
  same data; that cost is folded into every step's cost (:class:`EpochCost`: ResNet-56
  4 x 1.0 s per epoch, MobileNetV2 4 x 1.0 s, ResNet-20 4 x 0.5 s, BERT-Base one 30 s
  evaluation every 500 steps, 6 s per 100 steps), so a shared step's evaluations are
  shared too, as in Hippo.
* Step costs: ResNet-56 30 s per epoch at batch 128 (``(batch/128)**-0.3`` otherwise),
  7 MB checkpoints; MobileNetV2 25 s per epoch likewise, 20 MB; ResNet-20 10 s per epoch
  likewise, 2 MB; BERT-Base 70 s per 100 steps at sequence length 128 and batch 256,
  ``(seq/128)**1.2 * (batch/256)`` otherwise (one device), 1.3 GB checkpoints.

Columns: GPU-hours (device-hours) trial-based and stage-based and their ratio;
end-to-end time (makespan) of both and its ratio; the merge rate of the explored subset
(total steps / unique steps of the trials the stage-based run trained, each to the steps
the tuner gave it; the paper measured 4.23 for SHA); makespan / lower bound of the
stage-based study (lower bound = ``max(longest trial, unique work / workers)`` in
training seconds, before the extra epochs). The paper's rows give its ratios against Ray
Tune and against Hippo-trial (its Table 5 and Figure 12).

Multi-study S1/S2/S4/S8 (the paper's Figures 13-14): 1, 2, 4 or 8 SHA studies of ResNet-20
(144 trials each, drawn from ``paper_spaces.resnet20_space`` with the study's seed) on
one storage and 40 shared devices; the trial-based baseline shares nothing, not even
between studies. k-wise merge rate: total steps / unique steps of the k studies' trials
trained to 120 epochs.

Run: ``python benchmarks/paper_studies.py [--quick] [--only NAME] [--plot PNG]`` (the plot
goes to ``benchmarks/out/paper_studies.png``; it needs matplotlib, a benchmark-only
dependency; without it the tables are printed and the plot skipped). ``--quick`` runs
the four single studies only; ``--asha-concurrent N`` gives ASHA an explicit
``max_concurrent`` (``40``: one job per worker, ASHA's behaviour before it counted
distinct paths in sharing studies); ``--policy`` picks the scheduling policy.

Bounds printed under the tables (measurements of where the makespan goes):
:func:`barrier_bound` for SHA (rungs wait for each other) and :func:`depth_bound` for
the grids (no step starts before the steps above it on its path).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_spaces import (  # noqa: E402
    BERT_UNITS,
    EPOCHS,
    bert_space,
    mobilenetv2_space,
    resnet20_space,
    resnet56_space,
)

from stagetree.plan.memory import MemoryPlanStorage  # noqa: E402
from stagetree.space import TrialSpec, config_key  # noqa: E402
from stagetree.stages import build_stage_tree, kwise_merge_rate  # noqa: E402
from stagetree.tools.simulate import (  # noqa: E402
    LearningCurve,
    SimResult,
    StepCost,
    format_table,
    simulate,
    work,
)
from stagetree.tuners import ASHA, SHA, GridSearch, Tuner  # noqa: E402
from stagetree.tuners.base import TrialResult  # noqa: E402

DEVICES = 40
WORKERS = DEVICES  # one device per worker unless a study says otherwise
EXTRA_EPOCHS = 100
BERT_DEVICES_PER_WORKER = 4
BERT_PARALLEL_EFFICIENCY = 0.9
MULTI_TRIALS = 144
OUT = ROOT / "benchmarks" / "out"


# --------------------------------------------------------------------------- cost model


class EpochCost:
    """Seconds of one step: training (a :class:`StepCost`) plus the evaluations run
    during it (``eval_seconds``, the same in both systems)."""

    def __init__(self, train: StepCost, eval_seconds: float) -> None:
        self.train = train
        self.eval_seconds = eval_seconds

    def __call__(self, config: Mapping[str, Any], values: Mapping[str, Any]) -> float:
        return self.train(config, values) + self.eval_seconds

    def __repr__(self) -> str:
        return f"EpochCost({self.train!r}, eval_seconds={self.eval_seconds})"


def _resnet_options() -> dict[str, Any]:
    return {
        "step_cost": EpochCost(StepCost(30.0, {"batch_size": (128.0, -0.3)}), 4 * 1.0),
        "checkpoint_bytes": 7_000_000,
    }


def _mobilenet_options() -> dict[str, Any]:
    return {
        "step_cost": EpochCost(StepCost(25.0, {"batch_size": (128.0, -0.3)}), 4 * 1.0),
        "checkpoint_bytes": 20_000_000,
    }


def _resnet20_options() -> dict[str, Any]:
    return {
        "step_cost": EpochCost(StepCost(10.0, {"batch_size": (128.0, -0.3)}), 4 * 0.5),
        "checkpoint_bytes": 2_000_000,
    }


def _bert_options() -> dict[str, Any]:
    return {
        "step_cost": EpochCost(
            StepCost(70.0, {"seq_len": (128.0, 1.2), "batch_size": (256.0, 1.0)}), 6.0
        ),
        "checkpoint_bytes": 1_300_000_000,
        "curve": LearningCurve(
            tau=60.0, lr_half=2e-5, lr_max=1e-3, ref_batch=256, temperature_cost=300.0
        ),
    }


# --------------------------------------------------------------------------- the paper


@dataclass(frozen=True)
class Paper:
    """The paper's figures for one study: stage-based vs Ray Tune and vs Hippo-trial
    (GPU-hours ratio, end-to-end ratio), the explored subset's merge rate where given."""

    gpu_vs_ray: float
    e2e_vs_ray: float
    gpu_vs_trial: float
    e2e_vs_trial: float
    explored_merge_rate: float | None = None


PAPER: dict[str, Paper] = {
    "ResNet-56 SHA": Paper(4.81, 2.42, 4.84, 2.24, 4.23),
    "ResNet-56 ASHA": Paper(3.92, 2.38, 2.70, 1.84),
    "MobileNetV2 grid": Paper(3.15, 2.76, 3.24, 2.90),
    "BERT-Base grid": Paper(2.07, 2.11, 2.00, 2.02),
}

# Figures 13-14: k-wise merge rates of the paper's two sets of multi-study runs, and the
# largest savings (GPU-hours, end to end) of each set.
PAPER_MULTI: dict[str, tuple[dict[int, float], float, float]] = {
    "set 1": ({2: 2.26, 4: 2.77, 8: 2.47}, 6.77, 3.53),
    "set 2": ({2: 1.40, 4: 1.19, 8: 1.66}, 2.32, 1.99),
}


# --------------------------------------------------------------------------- studies


@dataclass
class Spec:
    """One study: its tuners (several for multi-study), the simulator's models and the
    paper's accounting."""

    name: str
    tuner: str
    trials: int
    make: Callable[[], list[Tuner]]
    options: dict[str, Any]
    devices_per_worker: int = 1
    parallel_efficiency: float = 1.0
    extra_steps: int = 0
    kwise_merge_rate: float | None = None
    multi: int = 0

    @property
    def key(self) -> str:
        return f"{self.name} {self.tuner}"

    @property
    def workers(self) -> int:
        return DEVICES // self.devices_per_worker


def _sha(space: Any, n: int, seed: int) -> SHA:
    return SHA(space, "accuracy", min_steps=15, max_steps=EPOCHS, eta=4, num_trials=n, seed=seed)


ASHA_CONCURRENT: int | None = None  # ASHA's max_concurrent (None: the workers); --asha-concurrent


def _asha(space: Any, n: int, seed: int, max_concurrent: int | None = None) -> ASHA:
    return ASHA(
        space,
        "accuracy",
        min_steps=15,
        max_steps=EPOCHS,
        eta=4,
        num_trials=n,
        seed=seed,
        max_concurrent=max_concurrent if max_concurrent is not None else ASHA_CONCURRENT,
    )


def multi_study_trials(k: int) -> list[list[TrialSpec]]:
    """The trials of each of ``k`` ResNet-20 studies (144 each, seed = study index)."""
    space = resnet20_space()
    return [space.trials(MULTI_TRIALS, seed) for seed in range(k)]


def _multi(k: int) -> Spec:
    studies = multi_study_trials(k)
    rate = kwise_merge_rate([[(t.root_key(), t.hp, EPOCHS) for t in s] for s in studies])
    return Spec(
        f"S{k} (ResNet-20)",
        f"{k} x SHA",
        MULTI_TRIALS * k,
        lambda: [_sha(trials, MULTI_TRIALS, seed) for seed, trials in enumerate(studies)],
        _resnet20_options(),
        kwise_merge_rate=rate,
        multi=k,
    )


def specs(quick: bool = False) -> list[Spec]:
    resnet = resnet56_space()
    out = [
        Spec(
            "ResNet-56",
            "SHA",
            448,
            lambda: [_sha(resnet, 448, 0)],
            _resnet_options(),
            extra_steps=EXTRA_EPOCHS,
        ),
        Spec(
            "ResNet-56",
            "ASHA",
            448,
            lambda: [_asha(resnet, 448, 0)],
            _resnet_options(),
            extra_steps=EXTRA_EPOCHS,
        ),
        Spec(
            "MobileNetV2",
            "grid",
            240,
            lambda: [GridSearch(mobilenetv2_space(), "accuracy", steps=EPOCHS)],
            _mobilenet_options(),
            extra_steps=EXTRA_EPOCHS,
        ),
        Spec(
            "BERT-Base",
            "grid",
            40,
            lambda: [GridSearch(bert_space(), "accuracy", steps=BERT_UNITS)],
            _bert_options(),
            devices_per_worker=BERT_DEVICES_PER_WORKER,
            parallel_efficiency=BERT_PARALLEL_EFFICIENCY,
        ),
    ]
    if not quick:
        out.extend(_multi(k) for k in (1, 2, 4, 8))
    return out


# --------------------------------------------------------------------------- runs


@dataclass
class Side:
    """One system's run: the simulated study, the best trial's extra training and, for
    synchronous successive halving, the rung-barrier bound (:func:`barrier_bound`)."""

    result: SimResult
    extra_seconds: float = 0.0  # end to end, on one worker
    barrier_bound: float | None = None
    depth_bound: float | None = None  # grid studies, stage-based: see depth_bound()

    @property
    def barrier_ratio(self) -> float | None:
        if self.barrier_bound is None:
            return None
        return self.result.makespan / self.barrier_bound

    @property
    def device_hours(self) -> float:
        return self.result.device_hours + self.extra_seconds * self.result.devices_per_worker / 3600

    @property
    def makespan_hours(self) -> float:
        return (self.result.makespan + self.extra_seconds) / 3600


@dataclass
class Row:
    spec: Spec
    stage: Side
    trial: Side
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_ratio(self) -> float:
        return self.trial.device_hours / self.stage.device_hours

    @property
    def e2e_ratio(self) -> float:
        return self.trial.makespan_hours / self.stage.makespan_hours

    @property
    def study_gpu_ratio(self) -> float:
        return self.trial.result.device_hours / self.stage.result.device_hours

    @property
    def study_e2e_ratio(self) -> float:
        return self.trial.result.makespan / self.stage.result.makespan


def extra_seconds(
    best: TrialResult | None, cost: Callable[..., float], steps: int, speedup: float
) -> float:
    """Seconds to train ``best`` ``steps`` more steps on one worker (its sequences
    continued past the steps it was trained for)."""
    if best is None or steps <= 0:
        return 0.0
    total = 0.0
    for t in range(best.steps, best.steps + steps):
        values = {name: seq(t) for name, seq in best.hp.items()}
        total += cost(best.config, values)
    return total / speedup


def _plan_of(
    trials: Sequence[Any], steps: int
) -> tuple[dict[int, Any], dict[str, Mapping[str, Any]], list[tuple[int, int]]]:
    """``trials`` to ``steps`` inserted in a fresh memory plan: its nodes by id, the fixed
    config of each plan tree, and each trial's canonical end."""
    storage = MemoryPlanStorage()
    grouped: dict[str, list[tuple[Any, int]]] = {}
    roots: dict[str, Mapping[str, Any]] = {}
    for t in trials:
        key = config_key(t.config)
        grouped.setdefault(key, []).append((t.hp, steps))
        roots[key] = t.config
    ends = [
        (ins.node, ins.step)
        for key, items in grouped.items()
        for ins in storage.insert_trials(key, items, request=False)
    ]
    return {n.id: n for n in storage.nodes()}, roots, ends


def _unique_seconds(
    trials: Sequence[Any], steps: int, cost: Callable[..., float], speedup: float
) -> float:
    """Training seconds of the union of ``trials``' paths to ``steps`` (shared steps once)."""
    if steps <= 0 or not trials:
        return 0.0
    nodes, roots, ends = _plan_of(trials, steps)
    return work(nodes, roots, ends, lambda c, v: cost(c, v) / speedup, 1).unique_work


def _segment_seconds(trial: Any, start: int, stop: int, cost: Callable[..., float]) -> float:
    return sum(
        cost(trial.config, {n: q(t) for n, q in trial.hp.items()}) for t in range(start, stop)
    )


def depth_bound(
    trials: Sequence[Any], steps: int, cost: Callable[..., float], workers: int, speedup: float
) -> float:
    """A lower bound on the makespan of training the union of ``trials``' paths to
    ``steps`` on ``workers`` that sees the tree's shape: a step cannot start before the
    steps above it on its path, ``s`` seconds after the start, so by time ``tau`` at most
    ``A(tau) = sum(clip(tau - s, 0, c))`` of the work can be done (and at most
    ``workers * tau``); the makespan is at least ``tau + (W - min(A, workers * tau)) /
    workers`` for every ``tau``. It exceeds ``max(longest path, W / workers)`` when a
    long shared trunk leaves workers without ready work early on."""
    import numpy as np

    nodes, roots, ends = _plan_of(trials, steps)
    tree = build_stage_tree(nodes, list(dict.fromkeys(ends)))
    starts: list[float] = []
    costs: list[float] = []
    finish: dict[int, float] = {}
    for stage in tree.stages:  # parents before children
        node = nodes[stage.node]
        config = roots[node.root_key]
        done = finish[id(stage.parent)] if stage.parent is not None else 0.0
        for t in range(stage.start, stage.stop):
            c = cost(config, {n: q(t) for n, q in node.hp.items()}) / speedup
            starts.append(done)
            costs.append(c)
            done += c
        finish[id(stage)] = done
    s, c = np.array(starts), np.array(costs)
    total, longest = float(c.sum()), float((s + c).max())
    best = max(longest, total / workers)
    for tau in np.linspace(0.0, longest, 600):
        done_by = min(float(np.clip(tau - s, 0.0, c).sum()), workers * tau)
        best = max(best, float(tau) + (total - done_by) / workers)
    return best


def barrier_bound(
    tuner: Any, cost: Callable[..., float], workers: int, speedup: float, share: bool
) -> float | None:
    """A lower bound on the makespan of synchronous successive halving: rung ``k`` cannot
    start before rung ``k - 1`` has ended, so the bound is the sum over rungs of
    ``max(longest segment, the rung's unique work / workers)``, the segment of a trial
    being its steps from the previous rung to this one (what the tuner actually
    promoted, read from ``tuner.rung_trials``). None for other tuners."""
    if not isinstance(tuner, SHA) or not tuner.rung_trials:
        return None
    rungs = tuner.rung_trials
    total = 0.0
    for bracket in rungs:
        phases = 0.0
        previous = 0
        for level, ids in enumerate(bracket):
            if not ids:
                break
            steps = tuner.levels[level] if len(bracket) == len(tuner.levels) else None
            if steps is None:
                return None
            trials = [tuner.trials[i] for i in ids]
            segments = [_segment_seconds(t, previous, steps, cost) / speedup for t in trials]
            if share:
                unique = _unique_seconds(trials, steps, cost, speedup) - _unique_seconds(
                    trials, previous, cost, speedup
                )
            else:
                unique = sum(segments)
            phases += max(max(segments), unique / workers)
            previous = steps
        total = max(total, phases)
    return total


def run_spec(spec: Spec, policy: str = "critical_path") -> Row:
    begin = time.perf_counter()
    sides = []
    for share in (True, False):
        tuners = spec.make()
        result = simulate(
            None,
            tuners if len(tuners) > 1 else tuners[0],
            spec.workers,
            share,
            policy=policy,
            name=spec.name.split()[0].lower(),
            devices_per_worker=spec.devices_per_worker,
            parallel_efficiency=spec.parallel_efficiency,
            **spec.options,
        )
        speedup = 1.0 + (spec.devices_per_worker - 1) * spec.parallel_efficiency
        cost = spec.options["step_cost"]
        extra = extra_seconds(result.best, cost, spec.extra_steps, speedup)
        bound = barrier_bound(tuners[0], cost, spec.workers, speedup, share)
        side = Side(result, extra, bound if len(tuners) == 1 else None)
        grid = tuners[0]
        if share and len(tuners) == 1 and isinstance(grid, GridSearch):
            side.depth_bound = depth_bound(
                list(grid.trials.values()), grid.steps, cost, spec.workers, speedup
            )
        sides.append(side)
    return Row(spec, sides[0], sides[1], time.perf_counter() - begin)


# --------------------------------------------------------------------------- tables


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


SIDE_HEADERS = [
    "",
    "GPU-h trial",
    "GPU-h stage",
    "GPU-h ratio",
    "end-to-end h trial",
    "end-to-end h stage",
    "end-to-end ratio",
    "merge rate explored",
    "makespan/LB",
]


def side_by_side(row: Row) -> str:
    """The paper's ratios next to the simulated study's (one table per study)."""
    s, t = row.stage, row.trial
    lines: list[list[Any]] = []
    paper = PAPER.get(row.spec.key)
    if paper is not None:
        lines.append(
            [
                "paper: stage vs Ray Tune",
                "-",
                "-",
                _f(paper.gpu_vs_ray),
                "-",
                "-",
                _f(paper.e2e_vs_ray),
                _f(paper.explored_merge_rate),
                "-",
            ]
        )
        lines.append(
            [
                "paper: stage vs Hippo-trial",
                "-",
                "-",
                _f(paper.gpu_vs_trial),
                "-",
                "-",
                _f(paper.e2e_vs_trial),
                _f(paper.explored_merge_rate),
                "-",
            ]
        )
    label = "stagetree (simulated)"
    if row.spec.extra_steps:
        label += f", best +{row.spec.extra_steps} epochs"
    lines.append(
        [
            label,
            _f(t.device_hours, 1),
            _f(s.device_hours, 1),
            _f(row.gpu_ratio),
            _f(t.makespan_hours),
            _f(s.makespan_hours),
            _f(row.e2e_ratio),
            _f(s.result.merge_rate),
            _f(s.result.bound_ratio),
        ]
    )
    if row.spec.extra_steps:
        lines.append(
            [
                "stagetree, study only",
                _f(t.result.device_hours, 1),
                _f(s.result.device_hours, 1),
                _f(row.study_gpu_ratio),
                _f(t.result.makespan_hours),
                _f(s.result.makespan_hours),
                _f(row.study_e2e_ratio),
                _f(s.result.merge_rate),
                _f(s.result.bound_ratio),
            ]
        )
    cluster = (
        f"{row.spec.workers} workers x {row.spec.devices_per_worker} devices "
        f"(e = {row.spec.parallel_efficiency:g})"
    )
    title = f"{row.spec.name}, {row.spec.tuner}, {row.spec.trials} trials, {cluster}"
    text = f"{title}\n\n{format_table(SIDE_HEADERS, lines)}"
    if s.barrier_ratio is not None and t.barrier_ratio is not None:
        text += (
            f"\n\nmakespan / rung-barrier bound (sum over rungs of max(longest segment, "
            f"rung's unique work / workers)): stage-based {s.barrier_ratio:.2f}, "
            f"trial-based {t.barrier_ratio:.2f}"
        )
    if s.depth_bound is not None:
        text += (
            f"\n\nmakespan / tree-depth bound (no step before the steps above it on its "
            f"path: see depth_bound): stage-based {s.result.makespan / s.depth_bound:.2f}"
        )
    return text


SUMMARY_HEADERS = [
    "study",
    "tuner",
    "trials",
    "merge rate explored",
    "cost-weighted",
    "GPU-h ratio",
    "paper vs Ray",
    "paper vs trial",
    "end-to-end ratio",
    "paper vs Ray",
    "paper vs trial",
    "makespan/LB stage",
    "makespan/LB trial",
    "executed/unique",
    "real s",
]


def summary(rows: Sequence[Row]) -> str:
    out = []
    for r in rows:
        p = PAPER.get(r.spec.key)
        out.append(
            [
                r.spec.name,
                r.spec.tuner,
                r.spec.trials,
                _f(r.stage.result.merge_rate),
                _f(r.stage.result.work_merge_rate),
                _f(r.gpu_ratio),
                _f(p.gpu_vs_ray if p else None),
                _f(p.gpu_vs_trial if p else None),
                _f(r.e2e_ratio),
                _f(p.e2e_vs_ray if p else None),
                _f(p.e2e_vs_trial if p else None),
                _f(r.stage.result.bound_ratio),
                _f(r.trial.result.bound_ratio),
                f"{r.stage.result.steps_executed}/{r.stage.result.steps_unique}",
                round(r.seconds, 1),
            ]
        )
    return format_table(SUMMARY_HEADERS, out)


MULTI_HEADERS = [
    "studies",
    "trials",
    "k-wise merge rate",
    "paper set 1",
    "paper set 2",
    "merge rate explored",
    "GPU-h trial",
    "GPU-h stage",
    "GPU-h ratio",
    "end-to-end h trial",
    "end-to-end h stage",
    "end-to-end ratio",
    "makespan/LB",
]


def multi_table(rows: Sequence[Row]) -> str:
    out = []
    for r in rows:
        k = r.spec.multi
        out.append(
            [
                f"S{k}",
                r.spec.trials,
                _f(r.spec.kwise_merge_rate),
                _f(PAPER_MULTI["set 1"][0].get(k)),
                _f(PAPER_MULTI["set 2"][0].get(k)),
                _f(r.stage.result.merge_rate),
                _f(r.trial.device_hours, 1),
                _f(r.stage.device_hours, 1),
                _f(r.gpu_ratio),
                _f(r.trial.makespan_hours),
                _f(r.stage.makespan_hours),
                _f(r.e2e_ratio),
                _f(r.stage.result.bound_ratio),
            ]
        )
    best = [(name, gpu, e2e) for name, (_rates, gpu, e2e) in PAPER_MULTI.items()]
    note = "; ".join(
        f"paper {n}: up to {g:.2f}x GPU-hours, {e:.2f}x end to end" for n, g, e in best
    )
    return f"{format_table(MULTI_HEADERS, out)}\n\n{note}"


# --------------------------------------------------------------------------- plot


def plot(rows: Sequence[Row], path: str) -> bool:
    """Grouped bars per study: GPU-hours and end-to-end ratios, ours and the paper's
    (vs Hippo-trial)."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: skipping the plot {path}", file=sys.stderr)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.spec.name}\n{r.spec.tuner}" for r in rows]
    nan = float("nan")
    papers = [PAPER.get(r.spec.key) for r in rows]
    series = [
        ("GPU-h ratio, stagetree", [r.gpu_ratio for r in rows]),
        ("GPU-h ratio, paper (vs Hippo-trial)", [p.gpu_vs_trial if p else nan for p in papers]),
        ("end-to-end ratio, stagetree", [r.e2e_ratio for r in rows]),
        (
            "end-to-end ratio, paper (vs Hippo-trial)",
            [p.e2e_vs_trial if p else nan for p in papers],
        ),
    ]
    fig, ax = plt.subplots(figsize=(max(8, 1.5 * len(rows)), 4.8))
    width = 0.2
    for i, (label, values) in enumerate(series):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, values, width, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("trial-based / stage-based")
    ax.set_title(f"Hippo's studies: paper vs stagetree (simulated, {DEVICES} devices)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", default=str(OUT / "paper_studies.png"), help="PNG to write")
    parser.add_argument("--only", help="run only studies whose name contains this")
    parser.add_argument("--quick", action="store_true", help="the four single studies only")
    parser.add_argument("--policy", default="critical_path", help="scheduling policy")
    parser.add_argument(
        "--asha-concurrent", type=int, help="ASHA's max_concurrent (default: the workers)"
    )
    args = parser.parse_args(argv)
    global ASHA_CONCURRENT
    ASHA_CONCURRENT = args.asha_concurrent
    rows = []
    for spec in specs(args.quick):
        if args.only and args.only.lower() not in spec.key.lower():
            continue
        rows.append(run_spec(spec, args.policy))
        print(f"  {spec.key}: {rows[-1].seconds:.1f} s", file=sys.stderr)
    single = [r for r in rows if not r.spec.multi]
    multi = [r for r in rows if r.spec.multi]
    for r in single:
        print(side_by_side(r), end="\n\n")
    if multi:
        print(f"Multi-study (ResNet-20, {MULTI_TRIALS} trials per study, SHA)\n")
        print(multi_table(multi), end="\n\n")
    if rows:
        print(summary(rows))
    if rows and plot(rows, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
