"""The memory plan drops the leases that are no longer live (deadline passed, or held
by a dead process of this machine) at each claim without looking at every lease: a
heap of deadlines, and each holder's process checked once (a claim per batch, a lease
per worker: with 1,000 workers the pass over every lease, a process check each, was a
seventh of the driver's time)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from stagetree.plan import memory as memory_module
from stagetree.plan.leases import Lease, new_owner
from stagetree.plan.memory import MemoryPlanStorage


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", range(6))
def test_expiry_drops_exactly_the_leases_that_are_not_live(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    clock = _Clock()
    monkeypatch.setattr(memory_module.time, "time", clock.time)
    dead = _dead_pid()
    owners = [new_owner() for _ in range(3)]
    holders = {owners[0]: None, owners[1]: None, owners[2]: dead}  # owners[2] is dead
    plan = MemoryPlanStorage()
    here = memory_module.host_pid()
    for _ in range(400):
        op = rng.random()
        owner = rng.choice(owners)
        pid = holders[owner]
        monkeypatch.setattr(memory_module, "host_pid", lambda p=pid: (here[0], p or here[1]))
        if op < 0.45:
            node = rng.randrange(1, 30)
            with plan._lock:  # what is live before the claim's own expiry
                now = clock.now
                expected = {k for k, v in plan._leases.items() if v.live(now)}
                plan._expire(now)
                assert set(plan._leases) == expected
            plan.claim(owner, "root", [(node, 0, rng.randrange(1, 9))], rng.uniform(1, 20))
        elif op < 0.55:
            plan.claim_study(owner, rng.choice("ab"), rng.uniform(1, 20))
        elif op < 0.7:
            plan.renew(owner, rng.uniform(0.5, 25))  # sooner or later than before
        elif op < 0.8:
            mine = [k for k, v in plan._leases.items() if v.owner == owner]
            plan.release(owner, rng.sample(mine, min(len(mine), 2)))
        else:
            clock.now += rng.uniform(0, 6)
        now = clock.now
        live = {k for k, v in plan._leases.items() if v.live(now)}
        assert {v.id for v in plan.leases(live_only=True)} == live


def test_a_claim_checks_each_holder_once_not_each_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = MemoryPlanStorage()
    owner = new_owner()
    for node in range(1, 101):
        assert plan.claim(owner, "root", [(node, 0, 4)], 60.0).ok
    checks = []
    real = Lease.holder_dead

    def counted(self: Lease) -> bool:
        checks.append(self.id)
        return real(self)

    monkeypatch.setattr(Lease, "holder_dead", counted)
    assert plan.claim(owner, "root", [(500, 0, 4)], 60.0).ok
    assert len(checks) <= 1  # one holder: one process check (was one per lease: 100)
    assert len(plan.leases()) == 101
