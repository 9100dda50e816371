"""Fused training (stagetree.torch.fused) on real training: B members of one digits
trainer trained as one vmapped job follow the members trained alone.

Fused and unfused runs agree up to floating-point reassociation, not bit for bit: the
batched kernels sum in another order, and training amplifies those roundings update
after update. Measured on the 2-core development CPU (torch 2.13, one thread; ``pytest
-s`` prints them), 4 members, 40 optimizer updates (20 steps of 2 minibatches):

=====================  ========  ========  ==========
run                    max abs   max rel   train loss
=====================  ========  ========  ==========
SGD+Nesterov+wd        3.0e-07   5.2e-07   4.8e-07
Adam / AdamW           3.3e-07   1.5e-05   9.5e-07
SGD, values changed    1.5e-07   3.3e-07   4.8e-07
CNN with BatchNorm     1.2e-07   9.4e-07   4.8e-07
Adadelta               1.2e-07   6.5e-07   4.8e-07
=====================  ========  ========  ==========

max abs: the largest difference of any weight, buffer or optimizer-state element; max
rel: the largest difference within a tensor over that tensor's largest magnitude (Adam's
is its ``exp_avg_sq``, of magnitude ~2e-5: 3e-10 apart). The bounds asserted are ~5x
these (:data:`BOUNDS`), 2x more on CUDA. Measured on an NVIDIA H100 (torch 2.11, CUDA
13; ``bash benchmarks/gpu_check.sh``): 3.6e-07 / 6.0e-07, 3.1e-07 / 1.4e-05, 1.8e-07 /
3.2e-07 and 2.8e-07 / 1.4e-06, train loss within 9.5e-07. Accuracies are equal.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from amp_digits import BiasFreeDigits, tensors  # noqa: E402 (tests/fakes, see conftest)

from stagetree.exceptions import FusionError  # noqa: E402
from stagetree.torch import FusibleTrainer, TorchFusedGroup  # noqa: E402
from stagetree.torch.examples import DigitsConvTrainer, DigitsTrainer  # noqa: E402
from stagetree.torch.fused_optim import FusedSGD  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("fused_vs_unfused_determinism")]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]
STEPS = 20
BASE = {"dropout": 0.0, "batches_per_step": 2, "hidden": 32}
#: (max abs, max rel) allowed on the CPU (see the module docstring).
BOUNDS = {"sgd": (2e-6, 3e-6), "adam": (2e-6, 1e-4), "bn": (1e-6, 5e-6), "amp": (2e-6, 1e-5)}


def within(device: str, kind: str, worst_abs: float, worst_rel: float) -> bool:
    factor = 1.0 if device == "cpu" else 2.0
    bound_abs, bound_rel = BOUNDS[kind]
    return worst_abs < bound_abs * factor and worst_rel < bound_rel * factor


class NesterovDigits(DigitsTrainer):
    """DigitsTrainer with SGD, Nesterov momentum and weight decay."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4
        )


class AdadeltaDigits(DigitsTrainer):
    """DigitsTrainer with Adadelta (weight decay 1e-4)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.optimizer = torch.optim.Adadelta(self.model.parameters(), weight_decay=1e-4)


class AmpDigits(BiasFreeDigits):
    """An MLP on the digits with automatic mixed precision: bfloat16 autocast on a CPU,
    float16 and a GradScaler on CUDA. Its layers have no bias (see BiasFreeDigits)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.enable_amp()


class ScaledAmpDigits(AmpDigits):
    """float16 autocast with a GradScaler (on a CPU too) whose first scale overflows at
    once and that grows after 3 good steps: skipped steps, backoff and growth."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.enable_amp(torch.float16, scaler=True, init_scale=2.0**40, growth_interval=3)


class AmpConvDigits(DigitsConvTrainer):
    """The CNN with BatchNorm, with automatic mixed precision."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.enable_amp()


# -- harness ------------------------------------------------------------------------------

Schedule = Callable[[int, int], dict[str, Any]]  # (member, step) -> setup values or {}


