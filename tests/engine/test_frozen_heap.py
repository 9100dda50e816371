"""tune() freezes the heap it starts with (the collector skips it) and unfreezes it when
it ends, however it ends; a user's own freeze, or a collector turned off, is left alone."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.distributions import Choice
from stagetree.space import RandomSpace
from stagetree.tuners import RandomSearch
from stagetree.tuners.base import ReplayingRunner

SPACE = RandomSpace({"lr": Choice([0.001, 0.01, 0.1])})


class _Cycle:
    """An object in a reference cycle with itself: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


class Recording(RandomSearch):
    """A random search that notes the freeze count while it runs, leaves cyclic garbage
    behind, and fails at its end when told to."""

    def __init__(self, fail: type[BaseException] | None = None) -> None:
        super().__init__(SPACE, "accuracy", steps=2, num_trials=2, seed=0)
        self.fail = fail
        self.counts: list[int] = []
        self.garbage: list[weakref.ref[_Cycle]] = []

    async def _search(self, ctx: ReplayingRunner) -> None:
        self.counts.append(gc.get_freeze_count())
        self.garbage.append(weakref.ref(_Cycle()))
        await super()._search(ctx)
        self.counts.append(gc.get_freeze_count())
        if self.fail is not None:
            raise self.fail("the tuner fails")


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    """Each test starts with nothing frozen and the collector on, and leaves it so."""
    gc.unfreeze()
    enabled = gc.isenabled()
    gc.enable()
    yield
    gc.unfreeze()
    if not enabled:
        gc.disable()


def _study(name: str) -> Study:
    return Study(name, LinearTrainer, storage="memory://", executor="simulated", workers=2)


def _tune(tuner: Recording) -> Any:
    with _study("frozen") as study:
        return study.tune(tuner)


def test_tune_freezes_its_heap_and_unfreezes_it_at_the_end() -> None:
    left = _Cycle()  # garbage from before the run: frozen with the rest when not collected
    before = weakref.ref(left)
    del left
    tuner = Recording()
    assert _tune(tuner) is not None
    assert all(count > 0 for count in tuner.counts)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None
    assert all(ref() is None for ref in tuner.garbage)  # made during the run


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failing_tune_unfreezes_too(error: type[BaseException]) -> None:
    tuner = Recording(fail=error)
    with pytest.raises(error):
        _tune(tuner)
    assert tuner.counts and all(count > 0 for count in tuner.counts)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert all(ref() is None for ref in tuner.garbage)


def test_a_users_freeze_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[Any] = [{"a": 1}, [2]]
    gc.freeze()
    assert gc.get_freeze_count() > 0
    # The freeze count itself is no witness: a frozen object that dies during the run
    # (in a long test session, some do) lowers it. What tune() calls is.
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    tuner = Recording()
    _tune(tuner)
    assert calls == []  # nothing more frozen, nothing thawed
    assert all(count > 0 for count in tuner.counts)
    assert gc.get_freeze_count() > 0
    assert kept


def test_a_disabled_collector_is_left_alone() -> None:
    gc.disable()
    tuner = Recording()
    _tune(tuner)
    assert tuner.counts == [0, 0]
    assert gc.get_freeze_count() == 0
    assert not gc.isenabled()
