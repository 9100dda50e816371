"""Loss scaling inside fused jobs (:class:`stagetree.torch.amp.MemberScales` and the fused
optimizers' masked step): each member keeps its own ``GradScaler`` semantics, and the
fused step never waits for the device to tell the host which member overflowed.

A member whose gradients overflow skips its update (parameters, optimizer state, step
count) and backs its scale off while the others step and grow theirs; each member is
compared with the same member trained alone with ``torch.amp.GradScaler``. The sync
test counts the scalar reads (``.item()``, ``bool()``...) of a fused step: on an
accelerator each one waits for every kernel queued before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from amp_digits import BiasFreeDigits, cuda_syncs, tensors  # noqa: E402 (tests/fakes)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from stagetree.torch import FusibleTrainer  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("fused_vs_unfused_determinism")]

STEPS = 12
#: member -> its GradScaler's first scale: member 0's float16 gradients overflow for
#: ~25 updates (it skips them, halving its scale) while the others step, and grow their
#: scale every 3 good updates until they overflow in turn.
INIT_SCALES = (2.0**40, 2.0**12, 2.0**4)
LRS = (0.01, 0.03, 0.1)
#: Adam's: its normalised steps carry float16's rounding further.
ADAM_LRS = (1e-4, 3e-4, 1e-3)


class OverflowDigits(BiasFreeDigits):
    """The digits MLP (no biases) with float16 autocast and a GradScaler on any device;
    :attr:`rule` picks the optimizer (its fused rule)."""

    rule = "momentum"
    scaled = True  #: a GradScaler (else float16 autocast alone)

    def __init__(self, config: Mapping[str, Any]) -> None:
        kind = self.rule
        super().__init__({**config, "optimizer": kind if kind in ("momentum", "adam") else "sgd"})
        params = self.model.parameters()
        if kind == "sgd-dampening":  # the buffer's start depends on who stepped
            self.optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.3)
        elif kind == "nesterov":
            self.optimizer = torch.optim.SGD(
                params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
            )
        elif kind == "adamw":
            self.optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)
        elif kind == "adadelta":
            self.optimizer = torch.optim.Adadelta(params, weight_decay=1e-4)
        self.enable_amp(torch.float16, scaler=self.scaled, growth_interval=3)


RULES = {
    rule: type(f"OverflowDigits_{rule}", (OverflowDigits,), {"rule": rule})
    for rule in ("momentum", "nesterov", "sgd-dampening", "adam", "adamw", "adadelta")
}
#: float16 autocast without loss scaling (the reference of the sync count).
Unscaled = type("UnscaledDigits", (OverflowDigits,), {"scaled": False})


def make(config: Mapping[str, Any], i: int, rule: str = "momentum") -> OverflowDigits:
    """Member ``i`` with ``rule``: its own first loss scale and learning rate."""
    trainer = RULES[rule](config) if rule in RULES else Unscaled(config)
    if trainer.scaled:
        trainer.enable_amp(torch.float16, scaler=True, init_scale=INIT_SCALES[i], growth_interval=3)
    trainer.setup({"lr": (ADAM_LRS if rule.startswith("adam") else LRS)[i]})
    return trainer


@pytest.mark.parametrize("rule", list(RULES))
def test_a_member_that_overflows_skips_alone_as_with_its_own_grad_scaler(rule: str) -> None:
    config = {"dropout": 0.0, "batches_per_step": 2, "hidden": 32}
    members = [make(config, i, rule) for i in range(len(INIT_SCALES))]
    group = RULES[rule].fuse(members)
    fused_losses = [group.step() for _ in range(STEPS)]
    for i in range(len(INIT_SCALES)):
        alone = make(config, i, rule)
        alone_losses = [alone.train() for _ in range(STEPS)]
        group.sync(i)
        member = group.members[i]
        assert isinstance(member, FusibleTrainer)
        # The scale, its growth tracker: exactly GradScaler's.
        assert member.grad_scaler.state_dict() == alone.grad_scaler.state_dict(), i
        got, want = dict(tensors(member.state_dict())), dict(tensors(alone.state_dict()))
        assert got.keys() == want.keys(), i  # the same optimizer state (steps skipped)
        for path, x in got.items():
            y = want[path]
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim():
                # float16 products batched round as the member's own but for
                # reassociation (the same figures as before the masked step); a step
                # taken or skipped wrongly moves a weight by ~lr * gradient, far more.
                bound = 2e-5 + 2e-4 * float(y.abs().max())
                assert float((x - y).abs().max()) <= bound, (i, path)
            elif isinstance(x, torch.Tensor):  # Adam's step count (skips uncounted), RNGs
                assert torch.equal(x, y), (i, path)
            else:
                assert x == y, (i, path)
        for step in range(STEPS):
            assert fused_losses[step][i]["train_loss"] == pytest.approx(
                alone_losses[step]["train_loss"], abs=1e-5
            )
    # Member 0 skipped its first updates while the others stepped.
    assert members[0].grad_scaler.get_scale() < INIT_SCALES[0] / 2**10


class ScalarReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (``.item()``, ``bool()``,
    ``int()``, ``nonzero``, boolean-mask indexing): on an accelerator, each waits for the
    device."""

    READS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rule", ["momentum", "sgd-dampening", "adam", "adadelta"])
