"""How PBT mutates a sequence: the distributions it follows and the moves it makes.

A :class:`Mutation` is one sequence's search distribution, taken from the space (or
from ``PBT(mutations=...)``), and the rules to move a trial's draw within it:

* a *scalar* distribution (``Uniform``, ``LogUniform``, ``IntUniform``, or ``Choice``
  of plain values or of sequences) stands for a whole sequence; the value the trial
  follows is a constant (or the chosen sequence);
* a *template* (``MultiStep(init=LogUniform(1e-3, 0.1), milestones=Choice(...))``)
  draws the arguments of a schedule; the trial follows the schedule built from them.

``resample`` draws afresh; ``perturb`` moves each drawn value a little, within the
distribution: ``Uniform`` by ``±perturb`` of its width, ``LogUniform`` by the factor
``1 ± perturb``, ``IntUniform`` by ``±max(1, round(perturb * width))`` (ints stay ints),
all clipped to the bounds; a ``Choice`` moves to a neighbouring option. The result is a
new schedule in the trial's own step numbering (``source``); PBT continues the donor's
sequence with it from the exploit step on (``Then(donor, Shifted(source, t), t)``),
so a decay it holds after that step still happens.
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass
from typing import Any

from stagetree.distributions import (
    Choice,
    Distribution,
    IntUniform,
    LogUniform,
    Uniform,
    sample_value,
)
from stagetree.exceptions import TunerError
from stagetree.hp import Constant, Sequence, as_sequence
from stagetree.space import GridSpace, RandomSpace

__all__ = ["Mutation", "as_distribution", "check_within", "mutation_of", "space_entries"]

_NUMERIC = (Uniform, LogUniform, IntUniform)


def _is_template(value: Any) -> bool:
    return bool(getattr(value, "is_template", False)) and callable(getattr(value, "sample", None))


def _same(a: Any, b: Any) -> bool:
    """Equal values: numbers by value (not bools), lists and tuples item by item,
    anything else by ``==`` and type (sequences compare typed themselves)."""

    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    # a grid's options are sequences; a plain value stands for its constant
    if isinstance(a, Sequence) and isinstance(b, (int, float, str)):
        return bool(a == Constant(b))
    if isinstance(b, Sequence) and isinstance(a, (int, float, str)):
        return bool(b == Constant(a))
    num_a = isinstance(a, (int, float)) and not isinstance(a, bool)
    num_b = isinstance(b, (int, float)) and not isinstance(b, bool)
    if num_a and num_b:
        return bool(a == b)
    return type(a) is type(b) and bool(a == b)


def _template_params(template: Any) -> dict[str, Any]:
    """The template's arguments by constructor parameter name."""
    bound = inspect.signature(template.family.__init__).bind(
        None, *template.args, **template.kwargs
    )
    params = dict(bound.arguments)
    params.pop(next(iter(params)))  # self
    return params


def _field_of(instance: Any, param: str) -> Any:
    """The value of constructor parameter ``param`` on a built sequence."""
    reverse = {v: k for k, v in getattr(type(instance), "_json_names", {}).items()}
    return getattr(instance, reverse.get(param, param))


# --------------------------------------------------------------------------- moves


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _perturb_value(dist: Any, value: Any, perturb: float, rng: random.Random) -> Any:
    """``value`` (a draw of ``dist``) moved a little within ``dist`` (see the module doc)."""

    if isinstance(dist, Distribution) and not isinstance(dist, Choice):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not isinstance(dist, _NUMERIC):
            return dist.sample(rng)  # not a value we can move: draw afresh
        sign = rng.choice((-1, 1))
        if isinstance(dist, IntUniform):
            step = max(1, round(perturb * (dist.high - dist.low)))
            return int(_clip(round(value) + sign * step, dist.low, dist.high))
        if isinstance(dist, LogUniform):
            return _clip(value * (1.0 + sign * perturb), dist.low, dist.high)
        return _clip(value + sign * perturb * (dist.high - dist.low), dist.low, dist.high)
    if isinstance(dist, Choice):
        options = dist.options
        index = _choice_index(options, value)
        if index is None:
            return dist.sample(rng)
        option = options[index]
        if isinstance(option, Distribution) or _is_template(option):
            return _perturb_value(option, value, perturb, rng)  # stay, move inside it
        if len(options) == 1:
            return sample_value(option, rng)
        if index == 0:
            index = 1
        elif index == len(options) - 1:
            index -= 1
        else:
            index += rng.choice((-1, 1))
        return sample_value(options[index], rng)
    if _is_template(dist):
        family = dist.family
        if not isinstance(value, family):
            return dist.sample(rng)
        args = _template_params(dist)
        kwargs = {}
        for param in inspect.signature(family.__init__).parameters:
            if param == "self":
                continue
            current = _field_of(value, param)  # arguments the template leaves out too
            kwargs[param] = (
                _perturb_arg(args[param], current, perturb, rng) if param in args else current
            )
        return family(**kwargs)
    if isinstance(dist, (list, tuple)):
        return _perturb_arg(dist, value, perturb, rng)
    return dist


