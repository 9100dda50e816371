"""Horizontal fusion: training throughput of B models fused into one job against the same
B models trained one after another (issue 12).

For each model and width B (``--widths``), B trainers are built from one config and
given B different learning rates (what sibling trials of a study differ in):

* ``fused``: :meth:`FusibleTrainer.fuse` of the B trainers; one step is
  ``TorchFusedGroup.step()`` (``vmap(functional_call)`` over the stacked models, one
  backward, one fused optimizer step, ``updates_per_step`` times);
* ``sequential``: the B trainers' ``train()``, one after another (what B unfused stages
  cost one worker).

Throughput is training samples per second summed over the B models (B x updates per step
x batch size x steps / seconds). Each width runs ``--repeats`` rounds of ``--steps``
steps per mode, fused and sequential alternating, after one warm-up step each; the
median round is reported. On CUDA every timed block ends with ``torch.cuda.synchronize``.

Memory per model: ``state/model`` is the bytes of the fused job's stacked parameters,
their gradients, buffers and fused optimizer state over B (what fusion keeps per member;
the member trainers keep their own copy of parameters and optimizer state besides, for
``sync``). On CUDA, ``peak/model`` is ``torch.cuda.max_memory_allocated`` over B while
the fused steps (or the sequential ones) run, everything alive included.

Models:

* ``mlp``: ``DigitsTrainer`` with its defaults (one hidden layer of 64, SGD with
  momentum 0.9, 10 minibatches of 32 per step) and dropout 0;
* ``cnn``: ``DigitsConvTrainer`` with its defaults (two 3x3 convolutions of 16 and 32
  channels with BatchNorm, SGD with momentum, 10 minibatches of 32 per step);
* ``resnet18``: a ResNet-18 (CIFAR layout, 11.2 M parameters, BatchNorm) on synthetic
  3x32x32 images generated from a fixed seed in this script (nothing is downloaded), SGD
  with momentum, 1 minibatch of 64 per step. Only with ``--device cuda`` (unless named
  in ``--models``); widths that run out of GPU memory are reported as such.

CPU runs use ``--threads`` torch threads (default 1: stable timings on a shared machine,
and the fair setting for B models that would otherwise each get a worker process).

Run::

    .venv/bin/python benchmarks/fusion_bench.py                      # CPU, widths 1..64
    .venv/bin/python benchmarks/fusion_bench.py --quick              # ~1 minute
    .venv/bin/python benchmarks/fusion_bench.py --device cuda --plot fusion_bench.png
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fakes"))

import torch
import torch.nn.functional as F
from _common import fmt, load_average, machine_info, markdown_table, write_plot
from resnet_block import BasicBlock
from torch import nn

from stagetree.torch import FusibleTrainer, StageLoader, TorchFusedGroup
from stagetree.torch.examples import DigitsConvTrainer, DigitsTrainer

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
QUICK_WIDTHS = (1, 4, 16)


# ---------------------------------------------------------------------- ResNet-18


def resnet18(classes: int = 10) -> nn.Sequential:
    """ResNet-18 for 32x32 inputs (3x3 stem, no max-pool), as usual on CIFAR-10."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 3, 1, 1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    ]
    cin = 64
    for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


