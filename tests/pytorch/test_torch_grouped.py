"""HFTA's form in fused jobs (stagetree.torch.grouped): the convolutions, BatchNorm and
pooling of B fused members run as one grouped convolution / one BatchNorm over B*C
channels, and each member still follows the member trained alone.

Measured on the 2-core development CPU (torch 2.13, one thread), 3 members, 6 updates:
the small ResNet below (stem, a block with a strided 1x1 shortcut, pooling, linear)
1.2e-07 max abs apart from the members alone in float32 (as vmap's rules), channels_last
1.8e-07 (1.0e-05 rel); with bfloat16 AMP 3.0e-08 / 9.9e-08 (vmap's rules: 2.5e-02).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from resnet_block import BasicBlock  # noqa: E402 (tests/fakes, see conftest)
from torch import nn  # noqa: E402
from torch.func import functional_call, stack_module_state, vmap  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from stagetree.exceptions import FusionError  # noqa: E402
from stagetree.torch import FusibleTrainer, StageLoader, TorchFusedGroup  # noqa: E402
from stagetree.torch.examples import DigitsConvTrainer, DigitsTrainer  # noqa: E402
from stagetree.torch.grouped import (  # noqa: E402
    GroupedAdaptiveAvgPool2d,
    GroupedBatchNorm2d,
    GroupedConv2d,
    GroupedLinear,
    Kernels,
    install,
)

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("fused_vs_unfused_determinism")]

STEPS = 6
LRS = (0.01, 0.05, 0.1)
#: (max abs, max rel) of test_torch_fused.py's BatchNorm case.
BN_BOUNDS = (1e-6, 5e-6)
#: ... and of its AMP cases.
AMP_BOUNDS = (2e-6, 1e-5)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


class TinyResNet(FusibleTrainer):
    """A stem (conv with bias + in-place ReLU + BatchNorm), a block with a strided 1x1
    shortcut, average pooling and a linear layer, on random 3x8x8 images.

    Config: ``amp`` (bfloat16 autocast), ``channels_last`` (the loss hands the model
    channels_last images), ``bias`` (the linear layer's)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        device = torch.device(config.get("device", "cpu"))
        gen = torch.Generator().manual_seed(0)
        images = torch.randn(64, 3, 8, 8, generator=gen).to(device)
        labels = torch.randint(0, 10, (64,), generator=gen).to(device)
        self.model = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1),  # a bias (no BatchNorm right after it: it would
            nn.ReLU(inplace=True),  # get ~0 gradients, all rounding noise)
            nn.BatchNorm2d(8),
            BasicBlock(8, 16, 2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10, bias=bool(config.get("bias", True))),
        ).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.loader = StageLoader((images, labels), batch_size=16, seed=0)
        if config.get("amp"):
            self.enable_amp()

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.config.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        return F.cross_entropy(self.model(x), y)

    def evaluate(self) -> dict[str, float]:
        return {}


class UnhandledLayers(TinyResNet):
    """Layers the grouped kernels leave to vmap: a circular-padded convolution and a
    subclass of BatchNorm2d."""

    class OwnNorm(nn.BatchNorm2d):
        pass

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        device = self.model[0].weight.device
        self.model[0] = nn.Conv2d(3, 8, 3, 1, 1, padding_mode="circular").to(device)
        self.model[2] = self.OwnNorm(8).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)


def train_fused(
    cls: type[FusibleTrainer], config: Mapping[str, Any], **settings: Any
) -> tuple[TorchFusedGroup, list[list[float]]]:
    """The members trained fused, with ``settings`` (``fused_kernels``...) as attributes."""
    members = [cls(config) for _ in LRS]
    for m in members:
        for key, value in settings.items():
            setattr(m, key, value)
    group = cls.fuse(members)
    assert isinstance(group, TorchFusedGroup)
    for i, lr in enumerate(LRS):
        group.setup(i, {"lr": lr})
    losses = [[r["train_loss"] for r in group.step()] for _ in range(STEPS)]
    for i in range(len(LRS)):
        group.sync(i)
    return group, losses


def train_alone(cls: type[FusibleTrainer], config: Mapping[str, Any]) -> list[Any]:
    """(trainer, its losses) of each member trained alone."""
    out = []
    for lr in LRS:
        trainer = cls(config)
        trainer.setup({"lr": lr})
        out.append((trainer, [trainer.train()["train_loss"] for _ in range(STEPS)]))
    return out


