"""The Hippo paper's studies, reconstructed and run in the virtual-time simulator.

Every study runs twice with the same tuner and seed on 40 simulated workers:
stage-based (stagetree: shared stages, critical-path scheduling) and trial-based
(``share=False``: every trial trains alone, promotions resume it from its checkpoint,
as a Ray Tune style system does). The real plan, scheduler and tuners take every
decision; training is replaced by a step-cost model and a synthetic learning curve
(``stagetree.simulate``).

Columns: merge rate (total steps / unique steps of the trials the stage-based run
requested) and its cost-weighted form (training seconds of every trial alone /
training seconds of the unique steps: steps differ in cost, e.g. with the batch
size, so this is the device-hours saving sharing allows at best); device-hours and
makespan of both runs and their ratios (trial-based / stage-based: the saving);
makespan / lower bound, the lower bound being ``max(longest trial, unique work /
workers)`` in training seconds.

Reconstruction (the paper's exact spaces are not public in machine-readable form;
these follow its Tables 1-4 in kind and size, see ``examples/resnet56_space.py``):

* ResNet-56 / CIFAR-10, SHA and ASHA (reduction 4, 15 to 120 epochs, 448 trials; one
  step = one epoch, 30 s at batch 128, ``(batch/128)**-0.3`` otherwise; 7 MB
  checkpoints). The space is the example's grid (5 learning-rate schedules x 2
  batch-size x 2 momentum schedules x 2 weight decays x 3 optimizers) extended with
  2 more learning-rate schedules (step decay at 60/90; 5 warm-up epochs then cosine),
  2 more batch-size schedules (doubling at epoch 40; 128/256/512 at 40/80) and 2 more
  momentum schedules (0.9 then 0.95 from 60; 0.8 then 0.9 from 20): 672 points, of
  which the tuner draws 448 (a seeded shuffle), as the paper sampled 448 trials.
* MobileNetV2 / CIFAR-10, grid search, 240 trials of 120 epochs: 5 learning-rate
  schedules x 3 batch-size schedules x 2 momentum schedules x 4 weight decays x 2
  optimizers (25 s per epoch at batch 128, 20 MB checkpoints).
* BERT-Base, grid search, 40 trials of 27,000 steps, simulated in units of 100
  steps (270 units; one unit = 70 s at sequence length 128 and batch 256, scaling
  with ``(seq/128)**1.2 * (batch/256)``; 1.3 GB checkpoints): peak learning rate
  {1e-4, 5e-5} after a 10 % linear warm-up, then 5 decays (linear, cosine, constant,
  x0.1 at 50 %, x0.1 at 80 %) x sequence length {128, 128 then 512 for the last
  10 %} x batch {256, 256 then 512 from 50 %}.
* Multi-study S1/S2/S4/S8: 1, 2, 4 or 8 SHA studies (as above) of 144 trials each,
  each drawing its trials from the ResNet-56 space with its own seed, on one storage
  and 40 shared workers; the trial-based baseline shares nothing, not even between
  studies.

Run: ``python benchmarks/paper_studies.py [--workers 40] [--plot PNG] [--only NAME]``
(the plot goes to ``benchmarks/out/paper_studies.png`` by default).
The plot needs matplotlib (a benchmark-only dependency); without it the table is
printed and the plot skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stagetree.hp import (  # noqa: E402
    Constant,
    Cosine,
    Cyclic,
    Exponential,
    Linear,
    MultiStep,
    Piecewise,
    Warmup,
)
from stagetree.simulate import LearningCurve, SimResult, StepCost, format_table, simulate  # noqa: E402
from stagetree.space import GridSpace  # noqa: E402
from stagetree.tuners import ASHA, SHA, GridSearch, Tuner  # noqa: E402

WORKERS = 40
OUT = ROOT / "benchmarks" / "out"


# --------------------------------------------------------------------------- spaces


def resnet56_space() -> GridSpace:
    """The example ResNet-56 grid extended to 672 points (see the module docstring)."""
    example = runpy.run_path(str(ROOT / "examples" / "resnet56_space.py"))
    lrs = [
        *example["learning_rates"],
        MultiStep(0.1, [60, 90], 0.1),
        Warmup(5, 0.1).then(Cosine(0.1, 115), at=5),
    ]
    batch_sizes = [
        *example["batch_sizes"],
        Piecewise([128, 256], [40]),
        Piecewise([128, 256, 512], [40, 80]),
    ]
    momenta = [
        *example["momenta"],
        Piecewise([0.9, 0.95], [60]),
        Piecewise([0.8, 0.9], [20]),
    ]
    return GridSpace(
        hp={"lr": lrs, "batch_size": batch_sizes, "momentum": momenta},
        fixed={"weight_decay": [1e-4, 1e-3], "optimizer": ["adam", "sgd", "sgd_momentum"]},
    )


def mobilenetv2_space() -> GridSpace:
    """240 trials: 5 x 3 x 2 sequences x 4 weight decays x 2 optimizers."""
    lrs = [
        MultiStep(0.05, [60, 90], 0.1),
        Warmup(5, 0.05).then(MultiStep(0.05, [55, 85], 0.1), at=5),
        Warmup(5, 0.05).then(Exponential(0.05, 0.97), at=5),
        Cosine(0.05, 120),
        Cyclic(0.001, 0.05, step_size_up=20),
    ]
    return GridSpace(
        hp={
            "lr": lrs,
            "batch_size": [
                Constant(128),
                Piecewise([128, 256], [70]),
                Piecewise([128, 256], [40]),
            ],
            "momentum": [Constant(0.9), Piecewise([0.9, 0.95], [60])],
        },
        fixed={"weight_decay": [4e-5, 1e-4, 4e-4, 1e-3], "optimizer": ["sgd", "nesterov"]},
    )


BERT_UNITS = 270  # 27,000 steps in units of 100
BERT_WARMUP = 27  # 10 %


def bert_space() -> GridSpace:
    """40 trials over one model config: 2 peaks x 5 decays x 2 seq-len x 2 batch."""
    lrs = []
    rest = BERT_UNITS - BERT_WARMUP
    for peak in (1e-4, 5e-5):
        warm = Warmup(BERT_WARMUP, peak)
        for decay in (
            Linear(peak, 0.0, rest),
            Cosine(peak, rest),
            Constant(peak),
            MultiStep(peak, [rest // 2], 0.1),
            MultiStep(peak, [int(rest * 0.8)], 0.1),
        ):
            lrs.append(warm.then(decay, at=BERT_WARMUP))
    return GridSpace(
        hp={
            "lr": lrs,
            "seq_len": [Constant(128), Piecewise([128, 512], [BERT_UNITS * 9 // 10])],
            "batch_size": [Constant(256), Piecewise([256, 512], [BERT_UNITS // 2])],
        },
        fixed={"model": ["bert-base-uncased"]},
    )


# --------------------------------------------------------------------------- studies


@dataclass
class Spec:
    """One reconstructed study: tuners (one per study, several for multi-study) and
    the simulator's models."""

    name: str
    tuner: str
    trials: int
    make: Callable[[], list[Tuner]]
    options: dict[str, Any]


