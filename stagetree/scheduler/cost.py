"""Estimated seconds per training step of each plan node.

A node's *configuration* is its root's fixed config plus the values of its sequences
at its branch step. Measured configurations (from ``Progress.seconds_per_step``) use
their running mean; unmeasured ones get a least-squares fit over the numeric
hyper-parameters that vary between measured configurations (batch size is the typical
one), falling back to the mean of the measurements; before any measurement every node
costs 1.0 per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stagetree.plan.model import Node

__all__ = ["CostEstimator"]


def _hashable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return (type(value).__name__, value)


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True)
class _Model:
    """``coef[0] + sum(coef[i + 1] * feature[names[i]])``; missing features take
    ``fill`` (their mean); ``lo``/``hi``/``mean`` summarise the measurements."""

    names: list[str]
    coef: list[float]
    fill: dict[str, float]
    lo: float
    hi: float
    mean: float


class CostEstimator:
    """Learns seconds per step per configuration; ``cost(node)`` predicts it.

    Args:
        default: cost per step before anything is measured.
    """

    def __init__(self, default: float = 1.0) -> None:
        self.default = float(default)
        self._roots: dict[str, dict[str, Any]] = {}
        # configuration key -> [sum of seconds per step, count, numeric features]
        self._measured: dict[Any, tuple[float, int, dict[str, float]]] = {}
        self._keys: dict[int, tuple[Any, dict[str, float]]] = {}
        self._cache: dict[int, float] = {}
        self._model: _Model | None = None
        self._fitted = True
        # root key -> fused width -> [sum of seconds per step, count]
        self._widths: dict[str, dict[int, tuple[float, int]]] = {}
        # Bumped whenever a prediction may change (a measurement, a root's config):
        # a caller may keep costs computed at one version until it moves.
        self.version = 0

    def register_root(self, root_key: str, config: Mapping[str, Any]) -> None:
        """Make ``config`` part of the configuration of ``root_key``'s nodes."""
        self._roots[root_key] = dict(config)
        self._keys.clear()  # configurations include the root config
        self._cache.clear()
        self.version += 1

    def configuration(self, node: Node) -> dict[str, Any]:
        """The node's configuration: ``config.<name>`` and ``hp.<name>`` values."""
        out: dict[str, Any] = {
            f"config.{k}": v for k, v in self._roots.get(node.root_key, {}).items()
        }
        for name, seq in node.hp.items():
            out[f"hp.{name}"] = seq(node.branch_step) if callable(seq) else seq
        return out

    def _key(self, node: Node) -> tuple[Any, dict[str, float]]:
        hit = self._keys.get(node.id)
        if hit is None:
            conf = self.configuration(node)
            key = _hashable(conf)
            features = {k: f for k, v in conf.items() if (f := _numeric(v)) is not None}
            hit = self._keys[node.id] = (key, features)
        return hit

    def observe(self, node: Node, seconds_per_step: float, width: int = 1) -> None:
        """Record a measured time per step of ``node`` (non-positive or NaN is ignored).

        ``width``: members of the fused job the step was measured in (1: unfused). A
        node trained fused costs what its steps really took (the job's step time), and
        the step time is also learnt as a function of the width (:meth:`fused_step`).
        """
        sps = float(seconds_per_step)
        if not (math.isfinite(sps) and sps > 0):
            return
        by_width = self._widths.setdefault(node.root_key, {})
        total, count = by_width.get(width, (0.0, 0))
        by_width[width] = (total + sps, count + 1)
        key, features = self._key(node)
        total, count, _ = self._measured.get(key, (0.0, 0, features))
        self._measured[key] = (total + sps, count + 1, features)
        self._cache.clear()
        self._fitted = False
        self.version += 1

    def fused_step(self, root_key: str, width: int) -> float | None:
        """Estimated seconds per step of a fused job of ``width`` members of plan tree
        ``root_key``, relative to one unfused step of that tree: measured widths give
        their mean; others are interpolated linearly between the nearest measured widths
        (or extrapolated from the two nearest); None until the tree was measured unfused
        and at one width > 1. Fusing ``width`` members pays when this is below ``width``.
        """
        means = self.widths(root_key)
        if 1 not in means or len(means) < 2:
            return None
        base = means[1]
        if width in means:
            return means[width] / base
        xs = sorted(means)
        lo = max((w for w in xs if w < width), default=None)
        hi = min((w for w in xs if w > width), default=None)
        if lo is None or hi is None:  # extrapolate from the two nearest widths
            a, b = (xs[-2], xs[-1]) if hi is None else (xs[0], xs[1])
        else:
            a, b = lo, hi
        slope = (means[b] - means[a]) / (b - a)
        return max(means[a] + slope * (width - a), 0.0) / base

    def widths(self, root_key: str) -> dict[int, float]:
        """Mean measured seconds per step of plan tree ``root_key`` by fused width (1:
        unfused)."""
        return {w: t / n for w, (t, n) in sorted(self._widths.get(root_key, {}).items()) if n}

    @property
    def measured(self) -> int:
        """Number of distinct configurations measured so far."""
        return len(self._measured)

    def _fit(self) -> None:
        self._fitted = True
        rows = [(total / count, feats) for total, count, feats in self._measured.values()]
        means = [y for y, _ in rows]
        mean = sum(means) / len(means)
        names = sorted({k for _, f in rows for k in f})
        fill = {k: float(np.mean([f[k] for _, f in rows if k in f])) for k in names}
        varying = [k for k in names if len({f.get(k, fill[k]) for _, f in rows}) > 1]
        coef = [mean]
        if len(rows) >= 2 and varying:
            x = np.array([[1.0] + [f.get(k, fill[k]) for k in varying] for _, f in rows])
            solution, *_ = np.linalg.lstsq(x, np.array(means), rcond=None)
            coef = [float(c) for c in solution]
        else:
            varying = []
        self._model = _Model(varying, coef, fill, min(means), max(means), mean)

    def cost(self, node: Node) -> float:
        """Estimated seconds per step of ``node`` (``default`` with no measurement)."""
        hit = self._cache.get(node.id)
        if hit is not None:
            return hit
        if not self._measured:
            return self.default
        key, features = self._key(node)
        measured = self._measured.get(key)
        if measured is not None:
            value = measured[0] / measured[1]
        else:
            if not self._fitted:
                self._fit()
            model = self._model
            assert model is not None
            value = model.coef[0]
            for k, c in zip(model.names, model.coef[1:]):
                value += c * features.get(k, model.fill[k])
            if not math.isfinite(value) or value <= 0:
                value = model.mean
            # Extrapolation far outside what was seen is not trustworthy.
            value = min(max(value, model.lo / 10), model.hi * 10)
        self._cache[node.id] = value
        return value
