"""benchmarks/vs_peers.py: a run says what its workers were forked from (a fresh fork
server imports torch before the first worker: seconds of the race's start-up, which
went unnoticed while the driver's allocator thread kept it from forking)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import vs_peers
    from stagetree.executors import _driverfork

    if __name__ == "__main__":
        _driverfork.driver_context([])
        print(vs_peers.fork_server(), flush=True)
        _driverfork.stop_server()
    """
)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_run_says_what_its_workers_were_forked_from(tmp_path: Path, fork: str) -> None:
    script = tmp_path / "which.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(ROOT / "benchmarks")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), STAGETREE_FORK_DRIVER=fork),
    ).stdout.strip()
    if fork == "1":
        assert out == "a fork of the driver"
    else:
        assert out == "a fresh interpreter ($STAGETREE_FORK_DRIVER is 0)"
