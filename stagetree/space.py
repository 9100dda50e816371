"""Search spaces: the set of trials a study may run.

A trial (:class:`TrialSpec`) is fixed hyper-parameters (``config``: optimizer, weight
decay, architecture, seed; they select the plan tree through the root key) plus
sequential hyper-parameters (``hp``: :class:`stagetree.hp.Sequence` by name, functions
of the step; they decide what trials share inside a tree).

Two spaces ship here:

* :class:`GridSpace`: the Cartesian product of option lists, in a deterministic order.
* :class:`RandomSpace`: entries are distributions (:mod:`stagetree.distributions`),
  sequence templates (a sequence family with a distribution among its arguments) or
  plain values; trials are drawn from a seeded :class:`random.Random`.

:func:`load_space_file` runs a Python file that defines ``space`` and ``steps``; it is
what ``stagetree explain SPACE.py`` reads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import runpy
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagetree.distributions import Choice, Distribution, shared_draws
from stagetree.exceptions import (
    InvalidSequenceError,
    InvalidSpaceError,
    InvalidTrialError,
    StagetreeError,
)
from stagetree.hp import Sequence, Value, as_sequence

__all__ = [
    "BaseSpace",
    "GridSpace",
    "RandomSpace",
    "SpaceFile",
    "TrialSpec",
    "canonical_json",
    "config_key",
    "load_space_file",
    "strict_json",
    "validate_trial",
]

Where = Callable[["TrialSpec"], bool]
_SCALARS = (str, int, float, bool)


# --------------------------------------------------------------------------- values


def _is_template(value: Any) -> bool:
    """A sequence family built with a distribution among its arguments."""
    return bool(getattr(value, "is_template", False)) and callable(getattr(value, "sample", None))


def _fixed_value_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a fixed hyper-parameter value, None if it can.

    Fixed values end up in the root key's canonical JSON and in ``Trainer(config)``:
    they must be JSON scalars, or lists/tuples of them (e.g. layer sizes).
    """
    if isinstance(value, float) and not math.isfinite(value):
        return f"non-finite float {value!r}"
    if isinstance(value, _SCALARS):
        return None
    if isinstance(value, (list, tuple)):
        for item in value:
            problem = _fixed_value_problem(item)
            if problem is not None:
                return problem
        return None
    return f"unsupported value {value!r} of type {type(value).__name__}"


def _check_fixed_value(name: str, value: Any) -> None:
    problem = _fixed_value_problem(value)
    if problem is not None:
        raise InvalidSpaceError(
            f"fixed hyper-parameter {name!r}: {problem} "
            "(expected str, int, float, bool, or a list/tuple of them)"
        )


