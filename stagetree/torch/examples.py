"""Small, real example trainers on scikit-learn's digits: an MLP with dropout and a CNN.

``DigitsTrainer`` is what the tests, the examples and the benchmarks train. It runs on a
CPU in about 2 ms per step with the defaults; raise ``hidden``, ``layers``,
``batches_per_step`` and ``batch_size`` to make a step as slow as a demo needs: on the
2-core development machine (one thread, torch 2.13) ``hidden=512, layers=2,
batches_per_step=20, batch_size=64`` takes about 35 ms a step and ``hidden=1024`` with
``batch_size=128`` about 200 ms. ``DigitsConvTrainer`` is a small CNN with BatchNorm on
the same data, about 11 ms a step with its defaults.

Both are :class:`~stagetree.torch.FusibleTrainer` s (``loss`` is all they write of the
training loop), so sibling trials that differ only in optimizer values can be trained
fused.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stagetree.torch.fused import FusibleTrainer
from stagetree.torch.loader import StageLoader
from stagetree.torch.rng import preserve_rng

__all__ = [
    "DIGITS_CONV_DEFAULTS",
    "DIGITS_DEFAULTS",
    "DigitsConvTrainer",
    "DigitsTrainer",
    "digits_split",
]

#: Fixed hyper-parameters of :class:`DigitsTrainer` and their defaults.
DIGITS_DEFAULTS: dict[str, Any] = {
    "hidden": 64,
    "layers": 1,
    "dropout": 0.1,
    "optimizer": "sgd",
    "weight_decay": 0.0,
    "seed": 0,
    "batches_per_step": 10,
    "batch_size": 32,
    "lr": 0.05,
    "test_fraction": 0.25,
    "device": "cpu",
}

#: Fixed hyper-parameters of :class:`DigitsConvTrainer` and their defaults.
DIGITS_CONV_DEFAULTS: dict[str, Any] = {
    "channels": 16,
    "dropout": 0.0,
    "optimizer": "sgd",
    "weight_decay": 0.0,
    "seed": 0,
    "batches_per_step": 10,
    "batch_size": 32,
    "lr": 0.05,
    "test_fraction": 0.25,
    "device": "cpu",
}

_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


@functools.lru_cache(maxsize=4)
def digits_split(
    test_fraction: float = 0.25,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)`` of scikit-learn's digits.

    Pixels are scaled to ``[0, 1]``. The split is fixed (a permutation with seed 0 drawn
    from a private generator), so every trial sees the same held-out set whatever its seed.
    Cached: treat the tensors as read-only.
    """
    from sklearn.datasets import load_digits

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _mlp(width: int, layers: int, dropout: float) -> nn.Sequential:
    blocks: list[nn.Module] = []
    size = 64
    for _ in range(layers):
        blocks += [nn.Linear(size, width), nn.ReLU(), nn.Dropout(dropout)]
        size = width
    blocks.append(nn.Linear(size, 10))
    return nn.Sequential(*blocks)


def _cnn(channels: int, dropout: float) -> nn.Sequential:
    wide = 2 * channels
    # No bias in the convolutions: BatchNorm would cancel it (its gradient is only
    # rounding noise).
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),  # the 64 pixels as a 1x8x8 image
        nn.Conv2d(1, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, wide, 3, padding=1, bias=False),
        nn.BatchNorm2d(wide),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(wide, 10),
    )


