"""Values in short text form, as the command line, the exports and the dashboard
print them: :func:`format_value` and :func:`short_sequence`."""

from __future__ import annotations

import dataclasses
from typing import Any

from stagetree.hp import Constant, Sequence, Shifted, Then

__all__ = ["format_value", "one_line", "short_sequence"]


def format_value(value: Any) -> str:
    """A config or hyper-parameter value in short form, as the CLI and the dashboard
    print it: floats with ``%g``, sequences as in :func:`short_sequence`,
    lists element-wise, strings as they are."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, Sequence):
        return short_sequence(value)
    if isinstance(value, str):
        return value
    return repr(value)


def short_sequence(seq: Any, offset: int = 0) -> str:
    """A sequence in short form: ``0.1`` for a constant, ``MultiStep(0.1, [8, 12],
    0.1)``, ``0.1 until step 4, then Exponential(0.1, 0.8)``.

    Args:
        seq: a :class:`~stagetree.hp.Sequence` (anything else is formatted as a value).
        offset: the absolute step the sequence starts at (for the steps of ``Then``).
    """
    if isinstance(seq, Constant):
        return format_value(seq.value)
    if isinstance(seq, Then):
        start = offset + seq.at
        first = short_sequence(seq.first, offset)
        second = seq.second
        if isinstance(second, Shifted) and second.offset == start:  # what PBT continues
            base = short_sequence(second.base)
            return f"{first} until step {start}, then {base} continued from step {start}"
        return f"{first} until step {start}, then {short_sequence(seq.second, start)}"
    if isinstance(seq, Sequence) and dataclasses.is_dataclass(seq):
        args = ", ".join(format_value(getattr(seq, f.name)) for f in dataclasses.fields(seq))
        return f"{type(seq).__name__}({args})"
    return format_value(seq)


def one_line(exc: BaseException) -> str:
    """An error's first line, spaces collapsed (its type name when it has no message)."""
    text = " ".join(str(exc).split("\n", 1)[0].split())
    return text or type(exc).__name__
