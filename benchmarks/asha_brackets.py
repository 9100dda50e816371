"""ASHA's one bracket against the ASHA paper's production brackets (issue 25 item 3).

Two allocations of new configurations, side by side on the same studies and seeds:

* ``1 bracket``: ASHA with one bracket (``brackets=1``), every configuration starts at
  the bottom rung (the paper's Algorithm 2 with ``s = 0``);
* ``production``: brackets ``s = 0, 1, 2`` (``brackets=3``), new configurations
  assigned in proportion to the inverse of a bracket's budget (``allocation="budget"``,
  :func:`stagetree.tuners.asha.bracket_shares`).

Measure: the best accuracy reached (by a trial trained to ``max_steps``) against the
device-seconds spent, as results arrive; the table gives it at fixed shares of the
one-bracket run's device-seconds (25 %, 50 %, 100 %) and at the end, with the total
device-seconds and the end-to-end time, averaged over the seeds.

Studies:

* **Paper studies, simulated** (virtual time, the cost models and cluster of
  ``benchmarks/paper_studies.py``: 40 workers, sharing on): ASHA with reduction 4 and
  rungs 15, 60, 120 epochs on the ResNet-56 space (448 trials, as the paper's Table
  1), the MobileNetV2 space (240) and the ResNet-20 space (144).
* **Digits, real training**: ``DigitsTrainer`` (an MLP on scikit-learn's digits, as
  ``examples/digits.py``) on a random space of learning-rate schedules, momentum and
  batch size, 48 trials, rungs 1, 4, 16 steps, 2 local workers; device-seconds are the
  study's measured worker-seconds (noisy on a loaded machine: compare the two rows of
  one seed, measured in one run).

Run: ``python benchmarks/asha_brackets.py [--seeds 3] [--only paper|digits] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_spaces import EPOCHS, mobilenetv2_space, resnet20_space, resnet56_space  # noqa: E402
from paper_studies import (  # noqa: E402
    DEVICES,
    _mobilenet_options,
    _resnet20_options,
    _resnet_options,
)

from stagetree.executors.simulated import SimulatedExecutor  # noqa: E402
from stagetree.tools.simulate import format_table, simulate  # noqa: E402
from stagetree.tuners.asha import ASHA  # noqa: E402
from stagetree.tuners.base import Job  # noqa: E402

#: The two settings compared: (label, ASHA keyword arguments).
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("1 bracket", {"brackets": 1, "allocation": "round_robin"}),
    ("production", {"brackets": 3, "allocation": "budget"}),
]
FRACTIONS = (0.5, 1.0, 2.0)


@dataclass
class Curve:
    """Best full-budget accuracy against device-seconds, as results arrived."""

    points: list[tuple[float, float]] = field(default_factory=list)  # (device s, best)
    device_seconds: float = 0.0
    seconds: float = 0.0  # end to end (virtual or wall)

    def best_at(self, spent: float) -> float | None:
        best = None
        for at, value in self.points:
            if at > spent:
                break
            best = value
        return best

    def spent_to_reach(self, value: float | None) -> float | None:
        """Device-seconds spent when the best first reached ``value`` (None: never)."""
        if value is None:
            return None
        return next((at for at, best in self.points if best >= value), None)

    @property
    def final(self) -> float | None:
        return self.points[-1][1] if self.points else None


class WatchedASHA(ASHA):
    """ASHA that records, for each result at ``max_steps``, the device-seconds spent so
    far (``spent()``) and the best such accuracy."""

    def __init__(self, *args: Any, spent: Callable[[], float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spent = spent
        self.curve = Curve()

    def _observe(self, job: Job) -> float:
        value = super()._observe(job)
        result = job.result()
        if result is not None and job.steps == self.max_steps:
            acc = float(result.metrics[self.metric])
            prev = self.curve.final
            best = acc if prev is None else max(prev, acc)
            self.curve.points.append((self.spent(), best))
        return value


def _sim_spent(executor: SimulatedExecutor) -> float:
    """Device-seconds so far: finished batches, and running ones up to now."""
    running = sum(
        max(executor.now - run.t0, 0.0)
        for run in executor._runs.values()  # a benchmark may look inside
        if not run.finished
    )
    return executor.device_seconds + running * executor.devices_per_worker


# --------------------------------------------------------------------------- paper studies


def paper_run(
    space: Any, n: int, options: dict[str, Any], seed: int, kw: dict[str, Any], min_steps: int
) -> Curve:
    box: dict[str, SimulatedExecutor] = {}
    tuner = WatchedASHA(
        space,
        "accuracy",
        min_steps=min_steps,
        max_steps=EPOCHS,
        eta=4,
        num_trials=n,
        seed=seed,
        spent=lambda: _sim_spent(box["ex"]),
        **kw,
    )
    result = simulate(
        None, tuner, DEVICES, True, watch=lambda ex: box.setdefault("ex", ex), **options
    )
    tuner.curve.device_seconds = result.device_hours * 3600.0
    tuner.curve.seconds = result.makespan
    assert result.steps_executed >= result.steps_unique
    return tuner.curve


def paper_studies(seeds: int, quick: bool) -> list[tuple[str, list[list[Curve]]]]:
    # (name, space, trials, cost model, first rung): rungs 15, 60, 120 epochs as the
    # paper's Table 1 (3 rungs), and 1, 4, 16, 64, 120 (5 rungs, the production
    # section's setting) on the ResNet-20 space
    studies: list[tuple[str, Any, int, dict[str, Any], int]] = [
        ("ResNet-56", resnet56_space(), 448, _resnet_options(), 15),
        ("MobileNetV2", mobilenetv2_space(), 240, _mobilenet_options(), 15),
        ("ResNet-20", resnet20_space(), 144, _resnet20_options(), 15),
        ("ResNet-20", resnet20_space(), 288, _resnet20_options(), 1),
    ]
    if quick:
        studies = studies[2:]
    out = []
    for name, space, n, options, first in studies:
        per_seed = []
        for seed in range(seeds):
            per_seed.append([paper_run(space, n, options, seed, kw, first) for _, kw in VARIANTS])
        rungs = "3 rungs" if first == 15 else "5 rungs"
        out.append((f"{name} (sim, {n} trials, {rungs})", per_seed))
    return out


# --------------------------------------------------------------------------- digits


def digits_space() -> Any:
    from stagetree.distributions import Choice, LogUniform
    from stagetree.hp import Constant, Cosine, MultiStep
    from stagetree.space import RandomSpace

    return RandomSpace(
        hp={
            "lr": Choice(
                [
                    MultiStep(LogUniform(0.01, 0.5), [8, 12], 0.1),
                    Constant(LogUniform(0.01, 0.5)),
                    Cosine(LogUniform(0.01, 0.5), 16),
                ]
            ),
            "momentum": Choice([0.0, 0.5, 0.9]),
            "batch_size": Choice([32, 64, 128]),
        },
        fixed={"optimizer": "momentum", "hidden": 128, "layers": 2, "batches_per_step": 8},
    )


def digits_run(seed: int, kw: dict[str, Any], n: int, workers: int) -> Curve:
    from stagetree.study import Study
    from stagetree.torch.examples import DigitsTrainer

    with tempfile.TemporaryDirectory(prefix="asha-brackets-") as tmp:
        study = Study(
            "digits",
            DigitsTrainer,
            storage=f"sqlite:///{tmp}/plan.db",
            checkpoint_dir=f"{tmp}/ckpt",
            workers=workers,
        )
        with study:
            tuner = WatchedASHA(
                digits_space(),
                "accuracy",
                min_steps=1,
                max_steps=16,
                eta=4,
                num_trials=n,
                seed=seed,
                spent=lambda: float(study.stats()["device_seconds"]),
                **kw,
            )
            started = time.perf_counter()
            study.tune(tuner, progress=False)
            tuner.curve.seconds = time.perf_counter() - started
            tuner.curve.device_seconds = float(study.stats()["device_seconds"])
    return tuner.curve


def digits(seeds: int, quick: bool) -> list[tuple[str, list[list[Curve]]]]:
    n = 24 if quick else 48
    digits_run(99, VARIANTS[0][1], 4, 2)  # warm-up: worker processes, imports, data
    per_seed = []
    for seed in range(seeds):
        per_seed.append([digits_run(seed, kw, n, 2) for _, kw in VARIANTS])
    return [(f"digits (real, {n} trials)", per_seed)]


# --------------------------------------------------------------------------- table


def _mean(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    return f"{statistics.fmean(known):.4f}" + ("" if len(known) == len(values) else "*")


def table(rows: list[tuple[str, list[list[Curve]]]], unit: float, name: str) -> str:
    """One line per study and setting, seconds shown in ``name`` (``unit`` seconds)."""
    headers = ["study", "ASHA", *[f"best @{int(f * 100)}%" for f in FRACTIONS]]
    headers += ["best (end)", f"device-{name} to 1-bracket best", f"device-{name}"]
    headers += ["vs 1 bracket", f"end-to-end {name}"]
    lines = []
    for name, per_seed in rows:
        for v, (label, _) in enumerate(VARIANTS):
            cells: list[Any] = [name if v == 0 else "", label]
            for f in FRACTIONS:
                cells.append(_mean([s[v].best_at(f * s[0].device_seconds) for s in per_seed]))
            cells.append(_mean([s[v].final for s in per_seed]))
            reach = [s[v].spent_to_reach(s[0].final) for s in per_seed]
            cells.append(_mean([None if r is None else r / unit for r in reach]))
            dev = [s[v].device_seconds for s in per_seed]
            cells.append(f"{statistics.fmean(dev) / unit:.3f}")
            ratio = statistics.fmean([s[v].device_seconds / s[0].device_seconds for s in per_seed])
            cells.append(f"{ratio:.2f}x")
            cells.append(f"{statistics.fmean([s[v].seconds for s in per_seed]) / unit:.3f}")
            lines.append(cells)
    return format_table(headers, lines)


def per_seed(rows: list[tuple[str, list[list[Curve]]]]) -> str:
    """Each seed's best at the 1-bracket run's device-seconds and at the end, and the
    production run's device-seconds against the 1-bracket run's."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    lines = []
    for name, seeds in rows:
        parts = []
        for seed, (one, prod) in enumerate(seeds):
            at = one.device_seconds
            parts.append(
                f"seed {seed}: @100% {cell(one.best_at(at))} vs {cell(prod.best_at(at))}, "
                f"end {cell(one.final)} vs {cell(prod.final)}, "
                f"{prod.device_seconds / one.device_seconds:.2f}x"
            )
        lines.append(f"{name}: " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", choices=("paper", "digits"))
    parser.add_argument("--quick", action="store_true", help="one paper study, fewer trials")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.only in (None, "paper"):
        rows = paper_studies(args.seeds, args.quick)
        print(table(rows, 3600.0, "h"), "\n", per_seed(rows), "\n", sep="\n")
    if args.only in (None, "digits"):
        rows = digits(args.seeds, args.quick)
        print(table(rows, 1.0, "s"), "\n", per_seed(rows), "\n", sep="\n")
    print(
        f"{args.seeds} seeds; best @x%: mean best accuracy of a trial trained to max_steps "
        "once x% of the 1-bracket run's device-seconds were spent ('-': none yet; '*': some "
        f"seeds had none yet). load average {os.getloadavg()[0]:.1f}; "
        f"{time.perf_counter() - started:.0f} s."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
