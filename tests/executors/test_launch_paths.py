"""One study, every way of launching it, one SQLite storage: the first launch trains, the
others find everything (no step trained again, ``state()`` found), workers never run
the user's script, and a changed trainer is announced once and never mixed with the old
one in ``best``, ``status`` or ``export``.

Every launch is a real process with a real worker process (``workers=1``), so these
tests also cover how trainers travel to workers (pickled by value).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stagetree.plan import open_storage

pytestmark = pytest.mark.slow

TRAINER = textwrap.dedent(
    """\
    import os
    from stagetree import GridSpace, Study, Trainer
    from stagetree.hp import Constant
    from stagetree.tuners import GridSearch

    # Workers must never run this file: every process that does leaves a marker.
    open(os.path.join(os.environ["MARKERS"], f"ran-{os.getpid()}"), "w").close()

    SCALE = 1.0


    def bump(w, lr):
        return w + lr * SCALE


    class Tiny(Trainer):
        def __init__(self, config):
            super().__init__(config)
            self.w = 0.0

        def setup(self, hp):
            self.lr = hp["lr"]

        def train(self):
            self.w = bump(self.w, self.lr)

        def evaluate(self):
            return {"w": self.w}

        def state_dict(self):
            return {"w": self.w}

        def load_state_dict(self, state):
            self.w = state["w"]


    space = GridSpace({"lr": [Constant(0.1), Constant(0.2)]}, fixed={"seed": [0]})
    tuner = GridSearch(space, metric="w", steps=4)
    study = Study("tiny", Tiny, storage=os.environ["DB"], workers=1)
    """
)
TUNE = textwrap.dedent(
    """\
    with study:
        best = study.tune(tuner)
        print("BEST", best.metrics["w"], study.stats()["steps_executed"])
    """
)
GUARDED = TRAINER + "\n\nif __name__ == '__main__':\n" + textwrap.indent(TUNE, "    ")
UNGUARDED = TRAINER + "\n" + TUNE
RESULTS = textwrap.dedent(
    """\
    from stagetree.hp import Constant
    from study import study  # a results script importing the study module

    with study:
        state = study.state({"seed": 0}, {"lr": Constant(0.2)}, 4)
        best = study.best("w")
        print("STATE", state, "BEST", best.metrics[4]["w"], len(study.trials()))
    """
)


class Launcher:
    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.markers = tmp_path / "markers"
        self.markers.mkdir()
        self.url = f"sqlite:///{tmp_path / 'plan.db'}"
        self.env = {**os.environ, "MARKERS": str(self.markers), "DB": self.url}
        self.env.pop("STAGETREE_STORAGE", None)

    def run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        before = set(self.markers.iterdir())
        done = subprocess.run(
            args,
            cwd=self.dir,
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        new = set(self.markers.iterdir()) - before
        assert len(new) <= 1, f"the study file ran in {len(new)} processes: {done.stderr}"
        return done

    def executed(self) -> float:
        with open_storage(self.url) as plan:
            return plan.stats("engine").get("steps_executed", 0.0)

    def stagetree(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-m", "stagetree.cli", *args])


def _notebook(launch: Launcher, cells: list[str]) -> str:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    saved = dict(os.environ)
    os.environ.update({"MARKERS": str(launch.markers), "DB": launch.url})
    try:
        nbclient.NotebookClient(
            nb,
            timeout=180,
            kernel_name="python3",
            resources={"metadata": {"path": str(launch.dir)}},
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return "".join(
        o.get("text", "") for c in nb.cells for o in c.outputs if o.get("name") == "stdout"
    )


def test_every_launch_path_shares_one_plan(tmp_path: Path) -> None:
    launch = Launcher(tmp_path)
    (tmp_path / "study.py").write_text(GUARDED)
    py = sys.executable
    first = launch.run([py, "study.py"])
    assert _best(first.stdout) == pytest.approx(0.8)
    assert launch.executed() == 8  # two trials of 4 steps
    # Every other way of launching the same study trains nothing.
    launch.stagetree("run", "study.py", "--no-progress")
    launch.run([py, "-"], stdin=GUARDED)
    launch.run([py, "-c", GUARDED])
    (tmp_path / "results.py").write_text(RESULTS)
    results = launch.run([py, "results.py"])
    assert "STATE {'w': 0.8" in results.stdout and "BEST 0.8" in results.stdout
    assert results.stdout.rstrip().endswith(" 2")  # two trials, no duplicates
    out = _notebook(launch, [TRAINER, TUNE])
    assert "BEST 0.8" in out, out
    assert launch.executed() == 8
    assert "TrainerChangedWarning" not in results.stderr
    status = launch.stagetree("status", "--storage", launch.url).stdout
    assert "trials: 2 (2 finished" in " ".join(status.split()), status
    assert "hidden" not in status


def test_a_script_without_main_guard_runs_once(tmp_path: Path) -> None:
    launch = Launcher(tmp_path)
    (tmp_path / "study.py").write_text(UNGUARDED.replace("workers=1", "workers=2"))
    py = sys.executable
    first = launch.run([py, "study.py"])
    assert "BEST 0.8" in first.stdout and "died" not in first.stderr
    assert launch.executed() == 8
    run = launch.stagetree("run", "study.py", "--no-progress")
    assert "BEST 0.8" in run.stdout  # the script's own tune, answered from the plan
    assert "best w" in run.stdout  # then stagetree run's report
    assert launch.executed() == 8
    assert len(list(launch.markers.iterdir())) == 2  # one per launch, none in workers


def test_a_changed_trainer_is_announced_once_and_never_mixed(tmp_path: Path) -> None:
    launch = Launcher(tmp_path)
    study_file = tmp_path / "study.py"
    study_file.write_text(GUARDED)
    py = sys.executable
    launch.run([py, "study.py"])
    # Edits outside the trainer: a comment, a grid entry, the main guard gone.
    edited = "# tuned by hand\n\n" + UNGUARDED.replace(
        "Constant(0.2)]", "Constant(0.2), Constant(0.3)]"
    )
    study_file.write_text(edited)
    again = launch.run([py, "study.py"])
    assert "changed" not in again.stderr
    assert launch.executed() == 12  # only the new grid entry trained
    # A real change of the trainer: a constant its helper reads.
    study_file.write_text(edited.replace("SCALE = 1.0", "SCALE = 10.0"))
    changed = launch.run([py, "study.py"])
    message = (
        "trainer Tiny changed since the last run on this storage: 3 trials will train "
        "again; pass version="
    )
    assert changed.stderr.count(message) == 1, changed.stderr
    assert _best(changed.stdout) == pytest.approx(12.0)
    assert launch.executed() == 24
    quiet = launch.run([py, "study.py"])  # the new version is the latest run now
    assert "changed" not in quiet.stderr and launch.executed() == 24
    status = " ".join(launch.stagetree("status", "--storage", launch.url).stdout.split())
    assert "trials: 3 (3 finished" in status and "3 trials hidden" in status, status
    assert "best w: 12 " in status, status
    export = launch.stagetree("export", "--storage", launch.url, "--format", "json")
    records = json.loads(export.stdout)
    assert len(records) == 3 and "3 trials of older trainer versions" in export.stderr
    finals = sorted(r["metric.w"] for r in records)
    assert finals == pytest.approx([4.0, 8.0, 12.0])
    # Pinning the old version by hand brings its results back, training nothing.
    old = re.search(r"pass version=('[0-9a-f]+')", changed.stderr)
    assert old is not None
    pinned = edited.replace("SCALE = 1.0", "SCALE = 10.0").replace(
        "workers=1)", f"workers=1, version={old.group(1)})"
    )
    study_file.write_text(pinned)
    back = launch.run([py, "study.py"])
    assert "changed" not in back.stderr, back.stderr  # nothing trains again
    assert _best(back.stdout) == pytest.approx(1.2) and launch.executed() == 24
    status = " ".join(launch.stagetree("status", "--storage", launch.url).stdout.split())
    assert "best w: 1.2 " in status and "3 trials hidden" in status, status


def _best(stdout: str) -> float:
    match = re.search(r"BEST (\S+)", stdout)
    assert match is not None, stdout
    return float(match.group(1))


def test_a_notebook_trainer_trains_in_worker_processes(tmp_path: Path) -> None:
    launch = Launcher(tmp_path)
    cells = [TRAINER.replace("workers=1", "workers=2"), TUNE]
    assert _best(_notebook(launch, cells)) == pytest.approx(0.8)
    assert launch.executed() == 8
    assert len(list(launch.markers.iterdir())) == 1  # the kernel; no worker ran the cell
    # The same notebook again (a fresh kernel: a restart) trains nothing.
    assert _best(_notebook(launch, cells)) == pytest.approx(0.8)
    assert launch.executed() == 8
