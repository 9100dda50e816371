"""A driver with a native thread the Python side cannot see (CUDA's driver threads once
``torch.cuda.is_available()`` ran, for instance) forks its server, finds the thread
right after the fork and falls back, without Python 3.12's fork warning reaching the
user: the fork is the check, not a mistake."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stagetree

SCRIPT = textwrap.dedent(
    """
    import _thread
    import time
    from stagetree.executors import _driverfork

    if __name__ == "__main__":
        _thread.start_new_thread(time.sleep, (30,))  # not in threading's tables
        time.sleep(0.1)
        print("CONTEXT", _driverfork.driver_context([]), flush=True)
    """
)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.12 added the fork warning")
def test_a_driver_with_a_native_thread_falls_back_without_a_fork_warning(
    tmp_path: Path,
) -> None:
    script = tmp_path / "driver.py"
    script.write_text(SCRIPT)
    root = str(Path(stagetree.__file__).parents[1])
    done = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert "CONTEXT None" in done.stdout
    assert "multi-threaded" not in done.stderr, done.stderr
