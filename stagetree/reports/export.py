"""Results as data: a study's trials as a table (CSV, JSON, Parquet, a pandas
DataFrame), as TensorBoard runs, as MLflow runs, and a trial's trained weights as plain
PyTorch files.

Everything here reads a storage (opened read-only by URL, or one a
:class:`~stagetree.Study` holds) and writes only what it is asked to write. The optional
packages are imported when a format needs them; a missing one raises
:class:`MissingExtraError` naming the extra that installs it.

The trial table (:func:`trials_table`), one row per trial:

* ``study``, ``trial`` (id), ``state``, ``steps`` (requested);
* ``config.<name>``: each fixed hyper-parameter;
* ``hp.<name>``: each sequence in readable form (``MultiStep(0.1, [30, 60], 0.1)``,
  ``0.1`` for a constant, ``0 until step 5, then Cosine(...)``), and ``hp.<name>.last``:
  its value at the trial's last trained step (``steps - 1``);
* ``metrics_at``: the step of the final metrics (the trial's last step with metrics:
  ``steps`` for a finished trial, earlier for a running or failed one), and
  ``metric.<name>``: each metric there;
* ``error``: one line for a failed trial (``ValueError: boom (training step 3)``);
* ``lineage``: how population based training made the trial, ``"3@10 > 7@20"`` (copied
  from trial 3 at step 10, then from trial 7 at step 20); empty for none.

Lists and dicts (a config value ``[64, 64]``, betas ``(0.9, 0.999)``) are JSON text in a
cell. With ``history=True`` the table is the full metric history in long form: ``study``,
``trial``, ``step``, ``metric``, ``value``, one row per recorded value.

Also the records that ``stagetree export --format json`` writes
(:func:`export_records`: every trial with its metric history) and their flat table
(:func:`export_table`).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stagetree.checkpoints.format import REF_RE, check_content, decode
from stagetree.checkpoints.location import default_checkpoint_dir
from stagetree.checkpoints.stores import open_byte_store
from stagetree.exceptions import CheckpointError, MissingExtraError, PlanKeyError, StagetreeError
from stagetree.extras import install_hint
from stagetree.plan.base import BasePlanStorage
from stagetree.records import TrialRecord, TrialState
from stagetree.reports.format import short_sequence
from stagetree.reports.open import default_storage, open_existing_storage
from stagetree.reports.trials import study_record, trial_records

__all__ = [
    "HISTORY_COLUMNS",
    "TABLE_FORMATS",
    "MissingExtraError",
    "MlflowExport",
    "Table",
    "dataframe",
    "export_checkpoint",
    "export_mlflow",
    "export_records",
    "export_table",
    "export_tensorboard",
    "lineage_text",
    "model_files",
    "read_trial_state",
    "records_table",
    "require",
    "trial_info",
    "trials_dataframe",
    "trials_table",
    "write_model_files",
    "write_table",
]

#: Formats :func:`write_table` writes.
TABLE_FORMATS = ("csv", "json", "parquet")

HISTORY_COLUMNS = ["study", "trial", "step", "metric", "value"]


def require(module: str, extra: str, what: str) -> Any:
    """Import ``module`` for ``what``, or raise :class:`MissingExtraError` naming
    ``extra``. A module set to None in ``sys.modules`` counts as missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{what} needs the package {module.split('.')[0]!r}, which is not installed: "
            f"{install_hint(extra)}"
        ) from exc


# --------------------------------------------------------------------------- table


@dataclass
class Table:
    """Columns and rows of an export (see the module docs for the columns)."""

    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def records(self) -> list[dict[str, Any]]:
        """One dict per row, column name to cell."""
        return [dict(zip(self.columns, row)) for row in self.rows]


def lineage_text(lineage: Iterable[Mapping[str, Any]]) -> str:
    """``[{"donor": 3, "step": 10}, {"donor": 7, "step": 20}]`` as ``"3@10 > 7@20"``."""
    return " > ".join(f"{int(e['donor'])}@{int(e['step'])}" for e in lineage)