def train_fused(
    cls: type[FusibleTrainer], config: Mapping[str, Any], schedule: Schedule, size: int
) -> tuple[TorchFusedGroup, list[list[dict[str, float]]]]:
    members = [cls(config) for _ in range(size)]
    group = cls.fuse(members)
    metrics: list[list[dict[str, float]]] = []
    for step in range(STEPS):
        for i in range(size):
            hp = schedule(i, step)
            if hp:
                group.setup(i, hp)
        metrics.append(group.step())
    return group, metrics


def train_alone(
    cls: type[FusibleTrainer], config: Mapping[str, Any], schedule: Schedule, i: int
) -> tuple[FusibleTrainer, list[dict[str, float]]]:
    trainer = cls(config)
    metrics = []
    for step in range(STEPS):
        hp = schedule(i, step)
        if hp:
            trainer.setup(hp)
        metrics.append(trainer.train())
    return trainer, metrics


def structure(state: Any) -> list[tuple[str, Any]]:
    """A state tree's paths with each leaf's kind (tensors: dtype, shape, device)."""
    return [
        (path, (v.dtype, tuple(v.shape), v.device.type))
        if isinstance(v, torch.Tensor)
        else (path, type(v).__name__)
        for path, v in tensors(state)
    ]


def difference(fused: FusibleTrainer, alone: FusibleTrainer) -> tuple[float, float]:
    """(max abs, max rel) difference of the weights, buffers and optimizer state; the
    rest of the state (loader, RNG streams, modes) must be equal."""
    a, b = fused.state_dict(), alone.state_dict()
    assert structure(a) == structure(b)
    worst_abs = worst_rel = 0.0
    for (path, x), (_, y) in zip(tensors(a), tensors(b)):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            d = (x - y).abs().max().item() if x.numel() else 0.0
            worst_abs = max(worst_abs, d)
            worst_rel = max(worst_rel, d / max(y.abs().max().item(), 1e-12))
        elif not isinstance(x, torch.Tensor):
            assert x == y, path
        else:  # RNG states, BatchNorm's num_batches_tracked
            assert torch.equal(x, y), path
    return worst_abs, worst_rel


def compare(
    cls: type[FusibleTrainer],
    config: Mapping[str, Any],
    schedule: Schedule,
    size: int,
    label: str,
) -> tuple[float, float]:
    group, fused_metrics = train_fused(cls, config, schedule, size)
    worst_abs = worst_rel = worst_loss = 0.0
    for i in range(size):
        alone, alone_metrics = train_alone(cls, config, schedule, i)
        group.sync(i)
        member = group.members[i]
        assert isinstance(member, FusibleTrainer)
        d_abs, d_rel = difference(member, alone)
        worst_abs, worst_rel = max(worst_abs, d_abs), max(worst_rel, d_rel)
        for step in range(STEPS):
            loss_f = fused_metrics[step][i]["train_loss"]
            loss_a = alone_metrics[step]["train_loss"]
            worst_loss = max(worst_loss, abs(loss_f - loss_a))
        got, want = member.evaluate(), alone.evaluate()
        assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-3)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    print(f"\n{label}: max abs {worst_abs:.2e}, max rel {worst_rel:.2e}, loss {worst_loss:.2e}")
    assert worst_loss < 1e-4
    return worst_abs, worst_rel


# -- fused == unfused ---------------------------------------------------------------------

