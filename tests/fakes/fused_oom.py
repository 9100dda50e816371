"""A fused trainer with an out-of-memory rule (TreeML §5.2, HFTA), for the tests of a
fused job that runs out of device memory and for ``benchmarks/gpu_oom.py``.

:class:`WidthFused` records the width of every fused job it builds and, in each fused
(vmap-batched) step, asks its subclass's :meth:`~WidthFused.allocate_fused` whether a step
of that width fits: the rule raises ``torch.cuda.OutOfMemoryError`` (or allocates on a
real device, which raises it) where it does not. Needs torch and scikit-learn (the
digits MLP).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from stagetree.torch.examples import DigitsTrainer


class WidthFused(DigitsTrainer):
    """The digits MLP whose fused steps are checked against :meth:`allocate_fused`; every
    subclass records its own ``widths`` (the members of each fused job, in order)."""

    widths: ClassVar[list[int]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.widths = []

    @classmethod
    def fuse(cls, members: Sequence[Any]) -> Any:
        cls.widths.append(len(members))
        return super().fuse(members)

    @classmethod
    def allocate_fused(cls, width: int) -> None:
        """The out-of-memory rule: raise ``torch.cuda.OutOfMemoryError`` where a fused
        step of ``width`` members does not fit (here every width fits)."""

    def loss(self, batch: Any) -> Any:
        weight = next(self.model.parameters())
        if torch._C._functorch.is_batchedtensor(weight):  # inside the fused (vmap) step
            type(self).allocate_fused(type(self).widths[-1])
        return super().loss(batch)


class FitsTwoFused(WidthFused):
    """A fused step of more than two members runs out of (CUDA) memory, as a job too
    wide for its device does; two fit, and so does one alone."""

    @classmethod
    def allocate_fused(cls, width: int) -> None:
        if width > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
