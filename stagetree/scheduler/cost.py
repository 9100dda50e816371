"""Estimated seconds per training step of each plan node.

A node's *configuration* is its root's fixed config plus the values of its sequences
at its branch step. Measured configurations (from ``Progress.seconds_per_step``) use
their running mean; unmeasured ones get a least-squares fit over the numeric
hyper-parameters that vary between measured configurations (batch size is the typical
one), falling back to the mean of the measurements; before any measurement every node
costs 1.0 per step.

The fit is over every measured configuration, so fitting it again after every
measurement would cost the study's size per decision. Up to ``EXACT_ROWS`` measured
configurations it is (every prediction comes from the measurements so far); beyond,
it is fitted again once the measurements since its last fit reach ``1 / REFIT_EVERY``
of those it was fitted on, so a prediction of an unmeasured configuration lags by at
most that fraction of the measurements, and a study of ``n`` trials fits it
``O(log n)`` times past the threshold. Measured configurations always use their
current mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stagetree.plan.model import Node

__all__ = ["EXACT_ROWS", "REFIT_EVERY", "CostEstimator"]

#: Measured configurations up to which the model is fitted again after every
#: measurement (every prediction then is that of the plain fit over all of them).
EXACT_ROWS = 4096
#: Beyond ``EXACT_ROWS``: the model is fitted again once the measurements since its
#: fit reach ``1 / REFIT_EVERY`` of those it was fitted on.
REFIT_EVERY = 64
#: Up to this many nodes not cached, :meth:`CostEstimator.costs` asks :meth:`cost` for
#: each (the same floats as the arrays give, without their set-up).
_ONE_BY_ONE = 8


def _hashable(value: Any) -> Any:
    """A hashable stand-in for ``value`` equal exactly when the values are (type
    included: ``1``, ``1.0`` and ``True`` differ)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return (type(value).__name__, value)


def _entry(name: str, value: Any) -> tuple[Any, Any, Any]:
    """``name``'s part of a configuration key: ``(name, type name, value)`` for a
    hashable value, ``(name, "", _hashable(value))`` for a mapping, a list or an
    unhashable value (each value's part equal exactly when its ``_hashable`` is)."""
    if not isinstance(value, (Mapping, list, tuple)):
        try:
            hash(value)
        except TypeError:
            return name, "", repr(value)
        return name, _type_name(type(value)), value
    return name, "", _hashable(value)


_TYPE_NAMES: dict[type, str] = {}


def _type_name(kind: type) -> str:
    """``kind.__name__``, one string per type (a builtin type makes a new one on each
    read, and a key per node holds it)."""
    name = _TYPE_NAMES.get(kind)
    if name is None:
        name = _TYPE_NAMES[kind] = kind.__name__
    return name


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


@dataclass
class _Model:
    """``coef[0] + sum(coef[i + 1] * feature[names[i]])``; missing features take
    ``fill`` (their mean); ``lo``/``hi``/``mean`` summarise the measurements (``mean``
    from ``rows``, the measured means it was fitted on, when first read: most fits
    never read it, and the sum is a walk over every measured configuration)."""

    names: list[str]
    coef: list[float]
    fill: dict[str, float]
    lo: float
    hi: float
    rows: np.ndarray
    _mean: float | None = None

    @property
    def mean(self) -> float:
        if self._mean is None:
            # Summed in Python over the same floats, in the same order, as ever.
            self._mean = sum(self.rows.tolist()) / len(self.rows)
        return self._mean


# The reductions ``ndarray.min``/``max``/``mean`` run, without their Python wrappers
# (the same floats: ``mean`` is the sum divided by the count).
_MIN = np.minimum.reduce
_MAX = np.maximum.reduce
_SUM = np.add.reduce
#: The stamp of a measured node's kept cost: current at every fit.
_MEASURED = np.iinfo(np.int64).max


