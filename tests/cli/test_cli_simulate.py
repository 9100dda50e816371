"""``stagetree simulate --devices-per-worker``: one count for every worker, or a mixed
cluster as ``Study(devices_per_worker=[...])`` takes it (issue 25 item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_script import tiny_script

from stagetree.cli import main

HOUR = ["--step-seconds", "3600"]  # loads and saves are then negligible


def shared_row(out: str) -> list[str]:
    """The cells of the stage-based row."""
    line = next(line for line in out.splitlines() if "stage-based" in line)
    return [c.strip() for c in line.split("|")]


def test_a_mixed_cluster_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``1,1,2,4``: four workers owning 8 devices; at efficiency 1 a step costs one
    device-hour whichever worker runs it, so the 12 unique steps cost 12."""
    script = tiny_script(tmp_path / "tiny.py")
    assert main(["simulate", str(script), *HOUR, "--devices-per-worker", "1,1,2,4"]) == 0
    out = capsys.readouterr().out
    assert "on 4 workers of 1, 1, 2, 4 devices (8 devices, data-parallel efficiency 1)" in out
    cells = shared_row(out)
    assert float(cells[2]) == pytest.approx(12, rel=1e-2)
    # --workers may repeat the list's length.
    args = ["simulate", str(script), *HOUR, "--workers", "4", "--devices-per-worker", "1,1,2,4"]
    assert main(args) == 0
    assert shared_row(capsys.readouterr().out) == cells


def test_a_mixed_cluster_from_the_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the option, the script's ``Study(devices_per_worker=[1, 2])`` is the
    cluster (two workers, not the default 40)."""
    script = tiny_script(tmp_path / "tiny.py", 'storage="memory://", devices_per_worker=[1, 2]')
    assert main(["simulate", str(script), *HOUR]) == 0
    assert "on 2 workers of 1, 2 devices (3 devices" in capsys.readouterr().out
    # The option replaces the study's cluster.
    assert main(["simulate", str(script), *HOUR, "--devices-per-worker", "2"]) == 0
    assert "on 40 workers x 2 devices (80 devices" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "1,0", "1,,2", "1.5", "a,b", "", "2,", "-1"])
def test_bad_device_counts_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    script = tiny_script(tmp_path / "tiny.py")
    assert main(["simulate", str(script), f"--devices-per-worker={bad}"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--devices-per-worker: expected an int >= 1 or a comma-separated list of them "
        f"(1,1,2,4), got {bad!r}" in err
    )


def test_workers_that_disagree_with_the_list_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tiny_script(tmp_path / "tiny.py")
    args = ["simulate", str(script), "--workers", "2", "--devices-per-worker", "1,1,2,4"]
    assert main(args) == 2
    assert "--workers 2 disagrees with --devices-per-worker, a cluster of 4 workers" in (
        capsys.readouterr().err
    )