def _perturb_arg(arg: Any, current: Any, perturb: float, rng: random.Random) -> Any:
    """A template argument: random ones move, fixed ones keep the drawn value."""
    if isinstance(arg, Distribution) or _is_template(arg):
        return _perturb_value(arg, current, perturb, rng)
    if (
        isinstance(arg, (list, tuple))
        and isinstance(current, (list, tuple))
        and len(arg) == len(current)
    ):
        return [_perturb_arg(a, c, perturb, rng) for a, c in zip(arg, current)]
    return current


def _choice_index(options: tuple[Any, ...], value: Any) -> int | None:
    """The option ``value`` was drawn from: an equal plain option, else the first
    distribution or template that could have drawn it; None when none matches."""
    for i, option in enumerate(options):
        plain = not (isinstance(option, Distribution) or _is_template(option))
        if plain and _same(option, value):
            return i
    for i, option in enumerate(options):
        if _is_template(option) and isinstance(value, option.family):
            return i
        if isinstance(option, Distribution) and _draws(option, value):
            return i
    return None


def _draws(dist: Distribution, value: Any) -> bool:
    """Whether ``value`` is a possible draw of ``dist``."""
    if isinstance(dist, Choice):
        return _choice_index(dist.options, value) is not None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(dist, IntUniform):
        return isinstance(value, int) and dist.low <= value <= dist.high
    if isinstance(dist, _NUMERIC):
        return dist.low <= value <= dist.high
    return False


# --------------------------------------------------------------------------- containment


def _contained(inner: Any, outer: Any) -> str | None:
    """Why the draws of ``inner`` are not all draws of ``outer``; None when they are."""
    if isinstance(inner, Choice):
        for option in inner.options:
            problem = _contained(option, outer)
            if problem is not None:
                return problem
        return None
    if isinstance(outer, Choice):
        if isinstance(inner, Distribution) or _is_template(inner):
            if any(_contained(inner, o) is None for o in outer.options):
                return None
            return f"{inner!r} is not one of the options {list(outer.options)!r}"
        if _choice_index(outer.options, inner) is not None:
            return None
        return f"{inner!r} is not one of the options {list(outer.options)!r}"
    if isinstance(outer, _NUMERIC):
        if isinstance(inner, _NUMERIC):
            if isinstance(outer, IntUniform) and not isinstance(inner, IntUniform):
                return f"{inner!r} draws floats, the space draws ints ({outer!r})"
            if not isinstance(outer, IntUniform) and isinstance(inner, IntUniform):
                return f"{inner!r} draws ints, the space draws floats ({outer!r})"
            if outer.low <= inner.low and inner.high <= outer.high:
                return None
            return f"{inner!r} reaches outside {outer!r}"
        if isinstance(inner, Distribution) or _is_template(inner):
            return f"{inner!r} is not a distribution like {outer!r}"
        if _draws(outer, inner):
            return None
        return f"{inner!r} is outside {outer!r}"
    if _is_template(outer):
        if not _is_template(inner) or inner.family is not outer.family:
            return f"{inner!r} is not a {outer.family.__name__} template like {outer!r}"
        mine, theirs = _template_params(inner), _template_params(outer)
        for param in sorted(set(mine) | set(theirs)):
            if param not in theirs or param not in mine:
                return f"argument {param!r} of {inner!r} differs from the space's {outer!r}"
            problem = _contained(mine[param], theirs[param])
            if problem is not None:
                return f"argument {param!r}: {problem}"
        return None
    if isinstance(outer, (list, tuple)) and isinstance(inner, (list, tuple)):
        if len(outer) != len(inner):
            return f"{inner!r} differs from {outer!r}"
        for a, b in zip(inner, outer):
            problem = _contained(a, b)
            if problem is not None:
                return problem
        return None
    if isinstance(inner, Distribution) or _is_template(inner):
        return f"{inner!r} varies what the space fixes to {outer!r}"
    return None if _same(inner, outer) else f"{inner!r} differs from the space's {outer!r}"


