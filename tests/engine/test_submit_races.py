"""A submission that races the end of its engine: a close, or the driver stopping on an
error (then the engine is replaced at the study's next use, see
:mod:`stagetree.engine.pool`). Either the submission runs (on the replacement) or it is
refused with the intended error; never ``StorageError: plan storage ... is closed``
(a stopped engine's storage, closed by its replacement) nor a waiter that nobody
answers. Each race is forced at one point with a hook, not left to timing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.engine.core import Engine, EngineStoppedError
from stagetree.exceptions import TrialCancelledError
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.tuners import ASHA


def make(tmp_path: Path) -> Study:
    return Study("s", LinearTrainer, storage=f"sqlite:///{tmp_path}/plan.db", executor="inline")


def stop(engine: Engine) -> None:
    """What the driver thread does when it stops on an error (Engine._run)."""
    engine.error = RuntimeError("the driver stopped")


def test_a_driver_that_stops_while_the_tuner_submits_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine stops at the burst of the study's third submission, just before it
    # is handed to the engine: the study sent it to the stopped engine with the slot
    # of the replacement, on the storage the replacement had just closed.
    begin_burst = Engine.begin_burst
    calls = []

    def hooked(self: Engine, watched: bool = False) -> None:
        begin_burst(self, watched)
        calls.append(self)
        if len(calls) == 3:
            stop(self)

    monkeypatch.setattr(Engine, "begin_burst", hooked)
    space = GridSpace({"lr": [Constant(0.01), Constant(0.02), Constant(0.05)]}, fixed={"seed": [0]})
    tuner = ASHA(space, "score", min_steps=1, max_steps=4, eta=2, num_trials=3, seed=0)
    with make(tmp_path) as study:
        best = study.tune(tuner, progress=False)
        assert best is not None
        assert calls[0] is not calls[-1]  # the tuner went on with the replacement
        trials = study.trials()
    assert len(trials) == 3 and {t.state for t in trials} == {"done"}


@pytest.mark.parametrize("where", ["entry", "start"])
def test_a_submission_to_an_engine_that_just_stopped_runs_on_its_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # The engine stops once the study holds it (entry), or while the submission starts
    # its workers (start): the submission goes to the replacement, recorded once.
    with make(tmp_path) as study:
        first = study._engine
        method = "submit" if where == "entry" else "ensure_started"
        original = getattr(first, method)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if method == "submit" or not (args or kwargs):  # the submission's own start
                stop(first)
            return original(*args, **kwargs)

        monkeypatch.setattr(first, method, hooked)
        result = study.run({"seed": 0}, {"lr": Constant(0.01)}, 3)
        assert result.steps == 3 and study._engine is not first
        assert [(t.state, t.steps) for t in study.trials()] == [("done", 3)]


def test_a_stop_after_the_workers_started_refuses_the_waiter_nobody_would_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver stops (and fails the waiters it has) between the submission's start of
    # the workers and its request: a waiter added then would wait forever.
    with make(tmp_path) as study:
        engine, slot = study._engine, study._study_slot
        original = engine.ensure_started

        def hooked(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            stop(engine)

        monkeypatch.setattr(engine, "ensure_started", hooked)
        with pytest.raises(EngineStoppedError, match="the driver stopped"):
            engine.submit(slot, {"seed": 0}, {"lr": Constant(0.01)}, 3)
        assert not engine._waiters


def test_a_submission_after_the_close_is_cancelled_not_a_storage_error(tmp_path: Path) -> None:
    study = make(tmp_path)
    study.run({"seed": 0}, {"lr": Constant(0.01)}, 2)
    engine, slot = study._engine, study._study_slot
    study.close()
    with pytest.raises(TrialCancelledError, match="the study was closed"):
        engine.submit(slot, {"seed": 1}, {"lr": Constant(0.01)}, 2)


def test_a_close_while_a_submission_starts_the_workers_cancels_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first submission lets the engine's lock go while it starts the workers; the
    # study is closed meanwhile (another thread): it is cancelled, no worker starts
    # after the close, and nothing is written to the closed storage.
    study = make(tmp_path)
    engine = study._engine
    original = engine.ensure_started

    def hooked(*args: Any, **kwargs: Any) -> None:
        study.close()
        original(*args, **kwargs)

    monkeypatch.setattr(engine, "ensure_started", hooked)

    async def submit() -> Any:
        return await study.submit({"seed": 0}, {"lr": Constant(0.01)}, 2)

    with pytest.raises(TrialCancelledError, match="the study was closed"):
        asyncio.run(submit())
    assert engine.executor is None


def test_a_result_read_after_its_engine_was_replaced_comes_from_the_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The submission's result is in; before its task reads the trial's history, the
    # engine stops and another use of the study replaces it (closing its storage).
    with make(tmp_path) as study:
        first = study._engine
        wrap_future = asyncio.wrap_future

        def hooked(future: Any, **kwargs: Any) -> Any:
            async def later() -> Any:
                result = await wrap_future(future, **kwargs)
                stop(first)
                _ = study._engine  # another task's submission, say
                return result

            return asyncio.ensure_future(later())

        monkeypatch.setattr(asyncio, "wrap_future", hooked)
        result = study.run({"seed": 0}, {"lr": Constant(0.01)}, 3)
        assert result.steps == 3 and sorted(result.history) == [1, 2, 3]
        assert study._engine is not first and first._closed
