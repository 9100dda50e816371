"""Out-of-memory recovery on a real CUDA device (issue 25 item 4, TreeML §5.2), in
under a minute.

Two studies of the digits MLP on one GPU (``executor="inline"``, one worker):

1. ``fused``: four learning rates fused into one job whose fused step allocates
   ``0.3 x`` the free device memory per member: four members ask for 1.2x what is free
   and the allocator raises ``torch.cuda.OutOfMemoryError``; the worker trains the job
   again at half the width (two jobs of two, 0.6x each), and the results match the
   unfused ones within the fusion tolerance.
2. ``too large``: a trial whose step allocates 1.5x the device's total memory runs
   out of memory on the largest (the only) worker: it fails with an error naming the
   need instead of retrying for ever.

Without CUDA (``DEVICE=cpu``) the device part is skipped: the same two studies run on
the CPU against a fake 8 GiB device that raises the real exception class (a rehearsal
of the script). Then the recovery is shown in the simulator: a mixed cluster of 1-,
1- and 2-device workers where the trials of one tree need two devices
(``memory_devices``): they run out of memory once on a small worker, then train on the
large one.

Run::

    .venv/bin/python benchmarks/gpu_oom.py            # on a CUDA machine
    DEVICE=cpu .venv/bin/python benchmarks/gpu_oom.py # rehearsal on a CPU
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import markdown_table

from stagetree.exceptions import TrialFailedError
from stagetree.hp import Constant, Piecewise
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.tools.simulate import simulate
from stagetree.tuners import GridSearch

RATES = (0.02, 0.05, 0.1, 0.2)
STEPS = 8


try:  # the device part needs torch; the simulated one does not
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fakes"))
    from fused_oom import WidthFused

    from stagetree.torch.examples import DigitsTrainer
except ImportError:  # pragma: no cover
    torch = None
    DigitsTrainer = WidthFused = object  # type: ignore[assignment,misc]


def _device() -> str:
    if os.environ.get("DEVICE", "cuda") == "cpu" or torch is None:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class Device:
    """Where the trainers allocate: the CUDA device, or (rehearsal on a CPU) a fake
    device of ``FAKE_BYTES`` that raises the real exception class when over."""

    FAKE_BYTES = 8 * 2**30
    cuda = False

    @classmethod
    def memory(cls) -> tuple[int, int]:
        """``(free, total)`` bytes."""
        if cls.cuda:
            free, total = torch.cuda.mem_get_info()
            return int(free), int(total)
        return cls.FAKE_BYTES, cls.FAKE_BYTES

    @classmethod
    def allocate(cls, nbytes: int) -> None:
        """Allocate ``nbytes`` on the device and free them again."""
        if cls.cuda:
            block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            del block
        elif nbytes > cls.FAKE_BYTES:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (rehearsal). Tried to allocate {nbytes / 2**30:.2f} GiB"
            )


class WideFused(WidthFused):  # type: ignore[misc,valid-type]
    """Each member of a fused step allocates ``per_member`` bytes on the device."""

    per_member: ClassVar[int] = 0

    @classmethod
    def allocate_fused(cls, width: int) -> None:
        Device.allocate(width * cls.per_member)


class TooLarge(DigitsTrainer):  # type: ignore[misc,valid-type]
    """Every step allocates 1.5x the device's memory."""

    def train(self) -> Any:
        Device.allocate(int(1.5 * Device.memory()[1]))
        return super().train()


async def _together(study: Study, trials: list[tuple[dict[str, Any], Any]]) -> list[Any]:
    """Submit the trials at once (so that the scheduler can fuse them) and wait."""
    return list(await asyncio.gather(*(study.submit(c, hp, STEPS) for c, hp in trials)))


def on_device(device: str) -> bool:
    """The two studies on ``device`` ("cuda", or "cpu" with the fake allocator); True
    when both recovered as they should."""
    Device.cuda = device == "cuda"
    config = {"dropout": 0.0, "batches_per_step": 2, "hidden": 32, "device": device}
    trials = [{"lr": Piecewise([0.05, lr], [3])} for lr in RATES]
    free, total = Device.memory()
    WideFused.per_member = int(0.3 * free)
    name = torch.cuda.get_device_name() if Device.cuda else "fake device (rehearsal)"
    print(
        f"{name}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}; a fused member "
        f"allocates {WideFused.per_member / 2**30:.1f} GiB"
    )

    def grid(fuse: bool) -> tuple[list[dict[str, float]], float]:
        begin = time.perf_counter()
        study = Study("oom", WideFused, storage="memory://", executor="inline", fuse=fuse)
        with study, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = asyncio.run(_together(study, [(config, hp) for hp in trials]))
        return [r.metrics for r in results], time.perf_counter() - begin

    WideFused.widths.clear()
    fused, fused_s = grid(True)
    widths = list(WideFused.widths)
    exact, exact_s = grid(False)
    rows = [
        (f"lr {lr}", f["accuracy"], e["accuracy"], abs(f["loss"] - e["loss"]) / e["loss"])
        for lr, f, e in zip(RATES, fused, exact)
    ]
    print(f"\n## fused: widths tried {widths} ({fused_s:.1f} s; unfused {exact_s:.1f} s)\n")
    print(markdown_table(["trial", "fused accuracy", "unfused accuracy", "loss rel. diff"], rows))
    fused_ok = widths[:2] == [4, 2] and all(r[1] == r[2] and r[3] < 1e-4 for r in rows)
    print(f"\nrecovered at half the width: {'yes' if fused_ok else 'NO'}")

    print("\n## too large for the largest worker\n")
    large_ok = False
    with Study("big", TooLarge, storage="memory://", executor="inline") as study:
        try:
            study.run(config, {"lr": Constant(0.05)}, 2)
            print("NO: the trial did not fail")
        except TrialFailedError as exc:
            large_ok = "needs more than 1 device" in str(exc)
            print(f"failed as expected: {str(exc).splitlines()[0]}")
    return fused_ok and large_ok


def simulated() -> None:
    space = GridSpace(hp={"lr": [Constant(lr) for lr in RATES]}, fixed={"width": [1, 2]})
    rows = []
    for cluster in ([1, 1, 2], [2, 2], [1, 1]):
        tuner = GridSearch(space, "accuracy", steps=20)
        result = simulate(
            None,
            tuner,
            devices_per_worker=cluster,
            memory_devices=lambda config: int(config["width"]),
        )
        rows.append(
            (
                str(cluster),
                len(tuner.results),  # the trials that did not fail
                result.trials,
                result.makespan,
                result.device_hours * 3600,
            )
        )
    print("\n## simulated: trials of width 2 need two devices\n")
    print(
        markdown_table(
            ["workers' devices", "trials done", "trials", "makespan (s)", "device-seconds"], rows
        )
    )


def main() -> None:
    begin = time.perf_counter()
    device = _device()
    if device == "cpu":
        print("skipped on the device: no CUDA device (DEVICE=cpu); rehearsal with a fake one")
    ok = torch is None or on_device(device)
    simulated()
    print(f"\n{'ok' if ok else 'FAILED'}: {time.perf_counter() - begin:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
