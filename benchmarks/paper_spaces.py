"""The Hippo paper's search spaces, rebuilt to its Table 1's trial counts and merge rates.

The paper (Hippo, its Tables 2-4) lists "examples from the search space" of each study:
the function families of the learning rate, the warm-ups, milestones, batch-size,
momentum and sequence-length schedules. Its Table 1 gives what the whole space must
come to: the number of trials and the merge rate p over the whole space (every trial
trained to its full length; total steps / unique steps, :func:`whole_space_merge_rate`):

============================  ======  ========  =====================================
study                         trials  p paper   here (``tests/test_paper_spaces.py``)
============================  ======  ========  =====================================
ResNet-56, SHA and ASHA          448     2.447   448, 2.458 (+0.45 %)
MobileNetV2, grid                240     3.144   240, 3.144 (+0.00 %)
BERT-Base, grid                   40     2.045    40, 2.043 (-0.11 %)
============================  ======  ========  =====================================

What the tables leave out was chosen so that both figures match; every choice is below.
The milestones that are not the paper's (marked *chosen*) were picked, among multiples of
5 or 10 epochs, as the ones that bring p closest to Table 1 (a small search over them,
with the listed families fixed). Fixed hyper-parameters (weight decay, optimizer, model)
select the plan tree: trials with different values never share a step.

ResNet-56 / CIFAR-10 (:func:`resnet56_space`; one step = one epoch, 120 epochs):

* learning rate, 7 schedules: the 5 of Table 2 as ``examples/resnet56_space.py``
  reconstructs them (step decay x0.1 at 90/135; 5 warm-up epochs then the same step
  decay; 5 warm-up epochs then exponential x0.95 per epoch; 10 warm-up epochs then
  cosine with warm restarts every 20; cyclic 0.001-0.1, 20 epochs up) and 2 more of
  the same families: step decay at 60/90 (it shares its first 60 epochs with the
  90/135 one) and cosine from 0.1 to 0 over the 120 epochs.
* batch size, 4 schedules: 128; 128 then 256 from 70 (Table 2); 128 then 256 from 90
  (*chosen*); 128, 256 from 90, 512 from 115 (*chosen*).
* momentum, 4 schedules: 0.9; 0.7, 0.8 from 40, 0.9 from 80 (Table 2); 0.8 then 0.9
  from 40 (*chosen*); 0.85 then 0.95 from 80 (*chosen*).
* fixed: weight decay {1e-4, 1e-3} (Table 2) x optimizer {SGD with momentum, Nesterov}:
  Table 2's Adam is left out, as Adam ignores the momentum schedule being searched (its
  16 batch-size x momentum variants would be 4 distinct trials) and 448 = 7 x 4 x 4 x 4
  has no factor 3.
* 7 x 4 x 4 x 2 x 2 = 448 trials: the tuners (SHA, ASHA with 448 trials) draw the
  whole space, in a seeded order.
* Among the completions within 1 % of p (a search over the two extra learning rates,
  the chosen milestones and the momentum starts), this one also gives SHA's explored
  subset the paper's merge rate: 4.16 in ``paper_studies.py`` (paper 4.23). Its 4
  momentum schedules start at 4 different values, so the first rung (15 epochs) shares
  less, while the batch-size changes come late (90, 115), so full-length trials still
  share enough. An earlier completion (momentum mostly 0.9 until epoch 60, batch-size
  changes at 40) had the same p but an explored merge rate of 6.84.

MobileNetV2 / CIFAR-10, grid search (:func:`mobilenetv2_space`; 120 epochs):

* learning rate, 5 schedules: 5 warm-up epochs to 0.05 (Table 3's warm-up), then step
  decay x0.1 at a first milestone d and again at d + 30, d in {30, 45, 60, 75, 90}
  (*chosen*). A merge rate of 3.14 over the whole grid needs the learning rates to agree
  for a long prefix: with Table 3's differing families after one common warm-up
  (step, exponential, cosine, linear, warm restarts) the best reachable p is 2.47,
  whatever the batch-size and momentum milestones; milestones of one step-decay family
  give 3.14.
* batch size, 3 schedules: 128; 128 then 256 from 30; 128 then 256 from 70 (*chosen*).
* momentum, 2 schedules: 0.9; 0.9 then 0.95 from 110 (*chosen*).
* fixed: weight decay {4e-5, 1e-4, 4e-4, 1e-3} x optimizer {SGD, Nesterov} (8 plan
  trees): 5 x 3 x 2 x 4 x 2 = 240. (With 4 plan trees of 60 trials, p can match as
  well, but each tree's 30-epoch trunk then keeps 36 of 40 devices idle for the first
  30 epochs: the end-to-end time is bound by the trees' shape, see
  ``paper_studies.depth_bound``.)

BERT-Base, grid search (:func:`bert_space`; 27,000 steps in units of
:data:`BERT_STEP_UNIT` = 100 steps, :data:`BERT_UNITS` = 270 units; every milestone is a
multiple of 100 steps, so p in units equals p in steps):

* learning rate, 10 schedules: peak {1e-4, 5e-5} reached by a linear warm-up over the
  first 10 % (2,700 steps, Table 4), then 5 decays: linear to 0, cosine, constant, x0.1
  at half of the rest, x0.1 at 80 % of the rest.
* sequence length, 2 schedules: 128; 128 then 512 from step 16,000 (*chosen*; Table 4's
  two-phase schedule, short sequences first).
* batch size, 2 schedules: 256; 256 then 512 from step 8,000 (*chosen*).
* fixed: one model, ``bert-base-uncased``: 10 x 2 x 2 = 40 trials.

ResNet-20 multi-study (:func:`resnet20_space`; the paper's Figures 13-14: 144 trials per
study, learning rate and batch size as sequences; the paper does not give the studies'
spaces, only their k-wise merge rates, which differ between its two sets of studies):
12 learning-rate schedules (step decay x0.1 at {40, 60, 80, 100} then 30 epochs later,
each at peak {0.1, 0.05, 0.2}) x 24 batch-size schedules (128, then 256 from one of 23
epochs {5, 10, ..., 115}) = 288 trials, of which each study draws 144 with its own seed.

ResNet-20 of the TreeML thesis's scheduler comparison (:func:`treeml_space`; learning
rate and batch size as sequences, merge rate 3.55; the thesis does not list the space):
step decay from 0.1, x0.1 at d and d + 30 for d in {50, 60, ..., 110} (7) x batch size
128, or 128 then 256 from one of {60, 70, ..., 110} (7), the grid repeated for 3 weight
decays {1e-4, 5e-4, 1e-3} (fixed): 147 trials, p = 3.542 (-0.2 %).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stagetree.hp import (  # noqa: E402
    Constant,
    Cosine,
    CosineWarmRestarts,
    Cyclic,
    Exponential,
    Linear,
    MultiStep,
    Piecewise,
    Sequence,
    Warmup,
)
from stagetree.space import GridSpace, TrialSpec  # noqa: E402
from stagetree.stages import merge_rate  # noqa: E402

__all__ = [
    "BERT_STEP_UNIT",
    "BERT_UNITS",
    "BERT_WARMUP",
    "EPOCHS",
    "PAPER_MERGE_RATES",
    "TREEML_MERGE_RATE",
    "bert_space",
    "mobilenetv2_space",
    "resnet20_space",
    "resnet56_space",
    "treeml_space",
    "whole_space_merge_rate",
]

EPOCHS = 120  # ResNet-56, MobileNetV2 and ResNet-20 trials: 120 epochs at most
BERT_STEP_UNIT = 100  # simulated BERT steps are units of 100 training steps
BERT_UNITS = 270  # 27,000 steps
BERT_WARMUP = 27  # 10 % linear warm-up

# Table 1: study -> (trials, whole-space merge rate p).
PAPER_MERGE_RATES: dict[str, tuple[int, float]] = {
    "ResNet-56": (448, 2.447),
    "MobileNetV2": (240, 3.144),
    "BERT-Base": (40, 2.045),
}
TREEML_MERGE_RATE = 3.55  # the thesis's ResNet-20 space


def whole_space_merge_rate(trials: Iterable[TrialSpec], steps: int) -> float:
    """Table 1's p: total steps / unique steps of ``trials``, each trained ``steps``.

    Trials with different fixed hyper-parameters are in different plan trees (their
    root keys differ) and share nothing.
    """
    return merge_rate((t.root_key(), t.hp, steps) for t in trials)


def resnet56_space() -> GridSpace:
    """ResNet-56 / CIFAR-10: 448 trials, p = 2.458 (see the module docstring)."""
    learning_rates: list[Sequence] = [
        MultiStep(0.1, [90, 135], 0.1),
        Warmup(5, 0.1).then(MultiStep(0.1, [85, 130], 0.1), at=5),
        Warmup(5, 0.1).then(Exponential(0.1, 0.95), at=5),
        Warmup(10, 0.1).then(CosineWarmRestarts(0.1, t_0=20), at=10),
        Cyclic(0.001, 0.1, step_size_up=20),
        MultiStep(0.1, [60, 90], 0.1),
        Cosine(0.1, EPOCHS),
    ]
    batch_sizes: list[Sequence] = [
        Constant(128),
        Piecewise([128, 256], [70]),
        Piecewise([128, 256], [90]),
        Piecewise([128, 256, 512], [90, 115]),
    ]
    momenta: list[Sequence] = [
        Constant(0.9),
        Piecewise([0.7, 0.8, 0.9], [40, 80]),
        Piecewise([0.8, 0.9], [40]),
        Piecewise([0.85, 0.95], [80]),
    ]
    return GridSpace(
        hp={"lr": learning_rates, "batch_size": batch_sizes, "momentum": momenta},
        fixed={"weight_decay": [1e-4, 1e-3], "optimizer": ["sgd_momentum", "nesterov"]},
    )


def mobilenetv2_space() -> GridSpace:
    """MobileNetV2 / CIFAR-10: 240 trials, p = 3.144 (see the module docstring)."""
    warm = 5
    learning_rates: list[Sequence] = [
        Warmup(warm, 0.05).then(MultiStep(0.05, [d - warm, d + 30 - warm], 0.1), at=warm)
        for d in (30, 45, 60, 75, 90)
    ]
    return GridSpace(
        hp={
            "lr": learning_rates,
            "batch_size": [
                Constant(128),
                Piecewise([128, 256], [30]),
                Piecewise([128, 256], [70]),
            ],
            "momentum": [Constant(0.9), Piecewise([0.9, 0.95], [110])],
        },
        fixed={"weight_decay": [4e-5, 1e-4, 4e-4, 1e-3], "optimizer": ["sgd", "nesterov"]},
    )


def bert_space() -> GridSpace:
    """BERT-Base: 40 trials of :data:`BERT_UNITS` units, p = 2.043 (see the module
    docstring)."""
    rest = BERT_UNITS - BERT_WARMUP
    learning_rates: list[Sequence] = []
    for peak in (1e-4, 5e-5):
        warm = Warmup(BERT_WARMUP, peak)
        for decay in (
            Linear(peak, 0.0, rest),
            Cosine(peak, rest),
            Constant(peak),
            MultiStep(peak, [rest // 2], 0.1),
            MultiStep(peak, [int(rest * 0.8)], 0.1),
        ):
            learning_rates.append(warm.then(decay, at=BERT_WARMUP))
    return GridSpace(
        hp={
            "lr": learning_rates,
            "seq_len": [Constant(128), Piecewise([128, 512], [16_000 // BERT_STEP_UNIT])],
            "batch_size": [Constant(256), Piecewise([256, 512], [8_000 // BERT_STEP_UNIT])],
        },
        fixed={"model": ["bert-base-uncased"]},
    )


def resnet20_space() -> GridSpace:
    """ResNet-20 / CIFAR-10 for the multi-study runs: 288 trials (lr x batch size as
    sequences), from which each study draws 144 (see the module docstring)."""
    learning_rates: list[Sequence] = [
        MultiStep(peak, [d, d + 30], 0.1) for peak in (0.1, 0.05, 0.2) for d in (40, 60, 80, 100)
    ]
    batch_sizes: list[Sequence] = [Constant(128)] + [
        Piecewise([128, 256], [at]) for at in range(5, EPOCHS, 5)
    ]
    return GridSpace(
        hp={"lr": learning_rates, "batch_size": batch_sizes},
        fixed={"weight_decay": [1e-4], "optimizer": ["sgd_momentum"]},
    )


def treeml_space() -> GridSpace:
    """ResNet-20 of the TreeML thesis's scheduler comparison: 147 trials, p = 3.542 (see
    the module docstring)."""
    learning_rates: list[Sequence] = [MultiStep(0.1, [d, d + 30], 0.1) for d in range(50, 120, 10)]
    batch_sizes: list[Sequence] = [Constant(128)] + [
        Piecewise([128, 256], [at]) for at in range(60, EPOCHS, 10)
    ]
    return GridSpace(
        hp={"lr": learning_rates, "batch_size": batch_sizes},
        fixed={"weight_decay": [1e-4, 5e-4, 1e-3], "optimizer": ["sgd_momentum"]},
    )
