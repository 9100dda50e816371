"""Automatic mixed precision for fusible trainers, fused or not.

A :class:`~stagetree.torch.FusibleTrainer` opts in with
:meth:`~stagetree.torch.FusibleTrainer.enable_amp`: its ``loss`` then runs under
``torch.autocast`` and, with float16, its updates go through a ``torch.amp.GradScaler``
(the trainer holds it, so it is checkpointed like the optimizer). Fused, B members share
one autocast forward, but each keeps *its own* loss scale: :class:`MemberScales` is B
``GradScaler`` s side by side (scale, growth tracker), so that a member whose gradients
overflow skips its step and halves its scale alone, as it would trained alone. All of it
stays on the device (the overflow flags mask the fused optimizer's step there): a fused
step never waits for the device to tell the host who overflowed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["Amp", "MemberScales", "autocast"]

#: ``(device type, dtype)`` of ``torch.autocast``: the settings of a trainer's AMP.
Amp = tuple[str, torch.dtype]


def autocast(amp: Amp | None, vmapped: bool = False) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` with ``amp``'s settings (a no-op for None); ``vmapped``: for a
    forward under ``torch.func.vmap``, with :class:`_VmapAutocast` too."""
    if amp is None:
        return contextlib.nullcontext()
    if not vmapped:
        return torch.autocast(amp[0], dtype=amp[1])
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(amp[0], dtype=amp[1]))
    stack.enter_context(_VmapAutocast(amp))
    return stack


def _ops(*names: str) -> frozenset[Any]:
    """The torch callables ``names`` (``"F.x"``: ``torch.nn.functional.x``; ``"T.x"``:
    the ``Tensor`` method) that this torch has."""
    roots = {"F": torch.nn.functional, "T": torch.Tensor, "torch": torch}
    found = set()
    for name in names:
        root, _, attr = name.partition(".")
        op = getattr(roots[root], attr, None)
        if op is not None:
            found.add(op)
    return frozenset(found)


#: Ops autocast runs in the lower precision (on CPU and CUDA alike).
_LOWER = _ops(
    "F.linear", "F.bilinear", "torch.conv1d", "torch.conv2d", "torch.conv3d",
    "torch.conv_transpose1d", "torch.conv_transpose2d", "torch.conv_transpose3d",
    "torch.matmul", "torch.mm", "torch.bmm", "torch.addmm", "torch.baddbmm",
    "T.matmul", "T.__matmul__", "T.mm", "T.bmm",
)  # fmt: skip
#: Ops autocast runs in float32 on CPU and CUDA (the losses).
_FLOAT32 = _ops(
    "F.cross_entropy", "F.nll_loss", "F.mse_loss", "F.l1_loss", "F.smooth_l1_loss",
    "F.huber_loss", "F.kl_div", "F.binary_cross_entropy_with_logits",
    "F.binary_cross_entropy", "F.poisson_nll_loss", "F.soft_margin_loss",
)  # fmt: skip
#: ... and on CUDA only.
_FLOAT32_CUDA = _ops(
    "F.softmax", "F.log_softmax", "torch.softmax", "torch.log_softmax", "T.softmax",
    "T.log_softmax", "F.layer_norm", "F.group_norm", "torch.exp", "torch.log",
)  # fmt: skip

#: Norms whose batching rules refuse a lower-precision input with float32 parameters
#: (which the ops alone accept): run in float32 (the input cast exactly), output cast back.
_NORMS = _ops("F.batch_norm", "F.instance_norm", "F.group_norm", "F.layer_norm")


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors (in lists and tuples too) as ``dtype``; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class _VmapAutocast(torch.overrides.TorchFunctionMode):
    """Autocast's casts for the ops that ``vmap`` hides from it.

    Under ``torch.func.vmap`` autocast sees only what the batching rules call: a linear
    layer becomes a product (cast) plus its bias (added in float32), a convolution on a
    CPU and a loss are not cast at all. This mode casts the arguments of the matrix
    products and convolutions to the lower precision and those of the losses (and, on
    CUDA, softmax, the norms, exp and log) to float32 before vmap decomposes them, as
    autocast does for a member trained alone, and runs a norm of a lower-precision input
    in float32 with its output cast back (vmap refuses the mixed form). Other ops run as
    vmap leaves them.
    """

    def __init__(self, amp: Amp) -> None:
        super().__init__()
        self.dtype = amp[1]
        self.float32 = _FLOAT32 | (_FLOAT32_CUDA if amp[0] == "cuda" else frozenset())

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _LOWER:
            args, kwargs = (
                _cast(args, self.dtype),
                {k: _cast(v, self.dtype) for k, v in kwargs.items()},
            )
        elif func in self.float32:
            args = _cast(args, torch.float32)
            kwargs = {k: _cast(v, torch.float32) for k, v in kwargs.items()}
        elif func in _NORMS and args and isinstance(args[0], torch.Tensor):
            dtype = args[0].dtype
            if dtype in (torch.float16, torch.bfloat16):
                # float32 tensors (the running statistics) go in as they are: their
                # in-place updates land in the module's buffers.
                args = _cast(args, torch.float32)
                kwargs = {k: _cast(v, torch.float32) for k, v in kwargs.items()}
                return func(*args, **kwargs).to(dtype)
        return func(*args, **kwargs)


