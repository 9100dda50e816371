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
