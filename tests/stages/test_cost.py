"""The per-step cost estimator."""

from __future__ import annotations

import pytest
from counting import counting

from stagetree.hp import Constant, MultiStep
from stagetree.plan.model import Node
from stagetree.scheduler import CostEstimator


def node(node_id: int, root: str = "r", **hp: object) -> Node:
    return Node(node_id, root, None, 0, {k: Constant(v) for k, v in hp.items()})  # type: ignore[arg-type]


def test_one_per_step_before_any_measurement() -> None:
    est = CostEstimator()
    assert est.cost(node(1, lr=0.1)) == 1.0
    assert CostEstimator(default=2.5).cost(node(1, lr=0.1)) == 2.5
    assert est.measured == 0


def test_measured_configuration_uses_its_mean() -> None:
    est = CostEstimator()
    a = node(1, lr=0.1)
    est.observe(a, 0.2)
    est.observe(a, 0.4)
    assert est.cost(a) == pytest.approx(0.3)
    # non-positive and NaN measurements are ignored
    est.observe(a, 0.0)
    est.observe(a, float("nan"))
    assert est.cost(a) == pytest.approx(0.3)


def test_nodes_with_the_same_configuration_share_measurements() -> None:
    est = CostEstimator()
    est.register_root("r", {"batch_size": 64})
    parent = node(1, lr=0.1)
    # a child whose value at its branch step equals another node's configuration
    child = Node(2, "r", 1, 50, {"lr": MultiStep(0.5, [50], 0.2)})  # 0.1 from step 50
    est.observe(parent, 0.7)
    est.observe(node(3, lr=0.5), 0.1)
    assert est.cost(child) == pytest.approx(0.7)


def test_learns_a_linear_dependence_on_batch_size_from_root_configs() -> None:
    est = CostEstimator()
    for i, bs in enumerate([32, 64, 128], start=1):
        est.register_root(f"bs{bs}", {"batch_size": bs, "optimizer": "sgd"})
        est.observe(node(i, f"bs{bs}", lr=0.1), 0.5 + 0.01 * bs)
    est.register_root("bs256", {"batch_size": 256, "optimizer": "sgd"})
    assert est.cost(node(9, "bs256", lr=0.1)) == pytest.approx(0.5 + 2.56)
    est.register_root("bs48", {"batch_size": 48, "optimizer": "sgd"})
    assert est.cost(node(10, "bs48", lr=0.1)) == pytest.approx(0.98)


def test_learns_from_sequential_hyper_parameters_too() -> None:
    est = CostEstimator()
    for i, bs in enumerate([16, 32, 64], start=1):
        est.observe(node(i, bs=bs, lr=0.1), 0.02 * bs)
    assert est.cost(node(4, bs=100, lr=0.1)) == pytest.approx(2.0)
    assert est.cost(node(5, bs=100, lr=0.3)) == pytest.approx(2.0)  # lr never varied


def test_falls_back_to_the_mean_without_numeric_variation() -> None:
    est = CostEstimator()
    est.observe(node(1, opt="sgd"), 1.0)
    est.observe(node(2, opt="adam"), 3.0)
    assert est.cost(node(3, opt="lamb")) == pytest.approx(2.0)
    single = CostEstimator()
    single.observe(node(1, bs=32), 0.4)
    assert single.cost(node(2, bs=64)) == pytest.approx(0.4)


def test_predictions_stay_positive_and_bounded() -> None:
    est = CostEstimator()
    est.observe(node(1, bs=10), 1.0)
    est.observe(node(2, bs=20), 0.5)
    # the line goes negative at bs=40: fall back to the mean
    assert est.cost(node(3, bs=40)) == pytest.approx(0.75)
    # far extrapolation is capped at ten times the largest measurement
    est2 = CostEstimator()
    est2.observe(node(1, bs=1), 1.0)
    est2.observe(node(2, bs=2), 2.0)
    assert est2.cost(node(3, bs=1000)) == pytest.approx(20.0)


