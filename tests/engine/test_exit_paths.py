"""A script that tunes and exits without closing its study (no ``with study:``, no
``close()``) ends promptly and quietly on every path: the engine's driver thread and the
executor's exit hook must not race for the worker processes (a worker reaped twice, or
replaced by a fresh process that multiprocessing's exit handler then waits for forever).
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
from exit_runs import run_many

FAKES = Path(__file__).resolve().parents[1] / "fakes"

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {fakes!r})
    from study_trainers import LinearTrainer, SlowLinearTrainer
    from stagetree import Study
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import ASHA

    run, how = sys.argv[1], sys.argv[2]
    lrs = [Constant(0.01), Constant(0.02), Constant(0.03), Constant(0.05)]
    space = GridSpace({{"lr": lrs}}, fixed={{"seed": [0]}})
    # Interrupted: still training then (rung 0 alone is 4 x 100 steps of 20 ms).
    steps, first = (400, 100) if how == "interrupt" else (4, 1)
    tuner = ASHA(space, "score", mode="max", min_steps=first, max_steps=steps, eta=2,
                 num_trials=len(space), seed=0)
    trainer = SlowLinearTrainer if how == "interrupt" else LinearTrainer
    study = Study("s", trainer, storage=f"sqlite:///plan-{{run}}.db", workers=2)
    if how == "interrupt":
        print("TUNING", flush=True)
    best = study.tune(tuner, progress=False)
    assert best is not None
    if how == "error":
        raise RuntimeError("the script fails after tuning")
    if how == "fork":
        import multiprocessing, os, time
        workers = {{p.pid for p in multiprocessing.active_children()}}
        assert workers
        child = os.fork()
        if child == 0:
            # The exit hooks inherited from the parent run (multiprocessing's own one
            # complains that it cannot join its parent's children: not shown).
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            sys.exit(0)
        assert os.waitpid(child, 0)[1] == 0
        time.sleep(0.5)
        alive = {{p.pid for p in multiprocessing.active_children()}}
        assert workers <= alive, f"the child stopped the parent's workers {{workers - alive}}"
        # The parent's workers are still its own: another study of this engine trains
        # with them.
        more = GridSpace({{"lr": [Constant(0.07)]}}, fixed={{"seed": [0]}})
        more_tuner = ASHA(more, "score", mode="max", min_steps=1, max_steps=4, eta=2,
                          num_trials=1, seed=0)
        other = Study("s2", trainer, storage=f"sqlite:///plan-{{run}}.db", workers=2)
        other.tune(more_tuner, progress=False)
        assert other.last_run.steps_executed > 0
        print("FORK OK", flush=True)
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "tune_no_close.py"
    path.write_text(SCRIPT.format(fakes=str(FAKES)))
    return path


@pytest.mark.slow
def test_tune_without_close_exits_promptly_every_time(script: Path) -> None:
    exits = run_many(script, 20, ["end"], timeout=120.0)
    bad = [e for e in exits if not e.clean(0)]
    assert not bad, "\n".join(f"run {e.run}: rc={e.returncode}\n{e.stderr}" for e in bad)


def test_a_script_that_fails_after_tune_exits_promptly(script: Path) -> None:
    exits = run_many(script, 4, ["error"], timeout=120.0)
    bad = [e for e in exits if e.returncode != 1 or "Exception ignored" in e.stderr]
    assert not bad, "\n".join(f"run {e.run}: rc={e.returncode}\n{e.stderr}" for e in bad)
    assert all("the script fails after tuning" in e.stderr for e in exits)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_leaves_the_parents_workers_alone(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "0", "fork"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=script.parent,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "FORK OK" in done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr


def test_ctrl_c_in_tune_without_close_exits_promptly(script: Path) -> None:
    for run in range(3):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(run), "interrupt"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=script.parent,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "TUNING"
        time.sleep(0.5)  # its workers start and train (20 ms steps)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"run {run} hung after Ctrl-C:\n{err}")
        assert proc.returncode != 0
        assert "Exception ignored" not in err, err