class _DigitsBase(FusibleTrainer):
    """Data, loader, optimizer, loss and metrics of the digits trainers; a subclass
    checks its model settings (:meth:`check_config`) and builds the model
    (:meth:`build_model`)."""

    defaults: ClassVar[dict[str, Any]] = DIGITS_DEFAULTS
    # The fork server imports scikit-learn once for every worker (seconds each).
    warmup_imports = (*FusibleTrainer.warmup_imports, "sklearn.datasets")
    # Construction draws only the model's initial weights (the split is fixed, the
    # loader has its own seeded generator): a trainer built to be restored skips them.
    restore_skips_init = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        unknown = sorted(set(config) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"unknown {type(self).__name__} config keys {unknown}; "
                f"known: {sorted(self.defaults)}"
            )
        c = {**self.defaults, **config}
        if c["optimizer"] not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {c['optimizer']!r}")
        self.check_config(c)
        self.device = torch.device(c["device"])
        self.batches_per_step = int(c["batches_per_step"])
        self.updates_per_step = self.batches_per_step  # the length of FusibleTrainer's loop

        # The first call imports scikit-learn, whose import draws from python's `random`:
        # keep that out of this trainer's streams so construction depends on config only.
        with preserve_rng():
            x_train, y_train, x_test, y_test = digits_split(float(c["test_fraction"]))
        self.x_test = x_test.to(self.device)
        self.y_test = y_test.to(self.device)
        self.loader = StageLoader(
            (x_train.to(self.device), y_train.to(self.device)),
            batch_size=c["batch_size"],
            seed=c["seed"],
        )
        self.model = self.build_model(c).to(self.device)
        lr, decay = float(c["lr"]), float(c["weight_decay"])
        params = self.model.parameters()
        self.optimizer: torch.optim.Optimizer
        if c["optimizer"] == "adam":
            self.optimizer = torch.optim.Adam(params, lr=lr, weight_decay=decay)
        elif c["optimizer"] == "adamw":
            self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=decay)
        else:
            momentum = 0.9 if c["optimizer"] == "momentum" else 0.0
            self.optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)

    def check_config(self, c: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` for invalid model settings in the merged config ``c``."""

    def build_model(self, c: Mapping[str, Any]) -> nn.Module:
        """The model for the merged config ``c`` (its init draws from the trainer's RNG)."""
        raise NotImplementedError

    @classmethod
    def warmup(cls) -> None:
        """Import scikit-learn and cache the default split once per worker process, while
        the other workers start too (leaving every RNG as it was)."""
        super().warmup()
        with preserve_rng():
            digits_split(float(cls.defaults["test_fraction"]))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Augment a training batch; the identity here."""
        return x

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(self.transform(x)), y)

    def evaluate(self) -> dict[str, float]:
        logits = self.model(self.x_test)
        return {
            "accuracy": (logits.argmax(dim=1) == self.y_test).float().mean().item(),
            "loss": F.cross_entropy(logits, self.y_test).item(),
        }


class DigitsTrainer(_DigitsBase):
    """MLP classifier of 8x8 digits; one step = ``batches_per_step`` minibatches.

    Config (fixed hyper-parameters, defaults in :data:`DIGITS_DEFAULTS`):
        hidden: width of each hidden layer.
        layers: number of hidden layers (>= 1).
        dropout: dropout probability after each hidden layer.
        optimizer: ``"sgd"``, ``"momentum"`` (SGD with momentum 0.9), ``"adam"`` or
            ``"adamw"``.
        weight_decay: initial weight decay.
        seed: weight init, dropout and data order.
        batches_per_step: minibatches (optimizer updates) per ``train()`` call.
        batch_size, lr: values used until ``setup`` gives others.
        test_fraction: share of the data held out for ``evaluate``.
        device: torch device of model and data.

    Sequential hyper-parameters accepted by ``setup``: ``lr``, ``momentum`` (``sgd`` and
    ``momentum`` optimizers), ``batch_size``, ``weight_decay`` (and ``betas`` / ``eps``
    for adam and adamw). All but ``batch_size`` are fusible: it is a
    :class:`~stagetree.torch.FusibleTrainer`, whose loop calls :meth:`loss`
    ``batches_per_step`` times a step.

    ``train()`` returns ``{"train_loss": mean training loss of the step}``;
    ``evaluate()`` returns ``{"accuracy", "loss"}`` on the held-out split.

    ``transform(x)`` is applied to every training batch (identity here): override it to add
    augmentation; it may use any RNG, which is checkpointed (fused, it runs inside
    ``vmap``; its random draws are then independent per member).

    Raises:
        ValueError: an unknown config key or an invalid value.
    """

    defaults = DIGITS_DEFAULTS

    def check_config(self, c: Mapping[str, Any]) -> None:
        if int(c["layers"]) < 1 or int(c["hidden"]) < 1 or int(c["batches_per_step"]) < 1:
            raise ValueError("hidden, layers and batches_per_step must be >= 1")

    def build_model(self, c: Mapping[str, Any]) -> nn.Module:
        return _mlp(int(c["hidden"]), int(c["layers"]), float(c["dropout"]))


class DigitsConvTrainer(_DigitsBase):
    """Small CNN classifier of the digits as 1x8x8 images; one step =
    ``batches_per_step`` minibatches.

    The model: conv 3x3 (1 -> ``channels``, no bias) + BatchNorm + ReLU, conv 3x3
    (``channels`` -> ``2 * channels``, no bias) + BatchNorm + ReLU, global average
    pooling, dropout, linear -> 10.

    Config: as :class:`DigitsTrainer`'s, defaults in :data:`DIGITS_CONV_DEFAULTS`, with
    ``channels`` instead of ``hidden`` and ``layers``; ``dropout`` (before the last
    layer) is 0 by default. Sequential hyper-parameters, metrics and ``transform`` as
    :class:`DigitsTrainer`'s; fused, each member keeps its own BatchNorm statistics.

    Raises:
        ValueError: an unknown config key or an invalid value.
    """

    defaults = DIGITS_CONV_DEFAULTS

    def check_config(self, c: Mapping[str, Any]) -> None:
        if int(c["channels"]) < 1 or int(c["batches_per_step"]) < 1:
            raise ValueError("channels and batches_per_step must be >= 1")

    def build_model(self, c: Mapping[str, Any]) -> nn.Module:
        return _cnn(int(c["channels"]), float(c["dropout"]))
