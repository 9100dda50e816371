"""PyTorch support: a self-checkpointing trainer, a resumable loader, RNG capture.

* :class:`TorchTrainer` -- subclass it, write ``__init__``/``train``/``evaluate`` as for a
  plain loop; checkpoints (model, optimizer, schedulers, loaders, every RNG), a trace-free
  ``evaluate`` and a ``setup`` applying optimizer values and batch size come for free.
* :class:`StageLoader` -- minibatches in an order fixed by ``(seed, epoch)``, resumable
  mid-epoch, batch size changeable between steps.
* :func:`set_optimizer_hp` -- write lr / momentum / betas / ... into every param group,
  with a ``ValueError`` for names the optimizer lacks.
* :func:`deterministic` -- deterministic algorithms and a fixed thread count.
* :func:`get_rng_state` / :func:`set_rng_state` / :func:`seed_rng` /
  :func:`preserve_rng` -- every global generator (torch CPU and CUDA, numpy, python) at once.

``stagetree.torch.examples.DigitsTrainer`` is a complete example on scikit-learn digits.
"""

from __future__ import annotations

from stagetree.torch.determinism import deterministic
from stagetree.torch.loader import StageLoader
from stagetree.torch.optim import OPTIMIZER_HP, set_optimizer_hp
from stagetree.torch.rng import get_rng_state, preserve_rng, seed_rng, set_rng_state
from stagetree.torch.trainer import TorchTrainer

__all__ = [
    "OPTIMIZER_HP",
    "StageLoader",
    "TorchTrainer",
    "deterministic",
    "get_rng_state",
    "preserve_rng",
    "seed_rng",
    "set_optimizer_hp",
    "set_rng_state",
]