def _to_sequence(name: str, value: Any) -> Sequence:
    """``value`` as a sequence, or an :class:`InvalidSpaceError` naming the entry."""
    if isinstance(value, Sequence):
        return value
    if isinstance(value, Distribution) or _is_template(value):
        raise InvalidSpaceError(
            f"hyper-parameter {name!r}: {value!r} is a distribution or template; "
            "only a RandomSpace samples those"
        )
    if value is None or isinstance(value, (dict, list, tuple, set)):
        raise InvalidSpaceError(
            f"hyper-parameter {name!r}: unsupported value {value!r} of type "
            f"{type(value).__name__} (expected a stagetree.hp.Sequence or a plain number)"
        )
    try:
        return as_sequence(value)
    except InvalidSequenceError as exc:
        raise InvalidSpaceError(f"hyper-parameter {name!r}: {exc}") from exc


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys; tuples are written as lists.

    Sequences (frozen, hashable) are written through ``repr`` so that a mapping holding
    them still has one canonical text.
    """
    return _CANONICAL.encode(value)


# json.dumps would build an encoder per call (most of the cost of a small config's text)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=repr)


def strict_json(value: Any) -> str:
    """``json.dumps(value, allow_nan=False)``: a NaN, an infinity or a value JSON cannot
    hold raises (``ValueError``, ``TypeError``), without an encoder built per call (a
    trial's config and its tuner's log records are checked this way at each
    submission)."""
    return _STRICT.encode(value)


_STRICT = json.JSONEncoder(allow_nan=False)


def config_key(config: Mapping[str, Any], salt: str = "") -> str:
    """Stable short hash (16 hex digits) of the canonical JSON of ``config``.

    Args:
        config: fixed hyper-parameters.
        salt: mixed into the hash, e.g. a trainer fingerprint, so that two trainers
            with equal configs get different trees.
    """
    text = salt + "\n" + canonical_json(dict(config))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------- trials


@dataclass(frozen=True, eq=False, init=False)
class TrialSpec:
    """One trial of a space.

    Attributes:
        config: fixed hyper-parameters by name (JSON-like values).
        hp: sequential hyper-parameters by name; plain numbers are turned into
            :class:`stagetree.hp.Constant` by :func:`stagetree.hp.as_sequence`.

    Both mappings are copied and sorted by name at construction; treat them as
    read-only. Equality and hash go through :attr:`key` (canonical JSON of ``config``,
    sequences in name order), so trials can be set members and dict keys.
    """

    config: Mapping[str, Any]
    hp: Mapping[str, Sequence]

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        hp: Mapping[str, Sequence | Value] | None = None,
    ) -> None:
        config = {} if config is None else config
        hp = {} if hp is None else hp
        if not isinstance(config, Mapping) or not isinstance(hp, Mapping):
            raise InvalidTrialError("TrialSpec needs mappings for config and hp")
        for name in itertools.chain(config, hp):
            if not isinstance(name, str):
                raise InvalidTrialError(f"hyper-parameter names must be str, got {name!r}")
        both = sorted(set(config) & set(hp))
        if both:
            raise InvalidTrialError(f"names both fixed and sequential: {both}")
        for name, value in config.items():
            problem = _fixed_value_problem(value)
            if problem is not None:
                raise InvalidTrialError(f"fixed hyper-parameter {name!r}: {problem}")
        seqs: dict[str, Sequence] = {}
        for name in sorted(hp):
            try:
                seqs[name] = as_sequence(hp[name])
            except InvalidSequenceError as exc:
                raise InvalidTrialError(f"hyper-parameter {name!r}: {exc}") from exc
        fixed = {k: config[k] for k in sorted(config)}
        object.__setattr__(self, "config", fixed)
        object.__setattr__(self, "hp", seqs)
        object.__setattr__(self, "_key", (canonical_json(fixed), tuple(seqs.items())))

    def __reduce__(self) -> tuple[Any, ...]:
        return (TrialSpec, (dict(self.config), dict(self.hp)))

    @property
    def key(self) -> tuple[str, tuple[tuple[str, Sequence], ...]]:
        """Canonical identity: ``(canonical JSON of config, ((name, sequence), ...))``."""
        key: tuple[str, tuple[tuple[str, Sequence], ...]] = self.__dict__["_key"]
        return key

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrialSpec):
            return NotImplemented
        return self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"TrialSpec(config={dict(self.config)!r}, hp={dict(self.hp)!r})"

    @property
    def root_config(self) -> dict[str, Any]:
        """A fresh copy of the fixed hyper-parameters: what selects the plan tree."""
        return dict(self.config)

    def root_key(self, salt: str = "") -> str:
        """:func:`config_key` of :attr:`root_config` (``salt``: e.g. a trainer fingerprint)."""
        return config_key(self.config, salt)


def validate_trial(
    space: BaseSpace | Iterable[str],
    trial: TrialSpec,
    fixed_names: Iterable[str] | None = None,
) -> TrialSpec:
    """Check that ``trial`` has exactly the hyper-parameter names of a study.

    Args:
        space: a space (its ``names`` and ``fixed_names`` are used), or the sequential
            hyper-parameter names.
        trial: the trial to check.
        fixed_names: fixed names to check too when ``space`` is a list of names; None
            skips that check.

    Returns:
        ``trial`` unchanged.

    Raises:
        InvalidTrialError: naming the missing and the unexpected names.
    """
    if not isinstance(trial, TrialSpec):
        raise InvalidTrialError(f"expected a TrialSpec, got {trial!r}")
    if isinstance(space, BaseSpace):
        names: set[str] = set(space.names)
        fixed: set[str] | None = set(space.fixed_names)
    else:
        names = set(space)
        fixed = None if fixed_names is None else set(fixed_names)
    problems = []
    for kind, expected, got in (
        ("sequential", names, set(trial.hp)),
        ("fixed", fixed, set(trial.config)),
    ):
        if expected is None or expected == got:
            continue
        problems.append(
            f"{kind} hyper-parameter names differ from the study's: "
            f"missing {sorted(expected - got)}, unexpected {sorted(got - expected)}"
        )
    if problems:
        raise InvalidTrialError("; ".join(problems))
    return trial


# --------------------------------------------------------------------------- spaces


def _check_names(hp: Any, fixed: Any) -> tuple[dict[Any, Any], dict[Any, Any]]:
    if not isinstance(hp, Mapping):
        raise InvalidSpaceError(f"hp must be a dict of name -> options, got {type(hp).__name__}")
    if fixed is None:
        fixed = {}
    if not isinstance(fixed, Mapping):
        raise InvalidSpaceError(
            f"fixed must be a dict of name -> options, got {type(fixed).__name__}"
        )
    for name in itertools.chain(hp, fixed):
        if not isinstance(name, str) or not name:
            raise InvalidSpaceError(f"hyper-parameter names must be non-empty str, got {name!r}")
    both = sorted(set(hp) & set(fixed))
    if both:
        raise InvalidSpaceError(f"names both in hp and in fixed: {both}")
    if not hp:
        raise InvalidSpaceError("the space has no sequential hyper-parameter (hp is empty)")
    return dict(hp), dict(fixed)


class BaseSpace(ABC):
    """A set of trials.

    Contract for subclasses:

    * ``names``: sorted names of the sequential hyper-parameters; every trial has
      exactly these in ``hp``. ``fixed_names``: same for ``config``.
    * ``trials(n, seed)`` returns a list of :class:`TrialSpec` that depends only on the
      space, ``n`` and ``seed`` (no global random state): same arguments, same list.
    * Construction validates everything that can be checked without sampling and raises
      :class:`InvalidSpaceError` naming the offending entry.
    """

    @property
    @abstractmethod
    def names(self) -> tuple[str, ...]:
        """Sorted names of the sequential hyper-parameters."""

    @property
    @abstractmethod
    def fixed_names(self) -> tuple[str, ...]:
        """Sorted names of the fixed hyper-parameters."""

    @abstractmethod
    def trials(self, n: int | None = None, seed: int = 0) -> list[TrialSpec]:
        """Trials of the space (see the subclass for what ``n`` and ``seed`` mean)."""

    def validate(self, trial: TrialSpec) -> TrialSpec:
        """:func:`validate_trial` against this space."""
        return validate_trial(self, trial)


def _grid_options(name: str, entry: Any, sequential: bool) -> list[Any]:
    """Options of one grid entry: a list/tuple of options, or one bare option."""
    options = list(entry) if isinstance(entry, (list, tuple)) else [entry]
    if not options:
        raise InvalidSpaceError(f"grid entry {name!r} has no options (empty list)")
    if sequential:
        out: list[Any] = [_to_sequence(name, o) for o in options]
    else:
        for o in options:
            if isinstance(o, Distribution) or _is_template(o):
                raise InvalidSpaceError(
                    f"fixed hyper-parameter {name!r}: {o!r} is a distribution; "
                    "only a RandomSpace samples those"
                )
            _check_fixed_value(name, o)
        out = options
    # Sequences compare by value (hashable); fixed values by canonical JSON (1 != 1.0).
    # A set, not a scan of the options before each: a list may be long.
    seen: set[Any] = set()
    for o in out:
        key = o if sequential else canonical_json(o)
        if key in seen:
            raise InvalidSpaceError(f"grid entry {name!r} lists the option {o!r} twice")
        seen.add(key)
    return out


class GridSpace(BaseSpace):
    """Every combination of the listed options.

    Args:
        hp: sequential hyper-parameters: name -> list of options, each a
            :class:`stagetree.hp.Sequence` or a plain number (a constant). A bare option
            (not in a list) counts as a one-option list.
        fixed: fixed hyper-parameters: name -> list of values (str, int, float, bool, or
            lists/tuples of them).
        where: keeps only the trials for which it returns True.

    Order: fixed configurations vary slowest (trials of one plan tree are contiguous),
    then the hp entries; within each, entries in dict order, the first varying slowest
    (``itertools.product`` order), options in list order.

    Raises:
        InvalidSpaceError: empty hp, an empty option list, an unsupported value, a name
            in both hp and fixed, a non-string name, a duplicated option, or a ``where``
            that rejects every combination.
    """

    def __init__(
        self,
        hp: Mapping[str, Any],
        fixed: Mapping[str, Any] | None = None,
        where: Where | None = None,
    ) -> None:
        hp_d, fixed_d = _check_names(hp, fixed)
        self._hp = {name: _grid_options(name, entry, True) for name, entry in hp_d.items()}
        self._fixed = {name: _grid_options(name, e, False) for name, e in fixed_d.items()}
        self._where = where
        # The points are never built here: a grid of a million points is a product of
        # a few short lists, and is enumerated lazily where it is consumed.
        self._size: int | None = self.size_before_filter if where is None else None
        if where is not None and next(self._enumerate(), None) is None:
            raise InvalidSpaceError(
                f"the grid is empty: where={where!r} rejects all "
                f"{self.size_before_filter} combinations"
            )

    def _enumerate(self) -> Iterator[TrialSpec]:
        fixed_names, hp_names = list(self._fixed), list(self._hp)
        for fixed_values in itertools.product(*self._fixed.values()):
            config = dict(zip(fixed_names, fixed_values))
            for seqs in itertools.product(*self._hp.values()):
                trial = TrialSpec(config, dict(zip(hp_names, seqs)))
                if self._where is None or self._where(trial):
                    yield trial

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._hp))

    @property
    def fixed_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._fixed))

    @property
    def size_before_filter(self) -> int:
        """Size of the full product, before ``where``."""
        return math.prod(len(o) for o in itertools.chain(self._hp.values(), self._fixed.values()))

    @property
    def size(self) -> int:
        """The number of trials: the product of the option counts, computed without
        building a point; with ``where``, counted by enumerating once (then kept)."""
        if self._size is None:
            self._size = sum(1 for _ in self._enumerate())
        return self._size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[TrialSpec]:
        return self._enumerate()

    def __getitem__(self, index: int) -> TrialSpec:
        """The trial at ``index`` in grid order, built alone (without ``where``)."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"grid indices must be integers, got {index!r}")
        size = self.size
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"grid index {index} out of range for a grid of {size}")
        if self._where is not None:
            return next(itertools.islice(self._enumerate(), index, None))
        # Mixed radix over (fixed..., hp...), the last entry varying fastest.
        lists = [*self._fixed.values(), *self._hp.values()]
        picks: list[Any] = []
        for options in reversed(lists):
            index, i = divmod(index, len(options))
            picks.append(options[i])
        picks.reverse()
        nf = len(self._fixed)
        return TrialSpec(dict(zip(self._fixed, picks[:nf])), dict(zip(self._hp, picks[nf:])))

    def __repr__(self) -> str:
        size = f"{self._size}" if self._size is not None else f"<= {self.size_before_filter}"
        return f"GridSpace({size} trials, hp={list(self._hp)}, fixed={list(self._fixed)})"

    def trials(self, n: int | None = None, seed: int = 0) -> list[TrialSpec]:
        """All trials in grid order (``n`` None), or ``n`` of them chosen with
        ``random.Random(seed)`` without replacement, kept in grid order (built one by
        one: a sample of a huge grid does not enumerate it).

        Raises:
            InvalidSpaceError: ``n`` is not an int in ``[1, len(self)]``.
        """
        if n is None:
            return list(self._enumerate())
        size = self.size
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= size:
            raise InvalidSpaceError(f"n must be an int in [1, {size}] for this grid, got {n!r}")
        picked = sorted(random.Random(seed).sample(range(size), n))
        if self._where is not None:
            points = list(self._enumerate())
            return [points[i] for i in picked]
        return [self[i] for i in picked]


