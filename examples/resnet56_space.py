"""ResNet-56 on CIFAR-10: the search space of the Hippo paper, Table 2 (reconstructed).

One step is one epoch; every trial trains 120 epochs. The grid is the paper's full
product: 5 learning-rate schedules x 2 batch-size schedules x 2 momentum schedules
(sequential) x 2 weight decays x 3 optimizers (fixed) = 120 trials in 6 plan trees.

See how much of it is shared before training anything::

    stagetree explain examples/resnet56_space.py
"""

from __future__ import annotations

from stagetree.hp import (
    Constant,
    CosineWarmRestarts,
    Cyclic,
    Exponential,
    MultiStep,
    Piecewise,
    Warmup,
)
from stagetree.space import GridSpace

name = "resnet56-cifar10"

learning_rates = [
    # Step decay: 0.1, x0.1 at epochs 90 and 135 (the second milestone lies past the
    # 120 epochs trained here, as in the paper's schedule).
    MultiStep(0.1, [90, 135], 0.1),
    # 5 warm-up epochs from 0 to 0.1, then the same step decay; the decay counts its
    # steps from epoch 5, so milestones 85/130 are the absolute epochs 90/135.
    Warmup(5, 0.1).then(MultiStep(0.1, [85, 130], 0.1), at=5),
    # 5 warm-up epochs to 0.1, then exponential decay by 0.95 per epoch.
    Warmup(5, 0.1).then(Exponential(0.1, 0.95), at=5),
    # 10 warm-up epochs to 0.1, then cosine annealing with warm restarts every 20 epochs.
    Warmup(10, 0.1).then(CosineWarmRestarts(0.1, t_0=20), at=10),
    # Cyclical learning rate between 0.001 and 0.1, 20 epochs up and 20 down.
    Cyclic(0.001, 0.1, step_size_up=20),
]

batch_sizes = [
    Constant(128),  # batch size 128 throughout
    Piecewise([128, 256], [70]),  # 128, doubled to 256 at epoch 70
]

momenta = [
    Constant(0.9),  # momentum 0.9 throughout
    Piecewise([0.7, 0.8, 0.9], [40, 80]),  # 0.7, 0.8 from epoch 40, 0.9 from epoch 80
]

space = GridSpace(
    hp={"lr": learning_rates, "batch_size": batch_sizes, "momentum": momenta},
    fixed={
        "weight_decay": [1e-4, 1e-3],  # L2 penalty, fixed for the whole run
        # Adam ignores the SGD momentum schedule in reality (its betas play that role),
        # so the 4 batch-size x momentum variants of Adam are partly redundant; the
        # paper's grid keeps the full product and so do we.
        "optimizer": ["adam", "sgd", "sgd_momentum"],
    },
)

steps = 120  # epochs per trial
