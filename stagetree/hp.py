"""Hyper-parameter sequences: values as functions of the training step.

Every sequential hyper-parameter of a trial is a :class:`Sequence`: an immutable,
hashable object whose value at step ``t`` is ``seq(t)``. Sharing between trials is
decided by *values* (``MultiStep(0.1, [100], 0.1)`` and ``Constant(0.1)`` agree on
steps 0-99), so the module's hot path is :func:`first_difference`.

Families whose name matches a PyTorch scheduler give, at step ``t``, the learning
rate that scheduler gives after ``t`` calls of ``scheduler.step()`` (up to float
rounding; see ``tests/test_hp_torch_parity.py``).

Numbers are equal by *value*: ``Constant(128) == Constant(128.0)``, and
``MultiStep(128, [40], 2)`` shares its first 40 steps with ``Constant(128)``. A
sequence's values are *canonical* (:func:`canonical_value`): a number with an integral
value is an ``int`` (``128.0`` is handed to ``setup()`` as ``128``, so it stays usable
as a batch size), any other number a ``float``; a trial gets the same values, and so
bit for bit the same results, whichever spelling it was written with. A ``bool`` is not
a number here (``Constant(True) != Constant(1)``) and a ``str`` only equals itself.
:func:`first_difference` follows the same rule. A sequence keeps its arguments as
written (its JSON does not change).

Random search: when any argument of a family is a
:class:`stagetree.distributions.Distribution` (or a :class:`SequenceTemplate`), the
constructor returns a :class:`SequenceTemplate`, whose ``sample(rng)`` draws the
arguments and builds the real sequence.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import inspect
import json
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from stagetree.distributions import Distribution, sample_value
from stagetree.exceptions import InvalidSequenceError

__all__ = [
    "Constant",
    "Cosine",
    "CosineWarmRestarts",
    "Cyclic",
    "Exponential",
    "Linear",
    "MultiStep",
    "OneCycle",
    "Piecewise",
    "Sequence",
    "SequenceTemplate",
    "Shifted",
    "Step",
    "Then",
    "Value",
    "Warmup",
    "as_sequence",
    "canonical_value",
    "dumps_hp",
    "first_difference",
    "from_json",
    "loads_hp",
    "step_values",
    "written_value",
]

Value = Union[int, float, str, bool]
"""A hyper-parameter value at one step."""

_SCALARS = (int, float, str, bool)
# Values are computed and cached in aligned chunks of this many steps.
_CHUNK = 1024
_FAMILIES: dict[str, type[Sequence]] = {}


# --------------------------------------------------------------------------- checks


def _check_step(name: str, value: Any, minimum: int = 0) -> int:
    """A step count/position: an int (not bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSequenceError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidSequenceError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    """A finite real number (int or float, not bool), returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSequenceError(f"{name} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise InvalidSequenceError(f"{name} must be finite, got {value!r}")
    return x + 0.0  # turns -0.0 into 0.0 so that equal sequences have equal values


def _check_value(name: str, value: Any) -> Value:
    """A scalar hyper-parameter value (int, float, str, bool); floats must be finite."""
    if not isinstance(value, _SCALARS):
        raise InvalidSequenceError(
            f"{name} must be an int, float, str or bool, got {type(value).__name__} {value!r}"
        )
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidSequenceError(f"{name} must be finite, got {value!r}")
        return value + 0.0
    return value


def _check_milestones(name: str, value: Any) -> tuple[int, ...]:
    """A strictly increasing list of non-negative int steps, stored as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidSequenceError(f"{name} must be a list of ints, got {value!r}")
    steps = tuple(_check_step(f"{name}[{i}]", m) for i, m in enumerate(value))
    for i in range(1, len(steps)):
        if steps[i] <= steps[i - 1]:
            raise InvalidSequenceError(
                f"{name} must be strictly increasing (sorted, no duplicates), got {list(steps)}"
            )
    return steps


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _is_random(value: Any) -> bool:
    """Whether ``value`` holds a distribution or a template (recursively in lists/tuples)."""
    if isinstance(value, Distribution) or getattr(value, "is_template", False) is True:
        return True
    if isinstance(value, (list, tuple)):
        return any(_is_random(v) for v in value)
    return False


def canonical_value(value: Any) -> Any:
    """The one form of a value that sequences give (to ``setup()``, to the plan): a
    float with an integral value becomes that ``int`` (``128.0 -> 128``, ``0.0 -> 0``);
    anything else (other floats, ints, bools, strings) is returned as is.

    An int keeps a batch size usable, and integral numbers convert to floats exactly, so
    arithmetic with a learning rate of ``1`` gives what it gives with ``1.0``.
    """
    if value.__class__ is float and value.is_integer():
        return int(value)
    return value


def _canonical_list(values: list[Value]) -> list[Value]:
    """:func:`canonical_value` of each value (a list of values of one chunk)."""
    return [int(v) if v.__class__ is float and v.is_integer() else v for v in values]


class _Mark:
    """A marker in a flat identity key; equal to itself only (so never to a value)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_BOOL, _TUPLE, _OTHER = _Mark("bool"), _Mark("tuple"), _Mark("other")


def _flat_key(values: tuple[Any, ...], out: list[Any]) -> list[Any]:
    """Append to ``out`` a flat key for equality by value of ``values``: ``a == b``
    exactly when, value by value, the canonical forms (:func:`canonical_value`) have the
    same type and are equal (``1 == 1.0`` but ``1 != True``); tuples compare element by
    element, anything else (a sequence) by its own ``==``.

    Flat (one tuple, no pair per value): a drawn sequence's key costs a few words per
    value. Canonical ints, floats and strs go in as they are: equal values of two of
    those types are equal canonical forms of one type (an integral float is an int by
    then). A bool is marked (``True == 1`` otherwise), a tuple by its length, anything
    else by a marker (it never equals a plain value).
    """
    for v in values:
        tp = v.__class__
        if tp is float:
            out.append(int(v) if v.is_integer() else v)
        elif tp is int or tp is str:
            out.append(v)
        elif tp is bool:
            out += (_BOOL, v)
        elif tp is tuple:
            out += (_TUPLE, len(v))
            _flat_key(v, out)
        else:
            out += (_OTHER, v)
    return out


# --------------------------------------------------------------------------- base


class Sequence(ABC):
    """Base class of every hyper-parameter sequence.

    Contract for subclasses: a frozen dataclass (``@dataclass(frozen=True,
    eq=False)``; equality and hashing come from this base and are typed), whose
    ``__post_init__`` validates and normalises its arguments (lists become tuples,
    numbers of numeric families become floats) and raises
    :class:`~stagetree.exceptions.InvalidSequenceError`, and which implements
    ``_value(t)``; it may override ``_values(start, stop)`` with a faster equivalent
    that returns exactly ``[self._value(t) for t in range(start, stop)]``, and
    ``_canonical_values(start, stop)`` with one that returns exactly
    ``[canonical_value(v) for v in self._values(start, stop)]`` (a subclass of a family
    that overrides both, overriding ``_values``, overrides ``_canonical_values`` too).
    """

    is_template: ClassVar[bool] = False
    # Field name -> constructor/JSON argument name, where they differ.
    _json_names: ClassVar[Mapping[str, str]] = {}
    # Field name -> default value left out of the JSON (arguments added later).
    _json_defaults: ClassVar[Mapping[str, Any]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A distribution among the arguments makes this a template for random search.
        # Unpickling and copying call ``cls.__new__(cls)`` without arguments.
        if _is_random(args) or _is_random(tuple(kwargs.values())):
            return SequenceTemplate(cls, args, kwargs)
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Families are found by class name in JSON; a user class never shadows a built-in.
        existing = _FAMILIES.get(cls.__name__)
        if existing is None or existing.__module__ != __name__:
            _FAMILIES[cls.__name__] = cls

    # -- values

    @abstractmethod
    def _value(self, t: int) -> Value:
        """Value at step ``t`` (already validated)."""

    def _values(self, start: int, stop: int) -> list[Value]:
        """Values at steps ``start..stop-1``; overridden where a faster form exists."""
        value = self._value
        return [value(t) for t in range(start, stop)]

    def __call__(self, t: int) -> Value:
        """Value at step ``t`` (a non-negative int), in canonical form
        (:func:`canonical_value`)."""
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InvalidSequenceError(f"step must be a non-negative int, got {t!r}")
        value = self._value(t)
        if value.__class__ is float and value.is_integer():
            return int(value)
        return value

    def _canonical_values(self, start: int, stop: int) -> list[Value]:
        """:meth:`_values` in canonical form (:func:`canonical_value`)."""
        return _canonical_list(self._values(start, stop))

    def values(self, start: int, stop: int) -> list[Value]:
        """Values at steps ``start, ..., stop - 1`` in canonical form (a new list; cached
        underneath)."""
        _check_step("start", start)
        _check_step("stop", stop)
        if stop <= start:
            return []
        out: list[Value] = []
        for k in range(start // _CHUNK, (stop - 1) // _CHUNK + 1):
            chunk = _chunk(self, k)
            base = k * _CHUNK
            out.extend(chunk[max(start - base, 0) : min(stop - base, _CHUNK)])
        return out

    # -- composition

    def then(self, other: Sequence | SequenceTemplate | Value, at: int) -> Sequence:
        """``self`` before step ``at``, then ``other`` (which counts its steps from ``at``)."""
        return Then(first=self, second=other, at=at)  # type: ignore[arg-type]

    # -- identity

    def _key(self) -> tuple[Any, ...]:
        """``(hash, *flat key of the field values)`` (:func:`_flat_key`), cached in the
        instance (it is frozen); not pickled, since the hash of a str differs between
        processes. One flat tuple: a study keeps one per drawn sequence."""
        key = self.__dict__.get("_cached_key")
        if key is None:
            fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]
            flat = tuple(_flat_key(fields, []))
            key = (hash((type(self).__name__, flat)), *flat)
            _set(self, "_cached_key", key)
        return key

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_cached_key"}

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Sequence):
            return NotImplemented
        if type(self) is not type(other):
            return False
        a, b = self._key(), other._key()
        return a[0] == b[0] and a == b

    def __hash__(self) -> int:
        return self._key()[0]

    # -- JSON

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict with a ``"type"`` key; :func:`from_json` inverts it."""
        out: dict[str, Any] = {"type": type(self).__name__}
        omit = self._json_defaults
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name in omit and value is omit[f.name]:
                continue
            out[self._json_names.get(f.name, f.name)] = _to_json_value(value)
        return out


def _to_json_value(value: Any) -> Any:
    if isinstance(value, Sequence):
        return value.to_json()
    if isinstance(value, tuple):
        return [_to_json_value(v) for v in value]
    return value


@functools.lru_cache(maxsize=512)
def _chunk(seq: Sequence, k: int) -> tuple[Value, ...]:
    """Canonical values of ``seq`` at steps ``[k * _CHUNK, (k + 1) * _CHUNK)``.

    Keyed by the sequence itself: equal sequences (``Constant(1)`` and ``Constant(1.0)``)
    share an entry, which is right because their canonical values are identical.
    """
    return tuple(seq._canonical_values(k * _CHUNK, (k + 1) * _CHUNK))


# --------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class SequenceTemplate:
    """A sequence family with random arguments; ``sample(rng)`` builds a real sequence.

    Created by a family's constructor when an argument is (or contains) a
    :class:`~stagetree.distributions.Distribution` or another template. Argument names
    are checked on creation; values are validated when sampled.

    Attributes:
        family: the sequence class to build.
        args: positional arguments, possibly random.
        kwargs: keyword arguments, possibly random.
    """

    family: type[Sequence]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]

    is_template: ClassVar[bool] = True

    def __init__(
        self, family: type[Sequence], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        try:
            inspect.signature(family.__init__).bind(None, *args, **kwargs)
        except TypeError as exc:
            raise InvalidSequenceError(f"{family.__name__}: {exc}") from None
        _set(self, "family", family)
        _set(self, "args", tuple(args))
        _set(self, "kwargs", dict(kwargs))

    def __hash__(self) -> int:
        return hash((self.family, repr(self)))

    def sample(self, rng: random.Random) -> Sequence:
        """Draw every random argument from ``rng`` (in order) and build the sequence."""
        args = [sample_value(a, rng) for a in self.args]
        kwargs = {k: sample_value(v, rng) for k, v in self.kwargs.items()}
        seq = self.family(*args, **kwargs)
        if not isinstance(seq, Sequence):  # a distribution drew another distribution
            raise InvalidSequenceError(f"sampling {self!r} did not give a sequence: {seq!r}")
        return seq

    def then(self, other: Sequence | SequenceTemplate | Value, at: int) -> SequenceTemplate:
        """Template of ``Then(first=self, second=other, at=at)``."""
        out = Then(first=self, second=other, at=at)  # type: ignore[arg-type]
        assert isinstance(out, SequenceTemplate)
        return out

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.family.__name__}({', '.join(parts)})"