SGD_HP = [
    {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0},
    {"lr": 0.03, "momentum": 0.8, "weight_decay": 1e-3},
    {"lr": 0.1, "momentum": 0.5, "weight_decay": 1e-4},
    {"lr": 0.2, "momentum": 0.9, "weight_decay": 1e-2},
]
ADAM_HP = [
    {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
    {"lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 1e-2, "eps": 1e-6},
    {"lr": 1e-2, "betas": (0.95, 0.9), "weight_decay": 1e-3},
    {"lr": 3e-4, "betas": (0.5, 0.999), "weight_decay": 0.1},
]


def at_start(values: Sequence[dict[str, Any]]) -> Schedule:
    return lambda i, step: dict(values[i]) if step == 0 else {}


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_nesterov_members_match_unfused(device: str) -> None:
    worst_abs, worst_rel = compare(
        NesterovDigits, {**BASE, "device": device}, at_start(SGD_HP), 4, "SGD+Nesterov"
    )
    assert within(device, "sgd", worst_abs, worst_rel)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_members_match_unfused(device: str, optimizer: str) -> None:
    config = {**BASE, "optimizer": optimizer, "device": device}
    worst_abs, worst_rel = compare(DigitsTrainer, config, at_start(ADAM_HP), 4, optimizer)
    assert within(device, "adam", worst_abs, worst_rel)


ADADELTA_HP = [
    {"lr": 1.0, "rho": 0.9},
    {"lr": 0.5, "rho": 0.95, "eps": 1e-5},
    {"lr": 2.0, "rho": 0.8, "weight_decay": 1e-3},
    {"lr": 0.1, "rho": 0.5},
]


@pytest.mark.parametrize("device", DEVICES)
def test_adadelta_members_match_unfused(device: str) -> None:
    """Adadelta has a fused form (it fell back to training one by one before)."""
    config = {**BASE, "device": device}
    worst_abs, worst_rel = compare(AdadeltaDigits, config, at_start(ADADELTA_HP), 4, "Adadelta")
    assert within(device, "sgd", worst_abs, worst_rel)


AMP_HP = [{"lr": 0.01}, {"lr": 0.03}, {"lr": 0.05}, {"lr": 0.1}]


@pytest.mark.parametrize("cls", [AmpDigits, ScaledAmpDigits])
def test_amp_members_match_members_trained_alone_with_amp(cls: type[AmpDigits]) -> None:
    """Mixed precision inside a fused job: bfloat16 autocast, or float16 with a
    GradScaler per member (skipped steps, backoff and growth included; the scalers'
    states are compared exactly), gives each member what it gets trained alone with the
    same settings (CPU: batched products round as the member's own)."""
    worst_abs, worst_rel = compare(cls, dict(BASE), at_start(AMP_HP), 4, "AMP")
    assert within("cpu", "amp", worst_abs, worst_rel)


def within_amp_rounding(cls: type[FusibleTrainer], config: Mapping[str, Any]) -> None:
    """Fused members against members alone where batched low-precision kernels round
    differently: train losses within 1e-02 at every step, evaluation losses within 5 %."""
    group, fused_metrics = train_fused(cls, config, at_start(AMP_HP), 4)
    for i in range(4):
        alone, alone_metrics = train_alone(cls, config, at_start(AMP_HP), i)
        group.sync(i)
        for step in range(STEPS):
            got, want = fused_metrics[step][i]["train_loss"], alone_metrics[step]["train_loss"]
            assert got == pytest.approx(want, abs=1e-2)
        got_eval, want_eval = group.members[i].evaluate(), alone.evaluate()
        assert got_eval["loss"] == pytest.approx(want_eval["loss"], rel=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_amp_members_on_cuda_stay_within_float16_rounding() -> None:
    """float16 and a GradScaler per member on CUDA, where batched GEMMs may round their
    float16 results differently from the member's own."""
    within_amp_rounding(AmpDigits, {**BASE, "device": "cuda"})


def test_amp_with_convolutions_and_batchnorm_stays_within_bfloat16_rounding() -> None:
    """Batched bfloat16 convolutions and a linear layer's bias round their results
    differently from the member's own (gradients ~2^-8 apart after one update: bfloat16's
    precision), and training carries it: measured after 40 updates, train losses within
    2.4e-03, evaluation losses within 1.9 % (the member at lr 0.1), 0.05 % for the others."""
    within_amp_rounding(AmpConvDigits, {"batches_per_step": 2})


def test_an_amp_trainer_runs_autocast_and_checkpoints_its_scaler() -> None:
    trainer = ScaledAmpDigits(dict(BASE))
    assert trainer.amp == ("cpu", torch.float16)
    assert "grad_scaler" in trainer.checkpointed_objects()
    trainer.train()
    assert trainer.grad_scaler.get_scale() < 2.0**40  # the first steps overflowed
    again = ScaledAmpDigits(dict(BASE))
    again.load_state_dict(trainer.state_dict())
    assert again.grad_scaler.state_dict() == trainer.grad_scaler.state_dict()
    assert AmpDigits(dict(BASE)).amp == ("cpu", torch.bfloat16)
    assert "grad_scaler" not in AmpDigits(dict(BASE)).checkpointed_objects()


@pytest.mark.parametrize("device", DEVICES)
def test_values_changed_mid_run_match_unfused(device: str) -> None:
    """New lr for some members at step 5, momentum from 0 to 0.9 and back for one, and
    a new batch size (not fusible: the same for all) at step 10."""

    def schedule(i: int, step: int) -> dict[str, Any]:
        hp: dict[str, Any] = {}
        if step == 0:
            hp = {"lr": [0.02, 0.05, 0.1][i], "momentum": [0.0, 0.9, 0.5][i]}
        if step == 5 and i != 1:
            hp["lr"] = 0.3 / (i + 1)
        if i == 0 and step in (5, 12):
            hp["momentum"] = 0.9 if step == 5 else 0.0
        if step == 10:
            hp["batch_size"] = 48
        return hp

    worst_abs, worst_rel = compare(
        DigitsTrainer, {**BASE, "device": device}, schedule, 3, "SGD, values changed"
    )
    assert within(device, "sgd", worst_abs, worst_rel)


@pytest.mark.parametrize("device", DEVICES)
def test_batchnorm_running_stats_stay_per_member(device: str) -> None:
    config = {"channels": 4, "batches_per_step": 1, "optimizer": "momentum", "device": device}
    hp = [{"lr": lr} for lr in (0.01, 0.03, 0.1)]
    # difference() covers running_mean / running_var (and num_batches_tracked exactly).
    worst_abs, worst_rel = compare(DigitsConvTrainer, config, at_start(hp), 3, "BatchNorm")
    assert within(device, "bn", worst_abs, worst_rel)


class TiedDigits(DigitsTrainer):
    """Two hidden layers sharing one weight matrix."""

    def build_model(self, c: Mapping[str, Any]) -> torch.nn.Module:
        hidden = torch.nn.Linear(32, 32)
        tied = torch.nn.Linear(32, 32)
        tied.weight = hidden.weight
        return torch.nn.Sequential(
            torch.nn.Linear(64, 32),
            torch.nn.ReLU(),
            hidden,
            torch.nn.ReLU(),
            tied,
            torch.nn.ReLU(),
            torch.nn.Linear(32, 10),
        )


def test_tied_weights_stay_tied() -> None:
    config = {**BASE, "optimizer": "momentum"}
    worst_abs, worst_rel = compare(TiedDigits, config, at_start(SGD_HP[:2]), 2, "tied")
    assert within("cpu", "sgd", worst_abs, worst_rel)


def test_dropout_masks_are_independent_per_member() -> None:
    config = {**BASE, "dropout": 0.3, "optimizer": "momentum"}
    members = [DigitsTrainer(config) for _ in range(3)]
    before = members[0].evaluate()["loss"]
    group = DigitsTrainer.fuse(members)
    for i in range(3):
        group.setup(i, {"lr": 0.05})  # the same values: only the masks differ
    first = group.step()
    for _ in range(STEPS):
        last = group.step()
    weights = []
    for i in range(3):
        group.sync(i)
        weights.append(members[i].model[0].weight.detach().clone())
        assert last[i]["train_loss"] < 0.7 * first[i]["train_loss"]
        assert members[i].evaluate()["loss"] < 0.7 * before
    assert not torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[1], weights[2])


# -- leaving the fused job ----------------------------------------------------------------


def roundtrip(state: Mapping[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same(a: Any, b: Any) -> None:
    assert structure(a) == structure(b)
    for (path, x), (_, y) in zip(tensors(a), tensors(b)):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), path
        else:
            assert x == y, path


@pytest.mark.parametrize("optimizer", ["momentum", "sgd", "adam"])
def test_a_synced_member_continues_as_an_ordinary_trainer(optimizer: str) -> None:
    config = {**BASE, "optimizer": optimizer}
    members = [DigitsTrainer(config) for _ in range(3)]
    group = DigitsTrainer.fuse(members)
    for i, lr in enumerate([0.01, 0.05, 0.02]):
        group.setup(i, {"lr": lr * (0.1 if optimizer == "adam" else 1)})
    for _ in range(5):
        group.step()
    group.sync(1)
    group.sync(1)  # nothing to do the second time
    state = roundtrip(members[1].state_dict())

    unfused = DigitsTrainer(config)
    unfused.setup({"lr": 0.05 * (0.1 if optimizer == "adam" else 1)})
    for _ in range(5):
        unfused.train()
    # Exactly the layout of an unfused trainer's state (optimizer state included).
    assert structure(state) == structure(roundtrip(unfused.state_dict()))

    fresh = DigitsTrainer(config)
    fresh.load_state_dict(state)
    fresh.setup({"lr": 0.05 * (0.1 if optimizer == "adam" else 1)})
    group.step()  # training the others goes on; member 1's trainer is left alone
    assert_same(roundtrip(members[1].state_dict()), state)
    for _ in range(3):
        assert fresh.train() == members[1].train()
    assert_same(fresh.state_dict(), members[1].state_dict())


def test_a_sync_for_evaluation_leaves_the_optimizer_out() -> None:
    """``sync(i, optimizer=False)``: what ``evaluate()`` sees (the same metrics as a full
    sync), without the optimizer state; a full sync afterwards adds it."""
    members = [DigitsTrainer({**BASE, "optimizer": "momentum"}) for _ in range(2)]
    group = DigitsTrainer.fuse(members)
    for i, lr in enumerate([0.01, 0.05]):
        group.setup(i, {"lr": lr})
    for _ in range(3):
        group.step()
    before = roundtrip(members[1].optimizer.state_dict())
    group.sync(1, optimizer=False)
    light = members[1].evaluate()
    assert_same(roundtrip(members[1].optimizer.state_dict()), before)  # left out
    group.sync(1)
    assert members[1].evaluate() == light
    assert structure(roundtrip(members[1].optimizer.state_dict())) != structure(before)


def test_remove_keeps_the_others_in_step() -> None:
    hp = SGD_HP[:3]
    config = {**BASE, "optimizer": "momentum"}
    members = [DigitsTrainer(config) for _ in range(3)]
    group = DigitsTrainer.fuse(members)
    for i in range(3):
        group.setup(i, hp[i])
    for _ in range(5):
        group.step()
    group.sync(2)  # synced before the removal: indices shift, the flag too
    removed = group.remove(1)
    assert removed is members[1]
    assert list(group.members) == [members[0], members[2]]
    for _ in range(STEPS - 5):
        group.step()
        removed.train()
    for i, j in [(0, 0), (1, 2)]:
        group.sync(i)
        alone, _ = train_alone(DigitsTrainer, config, at_start(hp), j)
        assert max(difference(members[j], alone)) < 1e-6
    alone, _ = train_alone(DigitsTrainer, config, at_start(hp), 1)
    assert max(difference(removed, alone)) < 1e-6
    assert group.remove(0) is members[0]
    assert group.remove(0) is members[2]
    assert group.step() == []


# -- what cannot be fused -----------------------------------------------------------------


class CallsItem(DigitsTrainer):
    def loss(self, batch: Any) -> Any:
        loss = super().loss(batch)
        self.last = loss.item()  # fine alone, not under vmap
        return loss


class WritesShared(DigitsTrainer):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.seen = torch.zeros(())

    def loss(self, batch: Any) -> Any:
        loss = super().loss(batch)
        self.seen.add_(loss.detach())  # one tensor for all members: per-member values
        return loss


class FailsLater(DigitsTrainer):
    calls = 0

    def loss(self, batch: Any) -> Any:
        type(self).calls += 1
        if type(self).calls > 4:
            raise KeyError("a bug of the trainer")
        return super().loss(batch)


class OwnLoop(DigitsTrainer):
    def train(self) -> dict[str, float]:
        return super().train()


class WithRMSprop(DigitsTrainer):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.optimizer = torch.optim.RMSprop(self.model.parameters(), lr=0.01)


class WithAmsgrad(DigitsTrainer):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.optimizer = torch.optim.Adam(self.model.parameters(), amsgrad=True)


class TwoGroups(DigitsTrainer):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        first, *rest = self.model.parameters()
        self.optimizer = torch.optim.SGD([{"params": [first]}, {"params": rest}], lr=0.1)


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (CallsItem, r"CallsItem cannot be fused: RuntimeError: .*\.item\(\)"),
        (WritesShared, "WritesShared cannot be fused: RuntimeError"),
    ],
)
def test_a_loss_vmap_refuses_fails_on_the_first_step(cls: type[DigitsTrainer], match: str) -> None:
    members = [cls(BASE), cls(BASE)]
    group = cls.fuse(members)
    with pytest.raises(FusionError, match=match):
        group.step()
    assert "train_loss" in members[0].train()  # the members train alone as before


def test_later_failures_propagate_unchanged() -> None:
    group = FailsLater.fuse([FailsLater(BASE), FailsLater(BASE)])
    group.step()  # 2 updates
    group.step()
    with pytest.raises(KeyError, match="a bug of the trainer"):
        group.step()


class LooseParameter(DigitsTrainer):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.scale = torch.nn.Parameter(torch.ones(()))
        params = [*self.model.parameters(), self.scale]
        self.optimizer = torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (OwnLoop, "OwnLoop overrides train()"),
        (LooseParameter, "a parameter of shape \\(\\) that no checkpointed module holds"),
        (WithRMSprop, "RMSprop has no fused form"),
        (WithAmsgrad, r"Adam\(amsgrad=True\) has no fused form"),
        (TwoGroups, "2 param groups"),
    ],
)
def test_unfusible_trainers_are_refused_by_fuse(cls: type[DigitsTrainer], match: str) -> None:
    with pytest.raises(FusionError, match=match):
        cls.fuse([cls(BASE), cls(BASE)])
    # A trainer with its own loop says so up front; the others find out in fuse().
    assert (cls.fusible == frozenset()) == (cls is OwnLoop)


