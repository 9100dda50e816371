"""The Study contract (:class:`stagetree.study_api.StudyAPI`), one suite run against both
implementations: ``local`` (:class:`stagetree.Study` in this process, inline executor)
and ``remote`` (:class:`stagetree.server.client.RemoteStudy` talking to a real
``stagetree serve`` process of this checkout on a free loopback port, one per module).

Where both implementations answer the same question (a tuner's best result, a trial's
metrics, a root key), the second answer must equal the first: results are the same
whoever runs the study.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import os
import pydoc
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from failing_trainers import Raises
from study_trainers import LinearTrainer

import stagetree
from stagetree import Study
from stagetree.distributions import Choice, LogUniform
from stagetree.exceptions import (
    InvalidTrialError,
    RemoteArgumentWarning,
    StagetreeError,
    TrialFailedError,
)
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace, RandomSpace
from stagetree.study_api import STUDY_PARAMETERS, StudyAPI, StudyArguments
from stagetree.tuners import (
    ASHA,
    PBT,
    SHA,
    GridSearch,
    Hyperband,
    MedianStopping,
    RandomSearch,
    Tuner,
)

FAKES = Path(__file__).resolve().parents[1] / "fakes"
ROOT = Path(__file__).resolve().parents[2]
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

KINDS = ["local", "remote"]
CONFIG = {"seed": 0}
HP = {"lr": MultiStep(0.05, [2], 0.5)}
# `stagetree serve` of this checkout (the tests' directory on its path: it imports the
# trainers by reference, as a user's server imports a user's).
SERVE = "import sys; from stagetree.cli import main; sys.exit(main(sys.argv[1:]))"


class _Server:
    """A ``stagetree serve`` process (inline executor, one worker)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = directory / "plan.db.token"
        env = {k: v for k, v in os.environ.items() if not k.startswith("STAGETREE_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(FAKES)])
        self.log = open(directory / "server.txt", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-c", SERVE, "serve"),
                *("--storage", f"sqlite:///{directory / 'plan.db'}"),
                *("--executor", "inline", "--workers", "1", "--port", str(self.port)),
            ],
            cwd=directory,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            if self.token_file.exists():
                try:
                    headers = {"Authorization": f"Bearer {self.token}"}
                    if httpx.get(f"{self.url}/v1/info", headers=headers).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the server did not start: {self.output()}")

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def output(self) -> str:
        return (self.dir / "server.txt").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    started = _Server(tmp_path_factory.mktemp("serve"))
    try:
        yield started
    finally:
        started.stop()


Make = Callable[..., StudyAPI]


@pytest.fixture(params=KINDS)
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """Studies of one kind, closed after the test; names are unique (one server)."""
    kind = request.param
    made: list[StudyAPI] = []
    remote = request.getfixturevalue("server") if kind == "remote" else None

    def make(name: str, trainer: type = LinearTrainer, **kw: Any) -> StudyAPI:
        name = f"{name}-{uuid.uuid4().hex[:8]}"
        if remote is None:
            storage = f"sqlite:///{tmp_path / 'plan.db'}"
            study = Study(name, trainer, storage=storage, executor="inline", url="", **kw)
        else:
            study = Study(name, trainer, url=remote.url, token=remote.token, **kw)
        made.append(study)
        return study

    make.kind = kind  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for study in made:
            study.close()


_SEEN: dict[str, Any] = {}


def agree(key: str, value: Any) -> None:
    """The other implementation, run before in this module, gave the same ``value``."""
    if key in _SEEN:
        assert value == _SEEN[key], key
    else:
        _SEEN[key] = value


# ----------------------------------------------------------------------------- the type


def test_both_kinds_implement_the_contract(make: Make) -> None:
    study = make("kind")
    assert isinstance(study, StudyAPI)
    assert isinstance(study, Study)  # what front ends look for in a script
    assert type(study).__name__ == {"local": "Study", "remote": "RemoteStudy"}[make.kind]  # type: ignore[attr-defined]


def test_local_and_remote_accept_the_same_parameters() -> None:
    from stagetree.server.client import RemoteStudy

    local = inspect.signature(Study)
    remote = inspect.signature(RemoteStudy)
    assert list(local.parameters) == list(remote.parameters) == list(STUDY_PARAMETERS)
    for name, param in local.parameters.items():
        assert remote.parameters[name].default == param.default, name
    fields = dataclasses.fields(StudyArguments)
    assert [f.name for f in fields] == list(local.parameters)
    defaults = [p.default for p in local.parameters.values()]
    assert [f.default for f in fields[2:]] == defaults[2:]


def test_the_factory_shows_its_parameters() -> None:
    shown = inspect.signature(stagetree.Study)
    assert "args" not in shown.parameters and "kwargs" not in shown.parameters
    text = pydoc.render_doc(stagetree.Study, renderer=pydoc.plaintext)
    shown_line = next(line for line in text.splitlines() if "Study(name" in line)
    for name in STUDY_PARAMETERS:
        assert f"{name}:" in shown_line, name


def test_a_remote_study_takes_every_argument_of_a_local_one() -> None:
    """Every parameter, given a non-default value: no TypeError (checkpoint_every once
    raised one); server-side ones are warned about, not refused."""
    from stagetree.server.client import RemoteStudy

    given = {
        "storage": "sqlite:///elsewhere.db",
        "workers": 3,
        "share": False,
        "checkpoint_dir": "/tmp/elsewhere",
        "checkpoint_budget": "1GB",
        "version": "v1",
        "executor": "inline",
        "policy": "bfs",
        "max_retries": 2,
        "threads_per_worker": 2,
        "eval_every": 2,
        "weight": 2.0,
        "url": "http://127.0.0.1:1",
        "token": "t" * 32,
        "fuse": False,
        "max_fused": 4,
        "checkpoint_every": 10,
        "devices_per_worker": 2,
        "step_timeout": 60.0,
        "stop_timeout": 2.0,
    }
    assert set(given) == set(STUDY_PARAMETERS) - {"name", "trainer"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteArgumentWarning)
        study = Study("all-args", LinearTrainer, **given)
    assert isinstance(study, RemoteStudy)
    assert study.version == "v1" and study.weight == 2.0 and study.share is False
    again = study._reopened()
    assert isinstance(again, RemoteStudy) and again.url == study.url
    study.close()
    again.close()


# ------------------------------------------------------------------------------ trials


def test_run_eval_state_and_root_key(make: Make) -> None:
    study = make("trials")
    result = study.run(CONFIG, HP, 4)
    assert result.steps == 4 and math.isfinite(result.metrics["score"])
    assert sorted(result.history) == [1, 2, 3, 4]
    assert study.eval(CONFIG, HP, 4) == result.metrics
    assert study.eval(CONFIG, HP, 8) is None  # not trained: nothing known, nothing trained
    state = study.state(CONFIG, HP, 4)
    assert state is not None and state["t"] == 4
    assert study.state(CONFIG, HP, 8) is None
    agree("run", (result.metrics, result.history))
    agree("root_key", study.root_key(CONFIG))
    assert study.num_workers >= 1
    assert isinstance(study.worker_locations(), dict)


def test_submit_concurrently_and_wait(make: Make) -> None:
    study = make("submit")
    lrs = [0.01, 0.02, 0.03]

    async def main() -> list[Any]:
        tasks = [asyncio.ensure_future(study.submit(CONFIG, {"lr": Constant(lr)}, 3)) for lr in lrs]
        done, _ = await study.wait_any(tasks)
        assert done
        return await study.wait_all(tasks)

    results = asyncio.run(main())
    assert [r.hp["lr"](0) for r in results] == lrs
    agree("submit", [r.metrics for r in results])
    assert len(study.trials()) == 3


def test_a_trial_that_does_not_fit_is_refused(make: Make) -> None:
    study = make("check")
    study.run(CONFIG, HP, 1)
    study.check(CONFIG, HP)  # fits: nothing raised, nothing written
    with pytest.raises(InvalidTrialError):
        study.check({"other": 1}, HP)
    with pytest.raises(InvalidTrialError):
        study.run(CONFIG, HP, -1)
    study.declare([(CONFIG, {"lr": Constant(0.2)})])


# ------------------------------------------------------------------------------ tuners

SPACE = RandomSpace({"lr": LogUniform(0.005, 0.1)}, fixed={"seed": Choice([0, 1])})
TUNERS: dict[str, Callable[[], Tuner]] = {
    "grid": lambda: GridSearch(GridSpace({"lr": [0.01, 0.05]}), "score", steps=4),
    "random": lambda: RandomSearch(SPACE, "score", steps=4, num_trials=3, seed=1),
    "sha": lambda: SHA(SPACE, "score", min_steps=1, max_steps=4, num_trials=4, eta=2),
    "asha": lambda: ASHA(SPACE, "score", min_steps=1, max_steps=4, num_trials=4, eta=2),
    "hyperband": lambda: Hyperband(SPACE, "score", min_steps=1, max_steps=4, num_trials=4, eta=2),
    "median": lambda: MedianStopping(SPACE, "score", steps=4, num_trials=4, min_samples=2),
    "pbt": lambda: PBT(SPACE, "score", population=3, interval=2, steps=4, seed=2),
}


@pytest.mark.parametrize("tuner", sorted(TUNERS))
def test_tune_with_each_tuner(make: Make, tuner: str) -> None:
    study = make(f"tune-{tuner}")
    best = study.tune(TUNERS[tuner](), progress=False)
    assert best is not None and math.isfinite(best.metrics["score"])
    run = study.last_run
    assert run is not None and run.trials >= 1 and run.stopped_by is None
    record = study.best("score")
    assert record is not None and record.config == best.config
    trials = study.trials()
    assert trials and all(t.state == "done" for t in trials)
    agree(f"tune-{tuner}", (best.config, best.metrics, best.steps, len(trials)))


# ----------------------------------------------------------------------------- reports


def test_trials_without_history_hold_final_metrics_and_best_its_curve(make: Make) -> None:
    study = make("final-only")
    study.tune(SHA(SPACE, "score", min_steps=1, max_steps=4, num_trials=4, eta=2), progress=False)
    full = study.trials()
    finals = study.trials(history=False)
    assert [(t.id, t.config, t.hp, t.steps, t.state) for t in finals] == [
        (t.id, t.config, t.hp, t.steps, t.state) for t in full
    ]
    assert [t.metrics for t in finals] == [{t.steps: t.metrics[t.steps]} for t in full]
    best = study.best("score")
    assert best is not None and best.metrics == next(t for t in full if t.id == best.id).metrics
    assert len(best.metrics) > 1  # its whole learning curve
    agree("final-only", [t.metrics for t in finals])


def test_stats_progress_and_export(make: Make) -> None:
    pd = pytest.importorskip("pandas")
    study = make("reports")
    # Values no other test trains: the server's storage is shared by this module's tests.
    study.tune(GridSearch(GridSpace({"lr": [0.011, 0.051]}), "score", steps=3), progress=False)
    stats = study.stats()
    assert stats["steps_requested"] == 6 and stats["steps_executed"] >= 3
    assert stats["device_seconds"] >= 0
    progress = study.progress()
    assert progress["trials"] == 2 and progress["finished"] == 2 and progress["elapsed"] >= 0
    table = study.trials_dataframe()
    assert isinstance(table, pd.DataFrame) and len(table) == 2
    assert {"state", "steps", "metric.score", "hp.lr"} <= set(table.columns)
    history = study.trials_dataframe(history=True)
    assert list(history.columns) == ["study", "trial", "step", "metric", "value"]
    agree("export", (list(table.columns), len(history)))
    model = study.best_model("score")
    assert isinstance(model, LinearTrainer) and model.t == 3
    assert study.failures() == []


def test_failures(make: Make, tmp_path: Path) -> None:
    study = make("failing", Raises)
    config = {"at": 2, "log": str(tmp_path / "attempts")}
    with pytest.raises(TrialFailedError, match="boom at step 2"):
        study.run(config, {"lr": Constant(0.5)}, 4)
    failures = study.failures()
    assert len(failures) == 1 and "boom at step 2" in failures[0][1].summary()
    assert study.trials()[0].state == "failed"
    space = GridSpace({"lr": [0.1, 0.2]}, fixed={"at": [1], "log": [config["log"]]})
    tuner = GridSearch(space, "w", steps=3)
    with pytest.raises(TrialFailedError, match="no trial of study"):
        study.tune(tuner, progress=False)


def test_budgets_stop_a_run_and_the_next_run_goes_on(make: Make) -> None:
    study = make("budget")
    grid = GridSpace({"lr": [0.012, 0.022, 0.032, 0.042]})
    tuner = GridSearch(grid, "score", steps=3, max_concurrent=1)
    study.tune(tuner, budget="2 trials", progress=False)
    first = study.last_run
    assert first is not None and first.stopped_by == "trials" and first.trials == 2
    best = study.tune(GridSearch(grid, "score", steps=3, max_concurrent=1), progress=False)
    second = study.last_run
    assert best is not None and second is not None and second.stopped_by is None
    assert second.trials == 4 and second.trials_answered == 2
    agree("budget", (best.config, best.metrics))


def test_tuner_log_and_lease(make: Make) -> None:
    study = make("log")
    study.begin_tuning("score", "max", "Manual", 4)
    try:
        study.append_log({"decision": 1})
        assert study.read_log()[-1] == {"decision": 1}
    finally:
        study.end_tuning()


def test_context_manager_and_close(make: Make) -> None:
    with make("closing") as study:
        study.open()
        study.run(CONFIG, HP, 1)
    study.close()  # twice: harmless
    with pytest.raises(StagetreeError):
        study.run(CONFIG, HP, 2)


# ---------------------------------------------------------------------------- settings


def test_engine_settings_are_frozen_checked_and_normalised() -> None:
    from stagetree.engine.settings import EngineSettings

    settings = EngineSettings(workers=2, eval_every=None, max_fused=None)
    assert settings == EngineSettings(workers=2, eval_every=0, max_fused=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.workers = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="workers"):
        EngineSettings(workers=0)
    other = EngineSettings(workers=2, eval_every=0, policy="bfs")
    assert settings.differences(other) == [("policy", "critical_path", "bfs")]


def test_overrides_apply_in_their_block_only(tmp_path: Path) -> None:
    from stagetree.engine.settings import Overrides, current_overrides, overriding

    own = f"sqlite:///{tmp_path / 'own.db'}"
    with overriding(storage="memory://", workers=2) as given:
        assert current_overrides() is given
        study = Study("o", LinearTrainer, storage=own, url="")
        assert isinstance(study, Study)
        assert study.placement.storage == "memory://" and study.settings.workers == 2

        async def in_a_task() -> Any:
            return Study("t", LinearTrainer, storage=own, url="")

        assert asyncio.run(in_a_task()).placement.storage == "memory://"
        with overriding(Overrides()):  # cleared for a block
            assert Study("c", LinearTrainer, storage=own, url="").placement.storage == own
        assert study._reopened().placement.storage == "memory://"  # type: ignore[attr-defined]
    assert current_overrides() == Overrides()
    assert Study("after", LinearTrainer, storage=own, url="").placement.storage == own


def test_a_study_joining_an_engine_made_otherwise_is_told(tmp_path: Path) -> None:
    from stagetree.engine import pool
    from stagetree.exceptions import SharedEngineWarning

    url = f"sqlite:///{tmp_path / 'plan.db'}"
    first = Study("a", LinearTrainer, storage=url, executor="inline", url="", workers=1)
    plain = Study("b", LinearTrainer, storage=url, executor="inline", url="", workers=1)
    other = Study(
        "c",
        LinearTrainer,
        storage=url,
        executor="inline",
        url="",
        workers=1,
        checkpoint_budget="1MB",
    )
    try:
        first.open()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plain.open()  # the same settings, the default location: shared, nothing to say
        with pytest.warns(SharedEngineWarning, match="checkpoint_budget=1000000"):
            other.open()
        assert first._engine is plain._engine is other._engine  # type: ignore[attr-defined]
        assert url in pool.open_storages()
    finally:
        for study in (first, plain, other):
            study.close()
    assert url not in pool.open_storages()
