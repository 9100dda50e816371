"""HFTA's form for fused convolutions and BatchNorm (issue 26, issue 25 item 6): ResNet-18
throughput of B models one after another, fused with vmap's rules, and fused with
stagetree's grouped kernels (:mod:`stagetree.torch.grouped`), in float32 and with AMP.

Side by side at each width B, on one device (:mod:`fusion_bench`'s ResNet-18, CIFAR
layout, synthetic 3x32x32 images, SGD with momentum, one minibatch per step; B
different learning rates):

* ``seq fp32``: the B trainers' ``train()`` one after another, float32, NCHW;
* ``seq amp+cl``: the same with ``enable_amp()`` (float16 and a GradScaler on CUDA,
  bfloat16 on a CPU) and a channels_last model and input: the fastest a user gets
  training the B models one by one;
* ``vmap fp32`` / ``vmap amp``: the fused job with ``fused_kernels = "vmap"`` (the path
  before the grouped kernels);
* ``grouped fp32`` / ``grouped fp32+cl`` / ``grouped amp``: the fused job with the
  default grouped kernels (NCHW in float32 unless ``fused_channels_last``; with AMP,
  channels_last on CUDA);
* ``grouped amp sync``: ``grouped amp`` with the AMP step before issue 26's change (see
  :func:`host_synced_amp_step`): the members' gradients unscaled and checked parameter
  by parameter, the overflow flags read on the host (a wait for the backward) to decide
  whether any member skips, and the optimizer stepping parameter by parameter. The two
  columns side by side measure what the device-side step saves.

With AMP, every member has a GradScaler: float16 on CUDA, bfloat16 with a scaler on a CPU
(so that the rehearsal runs the scaled path too).

``--host-ops`` adds, for each fused column, one more step counted op by op: the
operations dispatched (``aten`` ops a step, views included; in the fused forward, in the
backward and the rest of the step, and in the AMP step: unscale, check, optimizer step,
scale update), the host reads of a tensor
value (``.item()``, ``bool()``, ``nonzero``), on CUDA the synchronisations that
``torch.cuda.set_sync_debug_mode`` reports, and the host time of one step (the call's
wall time after a synchronize: until its last update is queued, and until its losses
are read; see :func:`host_ops`), and the process's CPU time a step over the timed rounds
(on a CPU, the host work whatever the other processes' load).

Throughput is training samples per second over the B models (median of ``--repeats``
rounds of ``--steps`` steps, after ``--warmup`` steps; on CUDA every timed block ends
with a synchronize, ``torch.backends.cudnn.benchmark`` is on, TF32 as torch's defaults
have it: on for cuDNN's float32 convolutions, off for matmuls). A run that
runs out of GPU memory is reported as such, and measurements not started after
``--budget`` seconds are skipped. Rows print as they finish (stderr), the markdown
table at the end. About 2 minutes on an H100 with the defaults.

Run::

    python benchmarks/gpu_fused_kernels.py                 # CUDA: B = 1, 8, 32
    DEVICE=cpu python benchmarks/gpu_fused_kernels.py      # rehearsal: tiny sizes, CPU
    python benchmarks/gpu_fused_kernels.py --widths 8,32 --steps 3 --repeats 2 \
        --columns "seq fp32,grouped amp sync,grouped amp" --host-ops   # issue 26's AMP
    DEVICE=cpu python benchmarks/gpu_fused_kernels.py --model cnn --widths 8 \
        --batch-size 32 --steps 20 --repeats 3 --host-ops   # a host-bound step on a CPU
    DEVICE=cpu python benchmarks/gpu_fused_kernels.py --narrow 16 --widths 8 \
        --batch-size 8 --steps 10 --repeats 3 --host-ops    # ResNet-18's layers, host-bound
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


import fusion_bench
import torch
from _common import fmt, load_average, machine_info, markdown_table
from amp_digits import cuda_syncs  # tests/fakes, on the path by fusion_bench
from torch.utils._python_dispatch import TorchDispatchMode

from stagetree.torch import FusibleTrainer, TorchFusedGroup
from stagetree.torch.examples import DIGITS_CONV_DEFAULTS, DigitsConvTrainer


def narrow(model: torch.nn.Module, divisor: int) -> torch.nn.Module:
    """``model`` with every convolution's, BatchNorm's and linear layer's channels divided
    by ``divisor`` (3 input channels and 10 classes kept): the same layers and parameter
    count, kernels ``divisor**2`` times shorter, so that a step on a CPU shows the host
    time a GPU spends around the kernels."""

    def less(channels: int) -> int:
        return channels if channels in (3, 10) else max(1, channels // divisor)

    for name, module in list(model.named_modules()):
        new: torch.nn.Module | None = None
        if isinstance(module, torch.nn.Conv2d):
            new = torch.nn.Conv2d(
                less(module.in_channels),
                less(module.out_channels),
                module.kernel_size,
                module.stride,
                module.padding,
                bias=module.bias is not None,
            )
        elif isinstance(module, torch.nn.BatchNorm2d):
            new = torch.nn.BatchNorm2d(less(module.num_features))
        elif isinstance(module, torch.nn.Linear):
            new = torch.nn.Linear(less(module.in_features), module.out_features)
        if new is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, new.to(module.weight.device))
    return model


class BenchResNet(fusion_bench.SyntheticResNetTrainer):
    """:class:`fusion_bench.SyntheticResNetTrainer` with ``config["amp"]`` (AMP) and
    ``config["channels_last"]`` (channels_last model and input)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        if config.get("narrow", 1) > 1:
            self.model = narrow(self.model, int(config["narrow"]))
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        if config.get("channels_last"):
            self.model.to(memory_format=torch.channels_last)  # in place: the optimizer's
        if config.get("amp"):
            self.enable_amp(scaler=True)  # float16 on CUDA, bfloat16 on a CPU

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.config.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        return super().loss((x, y))