def _resnet_options() -> dict[str, Any]:
    return {
        "step_cost": StepCost(30.0, {"batch_size": (128.0, -0.3)}),
        "checkpoint_bytes": 7_000_000,
    }


def _sha(space: GridSpace, n: int, seed: int) -> SHA:
    return SHA(space, "accuracy", min_steps=15, max_steps=120, eta=4, num_trials=n, seed=seed)


def _asha(space: GridSpace, n: int, seed: int) -> ASHA:
    return ASHA(space, "accuracy", min_steps=15, max_steps=120, eta=4, num_trials=n, seed=seed)


def _studies(space: GridSpace, k: int) -> Callable[[], list[Tuner]]:
    return lambda: [_sha(space, 144, seed) for seed in range(k)]


def specs() -> list[Spec]:
    resnet = resnet56_space()
    out = [
        Spec(
            "ResNet-56",
            "SHA",
            448,
            lambda: [_sha(resnet, 448, 0)],
            _resnet_options(),
        ),
        Spec(
            "ResNet-56",
            "ASHA",
            448,
            lambda: [_asha(resnet, 448, 0)],
            _resnet_options(),
        ),
        Spec(
            "MobileNetV2",
            "grid",
            240,
            lambda: [GridSearch(mobilenetv2_space(), "accuracy", steps=120)],
            {
                "step_cost": StepCost(25.0, {"batch_size": (128.0, -0.3)}),
                "checkpoint_bytes": 20_000_000,
            },
        ),
        Spec(
            "BERT-Base",
            "grid",
            40,
            lambda: [GridSearch(bert_space(), "accuracy", steps=BERT_UNITS)],
            {
                "step_cost": StepCost(70.0, {"seq_len": (128.0, 1.2), "batch_size": (256.0, 1.0)}),
                "checkpoint_bytes": 1_300_000_000,
                "curve": LearningCurve(
                    tau=60.0, lr_half=2e-5, lr_max=1e-3, ref_batch=256, temperature_cost=300.0
                ),
            },
        ),
    ]
    for k in (1, 2, 4, 8):
        out.append(
            Spec(
                f"S{k} (ResNet-56)",
                f"{k} x SHA",
                144 * k,
                _studies(resnet, k),
                _resnet_options(),
            )
        )
    return out