def test_members_must_share_class_and_config() -> None:
    with pytest.raises(FusionError, match="share their config"):
        DigitsTrainer.fuse([DigitsTrainer(BASE), DigitsTrainer({**BASE, "seed": 1})])
    with pytest.raises(FusionError, match="one class"):
        DigitsTrainer.fuse([DigitsTrainer(BASE), NesterovDigits(BASE)])
    with pytest.raises(FusionError, match="at least one member"):
        DigitsTrainer.fuse([])


def test_members_must_share_values_that_are_not_fusible() -> None:
    group = DigitsTrainer.fuse([DigitsTrainer(BASE), DigitsTrainer(BASE)])
    group.setup(0, {"lr": 0.1, "batch_size": 16})
    group.setup(1, {"lr": 0.2, "batch_size": 64})
    with pytest.raises(ValueError, match="must share 'batch_size'"):
        group.step()


def test_default_loop_needs_one_loader_and_one_optimizer() -> None:
    class TwoLoaders(DigitsTrainer):
        def __init__(self, config: Mapping[str, Any]) -> None:
            super().__init__(config)
            self.other = self.loader.__class__(self.x_test, batch_size=4, seed=0)

    with pytest.raises(ValueError, match="has 2; override next_batch"):
        TwoLoaders(BASE).train()


