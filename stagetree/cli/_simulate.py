"""``stagetree simulate SCRIPT.py``: the script's study in virtual time, with and without
sharing (:func:`stagetree.tools.simulate.simulate_script`)."""

from __future__ import annotations

import argparse
import math

from stagetree.cli._options import positive
from stagetree.tools.simulate import simulate_script

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree simulate SCRIPT.py``: the script's study in virtual time, with and
    without sharing (:func:`stagetree.tools.simulate.simulate_script`)."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
        return value

    def device_counts(text: str) -> int | list[int]:
        """``K`` (every worker) or ``K1,K2,...`` (a mixed cluster, one worker an entry)."""
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            raise argparse.ArgumentTypeError(
                f"expected an int >= 1 or a comma-separated list of them (1,1,2,4), got {text!r}"
            )
        return counts if "," in text else counts[0]

    def handler(args: argparse.Namespace) -> int:
        simulate_script(
            args.script,
            args.workers,
            policy=args.policy,
            step_seconds=args.step_seconds,
            devices_per_worker=args.devices_per_worker,
            parallel_efficiency=args.parallel_efficiency,
        )
        return 0

    def efficiency(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0.0 < value <= 1.0:  # NaN fails too
            raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
        return value

    p = sub.add_parser(
        "simulate",
        help="estimate a study's device-hours and makespan, with and without sharing",
        description="Load SCRIPT.py like `stagetree run` (its `study` and `tuner`; the "
        "study's storage and workers are not touched), run the tuner against simulated "
        "workers in virtual time (real plan, scheduler and tuner; a step-cost model and a "
        "synthetic learning curve instead of training), once with shared stages and once "
        "trial by trial, and print device-hours, makespan and steps of both.",
    )
    p.add_argument("script", metavar="SCRIPT.py", help="file defining `study` and `tuner`")
    p.add_argument(
        "--workers",
        type=positive,
        default=None,
        help="simulated workers (40; a mixed cluster: one per entry of its list)",
    )
    p.add_argument("--policy", choices=["critical_path", "bfs", "thr"], default="critical_path")
    p.add_argument(
        "--step-seconds",
        type=seconds,
        default=1.0,
        help="seconds per step at batch size 128 (1.0; larger batches are faster per step)",
    )
    p.add_argument(
        "--devices-per-worker",
        type=device_counts,
        default=None,
        metavar="K[,K...]",
        help="devices per worker: every trial trains data-parallel on all of its worker's "
        "devices; a list (1,1,2,4) is a mixed cluster of one worker per entry (default: "
        "the study's devices_per_worker, 1)",
    )
    p.add_argument(
        "--parallel-efficiency",
        type=efficiency,
        default=1.0,
        metavar="E",
        help="a step on K devices is 1 + (K - 1) * E times as fast as on one (1.0)",
    )
    p.set_defaults(handler=handler)
