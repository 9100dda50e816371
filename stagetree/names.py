"""Hyper-parameter names that reach the trainer, and the metric names that come back.

A typo in a sequential hyper-parameter name (``lrx`` for ``lr``) would otherwise train
silently with the trainer's default. Two guards:

* **Declared names.** A trainer class may declare the sequential hyper-parameters its
  ``setup`` applies in :attr:`stagetree.Trainer.hyperparameters`. Every entry point of a
  :class:`~stagetree.Study` (``submit``, ``run``, ``eval``, ``state``, ``declare``, and
  ``tune`` for the tuner's space) checks names against it before anything is written,
  and raises :class:`~stagetree.exceptions.InvalidTrialError` naming the unknown name,
  the accepted ones and the closest match. :class:`~stagetree.torch.TorchTrainer`
  declares the names its default ``setup`` applies; a subclass that overrides ``setup``
  without declaring counts as undeclared (see :func:`accepted_hyperparameters`).
* **Observed reads.** For a trainer that declares nothing, the worker hands ``setup`` a
  dict that records which names are read (``hp[name]``, ``hp.get``, ``in``, iteration).
  After the first step of a freshly built or restored trainer, a name that was given
  but never read is reported once per worker process with an
  :class:`UnreadHyperparameterWarning` (on the worker's stderr).

A trainer may also declare the fixed configuration names its ``__init__`` reads
(:attr:`stagetree.Trainer.config_names`) and the metric names it returns
(:attr:`stagetree.Trainer.metric_names`): ``Study.tune`` and ``stagetree run`` then
refuse a space with another fixed name, or a tuner whose metric the trainer never
returns, before any worker starts (:func:`check_tuner_fits`).
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from stagetree.exceptions import InvalidTrialError, TunerError, UnreadHyperparameterWarning

__all__ = [
    "HpReadWatch",
    "UnreadHyperparameterWarning",
    "accepted_hyperparameters",
    "check_config_names",
    "check_hp_names",
    "check_metric_name",
    "check_space_names",
    "check_tuner_fits",
    "declared_names",
    "did_you_mean",
    "names_mismatch",
]

# Common spellings of the names TorchTrainer applies that difflib would not match.
_SYNONYMS = {
    "learning_rate": "lr",
    "learningrate": "lr",
    "learning-rate": "lr",
    "lr_rate": "lr",
    "step_size": "lr",
    "bs": "batch_size",
    "batchsize": "batch_size",
    "batch-size": "batch_size",
    "minibatch_size": "batch_size",
    "wd": "weight_decay",
    "decay": "weight_decay",
    "l2": "weight_decay",
    "weightdecay": "weight_decay",
    "mom": "momentum",
    "beta_1": "beta1",
    "beta_2": "beta2",
    "epsilon": "eps",
}


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """The accepted name closest to ``name`` (a known synonym or a near spelling)."""
    pool = sorted(set(candidates))
    synonym = _SYNONYMS.get(name.lower())
    if synonym in pool:
        return synonym
    for candidate in pool:
        if candidate.lower() == name.lower():
            return candidate
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    return close[0] if close else None


def _declared_in(cls: type, attribute: str) -> int | None:
    """Index in ``cls.__mro__`` of the class that defines ``attribute`` itself."""
    for i, klass in enumerate(cls.__mro__):
        if attribute in vars(klass):
            return i
    return None


def accepted_hyperparameters(trainer: type) -> frozenset[str] | None:
    """The sequential hyper-parameter names ``trainer`` accepts; None when unknown.

    The declaration (:attr:`Trainer.hyperparameters`) counts when it is made by the class
    that defines ``setup`` or by a subclass of it: a subclass that overrides ``setup``
    without declaring again may read any name (then reads are observed instead).
    """
    declared = _declared_in(trainer, "hyperparameters")
    if declared is None:
        return None
    names = getattr(trainer, "hyperparameters", None)
    if names is None:
        return None
    setup = _declared_in(trainer, "setup")
    if setup is not None and setup < declared:
        return None
    if isinstance(names, str):
        raise TypeError(
            f"{trainer.__name__}.hyperparameters must be a collection of names, "
            f"not the string {names!r}"
        )
    return frozenset(str(n) for n in names)


def _with_hints(unknown: Iterable[str], accepted: Iterable[str]) -> list[str]:
    """Each unknown name quoted, with the accepted name it was probably meant to be."""
    out = []
    for name in unknown:
        hint = did_you_mean(name, accepted)
        out.append(f"{name!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    return out


def check_hp_names(trainer: type, names: Iterable[str], *, what: str = "trial") -> None:
    """Raise :class:`InvalidTrialError` for names ``trainer`` declares it does not apply.

    Args:
        trainer: the trainer class.
        names: sequential hyper-parameter names of a trial (or a space).
        what: how the message calls the thing checked (``"trial"``, ``"space"``).
    """
    accepted = accepted_hyperparameters(trainer)
    if accepted is None:
        return
    unknown = sorted(set(names) - accepted)
    if not unknown:
        return
    parts = _with_hints(unknown, accepted)
    cls = trainer.__name__
    raise InvalidTrialError(
        f"{what} has sequential hyper-parameter(s) {', '.join(parts)} that {cls} does not "
        f"apply; {cls} accepts {sorted(accepted)}. If your trainer reads other names, "
        f"declare them: `hyperparameters = {_base_expr(trainer)} | {{{unknown[0]!r}}}`"
    )


def check_space_names(trainer: type, space: Any) -> None:
    """:func:`check_hp_names` for every sequential name of a tuner's space, and
    :func:`check_config_names` for every fixed name (a space with ``names`` and
    ``fixed_names``, or a list of trial specs); anything else is left to the
    submissions."""
    if space is None:
        return
    what = "the tuner's space"
    names = getattr(space, "names", None)
    if isinstance(names, (tuple, list, frozenset, set)):
        check_hp_names(trainer, names, what=what)
        fixed = getattr(space, "fixed_names", None)
        if isinstance(fixed, (tuple, list, frozenset, set)):
            check_config_names(trainer, fixed, what=what)
        return
    if isinstance(space, (list, tuple)):
        for spec in space:
            hp = getattr(spec, "hp", None)
            if hp is not None:
                check_hp_names(trainer, hp, what=what)
            config = getattr(spec, "config", None)
            if isinstance(config, dict):
                check_config_names(trainer, config, what=what)


def declared_names(trainer: type, attribute: str) -> frozenset[str] | None:
    """The names a trainer class declares in ``attribute`` (``config_names``,
    ``metric_names``); None when it declares none."""
    names = getattr(trainer, attribute, None)
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(
            f"{trainer.__name__}.{attribute} must be a collection of names, "
            f"not the string {names!r}"
        )
    return frozenset(str(n) for n in names)


def check_config_names(trainer: type, names: Iterable[str], *, what: str = "trial") -> None:
    """Raise :class:`InvalidTrialError` for fixed names (``config`` keys) that
    ``trainer`` declares it does not read (:attr:`stagetree.Trainer.config_names`)."""
    accepted = declared_names(trainer, "config_names")
    if accepted is None:
        return
    unknown = sorted(set(names) - accepted)
    if not unknown:
        return
    parts = _with_hints(unknown, accepted)
    cls = trainer.__name__
    raise InvalidTrialError(
        f"{what} has fixed hyper-parameter(s) {', '.join(parts)} that {cls} does not "
        f"read; {cls}.config_names is {sorted(accepted)}"
    )


def check_metric_name(trainer: type, metric: str, returned: Iterable[str] | None = None) -> None:
    """Raise :class:`TunerError` when a tuner's ``metric`` is not among the names the
    trainer returns: ``returned`` (what a check saw it return), else its declared
    :attr:`stagetree.Trainer.metric_names`; nothing is checked when neither is known."""
    known = declared_names(trainer, "metric_names") if returned is None else frozenset(returned)
    if known is None or metric in known:
        return
    hint = did_you_mean(metric, known)
    source = "returns" if returned is not None else "declares in metric_names"
    raise TunerError(
        f"the tuner's metric {metric!r} is not among the metrics {trainer.__name__} "
        f"{source}: {sorted(known)}" + (f" (did you mean {hint!r}?)" if hint else "")
    )


def check_tuner_fits(trainer: type, tuner: Any) -> None:
    """What can be told about a tuner against a trainer without training: the names of
    its space (:func:`check_space_names`) and its metric (:func:`check_metric_name`).

    Raises:
        InvalidTrialError: a sequential or fixed name the trainer does not take.
        TunerError: a metric the trainer declares it does not return.
    """
    check_space_names(trainer, getattr(tuner, "space", None))
    metric = getattr(tuner, "metric", None)
    if isinstance(metric, str):
        check_metric_name(trainer, metric)


def _base_expr(trainer: type) -> str:
    i = _declared_in(trainer, "hyperparameters")
    owner = trainer.__mro__[i] if i is not None else trainer
    return f"{owner.__qualname__}.hyperparameters"


def names_mismatch(label: str, have: frozenset[str], want: frozenset[str]) -> list[str]:
    """Phrases for names of a trial that differ from the study's (with suggestions)."""
    out = []
    extra = sorted(have - want)
    if extra:
        hints = [h for h in (did_you_mean(n, want - have) for n in extra) if h]
        out.append(
            f"unexpected {label} names {extra}"
            + (f" (did you mean {', '.join(repr(h) for h in hints)}?)" if hints else "")
        )
    if want - have:
        out.append(f"missing {label} names {sorted(want - have)}")
    return out