def scaler_settings(scaler: torch.amp.GradScaler) -> tuple[float, float, int]:
    """A scaler's (growth factor, backoff factor, growth interval)."""
    state = scaler.state_dict()
    return (
        float(state["growth_factor"]),
        float(state["backoff_factor"]),
        int(state["growth_interval"]),
    )


class MemberScales:
    """The loss scales of B fused members, each following ``torch.amp.GradScaler``.

    Args:
        scalers: the members' (enabled) scalers, in member order; their growth and
            backoff factors and growth interval must agree.
        device: where the scales live (the stacked parameters' device).

    Raises:
        ValueError: the scalers' settings differ.
    """

    def __init__(self, scalers: Sequence[torch.amp.GradScaler], device: torch.device) -> None:
        settings = {scaler_settings(s) for s in scalers}
        if len(settings) != 1:
            raise ValueError(f"fused members' GradScalers differ in their settings: {settings}")
        self.growth, self.backoff, self.interval = settings.pop()
        states = [s.state_dict() for s in scalers]
        self.scale = torch.tensor([float(s["scale"]) for s in states], dtype=torch.float32)
        self.scale = self.scale.to(device)
        self.tracker = torch.tensor([int(s["_growth_tracker"]) for s in states], device=device)

    def scaled(self, losses: torch.Tensor) -> torch.Tensor:
        """The members' losses, each times its scale (``GradScaler.scale``)."""
        return losses * self.scale

    @torch.no_grad()
    def unscale(self, grads: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Divide each member's slice of the stacked ``grads`` by its scale in place (as
        ``GradScaler.unscale_``: times the float32 reciprocal computed in float64); return
        ``[B]`` bools on the device: the members whose gradients hold an inf or a NaN
        (before the division, as ``GradScaler`` checks them).

        ``grads``: the stacked gradients, or all of them side by side (one ``[B, width]``
        tensor, :meth:`stagetree.torch.fused_optim.FusedOptimizer.flat_grad`). A constant
        number of operations whatever the number of parameters (one check over the
        gradients side by side, one multiplication or a multi-tensor one), and no host
        sync.
        """
        inv = self.scale.double().reciprocal().float()
        if isinstance(grads, torch.Tensor):
            # A row's minimum and maximum are finite iff every element is (aminmax
            # propagates NaNs): one read of the gradients, where isfinite writes masks.
            low, high = torch.aminmax(grads, dim=1)
            found = ~(torch.isfinite(low) & torch.isfinite(high))
            grads.mul_(inv.view(-1, 1))
            return found
        if not grads:
            return torch.zeros_like(self.scale, dtype=torch.bool)
        size = self.scale.shape[0]
        found = ~torch.isfinite(torch.cat([g.reshape(size, -1) for g in grads], dim=1)).all(dim=1)
        views: dict[int, torch.Tensor] = {}
        for g in grads:
            if g.dim() not in views:
                views[g.dim()] = inv.view(-1, *([1] * (g.dim() - 1)))
        torch._foreach_mul_(list(grads), [views[g.dim()] for g in grads])
        return found

    @torch.no_grad()
    def update(self, found: torch.Tensor) -> None:
        """``GradScaler.update`` per member: back off where ``found``, else count a good
        step and grow the scale after ``interval`` of them (if it stays finite)."""
        tracker = torch.where(found, torch.zeros_like(self.tracker), self.tracker + 1)
        grow = tracker == self.interval
        grown = (self.scale.double() * self.growth).float()
        backed = (self.scale.double() * self.backoff).float()
        grow_ok = grow & torch.isfinite(grown)
        self.scale = torch.where(found, backed, torch.where(grow_ok, grown, self.scale))
        self.tracker = torch.where(grow, torch.zeros_like(tracker), tracker)

    def write(self, i: int, scaler: torch.amp.GradScaler) -> None:
        """Member ``i``'s scale into its own scaler."""
        state: Mapping[str, Any] = scaler.state_dict()
        scaler.load_state_dict(
            {**state, "scale": float(self.scale[i]), "_growth_tracker": int(self.tracker[i])}
        )

    def keep(self, members: Sequence[int]) -> None:
        """Only ``members`` stay, in that order."""
        self.scale, self.tracker = self.scale[list(members)], self.tracker[list(members)]
