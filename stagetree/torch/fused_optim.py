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

__all__ = ["FLAT", "FusedAdadelta", "FusedAdam", "FusedOptimizer", "FusedSGD"]

#: The name :meth:`FusedOptimizer._update` gets for a step over all parameters side by
#: side (its tensors ``[B, width]``).
FLAT = "*"


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
        device = next(iter(self.params.values())).device
        # Per member, on the parameters' device: a step skipped by a mask (a GradScaler's
        # overflow) leaves a member's count as it is without the host reading the mask.
        self.steps = torch.zeros(self.size, dtype=torch.float64, device=device)
        self._stepped: set[str] = set()  # parameters stepped (or loaded) at least once
        # The step's mask: None (every member steps) or ``[B]`` bools on the device, and
        # its views shaped for a parameter's dim (see :meth:`_ok`).
        self._mask: torch.Tensor | None = None
        self._mask_views: dict[int, torch.Tensor] = {}
        # Every member's parameters side by side: parameter ``name`` is columns
        # ``[offset, offset + numel)`` of a ``[B, width]`` tensor. The state is kept in
        # that layout (each parameter's state a view of it), so that a step can run over
        # all parameters at once (:meth:`flat_grad`): a few operations per step instead
        # of a few per parameter, what bounds a step on an accelerator when kernels are
        # short. None: the parameters differ in dtype or device (steps per parameter).
        self.flat = True  #: take flat steps where the values allow (False: never)
        self._layout: dict[str, tuple[int, int]] | None = None
        kinds = {(p.dtype, p.device) for p in self.params.values()}
        if len(kinds) == 1:
            offset, self._layout = 0, {}
            for name, p in self.params.items():
                numel = p[0].numel()
                self._layout[name] = (offset, numel)
                offset += numel
            self._width = offset
            (self._dtype, self._device) = kinds.pop()
        self._storage: dict[str, torch.Tensor] = {}  # slot -> [B, width] state
        self._grad_buffer: torch.Tensor | None = None
        self._update_views: list[torch.Tensor] = []  # of the gradient buffer
        self._update_views_of: torch.Tensor | None = None

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
    def step(self, skip: torch.Tensor | None = None, flat_grad: torch.Tensor | None = None) -> None:
        """One step of every member from the parameters' ``.grad`` (members whose
        gradient is None for a parameter are left as they are there).

        Args:
            skip: ``[B]`` bools on the parameters' device: members that do not step
                (their parameters, state and step count stay as they are; a
                ``GradScaler`` found their gradients not finite). Applied on the device
                (SGD: a zero gradient, lr 0 and momentum 1 for them; the others: each
                updated tensor selected with ``torch.where``): the host never reads it,
                so the step does not wait for the backward.
            flat_grad: what :meth:`flat_grad` returned (unscaled by the caller, perhaps),
                used instead of the ``.grad`` s: the step runs on all parameters side by
                side.
        """
        if flat_grad is None:
            flat_grad = self.flat_grad()
        if skip is None:
            self._mask = None
            self.steps += 1
        else:
            self._mask = ~skip.to(device=self.steps.device, dtype=torch.bool)
            self.steps += self._mask
        self._mask_views = {}
        self._forget("step")
        try:
            if flat_grad is not None:
                self._stepped.update(self.params)
                self._update(FLAT, flat_grad, flat_grad)
                return
            for name, p in self.params.items():
                if p.grad is not None:
                    self._stepped.add(name)
                    self._update(name, p, p.grad)
        finally:
            self._mask = None
            self._mask_views = {}

    def flat_grad(self) -> torch.Tensor | None:
        """Every parameter's ``.grad`` side by side (``[B, width]``, a copy; see
        :meth:`step`), or None where this step goes parameter by parameter: a gradient
        is missing, the parameters differ in dtype or device, or the update rule needs
        the parameters themselves (weight decay, :meth:`_flat_ready`)."""
        if not self.flat or self._layout is None or not self._flat_ready():
            return None
        grads = []
        for p in self.params.values():
            if p.grad is None:
                return None
            grads.append(p.grad.reshape(self.size, -1))
        buffer = self._grad_buffer
        if buffer is None or buffer.dtype != grads[0].dtype:
            buffer = self._grad_buffer = torch.empty(
                self.size, self._width, dtype=grads[0].dtype, device=self._device
            )
        return torch.cat(grads, dim=1, out=buffer)

    def _flat_ready(self) -> bool:
        """Whether this step's values let :meth:`_update` run on all parameters side by
        side (host-known facts only)."""
        return False

    def _slot(self, name: str, kind: str, p: torch.Tensor) -> torch.Tensor:
        """State ``kind`` of parameter ``name`` (:data:`FLAT`: of all of them side by
        side), zeros at first use; a view of the flat layout where there is one."""
        state = self.state.get(name)
        if state is not None and kind in state:
            return state[kind]
        if self._layout is None:
            assert state is not None
            tensor = state[kind] = torch.zeros_like(p)
            return tensor
        storage = self._storage.get(kind)
        if storage is None:
            storage = self._storage[kind] = torch.zeros(
                self.size, self._width, dtype=self._dtype, device=self._device
            )
        if name == FLAT:
            for n in self.params:
                if kind not in self.state[n]:
                    self.state[n][kind] = self._view(storage, n)
            return storage
        assert state is not None
        tensor = state[kind] = self._view(storage, name)
        return tensor

    def _view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter ``name``'s part of a ``[B, width]`` tensor, shaped like it."""
        assert self._layout is not None
        offset, numel = self._layout[name]
        return flat[:, offset : offset + numel].view(self.params[name].shape)

    def _col_masked(self, name: str, like: torch.Tensor, neutral: float) -> torch.Tensor:
        """:meth:`_col` where this step's mask holds, ``neutral`` for the members that
        skip (once a step)."""
        key = (f"step+{name}:masked", like.dtype, like.device, like.dim())
        column = self._columns.get(key)
        if column is None:
            ok = self._ok(like)
            assert ok is not None
            column = self._columns[key] = torch.where(ok, self._col(name, like), neutral)
        return column

    def _ok(self, like: torch.Tensor) -> torch.Tensor | None:
        """This step's mask (True: the member steps) shaped to broadcast over a stacked
        parameter like ``like``; None when every member steps."""
        if self._mask is None:
            return None
        view = self._mask_views.get(like.dim())
        if view is None:
            view = self._mask_views[like.dim()] = self._mask.view(-1, *([1] * (like.dim() - 1)))
        return view

    @staticmethod
    def _assign(target: torch.Tensor, new: torch.Tensor, ok: torch.Tensor | None) -> None:
        """``target`` becomes ``new`` for the members that step (``ok``; None: all)."""
        if ok is None:
            target.copy_(new)
        else:
            torch.where(ok, new, target, out=target)

    def _descend(
        self,
        name: str,
        p: torch.Tensor,
        factor: torch.Tensor,
        step: torch.Tensor,
        ok: torch.Tensor | None,
    ) -> None:
        """``p -= factor * step`` for the members that step: the others subtract an exact
        zero (their update may be an inf or a NaN). :data:`FLAT`: every parameter's part
        of the update, computed into :meth:`flat_grad`'s buffer and subtracted with one
        multi-tensor call."""
        if name != FLAT:
            update = factor * step
            p.sub_(update if ok is None else torch.where(ok, update, 0.0))
            return
        # The update goes where the gradients were (read by now): no more memory, and
        # the buffer's parameter-shaped views are made once.
        buffer = self._grad_buffer
        assert buffer is not None and buffer.shape == step.shape
        if self._update_views_of is not buffer:
            self._update_views = [self._view(buffer, n) for n in self.params]
            self._update_views_of = buffer
        torch.mul(factor, step, out=buffer)
        if ok is not None:
            buffer.masked_fill_(~ok, 0.0)
        torch._foreach_sub_(list(self.params.values()), self._update_views)

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
        # Whether member b's buffer exists, per parameter (row: parameter, on the
        # device: a step masked there starts buffers the host does not learn of).
        device = next(iter(self.params.values())).device
        self._rows = {name: row for row, name in enumerate(self.params)}
        self._has = torch.zeros(len(self.params), self.size, dtype=torch.bool, device=device)
        # Parameters whose members all have a buffer (known on the host).
        self._started: set[str] = set()

    def _has_row(self, name: str) -> torch.Tensor:
        """``[B]`` (:data:`FLAT`: ``[P, B]``): whose buffer exists."""
        return self._has if name == FLAT else self._has[self._rows[name]]

    def _all_started(self, name: str) -> bool:
        if name == FLAT:
            return len(self._started) == len(self.params)
        return name in self._started

    def _flat_ready(self) -> bool:
        hp = self.hp
        if self._flag("weight_decay:any", lambda: (hp["weight_decay"] > 0).any()):
            return False
        if not self._flag("momentum:any", lambda: (hp["momentum"] > 0).any()):
            return True
        return self._flag("momentum:all", lambda: (hp["momentum"] > 0).all()) and (
            self._all_started(FLAT)
            or self._flag("dampening:none", lambda: (hp["dampening"] == 0).all())
        )

    def _update(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        hp = self.hp
        ok = self._ok(p)
        d_p = grad
        if self._flag("weight_decay:any", lambda: (hp["weight_decay"] > 0).any()):
            d_p = grad + self._col("weight_decay", p) * p
        lr = self._col("lr", p)
        plain = not self._flag("momentum:any", lambda: (hp["momentum"] > 0).any())
        fast = (
            not plain
            and self._flag("momentum:all", lambda: (hp["momentum"] > 0).all())
            and (
                self._all_started(name)
                or self._flag("dampening:none", lambda: (hp["dampening"] == 0).all())
            )
        )
        neutral = False
        if ok is not None and (plain or fast):
            neutral = True
            # A member that skips steps with a zero gradient, lr 0 and momentum 1: its
            # buffer * 1 + 0 and its weights - 0 * buffer stay as they are (up to the sign
            # of a zero), at no more passes over the tensors than an unmasked step.
            # (the flat gradients are this optimizer's own buffer: zeroed in place)
            d_p = d_p.masked_fill_(~ok, 0.0) if name == FLAT else torch.where(ok, d_p, 0.0)
            lr = self._col_masked("lr", p, 0.0)
        if plain:  # plain SGD for everyone: buffers stay as they are
            self._descend(name, p, lr, d_p, None)
            return
        buf = self._slot(name, "momentum_buffer", p)
        has = self._has_row(name)
        momentum = self._col("momentum", p)
        keep = self._col("dampening:keep", p, lambda: 1.0 - hp["dampening"])
        if fast:
            # The usual case: every member has momentum, and a buffer (or no dampening:
            # a buffer not started yet is zeros, and zeros * momentum + d_p is d_p, the
            # buffer torch.optim starts with).
            if neutral:
                momentum = self._col_masked("momentum", p, 1.0)
            if self._flag("dampening:none", lambda: (hp["dampening"] == 0).all()):
                buf.mul_(momentum).add_(d_p)  # d_p * 1 is d_p: a pass over the tensors less
            else:
                buf.mul_(momentum).add_(d_p * keep)
            if not self._all_started(name):
                if self._mask is None:
                    has.fill_(True)
                    self._started.update(self.params if name == FLAT else (name,))
                else:  # who started is on the device: the host does not learn it
                    has.logical_or_(self._mask)
            step = d_p + momentum * buf if self.nesterov else buf
            self._descend(name, p, lr, step, None)
            return

        def momentum_uses() -> torch.Tensor:
            return (hp["momentum"] > 0).double()

        uses = self._col("momentum:uses", p, momentum_uses) > 0
        started = has.view(-1, *([1] * (p.dim() - 1)))
        # A member's first step with momentum starts its buffer at its gradient; a member
        # without momentum leaves its buffer as it is.
        self._assign(
            buf, torch.where(uses, torch.where(started, buf * momentum + d_p * keep, d_p), buf), ok
        )
        starts = self._col("momentum:uses", self.steps, momentum_uses) > 0
        has.logical_or_(starts if self._mask is None else starts & self._mask)
        if self._mask is None and self._flag("momentum:all", lambda: (hp["momentum"] > 0).all()):
            self._started.add(name)
        step = d_p + momentum * buf if self.nesterov else buf
        self._descend(name, p, lr, torch.where(uses, step, d_p), ok)

    def member_state(self, b: int) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        has = self._has[:, b].tolist()
        for name in self.params:
            buf = self.state[name].get("momentum_buffer")
            if buf is not None and has[self._rows[name]]:
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
            self._slot(name, "momentum_buffer", p)[b].copy_(buf)
            self._has[self._rows[name], b] = True


class _SlotOptimizer(FusedOptimizer):
    """A fused optimizer whose state per parameter is :attr:`SLOTS` (tensors shaped like
    the parameter) and the member's step count (``torch.optim``'s ``"step"``)."""

    SLOTS: tuple[str, ...] = ()

    def _slots(self, name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter ``name``'s state (:data:`FLAT`: all parameters'), its slots created
        (zeros) on first use."""
        return {slot: self._slot(name, slot, p) for slot in self.SLOTS}

    def _flat_ready(self) -> bool:
        hp = self.hp
        return not self._flag("weight_decay:any", lambda: (hp["weight_decay"] > 0).any())

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
        ok = self._ok(p)
        if self._flag("weight_decay:any", lambda: (hp["weight_decay"] > 0).any()):
            if self.decoupled:
                keep = self._col(
                    "lr+weight_decay:keep", p, lambda: 1 - hp["lr"] * hp["weight_decay"]
                )
                p.mul_(keep if ok is None else torch.where(ok, keep, 1.0))
            else:
                grad = grad + self._col("weight_decay", p) * p
        beta1, beta2 = self._col("beta1", p), self._col("beta2", p)
        exp_avg, exp_avg_sq = s["exp_avg"], s["exp_avg_sq"]
        if ok is None:
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).add_((1 - beta2) * grad * grad)
        else:
            torch.where(ok, exp_avg.lerp(grad, 1 - beta1), exp_avg, out=exp_avg)
            torch.where(
                ok, exp_avg_sq * beta2 + (1 - beta2) * grad * grad, exp_avg_sq, out=exp_avg_sq
            )
        # Bias corrections in float64 per member, as torch.optim computes them in Python
        # (once per step: "step:" columns are dropped by every step()), on the device
        # where the step counts are.
        steps = self.steps

        def size() -> torch.Tensor:
            return self._col("lr", steps) / (1 - self._col("beta1", steps) ** steps)

        def c2() -> torch.Tensor:
            return (1 - self._col("beta2", steps) ** steps).sqrt()

        step_size = self._col("step:size", p, size)
        correction2_sqrt = self._col("step:c2", p, c2)
        denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(self._col("eps", p))
        self._descend(name, p, step_size, exp_avg / denom, ok)


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
        ok = self._ok(p)
        square_avg, acc_delta = s["square_avg"], s["acc_delta"]
        if ok is None:
            square_avg.mul_(rho).add_(keep * grad * grad)
        else:
            torch.where(ok, square_avg * rho + keep * grad * grad, square_avg, out=square_avg)
        std = square_avg.add(eps).sqrt_()
        delta = acc_delta.add(eps).sqrt_().div_(std).mul_(grad)
        if ok is None:
            acc_delta.mul_(rho).add_(keep * delta * delta)
        else:
            torch.where(ok, acc_delta * rho + keep * delta * delta, acc_delta, out=acc_delta)
        self._descend(name, p, self._col("lr", p), delta, ok)
