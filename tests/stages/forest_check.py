"""A check that the state the scheduler keeps across decisions equals the state listed
from scratch, before every stage tree: the batches' inputs in its forest, the models in
memory, the idle workers by position, the running batches by promised evaluation, those
that promise nothing live, by worker and with a downstream, the batches by the
checkpoints asked of them, and the workers by their devices. The fixture
``checked_forest`` (imported by ``test_forest_batches.py``), or a pytest plugin for any
suite (``-p forest_check`` with ``tests/stages`` on the path)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from stagetree.scheduler import core


def scratch_inputs(scheduler: core.Scheduler) -> tuple[dict[str, Any], dict[Any, int]]:
    """The batches' inputs per plan tree and the models in memory, listed from the
    running and saving batches themselves (as the scheduler listed them per decision
    before it kept them)."""
    nodes = scheduler.nodes
    running: list[Any] = []
    promised: set[Any] = set()
    for b in scheduler._active():
        running.append(core.Scheduler._running_position(b))
        promised |= b.evaluate
    memory: dict[Any, int] = {}
    for b in scheduler._saving.values():
        promised.update(b.parked)
        at = scheduler._worker_at.get(b.worker)
        if at is not None and b.worker in scheduler._idle and at in b.checkpoint:
            memory[at] = b.worker
        keys = tuple(k for k in b.checkpoint if k not in memory)
        if keys:
            running.append(core.RunningPosition(b.batch_id, (), b.position, keys))
    out: dict[str, tuple[list[Any], set[Any]]] = {}
    for pos in running:
        if pos.segments or pos.saving:
            first = pos.segments[0][0] if pos.segments else pos.saving[0][0]
            out.setdefault(nodes[first].root_key, ([], set()))[0].append(pos)
    for key in promised:
        out.setdefault(nodes[key[0]].root_key, ([], set()))[1].add(key)
    inputs = {k: (tuple(r), frozenset(p)) for k, (r, p) in out.items() if r or p}
    return inputs, memory


def check(scheduler: core.Scheduler) -> None:
    """Raise AssertionError where the forest's kept inputs differ from scratch."""
    scheduler._report_batches()
    inputs, memory = scratch_inputs(scheduler)
    assert scheduler._forest.batch_inputs() == inputs
    # The models in memory are kept per position across decisions: their order carries
    # no meaning (every reader looks them up), so they are compared as a mapping.
    assert scheduler._memory == memory
    idle_at: dict[Any, set[int]] = {}
    for w in scheduler._idle:
        at = scheduler._worker_at.get(w)
        if at is not None:
            idle_at.setdefault(at, set()).add(w)
    assert scheduler._idle_at == idle_at
    assert scheduler._idle_key == {w: at for at, ws in idle_at.items() for w in ws}
    evaluators: dict[Any, set[int]] = {}
    for b in scheduler._batches.values():
        for key in b.evaluate:
            evaluators.setdefault(key, set()).add(b.batch_id)
    assert scheduler._evaluators == evaluators
    live = scheduler._requests
    unneeded = {
        b.batch_id
        for b in scheduler._batches.values()
        if not any(key in live for key in b.evaluate)
    }
    assert scheduler._unneeded == unneeded
    for b in (*scheduler._batches.values(), *scheduler._saving.values()):
        assert b.checkpoint <= b.indexed and b.parked.keys() <= b.indexed
        for key in b.indexed:
            assert b.batch_id in scheduler._promising[key]
    # The ready roots a decision reads without a copy: those of every root that can
    # start now, in root order (before this tree: as the last tree left them).
    forest = scheduler._forest
    ready = [r for r in forest._all.stages if r.origin is None or r.origin.ready]
    assert forest.ready_roots == ready
    alive = scheduler._batches.keys() | scheduler._saving.keys()
    for key, ids in scheduler._promising.items():
        assert ids and ids <= alive
        assert all(key in scheduler._any_batch(i).indexed for i in ids)
    assert scheduler._kinds == Counter(scheduler.worker_devices(w) for w in scheduler._workers)
    on_worker = Counter(b.worker for b in scheduler._batches.values())
    assert scheduler._on_worker == on_worker
    assert all(
        not b.downstream
        for b in scheduler._batches.values()
        if b.batch_id not in scheduler._downstream
    )


@pytest.fixture(autouse=True)
def checked_forest(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Check the kept inputs before every stage tree a scheduler builds."""
    tree = core.Scheduler._tree

    def checked(self: core.Scheduler, lazy: bool = False, shared: bool = False) -> Any:
        check(self)
        return tree(self, lazy, shared)

    monkeypatch.setattr(core.Scheduler, "_tree", checked)
    yield
