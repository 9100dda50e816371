"""HFTA's form for the convolutions, BatchNorm, pooling and linear layers of a fused job.

A fused job runs the trainer's ``loss`` once under ``torch.func.vmap`` over B stacked
members (:mod:`stagetree.torch.fused`). vmap's own rules are slow where HFTA is fast:
its BatchNorm with per-member weights applies the affine part as separate passes, it
cannot keep activations channels_last (its BatchNorm refuses to query that layout), and
autocast does not reach inside it. HFTA instead writes B models as one: a convolution
of B members is one convolution with ``groups=B`` over ``[N, B*C, H, W]``, a BatchNorm
is one BatchNorm over ``B*C`` channels, a linear layer one batched product
(``baddbmm``).

:func:`install` gives the fused job's template modules that form without touching the
user's code: each plain ``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.AdaptiveAvgPool2d`` and
``nn.Linear`` becomes a subclass whose forward, under vmap, runs a *vmap rule* (what
an ``autograd.Function``'s ``vmap`` staticmethod is, called without that class's
per-call cost): it takes the *physical* tensors of the vmap level (the activations as
``[N, B, C, H, W]`` or unbatched, the stacked weights ``[B, ...]``) and runs the grouped
op on them one level down, where regular autograd records it, so the fused backward and
optimizer are unchanged. The result goes back to vmap as ``[N, B, C', H', W']`` with the
members' dimension at 1, a view of the grouped output, so that the next grouped layer
reads it without a copy (elementwise ops between layers keep that layout).

Per layer, the rule also does what autocast would do for a member alone (a convolution
or a linear layer, its bias included, in the lower precision; BatchNorm of a
lower-precision input with float32 statistics) and, where :class:`Kernels` says so (on
CUDA with AMP by default), keeps activations and convolution weights channels_last. A
member's forward is the same arithmetic as alone: a grouped convolution computes each
group as the member's own convolution, a BatchNorm over ``B*C`` channels normalises each
channel over the same ``N*H*W`` values, and the running statistics are the stacked
buffers viewed as ``[B*C]``, updated in place.

Modules not handled here (a subclass of those classes, ``padding_mode`` other than
zeros, BatchNorm with ``momentum=None``, any other layer) keep vmap's rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:  # torch.func's internals (since torch 2.0), which autograd.Function's vmap uses
    from torch._C._functorch import (
        TransformType,
        _add_batch_dim,
        _unwrap_batched,
        peek_interpreter_stack,
    )
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    _AVAILABLE = True
except ImportError:  # a torch without them: vmap's rules stay
    _AVAILABLE = False

__all__ = ["Kernels", "install"]


@dataclasses.dataclass(frozen=True)
class Kernels:
    """How the grouped layers of one fused job compute.

    Attributes:
        dtype: the autocast dtype of the job's AMP (None: AMP off): convolutions run in
            it, as autocast runs them for a member trained alone.
        channels_last: keep convolution inputs and weights channels_last (cuDNN's fast
            layout for grouped and half-precision convolutions).
    """

    dtype: torch.dtype | None = None
    channels_last: bool = False


def _batched(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` is a vmap-batched tensor (the forward runs fused)."""
    return any(t is not None and torch._C._functorch.is_batchedtensor(t) for t in tensors)


def _vmap() -> Any:
    """The innermost ``torch.func`` transform if it is a vmap (else None: the grouped
    modules fall back to their plain forward)."""
    if peek_interpreter_stack() is None:  # no transform at all
        return None
    interpreter = retrieve_current_functorch_interpreter()
    return interpreter if interpreter.key() == TransformType.Vmap else None


def _fused(vmap: Any, rule: Any, *args: Any) -> torch.Tensor:
    """``rule(B, in_dims, *physical args)`` run on the physical tensors of the vmap
    level ``vmap`` (one level down, so that its ops are plain ones that regular autograd
    records), its ``(result, out_dim)`` wrapped back at that level.

    ``autograd.Function.apply`` does the same for a function with a ``vmap``
    staticmethod, but its generic argument handling (pytrees, identity checks) costs
    ~1 ms a call: more than a layer's kernels on a GPU."""
    level = vmap.level()
    physical, dims = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            a, dim = _unwrap_batched(a, level)
        else:
            dim = None
        physical.append(a)
        dims.append(dim)
    with vmap.lower():
        y, out_dim = rule(vmap.batch_size(), tuple(dims), *physical)
    return y if out_dim is None else _add_batch_dim(y, out_dim, level)


