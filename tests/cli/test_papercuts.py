"""Command-line and API papercuts of issue 14, each reproduced: the demo's storage and
``status``, ``explain``'s import path and ``--num-trials``, progress from ``Study.tune``,
the README's ``Study`` signature, distinct random trials and linked draws."""

from __future__ import annotations

import inspect
import random
import re
from pathlib import Path

import pytest
from study_trainers import LinearTrainer

from stagetree import Shared, Study
from stagetree import study_api as study_module
from stagetree.cli import main
from stagetree.distributions import Choice, LogUniform, Uniform, shared_draws
from stagetree.exceptions import InvalidSpaceError
from stagetree.hp import Constant, Cosine, Warmup
from stagetree.space import RandomSpace, load_space_file
from stagetree.tuners import RandomSearch

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- a: the demo


def test_status_names_the_databases_beside_a_missing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STAGETREE_STORAGE", raising=False)
    with Study("demo", LinearTrainer, storage="sqlite:///stagetree-demo.db", executor="inline"):
        pass
    Study("demo", LinearTrainer, storage="sqlite:///stagetree-demo.db").open().close()
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert "stagetree.db does not exist" in err
    assert "stagetree-demo.db: pass --storage sqlite:///stagetree-demo.db" in err
    assert main(["status", "--storage", "sqlite:///stagetree-demo.db"]) == 0


def test_readme_and_demo_name_the_demo_storage() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "stagetree status --storage sqlite:///stagetree-demo.db" in readme
    assert "export --storage sqlite:///stagetree-demo.db" in readme
    demo = (ROOT / "examples" / "digits.py").read_text()
    assert 'sqlite:///stagetree-demo.db"' in demo
    assert "status --storage {STORAGE}" in demo and "export --storage {STORAGE}" in demo


def test_run_names_a_storage_that_status_would_not_find(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import study_trainers

    monkeypatch.delenv("STAGETREE_STORAGE", raising=False)
    url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    script = tmp_path / "s.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(Path(study_trainers.__file__).parent)!r})\n"
        "from study_trainers import LinearTrainer\n"
        "from stagetree import Study, GridSpace\n"
        "from stagetree.hp import Constant\n"
        "from stagetree.tuners import GridSearch\n"
        'tuner = GridSearch(GridSpace({"lr": [Constant(0.01)]}), metric="score", steps=2)\n'
        f'study = Study("s", LinearTrainer, storage={url!r}, executor="inline")\n'
    )
    assert main(["run", str(script), "--no-progress"]) == 0
    assert f"stagetree status --storage {url}" in capsys.readouterr().out


# --------------------------------------------------------------------------- b, c: explain


def test_explain_imports_the_files_neighbours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "my_lrs_pc14.py").write_text("LRS = [0.1, 0.05]\n")
    space = tmp_path / "space.py"
    space.write_text(
        "from my_lrs_pc14 import LRS\n"
        "from stagetree.hp import Constant\n"
        "from stagetree.space import GridSpace\n"
        "space = GridSpace({'lr': [Constant(v) for v in LRS]})\n"
        "steps = 10\n"
    )
    assert main(["explain", str(space)]) == 0
    assert re.search(r"^trials:\s+2$", capsys.readouterr().out, re.MULTILINE)
    assert str(tmp_path) not in __import__("sys").path  # restored afterwards


def test_explain_num_trials_for_a_file_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    space = tmp_path / "space.py"
    space.write_text(
        f"open({str(marker)!r}, 'a').write('x')\n"
        "from stagetree.distributions import LogUniform\n"
        "from stagetree.space import RandomSpace\n"
        "space = RandomSpace({'lr': LogUniform(0.001, 0.1)})\n"
        "steps = 10\n"
    )
    assert main(["explain", str(space), "--num-trials", "20"]) == 0
    assert re.search(r"^trials:\s+20$", capsys.readouterr().out, re.MULTILINE)
    marker.unlink()
    # Bad arguments are refused before the file runs.
    assert main(["explain", str(space), "--num-trials", "0"]) == 2
    assert "--num-trials" in capsys.readouterr().err
    with pytest.raises(InvalidSpaceError, match="num_trials must be an int >= 1"):
        load_space_file(space, num_trials=-3)
    assert not marker.exists()
    # Without it anywhere, the message says where it may come from.
    assert main(["explain", str(space)]) == 2
    assert "--num-trials" in capsys.readouterr().err


# --------------------------------------------------------------------------- e: progress


def _tune(study: Study, **kw: object) -> None:
    tuner = RandomSearch(
        RandomSpace({"lr": LogUniform(0.001, 0.1)}), "score", steps=3, num_trials=2
    )
    study.tune(tuner, **kw)  # type: ignore[arg-type]


