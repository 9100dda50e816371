"""CheckpointStore: exact round trips, atomic writes, checksums, cost-benefit eviction."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stagetree import checkpoints as ckpt_mod
from stagetree.checkpoints import CheckpointInfo, CheckpointStore, EvictionInfo
from stagetree.exceptions import CheckpointError


def _plain_state() -> dict[str, Any]:
    return {
        "step": 7,
        "lr": 0.1,
        "flag": True,
        "none": None,
        "name": "model",
        "big": 2**80 + 3,
        "inf": math.inf,
        "tuple": (1, (2.5, "x")),
        "int_keys": {0: "a", 1: [1, 2]},
        "tuple_keys": {(1, 2): 3},
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "array": np.arange(12, dtype=np.float32).reshape(3, 4),
        "u32": np.array([1, 2, 2**32 - 1], dtype=np.uint32),
        "scalar": np.float32(1.5),
        "np_int": np.int64(-3),
        "nested": [{"w": np.ones(2)}, ()],
        "nan": math.nan,
    }


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a == b
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_plain_state_round_trips_exactly(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    state = _plain_state()
    info = store.save("plain", state)
    assert isinstance(info, CheckpointInfo)
    assert info.ref == "plain.ckpt"
    assert info.nbytes == (tmp_path / "plain.ckpt").stat().st_size
    assert store.exists(info.ref) and store.refs() == ["plain.ckpt"]
    assert store.total_bytes() == info.nbytes
    _assert_same(store.load(info.ref), state)


def test_tensor_state_round_trips(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    store = CheckpointStore(tmp_path)
    model = torch.nn.Linear(3, 2)
    gen = torch.Generator().manual_seed(3)
    state = {
        "model": model.state_dict(),
        "param": model.weight,  # a Parameter is saved as a plain tensor
        "bf16": torch.arange(4, dtype=torch.bfloat16),
        "rng": gen.get_state(),
        "np": np.arange(3),
    }
    loaded = store.load(store.save("t", state).ref)
    assert isinstance(loaded["model"], OrderedDict)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded["model"][k], v)
    assert type(loaded["param"]) is torch.Tensor and torch.equal(loaded["param"], model.weight)
    assert loaded["bf16"].dtype == torch.bfloat16
    assert torch.equal(loaded["rng"], gen.get_state())
    np.testing.assert_array_equal(loaded["np"], np.arange(3))


def test_tensor_section_is_loaded_with_weights_only(tmp_path: Path) -> None:
    """A tensor section holding arbitrary pickled objects is refused, never executed."""
    torch = pytest.importorskip("torch")
    import io

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save([Evil()], buf)
    skeleton = b'["d",[["x",["T",0]]]]'
    parts = ckpt_mod._pack(skeleton, b"", buf.getvalue())  # valid checksum
    (tmp_path / "evil.ckpt").write_bytes(b"".join(parts))
    with pytest.raises(CheckpointError):
        CheckpointStore(tmp_path).load("evil.ckpt")
    assert not marker.exists()


def test_plain_states_need_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from stagetree.checkpoints import CheckpointStore\n"
        f"s = CheckpointStore({str(tmp_path)!r})\n"
        "ref = s.save('a', {'w': np.arange(3), 't': (1, 2.0)}).ref\n"
        "out = s.load(ref)\n"
        "assert out['t'] == (1, 2.0) and out['w'].tolist() == [0, 1, 2]\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_unsupported_content_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="state\\['f'\\]"):
        store.save("bad", {"f": object()})
    with pytest.raises(CheckpointError, match="dtype object"):
        store.save("bad", {"a": np.array([object()])})
    with pytest.raises(CheckpointError, match="invalid checkpoint name"):
        store.save("../escape", {})
    assert os.listdir(tmp_path) == []


def test_missing_and_invalid_refs(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        store.load("nope.ckpt")
    with pytest.raises(CheckpointError, match="invalid checkpoint ref"):
        store.load("../../etc/passwd")
    assert store.delete("nope.ckpt") is False
    assert store.exists("nope.ckpt") is False


@pytest.mark.parametrize("where", ["header", "body", "tail"])
def test_corruption_is_detected(tmp_path: Path, where: str) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save("c", {"w": np.arange(100.0), "note": "hello"}).ref
    path = tmp_path / ref
    raw = bytearray(path.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[8:16])
    index = {"header": 20, "body": 16 + hlen + 5, "tail": len(raw) - 10}[where]
    raw[index] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt"):
        store.load(ref)


def test_truncated_file_is_detected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save("c", {"w": np.arange(100.0)}).ref
    path = tmp_path / ref
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="corrupt"):
        store.load(ref)
    path.write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="bad magic"):
        store.load(ref)


def test_crash_mid_write_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save("a", {"v": 1}).ref

    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod.os, "fsync", failing_fsync)
    with pytest.raises(CheckpointError, match="No space left"):
        store.save("a", {"v": 2})
    monkeypatch.setattr(ckpt_mod.os, "fsync", real_fsync)
    # The old version is intact and no temporary file is left behind.
    assert store.load(ref) == {"v": 1}
    assert os.listdir(tmp_path) == [ref]


def test_temp_file_of_dead_writer_is_ignored_and_cleaned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save("a", {"v": 1}).ref
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = ckpt_mod._host()
    leftover = tmp_path / f".b.{host}.{dead.pid}.deadbeef.tmp"
    leftover.write_bytes(b"STCKPT\x00\x01 half written")
    live = tmp_path / f".c.{host}.{os.getpid()}.cafe0000.tmp"  # our own: still writing
    live.write_bytes(b"in progress")
    # Ignored: not listed, not counted, not loadable.
    assert store.refs() == [ref]
    assert store.total_bytes() == store.size(ref)
    # Cleaned when a store opens the directory.
    CheckpointStore(tmp_path)
    assert not leftover.exists()
    assert live.exists()


def _sized_store(tmp_path: Path, budget: int | None) -> tuple[CheckpointStore, dict[str, int]]:
    store = CheckpointStore(tmp_path, budget_bytes=budget)
    sizes = {}
    for name, n in [("a", 1000), ("b", 4000), ("c", 2000), ("d", 3000)]:
        info = store.save(name, {"w": np.zeros(n, dtype=np.uint8)})
        sizes[info.ref] = info.nbytes
    return store, sizes


def test_eviction_removes_lowest_value_first_until_under_budget(tmp_path: Path) -> None:
    store, sizes = _sized_store(tmp_path, budget=None)
    total = sum(sizes.values())
    # value = recompute_cost * pending_refs / size
    candidates = {
        "a.ckpt": EvictionInfo(recompute_cost=10.0, pending_refs=1),  # 10/1k   = 1e-2
        "b.ckpt": EvictionInfo(recompute_cost=10.0, pending_refs=1),  # 10/4k   = 2.5e-3
        "c.ckpt": EvictionInfo(recompute_cost=100.0, pending_refs=2),  # 200/2k = 1e-1
        "d.ckpt": EvictionInfo(recompute_cost=1.0, pending_refs=0),  # 0
    }
    assert store.evict(candidates, needed=set()) == []  # no budget: nothing to do
    store.budget_bytes = total - sizes["d.ckpt"] - 1
    assert store.evict(candidates, needed=set()) == ["d.ckpt", "b.ckpt"]
    assert store.refs() == ["a.ckpt", "c.ckpt"]
    assert store.total_bytes() <= store.budget_bytes


def test_eviction_never_removes_needed_or_unlisted(tmp_path: Path) -> None:
    store, _ = _sized_store(tmp_path, budget=0)
    candidates = {
        "a.ckpt": EvictionInfo(1.0, 0),
        "b.ckpt": EvictionInfo(1.0, 0),
        "c.ckpt": EvictionInfo(5.0, 3),
    }
    evicted = store.evict(candidates, needed={"b.ckpt"})
    assert evicted == ["a.ckpt", "c.ckpt"]
    # Over budget still, but b is needed and d is not a candidate.
    assert store.refs() == ["b.ckpt", "d.ckpt"]
    assert store.total_bytes() > store.budget_bytes  # type: ignore[operator]


def test_eviction_stops_as_soon_as_budget_fits(tmp_path: Path) -> None:
    store, sizes = _sized_store(tmp_path, budget=None)
    store.budget_bytes = sum(sizes.values()) - 10
    candidates = {ref: EvictionInfo(1.0, 1) for ref in sizes}
    # Equal cost and refs: the largest checkpoint has the lowest value per byte.
    assert store.evict(candidates, needed=set()) == ["b.ckpt"]


def test_store_pickles_as_its_directory(tmp_path: Path) -> None:
    import pickle

    store = CheckpointStore(tmp_path, budget_bytes=123)
    copy = pickle.loads(pickle.dumps(store))
    assert copy.directory == store.directory and copy.budget_bytes == 123