def _cell(value: Any) -> Any:
    """A table cell: scalars as they are, lists, tuples and dicts as JSON text (so that
    every format holds them the same way), numpy scalars as Python numbers."""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True, default=str)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and not isinstance(value, (str, bytes)):
        with contextlib.suppress(Exception):
            return item()
    return value


def _records(
    storage: BasePlanStorage, study: str | None, version: Any = None
) -> list[tuple[str, TrialRecord]]:
    """``(study, record)`` of every trial of ``study`` (else of every study), each
    study's latest trainer version unless ``version``.

    Raises:
        PlanKeyError: no study ``study`` in the storage.
    """
    if study is not None:
        study_record(storage, study)
        names = [study]
    else:
        names = [s["name"] for s in storage.studies()]
    return [(name, rec) for name in names for rec in trial_records(storage, name, version)]


def _final(rec: TrialRecord) -> tuple[int, dict[str, float]] | None:
    """The last step with metrics up to the trial's steps, and its metrics."""
    steps = [s for s in rec.metrics if s <= rec.steps]
    if not steps:
        return None
    last = max(steps)
    return last, rec.metrics[last]


def _hp_last(seq: Any, steps: int) -> Any:
    return _cell(seq(max(steps - 1, 0)))


def _summary_table(found: list[tuple[str, TrialRecord]]) -> Table:
    config_names: dict[str, None] = {}
    hp_names: dict[str, None] = {}
    metric_names: set[str] = set()
    for _, rec in found:
        config_names.update(dict.fromkeys(rec.config))
        hp_names.update(dict.fromkeys(rec.hp))
        final = _final(rec)
        if final is not None:
            metric_names.update(final[1])
    metrics = sorted(metric_names)
    columns = [
        "study",
        "trial",
        "state",
        "steps",
        *(f"config.{k}" for k in config_names),
        *(c for k in hp_names for c in (f"hp.{k}", f"hp.{k}.last")),
        "metrics_at",
        *(f"metric.{k}" for k in metrics),
        "error",
        "lineage",
    ]
    table = Table(columns)
    for name, rec in found:
        final = _final(rec)
        hp: list[Any] = []
        for k in hp_names:
            seq = rec.hp.get(k)
            hp += [None, None] if seq is None else [short_sequence(seq), _hp_last(seq, rec.steps)]
        values = final[1] if final is not None else {}
        table.rows.append(
            [
                name,
                rec.id,
                rec.state,
                rec.steps,
                *(_cell(rec.config[k]) if k in rec.config else None for k in config_names),
                *hp,
                final[0] if final is not None else None,
                *(values.get(k) for k in metrics),
                rec.error.summary() if rec.error is not None else None,
                lineage_text(rec.lineage),
            ]
        )
    return table


def _history_table(found: list[tuple[str, TrialRecord]]) -> Table:
    table = Table(list(HISTORY_COLUMNS))
    for name, rec in found:
        for step, metrics in sorted(rec.metrics.items()):
            for metric in sorted(metrics):
                table.rows.append([name, rec.id, step, metric, metrics[metric]])
    return table


def records_table(found: list[tuple[str, TrialRecord]], history: bool = False) -> Table:
    """The trial table of ``(study name, record)`` pairs (or, with ``history``, their
    metric history in long form): what :func:`trials_table` builds from a storage, for
    records that came from elsewhere (a remote study's server)."""
    return _history_table(found) if history else _summary_table(found)


@contextlib.contextmanager
def _opened(storage: str | BasePlanStorage | None) -> Iterator[BasePlanStorage]:
    """A storage given, or one opened read-only by URL (default: the command line's
    default storage) and closed after."""
    if isinstance(storage, BasePlanStorage):
        yield storage
        return
    opened = open_existing_storage(default_storage() if storage is None else storage)
    try:
        yield opened
    finally:
        opened.close()


