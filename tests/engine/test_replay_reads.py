"""A resumed study replays its tuner's log from one read of its finished trials: the
storage is asked a fixed number of questions whatever the number of trials replayed,
and every answer is the one a question per trial gave."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from sqlalchemy import event

from stagetree.distributions import LogUniform, Uniform
from stagetree.exceptions import ReplayDivergedWarning
from stagetree.executors.simulated import LearningCurve, SimulatedExecutor, SimulatedTrainer
from stagetree.space import RandomSpace
from stagetree.study import Study
from stagetree.tuners import RandomSearch

SPACE = RandomSpace({"lr": LogUniform(1e-4, 1e-1), "wd": Uniform(0.0, 0.1)})


def _study(path: Path) -> Study:
    executor = SimulatedExecutor(4, curve=LearningCurve(aliases={"acc": "accuracy"}))
    return Study(
        "replay",
        SimulatedTrainer,
        storage=f"sqlite:///{path}",
        workers=4,
        checkpoint_dir=str(path) + ".ckpt",
        executor=lambda: executor,
    )


def _tune(
    path: Path, trials: int, statements: list[str] | None = None, budget: str | None = None
) -> Any:
    """Run (or resume) a random search of ``trials`` trials; the SQL statements of the
    run in ``statements``; its best result, records and run report."""
    with _study(path) as study, warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergedWarning)
        study.open()
        if statements is not None:

            def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
                statements.append(statement)

            event.listen(study._engine.storage._engine, "before_cursor_execute", seen)
        tuner = RandomSearch(SPACE, "acc", steps=3, num_trials=trials, seed=0)
        best = study.tune(tuner, budget=budget)
        return best, study.trials(), study.last_run


def test_replayed_trials_take_no_query_each(tmp_path: Path) -> None:
    """Resuming a finished study of 6 or of 24 trials takes the same statements: none
    per replayed trial (a question per trial and kind was ~17 statements each, about
    10 minutes for a study of 100,000 trials)."""
    counts = []
    for n in (6, 24):
        path = tmp_path / f"plan-{n}.db"
        first = _tune(path, n)
        statements: list[str] = []
        again = _tune(path, n, statements)
        assert again[0] == first[0] and again[1] == first[1]  # same best, same trials
        assert again[2].trials_answered == n and again[2].steps_executed == 0
        counts.append(len(statements))
    assert counts[0] == counts[1]


def test_a_replay_that_trains_again_reads_the_storage(tmp_path: Path) -> None:
    """A run stopped by its budget and resumed replays what it finished, then trains
    the rest, and ends as one whole run would (answers after a write come from the
    storage)."""
    resumed, fresh = tmp_path / "resumed.db", tmp_path / "fresh.db"
    _tune(resumed, 9, budget="5 trials")
    best, records, run = _tune(resumed, 9)
    assert 0 < run.trials_answered < 9 and run.steps_executed > 0
    once = _tune(fresh, 9)
    assert best == once[0]
    assert [(r.hp, r.steps, r.state, r.metrics) for r in records] == [
        (r.hp, r.steps, r.state, r.metrics) for r in once[1]
    ]
