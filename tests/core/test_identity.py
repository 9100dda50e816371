"""The trainer fingerprint (stagetree.identity): one per trainer code, whatever the launch
path, unchanged by edits outside the trainer, changed by edits of what it is made of."""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stagetree import identity
from stagetree.identity import (
    current_version,
    is_library_module,
    split_trials,
    trainer_fingerprint,
    trial_version,
)
from stagetree.study import trainer_fingerprint as study_fingerprint

# A study file: a trainer made of a base class, a helper function, a constant, a helper
# class and a user helper module; around it, things that are not the trainer.
STUDY = textwrap.dedent(
    """\
    import math
    import {helpers} as helpers
    from stagetree import GridSpace, Trainer
    from stagetree.hp import Constant

    import numpy as np

    SCALE = 2.0
    UNRELATED = 1
    MEAN = np.array([0.5, 0.25])


    class Config:
        def __init__(self, hidden):
            self.hidden = hidden


    CONFIG = Config(hidden=4)


    def bump(w, lr):
        return w + lr * SCALE + helpers.offset()


    def unrelated():
        return UNRELATED


    class Acc:
        def __init__(self):
            self.total = 0.0


    class Base(Trainer):
        def evaluate(self):
            return {{"w": self.w}}


    class Tiny(Base):
        def __init__(self, config):
            super().__init__(config)
            self.w, self.acc = 0.0, Acc()

        def setup(self, hp):
            self.lr = hp["lr"] if "lr" in {{"lr", "rate", "eta"}} else 0.0

        def train(self):
            self.w = bump(self.w, self.lr) + math.sqrt(0.0) * CONFIG.hidden * MEAN[0]
            return {{"w": self.w}}

        def state_dict(self):
            return {{"w": self.w}}

        def load_state_dict(self, state):
            self.w = state["w"]


    space = GridSpace({{"lr": [Constant(0.1), Constant(0.2)]}}, fixed={{"seed": [0]}})
    """
)
HELPERS = "def offset():\n    return 0.0\n\n\ndef other():\n    return 1\n"
_COUNTER = itertools.count()


def _fingerprint(tmp_path: Path, study: str = STUDY, helpers: str = HELPERS) -> str:
    """The fingerprint of ``Tiny`` in ``study``, run from a fresh file (its own helper
    module name, so that module caching cannot hide an edit)."""
    n = next(_COUNTER)
    (tmp_path / f"helpers_{n}.py").write_text(helpers)
    path = tmp_path / f"study_{n}.py"
    path.write_text(study.format(helpers=f"helpers_{n}"))
    sys.path.insert(0, str(tmp_path))
    try:
        namespace = runpy.run_path(str(path), run_name=f"variant_{n}")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(f"helpers_{n}", None)
    return trainer_fingerprint(namespace["Tiny"])


def test_study_module_reexports_the_fingerprint() -> None:
    assert study_fingerprint is trainer_fingerprint


def test_edits_outside_the_trainer_change_nothing(tmp_path: Path) -> None:
    base = _fingerprint(tmp_path)
    same = {
        "a comment and blank lines above": "# a comment\n\n\n" + STUDY,
        "a comment inside a method": STUDY.replace(
            "        self.lr = hp", "        # the rate\n        self.lr = hp"
        ),
        "a grid entry": STUDY.replace("Constant(0.2)]", "Constant(0.2), Constant(0.3)]"),
        "a main guard": STUDY + "\nif __name__ == '__main__':\n    print(space)\n",
        "an unrelated function": STUDY.replace("return UNRELATED", "return UNRELATED + 1"),
        "an unrelated constant": STUDY.replace("UNRELATED = 1", "UNRELATED = 2"),
    }
    for what, text in same.items():
        assert _fingerprint(tmp_path, text) == base, what
    other_helper = HELPERS.replace("return 1", "return 2")
    assert _fingerprint(tmp_path, helpers=other_helper) == base, "an unused helper"


def test_edits_of_the_trainer_change_the_fingerprint(tmp_path: Path) -> None:
    base = _fingerprint(tmp_path)
    changed = {
        "a trainer method": STUDY.replace('self.lr = hp["lr"]', 'self.lr = 2 * hp["lr"]'),
        "a base class method": STUDY.replace(
            'return {{"w": self.w}}\n\n\nclass Tiny', 'return {{"w": 2 * self.w}}\n\n\nclass Tiny'
        ),
        "a module-level helper it calls": STUDY.replace("lr * SCALE", "lr * SCALE * 1.5"),
        "a constant it reads": STUDY.replace("SCALE = 2.0", "SCALE = 3.0"),
        "a config object it reads": STUDY.replace("hidden=4", "hidden=5"),
        "an array it reads": STUDY.replace("[0.5, 0.25]", "[0.5, 0.5]"),
        "a helper class it uses": STUDY.replace("self.total = 0.0", "self.total = 1.0"),
        "a library function it calls": STUDY.replace("math.sqrt(0.0)", "math.fabs(0.0)"),
        "the class name": STUDY.replace("class Tiny(Base)", "class Tiny2(Base)").replace(
            "space =", "Tiny = Tiny2\nspace ="
        ),
    }
    seen = {base}
    for what, text in changed.items():
        assert text != STUDY, what
        fp = _fingerprint(tmp_path, text)
        assert fp not in seen, what
        seen.add(fp)
    helper = HELPERS.replace("return 0.0", "return 0.5")
    assert _fingerprint(tmp_path, helpers=helper) not in seen, "a helper module function"


