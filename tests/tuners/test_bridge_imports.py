"""The Optuna bridge's database copy in a thread of the driver (no fork server to fork a
copy process from: here the inline executor) imports SQLAlchemy's ORM with the driver
held off. Imported in the copy thread while the driver's thread built a Core statement,
it stopped the driver ("partially initialized module 'sqlalchemy.orm.exc' has no
attribute 'UnmappedClassError'", seen in a small ASHA + TPE run), and the run ended
with its replacement's errors. Checked in a fresh interpreter (the ORM not imported
yet) by an import hook that sees where the ORM is imported: not timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

FAKES = Path(__file__).resolve().parents[1] / "fakes"

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys, threading
    import optuna
    from study_trainers import LinearTrainer
    from stagetree import Study
    from stagetree.distributions import LogUniform
    from stagetree.space import RandomSpace
    from stagetree.tuners import ASHA

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    assert "sqlalchemy.orm" not in sys.modules
    study = Study("s", LinearTrainer, storage=f"sqlite:///{sys.argv[1]}/plan.db",
                  executor="inline")
    seen = []

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "sqlalchemy.orm" and not seen:
                engine = study._engine_obj
                seen.append([threading.current_thread().name, engine.lock._is_owned()])
            return None

    sys.meta_path.insert(0, Hook())
    tuner = ASHA(RandomSpace(hp={"lr": LogUniform(1e-3, 0.2)}), "score", min_steps=1,
                 max_steps=4, eta=2, num_trials=6,
                 sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=2))
    with study:
        study.tune(tuner, progress=False)
        states = sorted({t.state for t in study.trials()})
    print(json.dumps({"seen": seen, "states": states}))
    """
)


def test_the_copy_thread_imports_the_orm_with_the_driver_held_off(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=FAKES,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES), *sys.path])},
        timeout=300,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["states"] == ["done"]
    # Imported once, by the tuner's (main) thread, the engine's lock held.
    assert got["seen"] == [["MainThread", True]]