def trials_table(
    storage: str | BasePlanStorage | None = None,
    study: str | None = None,
    *,
    history: bool = False,
    version: Any = None,
    missing_ok: bool = False,
) -> Table:
    """The trial table (one row per trial, see the module docs) or, with ``history``,
    the metric history in long form (``study, trial, step, metric, value``).

    Args:
        storage: a storage URL (opened read-only; default ``$STAGETREE_STORAGE`` or
            ``sqlite:///stagetree.db``) or an open storage.
        study: only this study (default: every study of the storage).
        version: the trainer version (default: each study's latest run's).
        missing_ok: a study the storage does not hold has no rows (else an error).

    Raises:
        StorageError: the storage cannot be opened.
        PlanKeyError: no study ``study`` in it.
    """
    with _opened(storage) as opened:
        try:
            found = _records(opened, study, version)
        except PlanKeyError:
            if not missing_ok:
                raise
            found = []
    return _history_table(found) if history else _summary_table(found)


def dataframe(table: Table) -> Any:
    """``table`` as a :class:`pandas.DataFrame` (extra ``pandas``)."""
    pd = require("pandas", "pandas", "a DataFrame of trials")
    return pd.DataFrame(table.rows, columns=table.columns)


def trials_dataframe(
    storage: str | BasePlanStorage | None = None,
    study: str | None = None,
    history: bool = False,
    version: Any = None,
) -> Any:
    """:func:`trials_table` as a :class:`pandas.DataFrame` (extra ``pandas``).

    Raises:
        MissingExtraError: pandas is not installed.
        StorageError, PlanKeyError: as :func:`trials_table`.
    """
    require("pandas", "pandas", "a DataFrame of trials")  # before reading anything
    return dataframe(trials_table(storage, study, history=history, version=version))


