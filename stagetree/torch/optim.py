"""Set optimizer hyper-parameters between steps.

PyTorch optimizers read their hyper-parameters from ``optimizer.param_groups`` at every
``step()``, so a sequential hyper-parameter is applied by writing the new value into
every param group. :func:`set_optimizer_hp` does that with validation, and refuses names
the optimizer does not have instead of silently storing a value nothing reads.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

__all__ = ["OPTIMIZER_HP", "set_optimizer_hp"]

#: Hyper-parameter names :meth:`TorchTrainer.setup` forwards to every optimizer.
OPTIMIZER_HP: frozenset[str] = frozenset(
    {"lr", "momentum", "weight_decay", "betas", "beta1", "beta2", "dampening", "eps", "rho"}
)

_NON_NEGATIVE = ("lr", "momentum", "weight_decay", "dampening", "eps")


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"optimizer hyper-parameter {name!r} must be a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"optimizer hyper-parameter {name!r} must be finite, got {value!r}")
    return result


def _beta(name: str, value: Any) -> float:
    result = _scalar(name, value)
    if not 0.0 <= result < 1.0:
        raise ValueError(f"optimizer hyper-parameter {name!r} must be in [0, 1), got {value!r}")
    return result


def _coerce(name: str, value: Any) -> Any:
    if name in _NON_NEGATIVE:
        result = _scalar(name, value)
        if result < 0.0:
            raise ValueError(f"optimizer hyper-parameter {name!r} must be >= 0, got {value!r}")
        return result
    if name == "rho":  # Adadelta's decay: rho = 1 keeps the averages as they are
        result = _scalar(name, value)
        if not 0.0 <= result <= 1.0:
            raise ValueError(f"optimizer hyper-parameter {name!r} must be in [0, 1], got {value!r}")
        return result
    if name == "betas":
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
            raise ValueError(f"'betas' must be a pair (beta1, beta2), got {value!r}")
        return (_beta("beta1", value[0]), _beta("beta2", value[1]))
    # Other param-group entries: plain python values keep checkpoints weights_only-loadable.
    return value.item() if isinstance(value, np.generic) else value


def _assign(group: dict[str, Any], name: str, value: Any) -> None:
    current = group[name]
    # Tensor-valued entries (capturable / fused optimizers) are updated in place.
    if isinstance(current, torch.Tensor) and isinstance(value, float):
        current.fill_(value)
    elif (
        name == "betas"
        and isinstance(current, (tuple, list))
        and any(isinstance(b, torch.Tensor) for b in current)
    ):
        group[name] = tuple(
            old.fill_(new) if isinstance(old, torch.Tensor) else new
            for old, new in zip(current, value)
        )
    else:
        group[name] = value


def set_optimizer_hp(optimizer: torch.optim.Optimizer, **values: Any) -> None:
    """Write hyper-parameter values into every param group of ``optimizer``.

    Known names are validated: ``lr``, ``momentum``, ``weight_decay``, ``dampening`` and
    ``eps`` must be finite numbers >= 0; ``betas`` a pair in ``[0, 1)``; ``beta1`` /
    ``beta2`` replace one element of ``betas``. Any other name is accepted when every param
    group already has it (e.g. ``alpha`` of RMSprop). Nothing is written unless every
    value is valid.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        **values: hyper-parameter name -> new value.

    Raises:
        ValueError: the optimizer has no such hyper-parameter (``momentum`` on Adam,
            ``betas`` on SGD), ``betas`` given together with ``beta1``/``beta2``, or a
            value is invalid.
    """
    if not values:
        return
    groups = optimizer.param_groups
    kind = type(optimizer).__name__

    def require(name: str) -> None:
        if name == "params" or not all(name in group for group in groups):
            known = sorted({k for group in groups for k in group if k != "params"})
            raise ValueError(
                f"{kind} has no hyper-parameter {name!r}; its hyper-parameters are "
                + ", ".join(known)
            )

    updates: dict[str, Any] = {}
    single_betas: dict[int, float] = {}
    for name, value in values.items():
        if name in ("beta1", "beta2"):
            require("betas")
            single_betas[int(name[-1]) - 1] = _beta(name, value)
        else:
            require(name)
            updates[name] = _coerce(name, value)
    if single_betas and "betas" in updates:
        raise ValueError("give either 'betas' or 'beta1'/'beta2', not both")

    for group in groups:
        for name, value in updates.items():
            _assign(group, name, value)
        if single_betas:
            current = group["betas"]
            plain = [float(b) if isinstance(b, torch.Tensor) else b for b in current]
            for index, beta in single_betas.items():
                plain[index] = beta
            _assign(group, "betas", (plain[0], plain[1]))
