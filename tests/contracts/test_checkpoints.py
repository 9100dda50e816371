"""CheckpointStore: exact round trips, atomic writes, checksums, cost-benefit eviction, on
every byte store (a path, a ``file://`` URL, fsspec ``memory://``, S3 through s3fs
against moto in server mode), plus the local store's crash safety and the read cache."""

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

from stagetree.checkpoints import CheckpointInfo, CheckpointStore, EvictionInfo
from stagetree.checkpoints import format as fmt
from stagetree.checkpoints import stores as stores_mod
from stagetree.exceptions import CheckpointError

BACKENDS = ["path", "file-url", "memory", "s3"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A factory of checkpoint stores on one byte store: ``make(budget=None)`` opens the
    same location each call (so several stores share it, like several workers)."""
    kind = request.param
    if kind == "path":
        location = str(tmp_path / "ckpt")
    elif kind == "file-url":
        location = f"file://{tmp_path / 'ckpt'}"
    elif kind == "memory":
        location = f"memory://stagetree-test/{tmp_path.name}"
    else:
        location = request.getfixturevalue("s3").url()

    def make(budget: int | None = None, cache: str = "cache") -> CheckpointStore:
        return CheckpointStore(location, budget_bytes=budget, cache_dir=tmp_path / cache)

    make.kind = kind  # type: ignore[attr-defined]
    return make


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


def test_plain_state_round_trips_exactly(backend: Any) -> None:
    store = backend()
    state = _plain_state()
    info = store.save("plain", state)
    assert isinstance(info, CheckpointInfo)
    assert info.ref == "plain.ckpt"
    assert info.nbytes == store.size(info.ref) == len(store.bytes.get(info.ref))
    assert store.exists(info.ref) and store.refs() == ["plain.ckpt"]
    assert store.total_bytes() == info.nbytes
    _assert_same(store.load(info.ref), state)
    _assert_same(backend().load(info.ref), state)  # another store on the same location


def test_tensor_state_round_trips(backend: Any) -> None:
    torch = pytest.importorskip("torch")
    store = backend()
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


def test_tensor_section_is_loaded_with_weights_only(backend: Any, tmp_path: Path) -> None:
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
    parts = fmt.pack(skeleton, b"", buf.getvalue())  # valid checksum
    store = backend()
    store.bytes.put("evil.ckpt", parts)
    with pytest.raises(CheckpointError):
        store.load("evil.ckpt")
    assert not marker.exists()


def _tensor_zoo() -> dict[str, Any]:
    """Tensors of every dtype the raw section holds, and the awkward shapes and views."""
    torch = pytest.importorskip("torch")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    zoo: dict[str, Any] = {
        name: (torch.arange(7) % 2).to(getattr(torch, name)) for name in fmt._RAW_DTYPES
    }
    zoo.update(
        scalar=torch.tensor(3.25),
        empty=torch.empty(0, 5),
        transposed=base.t(),  # not contiguous
        strided=base[:, ::2],
        conj=torch.tensor([1 + 2j, 3 - 1j]).conj(),  # a lazy conjugate
        neg=torch.tensor([1.0, -2.0])._neg_view(),
        nonfinite=torch.tensor([math.inf, -math.inf, math.nan]),
        int_rng=torch.Generator().manual_seed(3).get_state(),
        uint16=torch.tensor([1, 2, 3], dtype=torch.int32).to(torch.uint16),  # not raw
        sparse=torch.eye(3).to_sparse(),  # not raw either
    )
    return zoo


def _same_tensor(a: Any, b: Any) -> None:
    torch = pytest.importorskip("torch")
    assert type(b) is torch.Tensor and b.dtype == a.dtype and b.shape == a.shape
    if a.is_sparse:
        assert b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
        return
    assert b.device.type == "cpu"

    # Bit for bit, NaNs included.
    def raw_bytes(t: Any) -> Any:
        return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)

    assert torch.equal(raw_bytes(a), raw_bytes(b))


def test_tensors_round_trip_bit_for_bit_without_torch_load(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense tensors are stored raw: a load reads them back as views of the checkpoint's
    bytes, without torch's unpickler (which cost a small model's load about 10x what
    reading its bytes did); other tensors still go through ``torch.load``."""
    torch = pytest.importorskip("torch")
    zoo = _tensor_zoo()
    store = backend()
    ref = store.save("zoo", zoo).ref
    loaded = store.load(ref)
    assert list(loaded) == list(zoo)
    for name, tensor in zoo.items():
        _same_tensor(tensor, loaded[name])
    loaded["float32"].add_(1)  # writable, and nothing else moves
    _same_tensor(zoo["int64"], loaded["int64"])
    dense = {k: v for k, v in zoo.items() if k not in ("uint16", "sparse")}
    ref = store.save("dense", dense).ref

    def no_torch_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    for name, tensor in store.load(ref).items():
        _same_tensor(dense[name], tensor)


def test_map_location_places_raw_tensors_as_torch_load_would(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    store = CheckpointStore(tmp_path / "ckpt")
    ref = store.save("m", {"w": torch.ones(2, 3)}).ref
    seen: list[str] = []

    def mapper(storage: Any, location: str) -> Any:
        seen.append(location)
        return storage

    for where in ("cpu", None, torch.device("cpu"), {"cpu": "cpu"}, mapper):
        w = store.load(ref, map_location=where)["w"]
        assert w.device.type == "cpu" and torch.equal(w, torch.ones(2, 3))
    assert seen == ["cpu"]


def test_format_1_checkpoints_still_load(tmp_path: Path) -> None:
    """Checkpoints written before raw tensors (three sections, tensors by torch.save)."""
    torch = pytest.importorskip("torch")
    import io

    buf = io.BytesIO()
    torch.save([torch.arange(4.0), torch.eye(2)], buf)
    skeleton = b'["d",[["a",["T",0]],["b",["l",[["T",1],7]]]]]'
    store = CheckpointStore(tmp_path / "ckpt")
    store.bytes.put("old.ckpt", fmt.pack(skeleton, b"", buf.getvalue()))
    loaded = store.load("old.ckpt")
    assert torch.equal(loaded["a"], torch.arange(4.0))
    assert torch.equal(loaded["b"][0], torch.eye(2)) and loaded["b"][1] == 7


def test_a_raw_tensor_outside_its_section_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    skeleton = b'["d",[["w",["R",["float32",[100],0,"cpu"]]]]]'
    store = CheckpointStore(tmp_path / "ckpt")
    store.bytes.put("bad.ckpt", fmt.pack(skeleton, b"", b"", bytes(16)))  # valid checksum
    with pytest.raises(CheckpointError, match="outside"):
        store.load("bad.ckpt")


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


def test_unsupported_content_is_refused_and_leaves_nothing(backend: Any) -> None:
    store = backend()
    with pytest.raises(CheckpointError, match="state\\['f'\\]"):
        store.save("bad", {"f": object()})
    with pytest.raises(CheckpointError, match="dtype object"):
        store.save("bad", {"a": np.array([object()])})
    with pytest.raises(CheckpointError, match="invalid checkpoint name"):
        store.save("../escape", {})
    assert store.bytes.list() == {}


def test_missing_and_invalid_refs(backend: Any) -> None:
    store = backend()
    with pytest.raises(CheckpointError, match="does not exist"):
        store.load("nope.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        store.size("nope.ckpt")
    with pytest.raises(CheckpointError, match="invalid checkpoint ref"):
        store.load("../../etc/passwd")
    assert store.delete("nope.ckpt") is False
    assert store.exists("nope.ckpt") is False


@pytest.mark.parametrize("where", ["header", "body", "tail"])
def test_corruption_is_detected(backend: Any, where: str) -> None:
    store = backend(cache="writer-cache")
    ref = store.save("c", {"w": np.arange(100.0), "note": "hello"}).ref
    raw = bytearray(store.bytes.get(ref))
    (hlen,) = struct.unpack("<Q", raw[8:16])
    index = {"header": 20, "body": 16 + hlen + 5, "tail": len(raw) - 10}[where]
    raw[index] ^= 0x01
    store.bytes.put(ref, [bytes(raw)])
    # A reader with its own (empty) cache, and the writer whose cache holds the good
    # bytes: a changed header is a different object, never the cached one.
    with pytest.raises(CheckpointError, match="corrupt"):
        backend(cache="reader-cache").load(ref)
    if where == "header" or store.cache is None:
        with pytest.raises(CheckpointError, match="corrupt"):
            store.load(ref)


def test_truncated_object_is_detected(backend: Any) -> None:
    store = backend()
    ref = store.save("c", {"w": np.arange(100.0)}).ref
    store.bytes.put(ref, [store.bytes.get(ref)[:-7]])
    with pytest.raises(CheckpointError, match="corrupt"):
        backend(cache="other").load(ref)
    store.bytes.put(ref, [b"junk"])
    with pytest.raises(CheckpointError, match="bad magic"):
        store.load(ref)


def test_readers_never_see_a_partial_object(backend: Any) -> None:
    """A checkpoint replaced while others read it: every load gives one whole version."""
    import threading

    writer, reader = backend(cache="w"), backend(cache="r")
    versions = [{"v": i, "w": np.full(1000 * (1 + i % 3), i, dtype=np.int64)} for i in range(12)]
    ref = writer.save("x", versions[0]).ref
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for state in versions[1:]:
                writer.save("x", state)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=write)
    thread.start()
    seen = set()
    while not done.is_set() or len(seen) == 0:
        state = reader.load(ref)
        i = state["v"]
        np.testing.assert_array_equal(state["w"], versions[i]["w"])
        seen.add(i)
    thread.join()
    assert not errors
    assert reader.load(ref)["v"] == 11
    assert reader.refs() == [ref]  # no temporary is ever listed


def test_crash_mid_write_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save("a", {"v": 1}).ref

    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stores_mod.os, "fsync", failing_fsync)
    with pytest.raises(CheckpointError, match="No space left"):
        store.save("a", {"v": 2})
    monkeypatch.setattr(stores_mod.os, "fsync", real_fsync)
    # The old version is intact and no temporary file is left behind.
    assert store.load(ref) == {"v": 1}
    assert os.listdir(tmp_path) == [ref]


def test_failed_put_on_an_object_store_keeps_previous_checkpoint(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = backend()
    ref = store.save("a", {"v": 1}).ref

    def failing_put(key: str, parts: Any) -> None:
        raise OSError("connection reset")

    monkeypatch.setattr(store.bytes, "put", failing_put)
    with pytest.raises(CheckpointError, match="connection reset"):
        store.save("a", {"v": 2})
    assert backend(cache="other").load(ref) == {"v": 1}


def test_temp_file_of_dead_writer_is_ignored_and_cleaned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save("a", {"v": 1}).ref
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = stores_mod._host()
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


def _sized_store(backend: Any, budget: int | None) -> tuple[CheckpointStore, dict[str, int]]:
    store = backend(budget)
    sizes = {}
    for name, n in [("a", 1000), ("b", 4000), ("c", 2000), ("d", 3000)]:
        info = store.save(name, {"w": np.zeros(n, dtype=np.uint8)})
        sizes[info.ref] = info.nbytes
    return store, sizes


def test_eviction_removes_lowest_value_first_until_under_budget(backend: Any) -> None:
    store, sizes = _sized_store(backend, budget=None)
    total = sum(sizes.values())
    assert store.total_bytes() == total
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
    with pytest.raises(CheckpointError, match="does not exist"):
        backend(cache="other").load("b.ckpt")  # evicted means missing everywhere


def test_eviction_never_removes_needed_or_unlisted(backend: Any) -> None:
    store, _ = _sized_store(backend, budget=0)
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


def test_eviction_stops_as_soon_as_budget_fits(backend: Any) -> None:
    store, sizes = _sized_store(backend, budget=None)
    store.budget_bytes = sum(sizes.values()) - 10
    candidates = {ref: EvictionInfo(1.0, 1) for ref in sizes}
    # Equal cost and refs: the largest checkpoint has the lowest value per byte.
    assert store.evict(candidates, needed=set()) == ["b.ckpt"]


def test_store_pickles_as_its_location(backend: Any) -> None:
    import pickle

    store = backend(123)
    ref = store.save("p", {"v": 1}).ref
    data = pickle.dumps(store)
    assert len(data) < 1000  # cheap to send to a worker or an actor
    copy = pickle.loads(data)
    assert copy.location == store.location and copy.budget_bytes == 123
    assert copy.load(ref) == {"v": 1}
    if backend.kind in ("path", "file-url"):
        assert copy.directory == store.directory


def test_check_proves_the_location_and_leaves_nothing(backend: Any) -> None:
    store = backend()
    store.check()
    assert store.bytes.list() == {}


def test_read_cache_downloads_a_checkpoint_once(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend.kind in ("path", "file-url"):
        assert backend().cache is None  # local disk: nothing to cache
        return
    writer = backend(cache="writer")
    state = {"w": np.arange(5000.0)}
    ref = writer.save("r", state).ref
    reader = backend(cache="reader")
    downloads: list[str] = []
    real_get = reader.bytes.get

    def counting_get(key: str) -> bytes:
        downloads.append(key)
        return real_get(key)

    monkeypatch.setattr(reader.bytes, "get", counting_get)
    for _ in range(2):
        np.testing.assert_array_equal(reader.load(ref)["w"], state["w"])
    assert downloads == [ref]
    # A new version under the same name is a new object: downloaded again.
    writer.save("r", {"w": np.zeros(3)})
    np.testing.assert_array_equal(reader.load(ref)["w"], np.zeros(3))
    assert downloads == [ref, ref]
    # A damaged cache entry is dropped and downloaded again, not reported corrupt.
    assert reader.cache is not None
    for entry in reader.cache.directory.glob("*.ckpt"):
        entry.write_bytes(entry.read_bytes()[:-3] + b"xyz")
    np.testing.assert_array_equal(reader.load(ref)["w"], np.zeros(3))
    assert downloads == [ref, ref, ref]


def test_read_cache_is_bounded(tmp_path: Path) -> None:
    from stagetree.checkpoints import ReadCache

    cache = ReadCache(tmp_path / "c", max_bytes=2500)
    for i in range(4):
        cache.put(f"{i:064x}", 1000, b"x" * 1000)
        os.utime(cache.path(f"{i:064x}", 1000), (i, i))  # older first
    assert sum(p.stat().st_size for p in (tmp_path / "c").glob("*.ckpt")) <= 2500
    assert cache.get(f"{3:064x}", 1000) is not None
    assert cache.get(f"{0:064x}", 1000) is None


def test_byte_stores_are_chosen_by_scheme(tmp_path: Path) -> None:
    from stagetree.checkpoints import (
        FsspecByteStore,
        LocalByteStore,
        byte_store_schemes,
        open_byte_store,
        register_byte_store,
    )

    assert isinstance(open_byte_store(tmp_path / "a"), LocalByteStore)
    assert isinstance(open_byte_store(str(tmp_path / "b")), LocalByteStore)
    local = open_byte_store(f"file://{tmp_path}/c")
    assert isinstance(local, LocalByteStore) and local.directory == tmp_path / "c"
    assert isinstance(open_byte_store("memory://x"), FsspecByteStore)
    assert {"file", "memory", "s3", "gs", "az"} <= set(byte_store_schemes())
    with pytest.raises(CheckpointError, match=r"unknown checkpoint URL scheme 'zz'.*s3://"):
        open_byte_store("zz://x")

    made: list[str] = []

    def factory(url: str, options: Any) -> Any:
        made.append(url)
        return LocalByteStore(tmp_path / "custom")

    register_byte_store("mine-test", factory)
    try:
        store = CheckpointStore("mine-test://anything")
        assert made == ["mine-test://anything"] and store.save("a", {}).ref == "a.ckpt"
        with pytest.raises(ValueError, match="already registered"):
            register_byte_store("mine-test", factory)
    finally:
        stores_mod._REGISTRY.pop("mine-test")


def test_an_unreachable_store_counts_checkpoints_missing(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    from conftest import free_port

    store = CheckpointStore(
        "s3://bucket/run",
        cache_dir=tmp_path,
        storage_options={
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
        },
    )
    assert store.exists("a.ckpt") is False
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint a\.ckpt"):
        store.load("a.ckpt")
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint a\.ckpt"):
        store.save("a", {"v": 1})