# -- the fused optimizer when momentum comes and goes -------------------------------------


def test_fused_sgd_follows_torch_when_momentum_goes_to_zero_and_back() -> None:
    gen = torch.Generator().manual_seed(0)
    schedule = [[0.0, 0.9, 0.5], [0.9, 0.0, 0.5], [0.9, 0.9, 0.0], [0.0, 0.9, 0.5]]
    dampening = [0.0, 0.1, 0.0]
    start = torch.randn(3, 5, generator=gen)
    stacked = {"w": start.clone().requires_grad_(True)}
    fused = FusedSGD(stacked, lr=0.1, momentum=schedule[0], dampening=dampening)
    alone = []
    for b in range(3):
        w = start[b].clone().requires_grad_(True)
        alone.append((w, torch.optim.SGD([w], lr=0.1, momentum=0.5, dampening=dampening[b])))
    for k in range(12):
        fused.set_hp("momentum", schedule[k % 4])
        grad = torch.randn(3, 5, generator=gen)
        stacked["w"].grad = grad.clone()
        fused.step()
        for b, (w, optimizer) in enumerate(alone):
            optimizer.param_groups[0]["momentum"] = schedule[k % 4][b]
            w.grad = grad[b].clone()
            optimizer.step()
            torch.testing.assert_close(stacked["w"][b].detach(), w.detach())
    for b, (_, optimizer) in enumerate(alone):
        state = optimizer.state_dict()["state"]
        member = fused.member_state(b)
        assert set(member) == ({"w"} if state else set())
        if state:
            torch.testing.assert_close(member["w"]["momentum_buffer"], state[0]["momentum_buffer"])
    # A member that never had momentum has no state, as in torch.optim.
    never = FusedSGD({"w": torch.zeros(2, 3, requires_grad=True)}, momentum=[0.0, 0.9])
    never.params["w"].grad = torch.ones(2, 3)
    never.step()
    plain = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
    plain.param_groups[0]["params"][0].grad = torch.ones(3)
    plain.step()
    expected = {"w": {"momentum_buffer": None}} if plain.state_dict()["state"] else {}
    assert never.member_state(0) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_the_width_a_device_holds(device: str) -> None:
    """On a CPU no limit; on CUDA a positive estimate that shrinks as the model grows."""
    small = DigitsTrainer({**BASE, "device": device}).fused_width_limit()
    if device == "cpu":
        assert small is None
        return
    big = DigitsTrainer({**BASE, "hidden": 2048, "device": device}).fused_width_limit()
    assert small is not None and big is not None and 1 <= big < small


