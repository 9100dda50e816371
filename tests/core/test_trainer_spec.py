"""How trainers travel to worker processes (stagetree.executors._spec): the user's own
classes by value into a fresh interpreter that never imports their module."""

from __future__ import annotations

import enum
import functools
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagetree.executors._spec import TrainerSpec
from stagetree.trainer import Trainer


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


@dataclass
class Settings:
    scale: float = 3.0


SETTINGS = Settings()


def _in_fresh_interpreter(spec: TrainerSpec) -> str:
    code = (
        "import pickle, sys\n"
        "spec = pickle.loads(sys.stdin.buffer.read())\n"
        "cls = spec.resolve()\n"
        "print(cls({}).train(), sorted(m for m in sys.modules if m.startswith('test_')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(spec), capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


def test_decorated_members_and_globals_travel_by_value() -> None:
    def make() -> type[Trainer]:
        class Decorated(Trainer):
            mode = Mode.SLOW

            @functools.cached_property
            def factor(self) -> float:
                return SETTINGS.scale

            @functools.lru_cache(maxsize=4)  # noqa: B019
            def base(self) -> float:
                return 1.0 if self.mode is Mode.FAST else 2.0

            def train(self) -> dict[str, Any]:
                return {"x": self.base() * self.factor}

        return Decorated

    spec = TrainerSpec.of(make())
    assert spec.by_value
    # The worker computes what the class computes here, and never imported this module.
    assert _in_fresh_interpreter(spec) == "{'x': 6.0} []"


SPAWNER = """\
import multiprocessing, os, sys
from stagetree.executors._spec import no_main_rerun

open(os.path.join(os.environ["MARKERS"], f"ran-{os.getpid()}"), "w").close()
if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=os.getpid)
    with no_main_rerun() if sys.argv[1] == "no-rerun" else contextlib_nullcontext():
        process.start()
    process.join()
    assert process.exitcode == 0
"""


def test_no_main_rerun_leaves_the_main_script_out(tmp_path: Path) -> None:
    script = tmp_path / "spawner.py"
    script.write_text("from contextlib import nullcontext as contextlib_nullcontext\n" + SPAWNER)
    for mode, processes in (("rerun", 2), ("no-rerun", 1)):
        markers = tmp_path / mode
        markers.mkdir()
        env = {**os.environ, "MARKERS": str(markers)}
        done = subprocess.run(
            [sys.executable, str(script), mode], env=env, capture_output=True, timeout=60
        )
        assert done.returncode == 0, done.stderr.decode()
        # Plain spawn runs the script again in the child; no_main_rerun does not.
        assert len(list(markers.iterdir())) == processes, mode


KEEPER = """\
import sys, tempfile
from stagetree import Trainer
from stagetree.executors.local import LocalExecutor

SEEN = {"n": 0}


class Counting(Trainer):
    def train(self):
        SEEN["n"] += 1
        return {}

    def evaluate(self):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


if __name__ == "__main__":
    train = Counting.train
    LocalExecutor(Counting, 1, checkpoint_dir=tempfile.mkdtemp())  # by value
    Counting({}).train()
    print(Counting.train is train, SEEN["n"])
"""


def test_an_executor_leaves_the_users_class_as_it_was(tmp_path: Path) -> None:
    """Checking a by-value trainer in the process that defined it must not unpickle it
    there: cloudpickle would rebind the class to copies of its methods, whose globals
    are a copy of the module's (the user's own code would no longer see its writes)."""
    script = tmp_path / "keeper.py"
    script.write_text(KEEPER)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1"]
