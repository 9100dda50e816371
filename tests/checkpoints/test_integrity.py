"""A checkpoint proves what it is: its ref names its content hash, its header its tree,
node and step. A file swapped for another trial's checkpoint, a stale copy or a foreign
file is refused (and its steps recomputed), never a result."""

from __future__ import annotations

import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.checkpoints import CheckpointStore
from stagetree.checkpoints import format as fmt
from stagetree.exceptions import CheckpointError
from stagetree.hp import Constant
from stagetree.plan import open_storage
from stagetree.reports.export import read_trial_state

OF = {"root": "tree-a", "node": 3, "step": 4}


def _state(value: float) -> dict[str, Any]:
    return {"w": np.full(3, value), "t": 4}


def test_a_ref_names_its_content_and_the_header_what_it_is(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    info = store.save("n3-s4", _state(1.0), OF)
    assert info.ref.startswith("n3-s4-h") and info.ref.endswith(".ckpt")
    raw = (tmp_path / "ckpt" / info.ref).read_bytes()
    meta = fmt.read_meta(raw)
    assert meta is not None and meta["of"] == OF
    assert meta["sha256"][:32] in info.ref
    assert store.load(info.ref, of=OF)["w"].tolist() == [1.0] * 3


def test_a_stale_or_swapped_file_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    first = store.save("n3-s4", _state(1.0), OF)
    second = store.save("n3-s4", _state(2.0), OF)  # a recomputation of the same point
    other = store.save("n5-s4", _state(3.0), {**OF, "node": 5})
    for source in (second, other):
        shutil.copyfile(tmp_path / "ckpt" / source.ref, tmp_path / "ckpt" / first.ref)
        with pytest.raises(CheckpointError, match="content hash"):
            store.load(first.ref, of=OF)


def test_an_untagged_checkpoint_of_another_point_is_refused(tmp_path: Path) -> None:
    # Refs from before the tag are read on their checksum, and their header's identity.
    store = CheckpointStore(tmp_path / "ckpt")
    store.bytes.put("old.ckpt", fmt.encode(_state(1.0), {**OF, "node": 9}))
    with pytest.raises(CheckpointError, match="another point"):
        store.load("old.ckpt", of=OF)
    assert store.load("old.ckpt")["t"] == 4  # no expectation: read as before
    store.bytes.put("older.ckpt", fmt.encode(_state(1.0)))  # no identity at all
    assert store.load("older.ckpt", of=OF)["t"] == 4


def test_a_tampered_payload_with_a_fixed_checksum_is_a_checkpoint_error() -> None:
    # Bytes whose checksum was recomputed after the arrays section was replaced by
    # something numpy will not read: a CheckpointError, not numpy's or torch's own error.
    skeleton = b'["d",[["w",["a",0]]]]'
    parts = fmt.pack(skeleton, b"PK\x03\x04not an npz archive", b"")
    raw = b"".join(parts)
    with pytest.raises(CheckpointError, match="cannot decode"):
        fmt.decode(raw, "cpu")
    assert struct.unpack("<Q", raw[8:16])[0] > 0


def _final_ref(url: str, trial: int) -> tuple[str, Path]:
    storage = open_storage(url)
    try:
        row = storage.trial(trial)
        where = storage.locate(str(row["root_key"]), row.get("hp") or {}, int(row["steps"]))
        assert where is not None
        record = storage.checkpoint(*where)
        assert record is not None
        return record.ref, Path(url[len("sqlite:///") :] + ".checkpoints") / record.ref
    finally:
        storage.close()


def test_a_trials_checkpoint_swapped_for_anothers_is_recomputed(tmp_path: Path) -> None:
    hp = {"lr": Constant(0.05)}
    with Study("fresh", LinearTrainer, storage="memory://", executor="inline") as fresh:
        expected = fresh.run({"seed": 0}, hp, 8).metrics

    url = f"sqlite:///{tmp_path / 'plan.db'}"
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        study.run({"seed": 0}, hp, 4)
        study.run({"seed": 1}, hp, 4)
    _, path_a = _final_ref(url, 1)
    _, path_b = _final_ref(url, 2)
    shutil.copyfile(path_b, path_a)  # a valid checkpoint of the same trainer

    with pytest.raises(CheckpointError, match="content hash"):
        read_trial_state(url, 1)
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        with pytest.raises(CheckpointError):
            study.state({"seed": 0}, hp, 4)
        result = study.run({"seed": 0}, hp, 8)  # the 4 steps behind the file, again
    assert result.metrics == expected


@pytest.mark.torch
def test_a_save_writes_raw_tensors_from_their_own_memory(tmp_path: Path) -> None:
    """The raw section's parts are views of the tensors (a save copies them once, into
    the file): encoding allocates no buffer of their size (it built the section twice)."""
    torch = pytest.importorskip("torch")
    state = {"w": torch.randn(1 << 20), "b": torch.arange(5), "none": torch.zeros(0)}
    tracemalloc.start()
    try:
        parts = fmt.encode(state, {"node": 1, "step": 1})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # the state's tensors hold 4 MiB
    store = CheckpointStore(tmp_path)
    info = store.save("n", state, {"node": 1, "step": 1})
    assert info.nbytes == sum(len(p) for p in parts)
    back = store.load(info.ref, of={"node": 1, "step": 1})
    assert all(torch.equal(back[k], v) for k, v in state.items())
