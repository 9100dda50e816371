"""Parity of stagetree.hp families with PyTorch's learning-rate schedulers.

The promise: ``seq(t)`` equals ``optimizer.param_groups[0]["lr"]`` after ``t`` calls
of ``scheduler.step()``, within 1e-9 relative, for t up to 10,000.

Tolerance: pure relative, ``|ours - torch| <= 1e-9 * max(|ours|, |torch|)``, no
absolute slack, even where schedules reach zero. PyTorch computes StepLR, MultiStepLR,
ExponentialLR, LinearLR and CosineAnnealingLR *recursively* (each lr from the previous
one) while stagetree uses closed forms, so those differ by accumulated rounding; with
torch 2.13 the largest relative gaps over these settings are ~5e-11 (Cosine: the
recursive ratio form resets to exactly ``eta_min`` at every odd multiple of ``t_max``,
so errors never build up over more than one period, and exact zeros agree exactly),
~6e-14 (Linear) and ~7e-15 (Step, Exponential). CosineAnnealingWarmRestarts, CyclicLR
and OneCycleLR are closed forms in PyTorch too; stagetree performs the same float
operations in the same order, so those must agree bit for bit (``exact=True``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from stagetree.hp import (
    Cosine,
    CosineWarmRestarts,
    Cyclic,
    Exponential,
    Linear,
    MultiStep,
    OneCycle,
    Sequence,
    Step,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

N = 10_000
REL = 1e-9


def torch_lrs(lr: float, make: Callable[[Any], Any], n: int = N) -> np.ndarray:
    """``lr`` after 0..n calls of ``scheduler.step()`` (SGD on one dummy parameter)."""
    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = make(opt)
        opt.step()  # no gradient: a no-op that silences the call-order warning
        out = [opt.param_groups[0]["lr"]]
        for _ in range(n):
            sched.step()
            out.append(opt.param_groups[0]["lr"])
    return np.asarray(out, dtype=np.float64)


def assert_parity(seq: Sequence, expected: np.ndarray, exact: bool = False) -> None:
    ours = np.asarray(seq.values(0, len(expected)), dtype=np.float64)
    assert ours.shape == expected.shape
    tol = 0.0 if exact else REL * np.maximum(np.abs(ours), np.abs(expected))
    bad = np.flatnonzero(np.abs(ours - expected) > tol)
    if bad.size:
        t = int(bad[0])
        pytest.fail(
            f"{seq!r} differs from torch at {bad.size} steps, first t={t}: "
            f"ours={ours[t]!r} torch={expected[t]!r}"
        )
    # values() and __call__ agree exactly (spot checks; test_hp checks whole ranges).
    for t in (0, 1, len(expected) // 2, len(expected) - 1):
        assert seq(t) == ours[t]


S = torch.optim.lr_scheduler


@pytest.mark.parametrize(
    ("lr", "step_size", "gamma"),
    [(0.1, 30, 0.1), (1.0, 7, 0.5), (0.05, 1, 0.999), (3e-4, 1000, 0.3)],
)
def test_step(lr: float, step_size: int, gamma: float) -> None:
    expected = torch_lrs(lr, lambda o: S.StepLR(o, step_size=step_size, gamma=gamma))
    assert_parity(Step(lr, step_size, gamma), expected)


@pytest.mark.parametrize(
    ("lr", "milestones", "gamma"),
    [(0.1, [30, 80], 0.1), (0.5, [0, 5, 5000, 9999], 0.5), (1.0, [1, 2, 3], 2.0)],
)
def test_multistep(lr: float, milestones: list[int], gamma: float) -> None:
    expected = torch_lrs(lr, lambda o: S.MultiStepLR(o, milestones=milestones, gamma=gamma))
    assert_parity(MultiStep(lr, milestones, gamma), expected)


@pytest.mark.parametrize(("lr", "gamma"), [(0.1, 0.999), (1.0, 0.99), (0.01, 1.0001)])
def test_exponential(lr: float, gamma: float) -> None:
    expected = torch_lrs(lr, lambda o: S.ExponentialLR(o, gamma=gamma))
    assert_parity(Exponential(lr, gamma), expected)


@pytest.mark.parametrize(
    ("lr", "t_max", "eta_min"),
    [(0.1, 100, 0.0), (0.1, 10_000, 0.0), (0.5, 37, 1e-3), (1.0, 1, 0.0), (0.2, 3000, 0.05)],
)
def test_cosine(lr: float, t_max: int, eta_min: float) -> None:
    expected = torch_lrs(lr, lambda o: S.CosineAnnealingLR(o, T_max=t_max, eta_min=eta_min))
    assert_parity(Cosine(lr, t_max, eta_min), expected)


@pytest.mark.parametrize(
    ("lr", "t_0", "t_mult", "eta_min"),
    [(0.1, 10, 1, 0.0), (0.1, 10, 2, 1e-4), (0.3, 1, 3, 0.0), (1.0, 7, 1, 0.5), (0.05, 1, 1, 0.0)],
)
def test_cosine_warm_restarts(lr: float, t_0: int, t_mult: int, eta_min: float) -> None:
    expected = torch_lrs(
        lr, lambda o: S.CosineAnnealingWarmRestarts(o, T_0=t_0, T_mult=t_mult, eta_min=eta_min)
    )
    assert_parity(CosineWarmRestarts(lr, t_0, t_mult, eta_min), expected, exact=True)


@pytest.mark.parametrize(
    ("lr", "start_factor", "end_factor", "total_iters"),
    [
        (0.1, 1.0 / 3, 1.0, 5),
        (0.2, 1.0, 0.0, 1000),
        (0.05, 0.5, 0.9, 9999),
        (1.0, 0.01, 1.0, 1),
        (0.3, 0.25, 0.75, 20_000),  # still ramping at the end of the window
    ],
)
def test_linear(lr: float, start_factor: float, end_factor: float, total_iters: int) -> None:
    expected = torch_lrs(
        lr,
        lambda o: S.LinearLR(
            o, start_factor=start_factor, end_factor=end_factor, total_iters=total_iters
        ),
    )
    assert_parity(Linear(lr * start_factor, lr * end_factor, total_iters), expected)


@pytest.mark.parametrize(
    ("base", "max_lr", "up", "down", "mode", "gamma"),
    [
        (1e-3, 1e-1, 100, None, "triangular", 1.0),
        (0.01, 0.1, 20, 50, "triangular2", 1.0),
        (0.001, 0.006, 7, 3, "exp_range", 0.9995),
        (0.1, 0.05, 1, 1, "triangular", 1.0),
        (0.02, 0.2, 2000, 1000, "exp_range", 0.99995),
    ],
)
def test_cyclic(
    base: float, max_lr: float, up: int, down: int | None, mode: str, gamma: float
) -> None:
    expected = torch_lrs(
        0.5,
        lambda o: S.CyclicLR(
            o,
            base_lr=base,
            max_lr=max_lr,
            step_size_up=up,
            step_size_down=down,
            mode=mode,
            gamma=gamma,
            cycle_momentum=False,
        ),
    )
    assert_parity(Cyclic(base, max_lr, up, down, mode, gamma), expected, exact=True)


@pytest.mark.parametrize(
    ("max_lr", "total", "pct", "anneal", "div", "final_div"),
    [
        (0.1, 10_000, 0.3, "cos", 25.0, 1e4),
        (1.0, 1000, 0.25, "linear", 10.0, 100.0),
        (0.01, 7, 0.5, "cos", 25.0, 1e4),
        (0.5, 100, 0.005, "cos", 25.0, 1e4),  # warm-up shorter than one step
        (0.3, 2, 0.3, "linear", 3.0, 7.0),
    ],
)
def test_one_cycle(
    max_lr: float, total: int, pct: float, anneal: str, div: float, final_div: float
) -> None:
    # PyTorch defines the schedule on steps 0..total-1 (it extrapolates at step
    # `total` and raises after it); stagetree holds the final value from total-1 on.
    expected = torch_lrs(
        0.5,
        lambda o: S.OneCycleLR(
            o,
            max_lr=max_lr,
            total_steps=total,
            pct_start=pct,
            anneal_strategy=anneal,
            cycle_momentum=False,
            div_factor=div,
            final_div_factor=final_div,
            three_phase=False,
        ),
        n=total - 1,
    )
    seq = OneCycle(max_lr, total, pct, anneal, div, final_div)
    assert_parity(seq, expected, exact=True)
    assert seq.values(total - 1, total + 50) == [seq(total - 1)] * 51
