"""Horizontal fusion: sibling stages trained as one job (the contract; torch-free).

Sibling stages start from the same model and differ only in *fusible* hyper-parameters
(optimizer scalars such as ``lr``, ``momentum``, ``weight_decay``). A trainer class that
can train B such members at once says so with :attr:`Trainer.fusible
<stagetree.trainer.Trainer.fusible>` (the names that may differ between members) and
builds a :class:`FusedGroup` from B member trainers with ``cls.fuse(members)``.
:class:`stagetree.torch.FusibleTrainer` is the PyTorch implementation
(``torch.func.stack_module_state`` + ``vmap(functional_call)`` and the fused optimizers
of :mod:`stagetree.torch.fused_optim`).

The worker (:mod:`stagetree.executors.worker`) owns the loop: it gives every member its sequence
values with :meth:`FusedGroup.setup`, calls :meth:`FusedGroup.step` once per training
step for all members, and before evaluating or checkpointing member ``i`` it calls
:meth:`FusedGroup.sync` so that the member's own trainer object holds member ``i``'s
state (its ``evaluate()``/``state_dict()`` are then the ordinary ones: a member leaves
the fused job as an ordinary checkpoint). Members leave with :meth:`FusedGroup.remove`
as their segments end; the job goes on with the rest.

Semantics: a fused member equals the member trained alone up to floating-point
reassociation (and, with dropout, up to the random masks drawn), not bit for bit. So a
study that fuses records its results in plan trees of their own (see
:attr:`stagetree.Study` ``fuse``): they are never handed to a study that asked for
exact, unfused training.
"""

from __future__ import annotations

import sys
from typing import Any

from stagetree.trainer import FusedGroup

__all__ = ["DEFAULT_MAX_FUSED", "FusedGroup", "check_max_fused", "fusion_names"]

#: Default ``max_fused``. On a CPU (``benchmarks/fusion_bench.py``, one thread) the fused
#: digits MLP trains 3.9x the samples of the same models one after another at 16 members,
#: 5.6x at 32 and 6.9x at 64: past 32 the gain is small next to the parallelism a wider
#: job takes from the other workers. On an accelerator a trainer can lower it to what
#: the device holds (``Trainer.fused_width_limit``).
DEFAULT_MAX_FUSED = 32


def _has_accelerator() -> bool:
    """Whether this process sees a CUDA device (torch already imported: a fusible
    trainer is a torch trainer)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def fusion_names(trainer: type, fuse: Any, executor: Any = "local") -> frozenset[str]:
    """The names a study of ``trainer`` fuses over given its ``fuse`` argument (empty:
    it does not fuse).

    Raises:
        ValueError: ``fuse`` is not True, False or "auto"; ``fuse=True`` with a trainer
            that cannot be fused, or with the simulated executor (it trains nothing).
    """
    if fuse is not True and fuse is not False and fuse != "auto":
        raise ValueError(f'fuse must be True, False or "auto", got {fuse!r}')
    if fuse is False:
        return frozenset()
    names = frozenset(getattr(trainer, "fusible", ()) or ())
    name = getattr(trainer, "__qualname__", repr(trainer))
    if fuse == "auto":
        return names if names and executor != "simulated" and _has_accelerator() else frozenset()
    if not names:
        raise ValueError(
            f"fuse=True, but {name} cannot be fused: it declares no fusible "
            "hyper-parameters (subclass stagetree.torch.FusibleTrainer, which trains "
            "B copies of a model as one job)"
        )
    if executor == "simulated":
        raise ValueError(
            "fuse=True needs real training: the simulated executor cannot fuse jobs "
            "(use executor='local', 'inline' or 'ray')"
        )
    return names


def check_max_fused(max_fused: Any) -> int:
    """``max_fused`` as an int >= 1 (None: :data:`DEFAULT_MAX_FUSED`).

    Raises:
        ValueError: not an integer >= 1.
    """
    if max_fused is None:
        return DEFAULT_MAX_FUSED
    if isinstance(max_fused, bool) or not isinstance(max_fused, int) or max_fused < 1:
        raise ValueError(f"max_fused must be an integer >= 1, got {max_fused!r}")
    return max_fused