def state_tensors(trainer: FusibleTrainer) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers and the optimizer's momentum buffers."""
    model = trainer.model  # type: ignore[attr-defined]
    out = dict(model.state_dict())
    optimizer = trainer.optimizer  # type: ignore[attr-defined]
    for j, p in enumerate(optimizer.param_groups[0]["params"]):
        if "momentum_buffer" in optimizer.state.get(p, {}):
            out[f"momentum.{j}"] = optimizer.state[p]["momentum_buffer"]
    return out


def difference(a: FusibleTrainer, b: FusibleTrainer) -> tuple[float, float]:
    """(max abs, max rel) difference of the floating tensors; the others are equal."""
    sa, sb = state_tensors(a), state_tensors(b)
    assert list(sa) == list(sb)
    worst_abs = worst_rel = 0.0
    for key, x in sa.items():
        y = sb[key]
        if not x.is_floating_point():  # num_batches_tracked
            assert torch.equal(x, y), key
            continue
        d = (x - y).abs().max().item()
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / max(y.abs().max().item(), 1e-12))
    return worst_abs, worst_rel


def compare(
    cls: type[FusibleTrainer], config: Mapping[str, Any], **settings: Any
) -> tuple[TorchFusedGroup, float, float, float]:
    """The fused group, and its members' worst (abs, rel, train loss) difference from
    the members trained alone."""
    group, fused_losses = train_fused(cls, config, **settings)
    worst_abs = worst_rel = worst_loss = 0.0
    for i, (alone, losses) in enumerate(train_alone(cls, config)):
        member = group.members[i]
        assert isinstance(member, FusibleTrainer)
        d_abs, d_rel = difference(member, alone)
        worst_abs, worst_rel = max(worst_abs, d_abs), max(worst_rel, d_rel)
        worst_loss = max(worst_loss, *(abs(f[i] - a) for f, a in zip(fused_losses, losses)))
    return group, worst_abs, worst_rel, worst_loss


def grouped_classes(group: TorchFusedGroup) -> list[type]:
    driver = group._driver
    return [type(m) for m in driver.model.modules()]  # type: ignore[attr-defined]


def test_the_cnn_with_batchnorm_runs_grouped_and_follows_its_members_alone() -> None:
    config = {"channels": 4, "batches_per_step": 1, "optimizer": "momentum"}
    group, worst_abs, worst_rel, worst_loss = compare(DigitsConvTrainer, config)
    classes = grouped_classes(group)
    assert classes.count(GroupedConv2d) == 2 and classes.count(GroupedBatchNorm2d) == 2
    assert group._grouped_layers == 6  # and the pooling and the linear layer
    assert worst_abs < BN_BOUNDS[0] and worst_rel < BN_BOUNDS[1]
    assert worst_loss < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_resnet_block_with_a_strided_shortcut_follows_its_members_alone(
    device: str, channels_last: bool
) -> None:
    """Running statistics per member included (num_batches_tracked exactly); with
    channels_last activations (which vmap's BatchNorm refuses) too. On CUDA the bounds
    are twice the CPU's, as in test_torch_fused.py."""
    group, worst_abs, worst_rel, worst_loss = compare(
        TinyResNet,
        {"channels_last": channels_last, "device": device},
        fused_channels_last=channels_last,
    )
    assert group._grouped_layers == 10
    # channels_last: the grouped convolution's kernels on a CPU block the channels
    # otherwise than the member's own (measured: 1.0e-05 rel, a momentum buffer of
    # magnitude 5e-03 that is 5e-08 apart).
    factor = 1 if device == "cpu" else 2
    bound_rel = BN_BOUNDS[1] * (10 if channels_last else 1) * factor
    print(f"\n{device}, channels_last={channels_last}: {worst_abs:.2e} abs, {worst_rel:.2e} rel")
    assert worst_abs < BN_BOUNDS[0] * factor and worst_rel < bound_rel
    assert worst_loss < 1e-5 * factor


def test_grouped_and_vmap_kernels_agree_and_vmap_changes_no_module() -> None:
    grouped, _, _, _ = compare(TinyResNet, {})
    plain, _, _, _ = compare(TinyResNet, {}, fused_kernels="vmap")
    assert plain._grouped_layers == 0
    assert not {GroupedConv2d, GroupedBatchNorm2d} & set(grouped_classes(plain))
    for i in range(len(LRS)):
        a, b = state_tensors(grouped.members[i]), state_tensors(plain.members[i])  # type: ignore[arg-type]
        for key in a:
            assert torch.allclose(a[key], b[key], rtol=0, atol=1e-6), key


