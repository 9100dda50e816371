"""A lease whose holder is a dead process of this machine is released at once: a run
killed with ``kill -9`` is resumed without waiting for its leases to expire."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from stagetree.plan import open_storage
from stagetree.plan.leases import Lease, machine_key, new_owner

ROOT = Path(__file__).resolve().parents[2]


def _lease(owner: str, pid: int, host: str | None = None) -> Lease:
    import socket

    now = time.time()
    return Lease(1, owner, "s", None, 0, 0, host or socket.gethostname(), pid, now, now + 60)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_holder_of_this_machine_holds_nothing() -> None:
    now = time.time()
    dead = _dead_pid()
    assert not _lease(new_owner(), dead).live(now)
    assert _lease(new_owner(), os.getpid()).live(now)  # a running holder
    # Unknown machines, or owners without a machine key: only expiry ends them.
    assert _lease(f"{'0' * 32}@{'f' * 12}", dead).live(now)
    assert _lease("plain-owner", dead).live(now)
    assert _lease(new_owner(), dead, host="another-host").live(now)
    assert new_owner().endswith("@" + machine_key()) and len(new_owner()) <= 64


def test_a_study_lease_of_a_killed_run_is_taken_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    script = textwrap.dedent(
        f"""
        import sys, time
        from stagetree.plan import open_storage
        from stagetree.plan.leases import new_owner
        storage = open_storage({url!r})
        assert storage.claim_study(new_owner(), "s", 3600.0).ok
        print("held", flush=True)
        time.sleep(3600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"held"
        storage = open_storage(url)
        try:
            assert not storage.claim_study(new_owner(), "s", 60.0).ok  # alive: busy
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert storage.claim_study(new_owner(), "s", 60.0).ok  # dead: free at once
        finally:
            storage.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
