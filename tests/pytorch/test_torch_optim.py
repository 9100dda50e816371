"""set_optimizer_hp: values reach every param group; wrong names fail clearly."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch

from stagetree.torch import OPTIMIZER_HP, set_optimizer_hp

pytestmark = pytest.mark.torch


def params() -> list[dict[str, Any]]:
    return [
        {"params": [torch.nn.Parameter(torch.ones(3))]},
        {"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.5},
    ]


def test_sgd_values_reach_every_group_as_plain_floats() -> None:
    opt = torch.optim.SGD(params(), lr=0.1)
    set_optimizer_hp(
        opt, lr=np.float32(0.25), momentum=np.float64(0.9), weight_decay=1, dampening=0.1
    )
    for group in opt.param_groups:
        assert (group["lr"], group["momentum"], group["weight_decay"], group["dampening"]) == (
            0.25,
            pytest.approx(0.9),
            1.0,
            0.1,
        )
        assert all(type(group[k]) is float for k in ("lr", "momentum", "weight_decay"))


def test_a_changed_lr_is_what_the_next_step_uses() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    set_optimizer_hp(opt, lr=0.125)
    param.grad = torch.ones(1)
    opt.step()
    assert param.item() == -0.125


def test_adam_betas_whole_and_one_at_a_time() -> None:
    opt = torch.optim.Adam(params(), lr=0.1)
    set_optimizer_hp(opt, betas=[0.5, 0.6], eps=1e-5)
    assert [g["betas"] for g in opt.param_groups] == [(0.5, 0.6), (0.5, 0.6)]
    set_optimizer_hp(opt, beta2=0.7)
    set_optimizer_hp(opt, beta1=0.0)
    assert [g["betas"] for g in opt.param_groups] == [(0.0, 0.7), (0.0, 0.7)]
    assert opt.param_groups[0]["eps"] == 1e-5


def test_other_existing_entries_are_accepted() -> None:
    opt = torch.optim.RMSprop(params(), lr=0.1)
    set_optimizer_hp(opt, alpha=np.float64(0.5), momentum=0.3)
    assert opt.param_groups[1]["alpha"] == 0.5 and type(opt.param_groups[1]["alpha"]) is float


@pytest.mark.parametrize(
    ("make", "values", "message"),
    [
        (torch.optim.Adam, {"momentum": 0.9}, r"Adam has no hyper-parameter 'momentum'"),
        (torch.optim.SGD, {"betas": (0.9, 0.99)}, r"SGD has no hyper-parameter 'betas'"),
        (torch.optim.SGD, {"beta1": 0.9}, r"SGD has no hyper-parameter 'betas'"),
        (torch.optim.SGD, {"eps": 1e-8}, r"SGD has no hyper-parameter 'eps'"),
        (torch.optim.Adam, {"dampening": 0.1}, r"Adam has no hyper-parameter 'dampening'"),
        (torch.optim.SGD, {"params": []}, r"no hyper-parameter 'params'"),
        (torch.optim.SGD, {"lr": -0.1}, r"'lr' must be >= 0"),
        (torch.optim.SGD, {"lr": float("nan")}, r"'lr' must be finite"),
        (torch.optim.SGD, {"momentum": "high"}, r"'momentum' must be a number"),
        (torch.optim.SGD, {"weight_decay": True}, r"'weight_decay' must be a number"),
        (torch.optim.Adam, {"betas": (0.9, 1.0)}, r"'beta2' must be in \[0, 1\)"),
        (torch.optim.Adam, {"betas": 0.9}, r"'betas' must be a pair"),
        (torch.optim.Adam, {"betas": (0.9, 0.99), "beta1": 0.5}, r"either 'betas' or"),
    ],
)
def test_refusals_name_the_problem_and_write_nothing(
    make: Any, values: dict[str, Any], message: str
) -> None:
    opt = make(params(), lr=0.1)
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=message):
        # A valid lr goes along: it must not be written either.
        set_optimizer_hp(opt, **{"lr": 0.01, **values})
    assert [dict(g) for g in opt.param_groups] == before


def test_the_error_lists_what_the_optimizer_has() -> None:
    opt = torch.optim.Adam(params(), lr=0.1)
    with pytest.raises(ValueError, match="betas, capturable") as info:
        set_optimizer_hp(opt, momentum=0.9)
    assert "params" not in str(info.value)


def test_known_names() -> None:
    assert (
        frozenset({"lr", "momentum", "weight_decay", "betas", "beta1", "beta2", "dampening", "eps"})
        | {"rho"}  # Adadelta's (issue 25 item 6: it has a fused form)
        == OPTIMIZER_HP
    )


def test_rho_is_set_and_checked_on_adadelta() -> None:
    optimizer = torch.optim.Adadelta([torch.zeros(2, requires_grad=True)])
    set_optimizer_hp(optimizer, rho=0.5)
    assert optimizer.param_groups[0]["rho"] == 0.5
    with pytest.raises(ValueError, match="'rho' must be in \\[0, 1\\]"):
        set_optimizer_hp(optimizer, rho=1.5)