def test_tune_shows_progress_on_a_terminal_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with Study("p", LinearTrainer, storage="memory://", executor="inline") as study:
        _tune(study)  # stderr is not a terminal here: quiet
        assert "trials" not in capsys.readouterr().err
        monkeypatch.setattr(study_module, "_stderr_is_tty", lambda: True)
        _tune(study)
        err = capsys.readouterr().err
        assert "trials 2/2 finished" in err
        _tune(study, progress=False)  # turned off
        assert "trials" not in capsys.readouterr().err
        monkeypatch.setattr(study_module, "_stderr_is_tty", lambda: False)
        _tune(study, progress=True)  # forced
        assert "trials 2/2 finished" in capsys.readouterr().err
        with pytest.raises(ValueError, match="progress must be"):
            _tune(study, progress="yes")


def test_last_run_tells_this_runs_work_from_the_totals() -> None:
    with Study("lr", LinearTrainer, storage="memory://", executor="inline") as study:
        _tune(study)
        first = study.last_run
        _tune(study)
        second = study.last_run
        total = study.stats()["steps_executed"]
    assert first is not None and second is not None
    assert first.steps_executed == 6 and first.trials_answered == 0
    assert second.steps_executed == 0 and second.trials == second.trials_answered == 2
    assert total == 6
    assert "2 trials (2 found already trained), 0 steps trained" in second.summary()


# --------------------------------------------------------------------------- f: README


def test_readme_study_signature_lists_every_parameter() -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"`Study\(name, trainer,(.*?)\)`", readme, re.DOTALL)
    assert match is not None
    listed = set(re.findall(r"(\w+)=", match.group(1)))
    params = set(inspect.signature(Study.__init__).parameters) - {"self", "name", "trainer"}
    assert listed == params


# --------------------------------------------------------------------------- g: distinct


def test_random_space_samples_distinct_trials() -> None:
    space = RandomSpace({"lr": Choice([0.1, 0.2, 0.3, 0.4, 0.5])}, fixed={"m": Choice([1, 2])})
    # 20 draws of this 10-configuration space repeat some; 10 distinct ones come back.
    repeated = space.sample(20, seed=0, unique=False)
    assert len(set(repeated)) < 20
    ten = space.sample(10, seed=0)
    assert len(ten) == 10 and len(set(ten)) == 10
    assert space.sample(10, seed=0) == ten  # reproducible
    assert space.trials(10, seed=0) == ten
    with pytest.raises(InvalidSpaceError, match="only 10 distinct trials") as info:
        space.sample(11, seed=0)
    assert "ask for at most 10" in str(info.value)


def test_random_search_trains_as_many_trials_as_asked() -> None:
    space = RandomSpace({"lr": Choice([0.001, 0.002, 0.005, 0.01, 0.02, 0.05])})
    tuner = RandomSearch(space, "score", steps=2, num_trials=6, seed=3)
    with Study("d", LinearTrainer, storage="memory://", executor="inline") as study:
        study.tune(tuner)
        assert len(study.trials()) == 6


# --------------------------------------------------------------------------- h: Shared


def test_shared_links_two_draws_of_a_trial() -> None:
    peak = Shared("peak", LogUniform(0.01, 0.3))
    space = RandomSpace(
        {"lr": Warmup(5, peak).then(Cosine(peak, 95), at=5), "wd": peak},
        fixed={"width": Choice([8, 16])},
    )
    trials = space.sample(5, seed=1)
    peaks = []
    for t in trials:
        wd = t.hp["wd"]
        assert isinstance(wd, Constant)
        peak_value = wd.value
        lr = t.hp["lr"].values(0, 7)
        assert lr[4] == pytest.approx(0.8 * peak_value)  # the warm-up climbs to the peak
        assert lr[5] == peak_value  # where the cosine starts
        assert lr[6] < peak_value
        peaks.append(peak_value)
    assert len(set(peaks)) == 5  # a new draw per trial
    assert space.sample(5, seed=1) == trials


def test_shared_in_a_fixed_and_a_sequence_entry() -> None:
    width = Shared("width", Choice([8, 16, 32]))
    space = RandomSpace({"units": width}, fixed={"hidden": width})
    for t in space.sample(3, seed=0):
        assert t.hp["units"] == Constant(t.config["hidden"])


def test_shared_bad_input() -> None:
    with pytest.raises(InvalidSpaceError, match="non-empty name"):
        Shared("", Uniform(0, 1))
    with pytest.raises(InvalidSpaceError, match="wraps another Shared"):
        Shared("a", Shared("b", Uniform(0, 1)))
    space = RandomSpace({"a": Shared("x", Uniform(0, 1)), "b": Shared("x", Uniform(0, 2))})
    with pytest.raises(InvalidSpaceError, match=r"'x'.*two distributions"):
        space.sample(1)
    # Outside a trial's draw a Shared draws afresh; inside shared_draws() it is one value.
    x = Shared("x", Uniform(0, 1))
    rng = random.Random(0)
    assert x.sample(rng) != x.sample(rng)
    with shared_draws():
        assert x.sample(rng) == x.sample(rng)
