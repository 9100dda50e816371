"""Run a script many times in fresh interpreters, a few at a time, each with a timeout:
what the exit-path tests share."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Exit:
    """How one run of a script ended (``returncode`` None: it hung past its timeout)."""

    run: int
    returncode: int | None
    stderr: str

    def clean(self, code: int = 0) -> bool:
        return self.returncode == code and "Exception ignored" not in self.stderr


def run_many(
    script: Path, runs: int, args: list[str], at_once: int = 4, timeout: float = 60.0
) -> list[Exit]:
    """Run ``python script <run> *args`` ``runs`` times, ``at_once`` in parallel; a run
    still alive ``timeout`` seconds after its start is killed and counted as hung."""
    out: list[Exit] = []
    for first in range(0, runs, at_once):
        procs = [
            (
                i,
                subprocess.Popen(
                    [sys.executable, str(script), str(i), *args],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=script.parent,
                ),
            )
            for i in range(first, min(runs, first + at_once))
        ]
        deadline = time.monotonic() + timeout
        for i, proc in procs:
            try:
                _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                out.append(Exit(i, proc.returncode, err))
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                out.append(Exit(i, None, err))
    return out
