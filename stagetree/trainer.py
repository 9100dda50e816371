"""The :class:`Trainer` base class that users subclass, and :class:`FusedGroup`, what
``Trainer.fuse`` returns (its helpers live in :mod:`stagetree.fusion`)."""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from stagetree.exceptions import FusionError, TrainerError

__all__ = [
    "FusedGroup",
    "Trainer",
    "building_to_restore",
    "built_to_restore",
    "caller_rng_kept",
    "check_checkpointable",
    "keep_caller_rng",
]

# Whether trainers that swap their own random streams into the process-global generators
# (TorchTrainer) put the caller's back when a method returns: see keep_caller_rng.
_caller_rng = {"kept": True}


def keep_caller_rng(kept: bool) -> None:
    """Say whether code outside the trainers of this process draws from the global
    random generators (True, the default: a trainer's methods leave them as the caller
    had them). A worker process, whose own code draws nothing, says False: a
    :class:`~stagetree.torch.TorchTrainer` then only swaps its own streams in when a
    method starts and keeps what the method drew when it ends, without saving and
    restoring the caller's (about half of the cost of each ``train()``, ``setup()`` and
    ``evaluate()`` call's RNG handling). Training is the same either way: every method
    starts from the trainer's own streams."""
    _caller_rng["kept"] = bool(kept)


def caller_rng_kept() -> bool:
    """See :func:`keep_caller_rng`."""
    return _caller_rng["kept"]


# Whether the trainers this thread constructs now are restored right after: see
# built_to_restore.
_restoring = threading.local()


@contextlib.contextmanager
def built_to_restore() -> Iterator[None]:
    """Trainers constructed in this block (by this thread) get ``load_state_dict`` right
    after, before any other call: a trainer class that says so may skip the part of its
    construction the restore overwrites (see
    :attr:`stagetree.torch.TorchTrainer.restore_skips_init`); the others build as
    always. A worker builds the trainer of a batch that starts from a checkpoint in it.
    """
    before = building_to_restore()
    _restoring.on = True
    try:
        yield
    finally:
        _restoring.on = before


def building_to_restore() -> bool:
    """Whether this thread is inside :func:`built_to_restore`."""
    return bool(getattr(_restoring, "on", False))