def check_within(name: str, mutation: Any, entry: Any) -> None:
    """Raise :class:`TunerError` when ``mutation`` can draw what space entry ``entry``
    cannot (for sequence ``name``)."""

    if isinstance(entry, Sequence):
        raise TunerError(
            f"mutations[{name!r}] is outside the search space: the space fixes {name!r} "
            f"to {entry!r}, so any mutation varies what the space fixes"
        )
    problem = _contained(mutation, entry)
    if problem is not None:
        raise TunerError(f"mutations[{name!r}] is outside the search space: {problem}")


# --------------------------------------------------------------------------- Mutation


@dataclass(frozen=True)
class Mutation:
    """One sequence's mutation distribution.

    Attributes:
        name: the sequence.
        dist: a distribution over whole sequences or values (``Uniform``, ``Choice``
            ...), or a sequence template.
    """

    name: str
    dist: Any

    @property
    def scalar(self) -> bool:
        """Whether the distribution draws a value or a whole sequence (not a template's
        arguments)."""
        return not _is_template(self.dist)

    def current(self, source: Any, t: int) -> Any:
        """What the trial drew: its value at ``t`` (a constant), the sequence it follows
        (a choice of sequences, a template)."""

        if isinstance(source, Constant):
            return source.value
        if self.scalar and not _choice_of_sequences(self.dist):
            return source(t)
        return source

    def move(self, source: Any, t: int, resample: bool, perturb: float, rng: random.Random) -> Any:
        """The new schedule (in the trial's step numbering) for a trial that followed
        ``source`` and is exploited at ``t``."""

        if resample:
            drawn = sample_value(self.dist, rng)
            while isinstance(drawn, Distribution) or _is_template(drawn):
                drawn = sample_value(drawn, rng)
        else:
            drawn = _perturb_value(self.dist, self.current(source, t), perturb, rng)
        if isinstance(drawn, float) and not math.isfinite(drawn):
            raise TunerError(f"mutating {self.name!r} drew {drawn!r}")
        seq = as_sequence(drawn)
        return Constant(seq.value) if isinstance(seq, Constant) else seq


def _choice_of_sequences(dist: Any) -> bool:

    return isinstance(dist, Choice) and any(
        isinstance(o, Sequence) or _is_template(o) for o in dist.options
    )


def mutation_of(name: str, entry: Any) -> Mutation | None:
    """The mutation a space entry gives (None for a plain sequence: nothing to vary).

    ``entry``: a RandomSpace entry (a distribution, a template, or a sequence), or a
    grid's list of options (a choice among them).
    """
    if isinstance(entry, list):
        return Mutation(name, Choice(entry)) if len(entry) > 1 else None
    if isinstance(entry, Distribution) or _is_template(entry):
        return Mutation(name, entry)
    return None


def space_entries(space: Any) -> tuple[dict[str, Any] | None, set[str]]:
    """``(sequence entries by name, fixed names)`` of a search space: a RandomSpace's
    entries as written, a GridSpace's option lists; ``(None, set())`` for a list of
    trial specs (no distributions to follow)."""

    # The spaces keep their entries private; PBT is the one reader that needs them.
    if isinstance(space, RandomSpace):
        return dict(space._hp), set(space.fixed_names)
    if isinstance(space, GridSpace):
        return {k: list(v) for k, v in space._hp.items()}, set(space.fixed_names)
    return None, set()


def as_distribution(name: str, value: Any) -> Any:
    """A ``mutations=`` value as a distribution: a distribution or a template as is, a
    list or tuple as a :class:`Choice` (as Ray Tune's ``hyperparam_mutations``)."""
    if isinstance(value, Distribution) or _is_template(value):
        return value
    if isinstance(value, (list, tuple)) and value:
        return Choice(list(value))
    raise TunerError(
        f"mutations[{name!r}] must be a distribution (Uniform, LogUniform, IntUniform, "
        f"Choice), a sequence template or a non-empty list of options, got {value!r}"
    )