class BenchCNN(DigitsConvTrainer):
    """``--model cnn``: the digits CNN (two convolutions with BatchNorm, 1x8x8 images,
    SGD with momentum, one minibatch a step), whose kernels are so short that a step is
    host time on any device; ``config["amp"]`` as :class:`BenchResNet`'s (its
    ``channels_last`` is ignored: the images are reshaped inside the model)."""

    defaults = {**DIGITS_CONV_DEFAULTS, "amp": False, "channels_last": False, "narrow": 1}

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__({**config, "optimizer": "momentum", "batches_per_step": 1})
        if config.get("amp"):
            self.enable_amp(scaler=True)


MODELS: dict[str, type[FusibleTrainer]] = {"resnet18": BenchResNet, "cnn": BenchCNN}

#: column -> (fused kernels, or None: sequential; AMP; channels_last: the model and input,
#: fused ``fused_channels_last = True``, which AMP on CUDA has by default)
RUNS: dict[str, tuple[str | None, bool, bool]] = {
    "seq fp32": (None, False, False),
    "seq amp+cl": (None, True, True),
    "vmap fp32": ("vmap", False, False),
    "vmap amp": ("vmap", True, False),
    "grouped fp32": ("grouped", False, False),
    "grouped fp32+cl": ("grouped", False, True),
    "grouped amp": ("grouped", True, False),
    "grouped amp sync": ("grouped", True, False),
}
#: Columns whose fused job takes :func:`host_synced_amp_step`.
HOST_SYNCED = frozenset({"grouped amp sync"})


@torch.no_grad()
def host_synced_amp_step(group: TorchFusedGroup) -> None:
    """The fused AMP step as it was before issue 26's change (for comparison): per
    parameter, an overflow check and an unscale of each member's slice; the flags read
    on the host (a wait for the backward) and, unless some member overflowed, the
    optimizer's step parameter by parameter (a masked step otherwise)."""
    scales, optimizer = group._scales, group._optimizer
    optimizer.flat = False
    if scales is None:
        optimizer.step()
        return
    grads = [p.grad for p in optimizer.params.values() if p.grad is not None]
    inv = scales.scale.double().reciprocal().float()
    found = torch.zeros_like(scales.scale, dtype=torch.bool)
    for g in grads:
        found |= ~torch.isfinite(g.flatten(1)).all(dim=1)
        g.mul_(inv.view(-1, *([1] * (g.dim() - 1))))
    skipped = found.to("cpu")
    optimizer.step(skip=found if bool(skipped.any()) else None)
    scales.update(found)