def _json_cell(value: Any) -> Any:
    """Strict JSON: NaN and infinities as ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _write_csv(table: Table, stream: IO[str]) -> None:
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(table.columns)
    writer.writerows([["" if c is None else c for c in row] for row in table.rows])


def _write_json(table: Table, stream: IO[str]) -> None:
    rows = [{k: _json_cell(v) for k, v in r.items()} for r in table.records()]
    json.dump(rows, stream, indent=2, allow_nan=False)
    stream.write("\n")


def _arrow_column(values: list[Any]) -> Any:
    """A pyarrow array of one column; a column of mixed types (``1`` and ``"a"``)
    becomes text."""
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values])


def _write_parquet(table: Table, path: str | os.PathLike[str]) -> None:
    require("pyarrow", "parquet", "--format parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(zip(*table.rows)) if table.rows else [() for _ in table.columns]
    arrow = pa.table({name: _arrow_column(list(col)) for name, col in zip(table.columns, columns)})
    pq.write_table(arrow, str(path))


def write_table(table: Table, fmt: str, out: str | os.PathLike[str] | IO[str] | None) -> None:
    """Write ``table`` as ``fmt`` (``csv``, ``json`` or ``parquet``).

    ``out``: a path (written to a temporary file beside it and renamed into place when
    complete, so a failed export leaves nothing), a text stream (``csv``/``json``), or
    None for ``sys.stdout``. Parquet needs a path.

    Raises:
        ValueError: an unknown format, or parquet to a stream.
        MissingExtraError: parquet without pyarrow.
        OSError: the file cannot be written.
    """
    if fmt not in TABLE_FORMATS:
        raise ValueError(f"table format must be one of {', '.join(TABLE_FORMATS)}, got {fmt!r}")
    if fmt == "parquet":
        require("pyarrow", "parquet", "--format parquet")
        if out is None or not isinstance(out, (str, os.PathLike)):
            raise ValueError("parquet is binary: give an output file (-o FILE)")
    if out is None or not isinstance(out, (str, os.PathLike)):
        stream = sys.stdout if out is None else out
        (_write_csv if fmt == "csv" else _write_json)(table, stream)
        return
    with atomic_path(out) as tmp:
        if fmt == "parquet":
            _write_parquet(table, tmp)
        else:
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                (_write_csv if fmt == "csv" else _write_json)(table, f)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` that replaces it when the block succeeds and is
    removed when it fails."""
    target = Path(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:  # name the file asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(target)) from None
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- checkpoints


def _checkpoint_location(url: str | None, checkpoints: str | os.PathLike[str] | None) -> Any:
    if checkpoints is not None:
        return checkpoints
    if url is not None and not url.startswith(("memory", ":memory:")):
        # Where a study put them by default: beside a SQLite file, else
        # ./stagetree_checkpoints (default_checkpoint_dir).
        return default_checkpoint_dir(url)[0]
    raise CheckpointError(
        "the checkpoint location of this storage is not known: pass --checkpoints"
    )


def _read_ref(location: Any, ref: str, of: dict[str, Any] | None = None) -> dict[str, Any]:
    """Decode checkpoint ``ref`` of ``location`` (a directory or a byte-store URL)
    without writing anything there; refused unless it is the checkpoint ``ref`` (and
    ``of``: tree, node, step) names."""
    if not REF_RE.fullmatch(ref):
        raise CheckpointError(f"the plan's checkpoint reference {ref!r} is not a checkpoint name")
    text = str(location)
    try:
        if "://" not in text or text.startswith("file://"):
            directory = Path(text[len("file://") :] if text.startswith("file://") else text)
            raw = (directory / ref).read_bytes()
        else:
            raw = bytes(open_byte_store(text).get(ref))
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {ref} is not in {location} (evicted, cleaned up or moved; "
            "--checkpoints names another location)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {ref} from {location}: {exc}") from exc
    check_content(ref, raw, of)  # before decoding: a wrong file is never decoded
    try:
        state = decode(raw, "cpu")
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {ref} in {location} is corrupt: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {ref} does not hold a dict")
    return state


def _trial_row(storage: BasePlanStorage, trial: int) -> dict[str, Any]:
    try:
        return storage.trial(int(trial))
    except PlanKeyError:
        raise PlanKeyError(f"no trial {trial} in the storage") from None


def _url(storage: str | BasePlanStorage | None) -> str | None:
    """The URL of a storage given by URL (or None: the default); None for an open one."""
    if storage is None:
        return default_storage()
    return storage if isinstance(storage, str) else None


def _trial_state(
    storage: BasePlanStorage, url: str | None, trial: int, checkpoints: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    row = _trial_row(storage, trial)
    # Where the plan holds the trial's final step (as Study.state finds it).
    where = storage.locate(str(row["root_key"]), row.get("hp") or {}, int(row["steps"]))
    record = storage.checkpoint(*where) if where is not None else None
    if record is None:
        raise CheckpointError(
            f"trial {trial} ({row['state']}, {row['steps']} steps) has no checkpoint at its "
            "final step: it did not finish, or its checkpoint was evicted (a checkpoint "
            "budget) or cleaned up; the export does not train it again"
        )
    assert where is not None  # a record was found there
    of = {"root": str(row["root_key"]), "node": where[0], "step": where[1]}
    return row, _read_ref(_checkpoint_location(url, checkpoints), record.ref, of)


def read_trial_state(
    storage: str | BasePlanStorage | None,
    trial: int,
    checkpoints: str | os.PathLike[str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trial row, trainer state)``: the state (``Trainer.state_dict()``) held by
    the checkpoint at trial ``trial``'s final step. Nothing is trained: a trial
    without that checkpoint is an error.

    Args:
        storage: a storage URL (read-only) or an open storage.
        checkpoints: the checkpoint location (default: beside a SQLite plan).

    Raises:
        PlanKeyError: no trial ``trial``.
        CheckpointError: the trial has no checkpoint at its final step (not finished, or
            its checkpoint was evicted: train it again to get one), it cannot be read, or
            the location is unknown (not a SQLite plan and no ``checkpoints``).
    """
    with _opened(storage) as opened:
        return _trial_state(opened, _url(storage), trial, checkpoints)


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"state", "param_groups"}


def model_files(state: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """The plain PyTorch ``state_dict`` s in a trainer state: file stem -> ``(kind,
    state_dict)``.

    A :class:`~stagetree.torch.TorchTrainer` state gives one ``"module"`` entry per
    module attribute (``"model"`` for ``self.model``) and one ``"optimizer"`` entry per
    optimizer (its other objects, a loader's position, are stagetree's and left out);
    any other trainer's state is one ``"state"`` entry (the whole ``state_dict()``,
    numpy arrays as tensors)."""
    objects, modes = state.get("objects"), state.get("modes")
    if isinstance(objects, dict) and isinstance(modes, dict) and "rng_objects" in state:
        out = {k: ("module", v) for k, v in objects.items() if k in modes}
        out.update(
            (k, ("optimizer", v))
            for k, v in objects.items()
            if k not in modes and _is_optimizer_state(v)
        )
        return out
    return {"state": ("state", _tensors(dict(state)))}


def _tensors(value: Any) -> Any:
    """numpy arrays as tensors and numpy scalars as numbers, so that
    ``torch.load(weights_only=True)`` reads a plain trainer's state."""
    import numpy as np

    if isinstance(value, np.ndarray):
        import torch

        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(v) for v in value)
    return value


def _check_empty(directory: str | os.PathLike[str]) -> Path:
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise StagetreeError(f"output {target} exists and is not an empty directory")
    return target


def write_model_files(
    state: Mapping[str, Any], info: Mapping[str, Any], directory: str | os.PathLike[str]
) -> list[Path]:
    """Write each :func:`model_files` entry as ``DIR/<name>.pt`` (``torch.save``) and
    ``DIR/trial.json`` (``info`` with ``"files"``: file -> ``"module"``,
    ``"optimizer"`` or ``"state"``), all or nothing. Load a module with
    ``model.load_state_dict(torch.load(DIR / "model.pt"))``.

    Raises:
        MissingExtraError: torch is not installed.
        StagetreeError: ``directory`` exists and is not an empty directory.
    """
    torch = require("torch", "torch", "writing model weights")
    target = _check_empty(directory)
    files = model_files(state)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        kinds = {}
        for name, (kind, obj) in files.items():
            torch.save(obj, tmp / f"{name}.pt")
            kinds[f"{name}.pt"] = kind
        meta = {**info, "files": kinds}
        (tmp / "trial.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(target.iterdir())


def trial_info(rec: TrialRecord | None, row: Mapping[str, Any]) -> dict[str, Any]:
    """What ``trial.json`` holds: study, trial, state, steps, config, sequences
    (readable and as JSON), final metrics and lineage."""
    hp = row.get("hp") or {}
    info: dict[str, Any] = {
        "study": row.get("study"),
        "trial": int(row["id"]),
        "state": row.get("state"),
        "steps": int(row["steps"]),
        "config": dict(row.get("config") or {}),
        "hp": {k: short_sequence(seq) for k, seq in hp.items()},
        "hp_json": {k: seq.to_json() for k, seq in hp.items()},
    }
    if rec is not None:
        final = _final(rec)
        info["metrics_at"] = final[0] if final is not None else None
        info["metrics"] = {k: _json_cell(v) for k, v in (final[1] if final else {}).items()}
        info["lineage"] = list(rec.lineage)
    return info


def _record_of(storage: BasePlanStorage, row: Mapping[str, Any]) -> TrialRecord | None:
    study = row.get("study")
    if study is None:
        return None
    for rec in trial_records(storage, str(study)):
        if rec.id == int(row["id"]):
            return rec
    return None


def export_checkpoint(
    storage: str | BasePlanStorage | None,
    trial: int,
    directory: str | os.PathLike[str],
    checkpoints: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write trial ``trial``'s trained weights in plain PyTorch form into
    ``directory`` (see :func:`write_model_files`): ``model.pt`` (for a
    ``TorchTrainer`` whose module is ``self.model``), ``optimizer.pt``..., and
    ``trial.json``. Returns the files written.

    Raises:
        PlanKeyError: no trial ``trial``.
        CheckpointError: it has no checkpoint at its final step (it is not retrained).
        StagetreeError: ``directory`` is not empty; MissingExtraError without torch.
    """
    require("torch", "torch", "writing model weights")
    _check_empty(directory)
    with _opened(storage) as opened:
        row, state = _trial_state(opened, _url(storage), trial, checkpoints)
        rec = _record_of(opened, row)
    return write_model_files(state, trial_info(rec, row), directory)


# --------------------------------------------------------------------------- tensorboard


def _param_value(value: Any) -> Any:
    """A value HParams and MLflow take: bool, int, float or str."""
    value = _cell(value)
    if value is None:
        return ""
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _params(rec: TrialRecord) -> dict[str, Any]:
    out: dict[str, Any] = {f"config.{k}": _param_value(v) for k, v in rec.config.items()}
    for k, seq in rec.hp.items():
        out[f"hp.{k}"] = short_sequence(seq)
        out[f"hp.{k}.last"] = _param_value(seq(max(rec.steps - 1, 0)))
    return out


def _run_dir(study: str, trial: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in study)
    return f"{safe}/trial-{trial}"


def export_tensorboard(
    storage: str | BasePlanStorage | None,
    directory: str | os.PathLike[str],
    study: str | None = None,
) -> int:
    """Write one TensorBoard run per trial, ``DIR/<study>/trial-<id>``: every recorded
    metric as a scalar by step, and the trial's hyper-parameters (``config.*``,
    ``hp.*``, ``hp.*.last``) and state through the HParams plugin, with the metrics as
    its metrics. A trial's earlier export in the same place is replaced. Returns the
    runs written.

    Raises:
        MissingExtraError: tensorboardX is not installed (extra ``tensorboard``).
        StorageError, PlanKeyError: as :func:`trials_table`.
    """
    require("tensorboardX", "tensorboard", "--format tensorboard")
    from tensorboardX import SummaryWriter
    from tensorboardX.summary import hparams

    with _opened(storage) as opened:
        found = _records(opened, study)
    root = Path(directory)
    metric_names = sorted({m for _, rec in found for ms in rec.metrics.values() for m in ms})
    for name, rec in found:
        run = root / _run_dir(name, rec.id)
        if run.is_dir():  # a re-export replaces the run, never doubles its points
            for old in run.glob("events.out.tfevents.*"):
                old.unlink()
        with SummaryWriter(logdir=str(run)) as writer:
            for step, metrics in sorted(rec.metrics.items()):
                for metric, value in sorted(metrics.items()):
                    writer.add_scalar(metric, float(value), step)
            params = {**_params(rec), "state": rec.state, "steps": rec.steps}
            params["lineage"] = lineage_text(rec.lineage)
            exp, ssi, sei = hparams(params, dict.fromkeys(metric_names, 0.0))
            for summary in (exp, ssi, sei):
                writer.file_writer.add_summary(summary)
    return len(found)


# --------------------------------------------------------------------------- mlflow

TAG_STUDY = "stagetree.study"
TAG_TRIAL = "stagetree.trial"
TAG_DIGEST = "stagetree.digest"


def _digest(rec: TrialRecord, artifacts: bool) -> str:
    """What a run was logged from: a re-export with the same digest has nothing new."""
    import hashlib

    points = sorted((s, sorted(m.items())) for s, m in rec.metrics.items())
    body = json.dumps(
        [rec.state, rec.steps, _params(rec), points, rec.lineage, artifacts], default=str
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass
class MlflowExport:
    """What :func:`export_mlflow` did: runs ``logged`` (new), ``replaced`` (the trial
    changed since its last export: its old run was deleted), ``skipped`` (unchanged),
    and the trials whose checkpoint artifact was asked for but absent
    (``no_checkpoint``)."""

    logged: int = 0
    replaced: int = 0
    skipped: int = 0
    no_checkpoint: list[int] = field(default_factory=list)
    tracking_uri: str = ""


def export_mlflow(
    storage: str | BasePlanStorage | None,
    study: str | None = None,
    tracking_uri: str | None = None,
    artifacts: bool = False,
    checkpoints: str | os.PathLike[str] | None = None,
) -> MlflowExport:
    """Log each trial as an MLflow run in the experiment named after its study: params
    (``config.*``, ``hp.*``, ``hp.*.last``), every metric by step, tags
    ``stagetree.study``, ``stagetree.trial``, ``stagetree.state``, ``stagetree.lineage``
    and, with ``artifacts``, the trial's weights (:func:`export_checkpoint`'s files) under
    the artifact path ``model``. Runs end ``FINISHED`` (done), ``FAILED`` or ``KILLED``
    (stopped early or not finished).

    Exporting again never duplicates a run: a trial whose run (found by its study and
    trial tags) was logged from the same results is skipped; one whose results changed
    (it trained further, failed, finished) has its old run deleted and is logged anew.

    Args:
        tracking_uri: MLflow tracking URI (default: MLflow's own, ``$MLFLOW_TRACKING_URI``
            or ``sqlite:///mlflow.db`` in the working directory). A file store
            (``./mlruns``, ``file:///dir``) is allowed when named here.
        checkpoints: the checkpoint location for ``artifacts`` (default: beside a
            SQLite plan).

    Raises:
        MissingExtraError: mlflow is not installed (extra ``mlflow``).
        StorageError, PlanKeyError: as :func:`trials_table`.
    """
    require("mlflow", "mlflow", "--format mlflow")
    if artifacts:
        require("torch", "torch", "--artifacts (model weights)")
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    location = _checkpoint_location(_url(storage), checkpoints) if artifacts else None
    result = MlflowExport()
    with _opened(storage) as opened:
        found = _records(opened, study)  # a bad storage or study: nothing is logged
        with _file_store_allowed(tracking_uri):
            try:
                client = MlflowClient(tracking_uri=tracking_uri)
                result.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
                _log_runs(client, opened, found, artifacts, location, result)
            except MlflowException as exc:
                raise StagetreeError(f"MLflow ({tracking_uri or 'default'}): {exc}") from exc
    return result


@contextlib.contextmanager
def _file_store_allowed(uri: str | None) -> Iterator[None]:
    """MLflow 3 refuses a file store (``./mlruns``, ``file:...``) unless
    ``MLFLOW_ALLOW_FILE_STORE`` is set: a URI naming one is the user's explicit choice."""
    if uri is None or not (uri.startswith("file:") or "://" not in uri):
        yield
        return
    old = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = old


def _log_runs(
    client: Any,
    opened: BasePlanStorage,
    found: list[tuple[str, TrialRecord]],
    artifacts: bool,
    location: Any,
    result: MlflowExport,
) -> None:
    import time

    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    experiments: dict[str, str] = {}
    for name, rec in found:
        if name not in experiments:
            exp = client.get_experiment_by_name(name)
            experiments[name] = (
                exp.experiment_id if exp is not None else client.create_experiment(name)
            )
        exp_id = experiments[name]
        digest = _digest(rec, artifacts)
        found_runs = client.search_runs([exp_id], filter_string=f"tags.`{TAG_TRIAL}` = '{rec.id}'")
        old = [r for r in found_runs if r.data.tags.get(TAG_STUDY) == name]
        if any(r.data.tags.get(TAG_DIGEST) == digest for r in old):
            result.skipped += 1
            continue
        for r in old:
            client.delete_run(r.info.run_id)
        tags = {
            TAG_STUDY: name,
            TAG_TRIAL: str(rec.id),
            TAG_DIGEST: digest,
            "stagetree.state": rec.state,
            "stagetree.lineage": lineage_text(rec.lineage),
            "mlflow.runName": f"{name}/trial-{rec.id}",
        }
        if rec.error is not None:
            tags["stagetree.error"] = rec.error.summary()
        run = client.create_run(exp_id, tags=tags, run_name=f"{name}/trial-{rec.id}")
        run_id = run.info.run_id
        # MLflow caps a param value at 6000 characters and a batch at 100 params.
        params = [Param(k, str(v)[:6000]) for k, v in _params(rec).items()]
        points = [
            Metric(metric, float(value), now, int(step))
            for step, metrics in sorted(rec.metrics.items())
            for metric, value in sorted(metrics.items())
        ]
        for i in range(0, len(params), 100):
            client.log_batch(run_id, params=params[i : i + 100])
        for i in range(0, len(points), 1000):
            client.log_batch(run_id, metrics=points[i : i + 1000])
        if artifacts:
            _log_model(client, run_id, opened, rec, location, result)
        ends: dict[str, str] = {TrialState.DONE: "FINISHED", TrialState.FAILED: "FAILED"}
        status = ends.get(rec.state, "KILLED")
        client.set_terminated(run_id, status)
        if old:
            result.replaced += 1
        else:
            result.logged += 1


def _log_model(
    client: Any,
    run_id: str,
    storage: BasePlanStorage,
    rec: TrialRecord,
    location: Any,
    result: MlflowExport,
) -> None:
    try:
        row, state = _trial_state(storage, None, rec.id, location)
    except CheckpointError:
        result.no_checkpoint.append(rec.id)
        client.set_tag(run_id, "stagetree.checkpoint", "absent")
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        write_model_files(state, trial_info(rec, row), out)
        client.log_artifacts(run_id, str(out), "model")


# --------------------------------------------------------------------------- records


def _json_number(value: float) -> float | str:
    """Strict JSON has no NaN or infinities: they become ``"nan"``, ``"inf"``,
    ``"-inf"`` (``float()`` reads them back)."""
    return value if math.isfinite(value) else str(value)


def export_records(storage: BasePlanStorage, study: str | None = None) -> list[dict[str, Any]]:
    """Every trial with its metric history, as JSON-able dicts: per study, the trials
    of its latest trainer version (:func:`hidden_trials` counts the others).

    Each dict: ``study``, ``trial`` (id), ``config``, ``hp`` (sequences as JSON),
    ``steps``, ``state``, ``error`` (None, or for a failed trial ``{"type", "message",
    "traceback", "where"}``) and ``history``: ``[{"step": s, "metrics": {...}}, ...]``
    in step order (only steps with metrics; NaN and infinities as strings).

    Raises:
        PlanKeyError: no study ``study`` in the storage.
    """
    names = [s["name"] for s in storage.studies()] if study is None else [study]
    if study is not None:
        study_record(storage, study)
    out: list[dict[str, Any]] = []
    for name in names:
        for rec in trial_records(storage, name):
            out.append(
                {
                    "study": name,
                    "trial": rec.id,
                    "config": dict(rec.config),
                    "hp": {k: seq.to_json() for k, seq in rec.hp.items()},
                    "steps": rec.steps,
                    "state": rec.state,
                    "error": dataclasses.asdict(rec.error) if rec.error is not None else None,
                    "history": [
                        {"step": step, "metrics": {k: _json_number(v) for k, v in m.items()}}
                        for step, m in sorted(rec.metrics.items())
                    ],
                }
            )
    return out


def _table_cell(value: Any) -> Any:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return value


def export_table(records: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """One row per (trial, step with metrics) of :func:`export_records`.

    Columns: ``study``, ``trial``, ``config.<name>`` (in order of first appearance),
    ``hp`` (JSON of the sequences), ``step``, ``metric.<name>`` (sorted), ``state`` and
    ``error`` (the first line of a failed trial's error). Cells a row does not have are
    empty. A failed trial without metrics still gets one row (with an empty step), so
    that every failure is in the table.
    """
    records = list(records)
    config_names: dict[str, None] = {}
    metric_names: set[str] = set()
    for rec in records:
        config_names.update(dict.fromkeys(rec["config"]))
        for h in rec["history"]:
            metric_names.update(h["metrics"])
    metrics = sorted(metric_names)
    header = [
        "study",
        "trial",
        *(f"config.{k}" for k in config_names),
        "hp",
        "step",
        *(f"metric.{k}" for k in metrics),
        "state",
        "error",
    ]
    rows: list[list[Any]] = []
    for rec in records:
        config = [_table_cell(rec["config"].get(k, "")) for k in config_names]
        hp = json.dumps(rec["hp"], sort_keys=True, separators=(",", ":"))
        error = rec.get("error") or {}
        line = f"{error.get('type', 'Error')}: {error.get('message', '')}" if error else ""
        tail = [rec.get("state", ""), line.splitlines()[0] if line else ""]
        history = rec["history"] or ([{"step": "", "metrics": {}}] if error else [])
        for h in history:
            values = [h["metrics"].get(k, "") for k in metrics]
            rows.append([rec["study"], rec["trial"], *config, hp, h["step"], *values, *tail])
    return header, rows
