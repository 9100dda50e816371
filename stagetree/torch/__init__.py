"""PyTorch support: a self-checkpointing trainer, a resumable loader, RNG capture.

* :class:`TorchTrainer` -- subclass it, write ``__init__``/``train``/``evaluate`` as for a
  plain loop; checkpoints (model, optimizer, schedulers, loaders, every RNG), a trace-free
  ``evaluate`` and a ``setup`` applying optimizer values and batch size come for free.
* :class:`FusibleTrainer` -- a :class:`TorchTrainer` whose loop stagetree owns: write
  ``__init__``/``loss``/``evaluate``; sibling trials that differ only in optimizer values
  (``lr``, ``momentum``, ``weight_decay``, ``betas``, ...) can then be trained as one
  fused job, a :class:`TorchFusedGroup` (``vmap`` over stacked copies of the model, one
  fused optimizer step).
* :class:`StageLoader` -- minibatches in an order fixed by ``(seed, epoch)``, resumable
  mid-epoch, batch size changeable between steps.
* :func:`set_optimizer_hp` -- write lr / momentum / betas / ... into every param group,
  with a ``ValueError`` for names the optimizer lacks.
* :func:`deterministic` -- deterministic algorithms and a fixed thread count.
* :func:`get_rng_state` / :func:`set_rng_state` / :func:`seed_rng` /
  :func:`preserve_rng` -- every global generator (torch CPU and CUDA, numpy, python) at once.

``stagetree.torch.examples.DigitsTrainer`` (an MLP) and ``DigitsConvTrainer`` (a small CNN
with BatchNorm) are complete, fusible examples on scikit-learn digits.
"""

from __future__ import annotations

from stagetree.torch.determinism import deterministic
from stagetree.torch.fused import FusibleTrainer, TorchFusedGroup
from stagetree.torch.loader import StageLoader
from stagetree.torch.optim import OPTIMIZER_HP, set_optimizer_hp
from stagetree.torch.rng import get_rng_state, preserve_rng, seed_rng, set_rng_state
from stagetree.torch.trainer import TorchTrainer

__all__ = [
    "OPTIMIZER_HP",
    "FusibleTrainer",
    "StageLoader",
    "TorchFusedGroup",
    "TorchTrainer",
    "deterministic",
    "get_rng_state",
    "preserve_rng",
    "seed_rng",
    "set_optimizer_hp",
    "set_rng_state",
]
