"""A lease whose holder is a dead process of this machine is released at once: a run
killed with ``kill -9`` is resumed without waiting for its leases to expire; and an
engine's leases outlive the database outages it rides through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from stagetree.engine.coordination import Coordinator
from stagetree.plan import open_storage
from stagetree.plan import sql as sql_module
from stagetree.plan.leases import Lease, machine_key, new_owner
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.sql import SQLPlanStorage

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


class _Clock:
    """``time`` of a module, with a ``time()`` the test moves."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize("window", [30.0, 5.0])
def test_a_stage_lease_outlives_a_database_outage_its_holder_rides_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: float
) -> None:
    """The holder cannot renew its leases while the database is out of reach. With the
    default time-to-live (15 s) shorter than the ride-through window (30 s), its lease
    on a stage expired during a long outage, and another engine claimed the stage the
    moment the database was back, while the holder, riding the outage through, still
    trained it: a stage trained twice."""
    monkeypatch.delenv("STAGETREE_LEASE_TTL", raising=False)
    clock = _Clock()
    monkeypatch.setattr(sql_module, "time", clock)
    storage = SQLPlanStorage(f"sqlite:///{tmp_path / 'plan.db'}", retry_seconds=window)
    holder = Coordinator(cast(Any, SimpleNamespace(storage=storage)))
    assert holder.storage.retry_seconds == window
    assert storage.claim(holder.owner, "r", [(1, 0, 10)], holder.ttl).ok
    # The outage begins a renewal interval after the last renewal and ends at the edge
    # of the window; the holder's last try (a connection attempt) takes 10 s more.
    clock.now += holder.ttl / 5 + window + min(window, 10.0)
    other = new_owner()
    late = storage.claim(other, "r", [(1, 5, 6)], holder.ttl)
    assert not late.ok and late.conflicts[0].owner == holder.owner
    # The holder renews once it is back: its lease is still its own.
    assert storage.renew(holder.owner, holder.ttl) == 1
    storage.close()


def test_an_explicit_lease_ttl_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STAGETREE_LEASE_TTL", "3")
    storage = SQLPlanStorage(f"sqlite:///{tmp_path / 'plan.db'}", retry_seconds=30)
    assert Coordinator(cast(Any, SimpleNamespace(storage=storage))).ttl == 3.0
    storage.close()
    monkeypatch.delenv("STAGETREE_LEASE_TTL")
    assert Coordinator(cast(Any, SimpleNamespace(storage=MemoryPlanStorage()))).ttl == 15.0