@pytest.mark.parametrize("device", DEVICES)
def test_amp_with_grouped_kernels_stays_within_amp_rounding(device: str) -> None:
    """bfloat16 autocast on a CPU, float16 and a GradScaler per member on CUDA: the
    grouped convolutions and the linear layer run in the lower precision as each
    member's own do (with vmap's rules the linear layer's bias is added in float32: 2.5e-02
    apart after 6 updates). On CUDA, test_torch_fused.py's AMP tolerance for
    convolutions: train losses within 1e-2."""
    group, worst_abs, worst_rel, worst_loss = compare(TinyResNet, {"amp": True, "device": device})
    print(f"\n{device} AMP: {worst_abs:.2e} abs, {worst_rel:.2e} rel, loss {worst_loss:.2e}")
    if device == "cpu":  # and as closely as float32 (test_torch_fused.py's AMP bound)
        assert worst_abs < AMP_BOUNDS[0] and worst_rel < AMP_BOUNDS[1]
    assert group._grouped_layers == 10
    # The convolutions cast to autocast's dtype; channels_last by default on CUDA only.
    conv = group._driver.model[0]  # type: ignore[attr-defined]
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    assert conv.stagetree_kernels == Kernels(dtype=dtype, channels_last=device == "cuda")
    assert worst_loss < 1e-2


def test_an_mlps_linear_layers_run_as_one_product_each() -> None:
    """The first layer (the shared batch) as one product with B*O outputs, the others as
    one batched product; the MLP's own accuracy figures are test_torch_fused.py's."""
    config = {"dropout": 0.0, "hidden": 16, "optimizer": "momentum"}
    group = DigitsTrainer.fuse([DigitsTrainer(config) for _ in range(2)])
    assert isinstance(group, TorchFusedGroup)
    assert group._grouped_layers == 2
    assert GroupedLinear in grouped_classes(group)


def test_layers_it_does_not_handle_keep_vmaps_rules() -> None:
    group, worst_abs, worst_rel, worst_loss = compare(UnhandledLayers, {})
    classes = grouped_classes(group)
    assert classes[1] is nn.Conv2d and classes[3] is UnhandledLayers.OwnNorm
    assert group._grouped_layers == 8  # the block, the pooling and the linear layer
    assert worst_abs < BN_BOUNDS[0] and worst_rel < BN_BOUNDS[1]
    assert worst_loss < 1e-5


def test_an_unknown_kernels_setting_is_refused() -> None:
    members = [TinyResNet({}) for _ in range(2)]
    for m in members:
        m.fused_kernels = "hfta"
    with pytest.raises(FusionError, match="fused_kernels"):
        TinyResNet.fuse(members)


def test_grouped_modules_compute_as_before_outside_vmap() -> None:
    group, _ = train_fused(TinyResNet, {})
    model = group._driver.model  # type: ignore[attr-defined]
    assert isinstance(model[4], GroupedAdaptiveAvgPool2d)
    plain = TinyResNet({}).model
    plain.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    model.eval(), plain.eval()
    assert torch.equal(model(x), plain(x))


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)), (5,)),
        (lambda: nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)), (2, 7, 5)),
        (lambda: nn.Conv2d(3, 4, 3), (3, 6, 6)),  # an unbatched image: vmap's rule
        (
            lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 6, 1, groups=2)),
            (2, 4, 6, 6),
        ),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval(), (2, 3, 6, 6)),
    ],
)
def test_grouped_layers_under_vmap_give_each_members_output(
    make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    """Inputs of other ranks than [N, C, H, W] / [N, I], grouped convolutions, and
    BatchNorm in eval mode (the running statistics)."""
    members = [make() for _ in range(3)]
    for i, m in enumerate(members):  # BatchNorm in eval mode: each member's statistics
        for buffer in m.buffers():
            if buffer.is_floating_point():
                buffer.add_(0.1 * i)
    params, buffers = stack_module_state(members)
    template = make()
    install([template], Kernels())
    x = torch.randn(shape)

    def run(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(template, (p, b), (x,))

    got = vmap(run)(params, buffers)
    want = torch.stack([m(x) for m in members])
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