def _check_random_hp(name: str, entry: Any) -> None:
    """Validate a RandomSpace hp entry as far as possible without sampling."""
    if isinstance(entry, Choice):
        for option in entry.options:
            _check_random_hp(name, option)
    elif isinstance(entry, Distribution) or _is_template(entry):
        return  # checked when sampled
    else:
        _to_sequence(name, entry)


def _check_random_fixed(name: str, entry: Any) -> None:
    if isinstance(entry, list):
        raise InvalidSpaceError(
            f"fixed hyper-parameter {name!r}: a list is ambiguous in a RandomSpace; "
            "write Choice([...]) for a choice, or a tuple for one list-valued value"
        )
    if isinstance(entry, Choice):
        for option in entry.options:
            if not isinstance(option, Distribution):
                _check_fixed_value(name, option)
    elif _is_template(entry):
        raise InvalidSpaceError(
            f"fixed hyper-parameter {name!r}: {entry!r} is a sequence template; "
            "sequences belong in hp"
        )
    elif not isinstance(entry, Distribution):
        _check_fixed_value(name, entry)


class RandomSpace(BaseSpace):
    """Trials drawn at random.

    Args:
        hp: sequential hyper-parameters: name -> a :class:`stagetree.hp.Sequence`, a
            plain number (constant), a sequence template (a family with a distribution
            among its arguments, e.g. ``MultiStep(init=LogUniform(1e-3, 0.3),
            milestones=Choice([[30, 45], [40]]), gamma=0.1)``), or a distribution whose
            values are any of those (e.g. ``Choice([seq1, seq2])``).
        fixed: fixed hyper-parameters: name -> a distribution or a plain value (str,
            int, float, bool, tuple). Plain lists are refused as ambiguous.
        where: keeps only trials for which it returns True; rejected draws are redrawn.
        max_rejections: consecutive rejected draws after which sampling gives up.

    Sampling uses only the ``random.Random`` it is given; entries are drawn in sorted
    name order, fixed before hp, so a seed always yields the same trials.
    """

    def __init__(
        self,
        hp: Mapping[str, Any],
        fixed: Mapping[str, Any] | None = None,
        where: Where | None = None,
        max_rejections: int = 1000,
    ) -> None:
        hp_d, fixed_d = _check_names(hp, fixed)
        for name, entry in hp_d.items():
            _check_random_hp(name, entry)
        for name, entry in fixed_d.items():
            _check_random_fixed(name, entry)
        if isinstance(max_rejections, bool) or not isinstance(max_rejections, int):
            raise InvalidSpaceError(f"max_rejections must be an int, got {max_rejections!r}")
        if max_rejections < 1:
            raise InvalidSpaceError(f"max_rejections must be >= 1, got {max_rejections}")
        self._hp = {k: hp_d[k] for k in sorted(hp_d)}
        self._fixed = {k: fixed_d[k] for k in sorted(fixed_d)}
        self._where = where
        self._max_rejections = max_rejections

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._hp)

    @property
    def fixed_names(self) -> tuple[str, ...]:
        return tuple(self._fixed)

    def __repr__(self) -> str:
        return f"RandomSpace(hp={list(self._hp)}, fixed={list(self._fixed)})"

    def _draw(self, rng: random.Random) -> TrialSpec:
        with shared_draws():  # each Shared name takes one value per trial
            return self._draw_entries(rng)

    def _draw_entries(self, rng: random.Random) -> TrialSpec:
        config: dict[str, Any] = {}
        for name, entry in self._fixed.items():
            value = _resolve(entry, rng)
            if isinstance(value, list):
                value = tuple(value)  # a drawn list is one list-valued value
            _check_fixed_value(name, value)
            config[name] = value
        hp: dict[str, Sequence] = {}
        for name, entry in self._hp.items():
            try:
                value = _resolve(entry, rng)
            except InvalidSequenceError as exc:  # a template drew arguments it refuses
                raise InvalidSpaceError(f"hyper-parameter {name!r}: {exc}") from exc
            hp[name] = _to_sequence(name, value)
        return TrialSpec(config, hp)

    def sample_one(self, rng: random.Random) -> TrialSpec:
        """Draw one trial that passes ``where``.

        Raises:
            InvalidSpaceError: ``max_rejections`` consecutive draws were rejected, or a
                distribution produced a value of an unsupported type.
        """
        for _ in range(self._max_rejections):
            trial = self._draw(rng)
            if self._where is None or self._where(trial):
                return trial
        raise InvalidSpaceError(
            f"where={self._where!r} rejected {self._max_rejections} draws in a row; "
            "the filter may reject (nearly) everything"
        )

    def sample(self, n: int, seed: int = 0, unique: bool = True) -> list[TrialSpec]:
        """Draw ``n`` distinct trials from ``random.Random(seed)``.

        A draw that repeats an earlier trial is drawn again (identical trials would train
        once and count as one), up to ``max(100, 10 * n)`` repeats in all.
        ``unique=False`` keeps every draw, repeats included.

        Raises:
            InvalidSpaceError: ``n`` is not an int >= 1, or the space gave fewer than
                ``n`` distinct trials within the repeats allowed (the message says how
                many it found: the space may hold no more).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidSpaceError(f"n must be an int >= 1, got {n!r}")
        rng = random.Random(seed)
        if not unique:
            return [self.sample_one(rng) for _ in range(n)]
        out: list[TrialSpec] = []
        seen: set[TrialSpec] = set()
        allowed = max(100, 10 * n)
        repeats = 0
        while len(out) < n:
            trial = self.sample_one(rng)
            if trial in seen:
                repeats += 1
                if repeats > allowed:
                    raise InvalidSpaceError(
                        f"the space gave only {len(out)} distinct trials in "
                        f"{len(out) + repeats} draws, not the {n} asked for: it may hold no "
                        f"more than {len(out)}; ask for at most {len(out)} trials, or widen "
                        "the space (more choices, continuous ranges)"
                    )
                continue
            seen.add(trial)
            out.append(trial)
        return out

    def trials(self, n: int | None = None, seed: int = 0) -> list[TrialSpec]:
        """Same as :meth:`sample`; ``n`` is required for a random space."""
        if n is None:
            raise InvalidSpaceError("a RandomSpace needs the number of trials n")
        return self.sample(n, seed)


def _resolve(entry: Any, rng: random.Random) -> Any:
    """Draw ``entry`` until it is no longer a distribution or template."""
    value = entry
    for _ in range(100):  # a distribution may yield another distribution (nested Choice)
        if isinstance(value, Distribution) or _is_template(value):
            value = value.sample(rng)
        else:
            return value
    raise InvalidSpaceError(f"{entry!r} nests distributions more than 100 levels deep")


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class SpaceFile:
    """What a space file defines.

    Attributes:
        space: the search space (module variable ``space``).
        steps: steps per trial: an int, or a callable ``steps(trial) -> int``.
        name: module variable ``name`` if defined, else the file's stem.
        num_trials: module variable ``num_trials`` (required for a random space).
        seed: module variable ``seed`` (default 0).
        path: the file.
    """

    space: BaseSpace
    steps: int | Callable[[TrialSpec], int]
    name: str
    num_trials: int | None = None
    seed: int = 0
    path: Path | None = None

    def steps_for(self, trial: TrialSpec) -> int:
        """Step count of ``trial``.

        Raises:
            InvalidSpaceError: ``steps(trial)`` raised, or did not return an int >= 1.
        """
        if callable(self.steps):
            try:
                value = self.steps(trial)
            except StagetreeError:
                raise
            except Exception as exc:
                raise InvalidSpaceError(
                    f"{self.name}: steps({trial!r}) raised {type(exc).__name__}: {exc}"
                ) from exc
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidSpaceError(
                    f"{self.name}: steps({trial!r}) returned {value!r}, expected an int >= 1"
                )
            return value
        return self.steps

    def trials(self, num_trials: int | None = None, seed: int | None = None) -> list[TrialSpec]:
        """The file's trials; arguments override ``num_trials`` and ``seed``."""
        n = self.num_trials if num_trials is None else num_trials
        return self.space.trials(n, self.seed if seed is None else seed)


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def load_space_file(
    path: str | Path,
    num_trials: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
) -> SpaceFile:
    """Run a Python file and collect its ``space`` and ``steps``.

    The file must define ``space`` (a :class:`BaseSpace`); it may define ``steps`` (an
    int >= 1, or a callable ``steps(trial) -> int``), ``num_trials`` (for a
    :class:`RandomSpace`), ``seed`` and ``name``. ``steps``, ``num_trials`` and ``seed``
    given here override the file's and need not be defined there, so a training script
    that defines only ``space`` can be planned; without them, the file must define
    ``steps``, and ``num_trials`` for a random space. It runs like ``python FILE`` would
    (its folder first on ``sys.path``, so it imports its neighbours), with ``__name__``
    set to ``"__stagetree_space__"``, so a ``if __name__ == "__main__"`` block does not
    run.

    Raises:
        InvalidSpaceError: the file does not exist, fails to run, or its variables are
            missing or invalid. A :class:`StagetreeError` raised by the file's own code
            (e.g. an invalid space) propagates unchanged.
    """
    # The overrides are checked before the file runs.
    if num_trials is not None and not _positive_int(num_trials):
        raise InvalidSpaceError(f"num_trials must be an int >= 1, got {num_trials!r}")
    if steps is not None and not _positive_int(steps):
        raise InvalidSpaceError(f"steps must be an int >= 1, got {steps!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidSpaceError(f"seed must be an int, got {seed!r}")
    p = Path(path)
    if not p.is_file():
        raise InvalidSpaceError(f"space file {str(p)!r} does not exist")
    saved_path = sys.path[:]
    sys.path.insert(0, str(p.resolve().parent))
    try:
        ns = runpy.run_path(str(p), run_name="__stagetree_space__")
    except StagetreeError:
        raise
    except SystemExit as exc:
        raise InvalidSpaceError(f"{p}: exited with status {exc.code!r} while loading") from exc
    except Exception as exc:
        raise InvalidSpaceError(f"{p}: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path[:] = saved_path
    if "space" not in ns:
        raise InvalidSpaceError(f"{p} defines no variable 'space' (a GridSpace or RandomSpace)")
    space = ns["space"]
    if not isinstance(space, BaseSpace):
        raise InvalidSpaceError(
            f"{p}: 'space' must be a stagetree.space.BaseSpace, got {type(space).__name__}"
        )
    trial_steps: int | Callable[[TrialSpec], int]
    if steps is not None:
        trial_steps = steps
    elif "steps" not in ns:
        raise InvalidSpaceError(
            f"{p} defines no variable 'steps' (an int, or a function steps(trial) -> int);"
            " define it or give --steps"
        )
    else:
        trial_steps = ns["steps"]
        if not callable(trial_steps) and not _positive_int(trial_steps):
            raise InvalidSpaceError(
                f"{p}: 'steps' must be an int >= 1 or a function steps(trial) -> int,"
                f" got {trial_steps!r}"
            )
    if num_trials is None:
        num_trials = ns.get("num_trials")
        if num_trials is not None and not _positive_int(num_trials):
            raise InvalidSpaceError(f"{p}: 'num_trials' must be an int >= 1, got {num_trials!r}")
    if num_trials is None and isinstance(space, RandomSpace):
        raise InvalidSpaceError(
            f"{p}: a RandomSpace needs 'num_trials' (an int >= 1), in the file or given "
            "with --num-trials"
        )
    if seed is None:
        seed = ns.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidSpaceError(f"{p}: 'seed' must be an int, got {seed!r}")
    name = ns.get("name", p.stem)
    if not isinstance(name, str):
        raise InvalidSpaceError(f"{p}: 'name' must be a str, got {name!r}")
    return SpaceFile(space, trial_steps, name, num_trials, seed, p)
