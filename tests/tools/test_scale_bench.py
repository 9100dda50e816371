"""benchmarks/scale_bench.py: a run says how far it got as it goes."""

from __future__ import annotations

import pytest
from bench_module import bench_module


def test_progress_prints_batches_and_cpu_as_the_run_goes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``progress=B``: a line every B batches started (a run stopped early by its
    timeout still says how far it got and at what CPU cost)."""
    got = bench_module("scale_bench").run_one("asha", 12, 2, "memory", progress=4)
    lines = capsys.readouterr().err.splitlines()
    assert got["decisions"] >= 12
    assert len(lines) == got["decisions"] // 4
    assert lines[0].startswith("asha N=12 W=2: 4 batches, ")
    assert lines[0].endswith(" s CPU")


def test_progress_says_the_cost_and_the_instants_per_batch_of_each_window(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each progress line gives, since the line before, the CPU and the virtual instants
    delivered per batch (a driver round each: they grow as workers drift out of step),
    and the run's figures count the instants."""
    got = bench_module("scale_bench").run_one("asha", 12, 2, "memory", progress=4)
    lines = capsys.readouterr().err.splitlines()
    assert got["instants"] > 0
    assert all(" ms CPU and " in line and " instants per batch, virtual clock " in line
               for line in lines)  # fmt: skip
