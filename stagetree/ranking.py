"""One ranking rule for every reader of results: the tuners (``Tuner.best`` and their
rungs), the read side (``Study.best``, ``stagetree status``, the dashboard) and the
checkpoint eviction that keeps the best trial's model.

* A metric is maximised or minimised (:data:`MODES`); a study that did not record
  its mode minimises a metric whose name says loss or error (:func:`metric_mode`).
* NaN, infinities, booleans and non-numbers are never best (:func:`finite`).
* Results compare at the largest step first, then by value, ties to the smaller id
  (:func:`best_key`).

This module imports nothing of stagetree: every layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MODES",
    "best_key",
    "check_mode",
    "finite",
    "guess_mode",
    "metric_mode",
    "ranked_ids",
    "signed_value",
]

#: The two directions a metric is optimised in.
MODES = ("max", "min")

# Metric names that are minimised when a study does not record its mode.
_MIN_WORDS = ("loss", "err", "perplexity", "mse", "mae", "regret")


def check_mode(mode: str) -> None:
    """Raises:
    ValueError: ``mode`` is not ``"max"`` or ``"min"``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def best_key(steps: int, value: Any, mode: str, tiebreak: int) -> tuple[int, float, int] | None:
    """The rank of a result (``value`` of the metric after ``steps`` steps) in the one
    best-trial rule: the larger key is the better result. None for a value that is
    never best (missing, not a number, NaN, infinite).

    Keys compare steps first (a result at more steps beats any result at fewer), then
    the value (``mode`` ``"max"`` or ``"min"``), then ``tiebreak`` (the smaller wins:
    the trial id, or the order the trial was created in).
    """
    number = finite(value)
    if number is None:
        return None
    return (int(steps), number if mode == "max" else -number, -int(tiebreak))


def signed_value(raw: Any, mode: str) -> float:
    """A metric value on the tuners' "larger is better" scale: the value for
    ``"max"``, its negation for ``"min"``; ``-inf`` (never better than anything) for
    a value that is not a finite number."""
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return -math.inf
    if not math.isfinite(v):
        return -math.inf
    return v if mode == "max" else -v


def ranked_ids(values: Mapping[int, float]) -> list[int]:
    """Trial ids by :func:`signed_value`, best first; ties go to the smaller id."""
    return sorted(values, key=lambda tid: (-values[tid], tid))


def guess_mode(metric: str) -> str:
    """``"min"`` when the metric's name says loss or error, else ``"max"``."""
    return "min" if any(w in metric.lower() for w in _MIN_WORDS) else "max"


def metric_mode(metric: str, meta: Mapping[str, Any]) -> str:
    """The mode of ``metric`` in a study: the one its meta records for it, else
    ``"min"`` when the name says loss or error, else ``"max"``."""
    recorded = meta.get("mode")
    if meta.get("metric") == metric and recorded in MODES:
        return str(recorded)
    return guess_mode(metric)