class OpCount(TorchDispatchMode):
    """Counts the ops dispatched, and those that read a tensor's value on the host."""

    READS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.phase = "backward"  #: what runs now (the fused step's forward, AMP step)
        self.phases: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func._schema.name] += 1
        self.phases[self.phase] += 1
        return func(*args, **(kwargs or {}))

    def during(self, phase: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, its ops counted under ``phase``."""

        def counted(*args: Any) -> Any:
            before, self.phase = self.phase, phase
            try:
                return call(*args)
            finally:
                self.phase = before

        return counted


def host_ops(group: TorchFusedGroup, device: torch.device) -> dict[str, float]:
    """One fused step counted: ops dispatched, host reads, CUDA syncs; and the wall
    milliseconds of a step (``step_ms``, until its losses are read: the device's time
    where it is the bottleneck) and until the host has queued its last update
    (``queued_ms``, waits for the device included: where it is under ``step_ms`` the
    device is the bottleneck, where they are equal the host is)."""
    marks: list[float] = []
    amp_step = group._amp_step

    def marked() -> None:
        amp_step()
        marks.append(time.perf_counter())

    group._amp_step = marked  # type: ignore[method-assign]
    try:
        synchronize(device)
        begin = time.perf_counter()
        group.step()
        end = time.perf_counter()
    finally:
        group._amp_step = amp_step  # type: ignore[method-assign]
    synchronize(device)
    count = OpCount()
    loss = group._loss
    group._loss = count.during("forward", loss)  # type: ignore[method-assign]
    group._amp_step = count.during("amp step", amp_step)  # type: ignore[method-assign]
    try:
        with count:
            group.step()
    finally:
        group._loss, group._amp_step = loss, amp_step  # type: ignore[method-assign]
    synchronize(device)
    syncs = float(cuda_syncs(group.step)) if device.type == "cuda" else float("nan")
    synchronize(device)
    return {
        "ops": sum(count.ops.values()),
        **{f"{phase} ops": count.phases[phase] for phase in ("forward", "backward", "amp step")},
        "reads": sum(count.ops[n] for n in OpCount.READS),
        "syncs": syncs,
        "queued_ms": (marks[-1] - begin) * 1e3,
        "step_ms": (end - begin) * 1e3,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(column: str, width: int, args: argparse.Namespace) -> dict[str, Any]:
    """Samples per second (``samples_s``) of ``width`` ResNet-18s trained as ``column``
    says; with ``--host-ops``, :func:`host_ops`'s figures of a fused column too."""
    kernels, amp, channels_last = RUNS[column]
    config = {
        "device": args.device,
        "batch_size": args.batch_size,
        "amp": amp,
        # Fused, the members' own tensors stay NCHW; the grouped kernels pick the layout.
        "channels_last": channels_last and kernels is None,
        "narrow": args.narrow,
    }
    model = MODELS[args.model]
    trainers = [model(config) for _ in range(width)]
    lrs = [0.05 * (0.5 + i / width) for i in range(width)]
    step: Callable[[], Any]
    group: TorchFusedGroup | None = None
    if kernels is None:
        for trainer, lr in zip(trainers, lrs):
            trainer.setup({"lr": lr})

        def step() -> None:
            for trainer in trainers:
                trainer.train()

    else:
        for trainer in trainers:
            trainer.fused_kernels = kernels
            if channels_last:
                trainer.fused_channels_last = True
        group = fused = model.fuse(trainers)
        if column in HOST_SYNCED:
            fused._amp_step = lambda: host_synced_amp_step(fused)  # type: ignore[method-assign]
        for i, lr in enumerate(lrs):
            group.setup(i, {"lr": lr})
        step = group.step
    device = torch.device(args.device)
    for _ in range(args.warmup):  # cuDNN's algorithm search, allocations
        step()
    synchronize(device)
    rounds, cpu = [], []
    for _ in range(args.repeats):
        begin, begin_cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        synchronize(device)
        rounds.append(time.perf_counter() - begin)
        cpu.append(time.process_time() - begin_cpu)
    row: dict[str, Any] = {
        "samples_s": width * args.batch_size * args.steps / statistics.median(rounds),
        # The process's CPU time a step: on a CPU device the host work, which other
        # processes' load leaves alone (unlike the wall clock); on CUDA it counts the
        # host spinning in a synchronisation too.
        "cpu_ms": statistics.median(cpu) / args.steps * 1e3,
    }
    if args.host_ops and group is not None:
        row.update(host_ops(group, device))
    return row


def measure(column: str, width: int, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run`'s figure as a row (with the peak memory on CUDA), or its error."""
    device = torch.device(args.device)
    row: dict[str, Any] = {"column": column, "B": width}
    free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        row.update(run(column, width, args))
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
    if device.type == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    free(device)
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    by = {(r["B"], r["column"]): r for r in rows}

    def cell(width: int, column: str) -> str:
        row = by.get((width, column))
        if row is None:
            return "-"
        return fmt(row["samples_s"], 0) if "samples_s" in row else row["error"]

    def ratio(width: int, top: str, bottom: str) -> str:
        a, b = by.get((width, top), {}), by.get((width, bottom), {})
        return (
            fmt(a["samples_s"] / b["samples_s"], 2)
            if "samples_s" in a and "samples_s" in b
            else "-"
        )

    lines = []
    for width in sorted({r["B"] for r in rows}):
        lines.append(
            [
                width,
                *(cell(width, c) for c in RUNS),
                ratio(width, "grouped amp", "seq fp32"),
                ratio(width, "grouped amp", "seq amp+cl"),
                ratio(width, "grouped amp", "vmap amp"),
                ratio(width, "grouped fp32", "vmap fp32"),
            ]
        )
    headers = ["B", *(f"{c} /s" for c in RUNS)]
    headers += [
        "grouped amp / seq fp32",
        "grouped amp / seq amp+cl",
        "grouped amp / vmap amp",
        "grouped fp32 / vmap fp32",
        "grouped amp / grouped amp sync",
    ]
    for line in lines:
        line.append(ratio(int(line[0]), "grouped amp", "grouped amp sync"))
    return markdown_table(headers, lines)


def host_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`host_ops`'s figures, a row per (B, fused column)."""
    lines = [
        [
            r["B"],
            r["column"],
            fmt(r["ops"], 0),
            *(fmt(r[f"{phase} ops"], 0) for phase in ("forward", "backward", "amp step")),
            fmt(r["reads"], 0),
            "-" if r["syncs"] != r["syncs"] else fmt(r["syncs"], 0),
            fmt(r["queued_ms"], 1),
            fmt(r["step_ms"], 1),
            fmt(r["cpu_ms"], 1),
        ]
        for r in sorted(rows, key=lambda r: (r["B"], r["column"]))
        if "ops" in r
    ]
    headers = ["B", "column", "ops/step", "forward", "backward (and the rest)", "AMP step"]
    headers += ["host reads/step", "CUDA syncs/step"]
    headers += ["queued ms", "step ms", "CPU ms/step (timed rounds)"]
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    device = os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    tiny = device == "cpu"
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--widths", default="2" if tiny else "1,8,32")
    parser.add_argument("--batch-size", type=int, default=2 if tiny else 64)
    parser.add_argument("--warmup", type=int, default=1 if tiny else 2)
    parser.add_argument("--steps", type=int, default=1 if tiny else 4)
    parser.add_argument("--repeats", type=int, default=1 if tiny else 3)
    parser.add_argument(
        "--budget",
        type=float,
        default=0 if tiny else 140,
        help="seconds after which measurements not started yet are skipped (0: none)",
    )
    parser.add_argument(
        "--columns", default=",".join(RUNS), help="which runs, of: " + ",".join(RUNS)
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument(
        "--narrow",
        type=int,
        default=1,
        help="ResNet-18 with its channels divided by this (host time on a CPU)",
    )
    parser.add_argument(
        "--host-ops",
        action="store_true",
        help="count each fused column's ops, host reads and syncs over one more step",
    )
    args = parser.parse_args(argv)
    args.device = device
    widths = [int(w) for w in args.widths.split(",")]
    columns = [c for c in args.columns.split(",") if c]
    if device.startswith("cuda"):
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(1)
    begin = time.perf_counter()
    rows = []
    # The widest first: it is the figure that matters (HFTA's gains at B = 32), and the
    # time budget leaves out what is left, not it.
    for width in sorted(widths, reverse=True):
        for column in columns:
            if args.budget and time.perf_counter() - begin > args.budget:
                rows.append({"column": column, "B": width, "error": "skipped (time budget)"})
                continue
            row = measure(column, width, args)
            rows.append(row)
            print(
                f"{time.perf_counter() - begin:6.0f} s  B={width} {row}",
                file=sys.stderr,
                flush=True,
            )
    name = args.model + (f" (channels / {args.narrow})" if args.narrow > 1 else "")
    print(f"## Fused kernels: {name}, batch {args.batch_size}, {device}\n")
    facts = "; ".join(f"{k}: {v}" for k, v in machine_info().items())
    print(f"{facts}; load average {load_average()}; {time.perf_counter() - begin:.0f} s\n")
    print(table(rows))
    if args.host_ops:
        print("\nOne fused step, counted:\n")
        print(host_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