def _reference_fit(est: CostEstimator) -> tuple[list[str], list[float], dict[str, float]]:
    """The fit as a plain walk over the measured rows (what the kept columns replace)."""
    import numpy as np

    rows = [(total / count, feats) for total, count, feats in est.measured_rows()]
    means = [y for y, _ in rows]
    names = sorted({k for _, f in rows for k in f})
    fill = {k: float(np.mean([f[k] for _, f in rows if k in f])) for k in names}
    varying = [k for k in names if len({f.get(k, fill[k]) for _, f in rows}) > 1]
    coef = [sum(means) / len(means)]
    if len(rows) >= 2 and varying:
        x = np.array([[1.0] + [f.get(k, fill[k]) for k in varying] for _, f in rows])
        solution, *_ = np.linalg.lstsq(x, np.array(means), rcond=None)
        coef = [float(c) for c in solution]
    else:
        varying = []
    return varying, coef, fill


def test_fit_and_bulk_costs_equal_the_plain_computation_to_the_bit() -> None:
    import random

    rng = random.Random(7)
    est = CostEstimator()
    nodes = []
    for i in range(400):
        hp: dict[str, object] = {"lr": rng.choice([0.1, 0.01, 0.3]) * rng.random()}
        if i % 3:
            hp["bs"] = rng.choice([64, 128, 256])
        if i % 7 == 0:
            hp["depth"] = rng.randint(1, 9)
        nodes.append(node(i, **hp))
    for round_ in range(60):
        for _ in range(rng.randint(1, 4)):
            n = rng.choice(nodes[: 40 + 5 * round_])
            bs = n.hp["bs"](0) if "bs" in n.hp else 100  # type: ignore[operator]
            est.observe(n, 0.001 * bs * (1 + 0.1 * rng.random()))
        one_by_one = [CostEstimator.cost(est, n) for n in nodes]
        est._cache.clear()
        assert est.costs(nodes) == one_by_one  # exact, not approximate
        est._fitted = False
        est._fit()
        assert est._model is not None
        assert (est._model.names, est._model.coef, est._model.fill) == _reference_fit(est)


def test_a_fit_after_measured_means_moved_keeps_the_design_matrix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The design matrix depends on the measured configurations' features only: a new
    # measurement of a configuration already measured moves its mean, not the matrix,
    # so the fit after it is the solve alone, not a walk over every configuration.
    import numpy as np

    est = CostEstimator()
    nodes = [node(i, bs=16 * (i + 1)) for i in range(50)]
    for n in nodes:
        est.observe(n, 0.01 * n.hp["bs"](0))  # type: ignore[operator]
    unmeasured = node(99, bs=1000)
    est.cost(unmeasured)
    stacks = counting(monkeypatch, np, "column_stack")
    solves = counting(monkeypatch, np.linalg, "lstsq")
    for i in range(20):
        est.observe(nodes[i], 0.02 * nodes[i].hp["bs"](0))  # type: ignore[operator]
        est.cost(unmeasured)
        assert solves[0] == 2 * i + 1  # every prediction from the measurements so far
        assert (est._model.names, est._model.coef, est._model.fill) == _reference_fit(est)  # type: ignore[union-attr]
    assert stacks[0] == 0