# ------------------------------------------------------------------ through a Study


def _study_grid(
    trainer: type, fuse: bool, quiet: bool = True, fused: bool | None = None
) -> list[dict[str, float]]:
    """Three learning rates after 3 shared steps, 8 steps each, in one process;
    ``fused``: whether the job trains fused (default: ``fuse``)."""
    import warnings

    from study_trainers import submit_together

    from stagetree import Study
    from stagetree.hp import Piecewise

    config = {"dropout": 0.0, "batches_per_step": 2, "hidden": 32}
    trials = [(config, {"lr": Piecewise([0.05, lr], [3])}) for lr in (0.02, 0.05, 0.1)]
    with Study("grid", trainer, storage="memory://", executor="inline", fuse=fuse) as study:
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            results = submit_together(study, trials, 8)
        stats = study.stats()
        fused_job = fuse if fused is None else fused
        assert stats["fused_jobs"] == (1 if fused_job else 0)
        assert stats.get("fused_members", 0) == (3 if fused_job else 0)
    return [r.metrics for r in results]


def test_a_fused_study_gives_the_unfused_results_within_the_tolerance() -> None:
    fused, exact = _study_grid(DigitsTrainer, True), _study_grid(DigitsTrainer, False)
    for got, want in zip(fused, exact):
        assert got["accuracy"] == want["accuracy"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_a_study_whose_trainer_cannot_be_vmapped_warns_once_and_trains_unfused() -> None:
    from stagetree.exceptions import StagetreeWarning

    with pytest.warns(StagetreeWarning, match=r"CallsItem cannot be trained fused") as said:
        fused = _study_grid(CallsItem, True, quiet=False, fused=False)  # fell back
    assert len([w for w in said if issubclass(w.category, StagetreeWarning)]) <= 1
    assert fused == _study_grid(CallsItem, False)  # trained unfused: exactly


class OutOfMemoryWhenFused(DigitsTrainer):
    """Runs out of (CUDA) memory in a fused step, as a job too wide for its device
    does; trains normally alone."""

    def loss(self, batch: Any) -> Any:
        weight = next(self.model.parameters())
        if torch._C._functorch.is_batchedtensor(weight):  # inside the fused vmap
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return super().loss(batch)


def test_out_of_memory_in_the_first_fused_step_is_not_a_fusion_error() -> None:
    """Seen on an H100 (issue 26): a fused ResNet-18 job too wide for the device was
    reported as "cannot be fused" (FusionError) on its first step; it is too wide, and
    the out-of-memory error goes up as it is."""
    members = [OutOfMemoryWhenFused(dict(BASE)) for _ in range(3)]
    group = OutOfMemoryWhenFused.fuse(members)
    for i in range(3):
        group.setup(i, {"lr": 0.05})
    with pytest.raises(torch.cuda.OutOfMemoryError):
        group.step()


def test_a_fused_job_out_of_memory_trains_unfused_and_fusion_is_not_given_up() -> None:
    import warnings

    from stagetree.exceptions import StagetreeWarning

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fused = _study_grid(OutOfMemoryWhenFused, True, quiet=False)
    assert not [w for w in said if issubclass(w.category, StagetreeWarning)]
    assert fused == _study_grid(OutOfMemoryWhenFused, False)  # trained unfused: exactly
