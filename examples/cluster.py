"""The digits study on a Ray cluster.

Start Ray (``ray start --head`` here, ``ray start --address HEAD:6379`` on the other
machines), then run, from any machine of the cluster::

    stagetree run examples/cluster.py --address auto \\
        --storage postgresql://user@dbhost/stagetree --checkpoints /shared/stagetree-ckpt

or ``python examples/cluster.py`` with ``STAGETREE_STORAGE``, ``STAGETREE_CHECKPOINTS``
and ``RAY_ADDRESS`` set. Without a cluster it starts a one-machine Ray. The plan lives
in PostgreSQL when workers span machines (SQLite for one machine); the checkpoints in a
location every node reaches.
"""

from __future__ import annotations

import os

from stagetree import Study
from stagetree.executors import RayExecutor
from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.space import GridSpace
from stagetree.torch.examples import DigitsTrainer
from stagetree.tuners import ASHA

MAX_STEPS = 16

space = GridSpace(
    hp={
        "lr": [MultiStep(0.1, [8, 12], 0.1), Constant(0.1), MultiStep(0.1, [4], 0.5)],
        "batch_size": [64, Piecewise([64, 128], [8])],
        "momentum": [0.9, Piecewise([0.5, 0.9], [4])],
    },
    fixed={
        "optimizer": ["momentum"],
        "hidden": [256],
        "batches_per_step": [8],
        "seed": [0],
    },
)

tuner = ASHA(
    space,
    metric="accuracy",
    mode="max",
    min_steps=1,
    max_steps=MAX_STEPS,
    num_trials=len(space),
    seed=0,
)

study = Study(
    "digits-cluster",
    DigitsTrainer,
    storage=os.environ.get("STAGETREE_STORAGE", "sqlite:///stagetree-cluster.db"),
    checkpoint_dir=os.environ.get("STAGETREE_CHECKPOINTS"),
    # One worker per CPU of the cluster (use {"GPU": 1} on GPU nodes).
    executor=RayExecutor(address=os.environ.get("RAY_ADDRESS"), worker_resources={"CPU": 1}),
    threads_per_worker=1,
)

if __name__ == "__main__":
    from stagetree.cli import report_study

    with study:
        best = study.tune(tuner)
        report_study(study, best, metric="accuracy")
