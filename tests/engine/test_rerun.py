"""Running a finished study again answers every trial from the storage: it starts no
worker process, and closing it waits on none."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.executors.local import LocalExecutor, shutdown_pool
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.tuners import ASHA


def _tuner() -> ASHA:
    space = GridSpace({"lr": [Constant(0.01), Constant(0.03)]}, fixed={"seed": [0, 1]})
    return ASHA(space, "score", mode="max", min_steps=1, max_steps=4, eta=2, num_trials=4, seed=0)


def test_a_rerun_that_trains_nothing_starts_no_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGETREE_WORKER_IDLE", "0")  # no pool: a started worker shows
    shutdown_pool()
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("s", LinearTrainer, storage=url, workers=2) as study:
        first = study.tune(_tuner(), progress=False)
        assert study.last_run is not None and study.last_run.steps_executed > 0
    assert multiprocessing.active_children() == []

    with Study("s", LinearTrainer, storage=url, workers=2) as again:
        best = again.tune(_tuner(), progress=False)
        assert again.last_run is not None
        assert again.last_run.steps_executed == 0
        assert again.last_run.trials_answered == again.last_run.trials > 0
        assert multiprocessing.active_children() == []  # no worker was started
        assert again.num_workers == 2  # the count, without starting them
        assert multiprocessing.active_children() == []
    assert first is not None and best is not None
    assert best.metrics == first.metrics


def test_workers_start_for_the_first_trial_the_storage_cannot_answer(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("s", LinearTrainer, storage=url, workers=2) as study:
        study.tune(_tuner(), progress=False)
    # Another study on the same plan: half of its trials are known, half are new.
    space = GridSpace({"lr": [Constant(0.01), Constant(0.07)]}, fixed={"seed": [0, 1]})
    tuner = ASHA(space, "score", mode="max", min_steps=1, max_steps=4, eta=2, num_trials=4)
    with Study("t", LinearTrainer, storage=url, workers=2) as other:
        best = other.tune(tuner, progress=False)
        assert other.last_run is not None
        assert other.last_run.steps_executed > 0
        assert 0 < other.last_run.trials_answered < other.last_run.trials
    assert best is not None


EXIT_SCRIPT = """
import atexit, gc, sys
atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0))  # first in, last out
sys.path.insert(0, {fakes!r})
from study_trainers import LinearTrainer
from stagetree import Study
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.tuners import ASHA

if sys.argv[1] == "study":
    space = GridSpace({{"lr": [Constant(0.01)]}}, fixed={{"seed": [0]}})
    tuner = ASHA(space, "score", mode="max", min_steps=1, max_steps=2, num_trials=1)
    with Study("s", LinearTrainer, storage="memory://", executor="inline") as study:
        study.tune(tuner, progress=False)
"""


@pytest.mark.parametrize(
    ("how", "env", "frozen"),
    [("study", {}, True), ("study", {"STAGETREE_EXIT_GC": "1"}, False), ("import", {}, False)],
)
def test_a_process_that_ran_a_study_exits_without_collecting_its_objects(
    tmp_path: Path, how: str, env: dict[str, str], frozen: bool
) -> None:
    # The interpreter's shutdown collects garbage by traversing every object alive (with
    # torch loaded, most of a re-run's exit): after a study, the objects are frozen first.
    script = tmp_path / "exit_gc.py"
    script.write_text(EXIT_SCRIPT.format(fakes=str(Path(__file__).resolve().parents[1] / "fakes")))
    environ = {k: v for k, v in os.environ.items() if k != "STAGETREE_EXIT_GC"} | env
    out = subprocess.run(
        [sys.executable, str(script), how],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["frozen", str(frozen)]


def test_a_first_run_starts_the_fork_server_before_its_tuner_asks_a_rerun_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The workers of a run that will train fork from a server that imports torch
    # (seconds): a first run starts it while its tuner is built; a re-run that trains
    # nothing starts nothing.
    calls: list[str] = []
    prepare, start = LocalExecutor.prepare, LocalExecutor.start

    def spy_prepare(self: LocalExecutor) -> None:
        calls.append("prepare")
        prepare(self)

    def spy_start(self: LocalExecutor) -> None:
        calls.append("start")
        start(self)

    monkeypatch.setattr(LocalExecutor, "prepare", spy_prepare)
    monkeypatch.setattr(LocalExecutor, "start", spy_start)
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("s", LinearTrainer, storage=url, workers=2) as study:
        study.tune(_tuner(), progress=False)
    assert calls == ["prepare", "start"]
    calls.clear()
    with Study("s", LinearTrainer, storage=url, workers=2) as again:
        again.tune(_tuner(), progress=False)
    assert calls == []