class Trainer:
    """One model under training. stagetree drives it one step at a time.

    Contract (held to exactly by every executor):

    * ``__init__(config)`` receives the trial's *fixed* hyper-parameters (optimizer
      type, weight decay, architecture, seed, ...) and builds model, data and optimizer.
      It must be deterministic given ``config``.
    * ``setup(hp)`` receives values of *sequential* hyper-parameters. Before the t-th call
      of ``train()`` (t = 0, 1, ...) the trainer has been given the value at step t of
      every sequence: all of them before the first step and after any restore from a
      checkpoint, only the changed ones otherwise.
    * ``train()`` runs one step (one logical iteration) and may return training metrics:
      None or a dict of numbers (anything else fails the trial with a ``TypeError``).
      They are recorded at every step, as the trial's learning curve.
    * ``evaluate()`` returns metrics of the current model. Metrics "at step S" are
      ``evaluate()`` after S calls of ``train()``, merged with what the S-th call of
      ``train()`` returned. It is called at the steps a tuner asks for and, for the
      learning curve, every ``eval_every`` steps (a :class:`~stagetree.Study` option;
      every step by default), so it must be cheap enough for that, and it must leave
      no trace on training: no RNG draws that training sees, no change of train/eval
      mode, no data position.
    * **Metric names**: ``train()``'s metrics are stored under their own names, and
      ``evaluate()``'s win a clash at the steps where both exist. Give training metrics
      distinct names (``train_loss`` beside ``evaluate()``'s ``loss``), or a curve
      would mix the two wherever the model was not evaluated.
    * ``state_dict()`` / ``load_state_dict(state)`` capture and restore *everything*
      that shapes future training (model, optimizer, every RNG, data order and
      position), so that a restored trainer continues bit for bit. The state must be
      made of tensors, numpy arrays, numbers, strings, lists, tuples and dicts only.
      The restored trainer is constructed fresh with the same ``config`` first.
      ``None`` is allowed too (PyTorch's optimizer states hold it).

    ``TorchTrainer`` in :mod:`stagetree.torch` implements ``state_dict`` for PyTorch
    users by itself.

    Attributes:
        hyperparameters: class attribute; the sequential hyper-parameter names ``setup``
            applies, or None (the default) when not declared. Declared names are
            enforced: a trial, space or query with another name raises
            :class:`~stagetree.exceptions.InvalidTrialError` before anything is written
            (with a "did you mean"). Undeclared, the names ``setup`` reads are observed
            and a name never read is warned about (see :mod:`stagetree.names`).
            A subclass that overrides ``setup`` must declare again for its names to be
            enforced. ``stagetree check`` (:func:`stagetree.check_trainer`) tells whether
            a trainer is exact.
        config_names: class attribute; the fixed configuration names ``__init__``
            reads, or None (the default) when not declared. Declared, a tuner's space
            with another fixed name (a typo) is refused by ``Study.tune`` and
            ``stagetree run`` before any worker starts, with a "did you mean".
        metric_names: class attribute; the metric names ``evaluate()`` and ``train()``
            return, or None (the default) when not declared. Declared, a tuner whose
            metric is not among them is refused before any worker starts.
        fusible: class attribute; the sequential hyper-parameter names that may differ
            between members of a fused job (see :mod:`stagetree.fusion`); empty (the
            default): the class cannot be fused, and :meth:`fuse` is never called.
        devices_needed: optional class attribute; the devices one trial needs on its
            worker, an int (``devices_needed = 2``) or a function of the fixed config
            (a classmethod or staticmethod ``devices_needed(config) -> int``). Its
            stages go only to workers with at least that many devices; undeclared,
            one, and a CUDA out-of-memory error doubles it (see
            :mod:`stagetree.executors.devices`).
    """

    hyperparameters: ClassVar[Collection[str] | None] = None
    config_names: ClassVar[Collection[str] | None] = None
    metric_names: ClassVar[Collection[str] | None] = None
    fusible: ClassVar[frozenset[str]] = frozenset()

    def fused_width_limit(self) -> int | None:
        """Optional: the most members of this trainer's kind that one fused job should
        hold on its device (e.g. from the free accelerator memory); None (the default):
        no limit. A worker given a wider job runs it in chunks of this width."""
        return None

    @classmethod
    def fuse(cls, members: Sequence[Trainer]) -> FusedGroup:
        """Train ``members`` (all at the same state) as one job; see
        :class:`stagetree.fusion.FusedGroup`.

        Raises:
            FusionError: the members cannot be fused (always, unless a subclass
                implements fusion).
        """

        raise FusionError(f"{cls.__qualname__} does not implement fused training")

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    @classmethod
    def warmup(cls) -> None:
        """Optional: one-off work a worker process does when it starts, before it says it
        is ready (import heavy libraries, load and cache a data set), so that the
        workers' cold starts overlap instead of delaying each one's first batch. It must
        not change anything training depends on (leave global RNGs as they were)."""

    def setup(self, hp: Mapping[str, Any]) -> None:
        """Receive sequence values for the coming step (see the class contract)."""

    def train(self) -> Mapping[str, float] | None:
        """Run one step."""
        raise NotImplementedError

    def evaluate(self) -> Mapping[str, float]:
        """Return metrics of the current model without changing training."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume training exactly."""
        raise NotImplementedError(
            f"{type(self).__name__}.state_dict() is not implemented: stagetree checkpoints "
            "every trainer it shares; implement state_dict() and load_state_dict() (or "
            "subclass stagetree.torch.TorchTrainer, which does it for PyTorch)"
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        raise NotImplementedError(
            f"{type(self).__name__}.load_state_dict() is not implemented; see state_dict()"
        )


class FusedGroup(ABC):
    """B member trainers trained as one job.

    Built by ``TrainerClass.fuse(members)`` from trainers that all hold the same state
    (built from the same config and restored from the same checkpoint, or fresh), before
    any of them was given sequence values. Contract:

    * :meth:`setup` ``(i, hp)`` gives member ``i`` its sequence values, exactly as
      ``Trainer.setup`` would (all of them before the first step, only changes after).
      Names outside the class's fusible set have the same value for every member.
    * :meth:`step` trains one step (one ``train()``) of every member at once and returns
      each member's training metrics, in member order. The first call is where a model
      that cannot be fused is found: it raises
      :class:`~stagetree.exceptions.FusionError` then, and the group must be dropped
      (its members' state is undefined).
    * :meth:`sync` ``(i)`` writes member ``i``'s current state into its trainer object
      (model, optimizer, data position, RNG streams), so that ``members[i].evaluate()``
      and ``members[i].state_dict()`` are exactly those of member ``i``. Training steps
      after it do not change the trainer object until the next ``sync``. With
      ``optimizer=False`` it may leave the optimizer state out (what ``evaluate()`` sees
      is enough: the cheap sync the worker uses to evaluate, not to checkpoint).
    * :meth:`remove` ``(i)`` takes member ``i`` out (synced first) and returns its
      trainer, which continues as an ordinary trainer; the indices of later members
      shift down by one.
    """

    @property
    @abstractmethod
    def members(self) -> Sequence[Trainer]:
        """The member trainers, in member order."""

    @abstractmethod
    def setup(self, i: int, hp: Mapping[str, Any]) -> None:
        """Give member ``i`` sequence values (see the class contract)."""

    @abstractmethod
    def step(self) -> list[dict[str, float]]:
        """One training step of every member; their training metrics."""

    @abstractmethod
    def sync(self, i: int, optimizer: bool = True) -> None:
        """Make member ``i``'s trainer object hold its current state (without the
        optimizer's when ``optimizer`` is False)."""

    @abstractmethod
    def remove(self, i: int) -> Trainer:
        """Member ``i`` leaves the job (synced); returns its trainer."""


def check_checkpointable(trainer: type) -> None:
    """Raise :class:`TrainerError` when ``trainer`` leaves ``state_dict`` or
    ``load_state_dict`` to :class:`Trainer` (which raises): every tuning run checkpoints
    its trials, so such a trainer would fail at its first checkpoint, after training.
    """
    missing = [
        name
        for name in ("state_dict", "load_state_dict")
        if getattr(trainer, name, None) is getattr(Trainer, name)
    ]
    if missing:
        raise TrainerError(
            f"{trainer.__name__} does not implement {' and '.join(f'{m}()' for m in missing)}: "
            "stagetree checkpoints every trial it tunes, so it would fail at its first "
            "checkpoint; implement state_dict() and load_state_dict() (or subclass "
            "stagetree.torch.TorchTrainer, which does it for PyTorch)"
        )
