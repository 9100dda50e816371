"""Optimizers over B stacked copies of a model, each copy with its own hyper-parameters
(issue 12, horizontal fusion; the first piece).

A fused job trains B sibling stages at once: their parameters are stacked along a new
leading dimension (``torch.func.stack_module_state``), one backward gives every
member's gradients, and one optimizer step updates them all. The members differ only in
*fusible* hyper-parameters (optimizer scalars), held here as tensors of shape ``[B]``
and broadcast over each parameter's trailing dimensions, so one step is one set of
tensor operations whatever B is.

The update rules are PyTorch's (``torch.optim.SGD`` with momentum, dampening, Nesterov
and weight decay; ``torch.optim.Adam`` and ``AdamW``; no ``amsgrad``, ``maximize`` or
complex parameters), member by member: member ``b`` of a fused step equals a
``torch.optim`` step of that member alone with ``b``'s values, up to the rounding of
reassociated floating-point operations (``tests/test_torch_fused_optim.py`` bounds it).
:meth:`FusedOptimizer.member_state` gives member ``b``'s state in ``torch.optim``'s own
``state_dict`` layout, so that a member leaving the fused job continues as an ordinary
optimizer (:meth:`FusedOptimizer.load_member` is the way back in).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["FusedAdam", "FusedOptimizer", "FusedSGD"]


def _column(values: Any, size: int, name: str) -> torch.Tensor:
    """``values`` (a number, or one per member) as a float64 tensor of shape ``[size]``.

    Raises:
        ValueError: a wrong count, or a value that is not a finite number >= 0.
    """
    t = torch.as_tensor(values, dtype=torch.float64).flatten()
    if t.numel() == 1:
        t = t.expand(size).clone()
    if t.numel() != size:
        raise ValueError(f"{name}: {t.numel()} values for {size} fused members")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"{name} must be finite and >= 0 for every member, got {t.tolist()}")
    return t


class FusedOptimizer:
    """The contract of an optimizer over stacked parameters.

    Args:
        params: name -> a leaf tensor of shape ``[B, ...]`` (member ``b``'s parameter is
            ``params[name][b]``); its ``.grad`` (same shape) is what :meth:`step` applies.
        **hp: hyper-parameters, each a number (every member) or B numbers.

    Subclasses define :attr:`HP` (names and defaults), :meth:`_update` (one step of one
    stacked parameter) and the per-parameter state they keep.
    """

    HP: Mapping[str, float] = {}

    def __init__(self, params: Mapping[str, torch.Tensor], **hp: Any) -> None:
        if not params:
            raise ValueError("no parameters to optimize")
        sizes = {p.shape[0] for p in params.values() if p.dim() > 0}
        if len(sizes) != 1 or any(p.dim() == 0 for p in params.values()):
            raise ValueError("every stacked parameter needs the same leading size B")
        unknown = set(hp) - set(self.HP)
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no hyper-parameter {sorted(unknown)} "
                f"(it has {sorted(self.HP)})"
            )
        self.params = dict(params)
        self.size = sizes.pop()
        self.hp: dict[str, torch.Tensor] = {}
        for name, default in self.HP.items():
            self.set_hp(name, hp.get(name, default))
        self.state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.params}
        self.steps = torch.zeros(self.size, dtype=torch.float64)  # per member

    def set_hp(self, name: str, values: Any) -> None:
        """Set one hyper-parameter for every member (a number) or each (B numbers)."""
        if name not in self.HP:
            raise ValueError(f"{type(self).__name__} has no hyper-parameter {name!r}")
        self.hp[name] = _column(values, self.size, name)

    def _scale(self, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``[B]`` values shaped to broadcast over a stacked parameter like ``like``."""
        return values.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))

    @torch.no_grad()
    def step(self) -> None:
        """One step of every member from the parameters' ``.grad`` (members whose
        gradient is None for a parameter are left as they are there)."""
        self.steps += 1
        for name, p in self.params.items():
            if p.grad is not None:
                self._update(name, p, p.grad)

    def _update(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def member_state(self, b: int) -> dict[str, dict[str, Any]]:
        """Member ``b``'s state per parameter name, as ``torch.optim`` keeps it."""
        raise NotImplementedError

    def load_member(self, b: int, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Set member ``b``'s state from :meth:`member_state`'s layout."""
        raise NotImplementedError


class FusedSGD(FusedOptimizer):
    """``torch.optim.SGD`` per member: ``lr``, ``momentum``, ``dampening``,
    ``weight_decay`` as [B] values; ``nesterov`` for all (as a structural choice).

    A member with momentum 0 keeps no buffer in effect (its update is its gradient), as
    ``torch.optim.SGD`` does; its slot of the stacked buffer is kept at its last
    gradient only to keep the step one operation.
    """

    HP = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0}

    def __init__(
        self, params: Mapping[str, torch.Tensor], nesterov: bool = False, **hp: Any
    ) -> None:
        super().__init__(params, **hp)
        self.nesterov = bool(nesterov)

    def _update(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        wd = self._scale(self.hp["weight_decay"], p)
        d_p = grad + wd * p if bool((self.hp["weight_decay"] > 0).any()) else grad
        momentum = self._scale(self.hp["momentum"], p)
        has = self._scale((self.hp["momentum"] > 0).to(torch.float64), p) > 0
        state = self.state[name]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = d_p.detach().clone()
        else:
            damp = self._scale(1.0 - self.hp["dampening"], p)
            buf.mul_(momentum).add_(d_p * damp)
        if self.nesterov:
            step = torch.where(has, d_p + momentum * buf, d_p)
        else:
            step = torch.where(has, buf, d_p)
        p.sub_(self._scale(self.hp["lr"], p) * step)

    def member_state(self, b: int) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name in self.params:
            buf = self.state[name].get("momentum_buffer")
            if buf is None or float(self.hp["momentum"][b]) <= 0:
                out[name] = {"momentum_buffer": None}  # torch.optim keeps none either
            else:
                out[name] = {"momentum_buffer": buf[b].clone()}
        return out

    def load_member(self, b: int, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, p in self.params.items():
            buf = state.get(name, {}).get("momentum_buffer")
            if buf is None:
                continue
            stacked = self.state[name].get("momentum_buffer")
            if stacked is None:
                stacked = self.state[name]["momentum_buffer"] = torch.zeros_like(p)
            stacked[b].copy_(buf)


class FusedAdam(FusedOptimizer):
    """``torch.optim.Adam`` (``decoupled=False``) or ``AdamW`` (``decoupled=True``) per
    member: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` as [B] values."""

    HP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}

    def __init__(
        self, params: Mapping[str, torch.Tensor], decoupled: bool = False, **hp: Any
    ) -> None:
        super().__init__(params, **hp)
        self.decoupled = bool(decoupled)
        for name in ("beta1", "beta2"):
            if bool((self.hp[name] >= 1).any()):
                raise ValueError(f"{name} must be < 1 for every member")

    def _update(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        hp, s = self.hp, self.state[name]
        if "exp_avg" not in s:
            s["exp_avg"] = torch.zeros_like(p)
            s["exp_avg_sq"] = torch.zeros_like(p)
        lr, wd = self._scale(hp["lr"], p), self._scale(hp["weight_decay"], p)
        if self.decoupled:
            p.mul_(1 - lr * wd)
        else:
            grad = grad + wd * p
        beta1, beta2 = self._scale(hp["beta1"], p), self._scale(hp["beta2"], p)
        s["exp_avg"].lerp_(grad, 1 - beta1)
        s["exp_avg_sq"].mul_(beta2).add_((1 - beta2) * grad * grad)
        # Bias corrections in float64 per member, as torch.optim computes them in Python.
        steps = self.steps
        correction1 = 1 - hp["beta1"] ** steps
        correction2_sqrt = (1 - hp["beta2"] ** steps).sqrt()
        step_size = self._scale(hp["lr"] / correction1, p)
        denom = (s["exp_avg_sq"].sqrt() / self._scale(correction2_sqrt, p)).add_(
            self._scale(hp["eps"], p)
        )
        p.sub_(step_size * (s["exp_avg"] / denom))

    def member_state(self, b: int) -> dict[str, dict[str, Any]]:
        step = torch.tensor(float(self.steps[b]))
        return {
            name: {
                "step": step.clone(),
                "exp_avg": s["exp_avg"][b].clone(),
                "exp_avg_sq": s["exp_avg_sq"][b].clone(),
            }
            for name, s in self.state.items()
            if "exp_avg" in s
        }

    def load_member(self, b: int, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, p in self.params.items():
            member = state.get(name)
            if not member:
                continue
            s = self.state[name]
            if "exp_avg" not in s:
                s["exp_avg"] = torch.zeros_like(p)
                s["exp_avg_sq"] = torch.zeros_like(p)
            s["exp_avg"][b].copy_(member["exp_avg"])
            s["exp_avg_sq"][b].copy_(member["exp_avg_sq"])
            self.steps[b] = float(member["step"])
