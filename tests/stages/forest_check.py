"""A check that the forest's kept inputs of running batches equal the ones listed from
scratch at every decision (loaded as a fixture by ``conftest.py``; a pytest plugin for
other suites: ``-p tests.stages.forest_check``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from stagetree.scheduler import core


def scratch_inputs(scheduler: core.Scheduler) -> dict[str, Any]:
    """The running batches' inputs per plan tree, listed from the batches themselves."""
    nodes = scheduler.nodes
    out: dict[str, tuple[list[Any], set[Any]]] = {}
    for b in scheduler._active():
        pos = core.Scheduler._running_position(b)
        if pos.segments or pos.saving:
            first = pos.segments[0][0] if pos.segments else pos.saving[0][0]
            out.setdefault(nodes[first].root_key, ([], set()))[0].append(pos)
        for key in b.evaluate:
            out.setdefault(nodes[key[0]].root_key, ([], set()))[1].add(key)
    return {k: (tuple(r), frozenset(p)) for k, (r, p) in out.items() if r or p}


def check(scheduler: core.Scheduler) -> None:
    """Raise AssertionError where the forest's kept inputs differ from scratch."""
    scheduler._report_batches()
    assert scheduler._forest.batch_inputs() == scratch_inputs(scheduler)


@pytest.fixture(autouse=True)
def checked_forest(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Check the kept inputs before every stage tree a scheduler builds."""
    tree = core.Scheduler._tree

    def checked(self: core.Scheduler, lazy: bool = False) -> Any:
        check(self)
        return tree(self, lazy)

    monkeypatch.setattr(core.Scheduler, "_tree", checked)
    yield
