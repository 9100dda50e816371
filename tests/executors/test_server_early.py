"""The fork server of a study's local workers starts when ``tune()`` begins, before the
storage opens (issue 22, start-up), and ends again when no worker came of it: a run
answered from the storage, a run that failed before its workers started, a program
that exits without closing. Each case runs in a fresh interpreter (a fork from the
driver needs a process with no other thread)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import stagetree

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

FAKES = Path(__file__).resolve().parents[1] / "fakes"

SCRIPT = textwrap.dedent(
    """
    import multiprocessing.forkserver, os, sys
    sys.path.insert(0, {fakes!r})
    import stagetree.study as study_module
    from stagetree.executors._driverfork import server_pid
    from study_trainers import LinearTrainer
    from stagetree import Study
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import ASHA

    def running_server():
        mp = multiprocessing.forkserver._forkserver._forkserver_pid
        return server_pid() or mp

    at_open = []
    attach = study_module.Study._attach

    def recording_attach(self):  # the storage opens here
        at_open.append(running_server())
        return attach(self)

    study_module.Study._attach = recording_attach

    storage, runs = sys.argv[1], int(sys.argv[2])
    space = GridSpace({{"lr": [Constant(0.01), Constant(0.02)]}}, fixed={{"seed": [0]}})
    for run in range(runs):
        tuner = ASHA(space, "score", mode="max", min_steps=1, max_steps=2, eta=2,
                     num_trials=len(space), seed=0)
        study = Study("s", LinearTrainer, storage=storage, workers=2)
        try:
            study.tune(tuner, progress=False)
        except Exception as exc:
            print("FAILED", type(exc).__name__, flush=True)
        print("AT_OPEN", at_open[-1], flush=True)
        print("AFTER", running_server(), flush=True)
        study.close()
        print("CLOSED", running_server(), flush=True)
    """
)


def _run(tmp_path: Path, *args: str, fork_driver: str = "1") -> dict[str, list[str]]:
    """The script's output lines by their first word, run in a fresh interpreter."""
    script = tmp_path / "early.py"
    script.write_text(SCRIPT.format(fakes=str(FAKES)))
    path = os.pathsep.join([str(FAKES), str(Path(stagetree.__file__).parents[1])])
    env = {**os.environ, "PYTHONPATH": path, "STAGETREE_FORK_DRIVER": fork_driver}
    env.pop("STAGETREE_START_METHOD", None)
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=True,
    )
    lines: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        word, _, rest = line.partition(" ")
        lines.setdefault(word, []).append(rest)
    return lines


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("fork_driver", ["1", "0"])
def test_the_fork_server_runs_before_the_storage_opens(tmp_path: Path, fork_driver: str) -> None:
    # Forked from the driver, or (STAGETREE_FORK_DRIVER=0, as when the driver may not
    # fork) a fresh interpreter: its imports overlap the storage's opening and the rest.
    out = _run(tmp_path, "sqlite:///plan.db", "1", fork_driver=fork_driver)
    assert "FAILED" not in out
    [at_open] = out["AT_OPEN"]
    assert at_open != "None"
    assert out["AFTER"] == [at_open]  # the same server forked the workers: it stays


@pytest.mark.parametrize("fork_driver", ["1", "0"])
def test_a_run_that_fails_before_its_workers_start_ends_the_server(
    tmp_path: Path, fork_driver: str
) -> None:
    # The storage cannot be opened: the server started for the run is ended with it.
    bad = f"sqlite:///{tmp_path / 'missing' / 'dir' / 'plan.db'}"
    out = _run(tmp_path, bad, "1", fork_driver=fork_driver)
    assert out["FAILED"] == ["StorageError"]
    [at_open] = out["AT_OPEN"]
    assert at_open != "None"
    assert out["AFTER"] == ["None"]
    assert _gone(int(at_open))