def _grown(array: np.ndarray, fill: Any) -> np.ndarray:
    """``array`` twice as long, the new half ``fill``."""
    out = np.full(2 * len(array), fill, dtype=array.dtype)
    out[: len(array)] = array
    return out


def _bounded(value: np.ndarray, model: _Model) -> np.ndarray:
    """Predictions as :meth:`CostEstimator.cost` bounds each (array version; ``value``
    is the caller's own array, bounded in place where it can be)."""
    # One look at the extremes instead of a mask per element: a NaN makes the minimum
    # NaN, so every bad value (NaN, infinite, not positive) fails this comparison.
    if not (len(value) and _MIN(value) > 0 and _MAX(value) < math.inf):
        bad = ~np.isfinite(value) | (value <= 0)
        if bad.any():
            value = np.where(bad, model.mean, value)
    # Extrapolation far outside what was seen is not trustworthy.
    np.maximum(value, model.lo / 10, out=value)
    return np.minimum(value, model.hi * 10, out=value)


class CostEstimator:
    """Learns seconds per step per configuration; ``cost(node)`` predicts it.

    What it keeps grows with the study (a study of many trials has many nodes), so it
    keeps it compact: a node it has seen has a dense index, its configuration key
    (equal configurations share one key object) and its numeric features in arrays
    by index; a measured configuration a row of arrays.

    Args:
        default: cost per step before anything is measured.
    """

    def __init__(self, default: float = 1.0) -> None:
        self.default = float(default)
        # root key -> its config as a flat (name, value, name, value, ...) tuple, the
        # names as in ``configuration`` ("config.<name>", one string per name).
        self._roots: dict[str, tuple[Any, ...]] = {}
        # One string per prefixed name ("config.<k>", "hp.<k>") for every node's key.
        self._names: dict[tuple[str, Any], str] = {}
        # Measured configurations: key -> row. A row's mean seconds per step, sum and
        # count, and its numeric features as columns for the fit (NaN: the row lacks
        # it), kept as measurements come, so that a fit is array work, not a walk in
        # Python; columns and sums are arrays grown by doubling (the first
        # ``len(self._means)`` entries are the rows).
        self._row: dict[Any, int] = {}
        self._means: list[float] = []
        self._columns: dict[str, np.ndarray] = {}
        # What a fit derives from the columns alone (each feature's fill, the filled
        # columns, the features that vary, the design matrix): it changes only when a
        # row is added, not when a measured row's mean moves, so it is kept until then.
        self._design: tuple[int, dict[str, float], list[str], np.ndarray | None] | None = None
        # The design matrix over columns every row has, grown in place as rows come
        # (the features it is over, the rows filled, the buffer): a random search adds
        # a row at nearly every fit, and stacking every row again grows with the study.
        self._x: tuple[tuple[str, ...], int, np.ndarray] | None = None
        # Per column, kept as rows are added: whether every row has it (no NaN), and
        # whether a row's value differs from the first row's: for such a column the
        # design matrix needs its mean alone, not a pass that fills and compares.
        self._whole: dict[str, bool] = {}
        self._varies: dict[str, bool] = {}
        # Nodes by a dense index (given on first sight): their configuration key, their
        # features as arrays (NaN: missing) and the row of their measured configuration
        # (-1: none), kept up to date as configurations are measured and roots change;
        # the nodes of each key (an int for one, a list for several: most keys have
        # one node), and those placed before their root's config was known.
        self._dense: dict[int, int] = {}
        self._dense_nodes: list[Node] = []
        self._dense_keys: list[Any] = []
        self._by_key: dict[Any, int | list[int]] = {}
        self._unrooted: dict[str, list[int]] = {}
        self._feature_arrays: dict[str, np.ndarray] = {}
        # Per feature, whether some node lacks it (NaN in its array; once true, kept):
        # a prediction over a feature every node has needs no fill.
        self._partial: dict[str, bool] = {}
        self._measured_row = np.full(16, -1, dtype=np.int64)
        self._totals_array = np.zeros(16)
        self._counts_array = np.zeros(16)
        # Each measured row's mean (``totals / counts``, the same floats), and each
        # node's cost as cost_array gives it with its stamp: an unmeasured node's
        # prediction with the fit it was made at (-1: none), a measured node's mean
        # (kept as it moves) with ``_MEASURED``. The forest asks for thousands of
        # pending nodes per decision, and the model changes far less often than that
        # once fits are spaced out; one gather answers measured and unmeasured alike.
        self._means_array = np.zeros(16)
        self._values = np.zeros(16)
        self._stamp = np.full(16, -1, dtype=np.int64)
        self._cache: dict[int, float] = {}
        self._model: _Model | None = None
        self._fitted = True
        # Fits of the model, builds of its design matrix, and predictions of
        # unmeasured nodes by cost_array, so far (for tests).
        self.fits = 0
        self.designs = 0
        self.predicted = 0
        # Measurements so far, and the count at which the model is next fitted again
        # (beyond ``EXACT_ROWS`` measured configurations).
        self._observations = 0
        self._refit_at = 0
        # root key -> (fused width, sum of seconds per step, count, width, ...): flat,
        # a tree is mostly measured at one width.
        self._widths: dict[str, tuple[Any, ...]] = {}
        # Bumped whenever a prediction may change (a measurement, a root's config):
        # a caller may keep costs computed at one version until it moves.
        self.version = 0

    def _name(self, prefix: str, key: Any) -> str:
        """``f"{prefix}.{key}"``, one string per name."""
        name = self._names.get((prefix, key))
        if name is None:
            name = self._names[(prefix, key)] = f"{prefix}.{key}"
        return name

    def register_root(self, root_key: str, config: Mapping[str, Any]) -> None:
        """Make ``config`` part of the configuration of ``root_key``'s nodes."""
        flat = tuple(x for k, v in config.items() for x in (self._name("config", k), v))
        old = self._roots.get(root_key)
        self._roots[root_key] = flat
        self._cache.clear()
        self.version += 1
        if old is None:
            redo = self._unrooted.pop(root_key, [])
        elif tuple(map(_hashable, old)) == tuple(map(_hashable, flat)):
            return  # the same config again: every key stays what it is
        else:
            redo = [i for i, n in enumerate(self._dense_nodes) if n.root_key == root_key]
        for i in redo:
            self._unplace(i)
            self._place(i)

    def configuration(self, node: Node) -> dict[str, Any]:
        """The node's configuration: ``config.<name>`` and ``hp.<name>`` values."""
        flat = self._roots.get(node.root_key, ())
        out: dict[str, Any] = dict(zip(flat[::2], flat[1::2]))
        for name, seq in node.hp.items():
            out[self._name("hp", name)] = seq(node.branch_step) if callable(seq) else seq
        return out

    def observe(self, node: Node, seconds_per_step: float, width: int = 1) -> None:
        """Record a measured time per step of ``node`` (non-positive or NaN is ignored).

        ``width``: members of the fused job the step was measured in (1: unfused). A
        node trained fused costs what its steps really took (the job's step time), and
        the step time is also learnt as a function of the width (:meth:`fused_step`).
        """
        sps = float(seconds_per_step)
        if not (math.isfinite(sps) and sps > 0):
            return
        by_width = self._widths.get(node.root_key, ())
        at = by_width[::3].index(width) * 3 if width in by_width[::3] else len(by_width)
        total, count = by_width[at + 1 : at + 3] or (0.0, 0)
        self._widths[node.root_key] = (
            *by_width[:at],
            width,
            total + sps,
            count + 1,
            *by_width[at + 3 :],
        )
        i = self.index(node)
        key = self._dense_keys[i]
        row = self._row.get(key)
        if row is None:
            total, count = 0.0, 0
            row = self._row[key] = len(self._means)
            self._means.append(0.0)
            if row >= len(self._totals_array):
                self._totals_array = _grown(self._totals_array, 0.0)
                self._counts_array = _grown(self._counts_array, 0.0)
                self._means_array = _grown(self._means_array, 0.0)
            features = self._features(i)
            for name in features.keys() - self._columns.keys():
                self._columns[name] = np.full(len(self._totals_array), math.nan)
                self._whole[name] = row == 0  # earlier rows lack it
                self._varies[name] = False
            for name, column in self._columns.items():
                if len(column) <= row:
                    column = self._columns[name] = _grown(column, math.nan)
                value = features.get(name, math.nan)
                column[row] = value
                if math.isnan(value):
                    self._whole[name] = False
                elif row and value != column[0]:
                    self._varies[name] = True
            for j in self._nodes_of(key):
                self._measured_row[j] = row
                self._stamp[j] = _MEASURED
            self._design = None
        else:
            total, count = float(self._totals_array[row]), int(self._counts_array[row])
        mean = self._means[row] = (total + sps) / (count + 1)
        self._totals_array[row] = total + sps
        self._counts_array[row] = count + 1
        self._means_array[row] = mean
        for j in self._nodes_of(key):
            self._values[j] = mean
        self._cache.clear()
        self._observations += 1
        if len(self._means) <= EXACT_ROWS or self._observations >= self._refit_at:
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
        flat = self._widths.get(root_key, ())
        return {w: t / n for w, t, n in sorted(zip(flat[::3], flat[1::3], flat[2::3])) if n}

    @property
    def measured(self) -> int:
        """Number of distinct configurations measured so far."""
        return len(self._row)

    def measured_rows(self) -> list[tuple[float, int, dict[str, float]]]:
        """Each measured configuration's sum of seconds per step, count and numeric
        features, in the order they were first measured (what the fit is over)."""
        out = []
        for row in range(len(self._means)):
            features = {
                k: float(c[row]) for k, c in self._columns.items() if not math.isnan(c[row])
            }
            out.append((float(self._totals_array[row]), int(self._counts_array[row]), features))
        return out

    def _fit(self) -> None:
        """The least-squares model over the measured configurations.

        Array work over the kept columns; the result is, to the bit, that of the plain
        computation over the measured rows (means per row, each feature's mean over
        the rows that have it as the fill, the features that vary once filled), so the
        predictions, and the decisions made on them, do not depend on how it is done.
        What depends on the features alone is kept between fits until a row is added
        (:meth:`_design_matrix`): a fit after a measured row's mean moved is the mean,
        the bounds and the solve.
        """
        self._fitted = True
        self.fits += 1
        self._refit_at = self._observations + self._observations // REFIT_EVERY
        rows = len(self._means)
        means_a = self._totals_array[:rows] / self._counts_array[:rows]
        fill, varying, x = self._design_matrix()
        model = _Model(varying, [], fill, float(_MIN(means_a)), float(_MAX(means_a)), means_a)
        if x is not None:
            solution, *_ = np.linalg.lstsq(x, means_a, rcond=None)
            model.coef = solution.tolist()
        else:
            model.coef = [model.mean]
        self._model = model

    def _design_matrix(self) -> tuple[dict[str, float], list[str], np.ndarray | None]:
        """Each feature's fill, the features that vary once filled and the design
        matrix over them (None: fewer than two rows, or none varies), for the rows
        measured now (kept until a row is added)."""
        rows = len(self._means)
        if self._design is not None and self._design[0] == rows:
            return self._design[1], self._design[2], self._design[3]
        self.designs += 1
        fill: dict[str, float] = {}
        filled: dict[str, np.ndarray] = {}
        varying = []
        for k in sorted(self._columns):
            column = self._columns[k][:rows]
            if self._whole[k]:  # what the pass below gives such a column, without it
                fill[k] = float(_SUM(column)) / rows  # float(column.mean())
                filled[k] = column
                if self._varies[k]:
                    varying.append(k)
                continue
            missing = np.isnan(column)
            fill[k] = float(np.mean(column[~missing] if missing.any() else column))
            filled[k] = np.where(missing, fill[k], column)
            if bool((filled[k] != filled[k][0]).any()):
                varying.append(k)
        x = None
        if rows >= 2 and varying:
            if all(self._whole[k] for k in varying):
                x = self._grown_design(tuple(varying), rows)
            else:  # a filled column changes with its fill: stacked again
                x = np.column_stack([np.ones(rows)] + [filled[k] for k in varying])
        else:
            varying = []
        self._design = (rows, fill, varying, x)
        return fill, varying, x

    def _grown_design(self, names: tuple[str, ...], rows: int) -> np.ndarray:
        """The design matrix over columns ``names`` (each one every row has) for the
        first ``rows`` rows: ``np.column_stack([np.ones(rows)] + columns)``, the same
        floats and layout, filled only where rows were added since the last call (a
        row's features never change)."""
        kept = self._x
        if kept is not None and kept[0] == names and len(kept[2]) >= rows:
            x, start = kept[2], kept[1]
        else:
            x, start = np.empty((max(64, 2 * rows), 1 + len(names))), 0
            x[:, 0] = 1.0
        for j, k in enumerate(names, 1):
            x[start:rows, j] = self._columns[k][start:rows]
        self._x = (names, rows, x)
        return x[:rows]

    def cost(self, node: Node) -> float:
        """Estimated seconds per step of ``node`` (``default`` with no measurement)."""
        hit = self._cache.get(node.id)
        if hit is not None:
            return hit
        if not self._row:
            return self.default
        i = self.index(node)
        row = int(self._measured_row[i])
        if row >= 0:
            value = self._means[row]
        else:
            if not self._fitted:
                self._fit()
            model = self._model
            assert model is not None
            value = model.coef[0]
            for k, c in zip(model.names, model.coef[1:]):
                feature = float(self._feature_arrays[k][i])
                value += c * (model.fill[k] if math.isnan(feature) else feature)
            if not math.isfinite(value) or value <= 0:
                value = model.mean
            # Extrapolation far outside what was seen is not trustworthy.
            value = min(max(value, model.lo / 10), model.hi * 10)
        self._cache[node.id] = value
        return value

    def index(self, node: Node) -> int:
        """The node's dense index for :meth:`cost_array` (given on first sight)."""
        i = self._dense.get(node.id)
        if i is None:
            i = self._dense[node.id] = len(self._dense_nodes)
            self._dense_nodes.append(node)
            self._dense_keys.append(None)
            if node.root_key not in self._roots:
                self._unrooted.setdefault(node.root_key, []).append(i)
            if i >= len(self._measured_row):
                self._measured_row = _grown(self._measured_row, -1)
                self._values = _grown(self._values, 0.0)
                self._stamp = _grown(self._stamp, -1)
                for name, array in self._feature_arrays.items():
                    self._feature_arrays[name] = _grown(array, math.nan)
            self._place(i)
        return i

    def _place(self, i: int) -> None:
        """Key, features and measured row of dense node ``i`` from its configuration."""
        conf = self.configuration(self._dense_nodes[i])
        key = tuple(x for name in sorted(conf) for x in _entry(name, conf[name]))
        first = self._by_key.get(key)
        if first is None:
            self._by_key[key] = i
        else:  # one key object per configuration
            if isinstance(first, int):
                first = self._by_key[key] = [first]
            key = self._dense_keys[first[0]]
            first.append(i)
        self._dense_keys[i] = key
        for name, value in conf.items():
            f = _numeric(value)
            if f is not None and name not in self._feature_arrays:
                self._feature_arrays[name] = np.full(len(self._measured_row), math.nan)
                self._partial[name] = len(self._dense_nodes) > 1  # the others lack it
        for name, array in self._feature_arrays.items():
            f = _numeric(conf[name]) if name in conf else None
            if f is None:
                array[i] = math.nan
                self._partial[name] = True
            else:
                array[i] = f
        row = self._measured_row[i] = self._row.get(key, -1)
        if row >= 0:
            self._values[i] = self._means_array[row]
            self._stamp[i] = _MEASURED
        else:
            self._stamp[i] = -1  # its features may have changed

    def _unplace(self, i: int) -> None:
        """Dense node ``i`` no longer has its key (its root's config changed)."""
        key = self._dense_keys[i]
        got = self._by_key[key]
        if isinstance(got, list):
            got.remove(i)
        if isinstance(got, int) or not got:
            del self._by_key[key]

    def _nodes_of(self, key: Any) -> list[int]:
        """The dense nodes whose configuration key is ``key``."""
        got = self._by_key.get(key, [])
        return [got] if isinstance(got, int) else got

    def _features(self, i: int) -> dict[str, float]:
        """Dense node ``i``'s numeric features."""
        out = {}
        for name, array in self._feature_arrays.items():
            f = float(array[i])
            if not math.isnan(f):
                out[name] = f
        return out

    def cost_array(self, dense: np.ndarray) -> np.ndarray:
        """``cost`` of the nodes at these dense indices (:meth:`index`), as an array of
        the same floats."""
        if not self._row:
            return np.full(len(dense), self.default)
        stamp = self._stamp[dense]
        if not self._fitted:
            if len(dense) == 0 or _MIN(stamp) == _MEASURED:
                return self._values[dense]  # every node measured: no fit needed
            self._fit()
        # Unmeasured nodes not predicted since the last fit (or since their features
        # changed) are predicted now and kept until the next fit (a fit only counts
        # up, and a measured node's stamp is above every count).
        stale = stamp < self.fits
        if stale.any():
            at = dense[stale]
            self._values[at] = self._predict(at)
            self._stamp[at] = self.fits
            self.predicted += len(at)
        return self._values[dense]

    def _predict(self, at: np.ndarray) -> np.ndarray:
        """The fitted model's predictions for the nodes at dense indices ``at``, as
        :meth:`cost` bounds each (element by element: the same floats for any subset)."""
        model = self._model
        assert model is not None
        # ``coef[0] + c1 * x1 + c2 * x2 ...`` added in that order, in place (an
        # addition or a product is the same float either way round).
        value: np.ndarray | None = None
        for k, c in zip(model.names, model.coef[1:]):
            column = self._feature_arrays[k][at]
            if self._partial[k]:
                column = np.where(np.isnan(column), model.fill[k], column)
            column *= c
            if value is None:
                value = column
                value += model.coef[0]
            else:
                value += column
        if value is None:
            value = np.full(len(at), model.coef[0])
        return _bounded(value, model)

    def costs(self, nodes: list[Node]) -> list[float]:
        """``[cost(n) for n in nodes]``, the same floats, computed as arrays
        (:meth:`cost_array`: what keeps the scheduler's cost refresh cheap over
        thousands of pending nodes after each measurement); a few nodes one by one
        (the arrays' set-up costs more than they save: the forest costs the part of
        the chosen path, a node or two, at every decision).
        """
        if not self._row:
            return [self.default] * len(nodes)
        cache = self._cache
        out: list[float | None] = [cache.get(node.id) for node in nodes]
        todo = [j for j, hit in enumerate(out) if hit is None]
        if 0 < len(todo) <= _ONE_BY_ONE:
            cost = self.cost
            for j in todo:
                out[j] = cost(nodes[j])
        elif todo:
            dense = np.array([self.index(nodes[j]) for j in todo], dtype=np.int64)
            for j, v in zip(todo, self.cost_array(dense).tolist()):
                out[j] = cache[nodes[j].id] = v
        return out  # type: ignore[return-value]