def test_beyond_the_exact_rows_the_model_is_fitted_again_logarithmically_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A study of n trials measures about n configurations and asks a prediction for a
    # new one at most decisions: a fit over all of them each time is O(n) per decision.
    # Past EXACT_ROWS configurations the model is fitted again once the measurements
    # since its fit reach 1 / REFIT_EVERY of those it was fitted on.
    import math

    import numpy as np

    from stagetree.scheduler import cost as cost_module

    monkeypatch.setattr(cost_module, "EXACT_ROWS", 64, raising=False)
    every = getattr(cost_module, "REFIT_EVERY", 64)
    solves = counting(monkeypatch, np.linalg, "lstsq")
    est = CostEstimator()
    n = 3000
    for i in range(n):
        est.observe(node(i, bs=16 + i % 7, lr=0.1 / (1 + i)), 0.01 * (16 + i % 7))
        est.cost(node(n + i, bs=20, lr=0.05))
    # 63 exact fits (one row: no solve), then about every * ln(n / 64) refits (the
    # first ones after every measurement while every / 64 rounds to one)
    assert solves[0] <= 64 + 2 * every * math.log(n / 64)
    # and what the model predicts lags by at most 1/REFIT_EVERY of the measurements
    stale = est.cost(node(2 * n, bs=20, lr=0.05))
    est._fitted = False
    assert est.cost(node(2 * n + 1, bs=20, lr=0.05)) == pytest.approx(stale, rel=0.05)


def test_bulk_predictions_are_kept_until_the_model_or_the_node_changes() -> None:
    # The forest asks cost_array for every pending node at each decision; between two
    # fits the model's predictions of unmeasured nodes are the same, so they are made
    # once per fit (and again for a node whose root's config changed), always the
    # same floats as ``cost``.
    import numpy as np

    est = CostEstimator()
    for i, bs in enumerate([16, 32, 64]):
        est.register_root(f"m{i}", {"bs": bs})
        est.observe(node(i, f"m{i}", lr=0.1), 0.01 * bs)
    pending = []
    for i in range(100):
        est.register_root(f"p{i}", {"bs": 100 + i})
        pending.append(node(100 + i, f"p{i}", lr=0.1))
    nodes = [node(0, "m0", lr=0.1), *pending]
    dense = np.array([est.index(n) for n in nodes], dtype=np.int64)

    def plain() -> list[float]:
        est._cache.clear()
        return [CostEstimator.cost(est, n) for n in nodes]

    first = est.cost_array(dense)
    assert est.predicted == 100
    assert first.tolist() == plain()
    again = est.cost_array(dense[::-1])
    assert est.predicted == 100  # no fit since: nothing predicted again
    assert again.tolist() == first[::-1].tolist()
    est.observe(nodes[0], 0.5)  # a measurement: the model is fitted again
    moved = est.cost_array(dense)
    assert est.predicted == 200
    assert moved.tolist() == plain()
    est.register_root("p3", {"bs": 1000})  # one node's features change
    changed = est.cost_array(dense)
    assert est.predicted == 201
    assert changed.tolist() == plain()
    est.observe(pending[5], 0.3)  # a pending node measured: its mean from now on
    measured = est.cost_array(dense)
    assert measured[6] == 0.3
    assert measured.tolist() == plain()


def test_a_fit_over_columns_every_row_has_skips_the_fill_pass_and_the_mean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A random search measures one new configuration per trial and asks a prediction
    # at each decision: every fit adds a row. For a feature every measured row has,
    # the fill pass (NaN mask, fill, compare with the first row) gives the column as
    # it is, so the fit takes its mean only; the mean of the measurements (a sum over
    # every row in Python) is summed only where it is read. Both stay the plain fit's.
    import numpy as np

    from stagetree.scheduler import cost as cost_module

    wheres = counting(monkeypatch, np, "where")
    sums = [0]

    def counted_sum(values: object) -> float:
        sums[0] += 1
        return sum(values)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(cost_module, "sum", counted_sum, raising=False)
    est = CostEstimator()
    for i in range(200):
        est.observe(node(i, lr=0.001 * (i + 1), bs=64), 0.01 + 0.0001 * i)
        est.cost(node(1000 + i, lr=0.5, bs=64))
        assert est._model is not None
        assert (est._model.names, est._model.coef, est._model.fill) == _reference_fit(est)
    # One sum: the first fit's, over one row (its coefficient is the mean); on main one
    # sum and two fill passes per fit (400 np.where).
    assert wheres[0] == 0 and sums[0] == 1
    assert est._model.names == ["hp.lr"]  # bs is the same on every row: not a feature
    means = [total / count for total, count, _ in est.measured_rows()]
    assert est._model.mean == sum(means) / len(means)  # summed when read
    # A feature a row lacks takes the fill pass again (the plain fit's answer too).
    est.observe(node(5000, lr=0.3), 0.02)
    est.cost(node(5001, lr=0.5, bs=64))
    assert (est._model.names, est._model.coef, est._model.fill) == _reference_fit(est)
    assert wheres[0] > 0


