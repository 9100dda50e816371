"""Parameter distributions for random search spaces.

A :class:`Distribution` draws one value from a :class:`random.Random`. Distributions
may stand for a fixed hyper-parameter, for a whole sequence (``Choice([seq, ...])``)
or for an argument of a sequence family (``MultiStep(init=LogUniform(1e-3, 0.3), ...)``,
which :mod:`stagetree.hp` turns into a template sampled per trial).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence as _Seq
from dataclasses import dataclass
from typing import Any

from stagetree.exceptions import InvalidSpaceError

__all__ = ["Choice", "Distribution", "IntUniform", "LogUniform", "Uniform", "sample_value"]


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
