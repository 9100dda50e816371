"""Fused optimizers (stagetree.torch.fused_optim): member b of a fused step is
torch.optim's step of that member alone, with its own hyper-parameters."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stagetree.torch.fused_optim import FusedAdadelta, FusedAdam, FusedSGD  # noqa: E402

pytestmark = pytest.mark.torch

SHAPES = {"w": (4, 3), "b": (3,)}
STEPS = 12


def _run(fused: Any, make_torch: Any, hps: list[dict[str, float]]) -> float:
    """Largest relative difference between the members of ``fused(params, **[B] hp)``
    and ``make_torch(params, hp)`` per member, over STEPS steps of random gradients
    (the same for both)."""
    gen = torch.Generator().manual_seed(0)
    B = len(hps)
    start = {k: torch.randn((B, *s), generator=gen) for k, s in SHAPES.items()}
    stacked = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    opt = fused(stacked, **{k: [hp[k] for hp in hps] for k in hps[0]})
    alone = []
    for b, hp in enumerate(hps):
        params = {k: v[b].clone().requires_grad_(True) for k, v in start.items()}
        alone.append((params, make_torch(list(params.values()), hp)))
    worst = 0.0
    for _ in range(STEPS):
        grads = {k: torch.randn((B, *s), generator=gen) for k, s in SHAPES.items()}
        for k, p in stacked.items():
            p.grad = grads[k].clone()
        opt.step()
        for b, (params, member) in enumerate(alone):
            for k, p in params.items():
                p.grad = grads[k][b].clone()
            member.step()
            for k, p in params.items():
                diff = (stacked[k][b].detach() - p.detach()).abs().max().item()
                worst = max(worst, diff / max(1.0, p.detach().abs().max().item()))
    return worst


SGD_HPS = [
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-4},
    {"lr": 0.05, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0},
    {"lr": 0.2, "momentum": 0.5, "dampening": 0.1, "weight_decay": 1e-3},
]


def test_sgd_members_follow_torch_sgd_with_their_own_values() -> None:
    worst = _run(FusedSGD, lambda ps, hp: torch.optim.SGD(ps, **hp), SGD_HPS)
    assert worst < 1e-6


def test_nesterov_members_follow_torch_sgd() -> None:
    hps = [{**hp, "dampening": 0.0} for hp in SGD_HPS if hp["momentum"] > 0]
    worst = _run(
        lambda ps, **hp: FusedSGD(ps, nesterov=True, **hp),
        lambda ps, hp: torch.optim.SGD(ps, nesterov=True, **hp),
        hps,
    )
    assert worst < 1e-6


@pytest.mark.parametrize(("decoupled", "cls"), [(False, "Adam"), (True, "AdamW")])
def test_adam_members_follow_torch_adam(decoupled: bool, cls: str) -> None:
    def make(params: Any, hp: dict[str, float]) -> Any:
        return getattr(torch.optim, cls)(
            params,
            lr=hp["lr"],
            betas=(hp["beta1"], hp["beta2"]),
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
        )

    hps = [
        {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
        {"lr": 3e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 1e-2},
        {"lr": 1e-2, "beta1": 0.95, "beta2": 0.9, "eps": 1e-8, "weight_decay": 0.1},
    ]
    worst = _run(lambda ps, **hp: FusedAdam(ps, decoupled=decoupled, **hp), make, hps)
    assert worst < 1e-6


ADADELTA_HPS = [
    {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0.0},
    {"lr": 0.5, "rho": 0.95, "eps": 1e-5, "weight_decay": 1e-2},
    {"lr": 2.0, "rho": 0.5, "eps": 1e-6, "weight_decay": 0.1},
]


def test_adadelta_members_follow_torch_adadelta() -> None:
    worst = _run(FusedAdadelta, lambda ps, hp: torch.optim.Adadelta(ps, **hp), ADADELTA_HPS)
    assert worst < 1e-6


def test_an_adadelta_member_leaves_with_torch_optims_state_and_comes_back() -> None:
    B = 2
    stacked = {"w": torch.randn(B, 5, requires_grad=True)}
    fused = FusedAdadelta(stacked, lr=[1.0, 0.5], rho=[0.9, 0.8])
    for _ in range(3):
        stacked["w"].grad = torch.randn(B, 5)
        fused.step()
    alone = _continues_alone(fused, stacked, lambda ps: torch.optim.Adadelta(ps, lr=0.5, rho=0.8))
    assert float(next(iter(alone.state.values()))["step"]) == 4.0
    other = FusedAdadelta({"w": torch.zeros(B, 5, requires_grad=True)}, lr=0.5, rho=0.8)
    other.load_member(0, fused.member_state(1))
    for key in ("square_avg", "acc_delta"):
        assert torch.equal(other.state["w"][key][0], fused.state["w"][key][1])
    assert other.steps[0] == fused.steps[1]


def _continues_alone(fused: Any, stacked: dict[str, Any], make: Any) -> Any:
    """Member 1 of ``fused`` leaves with its state into ``make([its weight])``; one more
    step of both with the same gradient lands on the same weight. Returns the optimizer."""
    weight = stacked["w"][1].detach().clone().requires_grad_(True)
    alone = make([weight])
    alone.load_state_dict(
        {
            "state": {0: fused.member_state(1)["w"]},
            "param_groups": alone.state_dict()["param_groups"],
        }
    )
    grad = torch.randn(stacked["w"].shape)
    stacked["w"].grad = grad.clone()
    fused.step()
    weight.grad = grad[1].clone()
    alone.step()
    torch.testing.assert_close(stacked["w"][1].detach(), weight.detach())
    return alone


def test_a_member_leaves_with_torch_optims_state_and_comes_back() -> None:
    B = 2
    stacked = {"w": torch.randn(B, 5, requires_grad=True)}
    fused = FusedSGD(stacked, lr=[0.1, 0.2], momentum=[0.9, 0.5])
    for _ in range(3):
        stacked["w"].grad = torch.randn(B, 5)
        fused.step()
    _continues_alone(fused, stacked, lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.5))
    other = FusedSGD({"w": torch.zeros(B, 5, requires_grad=True)}, lr=0.2, momentum=0.5)
    other.load_member(0, fused.member_state(1))
    torch.testing.assert_close(
        other.state["w"]["momentum_buffer"][0], fused.state["w"]["momentum_buffer"][1]
    )


@pytest.mark.parametrize("kind", ["sgd", "adam", "adadelta"])
def test_skipped_members_keep_their_weights_state_and_step_count(kind: str) -> None:
    """A GradScaler's overflow skips one member's step, as torch.optim skips it alone."""
    make = {
        "sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: FusedAdam(ps, lr=0.01),
        "adadelta": lambda ps: FusedAdadelta(ps),
    }[kind]
    gen = torch.Generator().manual_seed(1)
    stacked = {"w": torch.randn(3, 4, generator=gen, requires_grad=True)}
    reference = {"w": stacked["w"].detach().clone().requires_grad_(True)}
    fused, ref = make(stacked), make(reference)
    for step in range(4):
        grad = torch.randn(3, 4, generator=gen)
        stacked["w"].grad, reference["w"].grad = grad.clone(), grad.clone()
        skip = torch.tensor([False, step % 2 == 0, step == 0])
        before = {b: fused.member_state(b) for b in range(3)}
        weights = stacked["w"].detach().clone()
        fused.step(skip=skip)
        ref.step()  # every member steps; the skipped ones are compared to before
        for b in range(3):
            if skip[b]:
                assert torch.equal(stacked["w"][b], weights[b])
                assert str(fused.member_state(b)) == str(before[b])
    # Member 0 never skipped: it follows the reference that never did.
    assert torch.equal(stacked["w"][0], reference["w"][0])
    if kind != "sgd":
        assert fused.steps.tolist() == [4.0, 2.0, 3.0]


def test_bad_values_are_refused_by_name() -> None:
    p = {"w": torch.zeros(3, 2, requires_grad=True)}
    with pytest.raises(ValueError, match="lr: 2 values for 3 fused members"):
        FusedSGD(p, lr=[0.1, 0.2])
    with pytest.raises(ValueError, match="momentum must be finite and >= 0"):
        FusedSGD(p, momentum=[-1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="has no hyper-parameter \\['betas'\\]"):
        FusedSGD(p, betas=0.9)
    with pytest.raises(ValueError, match="beta1 must be < 1"):
        FusedAdam(p, beta1=1.0)
    with pytest.raises(ValueError, match="rho must be <= 1"):
        FusedAdadelta(p, rho=1.5)
