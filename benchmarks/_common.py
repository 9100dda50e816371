"""Helpers shared by the benchmarks: machine facts, markdown tables, medians, bar plots,
and a :class:`CountingDigitsTrainer` that counts its ``train()`` calls across processes.

Counting works in every runner (stagetree's worker processes, Ray actors, Optuna in the
calling process): when the environment variable :data:`COUNTER_ENV` names a file, every
``train()`` call appends one byte to it (``O_APPEND`` writes are atomic), so the file's
size is the number of steps executed. Worker processes inherit the variable from the
process that starts them. One append costs a few microseconds, against tens of
milliseconds per step.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stagetree.torch.examples import DigitsConvTrainer, DigitsTrainer

__all__ = [
    "COUNTER_ENV",
    "CountingDigitsTrainer",
    "EpochConvTrainer",
    "bar_plot",
    "count_steps",
    "fmt",
    "machine_info",
    "markdown_table",
    "median",
]

#: Environment variable naming the file that counts ``train()`` calls.
COUNTER_ENV = "STAGETREE_BENCH_COUNTER"

_fds: dict[str, int] = {}


def _bump() -> None:
    path = os.environ.get(COUNTER_ENV)
    if not path:
        return
    fd = _fds.get(path)
    if fd is None:
        fd = _fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b".")


def count_steps(path: str | os.PathLike[str]) -> int:
    """``train()`` calls recorded in the counter file ``path`` (0 when it is missing)."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


class CountingDigitsTrainer(DigitsTrainer):
    """:class:`~stagetree.torch.examples.DigitsTrainer` that records each ``train()``
    call in the file named by :data:`COUNTER_ENV` (see the module docstring)."""

    def train(self) -> dict[str, float]:
        out = super().train()
        _bump()
        return out


class EpochConvTrainer(DigitsConvTrainer):
    """:class:`~stagetree.torch.examples.DigitsConvTrainer` whose step is one epoch: one
    pass over the training split (1348 samples) at the current batch size, so
    ``ceil(1348 / batch_size)`` minibatches (the last one smaller), whatever the
    ``batch_size`` sequence says; ``batches_per_step`` is ignored. Counts its ``train()``
    calls like :class:`CountingDigitsTrainer`."""

    @property  # type: ignore[override]
    def updates_per_step(self) -> int:
        return len(self.loader)  # batches in one whole epoch at the current batch size

    @updates_per_step.setter
    def updates_per_step(self, value: int) -> None:
        pass  # the base class sets batches_per_step here: a step is an epoch instead

    def train(self) -> dict[str, float]:
        out = super().train()
        _bump()
        return out


# ---------------------------------------------------------------------- machine


def _run(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, str]:
    """Facts to print next to timings: date, cores, CPU model, load, versions."""
    cpu = ""
    for line in _run(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            cpu = line.split(":", 1)[1].strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": _run(["nproc"]) or str(os.cpu_count()),
        "cpu": cpu or platform.processor() or "unknown",
        "load": f"{load} (1/5/15 min, `uptime`)",
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - the benchmarks need torch anyway
        pass
    return info


def load_average() -> str:
    """The 1-minute load average, formatted."""
    return f"{os.getloadavg()[0]:.2f}"


# ---------------------------------------------------------------------- tables


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats with ``digits`` decimals, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells go through :func:`fmt`."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
    return "\n".join(lines)


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------- plots


def write_plot(path: str, draw: Callable[..., None], *args: Any) -> None:
    """``draw(path, *args)``, then say where the plot went; without matplotlib, say
    that instead of failing (it is a benchmark-only dependency)."""
    try:
        draw(path, *args)
        print(f"\nplot written to {path}")
    except ImportError:
        print("\nmatplotlib is not installed: no plot", file=sys.stderr)


def bar_plot(
    path: str,
    panels: Sequence[tuple[str, Sequence[str], Sequence[float], str]],
    title: str,
    notes: Mapping[int, Sequence[str]] | None = None,
    ylims: Mapping[int, tuple[float, float]] | None = None,
) -> None:
    """Write bar charts, three to a row, to ``path`` (PNG).

    Args:
        path: output file.
        panels: ``(title, labels, values, y label)`` for each panel.
        title: figure title.
        notes: panel index -> one text label per bar, written above the bars.
        ylims: panel index -> y-axis range.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 4.0 * nrows), squeeze=False)
    for k in range(len(panels), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    for i, (ptitle, labels, values, ylabel) in enumerate(panels):
        ax = axes[i // ncols][i % ncols]
        bars = ax.bar(range(len(values)), values, color=[f"C{k}" for k in range(len(values))])
        ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(ptitle, fontsize=10)
        ax.set_ylabel(ylabel)
        texts = (notes or {}).get(i) or [f"{v:.3g}" for v in values]
        for bar, text in zip(bars, texts):
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.margins(y=0.15)
        if ylims and i in ylims:
            ax.set_ylim(*ylims[i])
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
