"""JSON encoding of plan values (configs, metrics, log records)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["copy", "detach", "dumps", "event_needle", "loads", "loads_many"]


def dumps(value: Any, what: str = "value") -> str:
    """Canonical JSON (sorted keys, compact); NaN and infinities allowed.

    Raises:
        ValueError: ``value`` is not JSON-able.
    """
    try:
        return _ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None


# json.dumps with these arguments builds an encoder per call: about half the cost of
# encoding a small record (a trial's config, a log record: several a submission).
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=True)


def loads(text: str) -> Any:
    """Inverse of :func:`dumps`."""
    return json.loads(text)


def loads_many(texts: Iterable[str]) -> list[Any]:
    """:func:`loads` of each text, in one call: the texts are decoded as one JSON array,
    which is several times faster than decoding them one by one (a bulk read of a
    learning curve's points, of a study's trial rows).

    Raises:
        ValueError: a text is not a JSON value.
    """
    texts = texts if isinstance(texts, list) else list(texts)
    if not texts:
        return []
    out: list[Any] = json.loads("[" + ",".join(texts) + "]")
    if len(out) != len(texts):  # a text held a top-level comma: not one JSON value
        raise ValueError("a stored JSON text holds more than one value")
    return out


def copy(value: Any, what: str = "value") -> Any:
    """A deep copy through JSON: checks JSON-ability and detaches from the caller."""
    return loads(dumps(value, what))


def detach(value: Any) -> Any:
    """A deep copy of a value that :func:`copy` made (JSON types only: dicts with str
    keys, lists, scalars), without encoding it again: what a reader of stored rows gets,
    a few times faster than a second :func:`copy` (a study's 100,000 trial rows)."""
    if isinstance(value, dict):
        return {k: detach(v) if isinstance(v, (dict, list)) else v for k, v in value.items()}
    if isinstance(value, list):
        return [detach(v) if isinstance(v, (dict, list)) else v for v in value]
    return value


def event_needle(event: str) -> str:
    """The text that :func:`dumps` of a record whose ``"event"`` field is ``event`` holds
    (compact JSON, no space after the colon): a cheap filter before decoding a record
    (a nested field of that name and value holds it too, so matches are checked)."""
    return '"event":' + json.dumps(event)
