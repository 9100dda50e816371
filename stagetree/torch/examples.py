"""A small, real example trainer: an MLP with dropout on scikit-learn's digits.

``DigitsTrainer`` is what the tests, the examples and the benchmarks train. It runs on a
CPU in about 15 ms per step with the defaults; raise ``hidden``, ``layers``,
``batches_per_step`` and ``batch_size`` to make a step as slow as a demo needs: on the
2-core development machine (one thread) ``hidden=512, layers=2, batches_per_step=20,
batch_size=64`` takes about 90 ms a step and ``hidden=1024`` with ``batch_size=128`` about
300 ms.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stagetree.torch.loader import StageLoader
from stagetree.torch.rng import preserve_rng
from stagetree.torch.trainer import TorchTrainer

__all__ = ["DIGITS_DEFAULTS", "DigitsTrainer", "digits_split"]

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

_OPTIMIZERS = ("sgd", "momentum", "adam")


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


class DigitsTrainer(TorchTrainer):
    """MLP classifier of 8x8 digits; one step = ``batches_per_step`` minibatches.

    Config (fixed hyper-parameters, defaults in :data:`DIGITS_DEFAULTS`):
        hidden: width of each hidden layer.
        layers: number of hidden layers (>= 1).
        dropout: dropout probability after each hidden layer.
        optimizer: ``"sgd"``, ``"momentum"`` (SGD with momentum 0.9) or ``"adam"``.
        weight_decay: initial weight decay.
        seed: weight init, dropout and data order.
        batches_per_step: minibatches per ``train()`` call.
        batch_size, lr: values used until ``setup`` gives others.
        test_fraction: share of the data held out for ``evaluate``.
        device: torch device of model and data.

    Sequential hyper-parameters accepted by ``setup``: ``lr``, ``momentum`` (``sgd`` and
    ``momentum`` optimizers), ``batch_size``, ``weight_decay`` (and ``betas`` for adam).

    ``train()`` returns ``{"train_loss": mean training loss of the step}``;
    ``evaluate()`` returns ``{"accuracy", "loss"}`` on the held-out split.

    ``transform(x)`` is applied to every training batch (identity here): override it to add
    augmentation; it may use any RNG, which is checkpointed.

    Raises:
        ValueError: an unknown config key or an invalid value.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        unknown = sorted(set(config) - set(DIGITS_DEFAULTS))
        if unknown:
            raise ValueError(
                f"unknown DigitsTrainer config keys {unknown}; known: {sorted(DIGITS_DEFAULTS)}"
            )
        c = {**DIGITS_DEFAULTS, **config}
        if c["optimizer"] not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {c['optimizer']!r}")
        if int(c["layers"]) < 1 or int(c["hidden"]) < 1 or int(c["batches_per_step"]) < 1:
            raise ValueError("hidden, layers and batches_per_step must be >= 1")
        self.device = torch.device(c["device"])
        self.batches_per_step = int(c["batches_per_step"])

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
        self.model = _mlp(int(c["hidden"]), int(c["layers"]), float(c["dropout"])).to(self.device)
        lr, decay = float(c["lr"]), float(c["weight_decay"])
        params = self.model.parameters()
        self.optimizer: torch.optim.Optimizer
        if c["optimizer"] == "adam":
            self.optimizer = torch.optim.Adam(params, lr=lr, weight_decay=decay)
        else:
            momentum = 0.9 if c["optimizer"] == "momentum" else 0.0
            self.optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)

    @classmethod
    def warmup(cls) -> None:
        """Import scikit-learn and cache the default split once per worker process, while
        the other workers start too (leaving every RNG as it was)."""
        with preserve_rng():
            digits_split(float(DIGITS_DEFAULTS["test_fraction"]))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Augment a training batch; the identity here."""
        return x

    def train(self) -> dict[str, float]:
        self.model.train()
        total = torch.zeros((), device=self.device)
        for _ in range(self.batches_per_step):
            x, y = self.loader.next_batch()
            loss = F.cross_entropy(self.model(self.transform(x)), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += loss.detach()
        return {"train_loss": total.item() / self.batches_per_step}

    def evaluate(self) -> dict[str, float]:
        logits = self.model(self.x_test)
        return {
            "accuracy": (logits.argmax(dim=1) == self.y_test).float().mean().item(),
            "loss": F.cross_entropy(logits, self.y_test).item(),
        }
