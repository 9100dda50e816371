"""Optuna samplers inside stagetree's tuners (``sampler=``): asks, tells, resume, bad input."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer
from tuner_fakes import FakeRunner, kill_after

import stagetree.tuners.optuna_bridge as optuna_bridge
from stagetree import Study
from stagetree.distributions import Choice, Distribution, IntUniform, LogUniform, Uniform
from stagetree.exceptions import InvalidSpaceError, TunerError
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace, RandomSpace
from stagetree.tuners import (
    ASHA,
    PBT,
    SHA,
    AsyncHyperband,
    GridSearch,
    Hyperband,
    MedianStopping,
    RandomSearch,
    ReplayDivergedWarning,
    Tuner,
)
from stagetree.tuners.base import Trial
from stagetree.tuners.optuna_bridge import optuna_study_name, suggest_trial

optuna = pytest.importorskip("optuna")
TrialState = optuna.trial.TrialState
optuna.logging.set_verbosity(optuna.logging.WARNING)

# The fake runner's quality peaks at x = 0.7; "penalty" is a fixed hyper-parameter.
FAKE_SPACE = RandomSpace(
    hp={"x": MultiStep(init=Uniform(0.0, 1.0), milestones=Choice([[4], [8, 12]]), gamma=0.5)},
    fixed={"penalty": Choice([0.0, 0.1]), "width": IntUniform(1, 4)},
)
# LinearTrainer: SGD on least squares; lr > 1.0 diverges (the trial fails).
LR_SPACE = RandomSpace(
    hp={"lr": MultiStep(init=LogUniform(1e-3, 0.2), milestones=Choice([[4], [8]]), gamma=0.5)},
    fixed={"seed": Choice([0, 1])},
)


def tpe(seed: int = 0) -> Any:
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4)


def run(tuner: Tuner, runner: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergedWarning)
        return asyncio.run(tuner.run(runner))


class StoredRunner(FakeRunner):
    """A fake runner that, like a Study, says where the sampler's history lives."""

    def __init__(self, url: str | None, home: object, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url, self.home = url, home

    def sampler_storage(self) -> tuple[str | None, object, str, str]:
        return self.url, self.home, "fake", "v1"


def optuna_trials(url: str, tuner: Tuner, study: str = "fake", version: str = "v1") -> list[Any]:
    name = optuna_study_name(study, version, type(tuner).__name__, tuner.space)  # type: ignore[attr-defined]
    return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)


def asha(n: int = 24, sampler: Any = None, space: RandomSpace = FAKE_SPACE) -> ASHA:
    return ASHA(
        space, "acc", min_steps=1, max_steps=16, num_trials=n, eta=2, sampler=sampler or tpe()
    )


# --------------------------------------------------------------------------- asks and tells