def test_a_run_answered_from_the_storage_ends_the_server_it_started(tmp_path: Path) -> None:
    # The first process trains; the second one's run is a replay: no worker starts, and
    # the server its tune() started is ended (not left importing beside the replay).
    _run(tmp_path, "sqlite:///plan.db", "1")
    out = _run(tmp_path, "sqlite:///plan.db", "1")
    assert "FAILED" not in out
    [at_open] = out["AT_OPEN"]
    assert at_open != "None"
    assert out["AFTER"] == ["None"] and out["CLOSED"] == ["None"]
    assert _gone(int(at_open))


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    from stagetree.executors._driverfork import server_pid
    from stagetree.executors.local import start_server_early
    from slow_trainer import SlowImports

    if __name__ == "__main__":
        start_server_early(SlowImports)  # its server imports for a minute
        print("SERVER", server_pid(), flush=True)
    """
)

SLOW_TRAINER = textwrap.dedent(
    """
    from study_trainers import LinearTrainer


    class SlowImports(LinearTrainer):
        warmup_imports = ("slow_import",)
    """
)


def _slow_server_script(tmp_path: Path, text: str) -> tuple[Path, str]:
    """``text`` as a script in ``tmp_path`` beside a trainer whose fork server imports
    for a minute, and the PYTHONPATH to run it with."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "slow_trainer.py").write_text(SLOW_TRAINER)
    script = tmp_path / "script.py"
    script.write_text(text.format(here=str(tmp_path)))
    path = os.pathsep.join([str(tmp_path), str(FAKES), str(Path(stagetree.__file__).parents[1])])
    return script, path


def test_a_program_that_exits_with_an_unused_server_does_not_wait_for_it(
    tmp_path: Path,
) -> None:
    # The server still imports when the program ends: it is ended, not left holding
    # the program's output open (a pipeline such as `python x.py | tee log` waits).
    script, path = _slow_server_script(tmp_path, EXIT_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=40,  # the output closes once the program and its server ended
        env={**os.environ, "PYTHONPATH": path},
        check=True,
    )
    pid = done.stdout.split("SERVER", 1)[1].split()[0]
    assert pid != "None"
    assert _gone(int(pid))


INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    from stagetree import Study
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import ASHA
    from slow_trainer import SlowImports

    space = GridSpace({{"lr": [Constant(0.01), Constant(0.02)]}}, fixed={{"seed": [0]}})
    tuner = ASHA(space, "score", mode="max", min_steps=1, max_steps=2, eta=2,
                 num_trials=len(space), seed=0)
    study = Study("s", SlowImports, storage=f"sqlite:///{{sys.argv[1]}}", workers=2)
    print("TUNING", flush=True)
    study.tune(tuner, progress=False)  # its server imports for a minute
    """
)


def test_ctrl_c_while_the_fork_server_imports_ends_the_program_and_the_server(
    tmp_path: Path,
) -> None:
    # tune() waits for the server to fork its first worker; a Ctrl-C then stops the
    # program at once (not after the server's imports), and the server with it.
    script, path = _slow_server_script(tmp_path, INTERRUPT_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "plan.db")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "TUNING"
    time.sleep(2.0)  # the server forked and importing; tune() waits for it
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)  # the output closes: the server ended too
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the program or its fork server still ran 30 s after Ctrl-C")
    assert proc.returncode != 0
    assert "interrupted; run again to resume" in err
    assert "Exception ignored" not in err, err


PREPARED_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {fakes!r})
    from stagetree.executors._driverfork import server_pid
    from stagetree.executors.local import _preload_modules, _server_context, end_unused_server
    from study_trainers import LinearTrainer

    if __name__ == "__main__":
        _server_context(_preload_modules(LinearTrainer))  # as an executor's prepare() does
        before = server_pid()
        end_unused_server()
        print("SERVERS", before, server_pid(), flush=True)
    """
)


def test_only_a_server_started_early_is_ended_as_unused(tmp_path: Path) -> None:
    # A server an executor started (another study's, about to fork its workers) is not
    # ended by a study that closes or re-runs beside it.
    script = tmp_path / "prepared.py"
    script.write_text(PREPARED_SCRIPT.format(fakes=str(FAKES)))
    path = os.pathsep.join([str(FAKES), str(Path(stagetree.__file__).parents[1])])
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": path},
        check=True,
    ).stdout
    before, after = out.split("SERVERS", 1)[1].split()
    assert before != "None" and after == before
