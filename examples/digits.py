"""A real study: an MLP on scikit-learn's digits, tuned with ASHA.

Run it with ``make demo``, ``stagetree run examples/digits.py`` or
``python examples/digits.py``. The search space has 16 trials whose learning-rate,
batch-size and momentum sequences share prefixes, so stagetree trains every shared
stage once. Run it a second time on the same storage and it finishes without
training a step: every result comes from the plan.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from stagetree import Study
from stagetree.hp import Constant, Cosine, Exponential, MultiStep, Piecewise, Warmup
from stagetree.space import GridSpace
from stagetree.torch.examples import DigitsTrainer
from stagetree.tuners import ASHA

MAX_STEPS = 16

space = GridSpace(
    hp={
        "lr": [
            MultiStep(0.1, [8, 12], 0.1),  # step decay x0.1 at steps 8 and 12
            Warmup(2, 0.1).then(MultiStep(0.1, [6, 10], 0.1), at=2),  # warm-up, then decay
            Constant(0.1).then(Exponential(0.1, 0.8), at=4),  # 4 flat steps, then x0.8 a step
            Constant(0.1).then(Cosine(0.1, MAX_STEPS - 4), at=4),  # 4 flat steps, then cosine
        ],
        "batch_size": [64, Piecewise([64, 128], [8])],  # 64, or 64 then 128 from step 8
        "momentum": [0.9, Piecewise([0.5, 0.9], [4])],  # 0.9, or 0.5 then 0.9 from step 4
    },
    fixed={
        "optimizer": ["momentum"],  # SGD with momentum (its value comes from the sequence)
        "hidden": [512],
        "layers": [2],
        "batches_per_step": [8],
        "dropout": [0.1],
        "seed": [0],
    },
)

tuner = ASHA(
    space,
    metric="accuracy",
    mode="max",
    min_steps=1,
    max_steps=MAX_STEPS,
    eta=4,
    num_trials=len(space),
    seed=0,
)

STORAGE = os.environ.get("STAGETREE_STORAGE", "sqlite:///stagetree-demo.db")

study = Study("digits-asha", DigitsTrainer, storage=STORAGE, workers=2)

if __name__ == "__main__":
    from stagetree.cli import report_study

    with study:
        best = study.tune(tuner)
        report_study(study, best, metric="accuracy")
    command = Path(sys.executable).with_name("stagetree")  # this environment's command
    shown = os.path.relpath(command) if command.exists() else "stagetree"
    shown = shown if not shown.startswith("..") else str(command)
    print(f"\nSee its stage tree, learning curves and workers: {shown} dashboard {STORAGE}")
    print(f"Its trials and what sharing saved: {shown} status --storage {STORAGE}")
    print(f"Every trial's metrics: {shown} export --storage {STORAGE} --format csv -o trials.csv")