# --------------------------------------------------------------------------- families


@dataclass(frozen=True, eq=False)
class Constant(Sequence):
    """The same ``value`` (int, float, str or bool) at every step."""

    value: Value

    def __post_init__(self) -> None:
        _set(self, "value", _check_value("Constant.value", self.value))

    def _value(self, t: int) -> Value:
        return self.value

    def _values(self, start: int, stop: int) -> list[Value]:
        return [self.value] * (stop - start)

    def _canonical_values(self, start: int, stop: int) -> list[Value]:
        return [canonical_value(self.value)] * (stop - start)


def _segments(
    start: int, stop: int, bounds: SequenceABC[int], value_of: Any, index: int
) -> list[Value]:
    """Values of a piecewise-constant sequence whose ``i``-th piece starts at
    ``bounds[i - 1]``, where ``index`` is the piece holding ``start``."""
    out: list[Value] = []
    t = start
    while t < stop:
        end = bounds[index] if index < len(bounds) else stop
        end = min(end, stop)
        out.extend([value_of(index)] * (end - t))
        t = end
        index += 1
    return out


@dataclass(frozen=True, eq=False)
class Step(Sequence):
    """``init * gamma ** (t // step_size)`` (PyTorch ``StepLR``)."""

    init: float
    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _set(self, "init", _check_float("Step.init", self.init))
        _check_step("Step.step_size", self.step_size, 1)
        _set(self, "gamma", _check_float("Step.gamma", self.gamma))

    def _value(self, t: int) -> float:
        return self._level(t // self.step_size)

    def _level(self, k: int) -> float:
        try:
            return self.init * self.gamma**k
        except OverflowError:
            raise InvalidSequenceError(f"{self!r} overflows after {k} decays") from None

    def _values(self, start: int, stop: int) -> list[Value]:
        return self._levels(start, stop, self._level)

    def _canonical_values(self, start: int, stop: int) -> list[Value]:
        # One canonical_value per level, not per step.
        level = self._level
        return self._levels(start, stop, lambda k: canonical_value(level(k)))

    def _levels(self, start: int, stop: int, level: Any) -> list[Value]:
        out: list[Value] = []
        t = start
        while t < stop:
            k = t // self.step_size
            end = min((k + 1) * self.step_size, stop)
            out.extend([level(k)] * (end - t))
            t = end
        return out


@dataclass(frozen=True, eq=False)
class MultiStep(Sequence):
    """``init * gamma ** (number of milestones <= t)`` (PyTorch ``MultiStepLR``)."""

    init: float
    milestones: SequenceABC[int]
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _set(self, "init", _check_float("MultiStep.init", self.init))
        _set(self, "milestones", _check_milestones("MultiStep.milestones", self.milestones))
        _set(self, "gamma", _check_float("MultiStep.gamma", self.gamma))

    def _level(self, k: int) -> float:
        try:
            return self.init * self.gamma**k
        except OverflowError:
            raise InvalidSequenceError(f"{self!r} overflows after {k} decays") from None

    def _value(self, t: int) -> float:
        return self._level(bisect.bisect_right(self.milestones, t))

    def _values(self, start: int, stop: int) -> list[Value]:
        k = bisect.bisect_right(self.milestones, start)
        return _segments(start, stop, self.milestones, self._level, k)

    def _canonical_values(self, start: int, stop: int) -> list[Value]:
        k = bisect.bisect_right(self.milestones, start)
        level = self._level
        return _segments(start, stop, self.milestones, lambda i: canonical_value(level(i)), k)


@dataclass(frozen=True, eq=False, repr=False)
class Piecewise(Sequence):
    """``values[0]`` before ``milestones[0]``, ``values[i]`` from ``milestones[i - 1]`` on.

    Values may be of any scalar type (ints for a batch size, strings for an
    optimizer name); ``len(values) == len(milestones) + 1``. The values are stored as
    the attribute ``levels`` because ``values`` is the method of every sequence; the
    constructor, ``repr`` and JSON call them ``values``.
    """

    levels: SequenceABC[Value]
    milestones: SequenceABC[int]

    _json_names: ClassVar[Mapping[str, str]] = {"levels": "values"}

    def __init__(self, values: SequenceABC[Value], milestones: SequenceABC[int]) -> None:
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise InvalidSequenceError(f"Piecewise.values must be a list, got {values!r}")
        vals = tuple(_check_value(f"Piecewise.values[{i}]", v) for i, v in enumerate(values))
        ms = _check_milestones("Piecewise.milestones", milestones)
        if len(vals) != len(ms) + 1:
            raise InvalidSequenceError(
                f"Piecewise needs len(values) == len(milestones) + 1, "
                f"got {len(vals)} values and {len(ms)} milestones"
            )
        _set(self, "levels", vals)
        _set(self, "milestones", ms)

    def __repr__(self) -> str:
        return f"Piecewise(values={self.levels!r}, milestones={self.milestones!r})"

    def _value(self, t: int) -> Value:
        return self.levels[bisect.bisect_right(self.milestones, t)]

    def _values(self, start: int, stop: int) -> list[Value]:
        k = bisect.bisect_right(self.milestones, start)
        return _segments(start, stop, self.milestones, self.levels.__getitem__, k)

    def _canonical_values(self, start: int, stop: int) -> list[Value]:
        k = bisect.bisect_right(self.milestones, start)
        levels = self.levels
        return _segments(start, stop, self.milestones, lambda i: canonical_value(levels[i]), k)


@dataclass(frozen=True, eq=False)
class Then(Sequence):
    """``first(t)`` for ``t < at``, then ``second(t - at)``: ``second`` counts from ``at``."""

    first: Sequence
    second: Sequence
    at: int

    def __post_init__(self) -> None:
        _set(self, "first", _as_sequence("Then.first", self.first))
        _set(self, "second", _as_sequence("Then.second", self.second))
        _check_step("Then.at", self.at)

    def _value(self, t: int) -> Value:
        return self.first._value(t) if t < self.at else self.second._value(t - self.at)

    def _values(self, start: int, stop: int) -> list[Value]:
        return self._joined(start, stop, "_values")

    def _canonical_values(self, start: int, stop: int) -> list[Value]:
        # Canonical forms are per value: each part's own (faster) form, concatenated.
        return self._joined(start, stop, "_canonical_values")

    def _joined(self, start: int, stop: int, method: str) -> list[Value]:
        at = self.at
        out: list[Value] = []
        if start < at:
            out = getattr(self.first, method)(start, min(stop, at))
        if stop > at:
            out.extend(getattr(self.second, method)(max(start, at) - at, stop - at))
        return out


@dataclass(frozen=True, eq=False)
class Shifted(Sequence):
    """``base(t + offset)``: ``base`` from its step ``offset`` on, counted from 0.

    What a schedule continued mid-way is: ``Then(a, Shifted(b, at), at)`` follows ``a``
    before step ``at`` and ``b`` from ``at`` on, in the same step numbering as ``a`` (a
    ``MultiStep(0.1, [30, 60])`` continued at 40 still decays at 60). PBT builds these.
    """

    base: Sequence
    offset: int

    def __post_init__(self) -> None:
        _set(self, "base", _as_sequence("Shifted.base", self.base))
        _check_step("Shifted.offset", self.offset)

    def _value(self, t: int) -> Value:
        return self.base._value(t + self.offset)

    def _values(self, start: int, stop: int) -> list[Value]:
        return self.base._values(start + self.offset, stop + self.offset)

    def _canonical_values(self, start: int, stop: int) -> list[Value]:
        return self.base._canonical_values(start + self.offset, stop + self.offset)


@dataclass(frozen=True, eq=False)
class Exponential(Sequence):
    """``init * gamma ** t`` (PyTorch ``ExponentialLR``)."""

    init: float
    gamma: float

    def __post_init__(self) -> None:
        _set(self, "init", _check_float("Exponential.init", self.init))
        _set(self, "gamma", _check_float("Exponential.gamma", self.gamma))

    def _value(self, t: int) -> float:
        try:
            return self.init * self.gamma**t
        except OverflowError:
            raise InvalidSequenceError(f"{self!r} overflows at step {t}") from None


def _cosine_factor(num: float, den: float) -> float:
    # Same expression as PyTorch's closed forms: ``(1 + cos(pi * num / den)) / 2``.
    return (1 + math.cos(math.pi * num / den)) / 2


@dataclass(frozen=True, eq=False)
class Cosine(Sequence):
    """``eta_min + (init - eta_min) * (1 + cos(pi * t / t_max)) / 2``
    (PyTorch ``CosineAnnealingLR``).

    Like PyTorch, the cosine goes on after ``t_max``: it climbs back to ``init`` at
    ``2 * t_max`` (period ``2 * t_max``). To hold ``eta_min`` instead, write
    ``Cosine(init, t_max, eta_min).then(Constant(eta_min), at=t_max)``.

    ``t_max`` may be any positive number, not only a whole number of steps
    (``Cosine(0.1, 2.5)``: a half period of two and a half steps, as a schedule that
    anneals over a fraction of an epoch counted in epochs).
    """

    init: float
    t_max: int | float
    eta_min: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "init", _check_float("Cosine.init", self.init))
        if isinstance(self.t_max, int) and not isinstance(self.t_max, bool):
            _check_step("Cosine.t_max", self.t_max, 1)
        elif _check_float("Cosine.t_max", self.t_max) <= 0:
            raise InvalidSequenceError(f"Cosine.t_max must be > 0, got {self.t_max!r}")
        _set(self, "eta_min", _check_float("Cosine.eta_min", self.eta_min))

    def _value(self, t: int) -> float:
        return (
            self.eta_min + (self.init - self.eta_min) * (1 + math.cos(math.pi * t / self.t_max)) / 2
        )