def _run(args: list[str], cwd: Path, stdin: str | None = None, seed: str = "0") -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}  # set constants: order must not matter
    done = subprocess.run(
        args, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


PRINT = "\nfrom stagetree.identity import trainer_fingerprint\nprint(trainer_fingerprint(Tiny))\n"


def test_every_launch_path_gives_one_fingerprint(tmp_path: Path) -> None:
    """``python x.py``, stdin, ``-c``, an import from another script, ``runpy`` under
    the name ``stagetree run`` uses, and a notebook kernel: one fingerprint."""
    (tmp_path / "helpers.py").write_text(HELPERS)
    source = STUDY.format(helpers="helpers")
    (tmp_path / "study.py").write_text(source + PRINT)
    py = sys.executable
    prints = {
        "python study.py": _run([py, "study.py"], tmp_path),
        "another hash seed": _run([py, "study.py"], tmp_path, seed="12345"),
        "stdin": _run([py, "-"], tmp_path, stdin=source + PRINT),
        "-c": _run([py, "-c", source + PRINT], tmp_path),
        "import": _run([py, "-c", "import study"], tmp_path),
        "stagetree run's runpy": _run(
            [py, "-c", "import runpy; runpy.run_path('study.py', run_name='__stagetree_run__')"],
            tmp_path,
        ),
    }
    prints["notebook"] = _notebook_output(tmp_path, [source, PRINT])
    values = {what: out.strip().splitlines()[-1] for what, out in prints.items()}
    assert len(set(values.values())) == 1, values


def _notebook_output(cwd: Path, cells: list[str]) -> str:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    return "".join(
        o.get("text", "") for c in nb.cells for o in c.outputs if o.get("name") == "stdout"
    )


def test_library_modules_are_recognised() -> None:
    assert is_library_module("stagetree.torch.trainer")  # an installed distribution
    assert is_library_module("math") and is_library_module("collections.abc")
    assert is_library_module("numpy")
    assert not is_library_module("__main__")
    assert not is_library_module("study_trainers")  # tests/: the user's own module


def _clear_version_caches() -> None:
    for cached in (
        identity._library_version,
        identity._distributions_of,
        identity._installed_distributions,
    ):
        cached.cache_clear()


def test_library_versions_come_without_scanning_every_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # packages_distributions() parses every installed distribution's metadata (0.2-2 s),
    # the bulk of a finished study's re-run; the versions must come without it, the same.
    modules = ["numpy", "stagetree.trainer", "pytest", "math", "study_trainers"]
    _clear_version_caches()
    expected = {m: identity._library_version(m) for m in modules}

    def scan_all() -> None:
        raise AssertionError("packages_distributions() was called")

    monkeypatch.setattr(importlib.metadata, "packages_distributions", scan_all)
    _clear_version_caches()
    try:
        assert {m: identity._library_version(m) for m in modules} == expected
        assert expected["numpy"] == f"numpy=={importlib.metadata.version('numpy')}"
        assert expected["pytest"] == f"pytest=={importlib.metadata.version('pytest')}"
    finally:
        _clear_version_caches()


def test_distributions_of_a_module_are_those_of_the_standard_library() -> None:
    # The fingerprint names a library by the distribution packages_distributions() gives:
    # the same for every top-level name installed here, so no fingerprint changes.
    expected = importlib.metadata.packages_distributions()
    assert expected
    for top, names in expected.items():
        assert identity._distributions_of(top) == tuple(names), top
    assert identity._distributions_of("no_such_module_anywhere") == ()


def test_fingerprint_ignores_positions_and_module_names(tmp_path: Path) -> None:
    text = (
        "from stagetree import Trainer\nclass T(Trainer):\n    def train(self):\n        return 1\n"
    )
    a = runpy.run_path(_write(tmp_path / "a.py", text), run_name="__main__")["T"]
    b = runpy.run_path(_write(tmp_path / "b.py", "\n" * 30 + text), run_name="other")["T"]
    assert trainer_fingerprint(a) == trainer_fingerprint(b)
    ns: dict[str, Any] = {"__name__": "x"}
    exec(compile(text, "<stdin>", "exec"), ns)
    assert trainer_fingerprint(ns["T"]) == trainer_fingerprint(a)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return os.fspath(path)


def test_trial_versions_and_the_current_one() -> None:
    meta = {"version": "v1"}
    trials = [
        {"id": 1, "created": 1.0, "attrs": {}},  # before versions were recorded: v1
        {"id": 2, "created": 2.0, "attrs": {"version": "v2"}},
        {"id": 3, "created": 3.0, "attrs": {"version": "v2"}},
    ]
    assert trial_version(trials[0], meta) == "v1"
    assert current_version(trials, meta) == "v2"
    own, hidden = split_trials(trials, meta)
    assert [t["id"] for t in own] == [2, 3] and hidden == 1
    # A Study of v1 opened again marks its trials as the latest run.
    trials[0]["attrs"] = {"opened": 4.0}
    assert current_version(trials, meta) == "v1"
    assert current_version([], meta) == "v1"
