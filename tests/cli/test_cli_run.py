"""Tests of ``stagetree run | status | export``, :func:`stagetree.cli.report_study` and
:mod:`stagetree.progress`."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import study as study_module
from stagetree.cli import main, report_study
from stagetree.cli._run import command_line_overrides
from stagetree.engine import pool
from stagetree.engine.settings import Overrides, current_overrides
from stagetree.hp import Constant, Exponential, MultiStep, Piecewise, Warmup
from stagetree.plan import BasePlanStorage, open_storage
from stagetree.progress import ProgressDisplay, format_duration, progress_line
from stagetree.reports import accounting, short_sequence
from stagetree.tuners.base import TrialResult

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^\[\d+:\d\d:\d\d\] trials \d+/\d+ finished, \d+ running(, \d+ failed)? \| steps \d+ "
    r"executed / \d+ requested(, \d+ unique)? \| saved \d+ steps \| ETA (\d+:\d\d:\d\d|\?)$"
)


def _field(text: str, label: str) -> str:
    """The first token after ``label:`` on its line (indented or not)."""
    match = re.search(rf"^\s*{re.escape(label)}:\s+(\S+)", text, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{text}"
    return match.group(1)


def _line(text: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}:\s+(.*)$", text, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{text}"
    return match.group(1)


def _block(text: str, title: str) -> str:
    """The paragraph (blank-line separated) whose first line starts with ``title``."""
    for block in text.split("\n\n"):
        if block.startswith(title):
            return block
    raise AssertionError(f"no block {title!r} in:\n{text}")


# --------------------------------------------------------------------------- storages

HP_T1 = {"lr": Constant(0.1)}
HP_T2 = {"lr": MultiStep(0.1, [5], 0.1)}  # shares steps 0-4 with T1
HP_T3 = {"lr": Constant(0.05)}
CONFIG_A = {"opt": "sgd", "width": 8}
CONFIG_B = {"opt": "adam", "width": 8}


def _fill_a(s: BasePlanStorage) -> dict[str, int]:
    """Study "a": 24 requested steps, 19 unique. T3 has the highest accuracy but only at
    step 4, so the best at the largest step is T2 (0.8 at step 10)."""
    s.create_study("a", {"version": "v1"})
    s.register_root("rka", CONFIG_A)
    ids = {}
    for name, hp, steps, state in (
        ("t1", HP_T1, 10, "done"),
        ("t2", HP_T2, 10, "running"),
        ("t3", HP_T3, 4, "done"),
    ):
        ins = s.insert_trial("rka", hp, steps)
        ids[name] = s.add_trial("a", "rka", CONFIG_A, hp, steps, ins.node, ins.step, state=state)
    t1, t2, t3 = (s.trial(ids[k]) for k in ("t1", "t2", "t3"))
    s.put_metrics(t1["node"], 5, {"accuracy": 0.5, "loss": 1.0})
    s.put_metrics(t1["node"], 10, {"accuracy": 0.7, "loss": 0.6})
    s.put_metrics(t2["node"], 10, {"accuracy": 0.8, "loss": math.nan})
    s.put_metrics(t3["node"], 4, {"accuracy": 0.99, "loss": 0.1})
    s.claim("live-engine", "rka", [(t2["node"], 5, 10)], ttl=3600)  # t2 is being trained
    return ids


def _fill_b(s: BasePlanStorage) -> dict[str, int]:
    """Study "b" records metric loss (min): 24 requested steps, 18 unique."""
    s.create_study("b", {"version": "v1", "metric": "loss", "mode": "min"})
    s.register_root("rkb", CONFIG_B)
    ids = {}
    for name, lr, state in (
        ("u1", 0.01, "done"),
        ("u2", 0.01, "done"),  # identical to u1: same (node, step)
        ("u3", 0.02, "done"),
        ("u4", 0.03, "failed"),
    ):
        hp = {"lr": Constant(lr)}
        ins = s.insert_trial("rkb", hp, 6)
        ids[name] = s.add_trial("b", "rkb", CONFIG_B, hp, 6, ins.node, ins.step, state=state)
    s.put_metrics(s.trial(ids["u1"])["node"], 6, {"loss": 0.3, "accuracy": 0.6})
    s.put_metrics(s.trial(ids["u3"])["node"], 6, {"loss": 0.25, "accuracy": 0.5})
    return ids


def _executed(s: BasePlanStorage, root_key: str, steps: int, seconds: float) -> None:
    """Count trained steps as the engine does: for the whole storage and for the tree."""
    s.add_stats("engine", steps_executed=steps, device_seconds=seconds)
    s.add_stats(f"root:{root_key}", steps_executed=steps, device_seconds=seconds)


@pytest.fixture
def one_study(tmp_path: Path) -> Iterator[tuple[str, dict[str, int]]]:
    url = f"sqlite:///{tmp_path / 'one.db'}"
    s = open_storage(url)
    ids = _fill_a(s)
    _executed(s, "rka", 19, 3.8)
    s.close()
    yield url, ids


@pytest.fixture
def two_studies(tmp_path: Path) -> Iterator[tuple[str, dict[str, int]]]:
    url = f"sqlite:///{tmp_path / 'two.db'}"
    s = open_storage(url)
    ids = {**_fill_a(s), **_fill_b(s)}
    _executed(s, "rka", 19, 3.8)
    _executed(s, "rkb", 21, 4.2)
    s.close()
    yield url, ids


# --------------------------------------------------------------------------- status


def test_status_one_study_exact_numbers(
    one_study: tuple[str, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = one_study
    assert main(["status", "--storage", url]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines()[0] == f"storage {url}: 1 study"
    block = _block(out, "study a")
    assert _line(block, "trials") == "3 (2 finished, 1 running, 0 failed)"
    # No metric in the meta: the first name, at the largest step (T3's 0.99 is at step 4).
    assert _line(block, "best accuracy") == (
        f"0.8 (trial {ids['t2']} at step 10, max; first of accuracy, loss; mode guessed)"
    )
    assert _field(block, "steps requested") == "24"
    assert _field(block, "unique steps") == "19"
    assert _field(block, "steps executed") == "19"
    assert _field(block, "merge rate") == f"{24 / 19:.2f}"
    assert _field(block, "device-seconds") == "3.8"
    # Saved: steps of the finished trials (t1, t3: 14) minus executed (19), never
    # negative; t2 still runs: its steps are not saved yet (issue 22).
    assert _field(block, "steps saved") == "0"
    assert _line(block, "device-seconds saved") == "0.0 (estimated at 0.2 s per executed step)"
    assert "all " not in out  # no totals block for a single study


def test_status_two_studies_counts_execution_per_study_and_for_the_whole_storage(
    two_studies: tuple[str, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = two_studies
    assert main(["status", "--storage", url]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"storage {url}: 2 studies"
    a = _block(out, "study a")
    assert _field(a, "steps requested") == "24"
    assert _field(a, "unique steps") == "19"
    assert _field(a, "steps executed") == "19"  # counted on its tree
    assert _field(a, "device-seconds") == "3.8"
    assert _field(a, "steps saved") == "0"  # 14 finished - 19 executed: t2 still runs
    b = _block(out, "study b")
    assert _line(b, "trials") == "4 (3 finished, 0 running, 1 failed)"
    assert _line(b, "best loss") == (
        f"0.25 (trial {ids['u3']} at step 6, min; recorded in the study)"
    )
    assert _field(b, "steps requested") == "24"
    assert _field(b, "unique steps") == "18"
    assert _field(b, "merge rate") == "1.33"
    assert _field(b, "steps executed") == "21"
    assert _field(b, "device-seconds") == "4.2"
    # u4 failed: its 6 steps are not saved (18 finished - 21 executed, never negative).
    assert _field(b, "steps saved") == "0"
    assert _field(b, "device-seconds saved") == "0.0"
    total = _block(out, "all 2 studies")
    assert _field(total, "trials") == "7"
    assert _field(total, "steps requested") == "48"
    assert _field(total, "unique steps") == "37"
    assert _field(total, "steps executed") == "40"
    assert _field(total, "merge rate") == f"{48 / 37:.2f}"
    assert _field(total, "device-seconds") == "8.0"
    assert _field(total, "steps saved") == "0"  # 32 finished - 40 executed
    assert _field(total, "device-seconds saved") == "0.0"


def test_status_of_a_storage_without_counters_per_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A storage whose trees have no counters (written by a stagetree that counted only
    the whole storage) shows no steps executed per study rather than 0 (which would
    claim that every requested step was saved)."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    with open_storage(url) as s:
        _fill_a(s)
        s.add_stats("engine", steps_executed=19, device_seconds=3.8)
    assert main(["status", "--storage", url]) == 0
    block = _block(capsys.readouterr().out, "study a")
    assert _field(block, "steps requested") == "24"
    assert _line(block, "steps executed").startswith("not counted per study")
    assert "steps saved" not in block


def test_status_one_study_of_several(
    two_studies: tuple[str, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = two_studies
    assert main(["status", "--storage", url, "--study", "b"]) == 0
    out = capsys.readouterr().out
    assert "study b" in out and "study a" not in out
    assert _field(_block(out, "all 2 studies"), "steps executed") == "40"


def test_status_sees_writes_of_another_connection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'live.db'}"
    writer = open_storage(url)  # stays open, like a running study in another process
    try:
        writer.create_study("live", {})
        writer.register_root("rk", {})
        assert main(["status", "--storage", url]) == 0
        out = capsys.readouterr().out
        assert _line(out, "trials") == "0 (0 finished, 0 running, 0 failed)"
        assert _line(out, "best") == "no metrics yet"
        ins = writer.insert_trial("rk", HP_T1, 3)
        writer.add_trial("live", "rk", {}, HP_T1, 3, ins.node, ins.step, state="done")
        writer.put_metrics(ins.node, 3, {"score": 2.5})
        _executed(writer, "rk", 3, 0.6)
        assert main(["status", "--storage", url]) == 0
        out = capsys.readouterr().out
        assert _line(out, "trials") == "1 (1 finished, 0 running, 0 failed)"
        assert _field(out, "best score") == "2.5"
        assert _field(out, "steps executed") == "3"
    finally:
        writer.close()


def test_status_default_storage_from_env(
    one_study: tuple[str, dict[str, int]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, _ = one_study
    monkeypatch.setenv("STAGETREE_STORAGE", url)
    assert main(["status"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"storage {url}: 1 study"


def test_status_errors_are_one_line_exit_2(
    tmp_path: Path,
    one_study: tuple[str, dict[str, int]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    missing = tmp_path / "missing.db"
    assert main(["status", "--storage", f"sqlite:///{missing}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "does not exist" in err and str(missing) in err
    assert not missing.exists()  # status never creates a storage
    garbage = tmp_path / "garbage.db"
    garbage.write_text("not a database\n" * 100)
    assert main(["status", "--storage", f"sqlite:///{garbage}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stagetree status: error: ") and err.count("\n") == 1
    assert main(["status", "--storage", "nosuch://x"]) == 2
    assert "unknown scheme" in capsys.readouterr().err
    url, _ = one_study
    assert main(["status", "--storage", url, "--study", "zzz"]) == 2
    assert "no study 'zzz' in the storage (studies: a)" in capsys.readouterr().err


def test_status_rich_output(one_study: tuple[str, dict[str, int]]) -> None:
    from stagetree.cli import status

    buf = io.StringIO()
    result = status(one_study[0], out=buf, rich_output=True)
    text = buf.getvalue()
    assert "merge rate" in text and "1.26" in text and "study a" in text
    assert result.studies[0].numbers is not None
    assert result.studies[0].numbers["steps_saved"] == 0.0  # t2 still runs


# --------------------------------------------------------------------------- export


def test_export_csv_one_row_per_trial(
    two_studies: tuple[str, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The trial table (sequences readable, not JSON); ``--history``: the curves in
    long form."""
    url, ids = two_studies
    assert main(["export", "--storage", url, "--study", "a", "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == [
        "study",
        "trial",
        "state",
        "steps",
        "config.opt",
        "config.width",
        "hp.lr",
        "hp.lr.last",
        "metrics_at",
        "metric.accuracy",
        "metric.loss",
        "error",
        "lineage",
    ]
    t1, t2, t3 = (str(ids[k]) for k in ("t1", "t2", "t3"))
    assert rows[1] == ["a", t1, "done", "10", "sgd", "8", "0.1", "0.1", "10", "0.7", "0.6", "", ""]
    assert rows[2][:7] == ["a", t2, "running", "10", "sgd", "8", "MultiStep(0.1, [5], 0.1)"]
    assert float(rows[2][7]) == pytest.approx(0.01)  # the value at step 9
    assert rows[2][8:] == ["10", "0.8", "nan", "", ""]
    assert rows[3] == ["a", t3, "done", "4", "sgd", "8", "0.05", "0.05", "4", "0.99", "0.1", "", ""]

    assert main(["export", "--storage", url, "--study", "a", "--format", "csv", "--history"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["study", "trial", "step", "metric", "value"]
    assert rows[1:] == [
        ["a", t1, "5", "accuracy", "0.5"],
        ["a", t1, "5", "loss", "1.0"],
        ["a", t1, "10", "accuracy", "0.7"],
        ["a", t1, "10", "loss", "0.6"],
        ["a", t2, "5", "accuracy", "0.5"],  # the shared step
        ["a", t2, "5", "loss", "1.0"],
        ["a", t2, "10", "accuracy", "0.8"],
        ["a", t2, "10", "loss", "nan"],
        ["a", t3, "4", "accuracy", "0.99"],
        ["a", t3, "4", "loss", "0.1"],
    ]


def test_export_json_to_file(
    two_studies: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = two_studies
    target = tmp_path / "out.json"
    assert main(["export", "--storage", url, "--format", "json", "-o", str(target)]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"wrote 7 trials to {target}\n"
    trials = json.loads(target.read_text())  # strict JSON: NaN is a string
    assert [(t["study"], t["trial"]) for t in trials] == [
        ("a", ids["t1"]),
        ("a", ids["t2"]),
        ("a", ids["t3"]),
        ("b", ids["u1"]),
        ("b", ids["u2"]),
        ("b", ids["u3"]),
        ("b", ids["u4"]),
    ]
    t2 = trials[1]
    assert (t2["config.opt"], t2["config.width"]) == ("sgd", 8)
    assert t2["steps"] == 10 and t2["state"] == "running"
    assert t2["hp.lr"] == "MultiStep(0.1, [5], 0.1)"
    assert (t2["metrics_at"], t2["metric.accuracy"], t2["metric.loss"]) == (10, 0.8, "nan")
    # identical trials; a failed one with no metrics has none
    assert trials[4]["metric.loss"] == trials[3]["metric.loss"] == 0.3
    assert trials[6]["metrics_at"] is None and trials[6]["state"] == "failed"

    target = tmp_path / "history.json"
    argv = ["export", "--storage", url, "--study", "a", "--format", "json", "--history"]
    assert main([*argv, "-o", str(target)]) == 0
    assert capsys.readouterr().err == f"wrote 10 rows to {target}\n"
    long = json.loads(target.read_text())
    assert long[7] == {
        "study": "a",
        "trial": ids["t2"],
        "step": 10,
        "metric": "loss",
        "value": "nan",
    }


def test_export_csv_to_file_and_errors(
    two_studies: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = two_studies
    target = tmp_path / "b.csv"
    assert (
        main(["export", "--storage", url, "--study", "b", "--format", "csv", "-o", str(target)])
        == 0
    )
    assert capsys.readouterr().err == f"wrote 4 trials to {target}\n"
    rows = list(csv.DictReader(target.open()))
    # u1 and u2 are identical trials: one row each; u4 failed with no metrics.
    assert [(int(r["trial"]), r["metrics_at"], r["metric.loss"]) for r in rows] == [
        (ids["u1"], "6", "0.3"),
        (ids["u2"], "6", "0.3"),
        (ids["u3"], "6", "0.25"),
        (ids["u4"], "", ""),
    ]
    assert main(["export", "--storage", url, "--study", "zzz", "--format", "csv"]) == 2
    assert "no study 'zzz'" in capsys.readouterr().err
    assert main(["export", "--storage", url]) == 2  # --format (or --checkpoint) is required
    assert "--format" in capsys.readouterr().err
    assert (
        main(["export", "--storage", f"sqlite:///{tmp_path / 'nope.db'}", "--format", "json"]) == 2
    )
    assert "does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- report


class _FakeStudy:
    name = "fake"

    def __init__(self, stats: Mapping[str, float]) -> None:
        self._stats = dict(stats)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def trials(self) -> list[Any]:
        return []


def test_short_sequence_forms() -> None:
    assert short_sequence(Constant(0.1)) == "0.1"
    assert short_sequence(Constant(64)) == "64"
    assert short_sequence(MultiStep(0.1, [8, 12], 0.1)) == "MultiStep(0.1, [8, 12], 0.1)"
    assert short_sequence(Piecewise([64, 128], [8])) == "Piecewise([64, 128], [8])"
    nested = Constant(0.1).then(Constant(0.2).then(Exponential(0.2, 0.5), at=3), at=4)
    assert (
        short_sequence(nested)
        == "0.1 until step 4, then 0.2 until step 7, then Exponential(0.2, 0.5)"
    )
    assert short_sequence(Warmup(2, 0.1)).startswith("Warmup(2")


def test_report_study_plain_exact() -> None:
    study = _FakeStudy(
        {
            "trials": 4,
            "steps_requested": 100,
            "steps_unique": 60,
            "steps_executed": 70,
            "device_seconds": 14.0,
        }
    )
    best = TrialResult(
        config={"opt": "sgd", "hidden": 32},
        hp={"lr": Constant(0.1).then(Exponential(0.1, 0.5), at=4), "bs": Piecewise([64, 128], [8])},
        steps=16,
        metrics={"accuracy": 0.93, "loss": 0.2},
    )
    buf = io.StringIO()
    numbers = report_study(study, best, metric="accuracy", out=buf)  # type: ignore[arg-type]
    out = buf.getvalue()
    assert out.splitlines()[0] == "study fake"
    assert _line(out, "best accuracy") == "0.93 (max, after 16 steps)"
    assert _line(out, "config") == "opt=sgd hidden=32"
    assert _line(out, "lr") == "0.1 until step 4, then Exponential(0.1, 0.5)"
    assert _line(out, "bs") == "Piecewise([64, 128], [8])"
    assert _field(out, "trials") == "4"
    assert _field(out, "steps requested") == "100"
    assert _field(out, "unique steps") == "60"
    assert _field(out, "steps executed") == "70"
    assert _field(out, "merge rate") == "1.67"
    assert _field(out, "device-seconds") == "14.0"
    assert _line(out, "steps saved") == "30 (30% of requested)"
    assert _line(out, "device-seconds saved") == "6.0 (estimated at 0.2 s per executed step)"
    assert numbers["steps_saved"] == 30.0
    assert numbers["device_seconds_saved"] == pytest.approx(6.0)
    assert numbers["best"] == 0.93
    assert "\r" not in out and "\x1b" not in out


def test_report_study_says_what_ran_fused() -> None:
    stats = {"trials": 8, "steps_requested": 80, "steps_unique": 45, "steps_executed": 45}
    buf = io.StringIO()
    report_study(_FakeStudy({**stats, "device_seconds": 9.0}), None, "loss", out=buf)  # type: ignore[arg-type]
    assert "fused" not in buf.getvalue()  # a study that does not fuse says nothing
    fused = {**stats, "device_seconds": 3.0, "fused_jobs": 2, "fused_members": 8}
    buf = io.StringIO()
    numbers = report_study(_FakeStudy(fused), None, "loss", out=buf)  # type: ignore[arg-type]
    assert _line(buf.getvalue(), "fused") == "2 job(s) trained 8 stages at once"
    assert numbers["fused_jobs"] == 2


def test_report_study_without_best_and_rich() -> None:
    study = _FakeStudy({"steps_requested": 10, "steps_unique": 10, "steps_executed": 0})
    buf = io.StringIO()
    numbers = report_study(study, None, metric="loss", mode="min", out=buf)  # type: ignore[arg-type]
    out = buf.getvalue()
    assert _line(out, "best loss") == "none (no trial reported a finite loss)"
    assert _field(out, "trials") == "0"
    assert _line(out, "device-seconds saved") == "0.0"  # nothing measured: no estimate
    assert math.isnan(numbers["best"])
    buf = io.StringIO()
    report_study(study, None, metric="loss", out=buf, rich_output=True)  # type: ignore[arg-type]
    assert "merge rate" in buf.getvalue() and "sharing" in buf.getvalue()


def test_accounting_formula() -> None:
    a = accounting(200, 150, 160, 32.0)
    assert a["merge_rate"] == pytest.approx(200 / 150)
    assert a["steps_saved"] == 40.0
    assert a["seconds_per_step"] == pytest.approx(0.2)
    assert a["device_seconds_saved"] == pytest.approx(8.0)
    assert accounting(0, 0, 0, 0.0)["merge_rate"] == 1.0


# --------------------------------------------------------------------------- progress


class _ScriptedStudy:
    """``progress()`` answers from a list (the last one repeats); ``stats()`` gives the
    unique steps."""

    def __init__(self, snapshots: list[dict[str, float]], unique: float | None = None) -> None:
        self.snapshots = snapshots
        self.unique = unique
        self.calls = 0

    def progress(self) -> dict[str, float]:
        snap = self.snapshots[min(self.calls, len(self.snapshots) - 1)]
        self.calls += 1
        return dict(snap)

    def stats(self) -> dict[str, float]:
        if self.unique is None:
            raise RuntimeError("not known yet")
        return {"steps_unique": self.unique}


def _snap(executed: float, elapsed: float, **kw: float) -> dict[str, float]:
    base = {
        "trials": 8.0,
        "finished": 2.0,
        "running": 3.0,
        "pending": 3.0,
        "failed": 0.0,
        "steps_requested": 100.0,
        "steps_executed": executed,
        "device_seconds": executed * 0.1,
        "elapsed": elapsed,
    }
    base.update(kw)
    return base


def test_progress_plain_lines_every_few_seconds_with_eta() -> None:
    study = _ScriptedStudy([_snap(0, 0), _snap(10, 1), _snap(30, 6)], unique=60)
    buf = io.StringIO()
    display = ProgressDisplay(study, out=buf, rich_output=False, plain_every=5.0, window=30)
    display.tick(now=100.0)
    display.tick(now=101.0)  # within plain_every: no line
    state = display.tick(now=106.0)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in buf.getvalue()
    assert all(LINE.match(line) for line in lines), lines
    assert state is not None
    # 30 steps in 6 s -> 5 steps/s; 60 unique - 30 executed = 30 steps left -> 6 s.
    assert state.eta == pytest.approx(6.0)
    assert state.saved == 100 - 60  # steps still to run are not counted as saved
    assert lines[1] == (
        "[0:00:06] trials 2/8 finished, 3 running | steps 30 executed / 100 requested, "
        "60 unique | saved 40 steps | ETA 0:00:06"
    )


def test_progress_unique_steps_follow_new_trials() -> None:
    class Growing(_ScriptedStudy):
        answers = [(60.0, 100.0), (80.0, 140.0)]  # (unique, requested) per stats() call

        def stats(self) -> dict[str, float]:
            unique, requested = self.answers.pop(0)
            return {"steps_unique": unique, "steps_requested": requested}

    study = Growing([_snap(0, 0), _snap(10, 1, steps_requested=140.0)])
    display = ProgressDisplay(study, out=io.StringIO(), rich_output=False, unique_every=60)
    first = display.poll(now=0.0)
    assert first is not None and first.steps_unique == 60
    # 40 steps were requested since: counted as unique until the next refresh.
    second = display.poll(now=0.5)
    assert second is not None and second.steps_unique == 100
    third = display.poll(now=2.0)  # a second after the new trials: refreshed
    assert third is not None and third.steps_unique == 80 and study.answers == []


def test_progress_without_trials_or_without_answers() -> None:
    empty = {k: 0.0 for k in _snap(0, 0)}
    buf = io.StringIO()
    display = ProgressDisplay(_ScriptedStudy([empty]), out=buf, rich_output=False)
    state = display.tick(now=1.0)
    assert state is not None and state.eta is None and state.saved == 0
    assert buf.getvalue() == (
        "[0:00:00] trials 0/0 finished, 0 running | steps 0 executed / 0 requested | "
        "saved 0 steps | ETA ?\n"
    )

    class Broken:
        def progress(self) -> dict[str, float]:
            raise RuntimeError("storage closed")

    buf = io.StringIO()
    with ProgressDisplay(Broken(), interval=0.01, out=buf, rich_output=False) as display:
        assert display.tick() is None
    assert buf.getvalue() == ""  # nothing known, nothing printed, nothing raised


def test_progress_thread_prints_final_plain_line() -> None:
    study = _ScriptedStudy([_snap(5, 1), _snap(50, 2, finished=8.0, running=0.0)])
    buf = io.StringIO()
    with ProgressDisplay(study, interval=0.01, out=buf, rich_output=False, plain_every=0.0):
        while study.calls < 3:  # let the thread poll a few times
            time.sleep(0.01)
    text = buf.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines and all(LINE.match(line) for line in lines), lines
    assert "trials 8/8 finished, 0 running" in lines[-1]


def test_progress_rich_mode_draws() -> None:
    study = _ScriptedStudy([_snap(20, 3)], unique=60)
    buf = io.StringIO()
    with ProgressDisplay(study, interval=0.01, out=buf, rich_output=True) as display:
        display.tick()
    text = buf.getvalue()
    assert "2/8 finished" in text and "20/60 executed" in text


def test_format_duration_and_line() -> None:
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(None) == "?"
    assert format_duration(math.inf) == "?"
    display = ProgressDisplay(_ScriptedStudy([_snap(10, 2, failed=1.0)]))
    state = display.poll(now=0.0)
    assert state is not None
    assert ", 1 failed |" in progress_line(state)
    with pytest.raises(ValueError, match="interval"):
        ProgressDisplay(_ScriptedStudy([_snap(0, 0)]), interval=0)


# --------------------------------------------------------------------------- run

TRAINER = '''
from __future__ import annotations

import os
import time

from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.trainer import Trainer
from stagetree.tuners import GridSearch


class Tiny(Trainer):
    """w grows by lr each step; deterministic, checkpointable, fast."""

    def __init__(self, config):
        super().__init__(config)
        self.w = 0.0
        self.lr = 0.0

    def setup(self, hp):
        self.lr = hp.get("lr", self.lr)

    def train(self):
        time.sleep(float(os.environ.get("TINY_SLEEP", "0")))
        self.w += self.lr
        return {"loss": -self.w}

    def evaluate(self):
        return {"score": self.w}

    def state_dict(self):
        return {"w": self.w, "lr": self.lr}

    def load_state_dict(self, state):
        self.w = state["w"]
        self.lr = state["lr"]


# Two trials of 10 steps that agree on steps 0-4: 20 requested, 15 unique.
space = GridSpace({"lr": [Constant(0.1), MultiStep(0.1, [5], 0.5)]})
'''


def _script(tmp_path: Path, body: str, name: str = "tiny_study.py") -> Path:
    path = tmp_path / name
    path.write_text(TRAINER + textwrap.dedent(body))
    return path


def _no_engine_on(url: str) -> bool:
    # Every Study a run made is closed: the engines of the url are gone.
    return url not in pool.open_storages()


def test_run_missing_script_or_no_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert (
        capsys.readouterr().err == f"stagetree run: error: no such script: {tmp_path / 'nope.py'}\n"
    )
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    assert main(["run", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"stagetree run: error: {path} defines no study (a Study named `study`)\n"


def test_run_no_tuner_closes_the_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'nt.db'}"
    path = _script(tmp_path, f'study = Study("nt", Tiny, storage={url!r}, executor="inline")\n')
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"stagetree run: error: {path} defines no tuner (a Tuner named `tuner`)\n"
    assert _no_engine_on(url)


def test_run_ambiguous_studies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'amb.db'}"
    path = _script(
        tmp_path,
        f"""
        s1 = Study("s1", Tiny, storage={url!r}, executor="inline")
        s2 = Study("s2", Tiny, storage={url!r}, executor="inline")
        tuner = GridSearch(space, metric="score", steps=10)
        """,
    )
    assert main(["run", str(path)]) == 2
    assert "defines 2 studies (s1, s2) and none is named `study`" in capsys.readouterr().err
    assert _no_engine_on(url)


def test_run_tiny_study_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    own_db = tmp_path / "script_default.db"
    url = f"sqlite:///{tmp_path / 'override.db'}"
    marker = tmp_path / "main_block_ran"
    path = _script(
        tmp_path,
        f"""
        tuner = GridSearch(space, metric="score", steps=10)
        my_study = Study("tiny", Tiny, storage="sqlite:///{own_db}", executor="inline")

        if __name__ == "__main__":
            open({str(marker)!r}, "w").close()
        """,
    )
    assert main(["run", str(path), "--storage", url, "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert not marker.exists()  # the script's main block did not run
    assert not own_db.exists()  # --storage overrode the script's storage
    assert current_overrides() == Overrides()  # overrides are restored after the run
    assert "STAGETREE_STORAGE" not in os.environ
    assert _no_engine_on(url)
    # Progress in a non-terminal: plain lines only (at least the final one).
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert progress and all(LINE.match(line) for line in progress), progress
    assert "trials 2/2 finished" in progress[-1]
    assert "\r" not in out
    # The best trial: lr 0.1 for 10 steps -> w = 1.0.
    assert _line(out, "best score") == "1 (max, after 10 steps)"
    assert _line(out, "lr") == "0.1"
    # The report's numbers are the study's stats (read with the script's own trainer:
    # a Study of another trainer sees none of its trials).
    tiny = runpy.run_path(str(path))["Tiny"]
    with study_module.Study("tiny", tiny, storage=url, executor="inline") as again:
        stats = again.stats()
    assert stats["steps_requested"] == 20 and stats["steps_unique"] == 15
    assert _field(out, "trials") == "2"
    assert _field(out, "steps requested") == "20"
    assert _field(out, "unique steps") == "15"
    assert _field(out, "steps executed") == str(round(stats["steps_executed"]))
    assert _field(out, "merge rate") == "1.33"
    assert _field(out, "device-seconds") == f"{stats['device_seconds']:.1f}"
    assert _field(out, "steps saved") == str(round(20 - stats["steps_executed"]))
    assert 15 <= stats["steps_executed"] <= 20


UNGUARDED = """
from study_trainers import LinearTrainer

from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.tuners import GridSearch

# Two trials of 6 steps that agree on steps 0-2: 12 requested, 9 unique.
space = GridSpace({"lr": [Constant(0.05), MultiStep(0.05, [3], 0.5)]})
tuner = GridSearch(space, metric="score", mode="max", steps=6)
study = Study("unguarded", LinearTrainer, executor="inline")
"""


@pytest.mark.parametrize(
    "tune",
    ["best = study.tune(tuner)\n", "with study:\n    best = study.tune(tuner)\n"],
    ids=["open", "closed"],
)
def test_run_a_script_without_main_guard_tunes_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tune: str,
) -> None:
    # The script tunes while it loads; the command reports that run, tuning no more.
    path = tmp_path / "unguarded.py"
    path.write_text(UNGUARDED + tune)
    url = f"sqlite:///{tmp_path / 'unguarded.db'}"
    runs: list[str] = []
    begin = study_module.Study.begin_tuning

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        runs.append(self.name)
        begin(self, *args, **kwargs)

    monkeypatch.setattr(study_module.Study, "begin_tuning", counting)
    assert main(["run", str(path), "--storage", url, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert runs == ["unguarded"]
    assert _line(out, "this run").startswith("2 trials; trained 9 steps")
    assert _line(out, "best score").endswith("(max, after 6 steps)")
    assert _field(out, "trials") == "2"
    assert _field(out, "steps executed") == "9"
    assert _no_engine_on(url)
    with open_storage(url) as s:
        assert len(s.trials("unguarded")) == 2
        assert s.stats("engine")["steps_executed"] == 9


def test_run_budget_limits_the_tuning_of_a_script_without_main_guard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "unguarded.py"
    path.write_text(UNGUARDED + "best = study.tune(tuner)\n")
    url = f"sqlite:///{tmp_path / 'unguarded.db'}"
    args = ["run", str(path), "--storage", url, "--no-progress", "--budget", "1 trials"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert _line(out, "this run").startswith("1 trial")
    with open_storage(url) as s:
        assert len(s.trials("unguarded")) == 1


def test_report_matches_study_stats_in_process(tmp_path: Path) -> None:
    from stagetree.space import GridSpace
    from stagetree.study import Study
    from stagetree.tuners import GridSearch

    path = _script(tmp_path, "")
    namespace: dict[str, Any] = {"__name__": "tiny_inproc"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    space = GridSpace({"lr": [Constant(0.1), MultiStep(0.1, [5], 0.5)]})
    url = f"sqlite:///{tmp_path / 'inproc.db'}"
    with Study("inproc", namespace["Tiny"], storage=url, executor="inline") as study:
        best = study.tune(GridSearch(space, metric="score", steps=10))
        buf = io.StringIO()
        numbers = report_study(study, best, metric="score", out=buf)
        stats = study.stats()
    assert numbers["best"] == pytest.approx(1.0)
    for key in ("steps_requested", "steps_unique", "steps_executed", "device_seconds"):
        assert numbers[key] == stats[key]
    assert numbers["trials"] == 2.0
    assert numbers["steps_saved"] == stats["steps_requested"] - stats["steps_executed"]
    out = buf.getvalue()
    assert _field(out, "steps executed") == str(round(stats["steps_executed"]))


INTERRUPTING = """
class MaybeInterrupt(GridSearch):
    async def run(self, runner):
        if os.environ.get("TINY_INTERRUPT") == "1":
            await runner.submit({}, {"lr": Constant(0.1)}, 10)  # the grid's first trial
            raise KeyboardInterrupt  # as if Ctrl-C came now
        return await super().run(runner)


tuner = MaybeInterrupt(space, metric="score", steps=10)
study = Study("intr", Tiny, executor="inline")
"""


def test_run_interrupted_closes_cleanly_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'intr.db'}"
    path = _script(tmp_path, INTERRUPTING)
    monkeypatch.setenv("TINY_INTERRUPT", "1")
    assert main(["run", str(path), "--storage", url, "--no-progress"]) == 130
    out, err = capsys.readouterr()
    assert err == "interrupted; run again to resume\n"
    assert out == ""
    assert _no_engine_on(url)
    with open_storage(url) as s:
        assert [t["state"] for t in s.trials("intr")] == ["done"]
        assert s.requests(states=["pending", "scheduled"]) == []
        first = s.stats("engine")["steps_executed"]
    assert first >= 10
    monkeypatch.delenv("TINY_INTERRUPT")
    assert main(["run", str(path), "--storage", url, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert _field(out, "trials") == "2"
    with open_storage(url) as s:
        assert sorted(t["state"] for t in s.trials("intr")) == ["done", "done"]
        second = s.stats("engine")["steps_executed"] - first
    # The first trial came from the plan: at most the second trial's 10 steps ran.
    assert 5 <= second <= 10


@pytest.mark.slow
def test_run_with_worker_processes_and_real_sigint(tmp_path: Path) -> None:
    """Ctrl-C on ``stagetree run`` with a worker process: exit 130, storage consistent,
    and the trainer defined in the script reaches the worker."""
    url = f"sqlite:///{tmp_path / 'sig.db'}"
    path = _script(
        tmp_path,
        'tuner = GridSearch(space, metric="score", steps=200)\nstudy = Study("sig", Tiny)\n',
    )
    env = {**os.environ, "TINY_SLEEP": "0.1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetree.cli",
            "run",
            str(path),
            "--storage",
            url,
            "--workers",
            "1",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # The worker loads the script to find the trainer, and with it builds the Study
        # with the script's own default storage, relative to the working directory.
        cwd=tmp_path,
        # A shell that starts jobs in the background (CI runners, nohup ... &) leaves
        # SIGINT ignored, and a child inherits that: give the run the default handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if not (tmp_path / "sig.db").exists():
                continue
            with open_storage(url) as s:
                # the branch checkpoint at step 5 is durable: there is work to keep
                # (steps are slow, 0.1 s, so a loaded machine still interrupts mid-run)
                if s.checkpoints():
                    break
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == "interrupted; run again to resume"
    with open_storage(url) as s:
        assert s.requests(states=["pending", "scheduled"]) == []
        assert {t["state"] for t in s.trials("sig")} <= {"cancelled", "done"}
        assert s.checkpoints()  # durable work stays for the next run


# -- --step-timeout, --stop-timeout ----------------------------------------------------

HANGS = """
from stop_trainers import Hangs

from stagetree import Study
from stagetree.hp import Constant
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

study = Study("hang", Hangs, storage={url!r}, workers=1)
tuner = GridSearch(GridSpace({{"lr": [Constant(0.5)]}}, fixed={{"at": [2]}}), "w", steps=4)
"""


def test_run_step_timeout_fails_a_stuck_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'hang.db'}"
    path = tmp_path / "hangs.py"
    path.write_text(HANGS.format(url=url))
    args = ["run", str(path), "--no-progress", "--no-check", "--step-timeout", "1"]
    assert main(args) == 1  # the only trial failed: its step 2 never returns
    err = capsys.readouterr().err
    assert "step 2 took longer than step_timeout=1s" in err
    assert current_overrides() == Overrides()
    assert _no_engine_on(url)


def test_run_timeouts_override_the_script_and_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with command_line_overrides(step_timeout=2.5, stop_timeout=0.5):
        study = study_module.Study("t", LinearTrainer, storage="memory://", step_timeout=60.0)
    assert (study.settings.step_timeout, study.settings.stop_timeout) == (2.5, 0.5)
    study.close()
    for flag, value in [("--step-timeout", "0"), ("--stop-timeout", "-1"), ("--step-timeout", "x")]:
        assert main(["run", str(tmp_path / "any.py"), flag, value]) == 2
        assert f"{flag}: expected a number of seconds > 0, got '{value}'" in capsys.readouterr().err