def test_costs_of_a_few_nodes_go_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # The forest costs the part of the chosen path (a node or two) at every decision:
    # arrays for one node cost more than the prediction itself. The same floats.
    est = CostEstimator()
    measured = [node(i, lr=0.01 * (i + 1), bs=16 * (i % 3 + 1)) for i in range(30)]
    for n in measured:
        est.observe(n, 0.001 * n.hp["bs"](0))  # type: ignore[operator]
    pending = [node(100 + i, lr=0.003 * (i + 1), bs=32) for i in range(20)]
    arrays = counting(monkeypatch, CostEstimator, "cost_array")
    few = est.costs([pending[0], measured[3], pending[1]])
    assert arrays[0] == 0  # on main: one call, for three nodes
    many = est.costs(pending)
    assert arrays[0] == 1
    est._cache.clear()
    assert few == [CostEstimator.cost(est, n) for n in (pending[0], measured[3], pending[1])]
    assert many == [CostEstimator.cost(est, n) for n in pending]


def test_the_design_matrix_over_columns_every_row_has_grows_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A random search adds a measured row at nearly every fit: stacking the design
    # matrix again over every row each time grows with the study. Over columns every
    # row has, rows are written once into a kept buffer; the fit stays the plain one.
    import numpy as np

    stacks = counting(monkeypatch, np, "column_stack")
    est = CostEstimator()
    for i in range(300):
        est.observe(node(i, lr=0.001 * (i + 1) ** 1.3, bs=64), 0.01 + 0.0001 * i)
        est.cost(node(1000 + i, lr=0.5, bs=64))
        assert est._model is not None
        assert (est._model.names, est._model.coef, est._model.fill) == _reference_fit(est)
    assert est.designs == 300  # one per added row
    assert stacks[0] == 0  # on main: 298 stacks
    # A feature a row lacks: its filled column changes with its fill, stacked again.
    est.observe(node(5000, bs=64), 0.02)
    est.cost(node(5001, lr=0.5, bs=64))
    assert (est._model.names, est._model.coef, est._model.fill) == _reference_fit(est)
    assert stacks[0] == 1


def test_bulk_predictions_of_features_every_node_has_need_no_fill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The forest asks for every ready root's cost at each decision, and every fit
    # makes each unmeasured node's prediction stale: a feature every node has needs no
    # NaN mask and fill per prediction. The same floats as one by one.
    import numpy as np

    est = CostEstimator()
    measured = [node(i, lr=0.01 * (i + 1), bs=16 * (i % 3 + 1)) for i in range(40)]
    for n in measured:
        est.observe(n, 0.001 * n.hp["bs"](0) + 0.0001 * n.hp["lr"](0))  # type: ignore[operator]
    pending = [node(100 + i, lr=0.003 * (i + 1), bs=32 * (i % 2 + 1)) for i in range(50)]
    nans = counting(monkeypatch, np, "isnan")
    wheres = counting(monkeypatch, np, "where")
    got = est.costs(pending + measured)
    assert nans[0] == 0 and wheres[0] == 0  # on main: one of each per feature
    est._cache.clear()
    assert got == [CostEstimator.cost(est, n) for n in pending + measured]
    # A node that lacks a feature: the fill again, for that feature from then on.
    lacking = node(500, lr=0.02)
    est._cache.clear()
    got = est.costs([*pending, lacking])
    assert wheres[0] == 1
    est._cache.clear()
    assert got == [CostEstimator.cost(est, n) for n in [*pending, lacking]]
