"""Optimizers over B stacked copies of a model, each copy with its own hyper-parameters
(issue 12, horizontal fusion; the first piece).

A fused job trains B sibling stages at once: their parameters are stacked along a new
leading dimension (``torch.func.stack_module_state``), one backward gives every
member's gradients, and one optimizer step updates them all. The members differ only in
*fusible* hyper-parameters (optimizer scalars), held here as tensors of shape ``[B]``
and broadcast over each parameter's trailing dimensions, so one step is one set of
tensor operations whatever B is.

The update rules are PyTorch's (``torch.optim.SGD`` with momentum, dampening, Nesterov
and weight decay; ``torch.optim.Adam`` and ``AdamW``; ``torch.optim.Adadelta``; no
``amsgrad``, ``maximize`` or complex parameters), member by member: member ``b`` of a
fused step equals a ``torch.optim`` step of that member alone with ``b``'s values, up to
the rounding of reassociated floating-point operations
(``tests/pytorch/test_torch_fused_optim.py`` bounds it).
:meth:`FusedOptimizer.member_state` gives member ``b``'s state in ``torch.optim``'s own
``state_dict`` layout, so that a member leaving the fused job continues as an ordinary
optimizer (:meth:`FusedOptimizer.load_member` is the way back in).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["FusedAdadelta", "FusedAdam", "FusedOptimizer", "FusedSGD"]


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
        # [B] columns already cast and shaped for a parameter's (name, dtype, device,
        # dim): rebuilt only when a value changes, so that a step on an accelerator
        # does not copy every hyper-parameter to it for every parameter.
        self._columns: dict[tuple[str, torch.dtype, torch.device, int], torch.Tensor] = {}
        self._flags: dict[str, bool] = {}  # facts about the values, e.g. "any weight decay"
        for name, default in self.HP.items():
            self.set_hp(name, hp.get(name, default))
        self.state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.params}
        self.steps = torch.zeros(self.size, dtype=torch.float64)  # per member
        self._stepped: set[str] = set()  # parameters stepped (or loaded) at least once

    def set_hp(self, name: str, values: Any) -> None:
        """Set one hyper-parameter for every member (a number) or each (B numbers)."""
        if name not in self.HP:
            raise ValueError(f"{type(self).__name__} has no hyper-parameter {name!r}")
        self.hp[name] = _column(values, self.size, name)
        self._forget(name)

    def _scale(self, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``[B]`` values shaped to broadcast over a stacked parameter like ``like`` (its
        dtype and device)."""
        # non_blocking: a blocking copy to an accelerator would wait for every kernel
        # queued before it (the backward), once per step for Adam's bias corrections.
        values = values.to(dtype=like.dtype).to(device=like.device, non_blocking=True)
        return values.view(-1, *([1] * (like.dim() - 1)))

    def _col(
        self,
        name: str,
        like: torch.Tensor,
        derive: Callable[[], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`_scale` of ``self.hp[name]``, or of the ``[B]`` column ``derive()``
        computes from the hyper-parameters (named ``"source:what"`` or
        ``"source+other:what"`` so that changing a source drops it), cached until
        :meth:`_forget`."""
        key = (name, like.dtype, like.device, like.dim())
        column = self._columns.get(key)
        if column is None:
            values = self.hp[name] if derive is None else derive()
            column = self._columns[key] = self._scale(values, like)
        return column

    def _flag(self, name: str, test: Callable[[], torch.Tensor]) -> bool:
        """``bool(test())`` of a test on the (CPU) hyper-parameter values, cached under
        ``name`` (``"source:what"``) like :meth:`_col`'s columns."""
        flag = self._flags.get(name)
        if flag is None:
            flag = self._flags[name] = bool(test())
        return flag

    def _forget(self, *names: str) -> None:
        """Drop the cached columns and flags of ``names`` and those derived from them
        (cached under ``"name:..."``)."""

        def derived(key: str) -> bool:
            return any(source in names for source in key.split(":", 1)[0].split("+"))

        for key in [k for k in self._columns if derived(k[0])]:
            del self._columns[key]
        for flag in [k for k in self._flags if derived(k)]:
            del self._flags[flag]

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> None:
        """One step of every member from the parameters' ``.grad`` (members whose
        gradient is None for a parameter are left as they are there).

        Args:
            skip: ``[B]`` bools (any device): members that do not step (their parameters,
                state and step count stay as they are; a ``GradScaler`` found their
                gradients not finite).
        """
        skipped = None if skip is None else skip.to("cpu")
        if skipped is not None and bool(skipped.any()):
            self._step_some(skipped)
            return
        self.steps += 1
        self._forget("step")
        for name, p in self.params.items():
            if p.grad is not None:
                self._stepped.add(name)
                self._update(name, p, p.grad)

    def _step_some(self, skipped: torch.Tensor) -> None:
        """Step all, then put the ``skipped`` members' slices back (rare: an overflow)."""
        before = {name: p.clone() for name, p in self.params.items()}
        state = {n: {k: v.clone() for k, v in s.items()} for n, s in self.state.items()}
        stepped = set(self._stepped)
        self.step()
        for name, p in self.params.items():
            p[skipped.to(p.device)] = before[name][skipped.to(p.device)]
        for name, saved in state.items():
            current = self.state[name]
            for key, value in saved.items():
                current[key][skipped.to(value.device)] = value[skipped.to(value.device)]
            for key in set(current) - set(saved):  # created by this step: zeros for them
                current[key][skipped.to(current[key].device)] = 0
        self.steps[skipped] -= 1
        self._forget("step")
        if bool(skipped.all()):
            self._stepped = stepped

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


@functools.cache
def _sgd_records_empty_buffers() -> bool:
    """Whether this PyTorch's ``SGD`` records ``{"momentum_buffer": None}`` for a
    parameter stepped without momentum (older versions) or no state at all (newer)."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    optimizer = torch.optim.SGD([p], lr=0.1)
    optimizer.step()
    return bool(optimizer.state)


class FusedSGD(FusedOptimizer):
    """``torch.optim.SGD`` per member: ``lr``, ``momentum``, ``dampening``,
    ``weight_decay`` as [B] values; ``nesterov`` for all (as a structural choice).

    As in ``torch.optim.SGD``, a member's momentum buffer starts as its first gradient
    taken with momentum > 0 and is left untouched by steps taken with momentum 0 (its
    update is then its gradient); the stacked buffer keeps a per-member flag of whether
    the member's buffer exists yet, so momentum may go to 0 and back mid-run.
    """

    HP = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0}

    def __init__(
        self, params: Mapping[str, torch.Tensor], nesterov: bool = False, **hp: Any
    ) -> None:
        super().__init__(params, **hp)
        self.nesterov = bool(nesterov)

    def _update(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        hp = self.hp
        d_p = grad
        if self._flag("weight_decay:any", lambda: (hp["weight_decay"] > 0).any()):
            d_p = grad + self._col("weight_decay", p) * p
        lr = self._col("lr", p)
        if not self._flag("momentum:any", lambda: (hp["momentum"] > 0).any()):
            p.sub_(lr * d_p)  # plain SGD for everyone: buffers stay as they are
            return
        state = self.state[name]
        buf = state.get("momentum_buffer")
        has = state.get("has_buffer")  # [B] bool on the CPU: member b's buffer exists
        if buf is None or has is None:
            buf = state["momentum_buffer"] = torch.zeros_like(p)
            has = state["has_buffer"] = torch.zeros(self.size, dtype=torch.bool)
        momentum = self._col("momentum", p)
        keep = self._col("dampening:keep", p, lambda: 1.0 - hp["dampening"])
        if self._flag("momentum:all", lambda: (hp["momentum"] > 0).all()) and bool(has.all()):
            # The usual case: every member has momentum and a buffer.
            buf.mul_(momentum).add_(d_p * keep)
            step = d_p + momentum * buf if self.nesterov else buf
            p.sub_(lr * step)
            return
        uses = self._col("momentum:uses", p, lambda: (hp["momentum"] > 0).double()) > 0
        started = self._scale(has.double(), p) > 0
        # A member's first step with momentum starts its buffer at its gradient; a member
        # without momentum leaves its buffer as it is.
        buf.copy_(torch.where(uses, torch.where(started, buf * momentum + d_p * keep, d_p), buf))
        has.logical_or_(hp["momentum"] > 0)
        step = d_p + momentum * buf if self.nesterov else buf
        p.sub_(lr * torch.where(uses, step, d_p))

    def member_state(self, b: int) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name in self.params:
            state = self.state[name]
            buf, has = state.get("momentum_buffer"), state.get("has_buffer")
            if buf is not None and has is not None and bool(has[b]):
                out[name] = {"momentum_buffer": buf[b].clone()}
            elif name in self._stepped and _sgd_records_empty_buffers():
                out[name] = {"momentum_buffer": None}
        return out

    def load_member(self, b: int, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, p in self.params.items():
            member = state.get(name)
            if member is None:
                continue
            self._stepped.add(name)
            buf = member.get("momentum_buffer")
            if buf is None:
                continue
            s = self.state[name]
            if "momentum_buffer" not in s:
                s["momentum_buffer"] = torch.zeros_like(p)
                s["has_buffer"] = torch.zeros(self.size, dtype=torch.bool)
            s["momentum_buffer"][b].copy_(buf)
            s["has_buffer"][b] = True


class _SlotOptimizer(FusedOptimizer):
    """A fused optimizer whose state per parameter is :attr:`SLOTS` (tensors shaped like
    the parameter) and the member's step count (``torch.optim``'s ``"step"``)."""

    SLOTS: tuple[str, ...] = ()

    def _slots(self, name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter ``name``'s state, its slots created (zeros) on first use."""
        s = self.state[name]
        if self.SLOTS[0] not in s:
            for slot in self.SLOTS:
                s[slot] = torch.zeros_like(p)
        return s

    def member_state(self, b: int) -> dict[str, dict[str, Any]]:
        if not self.steps[b]:  # it never stepped (skipped steps): torch.optim keeps nothing
            return {}
        step = torch.tensor(float(self.steps[b]))
        return {
            name: {"step": step.clone(), **{k: s[k][b].clone() for k in self.SLOTS}}
            for name, s in self.state.items()
            if self.SLOTS[0] in s
        }

    def load_member(self, b: int, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, p in self.params.items():
            member = state.get(name)
            if not member:
                continue
            s = self._slots(name, p)
            for slot in self.SLOTS:
                s[slot][b].copy_(member[slot])
            self.steps[b] = float(member["step"])
            self._stepped.add(name)
        self._forget("step")


class FusedAdam(_SlotOptimizer):
    """``torch.optim.Adam`` (``decoupled=False``) or ``AdamW`` (``decoupled=True``) per
    member: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` as [B] values."""

    HP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    SLOTS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self, params: Mapping[str, torch.Tensor], decoupled: bool = False, **hp: Any
    ) -> None:
        super().__init__(params, **hp)
        self.decoupled = bool(decoupled)
        for name in ("beta1", "beta2"):
            if bool((self.hp[name] >= 1).any()):
                raise ValueError(f"{name} must be < 1 for every member")

    def _update(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        hp, s = self.hp, self._slots(name, p)
        if self._flag("weight_decay:any", lambda: (hp["weight_decay"] > 0).any()):
            if self.decoupled:
                p.mul_(
                    self._col("lr+weight_decay:keep", p, lambda: 1 - hp["lr"] * hp["weight_decay"])
                )
            else:
                grad = grad + self._col("weight_decay", p) * p
        beta1, beta2 = self._col("beta1", p), self._col("beta2", p)
        s["exp_avg"].lerp_(grad, 1 - beta1)
        s["exp_avg_sq"].mul_(beta2).add_((1 - beta2) * grad * grad)
        # Bias corrections in float64 per member, as torch.optim computes them in Python
        # (once per step: "step:" columns are dropped by every step()).
        steps = self.steps
        step_size = self._col("step:size", p, lambda: hp["lr"] / (1 - hp["beta1"] ** steps))
        correction2_sqrt = self._col("step:c2", p, lambda: (1 - hp["beta2"] ** steps).sqrt())
        denom = (s["exp_avg_sq"].sqrt() / correction2_sqrt).add_(self._col("eps", p))
        p.sub_(step_size * (s["exp_avg"] / denom))


class FusedAdadelta(_SlotOptimizer):
    """``torch.optim.Adadelta`` per member: ``lr``, ``rho``, ``eps``, ``weight_decay``
    as [B] values (the same operations in the same order as its single-tensor step)."""

    HP = {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0.0}
    SLOTS = ("square_avg", "acc_delta")

    def __init__(self, params: Mapping[str, torch.Tensor], **hp: Any) -> None:
        super().__init__(params, **hp)
        if bool((self.hp["rho"] > 1).any()):
            raise ValueError("rho must be <= 1 for every member")

    def _update(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        hp, s = self.hp, self._slots(name, p)
        if self._flag("weight_decay:any", lambda: (hp["weight_decay"] > 0).any()):
            grad = grad + self._col("weight_decay", p) * p
        rho = self._col("rho", p)
        keep = self._col("rho:keep", p, lambda: 1 - hp["rho"])
        eps = self._col("eps", p)
        square_avg, acc_delta = s["square_avg"], s["acc_delta"]
        square_avg.mul_(rho).add_(keep * grad * grad)
        std = square_avg.add(eps).sqrt_()
        delta = acc_delta.add(eps).sqrt_().div_(std).mul_(grad)
        acc_delta.mul_(rho).add_(keep * delta * delta)
        p.sub_(self._col("lr", p) * delta)
