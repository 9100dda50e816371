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
  channels_last on CUDA).

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
"""

from __future__ import annotations

import argparse
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


class BenchResNet(fusion_bench.SyntheticResNetTrainer):
    """:class:`fusion_bench.SyntheticResNetTrainer` with ``config["amp"]`` (AMP) and
    ``config["channels_last"]`` (channels_last model and input)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        if config.get("channels_last"):
            self.model.to(memory_format=torch.channels_last)  # in place: the optimizer's
        if config.get("amp"):
            self.enable_amp()

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.config.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        return super().loss((x, y))


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
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(column: str, width: int, args: argparse.Namespace) -> float:
    """Samples per second of ``width`` ResNet-18s trained as ``column`` says."""
    kernels, amp, channels_last = RUNS[column]
    config = {
        "device": args.device,
        "batch_size": args.batch_size,
        "amp": amp,
        # Fused, the members' own tensors stay NCHW; the grouped kernels pick the layout.
        "channels_last": channels_last and kernels is None,
    }
    trainers = [BenchResNet(config) for _ in range(width)]
    lrs = [0.05 * (0.5 + i / width) for i in range(width)]
    step: Callable[[], Any]
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
        group = BenchResNet.fuse(trainers)
        for i, lr in enumerate(lrs):
            group.setup(i, {"lr": lr})
        step = group.step
    device = torch.device(args.device)
    for _ in range(args.warmup):  # cuDNN's algorithm search, allocations
        step()
    synchronize(device)
    rounds = []
    for _ in range(args.repeats):
        begin = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(device)
        rounds.append(time.perf_counter() - begin)
    return width * args.batch_size * args.steps / statistics.median(rounds)


def measure(column: str, width: int, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run`'s figure as a row (with the peak memory on CUDA), or its error."""
    device = torch.device(args.device)
    row: dict[str, Any] = {"column": column, "B": width}
    free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        row["samples_s"] = run(column, width, args)
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
    ]
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
    print(f"## Fused kernels: ResNet-18, batch {args.batch_size}, {device}\n")
    facts = "; ".join(f"{k}: {v}" for k, v in machine_info().items())
    print(f"{facts}; load average {load_average()}; {time.perf_counter() - begin:.0f} s\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
