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
from stagetree.hp import dumps_hp
from stagetree.space import RandomSpace, canonical_json
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
    path: Path,
    trials: int,
    statements: list[str] | None = None,
    budget: str | None = None,
    records: bool = True,
) -> Any:
    """Run (or resume) a random search of ``trials`` trials; the SQL statements of the
    run in ``statements``; its best result, records (unless not ``records``) and run
    report."""
    with _study(path) as study, warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergedWarning)
        study.open()
        if statements is not None:

            def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
                statements.append(statement)

            event.listen(study._engine.storage._engine, "before_cursor_execute", seen)
        tuner = RandomSearch(SPACE, "acc", steps=3, num_trials=trials, seed=0)
        best = study.tune(tuner, budget=budget)
        return best, study.trials() if records else None, study.last_run


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


def test_replayed_trials_are_not_encoded_to_json_per_question(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The replay finds a random search's trials (constants) by their values: its
    read of the finished trials and its three questions per replayed trial write no
    sequence JSON (they wrote one per finished trial and one or two per question:
    about a fifth of a 100,000-trial replay). Same answers (the first test)."""
    from stagetree.engine import replay

    path = tmp_path / "plan.db"
    first = _tune(path, 8)
    encoded: list[Any] = []

    def counted(hp: Any) -> str:
        encoded.append(hp)
        return dumps_hp(hp)

    monkeypatch.setattr(replay, "dumps_hp", counted)
    again = _tune(path, 8)
    assert again[0] == first[0] and again[1] == first[1]
    assert again[2].trials_answered == 8
    assert encoded == []


def test_trial_key_is_equal_exactly_when_the_identities_are() -> None:
    """``trial_key`` tells trials apart as ``(canonical config JSON, dumps_hp)`` does:
    1, 1.0 and True apart, 0.0 and -0.0 apart, other sequences by their JSON."""
    from stagetree.engine.replay import trial_key
    from stagetree.hp import Constant, Cosine

    def zero(negative: bool) -> Constant:
        c = Constant(0.0)
        object.__setattr__(c, "value", -0.0 if negative else 0.0)  # as an old plan's
        return c

    trials = [
        ({}, {"x": Constant(1)}),
        ({}, {"x": Constant(1.0)}),
        ({}, {"x": Constant(True)}),
        ({}, {"x": Constant("1")}),
        ({}, {"x": zero(False)}),
        ({}, {"x": zero(True)}),
        ({"a": 1}, {"x": Constant(1)}),
        ({}, {"y": Constant(1)}),
        ({}, {"x": Constant(1), "y": Constant(2.5)}),
        ({}, {"y": Constant(2.5), "x": Constant(1)}),
        ({}, {"x": Cosine(1.0, 10)}),
        ({}, {"x": Cosine(1.0, 10), "y": Constant(1)}),
    ]
    for c1, h1 in trials:
        for c2, h2 in trials:
            same_ident = (canonical_json(c1), dumps_hp(h1)) == (canonical_json(c2), dumps_hp(h2))
            assert (trial_key(c1, h1) == trial_key(c2, h2)) == same_ident, (h1, h2)


def test_dumps_hp_of_constants_is_their_to_json() -> None:
    """``dumps_hp`` writes a constant without ``to_json`` (a replay writes 100,000 of
    them several times): the same text as the generic way."""
    import json

    from stagetree.hp import Constant, Linear

    for value in (0, 1, -7, 2**70, 0.1, 1e-300, 1.0, True, False, "lr", 'é\n"x', 0.0):
        hp = {"b": Constant(value), "a": Linear(1.0, 0.0, 5)}
        generic = {name: seq.to_json() for name, seq in hp.items()}
        text = json.dumps(generic, sort_keys=True, separators=(",", ":"), allow_nan=False)
        assert dumps_hp(hp) == text


def test_a_replay_reads_no_nodes_sequences(tmp_path: Path, monkeypatch: Any) -> None:
    """A resumed run cuts its replayed trials' curves from where the nodes hang
    (``node_links``) and its budget reads the counters: no node of the plan is read
    with its sequences (it read the whole tree, every node's sequences decoded, three
    times). Same answers (the first test)."""
    from stagetree.plan.sql import SQLPlanStorage

    path = tmp_path / "plan.db"
    first = _tune(path, 8)
    read: list[Any] = []
    nodes = SQLPlanStorage.nodes

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        read.append(args)
        return nodes(self, *args, **kwargs)

    monkeypatch.setattr(SQLPlanStorage, "nodes", counted)
    again = _tune(path, 8, records=False)
    assert again[0] == first[0] and again[2].trials_answered == 8
    assert read == []
