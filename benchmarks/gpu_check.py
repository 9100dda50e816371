"""Everything stagetree claims on a GPU, in one run (issue 26): run it through
``benchmarks/gpu_check.sh``, which first runs the CUDA test cases.

Sections (each prints a markdown table; a section that fails prints its error and the
run goes on):

1. ``throughput``: fused against one-after-another training
   (:mod:`fusion_bench`'s measurement) for the MLP, the CNN with BatchNorm and the
   ResNet-18 on synthetic 3x32x32 images at ``--widths``, with peak memory per model;
   ``--cudnn-benchmark`` lets cuDNN time its algorithms first.
2. ``widths``: :meth:`FusibleTrainer.fused_width_limit` against the widest fused job
   that actually fit (doubling from 64, then bisection).
3. ``exactness``: :func:`stagetree.tools.check.check_trainer` on the CNN with
   ``torch.use_deterministic_algorithms(True)``: straight against split with a
   checkpoint round-trip into a fresh instance, bit for bit, on the device.
4. ``study``: the digits grid with shared prefixes as a user runs it, on the device:
   ``fuse=True`` against ``fuse=False`` against ``share=False``; wall-clock,
   device-seconds, steps executed, and the final accuracies compared (sharing must
   equal training alone bit for bit; fusion within its tolerance).

Workers pinned to real devices are a test case
(``tests/executors/test_devices.py::test_workers_pinned_to_real_cuda_devices``), run by
the shell script with the CUDA cases.

Run::

    bash benchmarks/gpu_check.sh                         # on a CUDA machine
    .venv/bin/python benchmarks/gpu_check.py --device cpu --quick   # rehearsal on a CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fusion_bench
import torch
from _common import fmt, markdown_table, write_plot

from stagetree.hp import Piecewise
from stagetree.tools.check import check_trainer
from stagetree.torch.examples import DigitsConvTrainer


def section(name: str, body: Callable[[], str], out: Path) -> None:
    """Run one section, print its text (or its error), keep it in ``out/name.md``."""
    print(f"\n## {name}\n", flush=True)
    begin = time.perf_counter()
    try:
        text = body()
    except Exception:  # a section's failure is a finding; the others still run
        text = "FAILED:\n\n```\n" + traceback.format_exc() + "```"
    text += f"\n\n({name}: {time.perf_counter() - begin:.0f} s)\n"
    print(text, flush=True)
    (out / f"{name}.md").write_text(text)


# ---------------------------------------------------------------------- 1. throughput


def throughput(args: argparse.Namespace, out: Path) -> str:
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    bench = argparse.Namespace(
        device=args.device,
        widths=args.widths,
        models=args.models,
        steps=args.steps,
        repeats=args.repeats,
        threads=1,
    )
    rows = fusion_bench.throughput(bench)
    text = fusion_bench.report(rows, bench)
    if args.cudnn_benchmark:
        text = "torch.backends.cudnn.benchmark = True\n\n" + text
    write_plot(str(out / "fusion_bench.png"), fusion_bench.plot, rows, bench)
    return text


def widths(args: argparse.Namespace) -> str:
    probes = [
        fusion_bench.widest(m, args.device, start=args.probe_start, cap=args.probe_cap)
        for m in args.models
    ]
    return "Fused width, estimated against measured:\n\n" + fusion_bench.widths_table(probes)


# ---------------------------------------------------------------------- 2. exactness


def exactness(args: argparse.Namespace) -> str:
    config = {"device": args.device, "optimizer": "momentum"}
    hp = {"lr": Piecewise([0.05, 0.02], [3])}
    lines = []
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for tf32 in (False, True):
            torch.backends.cudnn.allow_tf32 = tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            report = check_trainer(DigitsConvTrainer, config, hp, args.check_steps)
            lines.append(f"### TF32 {'on' if tf32 else 'off'}: exact={report.exact}\n")
            lines.append("```\n" + report.format() + "\n```")
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = False
    return "\n".join(lines)


# ---------------------------------------------------------------------- 3. study


def study(args: argparse.Namespace) -> str:
    modes = [
        ("sharing + fusion", {"fuse": True, "share": True}),
        ("sharing alone", {"fuse": False, "share": True}),
        ("each trial alone", {"fuse": False, "share": False}),
    ]
    config = {"device": args.device, "dropout": 0.0}
    # Warm-up: the first study of a process starts the fork server that imports torch
    # and CUDA once for every later worker; none of the timed modes should pay for it.
    fusion_bench.grid_study(False, 2, 2, 1, args.workers, config=config)
    runs: dict[str, dict[str, Any]] = {}
    for label, flags in modes:
        runs[label] = fusion_bench.grid_study(
            flags["fuse"],
            args.trials,
            args.trial_steps,
            args.warmup,
            args.workers,
            config=config,
            share=flags["share"],
        )
        r = runs[label]
        print(f"{label}: {r['seconds']:.1f} s, device {r['device']:.1f} s", flush=True)
    alone = runs["each trial alone"]
    table = []
    for label, _ in modes:
        r = runs[label]
        diff = max(abs(a - b) for a, b in zip(r["accuracy"], alone["accuracy"]))
        same = r["accuracy"] == alone["accuracy"]
        table.append(
            [
                label,
                int(r["steps"]),
                fmt(r["seconds"], 1),
                fmt(alone["seconds"] / r["seconds"]),
                fmt(r["device"], 1),
                fmt(alone["device"] / max(r["device"], 1e-9)),
                "identical" if same else f"max diff {diff:.4f}",
            ]
        )
    head = (
        f"Digits grid on {args.device}: {args.trials} learning rates after {args.warmup} "
        f"shared steps, {args.trial_steps} steps each, {args.workers} worker(s), "
        "evaluated every step, dropout 0 (fused members draw their own dropout masks, so "
        "with dropout fusion is not comparable to training alone).\n\n"
    )
    headers = [
        "run", "steps executed", "wall s", "wall speed-up", "device s",
        "device-s saving", "final accuracies vs alone",
    ]  # fmt: skip
    return head + markdown_table(headers, table)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="a small rehearsal")
    parser.add_argument("--out", default="benchmarks/out/gpu_check", help="output folder")
    parser.add_argument(
        "--sections", default="throughput,widths,exactness,study", help="which to run"
    )
    parser.add_argument("--models", default=None, help="mlp,cnn,resnet18 (quick: mlp,cnn)")
    parser.add_argument(
        "--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark"
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available (rehearse with --device cpu)")
    quick = args.quick
    args.widths = [1, 4] if quick else [1, 4, 16, 32, 64]
    default_models = "mlp,cnn" if quick else "mlp,cnn,resnet18"
    args.models = (args.models or default_models).split(",")
    args.steps, args.repeats = (1, 1) if quick else (3, 2)
    args.probe_start, args.probe_cap = (4, 8) if quick else (64, 1024)
    args.check_steps = 4 if quick else 8
    args.trials, args.trial_steps, args.warmup = (4, 6, 2) if quick else (32, 60, 20)
    args.workers = 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(
        f"# stagetree on {name}: torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    bodies: dict[str, Callable[[], str]] = {
        "throughput": lambda: throughput(args, out),
        "widths": lambda: widths(args),
        "exactness": lambda: exactness(args),
        "study": lambda: study(args),
    }
    for name in args.sections.split(","):
        section(name, bodies[name], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
