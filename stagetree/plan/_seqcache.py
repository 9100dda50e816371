"""Per-process caches that make the insertion walk cheap.

The trials of a study share a handful of sequence objects, so the walk asks the same
questions over and over: the value of a sequence at a step, the first difference of two
sequences, the JSON of a sequence. Hashing a sequence walks its fields, so the caches
key on object ids and keep each object alive (``_alive``) while an entry refers to it,
which stops ids from being reused (entries and kept objects are dropped together).
Decoding interns sequences, so that nodes loaded from
a database share objects (and cache entries) too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from stagetree.hp import Sequence, first_difference, from_json
from stagetree.plan import _codec

__all__ = ["SeqCache"]

_SCALARS = frozenset({int, float, str, bool})


class SeqCache:
    """Memoised values, differences, JSON and decoding of sequences.

    Args:
        max_entries: the caches are emptied when one grows past this.

    Attributes:
        values: ``(id(seq), step) -> (type, value)``; read-only for callers (hot loops
            may look up directly and call :meth:`value` on a miss).
        diffs: ``(id(a), id(b), stop) -> first difference``; same rule
            (:meth:`first_difference` on a miss).
    """

    def __init__(self, max_entries: int = 500_000) -> None:
        self._max = max_entries
        self._alive: dict[int, Sequence] = {}
        self.values: dict[tuple[int, int], tuple[type, Any]] = {}
        self.diffs: dict[tuple[int, int, int], int | None] = {}
        self._json: dict[int, str] = {}
        self._decoded: dict[
            Any, Sequence
        ] = {}  # repr of a description, or a constant's (type, value)
        self._texts: dict[str, dict[str, Sequence]] = {}  # hp text -> decoded

    def _keep(self, seq: Sequence) -> int:
        key = id(seq)
        if key not in self._alive:
            if len(self._alive) >= self._max:
                self.clear()
            self._alive[key] = seq
        return key

    def clear(self) -> None:
        """Drop every entry."""
        self._alive.clear()
        self.values.clear()
        self.diffs.clear()
        self._json.clear()
        self._decoded.clear()
        self._texts.clear()

    def value(self, seq: Sequence, step: int) -> tuple[type, Any]:
        """``(type, value)`` of ``seq`` at ``step``: the canonical value (``1.0`` is ``1``)
        with its type, so that ``True`` still differs from ``1``."""
        key = (id(seq), step)
        hit = self.values.get(key)
        if hit is not None:
            return hit
        value = seq(step)
        typed = (type(value), value)
        if len(self.values) >= self._max:
            self.clear()
        self._keep(seq)
        self.values[key] = typed
        return typed

    def first_difference(self, a: Sequence, b: Sequence, stop: int) -> int | None:
        """First step in ``[0, stop)`` where ``a`` and ``b`` differ, None if none."""
        if a is b:
            return None
        key = (id(a), id(b), stop)
        try:
            return self.diffs[key]
        except KeyError:
            pass
        d = first_difference(a, b, 0, stop)
        if len(self.diffs) >= self._max:
            self.clear()
        self._keep(a)
        self._keep(b)
        self.diffs[key] = d
        return d

    def encode_hp(self, hp: Mapping[str, Sequence]) -> str:
        """Same text as :func:`stagetree.hp.dumps_hp` (canonical JSON: sorted names, no
        spaces), built from cached per-sequence JSON."""
        parts = []
        for name in sorted(hp):
            seq = hp[name]
            key = id(seq)
            text = self._json.get(key)
            if text is None:
                text = json.dumps(
                    seq.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False
                )
                self._keep(seq)
                self._json[key] = text
            parts.append(json.dumps(name) + ":" + text)
        return "{" + ",".join(parts) + "}"

    def decode_hp(self, text: str) -> dict[str, Sequence]:
        """Inverse of :meth:`encode_hp` (like :func:`stagetree.hp.loads_hp`); equal
        sequences come back as one shared object (a new dict each call)."""
        return self.decode_hp_many([text])[0]

    def decode_hp_many(self, texts: list[str]) -> list[dict[str, Sequence]]:
        """:meth:`decode_hp` of each text: texts seen before are not decoded again (a
        trial's sequences are those of the node it created, and readers read the same
        rows over and over), the others in one bulk decode."""
        known = self._texts
        hits = list(map(known.get, texts))
        if None not in hits:
            return [hp.copy() for hp in hits]  # type: ignore[union-attr]
        missing = list(dict.fromkeys([t for t, hp in zip(texts, hits) if hp is None]))
        found: dict[str, dict[str, Sequence]] = {}
        intern, decoded = self._intern, self._decoded
        for text, data in zip(missing, _codec.loads_many(missing)):
            hp = found[text] = {}
            for name, desc in data.items():
                # A constant (what a random or grid search stores: 100,000 distinct
                # ones in a large study) is keyed by its value's type and value,
                # inline: ten times cheaper than the repr of a float.
                if desc.__class__ is dict and len(desc) == 2 and desc.get("type") == "Constant":
                    value = desc.get("value")
                    if value.__class__ in _SCALARS:
                        key = (value.__class__, value)
                        seq = decoded.get(key)
                        if seq is None:
                            seq = decoded[key] = from_json(desc)
                        hp[name] = seq
                        continue
                hp[name] = intern(desc)
        if len(known) + len(missing) > self._max or len(decoded) > self._max:
            self.clear()  # what this call decoded is handed out from ``found``
        known.update(found)
        new = found.get
        # each caller its own dict (the cache keeps one), hits and new texts alike
        return [(hp if hp is not None else new(t)).copy() for t, hp in zip(texts, hits)]  # type: ignore[union-attr]

    def _intern(self, desc: Any) -> Sequence:
        # Keyed by the repr of the decoded canonical JSON (sorted keys): exact (1, 1.0
        # and True differ) and ten times cheaper than a hashable copy of it; a text in
        # another key order could only miss the cache.
        key = repr(desc)
        seq = self._decoded.get(key)
        if seq is None:
            seq = self._decoded[key] = from_json(desc)
        return seq