@functools.lru_cache(maxsize=2)
def synthetic_images(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """2048 3x32x32 images in 10 classes (class-dependent means, so the loss can fall),
    from a fixed seed, on ``device``. Cached: one copy per device for every trainer (a
    copy per member would be 25 MB each, and would decide how wide a job fits)."""
    gen = torch.Generator().manual_seed(1234)
    labels = torch.randint(0, 10, (2048,), generator=gen)
    means = torch.randn(10, 3, 1, 1, generator=gen)
    images = torch.randn(2048, 3, 32, 32, generator=gen) + means[labels]
    return images.to(device), labels.to(device)


class SyntheticResNetTrainer(FusibleTrainer):
    """ResNet-18 on :func:`synthetic_images` of the trainer's device."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        device = torch.device(config.get("device", "cpu"))
        images, labels = synthetic_images(str(device))
        self.loader = StageLoader(
            (images, labels),
            batch_size=int(config.get("batch_size", 64)),
            seed=int(config.get("seed", 0)),
        )
        self.model = resnet18().to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def evaluate(self) -> dict[str, float]:
        return {}


# ---------------------------------------------------------------------- measurement


MODELS: dict[str, tuple[type[FusibleTrainer], dict[str, Any], float]] = {
    # name: (trainer class, config, base learning rate)
    "mlp": (DigitsTrainer, {"dropout": 0.0, "optimizer": "momentum"}, 0.05),
    "cnn": (DigitsConvTrainer, {"optimizer": "momentum"}, 0.05),
    "resnet18": (SyntheticResNetTrainer, {"batch_size": 64}, 0.05),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    begin = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - begin


def samples_per_step(trainer: FusibleTrainer) -> int:
    loaders = trainer._loaders()
    return int(trainer.updates_per_step) * loaders[0].batch_size


def state_bytes(group: TorchFusedGroup) -> int:
    """Bytes of the stacked parameters, gradients, buffers and optimizer state."""
    total = 0
    for p in group._params.values():
        total += p.numel() * p.element_size() * (2 if p.requires_grad else 1)
    for b in group._buffers.values():
        total += b.numel() * b.element_size()
    for state in group._optimizer.state.values():
        for t in state.values():
            total += t.numel() * t.element_size()
    return total


def measure(model: str, width: int, args: argparse.Namespace) -> dict[str, Any]:
    """Fused and sequential throughput of ``width`` models of kind ``model``."""
    cls, base, lr = MODELS[model]
    device = torch.device(args.device)
    config = {**base, "device": args.device}
    row: dict[str, Any] = {"model": model, "device": device.type, "B": width}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    lrs = [lr * (0.5 + i / width) for i in range(width)]
    try:
        alone = [cls(config) for _ in range(width)]
        for trainer, value in zip(alone, lrs):
            trainer.setup({"lr": value})
        members = [cls(config) for _ in range(width)]
        group = cls.fuse(members)
        for i, value in enumerate(lrs):
            group.setup(i, {"lr": value})
        samples = width * samples_per_step(alone[0]) * args.steps

        def fused() -> None:
            for _ in range(args.steps):
                group.step()

        def sequential() -> None:
            for _ in range(args.steps):
                for trainer in alone:
                    trainer.train()

        timed(group.step, device)  # warm-up: allocations, first-call checks
        timed(lambda: [t.train() for t in alone], device)
        fused_s, seq_s = [], []
        peak_fused = peak_seq = 0
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            fused_s.append(timed(fused, device))
            if device.type == "cuda":
                peak_fused = max(peak_fused, torch.cuda.max_memory_allocated(device))
                torch.cuda.reset_peak_memory_stats(device)
            seq_s.append(timed(sequential, device))
            if device.type == "cuda":
                peak_seq = max(peak_seq, torch.cuda.max_memory_allocated(device))
        sync_s = timed(lambda: [group.sync(i) for i in range(width)], device)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of GPU memory"
        return row
    row["fused"] = samples / statistics.median(fused_s)
    row["sequential"] = samples / statistics.median(seq_s)
    row["speedup"] = row["fused"] / row["sequential"]
    row["state_kib"] = state_bytes(group) / width / 1024
    row["sync_ms"] = sync_s / width * 1000
    if device.type == "cuda":
        row["peak_fused_mib"] = peak_fused / width / 2**20
        row["peak_seq_mib"] = peak_seq / width / 2**20
    return row


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Section 1: fused against sequential, every model and width."""
    rows = []
    for model in args.models:
        for width in args.widths:
            row = measure(model, width, args)
            rows.append(row)
            if "error" in row:
                print(f"{model} B={width}: {row['error']}", file=sys.stderr)
                break  # wider only needs more memory
            print(
                f"{model} B={width}: fused {row['fused']:.0f}/s, sequential "
                f"{row['sequential']:.0f}/s (x{row['speedup']:.2f})",
                file=sys.stderr,
            )
    return rows


def fits(model: str, width: int, device: str) -> bool:
    """Whether a fused job of ``width`` members of ``model`` trains two steps on
    ``device`` without running out of memory (the members' own trainers alive beside it,
    as in a study)."""
    cls, base, lr = MODELS[model]
    config = {**base, "device": device}
    members: list[FusibleTrainer] = []
    try:
        members = [cls(config) for _ in range(width)]
        group = cls.fuse(members)
        for i in range(width):
            group.setup(i, {"lr": lr * (0.5 + i / width)})
        group.step()
        group.step()
        synchronize(torch.device(device))
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        group = None  # type: ignore[assignment]
        members.clear()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def widest(model: str, device: str, start: int = 64, cap: int = 1024) -> dict[str, Any]:
    """``fused_width_limit()`` of one trainer against the widest fused job that fits:
    doubling from ``start`` up to ``cap``, then bisection to within 1/8."""
    cls, base, _ = MODELS[model]
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    predicted = cls({**base, "device": device}).fused_width_limit()
    gc.collect()
    ok, bad, width = 0, None, start
    while width <= cap:
        if fits(model, width, device):
            ok, width = width, width * 2
        else:
            bad = width
            break
    while bad is not None and ok and bad - ok > max(1, ok // 8):
        mid = (ok + bad) // 2
        if fits(model, mid, device):
            ok = mid
        else:
            bad = mid
    return {"model": model, "predicted": predicted, "fits": ok, "oom": bad, "cap": cap}


def widths_table(rows: Sequence[dict[str, Any]]) -> str:
    """The predicted widths against the measured ones, as markdown."""
    table = [
        [
            r["model"],
            "-" if r["predicted"] is None else r["predicted"],
            r["fits"] if r["oom"] is not None else f">= {r['fits']} (probe cap)",
            "-" if r["oom"] is None else r["oom"],
        ]
        for r in rows
    ]
    return markdown_table(
        ["model", "fused_width_limit()", "widest that fit", "first that ran out"], table
    )


# ---------------------------------------------------------------------- end to end


def grid_study(
    fuse: bool,
    trials: int,
    steps: int,
    warmup: int,
    workers: int,
    eval_every: int = 1,
    *,
    config: Mapping[str, Any] | None = None,
    share: bool = True,
) -> dict[str, Any]:
    """The digits grid, as a user runs it: ``trials`` learning rates (log-spaced from
    0.005 to 0.5) after a shared warm-up of ``warmup`` steps at 0.05, ``steps`` steps
    each, submitted at once to a ``Study`` (``DigitsTrainer`` defaults, local worker
    processes, a fresh SQLite storage, ``eval_every`` 1 by default: the learning curve
    evaluated at every step). ``config`` is the trainer's fixed config (``{"device":
    "cuda"}`` on a GPU); ``share=False`` trains every trial alone from step 0. Wall time
    from the study's creation to its last result; worker busy time (training and
    evaluating, from the engine's counters)."""
    import asyncio
    import tempfile

    from stagetree import Study
    from stagetree.hp import Piecewise

    lrs = [0.005 * 100 ** (i / max(trials - 1, 1)) for i in range(trials)]
    with tempfile.TemporaryDirectory() as tmp:
        begin = time.perf_counter()
        with Study(
            "grid",
            DigitsTrainer,
            storage=f"sqlite:///{tmp}/plan.db",
            workers=workers,
            fuse=fuse,
            share=share,
            eval_every=eval_every,
        ) as study:

            async def grid() -> list[Any]:
                hps = [{"lr": Piecewise([0.05, lr], [warmup])} for lr in lrs]
                fixed = dict(config or {})
                return await asyncio.gather(*[study.submit(fixed, hp, steps) for hp in hps])

            results = study._drive(grid())
            seconds = time.perf_counter() - begin
            stats = study.stats()
            with study.reading() as storage:
                busy = storage.stats("engine")["device_seconds"]
    return {
        "seconds": seconds,
        "accuracy": [r.metrics["accuracy"] for r in results],
        "steps": stats["steps_executed"],
        "device": busy,
        "jobs": stats["fused_jobs"],
        "members": stats["fused_members"],
    }


def end_to_end(args: argparse.Namespace) -> str:
    """The digits grid with sharing alone against sharing + fusion: alternating runs,
    ``--e2e-repeats`` of each, medians."""
    trials, steps = (16, 40) if args.quick else (args.e2e_trials, args.e2e_steps)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(1 if args.quick else args.e2e_repeats):
        for fuse in (False, True):
            run = grid_study(
                fuse, trials, steps, args.e2e_warmup, args.workers, args.e2e_eval_every
            )
            runs[fuse].append(run)
            print(
                f"grid fuse={fuse}: {run['seconds']:.1f} s, device {run['device']:.1f} s",
                file=sys.stderr,
            )
    wall = {f: statistics.median(r["seconds"] for r in runs[f]) for f in runs}
    device = {f: statistics.median(r["device"] for r in runs[f]) for f in runs}
    acc = [abs(a - b) for a, b in zip(runs[False][0]["accuracy"], runs[True][0]["accuracy"])]
    first = runs[True][0]
    shape = f"{first['jobs']:.0f} x {first['members'] / max(first['jobs'], 1):.0f}"
    table = [
        [
            "sharing + fusion" if fuse else "sharing alone",
            int(runs[fuse][0]["steps"]),
            shape if fuse else "-",
            fmt(wall[fuse], 1),
            fmt(wall[False] / wall[fuse]),
            fmt(device[fuse], 1),
            fmt(device[False] / device[fuse]),
        ]
        for fuse in (False, True)
    ]
    head = (
        f"\n\nDigits grid end to end: {trials} learning rates after {args.e2e_warmup} shared "
        f"steps, {steps} steps each, {args.workers} workers, eval_every "
        f"{args.e2e_eval_every}; median of "
        f"{len(runs[True])} run(s) each. Final accuracy, fused vs unfused: max difference "
        f"{max(acc):.4f} over {len(acc)} trials.\n"
    )
    headers = [
        "run", "steps executed", "fused jobs x members", "wall s", "speed-up",
        "worker busy s", "busy-time saving",
    ]  # fmt: skip
    return head + markdown_table(headers, table)


# ---------------------------------------------------------------------- report


def report(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    info = machine_info()
    out = [
        f"Machine: {info['nproc']} cores, {info['cpu']}; torch {info.get('torch')}, "
        f"python {info['python']}; {info['date']}; load at the end {load_average()}",
        f"Setup: device {args.device}"
        + (f", {args.threads} torch thread(s)" if args.device == "cpu" else "")
        + f", {args.steps} steps x {args.repeats} rounds per mode (median round)\n",
    ]
    cuda = args.device.startswith("cuda")
    headers = [
        "model", "B", "fused samples/s", "sequential samples/s", "speedup",
        "state/model KiB", "sync ms/model",
    ] + (["peak/model MiB fused", "peak/model MiB seq."] if cuda else [])  # fmt: skip
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["model"], r["B"], r["error"], *["-"] * (len(headers) - 3)])
            continue
        line = [
            r["model"], r["B"], fmt(r["fused"], 0), fmt(r["sequential"], 0),
            fmt(r["speedup"]), fmt(r["state_kib"], 1), fmt(r["sync_ms"]),
        ]  # fmt: skip
        if cuda:
            line += [fmt(r["peak_fused_mib"], 1), fmt(r["peak_seq_mib"], 1)]
        table.append(line)
    out.append(markdown_table(headers, table))
    return "\n".join(out)


def plot(path: str, rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    """Throughput against B, fused and sequential, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in args.models if any(r["model"] == m and "fused" in r for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.0), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model and "fused" in r]
        widths = [r["B"] for r in mine]
        ax.plot(widths, [r["fused"] for r in mine], "o-", label="fused")
        ax.plot(widths, [r["sequential"] for r in mine], "s--", label="sequential")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("models B")
        ax.set_ylabel("samples/s, all models")
        ax.set_title(f"{model} ({args.device})", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("horizontal fusion: training throughput", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="widths 1, 4, 16; 1 round")
    parser.add_argument("--widths", default=None, help="comma-separated B (default 1..64)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    parser.add_argument("--models", default=None, help="mlp,cnn (+ resnet18 on cuda)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (3, quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (3, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument("--no-e2e", action="store_true", help="skip the digits grid study")
    parser.add_argument("--e2e-only", action="store_true", help="only the digits grid study")
    parser.add_argument("--e2e-trials", type=int, default=64, help="grid trials (64)")
    parser.add_argument("--e2e-steps", type=int, default=200, help="steps per trial (200)")
    parser.add_argument("--e2e-warmup", type=int, default=10, help="shared steps (10)")
    parser.add_argument("--e2e-repeats", type=int, default=2, help="runs of each (2)")
    parser.add_argument("--workers", type=int, default=2, help="study workers (2)")
    parser.add_argument(
        "--e2e-eval-every", type=int, default=1, help="the grid study's eval_every (1)"
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.widths:
        args.widths = [int(w) for w in args.widths.split(",")]
    else:
        args.widths = list(QUICK_WIDTHS if args.quick else WIDTHS)
    if args.models:
        args.models = args.models.split(",")
    else:
        args.models = ["mlp", "cnn"] + (["resnet18"] if args.device.startswith("cuda") else [])
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; known: {sorted(MODELS)}")
    args.steps = args.steps or (2 if args.quick else 3)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    rows = [] if args.e2e_only else throughput(args)
    text = "" if args.e2e_only else report(rows, args)
    if not args.no_e2e:
        text += end_to_end(args)
    print(text)
    if args.plot and rows:
        write_plot(args.plot, plot, rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
