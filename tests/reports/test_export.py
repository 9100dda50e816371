"""Results as data (issue 14, items 4 and 5): ``Study.trials_dataframe``, ``stagetree
export --format csv|json|parquet|tensorboard|mlflow``, ``--checkpoint`` and
``Study.best_model``, through the public API and the command line."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study, extras
from stagetree.cli import export, main
from stagetree.exceptions import MissingExtraError, TrialFailedError
from stagetree.hp import Constant, MultiStep
from stagetree.plan import open_storage
from stagetree.reports.export import lineage_text, trials_dataframe, trials_table

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
    got = sorted((int(r.trial), int(r.step), r.metric, float(r.value)) for r in long.itertuples())
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
        ("checkpoint", "torch", "torch"),
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
    storage, ids = plan
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    # Installed from an index: the extra's name is what installs it.
    monkeypatch.setattr(extras, "installation", lambda: extras.Installation("index"))
    out = tmp_path / "out"
    if fmt == "checkpoint":
        args = ["--checkpoint", str(ids["lr1"]), "-o", str(out)]
    else:
        args = ["--format", fmt] + ([] if fmt == "mlflow" else ["-o", str(out)])
    assert main(["export", "--storage", storage, *args]) == 2
    assert f"pip install 'stagetree[{extra}]'" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "mlruns").exists()


def test_a_missing_package_from_a_checkout_says_what_works_there(
    plan: tuple[str, dict[str, int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # From a checkout, pip install 'stagetree[parquet]' asks an index for another
    # package: the hint gives the plain package and the extra from the project.
    storage, _ = plan
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    project = tmp_path / "stagetree-src"
    monkeypatch.setattr(extras, "installation", lambda: extras.Installation("checkout", project))
    out = tmp_path / "out"
    assert main(["export", "--storage", storage, "--format", "parquet", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install pyarrow (" in err
    assert f"in {project}: pip install -e '.[parquet]'" in err
    assert "pip install 'stagetree[" not in err


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
    if importlib.util.find_spec("mlflow") is not None:
        uri = (tmp_path / "mlruns").as_uri()
        argv = ["--format", "mlflow", "--tracking-uri", uri, "--study", "zzz"]
        assert main(["export", "--storage", storage, *argv]) == 2
        assert "no study 'zzz'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written


def test_export_function_keeps_its_signature(plan: tuple[str, dict[str, int]]) -> None:
    storage, _ = plan
    out = io.StringIO()
    assert export(storage, "lin", "csv", out) == 3
    assert export(storage, "lin", "csv", io.StringIO(), history=True) > 3
    with pytest.raises(ValueError, match="format must be one of"):
        export(storage, "lin", "xml", out)


# --------------------------------------------------------------------------- tensorboard


def _event_runs(directory: Path) -> dict[str, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for run in sorted(p for p in directory.glob("*/trial-*") if p.is_dir()):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        out[f"{run.parent.name}/{run.name}"] = acc
    return out


def _hparams(acc: Any) -> dict[str, Any]:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = data.session_start_info.hparams
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in values.items()}


def test_tensorboard_one_run_per_trial_with_metrics_and_hparams(
    plan: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    storage, ids = plan
    logdir = tmp_path / "tb"
    with Study("lin", LinearTrainer, storage=storage, executor="inline") as study:
        records = {r.id: r for r in study.trials()}
    for _ in range(2):  # a second export replaces the runs, never doubles their points
        assert (
            main(["export", "--storage", storage, "--format", "tensorboard", "-o", str(logdir)])
            == 0
        )
        assert "wrote 3 TensorBoard runs" in capsys.readouterr().err
    runs = _event_runs(logdir)
    assert sorted(runs) == sorted(f"lin/trial-{i}" for i in ids.values())
    for tid, rec in records.items():
        acc = runs[f"lin/trial-{tid}"]
        assert set(acc.Tags()["scalars"]) == {"loss", "score"}
        for metric in ("loss", "score"):
            got = [(e.step, e.value) for e in acc.Scalars(metric)]
            want = [(s, m[metric]) for s, m in sorted(rec.metrics.items()) if metric in m]
            assert [s for s, _ in got] == [s for s, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
        hp = _hparams(acc)
        assert hp["hp.lr"] == ("MultiStep(0.1, [3], 0.1)" if tid == ids["lr1"] else "0.05")
        assert hp["state"] == rec.state and hp["steps"] == rec.steps and hp["config.seed"] == 0
        assert hp["lineage"] == ""
    assert _hparams(runs[f"lin/trial-{ids['lr1']}"])["hp.lr.last"] == pytest.approx(0.01)


# --------------------------------------------------------------------------- mlflow


def test_mlflow_one_run_per_trial_and_no_duplicates(
    plan: tuple[str, dict[str, int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for reading back here
    from mlflow.tracking import MlflowClient

    storage, ids = plan
    uri = (tmp_path / "mlruns").as_uri()
    argv = ["export", "--storage", storage, "--format", "mlflow", "--tracking-uri", uri]
    assert main(argv) == 0
    assert "3 runs logged, 0 replaced, 0 unchanged" in capsys.readouterr().err
    assert main(argv) == 0  # again: nothing new, nothing duplicated
    assert "0 runs logged, 0 replaced, 3 unchanged" in capsys.readouterr().err
    mlflow.set_tracking_uri(uri)
    try:
        runs = mlflow.search_runs(experiment_names=["lin"], output_format="list")
    finally:
        mlflow.set_tracking_uri(None)
    assert len(runs) == 3
    by = {int(r.data.tags["stagetree.trial"]): r for r in runs}
    assert sorted(by) == sorted(ids.values())
    lr1 = by[ids["lr1"]]
    assert lr1.data.params["hp.lr"] == "MultiStep(0.1, [3], 0.1)"
    assert float(lr1.data.params["hp.lr.last"]) == pytest.approx(0.01)
    assert lr1.data.params["config.seed"] == "0"
    assert lr1.info.status == "FINISHED" and by[ids["failed"]].info.status == "FAILED"
    assert by[ids["failed"]].data.tags["stagetree.error"].startswith("ValueError: boom")
    with Study("lin", LinearTrainer, storage=storage, executor="inline") as study:
        rec = next(r for r in study.trials() if r.id == ids["lr1"])
    history = MlflowClient(uri).get_metric_history(lr1.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [
        (s, m["loss"]) for s, m in sorted(rec.metrics.items())
    ]


# --------------------------------------------------------------------------- weights


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """A real (small) stagetree.torch study: two trials of DigitsTrainer."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from stagetree.torch.examples import DigitsTrainer

    tmp = tmp_path_factory.mktemp("digits")
    config = {"hidden": 16, "batches_per_step": 2, "dropout": 0.0}
    with Study("digits", DigitsTrainer, storage=url(tmp), executor="inline") as study:
        for lr in (0.05, 0.2):
            study.run(config, {"lr": lr}, 3)
    return url(tmp), tmp, DigitsTrainer


