"""Trainer versions in one storage, in process: a Study, its reports and its tuner's
replay see only the trials and decisions of their own trainer version."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study, _versions
from stagetree.exceptions import ReplayDivergedWarning, TrainerChangedWarning
from stagetree.hp import Constant
from stagetree.plan import open_storage
from stagetree.reports import export_records, hidden_trials, study_status
from stagetree.space import GridSpace
from stagetree.study_api import StudyRunner as _StudyRunner
from stagetree.tuners import ASHA, GridSearch

SPACE = GridSpace({"lr": [Constant(0.01), Constant(0.02), Constant(0.04)]}, fixed={"seed": [0]})


def _study(tmp_path: Path, version: str) -> Study:
    return Study(
        "v",
        LinearTrainer,
        storage=f"sqlite:///{tmp_path}/plan.db",
        executor="inline",
        version=version,
    )


def _tuner() -> ASHA:
    return ASHA(
        SPACE, metric="score", mode="max", min_steps=1, max_steps=4, eta=2, num_trials=3, seed=0
    )


def test_versions_are_never_mixed(tmp_path: Path) -> None:
    with _study(tmp_path, "a") as a:
        best_a = a.tune(_tuner())
        assert best_a is not None
        trials_a = len(a.trials())
        executed_a = a.stats()["steps_executed"]
        assert _StudyRunner(a).read_log()  # the decisions of version a
    with (
        pytest.warns(TrainerChangedWarning, match=rf"{trials_a} trials will train again"),
        _study(tmp_path, "b") as b,
    ):
        b.open()
        assert b.trials() == [] and b.best("score") is None
        assert _StudyRunner(b).read_log() == []  # a's decisions are not replayed for b
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplayDivergedWarning)
            b.tune(_tuner())
        assert len(b.trials()) == trials_a
        assert b.stats()["steps_executed"] > 0
    with open_storage(f"sqlite:///{tmp_path}/plan.db") as plan:
        everything = plan.trials("v")
        assert len(everything) == 2 * trials_a
        assert {t["attrs"]["version"] for t in everything} == {"a", "b"}
        assert [r for r in plan.read_log("v") if r.get("event") == "trainer"] == [
            {"event": "trainer", "version": "b"}
        ]
        status = study_status(plan, "v")
        assert status.trials == trials_a and status.hidden == trials_a
        assert len(export_records(plan, "v")) == trials_a
        assert hidden_trials(plan) == trials_a
        ids_b = {t["id"] for t in everything if t["attrs"]["version"] == "b"}
        assert status.best_trial in ids_b
    # Version a again (version= pins it): its trials, its decisions, nothing trains.
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainerChangedWarning)  # nothing trains again
        with _study(tmp_path, "a") as again:
            assert len(again.trials()) == trials_a
            assert again.best("score") is not None
            assert _StudyRunner(again).read_log() == []  # the log's latest run is b's
            result = again.tune(_tuner())
            assert result is not None and result.metrics == best_a.metrics
            assert again.stats()["steps_executed"] == executed_a
    with open_storage(f"sqlite:///{tmp_path}/plan.db") as plan:
        assert study_status(plan, "v").best_trial not in ids_b  # a is the latest run


def test_announced_once_per_process(tmp_path: Path) -> None:
    with _study(tmp_path, "a") as a:
        a.tune(GridSearch(SPACE, metric="score", steps=2))
    with pytest.warns(TrainerChangedWarning) as record:
        for _ in range(3):
            with _study(tmp_path, "c") as c:
                c.open()
    assert len(record) == 1
    assert str(record[0].message) == (
        "trainer LinearTrainer changed since the last run on this storage: 3 trials will "
        "train again; pass version='a' to keep the old results"
    )


def test_stats_and_progress_count_only_this_version(tmp_path: Path) -> None:
    with _study(tmp_path, "a") as a:
        a.tune(GridSearch(SPACE, metric="score", steps=2))
    with pytest.warns(TrainerChangedWarning), _study(tmp_path, "b") as b:
        b.run({"seed": 0}, {"lr": Constant(0.01)}, 2)
        stats: dict[str, Any] = b.stats()
        assert stats["trials"] == 1 and stats["steps_requested"] == 2
        assert b.progress()["trials"] == 1


@pytest.mark.parametrize(
    ("created", "log"),
    [
        ("a", []),
        ("a", [{"event": "submit", "key": 0}]),  # written before versions were logged
        ("b", [{"event": "submit", "key": 0}]),
        ("b", [{"event": "trainer", "version": "a"}, {"event": "submit", "key": 0}]),
        ("a", [{"event": "trainer", "version": "b"}, {"event": "submit", "key": 0}]),
        ("a", [{"event": "submit", "key": 0}, {"event": "trainer", "version": "a"}]),
        (
            "a",
            [
                {"event": "trainer", "version": "a"},
                {"event": "submit", "key": 0},
                {"event": "trainer", "version": "b"},
                {"event": "submit", "key": 1, "hp": {"event": "trainer", "version": "a"}},
            ],
        ),
    ],
)
def test_has_log_is_whether_read_log_gives_decisions(
    tmp_path: Path, created: str, log: list[dict[str, Any]]
) -> None:
    """A run tells a first run from a re-run by the log's last records (the whole log of
    a 100,000-trial study was read once more just for that)."""

    class Slot:
        name, version, log_checked = "s", "a", False

    for url in ("memory://", f"sqlite:///{tmp_path}/plan.db"):
        with open_storage(url) as plan:
            plan.create_study("s", {"version": created})
            for rec in log:
                plan.append_log("s", rec)
            reads: list[str] = []
            real = plan.read_log

            def counted(study: str, real: Any = real, reads: list[str] = reads) -> Any:
                reads.append(study)
                return real(study)

            plan.read_log = counted  # type: ignore[method-assign]
            assert _versions.has_log(Slot(), plan) is bool(_versions.read_log(Slot(), plan))
            assert reads == ["s"]  # read_log's own read only


def test_a_resumed_tune_reads_the_log_once(tmp_path: Path) -> None:
    """A re-run of ``tune()`` reads the tuner's log once, to replay it: telling a first
    run from a re-run reads only the log's last records."""
    reads: list[str] = []
    with _study(tmp_path, "a") as study:
        study.tune(_tuner())
        plan = study._engine.storage
        real = plan.read_log

        def counted(name: str) -> list[dict[str, Any]]:
            reads.append(name)
            return real(name)

        plan.read_log = counted  # type: ignore[method-assign]
        study.tune(_tuner())
        assert reads == ["v"]
