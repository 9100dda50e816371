"""Mixed precision inside fused jobs (issue 25 item 6): ResNet-18 throughput of B models
fused against the same B models one after another, in float32 and with AMP.

HFTA's ResNet-18 figures are with automatic mixed precision; stagetree's fused float32
ResNet-18 ran 1.4-2.7x the sequential throughput on an H100. This measures the four
combinations side by side on one device, at each width B:

* ``fp32 seq`` / ``fp32 fused``: ``benchmarks/fusion_bench.py``'s ResNet-18 (CIFAR
  layout, synthetic 3x32x32 images, SGD with momentum, one minibatch per step);
* ``amp seq`` / ``amp fused``: the same trainer with ``enable_amp()`` (float16 autocast and
  a GradScaler per member on CUDA; bfloat16 autocast on a CPU).

Throughput is training samples per second over the B models (median of ``--repeats``
rounds of ``--steps`` steps, after a warm-up step; on CUDA every timed block ends with a
synchronize, and ``torch.backends.cudnn.benchmark`` is on). Widths that run out of GPU
memory are reported as such. About 60-90 s on an H100 with the defaults.

Run::

    python benchmarks/gpu_amp.py                          # CUDA: B = 1, 8, 32
    DEVICE=cpu python benchmarks/gpu_amp.py               # rehearsal: tiny sizes, CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fusion_bench
import torch
from _common import fmt, load_average, machine_info, markdown_table


class AmpResNetTrainer(fusion_bench.SyntheticResNetTrainer):
    """:class:`fusion_bench.SyntheticResNetTrainer`, with AMP when ``config["amp"]``."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        if config.get("amp"):
            self.enable_amp()


def measure(width: int, amp: bool, args: argparse.Namespace) -> dict[str, Any]:
    """fusion_bench's fused-vs-sequential measurement of ``width`` ResNet-18s."""
    name = "resnet18-amp" if amp else "resnet18-fp32"
    fusion_bench.MODELS[name] = (
        AmpResNetTrainer,
        {"batch_size": args.batch_size, "amp": amp},
        0.05,
    )
    row = fusion_bench.measure(name, width, args)
    row["amp"] = amp
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    by = {(r["B"], r["amp"]): r for r in rows}
    lines = []
    for width in sorted({r["B"] for r in rows}):
        fp32, amp = by.get((width, False), {}), by.get((width, True), {})

        def get(row: Mapping[str, Any], key: str) -> Any:
            return row.get(key, row.get("error", "-"))

        base = fp32.get("sequential")
        lines.append(
            [
                width,
                fmt(get(fp32, "sequential"), 0),
                fmt(get(fp32, "fused"), 0),
                fmt(get(amp, "sequential"), 0),
                fmt(get(amp, "fused"), 0),
                fmt(fp32["speedup"], 2) if "speedup" in fp32 else "-",
                fmt(amp["speedup"], 2) if "speedup" in amp else "-",
                fmt(amp["fused"] / base, 2) if base and "fused" in amp else "-",
            ]
        )
    return markdown_table(
        [
            "B",
            "fp32 seq /s",
            "fp32 fused /s",
            "amp seq /s",
            "amp fused /s",
            "fused/seq fp32",
            "fused/seq amp",
            "amp fused / fp32 seq",
        ],
        lines,
    )


def main(argv: list[str] | None = None) -> int:
    device = os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    tiny = device == "cpu"
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--widths", default="1,2" if tiny else "1,8,32")
    parser.add_argument("--batch-size", type=int, default=4 if tiny else 64)
    parser.add_argument("--steps", type=int, default=1 if tiny else 5)
    parser.add_argument("--repeats", type=int, default=1 if tiny else 3)
    args = parser.parse_args(argv)
    args.device = device
    widths = [int(w) for w in args.widths.split(",")]
    if device.startswith("cuda"):
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(1)
    begin = time.perf_counter()
    rows = []
    for amp in (False, True):
        for width in widths:
            row = measure(width, amp, args)
            rows.append(row)
            print(f"amp={amp} B={width}: {row}", file=sys.stderr)
            if "error" in row:
                break
    print(f"## AMP in fused jobs: ResNet-18, batch {args.batch_size}, {device}\n")
    facts = "; ".join(f"{k}: {v}" for k, v in machine_info().items())
    print(f"{facts}; load average {load_average()}; {time.perf_counter() - begin:.0f} s\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
