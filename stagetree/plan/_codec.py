"""JSON encoding of plan values (configs, metrics, log records)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["copy", "dumps", "loads"]


def dumps(value: Any, what: str = "value") -> str:
    """Canonical JSON (sorted keys, compact); NaN and infinities allowed.

    Raises:
        ValueError: ``value`` is not JSON-able.
    """
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None


def loads(text: str) -> Any:
    """Inverse of :func:`dumps`."""
    return json.loads(text)


def copy(value: Any, what: str = "value") -> Any:
    """A deep copy through JSON: checks JSON-ability and detaches from the caller."""
    return loads(dumps(value, what))