def test_asha_tpe_on_a_study_tells_optuna_each_trial_with_nested_params(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    tuner = ASHA(LR_SPACE, "score", min_steps=1, max_steps=8, num_trials=10, eta=2, sampler=tpe())
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        best = study.tune(tuner)
        version = study.version
    assert best is not None
    # the Optuna study sits in the plan's database, named after study, tuner and space
    names = optuna.get_all_study_names(url)
    assert names == [optuna_study_name("s", version, "ASHA", LR_SPACE)]
    assert names[0].startswith("stagetree:s:ASHA:")
    trials = optuna_trials(url, tuner, "s", version)
    assert [t.number for t in trials] == list(range(10)) == sorted(tuner.trials)
    for t in trials:
        assert t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        assert set(t.params) == {"seed", "lr.init", "lr.milestones"}
        mine = tuner.trials[t.number]
        assert mine.config == {"seed": t.params["seed"]}
        assert mine.hp["lr"] == MultiStep(
            init=t.params["lr.init"], milestones=eval(t.params["lr.milestones"]), gamma=0.5
        )
        assert t.user_attrs["stagetree_trial"] == t.number
        # results are reported at their steps until the trial is told (a trial pruned at
        # a pause that ASHA promotes later keeps its later results in stagetree only)
        seen = {r.steps: r.metrics["score"] for tid, r in tuner.results if tid == t.number}
        told = dict(t.intermediate_values)
        assert told == {s: v for s, v in seen.items() if s <= max(told)}
        assert t.value == told[max(told)]
        assert (t.state == TrialState.COMPLETE) == (max(told) == 8)
    assert max(t.value for t in trials if t.state == TrialState.COMPLETE) == best.metrics["score"]
    assert any(t.state == TrialState.PRUNED for t in trials)


def test_a_failed_trial_is_told_fail(tmp_path: Path) -> None:
    space = RandomSpace(hp={"lr": LogUniform(0.1, 4.0)})  # lr > 1 diverges: the trial fails
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    tuner = RandomSearch(
        space, "score", steps=2, num_trials=12, sampler=optuna.samplers.RandomSampler(seed=1)
    )
    with Study("f", LinearTrainer, storage=url, executor="inline", max_retries=0) as study:
        study.tune(tuner)
        version = study.version
    trials = optuna_trials(url, tuner, "f", version)
    assert len(trials) == 12
    for t in trials:
        expected = TrialState.FAIL if t.params["lr"] > 1.0 else TrialState.COMPLETE
        assert t.state == expected, t
    assert {t.state for t in trials} == {TrialState.FAIL, TrialState.COMPLETE}


@pytest.mark.parametrize(
    "make",
    [
        lambda s: RandomSearch(FAKE_SPACE, "acc", steps=8, num_trials=8, sampler=s),
        lambda s: SHA(FAKE_SPACE, "acc", min_steps=1, max_steps=9, num_trials=9, sampler=s),
        lambda s: Hyperband(FAKE_SPACE, "acc", min_steps=1, max_steps=9, num_trials=9, sampler=s),
        lambda s: AsyncHyperband(
            FAKE_SPACE, "loss", "min", min_steps=1, max_steps=9, num_trials=9, eta=3, sampler=s
        ),
        lambda s: MedianStopping(
            FAKE_SPACE, "acc", steps=8, num_trials=10, eval_every=2, min_samples=2, sampler=s
        ),
    ],
    ids=["random", "sha", "hyperband", "async_hyperband", "median"],
)
def test_every_drawing_tuner_tells_complete_at_its_horizon_and_pruned_below(
    tmp_path: Path, make: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'o.db'}"
    tuner = make(tpe())
    run(tuner, StoredRunner(url, None))
    trials = optuna_trials(url, tuner)
    assert len(trials) == tuner.num_trials == len(tuner.trials)
    direction = optuna.load_study(
        study_name=optuna_study_name("fake", "v1", type(tuner).__name__, FAKE_SPACE), storage=url
    ).direction
    assert direction.name == ("MINIMIZE" if tuner.mode == "min" else "MAXIMIZE")
    top = {tid for tid, r in tuner.results if r.steps == tuner.horizon}
    for t in trials:
        assert t.state == (TrialState.COMPLETE if t.number in top else TrialState.PRUNED)
        last = max(r.steps for tid, r in tuner.results if tid == t.number)
        assert max(t.intermediate_values) == last
        assert t.value == t.intermediate_values[last]
    if not isinstance(tuner, RandomSearch):
        assert any(t.state == TrialState.PRUNED for t in trials)


def test_a_seeded_sampler_makes_the_search_deterministic() -> None:
    def once() -> tuple[list[str], Any]:
        tuner = asha(20)
        best = run(tuner, FakeRunner(order_seed=5))
        return [t.fingerprint for t in tuner.trials.values()], best

    a, b = once(), once()
    assert a == b
    tuner = asha(20)  # the same tuner run twice starts from its sampler as given twice
    runs = [run(tuner, FakeRunner(order_seed=5)) for _ in range(2)]
    assert runs[0] == runs[1] == a[1]
    other = asha(20, sampler=tpe(seed=1))
    run(other, FakeRunner(order_seed=5))
    assert [t.fingerprint for t in other.trials.values()] != a[0]


def test_asha_asks_each_configuration_after_the_results_before_it() -> None:
    """TPE proposes from what it was told: past its startup trials the proposals
    concentrate near the fake curve's optimum (x = 0.7, no penalty)."""
    space = RandomSpace(hp={"x": Uniform(0.0, 1.0)}, fixed={"penalty": Choice([0.0, 0.3])})
    tuner = ASHA(space, "acc", min_steps=1, max_steps=4, num_trials=40, eta=2, sampler=tpe())
    run(tuner, FakeRunner(order_seed=0, workers=2))
    late = [tuner.trials[i] for i in range(20, 40)]
    near = sum(abs(t.hp["x"](0) - 0.7) < 0.2 and t.config["penalty"] == 0.0 for t in late)
    assert near >= 12  # a random draw lands there 20% of the time (4 of 20 expected)


# --------------------------------------------------------------------------- resume


def test_a_second_tune_resumes_the_sampler_history_without_asking_twice(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"

    def tune(n: int) -> ASHA:
        tuner = ASHA(
            LR_SPACE, "score", min_steps=1, max_steps=8, num_trials=n, eta=2, sampler=tpe()
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplayDivergedWarning)
            with Study("r", LinearTrainer, storage=url, executor="inline") as study:
                study.tune(tuner)
                tuner.version = study.version  # type: ignore[attr-defined]
        return tuner

    first = tune(6)
    trials = optuna_trials(url, first, "r", first.version)  # type: ignore[attr-defined]
    assert len(trials) == 6
    before = {t.number: (t.state, t.params, t.value) for t in trials}
    second = tune(12)  # replays the first run's log, then goes on live
    assert [t.fingerprint for t in second.trials.values()][:6] == [
        t.fingerprint for t in first.trials.values()
    ]
    trials = optuna_trials(url, second, "r", second.version)  # type: ignore[attr-defined]
    assert [t.number for t in trials] == list(range(12))
    assert all(t.state.is_finished() for t in trials)
    # the first run's trials were not asked or told again
    assert {t.number: (t.state, t.params, t.value) for t in trials[:6]} == before
    # the reseeded sampler does not repeat the first run's proposals
    assert len({repr(sorted(t.params.items())) for t in trials}) == 12
    third = tune(12)  # everything replays: nothing new in Optuna
    assert len(optuna_trials(url, third, "r", third.version)) == 12  # type: ignore[attr-defined]


@pytest.mark.parametrize("sql", [True, False], ids=["sql", "memory"])
def test_a_killed_asha_resumes_its_sampler_and_replays_without_diverging(
    tmp_path: Path, sql: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'o.db'}" if sql else None
    home = object() if sql else type("Plan", (), {})()  # the in-memory history's owner
    first = StoredRunner(url, home, order_seed=1)
    killed = asha(24)
    kill_after(killed, first, 9)
    assert 0 < len(killed.trials) < 24
    second = StoredRunner(url, home, order_seed=2, log=list(first.log))
    resumed = asha(24)
    best = run(resumed, second)
    assert best is not None
    asked = [t.fingerprint for t in killed.trials.values()]
    assert [t.fingerprint for t in resumed.trials.values()][: len(asked)] == asked
    study = optuna.create_study(
        study_name=optuna_study_name("fake", "v1", "ASHA", FAKE_SPACE),
        storage=url or _memory(home),
        load_if_exists=True,
    )
    trials = study.get_trials(deepcopy=False)
    assert [t.number for t in trials] == list(range(24))
    assert all(t.state.is_finished() for t in trials)
    # a trial killed while running was told once, by the resumed run, with what it saw
    for t in trials:
        seen = {r.steps: r.metrics["acc"] for tid, r in resumed.results if tid == t.number}
        assert set(t.intermediate_values) <= set(seen)
    third = StoredRunner(url, home, order_seed=3, log=list(second.log))
    assert run(asha(24), third) == best
    assert third.log == second.log
    assert len(study.get_trials(deepcopy=False)) == 24


def assert_whole_study(url: str, tuner: Tuner, n: int) -> None:
    """The database holds the tuner's ``n`` trials, finished, as the tuner saw them."""
    trials = optuna_trials(url, tuner)
    assert [t.number for t in trials] == list(range(n))
    assert all(t.state.is_finished() for t in trials)
    for t in trials:
        assert t.user_attrs["stagetree_trial"] == t.number
        assert tuner.trials[t.number].fingerprint == suggest(t).fingerprint
        seen = {r.steps: r.metrics["acc"] for tid, r in tuner.results if tid == t.number}
        assert dict(t.intermediate_values) == {s: seen[s] for s in t.intermediate_values}
        assert t.value == t.intermediate_values[max(t.intermediate_values)]


def test_the_first_trials_are_submitted_before_the_database_storage_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening Optuna's RDBStorage (SQLAlchemy's ORM, Alembic, its tables) takes seconds:
    a first run asks its first trials from memory and copies them to the database
    from the first result on; at the end the database holds the whole study."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    runner = StoredRunner(url, object(), order_seed=4, workers=3)
    opened: list[tuple[int, int]] = []  # (submissions, results) when a storage opened
    rdb = optuna.storages.RDBStorage
    init = rdb.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        opened.append((len(runner.calls), runner.completed))
        init(self, *args, **kwargs)

    monkeypatch.setattr(rdb, "__init__", spy)
    # The copy in a thread of this process, where the spy sees it open the storage: a
    # fork server left running by an earlier test would otherwise take the copy to a
    # process of its own (that path: test_the_database_copy_runs_in_a_process_beside_
    # the_driver).
    monkeypatch.setattr(optuna_bridge, "start_helper", lambda *args: None)
    tuner = asha(12)
    run(tuner, runner)
    assert len(opened) == 1
    submitted, results = opened[0]
    assert submitted >= 3 and results >= 1  # one trial per worker, and a result
    monkeypatch.setattr(rdb, "__init__", init)
    assert_whole_study(url, tuner, 12)


def test_a_budget_stop_leaves_the_asked_trials_in_the_database_and_continues(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    seen = []
    for budget in ("6 steps", None):
        tuner = ASHA(
            LR_SPACE, "score", min_steps=1, max_steps=8, num_trials=12, eta=2, sampler=tpe()
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplayDivergedWarning)
            with Study("b", LinearTrainer, storage=url, executor="inline") as study:
                study.tune(tuner, budget=budget)
                stopped, version = study.last_run.stopped_by, study.version
        trials = optuna_trials(url, tuner, "b", version)
        seen.append((stopped, len(tuner.trials), trials))
    (stopped, asked, trials), (_, _, final) = seen
    assert stopped == "steps" and 0 < asked < 12
    assert [t.number for t in trials] == list(range(asked))  # written when stopped
    assert [t.number for t in final] == list(range(12))
    assert all(t.state.is_finished() for t in final)
    assert [t.params for t in final[:asked]] == [t.params for t in trials]


def suggest(trial: Any) -> Trial:
    spec = suggest_trial(FAKE_SPACE, optuna.trial.FixedTrial(trial.params))
    return Trial(trial.number, spec.config, spec.hp)


def test_a_run_killed_before_its_database_copy_resumes_with_the_same_decisions(
    tmp_path: Path,
) -> None:
    """An interrupted search writes what its sampler was asked to the database; a run
    killed before anything reached it (the Optuna study missing) replays the same
    decisions with a seeded sampler, asked again from a fresh copy."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    first = StoredRunner(url, object(), order_seed=1)
    killed = asha(24)
    kill_after(killed, first, 9)
    assert 0 < len(killed.trials) < 24
    name = optuna_study_name("fake", "v1", "ASHA", FAKE_SPACE)
    stored = optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    assert [t.number for t in stored] == sorted(killed.trials)  # flushed when killed
    optuna.delete_study(study_name=name, storage=url)
    second = StoredRunner(url, object(), order_seed=2, log=list(first.log))
    resumed = asha(24)
    assert run(resumed, second) is not None  # no ReplayDivergedWarning (an error here)
    asked = [t.fingerprint for t in killed.trials.values()]
    assert [t.fingerprint for t in resumed.trials.values()][: len(asked)] == asked
    assert len(optuna_trials(url, resumed)) == 24


def _memory(home: object) -> Any:
    from stagetree.tuners.optuna_bridge import _MEMORY

    return _MEMORY[home]


def test_a_memory_study_keeps_the_sampler_history_between_tune_calls() -> None:
    with Study("m", LinearTrainer, storage="memory://", executor="inline") as study:
        for n in (4, 8):
            with warnings.catch_warnings():
                warnings.simplefilter("error", ReplayDivergedWarning)
                tuner = ASHA(
                    LR_SPACE, "score", min_steps=1, max_steps=4, num_trials=n, sampler=tpe()
                )
                study.tune(tuner)
            assert len(tuner.trials) == n
        assert len({t.fingerprint for t in tuner.trials.values()}) == 8


# --------------------------------------------------------------------------- bad input


class Normal(Distribution):
    def sample(self, rng: random.Random) -> float:
        return rng.gauss(0.0, 1.0)

    def __repr__(self) -> str:
        return "Normal()"


def test_pbt_asks_its_population_and_tells_replaced_members_pruned(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    tuner = PBT(FAKE_SPACE, "acc", population=6, interval=4, steps=12, seed=0, sampler=tpe())
    best = run(tuner, StoredRunner(url, object()))
    assert best is not None
    trials = optuna_trials(url, tuner)
    # The initial population comes from the sampler, one Optuna trial each; exploited
    # trials come from mutation and are not asked.
    assert len(trials) == 6
    replaced = {e["replaces"] for e in tuner.exploits}
    assert replaced, "the search exploited nobody"
    states = {t.number: t.state for t in trials}
    for number, state in states.items():  # survivors trained to the end
        assert state == (TrialState.PRUNED if number in replaced else TrialState.COMPLETE)
    assert set(states) - replaced, "every member was replaced"


def test_bad_samplers_and_spaces_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    db = tmp_path / "plan.db"
    with pytest.raises(TunerError, match=r"optuna.samplers.BaseSampler.*got str"):
        asha(sampler="tpe")
    with pytest.raises(TunerError, match="BaseSampler"):
        RandomSearch(FAKE_SPACE, "acc", steps=2, num_trials=2, sampler=random.Random(0))
    space = RandomSpace(hp={"x": MultiStep(init=Normal(), milestones=[2], gamma=0.5)})
    with pytest.raises(InvalidSpaceError, match=r"'x.init'.*Normal"):
        asha(sampler=tpe(), space=space)
    nested = RandomSpace(hp={"x": Choice([Constant(0.1), Normal()])})
    with pytest.raises(InvalidSpaceError, match=r"'x.1'.*Normal"):
        MedianStopping(nested, "acc", steps=4, num_trials=2, sampler=tpe())
    grid = GridSpace(hp={"x": [0.1, 0.2]})
    with pytest.raises(TunerError, match=r"GridSearch.*no sampler"):
        GridSearch(grid, "acc", steps=2, sampler=tpe())
    with pytest.raises(TunerError, match=r"RandomSpace.*got GridSpace"):
        SHA(grid, "acc", min_steps=1, max_steps=2, num_trials=2, sampler=tpe())
    filtered = RandomSpace(hp={"x": Uniform(0.0, 1.0)}, where=lambda t: True)
    with pytest.raises(TunerError, match="where"):
        RandomSearch(filtered, "acc", steps=2, num_trials=2, sampler=tpe())
    assert not db.exists()
    with Study("ok", LinearTrainer, storage=f"sqlite:///{db}", executor="inline") as study:
        study.tune(RandomSearch(LR_SPACE, "score", steps=1, num_trials=2))  # no sampler
    assert optuna.get_all_study_names(f"sqlite:///{db}") == []


def test_the_core_imports_without_optuna() -> None:
    code = (
        "import sys; sys.modules['optuna'] = None\n"
        "import stagetree, stagetree.tuners, stagetree.tuners.optuna_bridge\n"
        "from stagetree.tuners import ASHA\n"
        "from stagetree.space import RandomSpace\n"
        "from stagetree.distributions import Uniform\n"
        "ASHA(RandomSpace(hp={'x': Uniform(0, 1)}), 'a', min_steps=1, max_steps=2, num_trials=2)\n"
        "try:\n"
        "    ASHA(RandomSpace(hp={'x': Uniform(0, 1)}), 'a', min_steps=1, max_steps=2,"
        " num_trials=2, sampler=object())\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "TunerError" in out and "stagetree[optuna]" in out


# --------------------------------------------------------------------------- the copy process


@pytest.mark.parametrize("fork_driver", ["1", "0"])
def test_the_database_copy_runs_in_a_process_beside_the_driver(
    tmp_path: Path, fork_driver: str
) -> None:
    """With local workers forked from a fork server (the driver's own, or with
    ``STAGETREE_FORK_DRIVER=0`` multiprocessing's), a first run's copy of the Optuna
    study to the database (Optuna's ORM: about half of a small run's time after its
    first result, in the driver) is written by a process forked from that server: the
    driver never opens the RDBStorage; at the end the database holds every trial
    finished, and the copy process has ended."""
    here = Path(__file__).parent.parent / "fakes"
    out = subprocess.run(
        [sys.executable, str(here / "optuna_copy_run.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=here,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(here), *sys.path]),
            "STAGETREE_FORK_DRIVER": fork_driver,
        },
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["copies"] == [0] and got["exit_codes"] == [0]  # one process, ended well
    assert got["left"] == []
    assert got["opened_in_driver"] == 0
    assert not [name for name in got["alive"] if "optuna" in name]
    assert got["numbers"] == list(range(got["asked"])) and got["asked"] == 12
    assert got["finished"] and got["reported"] >= 12


def test_a_copy_process_writes_what_the_driver_would_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy process (here a spawned one) writes the same study as the driver's own
    copy: every trial, its parameters, reported values, attributes and state; the driver
    opens no RDBStorage; the process has ended when the search returns."""
    import multiprocessing

    import stagetree.tuners.optuna_bridge as bridge

    started: list[Any] = []

    def spawn(target: Any, args: tuple[Any, ...], name: str) -> Any:
        process = multiprocessing.get_context("spawn").Process(
            target=target, args=args, name=name, daemon=True
        )
        process.start()
        close = process.close

        def closing() -> None:  # its exit code, before the object forgets it
            started.append(process.exitcode)
            close()

        process.close = closing  # type: ignore[method-assign]
        return process

    monkeypatch.setattr(bridge, "start_helper", spawn)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    opened: list[int] = []
    rdb = optuna.storages.RDBStorage
    init = rdb.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        opened.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(rdb, "__init__", spy)
    tuner = asha(12)
    run(tuner, StoredRunner(url, object(), order_seed=4, workers=3))
    assert opened == []
    assert started == [0]  # one copy process, joined when the search returned
    monkeypatch.setattr(rdb, "__init__", init)
    assert_whole_study(url, tuner, 12)


def test_a_copy_process_that_fails_stops_the_search_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy process that cannot write (here: a database it cannot open) ends the
    search with a TunerError naming the study and the cause, and is gone."""
    import multiprocessing

    import stagetree.tuners.optuna_bridge as bridge

    started: list[Any] = []

    def spawn(target: Any, args: tuple[Any, ...], name: str) -> Any:
        process = multiprocessing.get_context("spawn").Process(
            target=target, args=args, name=name, daemon=True
        )
        process.start()
        started.append(process)
        return process

    monkeypatch.setattr(bridge, "start_helper", spawn)
    monkeypatch.setattr(bridge, "_holds_trials", lambda url, name: False)
    url = f"sqlite:///{tmp_path / 'missing' / 'o.db'}"  # its directory does not exist
    with pytest.raises(TunerError, match="could not be copied to the plan's database"):
        run(asha(12), StoredRunner(url, object(), order_seed=4, workers=3))
    assert len(started) == 1
    with pytest.raises(ValueError, match="closed"):  # joined and closed by the bridge
        started[0].is_alive()
