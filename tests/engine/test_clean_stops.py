"""Clean stops lose nothing: a run stopped by Ctrl-C or by its budget checkpoints its
running stages where they stand before it exits, so that the next run trains no step
twice; a stuck trainer ends as a failed request (``step_timeout``) and does not hold a
stopping run.

Before: after a ``"20 steps"`` budget stop the next run trained again every step past
the batches' last checkpoints (no checkpoint was taken where they were aborted), after
Ctrl-C the same (the aborted batches saved nothing), and the inline executor finished
its running batch before it noticed the stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from stop_trainers import Hangs, LoggedTrainer, trained_steps

from stagetree import Study
from stagetree.exceptions import TrialFailedError
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

FAKES = Path(__file__).resolve().parents[1] / "fakes"
LRS = (0.01, 0.02, 0.03)
STEPS = 60


def _grid(log: Path) -> GridSearch:
    space = GridSpace({"lr": [Constant(lr) for lr in LRS]}, fixed={"seed": [0], "log": [str(log)]})
    return GridSearch(space, "score", steps=STEPS)


def _assert_each_step_once(log: Path) -> None:
    steps = trained_steps(str(log))
    twice = sorted({s for s in steps if steps.count(s) > 1})
    assert not twice, f"{len(steps) - len(set(steps))} steps trained twice: {twice[:10]}"
    assert len(steps) == len(LRS) * STEPS  # and every step was trained


def test_a_budget_stop_keeps_what_the_running_stages_trained(tmp_path: Path) -> None:
    log = tmp_path / "trained.txt"
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("b", LoggedTrainer, storage=url, workers=2) as study:
        study.tune(_grid(log), budget="20 steps", progress=False)
        first = study.last_run
    assert first is not None and first.stopped_by == "steps"
    assert 0 < len(trained_steps(str(log))) < len(LRS) * STEPS
    with Study("b", LoggedTrainer, storage=url, workers=2) as study:
        best = study.tune(_grid(log), progress=False)
    assert best is not None
    _assert_each_step_once(log)


# --------------------------------------------------------------------------- Ctrl-C

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {fakes!r})
    from stop_trainers import LoggedTrainer
    from stagetree import Study
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import GridSearch

    log = {log!r}
    space = GridSpace({{"lr": [Constant(lr) for lr in {lrs!r}]}},
                      fixed={{"seed": [0], "log": [log]}})
    tuner = GridSearch(space, "score", steps={steps})
    executor = sys.argv[1] if len(sys.argv) > 1 else "local"
    workers = 2 if executor == "local" else None
    study = Study("c", LoggedTrainer, storage={url!r}, workers=workers, executor=executor)
    if __name__ == "__main__":
        if sys.argv[2] == "tune":
            study.tune(tuner, progress=False)
        else:  # one trial after another, with study.run()
            for lr in {lrs!r}:
                study.run({{"seed": 0, "log": log}}, {{"lr": lr}}, {steps})
    """
)

# --no-check: the first-contact check trains a few steps of its own, in this process.
_CLI = "import sys; from stagetree.cli import main; sys.exit(main(sys.argv[1:]))"


def _command(script: Path, how: str) -> list[str]:
    if how == "cli":
        return [sys.executable, "-c", _CLI, "run", str(script), "--no-progress", "--no-check"]
    executor, call = how.split("-")
    return [sys.executable, str(script), executor, call]


@pytest.mark.parametrize("how", ["local-tune", "inline-tune", "local-run", "cli"])
def test_ctrl_c_keeps_what_the_running_stages_trained(tmp_path: Path, how: str) -> None:
    log = tmp_path / "trained.txt"
    script = tmp_path / "stop_script.py"
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    script.write_text(SCRIPT.format(fakes=str(FAKES), log=str(log), lrs=LRS, steps=STEPS, url=url))
    command = _command(script, how)
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    deadline = time.monotonic() + 60
    while len(trained_steps(str(log))) < 30 and proc.poll() is None:
        assert time.monotonic() < deadline, "the script trained nothing"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the script hung after Ctrl-C:\n{proc.communicate()[1]}")
    assert proc.returncode in (130, -signal.SIGINT), err
    assert len(trained_steps(str(log))) < len(LRS) * STEPS  # it was stopped
    again = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False
    )
    assert again.returncode == 0, again.stderr
    _assert_each_step_once(log)


# --------------------------------------------------------------------------- stuck trainers


def test_step_timeout_fails_a_stuck_trainer_and_replaces_its_worker(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("t", Hangs, storage=url, workers=1, step_timeout=1.0) as study:
        with pytest.raises(TrialFailedError, match=r"step 3 took longer than step_timeout=1s"):
            study.run({"at": 3}, {"lr": 0.5}, 6)
        # The worker that hung was replaced: the next trial trains.
        result = study.run({"at": 3}, {"lr": 0.0}, 6)
        assert result.metrics["w"] == 0.0
        failures = study.failures()
    assert len(failures) == 1 and "step_timeout=1s" in failures[0][1].message


def test_a_stop_does_not_wait_for_a_stuck_trainer(tmp_path: Path) -> None:
    """A budget stops a run whose trainer hangs in a step: closing the study stops that
    worker at once once the stop's bounded wait is over (before: the executor's full
    close timeout after the engine's)."""
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    space = GridSpace({"lr": [Constant(0.5)]}, fixed={"at": [2]})
    study = Study("h", Hangs, storage=url, workers=1, stop_timeout=0.5)
    study.tune(GridSearch(space, "w", steps=10), budget="1s", progress=False)
    assert study.last_run is not None and study.last_run.stopped_by == "wall_seconds"
    executor = study._engine.executor
    assert executor is not None
    pid = executor.pid(0)  # type: ignore[attr-defined]
    calls: list[str] = []
    close, close_now = executor.close, executor.close_now
    executor.close = lambda: (calls.append("close"), close())[-1]  # type: ignore[method-assign]
    executor.close_now = lambda: (calls.append("now"), close_now())[-1]  # type: ignore[method-assign]
    study.close()
    assert calls == ["now"]
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