def _members_first(t: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """A physical per-member tensor with the members' dimension first (expanded when
    unbatched)."""
    if t is None:
        return None
    if dim is None:
        return t.expand(size, *t.shape)
    # movedim dispatches a permute even to where the dimension is: a host op saved per
    # tensor per layer (and its backward), what a GPU step waits on when kernels are short
    return t if dim == 0 else t.movedim(dim, 0)


def _grouped_input(x: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """Physical activations ``[N, B, C, ...]`` (any layout) as ``[N, B*C, ...]``."""
    if dim is None:
        x = x.unsqueeze(1).expand(x.shape[0], size, *x.shape[1:])
    elif dim != 1:
        x = x.movedim(dim, 1)
    return x.flatten(1, 2)


def _conv2d_rule(
    size: int,
    in_dims: tuple[int | None, ...],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    kernels: Kernels,
) -> tuple[torch.Tensor, int]:
    """``F.conv2d`` of the B members as one grouped convolution."""
    x_dim, w_dim, b_dim = in_dims[:3]
    w = _members_first(weight, w_dim, size)
    assert w is not None
    out = w.shape[1]
    w = w.flatten(0, 1)  # [B*O, C/groups, kh, kw]
    b = _members_first(bias, b_dim, size)
    b = None if b is None else b.flatten()
    if x_dim is None and groups == 1:
        # The same input for every member: one convolution with B*O filters.
        grouped = x
        count = 1
    else:
        grouped = _grouped_input(x, x_dim, size)
        count = size * groups
    with torch._C.DisableTorchFunction():  # no vmap-autocast casts on these
        # One copy each (at most): the cast and the layout together.
        dtype = w.dtype if kernels.dtype is None else kernels.dtype
        layout = torch.channels_last if kernels.channels_last else torch.preserve_format
        grouped = grouped.to(dtype=dtype, memory_format=layout)
        w = w.to(dtype=dtype, memory_format=layout)
        b = None if b is None else b.to(dtype)
        y = F.conv2d(grouped, w, b, stride, padding, dilation, count)
    return y.unflatten(1, (size, out)), 1


def _batch_norm_rule(
    size: int,
    in_dims: tuple[int | None, ...],
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, int]:
    """``F.batch_norm`` of the B members as one BatchNorm over their channels, updating
    the stacked running statistics in place."""
    grouped = _grouped_input(x, in_dims[0], size)
    channels = grouped.shape[1] // size
    stats = [_members_first(t, d, size) for t, d in zip((running_mean, running_var), in_dims[1:3])]
    # The statistics as [B*C] views of the stacked buffers, so that the in-place
    # update lands in each member's slice (a copy, written back, where no view exists).
    flat = [None if s is None else s.reshape(-1) for s in stats]
    weight, bias = (
        None if t is None else _members_first(t, d, size).flatten()  # type: ignore[union-attr]
        for t, d in zip((weight, bias), in_dims[3:5])
    )
    with torch._C.DisableTorchFunction():  # no vmap-autocast casts on these
        y = F.batch_norm(grouped, flat[0], flat[1], weight, bias, training, momentum, eps)
    if training:
        with torch.no_grad():
            for s, f in zip(stats, flat):
                if s is not None and f is not None and f.data_ptr() != s.data_ptr():
                    s.copy_(f.view_as(s))
    return y.unflatten(1, (size, channels)), 1


def _adaptive_avg_pool2d_rule(
    size: int, in_dims: tuple[int | None, ...], x: torch.Tensor, output_size: Any
) -> tuple[torch.Tensor, int | None]:
    """``F.adaptive_avg_pool2d`` of ``[N, B*C, H, W]`` in one call (vmap's own rule falls
    back to a slow path on channels_last activations)."""
    if in_dims[0] is None:
        return F.adaptive_avg_pool2d(x, output_size), None
    grouped = _grouped_input(x, in_dims[0], size)
    with torch._C.DisableTorchFunction():
        y = F.adaptive_avg_pool2d(grouped, output_size)
    return y.unflatten(1, (size, grouped.shape[1] // size)), 1


def _linear_rule(
    size: int,
    in_dims: tuple[int | None, ...],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernels: Kernels,
) -> tuple[torch.Tensor, int]:
    """``F.linear`` of the B members as one product (HFTA's ``baddbmm``), the bias added
    inside it as a member alone adds it."""
    w = _members_first(weight, in_dims[1], size)
    assert w is not None
    b = _members_first(bias, in_dims[2], size)
    out = w.shape[1]
    with torch._C.DisableTorchFunction():  # no vmap-autocast casts on these
        if kernels.dtype is not None:  # autocast casts all three
            x, w = x.to(kernels.dtype), w.to(kernels.dtype)
            b = None if b is None else b.to(kernels.dtype)
        if in_dims[0] is None:
            # The same input for every member: one product with B*O outputs.
            y = F.linear(x, w.flatten(0, 1), None if b is None else b.flatten())
            return y.unflatten(-1, (size, out)), y.dim() - 1
        if in_dims[0] != 0:
            x = x.movedim(in_dims[0], 0)
        flat = x.reshape(size, -1, x.shape[-1])
        if b is None:
            y = torch.bmm(flat, w.transpose(1, 2))
        else:
            y = torch.baddbmm(b.unsqueeze(1), flat, w.transpose(1, 2))
    return y.reshape(size, *x.shape[1:-1], out), 0


class GroupedConv2d(nn.Conv2d):
    """``nn.Conv2d`` that runs as one grouped convolution of the members under vmap."""

    stagetree_kernels: Kernels

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # An unbatched image ([C, H, W]) keeps vmap's rule: the grouped form needs [N, ...].
        vmap = _vmap()
        if vmap is None or input.dim() != 4 or not _batched(input, self.weight, self.bias):
            return super().forward(input)
        return _fused(
            vmap,
            _conv2d_rule,
            input,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            self.stagetree_kernels,
        )


class GroupedBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` (with a ``momentum``) that runs as one BatchNorm over the
    members' channels under vmap; its forward is ``_BatchNorm.forward``'s."""

    stagetree_kernels: Kernels

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        vmap = _vmap()
        if vmap is None or not _batched(input, self.weight, self.bias, self.running_mean):
            return super().forward(input)
        self._check_input_dim(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        training = self.training or (self.running_mean is None and self.running_var is None)
        stats = not self.training or self.track_running_stats
        return _fused(
            vmap,
            _batch_norm_rule,
            input,
            self.running_mean if stats else None,
            self.running_var if stats else None,
            self.weight,
            self.bias,
            training,
            self.momentum,
            self.eps,
        )


class GroupedAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` that pools the members' channels in one call under vmap."""

    stagetree_kernels: Kernels

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        vmap = _vmap()
        if vmap is None or input.dim() != 4 or not _batched(input):
            return super().forward(input)
        return _fused(vmap, _adaptive_avg_pool2d_rule, input, self.output_size)


class GroupedLinear(nn.Linear):
    """``nn.Linear`` that runs as one batched product of the members under vmap."""

    stagetree_kernels: Kernels

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        vmap = _vmap()
        if vmap is None or not _batched(input, self.weight, self.bias):
            return super().forward(input)
        return _fused(vmap, _linear_rule, input, self.weight, self.bias, self.stagetree_kernels)


def _grouped_class(module: nn.Module) -> type[nn.Module] | None:
    """The grouped class for ``module`` (None: vmap's rules stay)."""
    kind = type(module)
    if kind is nn.Conv2d:
        return GroupedConv2d if module.padding_mode == "zeros" else None
    if kind is nn.BatchNorm2d:
        return GroupedBatchNorm2d if module.momentum is not None else None
    if kind is nn.AdaptiveAvgPool2d:
        return GroupedAdaptiveAvgPool2d
    if kind is nn.Linear:
        return GroupedLinear
    return None


def install(modules: Iterable[nn.Module], kernels: Kernels) -> int:
    """Give the plain ``nn.Conv2d`` / ``nn.BatchNorm2d`` / ``nn.AdaptiveAvgPool2d`` /
    ``nn.Linear`` in
    ``modules`` (and their submodules) the grouped forward (their class becomes the
    grouped subclass; parameters, buffers and state-dict keys stay). Outside vmap they
    compute as before. Returns how many modules changed."""
    if not _AVAILABLE:
        return 0
    count = 0
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            grouped = _grouped_class(module)
            if grouped is not None:
                module.__class__ = grouped
                count += 1
            if isinstance(
                module,
                (GroupedConv2d, GroupedBatchNorm2d, GroupedAdaptiveAvgPool2d, GroupedLinear),
            ):
                module.stagetree_kernels = kernels
    return count