@dataclass(frozen=True, eq=False)
class CosineWarmRestarts(Sequence):
    """Cosine from ``init`` towards ``eta_min`` over ``t_0`` steps, then restarts at
    ``init``; each cycle is ``t_mult`` times longer than the previous one (PyTorch
    ``CosineAnnealingWarmRestarts``)."""

    init: float
    t_0: int
    t_mult: int = 1
    eta_min: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "init", _check_float("CosineWarmRestarts.init", self.init))
        _check_step("CosineWarmRestarts.t_0", self.t_0, 1)
        _check_step("CosineWarmRestarts.t_mult", self.t_mult, 1)
        _set(self, "eta_min", _check_float("CosineWarmRestarts.eta_min", self.eta_min))

    def _value(self, t: int) -> float:
        # Exact integer cycle arithmetic (PyTorch tracks T_cur, T_i the same way).
        t_i = self.t_0
        if self.t_mult == 1:
            t_cur = t % t_i
        else:
            t_cur = t
            while t_cur >= t_i:
                t_cur -= t_i
                t_i *= self.t_mult
        return self.eta_min + (self.init - self.eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2


@dataclass(frozen=True, eq=False)
class Linear(Sequence):
    """Linear from ``start`` at step 0 to ``end`` at step ``steps``; ``end`` afterwards
    (``steps == 0`` gives ``end`` everywhere). PyTorch ``LinearLR(start_factor,
    end_factor, total_iters)`` on base lr ``L`` is ``Linear(L * start_factor,
    L * end_factor, total_iters)``.

    ``extend=True`` keeps the slope past ``steps`` instead of holding ``end``
    (``Linear(0.0, 1.0, 10, extend=True)(20) == 2.0``; it needs ``steps >= 1``)."""

    start: float
    end: float
    steps: int
    extend: bool = False

    # Left out of the JSON when False, so that plans written before it keep their text.
    _json_defaults: ClassVar[Mapping[str, Any]] = {"extend": False}

    def __post_init__(self) -> None:
        _set(self, "start", _check_float("Linear.start", self.start))
        _set(self, "end", _check_float("Linear.end", self.end))
        _check_step("Linear.steps", self.steps)
        if not isinstance(self.extend, bool):
            raise InvalidSequenceError(f"Linear.extend must be a bool, got {self.extend!r}")
        if self.extend and self.steps == 0:
            raise InvalidSequenceError("Linear with extend=True needs steps >= 1 (a slope)")

    def _value(self, t: int) -> float:
        if t >= self.steps and not self.extend:
            return self.end
        return self.start + (self.end - self.start) * t / self.steps


@dataclass(frozen=True, eq=False)
class Warmup(Sequence):
    """Linear from ``start`` (at step 0) to ``target`` (at step ``steps``), then
    ``target``. Usually followed by a decay: ``Warmup(5, 0.1).then(Cosine(0.1, 95), 5)``."""

    steps: int
    target: float
    start: float = 0.0

    def __post_init__(self) -> None:
        _check_step("Warmup.steps", self.steps)
        _set(self, "target", _check_float("Warmup.target", self.target))
        _set(self, "start", _check_float("Warmup.start", self.start))

    def _value(self, t: int) -> float:
        if t >= self.steps:
            return self.target
        return self.start + (self.target - self.start) * t / self.steps


_CYCLIC_MODES = ("triangular", "triangular2", "exp_range")


@dataclass(frozen=True, eq=False)
class Cyclic(Sequence):
    """Cyclical learning rate between ``base`` and ``max`` (PyTorch ``CyclicLR`` with
    ``cycle_momentum=False``): up over ``step_size_up`` steps, down over
    ``step_size_down`` (default ``step_size_up``). ``triangular2`` halves the amplitude
    every cycle; ``exp_range`` scales it by ``gamma ** t``."""

    base: float
    max: float
    step_size_up: int
    step_size_down: int | None = None
    mode: str = "triangular"
    gamma: float = 1.0

    def __post_init__(self) -> None:
        _set(self, "base", _check_float("Cyclic.base", self.base))
        _set(self, "max", _check_float("Cyclic.max", self.max))
        _check_step("Cyclic.step_size_up", self.step_size_up, 1)
        if self.step_size_down is not None:
            _check_step("Cyclic.step_size_down", self.step_size_down, 1)
        if self.mode not in _CYCLIC_MODES:
            raise InvalidSequenceError(
                f"Cyclic.mode must be one of {_CYCLIC_MODES}, got {self.mode!r}"
            )
        _set(self, "gamma", _check_float("Cyclic.gamma", self.gamma))

    def _value(self, t: int) -> float:
        # Same operations, in the same order, as torch.optim.lr_scheduler.CyclicLR.
        up = float(self.step_size_up)
        down = float(self.step_size_down) if self.step_size_down is not None else up
        total = up + down
        ratio = up / total
        cycle = math.floor(1 + t / total)
        x = 1.0 + t / total - cycle
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        height = (self.max - self.base) * scale
        if self.mode == "triangular":
            return self.base + height * 1.0
        if self.mode == "triangular2":
            try:
                amplitude = 1 / (2.0 ** (cycle - 1))
            except OverflowError:  # PyTorch raises here after ~1000 cycles
                amplitude = 0.0
            return self.base + height * amplitude
        try:
            return self.base + height * self.gamma**t
        except OverflowError:
            raise InvalidSequenceError(f"{self!r} overflows at step {t}") from None


@dataclass(frozen=True, eq=False)
class OneCycle(Sequence):
    """One-cycle policy (PyTorch ``OneCycleLR`` with ``cycle_momentum=False``,
    ``three_phase=False``): from ``max / div_factor`` up to ``max`` over the first
    ``pct_start`` of ``total_steps``, then down to ``max / div_factor /
    final_div_factor`` at step ``total_steps - 1``, which it holds afterwards
    (PyTorch extrapolates at step ``total_steps`` and raises after it)."""

    max: float
    total_steps: int
    pct_start: float = 0.3
    anneal: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4

    def __post_init__(self) -> None:
        _set(self, "max", _check_float("OneCycle.max", self.max))
        _check_step("OneCycle.total_steps", self.total_steps, 1)
        pct = _check_float("OneCycle.pct_start", self.pct_start)
        if not 0.0 < pct < 1.0:
            raise InvalidSequenceError(f"OneCycle.pct_start must be in (0, 1), got {pct!r}")
        _set(self, "pct_start", pct)
        if self.anneal not in ("cos", "linear"):
            raise InvalidSequenceError(
                f"OneCycle.anneal must be 'cos' or 'linear', got {self.anneal!r}"
            )
        for name in ("div_factor", "final_div_factor"):
            value = _check_float(f"OneCycle.{name}", getattr(self, name))
            if value <= 0:
                raise InvalidSequenceError(f"OneCycle.{name} must be > 0, got {value!r}")
            _set(self, name, value)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _value(self, t: int) -> float:
        # Same operations, in the same order, as torch.optim.lr_scheduler.OneCycleLR.
        step = min(t, self.total_steps - 1)
        initial = self.max / self.div_factor
        final = initial / self.final_div_factor
        end_up = float(self.pct_start * self.total_steps) - 1
        if step <= end_up:
            # PyTorch divides by zero when the warm-up phase is one step long
            # (pct_start * total_steps == 1); that step is the phase's end: max.
            pct = step / end_up if end_up != 0 else 1.0
            return self._anneal(initial, self.max, pct)
        pct = (step - end_up) / (self.total_steps - 1 - end_up)
        return self._anneal(self.max, final, pct)


# --------------------------------------------------------------------------- functions


def _as_sequence(name: str, x: Any) -> Sequence:
    if isinstance(x, Sequence):
        return x
    if isinstance(x, _SCALARS):
        return Constant(x)
    if getattr(x, "is_template", False):
        raise InvalidSequenceError(f"{name} is a template; sample it first: {x!r}")
    raise InvalidSequenceError(
        f"{name} must be a Sequence or an int, float, str or bool, got {type(x).__name__} {x!r}"
    )


def as_sequence(x: Any) -> Sequence:
    """``x`` if it is a :class:`Sequence`; ``Constant(x)`` for a plain int, float, str
    or bool; :class:`~stagetree.exceptions.InvalidSequenceError` otherwise."""
    return _as_sequence("value", x)


def _first_mismatch(a: SequenceABC[Value], b: SequenceABC[Value]) -> int | None:
    """Index of the first difference of two equally long chunks of canonical values, or
    None; typed, so that ``True`` differs from ``1`` (canonical numbers of equal value
    have equal types already)."""
    # Fast C-level checks first; fall back to a scan only when something differs.
    if a == b and list(map(type, a)) == list(map(type, b)):
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y or type(x) is not type(y):
            return i
    return None


def first_difference(a: Sequence, b: Sequence, start: int, stop: int) -> int | None:
    """First step ``t`` in ``[start, stop)`` with ``a(t) != b(t)``, or None.

    Numbers compare by value (``128`` and ``128.0`` are equal, see
    :func:`canonical_value`); a ``bool`` differs from every number (``True`` vs ``1``).
    Compares cached chunks of canonical values, not one call per step.
    """
    _check_step("start", start)
    _check_step("stop", stop)
    if a == b or stop <= start:
        return None
    for k in range(start // _CHUNK, (stop - 1) // _CHUNK + 1):
        base = k * _CHUNK
        lo, hi = max(start - base, 0), min(stop - base, _CHUNK)
        ca, cb = _chunk(a, k), _chunk(b, k)
        if lo == 0 and hi == _CHUNK:
            i = _first_mismatch(ca, cb)
        else:
            i = _first_mismatch(ca[lo:hi], cb[lo:hi])
            i = None if i is None else i + lo
        if i is not None:
            return base + i
    return None


def _from_json_value(value: Any) -> Any:
    if isinstance(value, dict):
        return from_json(value)
    return value


@functools.cache
def _argument_names(family: type[Sequence]) -> frozenset[str]:
    """The constructor's argument names of a family (read once: decoding a study's
    thousands of sequences should not inspect a signature each time)."""
    return frozenset(inspect.signature(family.__init__).parameters) - {"self"}


# JSON scalars: an argument of these types is never a distribution or a template.
_PLAIN = frozenset({int, float, str, bool, type(None)})


def from_json(d: Mapping[str, Any]) -> Sequence:
    """Rebuild a sequence from :meth:`Sequence.to_json` output."""
    if (d.__class__ is not dict and not isinstance(d, Mapping)) or "type" not in d:
        raise InvalidSequenceError(f"not a sequence description (no 'type'): {d!r}")
    family = _FAMILIES.get(d["type"])
    if family is None:
        raise InvalidSequenceError(f"unknown sequence type {d['type']!r}")
    if family is Constant and len(d) == 2:
        quick = _constant(d.get("value"))
        if quick is not None:
            return quick
    names = _argument_names(family)
    kwargs = {k: _from_json_value(v) for k, v in d.items() if k != "type"}
    unknown = set(kwargs) - names
    if unknown:
        raise InvalidSequenceError(f"{d['type']} has no argument(s) {sorted(unknown)}")
    # Plain JSON arguments (scalars, decoded sequences) hold no distribution, so the
    # family's __new__ (which looks for one in every argument, most of the cost of a
    # study's 100,000 sequences) is skipped where it is Sequence's own.
    plain = family.__new__ is Sequence.__new__ and all(map(_plain, kwargs.values()))
    try:
        if plain:
            seq = object.__new__(family)
            seq.__init__(**kwargs)  # type: ignore[misc]
        else:
            seq = family(**kwargs)
    except TypeError as exc:
        raise InvalidSequenceError(f"cannot build {d['type']}: {exc}") from None
    if not isinstance(seq, Sequence):
        raise InvalidSequenceError(f"{d!r} does not describe a plain sequence")
    return seq


def _plain(value: Any) -> bool:
    """Whether a decoded argument is plain JSON (scalars and lists of them) or a
    sequence: nothing :func:`_is_random` would find a distribution in."""
    if value.__class__ in _PLAIN or isinstance(value, Sequence):
        return True
    return value.__class__ is list and all(map(_plain, value))


def _constant(value: Any) -> Constant | None:
    """``Constant(value)`` built without its checks where they cannot fail or change
    ``value`` (an int, str, bool or finite float: what a random or grid search stores);
    None otherwise (the caller builds it the checked way)."""
    tp = value.__class__
    if tp is float:
        if not math.isfinite(value):
            return None
        value += 0.0  # as _check_value: -0.0 becomes 0.0
    elif tp is not int and tp is not str and tp is not bool:
        return None
    seq = object.__new__(Constant)
    seq.__dict__["value"] = value
    return seq


# What dumps_hp writes with (json.dumps would build an encoder per call: a third of
# the cost of a trial's identity, which a replay of 100,000 trials asks for several times).
_HP_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


def dumps_hp(hp: Mapping[str, Sequence | Value]) -> str:
    """Canonical JSON (sorted keys, no spaces) of sequences by name; plain values
    become :class:`Constant`."""
    out: dict[str, Any] = {}
    for name, seq in hp.items():
        if not isinstance(name, str):
            raise InvalidSequenceError(f"hyper-parameter names must be str, got {name!r}")
        if seq.__class__ is Constant:  # to_json's answer, without reading its fields
            out[name] = {"type": "Constant", "value": seq.value}
        else:
            out[name] = _as_sequence(f"hp[{name!r}]", seq).to_json()
    return _HP_ENCODER.encode(out)


def loads_hp(s: str) -> dict[str, Sequence]:
    """Inverse of :func:`dumps_hp`."""
    data = json.loads(s)
    if not isinstance(data, dict):
        raise InvalidSequenceError(f"expected a JSON object of sequences, got {s[:80]!r}")
    return {name: from_json(d) for name, d in data.items()}


def written_value(seq: Sequence, t: int) -> Value:
    """Value of ``seq`` at step ``t`` as its arguments write it (``Constant(128.0)``
    gives ``128.0``), not canonical: what plans written before numbers were compared by
    value told apart."""
    return seq._value(t)


def step_values(seq: Any, start: int, stop: int) -> list[Any]:
    """Values of a sequence (or any callable of the step, or a constant) at steps
    ``start .. stop - 1``: the one reading of "a sequence on ``[start, stop)``" that the
    stage trees, the simulator and the workers share.

    Raises:
        ValueError: a ``values()`` method that returned the wrong number of values.
    """
    if callable(seq):
        values = getattr(seq, "values", None)
        if callable(values):
            out = list(values(start, stop))
            if len(out) != stop - start:
                raise ValueError(f"{seq!r}.values({start}, {stop}) returned {len(out)} values")
            return out
        return [seq(t) for t in range(start, stop)]
    return [seq] * (stop - start)