def _accuracy(trainer: Any, model: Any) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(trainer.x_test)
    return float((logits.argmax(dim=1) == trainer.y_test).float().mean().item())


def test_best_model_gives_the_trained_module(digits: tuple[str, Path, Any]) -> None:
    storage, _, trainer_cls = digits
    with Study("digits", trainer_cls, storage=storage, executor="inline") as study:
        model = study.best_model("accuracy", "max")
        best = study.best("accuracy", "max")
    import torch

    assert best is not None and isinstance(model, torch.nn.Module)
    fresh = trainer_cls(best.config)  # untrained weights differ, its test data is the same
    assert _accuracy(fresh, model) == best.metrics[best.steps]["accuracy"]
    with (
        Study("digits", trainer_cls, storage=storage, executor="inline") as study,
        pytest.raises(ValueError, match="no trial of study 'digits' has a finite 'nope'"),
    ):
        study.best_model("nope")


def test_cli_checkpoint_writes_plain_torch_weights(
    digits: tuple[str, Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    storage, _, trainer_cls = digits
    with Study("digits", trainer_cls, storage=storage, executor="inline") as study:
        records = study.trials()
    for rec in records:
        out = tmp_path / f"w{rec.id}"
        argv = ["export", "--storage", storage, "--checkpoint", str(rec.id), "-o", str(out)]
        assert main(argv) == 0
        assert f"wrote trial {rec.id}'s weights" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["model.pt", "optimizer.pt", "trial.json"]
        info = json.loads((out / "trial.json").read_text())
        assert info["trial"] == rec.id and info["config"] == rec.config
        assert info["hp"] == {"lr": str(rec.hp["lr"](0))}
        assert info["metrics"] == rec.metrics[rec.steps] and info["files"]["model.pt"] == "module"
        fresh = trainer_cls(rec.config)
        fresh.model.load_state_dict(torch.load(out / "model.pt"))  # weights_only by default
        assert _accuracy(fresh, fresh.model) == rec.metrics[rec.steps]["accuracy"]
        assert main(argv) == 2  # the directory is not empty any more: nothing overwritten
        assert "not an empty directory" in capsys.readouterr().err


def test_a_trial_without_its_checkpoint_says_so(
    digits: tuple[str, Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    storage, plan_dir, trainer_cls = digits
    with Study("digits", trainer_cls, storage=storage, executor="inline") as study:
        tid = study.trials()[0].id
    moved = tmp_path / "ckpts"
    shutil.copytree(plan_dir / "plan.db.checkpoints", moved)
    for ckpt in moved.iterdir():
        ckpt.unlink()
    out = tmp_path / "w"
    argv = ["export", "--storage", storage, "--checkpoint", str(tid), "-o", str(out)]
    assert main([*argv, "--checkpoints", str(moved)]) == 2
    assert "is not in" in capsys.readouterr().err and not out.exists()


def test_mlflow_artifacts_hold_the_weights(
    digits: tuple[str, Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("mlflow")
    import torch
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    storage, _, trainer_cls = digits
    uri = (tmp_path / "mlruns").as_uri()
    argv = ["export", "--storage", storage, "--format", "mlflow", "--tracking-uri", uri]
    assert main(argv) == 0
    assert main([*argv, "--artifacts"]) == 0  # asked for more: the runs are replaced
    assert "0 runs logged, 2 replaced, 0 unchanged" in capsys.readouterr().err
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("digits")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2
    run = runs[0]
    names = sorted(a.path for a in client.list_artifacts(run.info.run_id, "model"))
    assert names == ["model/model.pt", "model/optimizer.pt", "model/trial.json"]
    local = client.download_artifacts(run.info.run_id, "model/model.pt", str(tmp_path))
    tid = int(run.data.tags["stagetree.trial"])
    with Study("digits", trainer_cls, storage=storage, executor="inline") as study:
        rec = next(r for r in study.trials() if r.id == tid)
    fresh = trainer_cls(rec.config)
    fresh.model.load_state_dict(torch.load(local))
    assert _accuracy(fresh, fresh.model) == rec.metrics[rec.steps]["accuracy"]


def test_checkpoint_of_a_plain_trainer_is_its_state(
    plan: tuple[str, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    storage, ids = plan
    out = tmp_path / "w"
    argv = ["export", "--storage", storage, "--checkpoint", str(ids["lr1"]), "-o", str(out)]
    assert main(argv) == 0
    state = torch.load(out / "state.pt")  # numpy arrays became tensors: weights_only loads
    trainer = LinearTrainer(OK)
    trainer.load_state_dict({**state, "w": state["w"].numpy()})
    with Study("lin", LinearTrainer, storage=storage, executor="inline") as study:
        rec = next(r for r in study.trials() if r.id == ids["lr1"])
    assert trainer.evaluate() == rec.metrics[6]
    # a failed trial has no final checkpoint: said, nothing written
    failed = ["export", "--storage", storage, "--checkpoint", str(ids["failed"]), "-o"]
    assert main([*failed, str(tmp_path / "f")]) == 2
    assert "has no checkpoint at its final step" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()


def test_lineage_reaches_every_format(
    plan: tuple[str, dict[str, int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What PBT records on ``TrialRecord.lineage`` is the ``lineage`` column, the
    TensorBoard hparam and the MLflow tag."""
    import stagetree.reports.export as exporting

    storage, ids = plan
    real = exporting.trial_records

    def with_lineage(*args: Any, **kwargs: Any) -> Any:
        records = real(*args, **kwargs)
        for rec in records:
            if rec.id == ids["lr2"]:
                rec.lineage = [{"donor": ids["lr1"], "step": 3}]
        return records

    monkeypatch.setattr(exporting, "trial_records", with_lineage)
    want = f"{ids['lr1']}@3"
    rows = _by_trial(trials_table(storage, "lin").records())
    assert rows[ids["lr2"]]["lineage"] == want and rows[ids["lr1"]]["lineage"] == ""
    if importlib.util.find_spec("tensorboardX") and importlib.util.find_spec("tensorboard"):
        assert (
            main(["export", "--storage", storage, "--format", "tensorboard", "-o", str(tmp_path)])
            == 0
        )
        assert _hparams(_event_runs(tmp_path)[f"lin/trial-{ids['lr2']}"])["lineage"] == want
    if importlib.util.find_spec("mlflow"):
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = (tmp_path / "mlruns").as_uri()
        assert (
            main(["export", "--storage", storage, "--format", "mlflow", "--tracking-uri", uri]) == 0
        )
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("lin").experiment_id])
        tags = {int(r.data.tags["stagetree.trial"]): r.data.tags for r in runs}
        assert tags[ids["lr2"]]["stagetree.lineage"] == want


def _tampered(parts_of: Any) -> bytes:
    """A checkpoint whose tensors section is a pickle that would run code, with its
    checksum recomputed: only decoding can refuse it."""
    import pickle

    from stagetree.checkpoints import format as fmt

    class _Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned",))

    skeleton = b'["d",[["w",["T",0]]]]'
    return b"".join(fmt.pack(skeleton, b"", pickle.dumps(_Evil(), protocol=2), parts_of))


def test_a_tampered_checkpoint_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    storage = url(tmp_path)
    with Study("lin", LinearTrainer, storage=storage, executor="inline") as study:
        study.run(OK, {"lr": Constant(0.05)}, 3)
    plan = open_storage(storage)
    try:
        [(key, record)] = [(k, r) for k, r in plan.checkpoints().items() if k[1] == 3]
        directory = tmp_path / "plan.db.checkpoints"
        # The ref names its content: a tampered file fails that first.
        (directory / record.ref).write_bytes(_tampered(None))
        out = tmp_path / "w"
        argv = ["export", "--storage", storage, "--checkpoint", "1", "-o", str(out)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "content hash differs" in err and "Traceback" not in err and not out.exists()
        # A ref from before refs named their content: decoding refuses the pickle.
        (directory / "legacy.ckpt").write_bytes(_tampered(None))
        plan.put_checkpoint(*key, "legacy.ckpt", 100)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "legacy.ckpt" in err and "cannot decode" in err
        assert "Traceback" not in err and not out.exists()
    finally:
        plan.close()
