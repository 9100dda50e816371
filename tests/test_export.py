"""Results as data (issue 14, items 4 and 5): ``Study.trials_dataframe``, ``stagetree
export --format csv|json|parquet|tensorboard|mlflow``, ``--checkpoint`` and
``Study.best_model``, through the public API and the command line."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from stagetree import Study
from stagetree.cli import export, main
from stagetree.exceptions import TrialFailedError
from stagetree.export import MissingExtraError, lineage_text, trials_dataframe, trials_table
from stagetree.hp import Constant, MultiStep

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_trainers import LinearTrainer  # noqa: E402

LR1 = MultiStep(0.1, [3], 0.1)
LR2 = Constant(0.05)
OK = {"seed": 0, "fail_train_at": None}


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'plan.db'}"


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, int]]:
    """Study "lin": two finished trials sharing steps 0-2, one failed at step 2."""
    tmp = tmp_path_factory.mktemp("export")
    with Study("lin", LinearTrainer, storage=url(tmp), executor="inline") as study:
        study.run(OK, {"lr": LR1}, 6)
        study.run(OK, {"lr": LR2}, 6)
        with pytest.raises(TrialFailedError):
            study.run({"seed": 0, "fail_train_at": 2}, {"lr": LR2}, 4)
        ids = {("lr1", "lr2", "failed")[i]: rec.id for i, rec in enumerate(study.trials())}
    return url(tmp), ids


def _by_trial(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {int(r["trial"]): r for r in rows}


# --------------------------------------------------------------------------- the table


def test_dataframe_has_one_readable_row_per_trial(plan: tuple[str, dict[str, int]]) -> None:
    pd = pytest.importorskip("pandas")
    storage, ids = plan
    with Study("lin", LinearTrainer, storage=storage, executor="inline") as study:
        df = study.trials_dataframe()
        records = {r.id: r for r in study.trials()}
    assert isinstance(df, pd.DataFrame) and len(df) == 3
    assert list(df.columns) == [
        "study",
        "trial",
        "state",
        "steps",
        "config.fail_train_at",
        "config.seed",
        "hp.lr",
        "hp.lr.last",
        "metrics_at",
        "metric.loss",
        "metric.score",
        "error",
        "lineage",
    ]
    rows = df.set_index("trial")
    lr1 = rows.loc[ids["lr1"]]
    assert lr1["hp.lr"] == "MultiStep(0.1, [3], 0.1)"
    assert lr1["hp.lr.last"] == pytest.approx(0.01)  # the value at step 5
    assert lr1["state"] == "done" and lr1["steps"] == 6 and lr1["metrics_at"] == 6
    assert lr1["metric.loss"] == records[ids["lr1"]].metrics[6]["loss"]
    assert lr1["lineage"] == "" and pd.isna(lr1["error"])
    assert rows.loc[ids["lr2"], "hp.lr"] == "0.05"
    failed = rows.loc[ids["failed"]]
    assert failed["state"] == "failed"
    assert failed["error"] == "ValueError: boom in train at step 2 (training step 2)"
    assert failed["metrics_at"] == 2  # its last step with metrics
    # The module function over the storage URL gives the same table.
    same = trials_dataframe(storage, "lin")
    pd.testing.assert_frame_equal(same, df)


def test_dataframe_history_is_long_form(plan: tuple[str, dict[str, int]]) -> None:
    pytest.importorskip("pandas")
    storage, ids = plan
    with Study("lin", LinearTrainer, storage=storage, executor="inline") as study:
        long = study.trials_dataframe(history=True)
        records = {r.id: r for r in study.trials()}
    assert list(long.columns) == ["study", "trial", "step", "metric", "value"]
    expected = sorted(
        (tid, step, metric, value)
        for tid, rec in records.items()
        for step, metrics in rec.metrics.items()
        for metric, value in metrics.items()
    )
    got = sorted(
        (int(r.trial), int(r.step), r.metric, float(r.value)) for r in long.itertuples()
    )
    assert got == expected
    assert {s for t, s, *_ in got if t == ids["lr1"]} == set(range(1, 7))


def test_dataframe_of_a_study_without_trials_is_empty(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    with Study("none", LinearTrainer, storage=url(tmp_path), executor="inline") as study:
        df = study.trials_dataframe()
    assert len(df) == 0 and "trial" in df.columns


def test_lineage_text() -> None:
    assert lineage_text([]) == ""
    assert lineage_text([{"donor": 3, "step": 10}, {"donor": 7, "step": 20}]) == "3@10 > 7@20"


def test_cli_csv_and_json_have_the_dataframe_columns(
    plan: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage, ids = plan
    table = trials_table(storage, "lin")
    assert main(["export", "--storage", storage, "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert list(rows[0]) == table.columns
    by = _by_trial(rows)
    assert by[ids["lr1"]]["hp.lr"] == "MultiStep(0.1, [3], 0.1)"  # no JSON blob
    assert float(by[ids["lr1"]]["hp.lr.last"]) == pytest.approx(0.01)
    assert by[ids["failed"]]["error"].startswith("ValueError: boom in train")
    assert by[ids["lr2"]]["error"] == ""

    target = tmp_path / "t.json"
    assert main(["export", "--storage", storage, "--format", "json", "-o", str(target)]) == 0
    assert capsys.readouterr().err == f"wrote 3 trials to {target}\n"
    objs = json.loads(target.read_text())
    assert [list(o) for o in objs] == [table.columns] * 3
    assert _by_trial(objs)[ids["lr2"]]["hp.lr"] == "0.05"

    assert main(["export", "--storage", storage, "--format", "csv", "--history"]) == 0
    long = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert list(long[0]) == ["study", "trial", "step", "metric", "value"]
    assert len(long) == len(trials_table(storage, history=True).rows)


def test_cli_parquet_round_trips(
    plan: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    storage, ids = plan
    target = tmp_path / "t.parquet"
    assert main(["export", "--storage", storage, "--format", "parquet", "-o", str(target)]) == 0
    back = pq.read_table(target).to_pylist()
    assert _by_trial(back)[ids["lr1"]]["hp.lr"] == "MultiStep(0.1, [3], 0.1)"
    assert [list(r) for r in back] == [trials_table(storage).columns] * 3
    assert main(["export", "--storage", storage, "--format", "parquet"]) == 2  # needs -o
    assert "needs -o FILE" in capsys.readouterr().err


def test_a_failing_export_leaves_no_file(
    plan: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage, _ = plan
    target = tmp_path / "trials.csv"
    missing = f"sqlite:///{tmp_path / 'nope.db'}"
    assert main(["export", "--storage", missing, "--format", "csv", "-o", str(target)]) == 2
    assert "does not exist" in capsys.readouterr().err
    argv = ["export", "--storage", storage, "--study", "zzz", "--format", "csv", "-o"]
    assert main([*argv, str(target)]) == 2
    assert "no study 'zzz'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no empty file, no temporary left behind
    target.write_text("old\n")  # a failed export keeps an existing file as it was
    assert main([*argv, str(target)]) == 2
    assert target.read_text() == "old\n"


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("fmt", "module", "extra"),
    [
        ("parquet", "pyarrow", "parquet"),
        ("tensorboard", "tensorboardX", "tensorboard"),
        ("mlflow", "mlflow", "mlflow"),
    ],
)
def test_a_missing_package_names_the_extra(
    plan: tuple[str, dict[str, int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fmt: str,
    module: str,
    extra: str,
) -> None:
    storage, _ = plan
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    out = tmp_path / "out"
    args = [] if fmt == "mlflow" else ["-o", str(out)]
    assert main(["export", "--storage", storage, "--format", fmt, *args]) == 2
    assert f"pip install 'stagetree[{extra}]'" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "mlruns").exists()


def test_dataframe_without_pandas_names_the_extra(
    plan: tuple[str, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, _ = plan
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(MissingExtraError, match=r"stagetree\[pandas\]"):
        trials_dataframe(storage)
    with (
        Study("lin", LinearTrainer, storage=storage, executor="inline") as study,
        pytest.raises(MissingExtraError, match=r"stagetree\[pandas\]"),
    ):
        study.trials_dataframe()


def test_export_usage_errors(
    plan: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage, _ = plan
    cases = [
        (["--format", "tensorboard"], "needs -o DIR"),
        (["--format", "mlflow", "-o", str(tmp_path / "x")], "--tracking-uri"),
        ([], "give --format"),
        (["--checkpoint", "1"], "needs -o DIR"),
        (["--checkpoint", "999", "-o", str(tmp_path / "w")], "no trial 999"),
    ]
    for argv, message in cases:
        assert main(["export", "--storage", storage, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["export", "--storage", storage, "--format", "tensorboard", "-o", str(afile)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_export_function_keeps_its_signature(plan: tuple[str, dict[str, int]]) -> None:
    storage, _ = plan
    out = io.StringIO()
    assert export(storage, "lin", "csv", out) == 3
    assert export(storage, "lin", "csv", io.StringIO(), history=True) > 3
    with pytest.raises(ValueError, match="format must be one of"):
        export(storage, "lin", "xml", out)