@dataclass
class Row:
    spec: Spec
    shared: SimResult
    alone: SimResult
    seconds: float

    @property
    def device_ratio(self) -> float:
        return self.alone.device_hours / self.shared.device_hours

    @property
    def makespan_ratio(self) -> float:
        return self.alone.makespan / self.shared.makespan


def run_spec(spec: Spec, workers: int, policy: str = "critical_path") -> Row:
    begin = time.perf_counter()
    results = []
    for share in (True, False):
        tuners = spec.make()
        results.append(
            simulate(
                None,
                tuners if len(tuners) > 1 else tuners[0],
                workers,
                share,
                policy=policy,
                name=spec.name.split()[0].lower(),
                **spec.options,
            )
        )
    return Row(spec, results[0], results[1], time.perf_counter() - begin)


HEADERS = [
    "study",
    "tuner",
    "trials",
    "merge rate",
    "cost-weighted merge rate",
    "device-h stage",
    "device-h trial",
    "device-h saving",
    "makespan h stage",
    "makespan h trial",
    "makespan saving",
    "makespan/LB stage",
    "makespan/LB trial",
    "executed/unique",
    "real s",
]


def table(rows: Sequence[Row]) -> str:
    return format_table(
        HEADERS,
        [
            [
                r.spec.name,
                r.spec.tuner,
                r.shared.trials,
                r.shared.merge_rate,
                r.shared.work_merge_rate,
                r.shared.device_hours,
                r.alone.device_hours,
                r.device_ratio,
                r.shared.makespan_hours,
                r.alone.makespan_hours,
                r.makespan_ratio,
                r.shared.bound_ratio,
                r.alone.bound_ratio,
                f"{r.shared.steps_executed}/{r.shared.steps_unique}",
                round(r.seconds, 1),
            ]
            for r in rows
        ],
    )


def plot(rows: Sequence[Row], path: str) -> bool:
    """Grouped bars: merge rate, device-hours saving, makespan saving per study."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: skipping the plot {path}", file=sys.stderr)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.spec.name}\n{r.spec.tuner}" for r in rows]
    series = [
        ("merge rate", [r.shared.merge_rate for r in rows]),
        ("device-hours saving", [r.device_ratio for r in rows]),
        ("makespan saving", [r.makespan_ratio for r in rows]),
    ]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(rows)), 4.5))
    width = 0.27
    for i, (label, values) in enumerate(series):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, values, width, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("trial-based / stage-based")
    ax.set_title(f"Hippo studies reconstructed, {rows[0].shared.workers} simulated workers")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--plot", default=str(OUT / "paper_studies.png"), help="PNG to write")
    parser.add_argument("--only", help="run only studies whose name contains this")
    args = parser.parse_args(argv)
    rows = []
    for spec in specs():
        if args.only and args.only.lower() not in f"{spec.name} {spec.tuner}".lower():
            continue
        rows.append(run_spec(spec, args.workers))
        print(f"  {spec.name} {spec.tuner}: {rows[-1].seconds:.1f} s", file=sys.stderr)
    print(table(rows))
    if rows and plot(rows, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
