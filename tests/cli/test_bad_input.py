"""Bad input gets a clear error that names the problem, before anything is written; and
reading a storage never writes to it (issue: trust in the first hour)."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from failing_trainers import Counter

from stagetree import Choice, Study
from stagetree.cli import main
from stagetree.exceptions import (
    InvalidSpaceError,
    InvalidTrialError,
    ReplayDivergedWarning,
    StagetreeWarning,
    StorageError,
    TunerError,
)
from stagetree.plan import open_storage
from stagetree.space import GridSpace, RandomSpace
from stagetree.tuners import GridSearch, RandomSearch


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'plan.db'}"


def rows(tmp_path: Path) -> tuple[int, int, int]:
    """(studies, trials, log records) in the test storage."""
    s = open_storage(url(tmp_path))
    try:
        names = [x["name"] for x in s.studies()]
        trials = sum(len(s.trials(n)) for n in names)
        logs = sum(len(s.read_log(n)) for n in names)
        return len(names), trials, logs
    finally:
        s.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"executor": "gpu"}, "unknown executor 'gpu': use one of 'inline', 'local'"),
        ({"threads_per_worker": 0}, "threads_per_worker must be an int >= 1, got 0"),
        ({"workers": 0}, "workers must be an int >= 1, got 0"),
        ({"max_retries": -1}, "max_retries must be an int >= 0"),
        ({"policy": "fastest"}, "unknown scheduling policy 'fastest'"),
        ({"storage": 123}, "storage must be a URL"),
        ({"checkpoint_budget": "ten megs"}, "checkpoint_budget must be a number of bytes"),
        ({"checkpoint_budget": -5}, "checkpoint_budget must be >= 0"),
        ({"version": ""}, "version must be a non-empty string"),
    ],
)
def test_study_arguments_are_checked_before_anything_is_opened(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    kwargs.setdefault("storage", url(tmp_path))
    with pytest.raises(ValueError, match=message):
        Study("s", Counter, **kwargs)
    assert not (tmp_path / "plan.db").exists()


@pytest.mark.parametrize(
    "storage",
    [
        "sqlite:///{tmp}/nonexistent/dir/x.db",  # a directory that does not exist
        "bogus://x",  # an unknown scheme
        "postgresql://u:p@127.0.0.1:1/db",  # nobody listens there
    ],
)
def test_a_bad_storage_url_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, storage: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # where ./stagetree_checkpoints would go
    study = Study("s", Counter, storage=storage.format(tmp=tmp_path), executor="inline")
    with pytest.raises(StorageError, match="plan storage") as info:
        study.open()
    if "nonexistent" in storage:
        assert "does not exist" in str(info.value)
    study.close()
    # Nor a checkpoint directory the study names.
    named = Study("s", Counter, storage=storage.format(tmp=tmp_path), checkpoint_dir="ckpts")
    with pytest.raises(StorageError):
        named.open()
    named.close()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["work"]


def test_checkpoints_beside_a_sqlite_file_ignore_the_url_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with Study("s", Counter, storage="sqlite:///plan.db?timeout=5", executor="inline") as s:
        s.open()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.db", "plan.db.checkpoints"]


def test_checkpoint_budget_accepts_sizes(tmp_path: Path) -> None:
    for given, expected in (("10MB", 10**7), ("2GiB", 2 * 2**30), ("1.5 kB", 1500), (512, 512)):
        study = Study("s", Counter, storage="memory://", checkpoint_budget=given)
        assert study.placement.checkpoint_budget == expected


@pytest.mark.parametrize(
    "config",
    [{"x": float("nan")}, {"x": float("inf")}, {"f": lambda: 0}, {"nested": [1.0, float("nan")]}],
)
def test_a_config_without_a_stable_identity_is_refused(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    with (
        Study("s", Counter, storage=url(tmp_path), executor="inline") as study,
        pytest.raises(InvalidTrialError, match="cannot be a fixed configuration"),
    ):
        study.run(config, {"lr": 0.1}, 2)
    assert rows(tmp_path) == (0, 0, 0)


def test_a_name_mismatch_writes_nothing(tmp_path: Path) -> None:
    with Study("s", Counter, storage=url(tmp_path), executor="inline") as study:
        study.run({}, {"lr": 0.1}, 2)
    before = rows(tmp_path)
    with (
        Study("s", Counter, storage=url(tmp_path), executor="inline") as study,
        pytest.raises(InvalidTrialError, match=r"unexpected hp names \['momentum'\]"),
    ):
        study.run({}, {"lr": 0.1, "momentum": 0.9}, 2)
    assert rows(tmp_path) == before


def test_a_tuner_over_a_different_space_writes_no_row_and_no_log_record(tmp_path: Path) -> None:
    with Study("s", Counter, storage=url(tmp_path), executor="inline") as study:
        study.tune(GridSearch(GridSpace(hp={"lr": [0.1, 0.2]}), metric="w", steps=2))
    before = rows(tmp_path)
    other = GridSearch(GridSpace(hp={"lr": [0.1], "wd": [0.0]}), metric="w", steps=2)
    with (
        Study("s", Counter, storage=url(tmp_path), executor="inline") as study,
        pytest.raises(InvalidTrialError, match=r"unexpected hp names \['wd'\]"),
    ):
        study.tune(other)
    assert rows(tmp_path) == before
    # a fresh study name: refused before its row exists
    with Study("t", Counter, storage=url(tmp_path), executor="inline") as study:
        study.run({}, {"lr": 0.1}, 2)
        with pytest.raises(InvalidTrialError):
            study.tune(other)
    assert rows(tmp_path)[2] == before[2]


def test_study_meta_records_the_latest_tuner_metric(tmp_path: Path) -> None:
    space = GridSpace(hp={"lr": [0.1, 0.2]})
    with Study("s", Counter, storage=url(tmp_path), executor="inline") as study:
        study.tune(GridSearch(space, metric="w", steps=2))
    with (
        Study("s", Counter, storage=url(tmp_path), executor="inline") as study,
        pytest.warns(ReplayDivergedWarning),  # other tuner arguments: replay diverges
    ):
        study.tune(GridSearch(space, metric="w", mode="min", steps=3))
    s = open_storage(url(tmp_path))
    (meta,) = [x["meta"] for x in s.studies()]
    s.close()
    assert (meta["metric"], meta["mode"]) == ("w", "min")


def test_grid_search_given_a_dict_says_what_to_pass(tmp_path: Path) -> None:
    with (
        Study("s", Counter, storage=url(tmp_path), executor="inline") as study,
        pytest.raises(TunerError, match=r"not a dict: wrap the options in .*GridSpace"),
    ):
        study.tune(GridSearch({"lr": [0.1, 0.2]}, metric="w", steps=2))
    assert rows(tmp_path) == (0, 0, 0)


def test_random_search_over_a_small_space_says_it_holds_fewer(tmp_path: Path) -> None:
    space = RandomSpace(hp={"lr": Choice([0.1, 0.2])})
    with (
        Study("s", Counter, storage=url(tmp_path), executor="inline") as study,
        pytest.raises(InvalidSpaceError, match=r"only 2 distinct trials .* ask for at most 2"),
    ):
        study.tune(RandomSearch(space, metric="w", num_trials=5, steps=2))
    assert rows(tmp_path) == (0, 0, 0)


def test_a_script_with_a_syntax_or_import_error_gets_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "syntax.py"
    bad.write_text("import stagetree\nx = (\n")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"stagetree run: error: {bad}: SyntaxError: '(' was never closed (line 2)"
    ]
    missing = tmp_path / "imports.py"
    missing.write_text("import os\nimport nosuchmodule_xyz\n")
    assert main(["run", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"stagetree run: error: {missing}: ModuleNotFoundError: No module named "
        "'nosuchmodule_xyz' (line 2)"
    ]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_status_and_export_never_write_into_a_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    other = tmp_path / "other.db"
    con = sqlite3.connect(other)
    con.execute("create table notes (text)")
    con.commit()
    con.close()
    empty = tmp_path / "empty.db"
    empty.touch()
    for path in (other, empty):
        before = _digest(path)
        for argv in (["status"], ["export", "--format", "csv"]):
            assert main([*argv, "--storage", f"sqlite:///{path}"]) == 2
            assert "is not a stagetree plan storage" in capsys.readouterr().err
        assert _digest(path) == before
    assert empty.stat().st_size == 0


def test_reading_a_plan_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Study("s", Counter, storage=url(tmp_path), executor="inline") as study:
        study.run({}, {"lr": 0.1}, 2)
    db = tmp_path / "plan.db"
    files = [p for p in tmp_path.glob("plan.db*") if p.is_file()]
    before = {p.name: _digest(p) for p in files}
    assert main(["status", "--storage", url(tmp_path)]) == 0
    assert main(["export", "--storage", url(tmp_path), "--format", "json"]) == 0
    assert {p.name: _digest(p) for p in files} == before
    plan = open_storage(url(tmp_path), readonly=True)
    with pytest.raises(StorageError, match="open read-only"):
        plan.create_study("x", {})
    plan.close()
    assert db.exists()


@pytest.mark.parametrize("directory_writable", [True, False])
def test_a_read_only_database_is_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    directory_writable: bool,
) -> None:
    """A database its reader cannot write (another user's file, a read-only mount) is
    read: status, export and a results script's ``Study.trials()`` work, training says
    why it cannot, and not a byte changes. Tests run as root, which the kernel lets write
    anything, so the permission check itself is what is made to say no."""
    with Study("s", Counter, storage=url(tmp_path), executor="inline") as study:
        study.run({}, {"lr": 0.1}, 2)
    files = [p for p in tmp_path.glob("plan.db*") if p.is_file()]
    before = {p.name: _digest(p) for p in files}
    real_access = os.access
    denied = {str(tmp_path / "plan.db")} | ({str(tmp_path)} if not directory_writable else set())

    def access(path: Any, mode: int, **kw: Any) -> bool:
        if mode & os.W_OK and os.path.abspath(str(path)) in denied:
            return False
        return real_access(path, mode, **kw)

    monkeypatch.setattr(os, "access", access)
    assert main(["status", "--storage", url(tmp_path)]) == 0
    assert "1 finished" in capsys.readouterr().out
    study = Study("s", Counter, storage=url(tmp_path), executor="inline")
    assert study.trials()[0].metrics[2] == {"w": 0.2}
    with pytest.raises(StorageError, match="is open read-only"):
        study.run({}, {"lr": 0.2}, 2)
    study.close()
    assert {p.name: _digest(p) for p in files} == before


def test_warnings_module_shows_stagetree_warnings() -> None:
    assert issubclass(StagetreeWarning, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        warnings.warn("x", StagetreeWarning, stacklevel=1)
    assert caught and caught[0].category is StagetreeWarning


def test_run_refuses_a_misnamed_space_before_opening_the_storage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "typo.py"
    script.write_text(
        "from stagetree import Study, GridSpace\n"
        "from stagetree.torch.examples import DigitsTrainer\n"
        "from stagetree.tuners import GridSearch\n"
        'space = GridSpace({"learning_rate": [0.1, 0.05]})\n'
        f'study = Study("typo", DigitsTrainer, storage="sqlite:///{tmp_path}/typo.db")\n'
        'tuner = GridSearch(space, metric="accuracy", steps=2)\n'
    )
    assert main(["run", str(script)]) == 2
    assert "'learning_rate' (did you mean 'lr'?)" in capsys.readouterr().err
    assert not (tmp_path / "typo.db").exists()


@pytest.mark.parametrize("steps", [-1, 10**30, 2**63])
def test_a_trial_refused_for_its_steps_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int
) -> None:
    monkeypatch.chdir(tmp_path)
    study = Study("s", Counter, storage=url(tmp_path), executor="inline")
    with pytest.raises(InvalidTrialError, match=r"steps must be a non-negative int"):
        study.run({}, {"lr": 0.1}, steps)
    study.close()
    assert list(tmp_path.iterdir()) == []  # no p.db, no checkpoint folder


def test_a_sqlite_url_in_a_missing_folder_creates_no_folder(tmp_path: Path) -> None:
    study = Study("s", Counter, storage=f"sqlite:///{tmp_path}/no/such/dir/p.db")
    with pytest.raises(StorageError, match="does not exist"):
        study.run({}, {"lr": 0.1}, 2)
    study.close()
    assert list(tmp_path.iterdir()) == []


def _foreign_db(path: Path) -> None:
    import sqlite3

    con = sqlite3.connect(path)
    con.execute("create table notes (text)")
    con.execute("insert into notes values ('mine')")
    con.commit()
    con.close()


def test_a_foreign_sqlite_file_is_never_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "notes.db"
    _foreign_db(other)
    before = _digest(other)
    study = Study("s", Counter, storage=f"sqlite:///{other}", executor="inline")
    with pytest.raises(StorageError, match=r"not a stagetree database.*notes"):
        study.run({}, {"lr": 0.1}, 2)
    study.close()
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'fakes')!r})\n"
        "from failing_trainers import Counter\n"
        "from stagetree import Study, GridSpace\n"
        "from stagetree.tuners import GridSearch\n"
        f'study = Study("s", Counter, storage="sqlite:///{tmp_path}/own.db", executor="inline")\n'
        'tuner = GridSearch(GridSpace({"lr": [0.1]}), metric="w", steps=2)\n'
    )
    assert main(["run", str(script), "--storage", f"sqlite:///{other}", "--no-progress"]) == 2
    assert "not a stagetree database" in capsys.readouterr().err
    assert _digest(other) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.db", "script.py"]


def test_tune_given_a_name_says_to_pass_a_tuner_object(tmp_path: Path) -> None:
    with Study("s", Counter, storage=url(tmp_path), executor="inline") as study:
        with pytest.raises(TunerError, match=r"stagetree.tuners.ASHA\(space"):
            study.tune("asha")  # type: ignore[arg-type]
        with pytest.raises(TunerError, match="takes a tuner object"):
            study.tune(None)  # type: ignore[arg-type]
    assert not (tmp_path / "plan.db").exists()