def test_a_fused_amp_step_reads_no_value_on_the_host(rule: str) -> None:
    """Loss scaling, the overflow check, the skipped members and the optimizer step all
    stay on the device: a fused step with a GradScaler per member, one overflowing,
    reads no tensor value on the host (its losses are read once, at the end, as a list:
    not an op the dispatcher sees)."""
    config = {"dropout": 0.0, "batches_per_step": 2, "hidden": 16}
    group = RULES[rule].fuse([make(config, i, rule) for i in range(len(INIT_SCALES))])
    group.step()  # the first step caches the values' facts (per hyper-parameter change)
    with ScalarReads() as reads:
        group.step()
        group.step()
    assert reads.count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_loss_scaling_adds_no_synchronisation() -> None:
    """On CUDA, ``torch.cuda.set_sync_debug_mode`` counts what waits for the device: a
    fused step with a GradScaler per member waits as often as one without (its losses'
    read, and the loader's)."""

    def syncs(rule: str) -> int:
        config = {"dropout": 0.0, "batches_per_step": 2, "hidden": 16, "device": "cuda"}
        group = OverflowDigits.fuse([make(config, i, rule) for i in range(len(INIT_SCALES))])
        group.step()
        return cuda_syncs(group.step)

    assert syncs("momentum") <= syncs("unscaled")


def _optimizers() -> list[tuple[str, Any, dict[str, Any]]]:
    from stagetree.torch.fused_optim import FusedAdadelta, FusedAdam, FusedSGD

    return [
        ("sgd", FusedSGD, {"lr": [0.1, 0.2, 0.3]}),
        ("momentum", FusedSGD, {"lr": [0.1, 0.2, 0.3], "momentum": 0.9}),
        ("nesterov", lambda p, **hp: FusedSGD(p, nesterov=True, **hp), {"momentum": 0.8}),
        ("adam", FusedAdam, {"lr": [1e-3, 2e-3, 3e-3], "beta1": [0.9, 0.8, 0.5]}),
        ("adadelta", FusedAdadelta, {"rho": [0.9, 0.95, 0.5]}),
    ]


@pytest.mark.parametrize("index", range(5))
def test_a_step_over_all_parameters_side_by_side_equals_steps_per_parameter(index: int) -> None:
    """The flat step (every parameter's columns of one ``[B, width]`` tensor) gives the
    per-parameter step's values bit for bit, masks included, and the same state."""
    _, rule, hp = _optimizers()[index]
    gen = torch.Generator().manual_seed(index)
    shapes = [(3, 4, 2, 2), (3, 4), (3, 7)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    runs = []
    for flat in (True, False):
        params = {f"p{i}": t.clone().requires_grad_(True) for i, t in enumerate(start)}
        opt = rule(params, **hp)
        opt.flat = flat
        gen.manual_seed(100 + index)
        for step in range(6):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen)
            assert (opt.flat_grad() is not None) == flat
            skip = torch.tensor([step % 3 == 1, step == 0, False])
            opt.step(skip=skip if step % 2 else None)
        runs.append((params, opt))
    (fp, fo), (pp, po) = runs
    for name in fp:
        assert torch.equal(fp[name], pp[name]), name
    for b in range(3):
        got, want = dict(tensors(fo.member_state(b))), dict(tensors(po.member_state(b)))
        assert got.keys() == want.keys()
        for path, x in got.items():
            assert torch.equal(x, want[path]) if isinstance(x, torch.Tensor) else x == want[path]


def test_the_overflow_check_flags_exactly_the_members_with_an_inf_or_a_nan() -> None:
    """Side by side or per parameter: a member is flagged iff one of its gradients holds
    an inf or a NaN (huge finite values that would overflow a float32 sum are not), and
    the others are unscaled as ``GradScaler`` unscales them (times 1/scale in float32)."""
    from stagetree.torch.amp import MemberScales

    scalers = [torch.amp.GradScaler("cpu", init_scale=s) for s in (2.0**16, 3.0, 2.0**-3, 1.0)]
    big = torch.finfo(torch.float32).max
    grads = [torch.randn(4, 3, 5), torch.randn(4, 6)]
    grads[0][0, 1, 2] = float("inf")
    grads[1][1, 3] = float("nan")
    grads[0][2].fill_(big)  # finite: sums to more than float32 holds
    grads[1][3, 0], grads[1][3, 1] = float("inf"), float("-inf")
    want = [g.clone() for g in grads]
    for g, scaler in zip(zip(*want), scalers):  # member by member, as a GradScaler would
        inv = torch.full((), scaler.get_scale(), dtype=torch.float64).reciprocal().float()
        for part in g:
            part.mul_(inv)
    flat = torch.cat([g.reshape(4, -1) for g in grads], dim=1)
    found_flat = MemberScales(scalers, torch.device("cpu")).unscale(flat)
    found_list = MemberScales(scalers, torch.device("cpu")).unscale(grads)
    assert found_flat.tolist() == found_list.tolist() == [True, True, False, True]
    for g, w in zip(grads, want):
        assert torch.equal(g[2], w[2])
    assert torch.equal(flat[2], torch.cat([w[2].reshape(-1) for w in want]))