# --------------------------------------------------------------------------- observed reads


class _ObservedHp(dict[str, Any]):
    """A dict that records which keys were read."""

    __slots__ = ("read",)

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(values)
        self.read: set[Any] = set()

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def _all(self) -> None:
        self.read.update(super().keys())

    def __iter__(self) -> Iterator[Any]:
        self._all()
        return super().__iter__()

    def keys(self) -> Any:
        self._all()
        return super().keys()

    def items(self) -> Any:
        self._all()
        return super().items()

    def values(self) -> Any:
        self._all()
        return super().values()

    def copy(self) -> dict[str, Any]:
        self._all()
        return dict(super().items())

    def __reduce__(self) -> Any:
        self._all()
        return (dict, (dict(super().items()),))


class HpReadWatch:
    """Observes the first ``setup`` of each fresh trainer of a worker (see module docs).

    ``arm()`` when a trainer is built or restored; ``wrap(trainer, values)`` returns what
    to pass to ``setup``; ``after_step()`` after each ``train()``.
    """

    _reported: set[tuple[str, frozenset[str]]] = set()  # per process

    def __init__(self) -> None:
        self._armed = False
        self._watch: _ObservedHp | None = None
        self._trainer: type | None = None

    def arm(self) -> None:
        self._armed = True
        self._watch = None

    def wrap(self, trainer: object, values: dict[str, Any]) -> dict[str, Any]:
        if not self._armed:
            return values
        self._armed = False
        if accepted_hyperparameters(type(trainer)) is not None:
            return values
        self._watch = _ObservedHp(values)
        self._trainer = type(trainer)
        return self._watch

    def after_step(self) -> None:
        watch = self._watch
        if watch is None:
            return
        self._watch = None
        given = frozenset(dict.keys(watch))
        unread = sorted(given - watch.read)
        if not unread or self._trainer is None:
            return
        cls = self._trainer
        key = (f"{cls.__module__}.{cls.__qualname__}", frozenset(unread))
        if key in HpReadWatch._reported:
            return
        HpReadWatch._reported.add(key)
        read = sorted(given & watch.read)
        missing = sorted(str(n) for n in watch.read - given)  # asked for, not given
        hints = [h for h in (did_you_mean(n, missing or read) for n in unread) if h]
        asked = f"; it asked for {missing}, which no sequence gives" if missing else ""
        warnings.warn(
            f"stagetree: sequential hyper-parameter(s) {unread} reached "
            f"{cls.__name__}.setup() but were never read during the first step "
            f"(it read {read}{asked})"
            + (f"; did you mean {', '.join(repr(h) for h in hints)}?" if hints else "")
            + ". A typo trains with the trainer's default value. Declare "
            f"`hyperparameters = {{...}}` on {cls.__name__} to have unknown names "
            "rejected before anything is trained.",
            UnreadHyperparameterWarning,
            stacklevel=2,
        )
