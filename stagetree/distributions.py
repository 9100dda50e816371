"""Parameter distributions for random search spaces.

A :class:`Distribution` draws one value from a :class:`random.Random`. Distributions
may stand for a fixed hyper-parameter, for a whole sequence (``Choice([seq, ...])``)
or for an argument of a sequence family (``MultiStep(init=LogUniform(1e-3, 0.3), ...)``,
which :mod:`stagetree.hp` turns into a template sampled per trial).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from collections.abc import Sequence as _Seq
from dataclasses import dataclass
from typing import Any

from stagetree.exceptions import InvalidSpaceError

__all__ = [
    "Choice",
    "Distribution",
    "IntUniform",
    "LogUniform",
    "Shared",
    "Uniform",
    "sample_value",
    "shared_draws",
]


class Distribution(ABC):
    """Base class of every distribution.

    Contract: ``sample(rng)`` draws one value using only ``rng`` (so a seeded
    ``random.Random`` makes sampling reproducible) and never mutates ``self``.
    """

    @abstractmethod
    def sample(self, rng: random.Random) -> Any:
        """Draw one value."""


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidSpaceError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Choice(Distribution):
    """Uniform choice among ``options`` (any values, including sequences or lists)."""

    options: tuple[Any, ...]

    def __init__(self, options: _Seq[Any]) -> None:
        opts = tuple(options)
        if not opts:
            raise InvalidSpaceError("Choice needs at least one option")
        object.__setattr__(self, "options", opts)

    def sample(self, rng: random.Random) -> Any:
        return sample_value(self.options[rng.randrange(len(self.options))], rng)


@dataclass(frozen=True)
class Uniform(Distribution):
    """Uniform float in ``[low, high]``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        lo, hi = _finite("Uniform.low", self.low), _finite("Uniform.high", self.high)
        if lo > hi:
            raise InvalidSpaceError(f"Uniform needs low <= high, got {lo} > {hi}")

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


@dataclass(frozen=True)
class LogUniform(Distribution):
    """Float whose logarithm is uniform in ``[log(low), log(high)]``; needs ``0 < low``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        lo, hi = _finite("LogUniform.low", self.low), _finite("LogUniform.high", self.high)
        if lo <= 0 or lo > hi:
            raise InvalidSpaceError(f"LogUniform needs 0 < low <= high, got {lo}, {hi}")

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))


@dataclass(frozen=True)
class IntUniform(Distribution):
    """Integer uniform in ``[low, high]`` (both inclusive)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        for name, v in (("low", self.low), ("high", self.high)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidSpaceError(f"IntUniform.{name} must be an int, got {v!r}")
        if self.low > self.high:
            raise InvalidSpaceError(f"IntUniform needs low <= high, got {self.low} > {self.high}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


# The values that Shared draws took in the trial being drawn (name -> (what, value)); None
# outside a draw (RandomSpace sets it per trial with shared_draws()).
_SHARED: contextvars.ContextVar[dict[str, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "stagetree_shared_draws", default=None
)


@contextlib.contextmanager
def shared_draws() -> Iterator[None]:
    """One trial's draws: every :class:`Shared` of a name drawn inside the block gives
    the value its first draw took. :class:`~stagetree.space.RandomSpace` opens one per
    trial; outside any block a Shared draws afresh each time."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


@dataclass(frozen=True)
class Shared(Distribution):
    """One draw used in several places of a trial: every ``Shared`` of the same ``name``
    takes the same value within one trial (the first place drawn draws it from
    ``dist``), a new one per trial. Links, say, a warm-up's peak to the start of the
    decay that follows it::

        peak = Shared("peak", LogUniform(0.01, 0.3))
        lr = Warmup(5, peak).then(Cosine(peak, 95), at=5)

    ``dist`` is a distribution, a sequence template or a plain value (then it is that
    value). Two Shared of one name must wrap equal distributions.

    Raises:
        InvalidSpaceError: an empty name; when drawn, a name used with two different
            distributions in one trial.
    """

    name: str
    dist: Any

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidSpaceError(f"Shared needs a non-empty name, got {self.name!r}")
        if isinstance(self.dist, Shared):
            raise InvalidSpaceError(f"Shared({self.name!r}) wraps another Shared: use one name")

    def sample(self, rng: random.Random) -> Any:
        memo = _SHARED.get()
        if memo is None:
            return sample_value(self.dist, rng)
        if self.name in memo:
            dist, value = memo[self.name]
            if dist != self.dist:
                raise InvalidSpaceError(
                    f"Shared({self.name!r}) is used with two distributions, {dist!r} and "
                    f"{self.dist!r}: one name stands for one draw"
                )
            return value
        value = sample_value(self.dist, rng)
        memo[self.name] = (self.dist, value)
        return value


def sample_value(value: Any, rng: random.Random) -> Any:
    """Resolve ``value``: draw it when it is a distribution or has a ``sample`` template
    method (sequence templates), recurse into lists and tuples, return it unchanged otherwise."""
    if isinstance(value, Distribution):
        return value.sample(rng)
    sample = getattr(value, "sample", None)
    if callable(sample) and getattr(value, "is_template", False):
        return sample(rng)
    if isinstance(value, list):
        return [sample_value(v, rng) for v in value]
    if isinstance(value, tuple):
        return tuple(sample_value(v, rng) for v in value)
    return value
