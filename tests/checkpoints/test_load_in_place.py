"""A checkpoint read into a buffer of its own is decoded in place: its raw tensors view
that buffer (no second copy of the raw section), and every load is still independent."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from stagetree.checkpoints.format import decode, encode  # noqa: E402
from stagetree.checkpoints.store import CheckpointStore  # noqa: E402
from stagetree.checkpoints.stores import LocalByteStore  # noqa: E402


def _state() -> dict:
    return {
        "w": torch.arange(1000, dtype=torch.float32).reshape(10, 100),
        "b": torch.ones(7, dtype=torch.float64),
        "step": 3,
    }


def _inside(tensor: object, buffer: bytearray) -> bool:
    start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    ptr = tensor.data_ptr()  # type: ignore[attr-defined]
    return start <= ptr < start + len(buffer)


def test_decode_of_a_bytearray_views_it() -> None:
    buffer = bytearray(b"".join(bytes(p) for p in encode(_state())))
    state = decode(buffer, "cpu")
    assert _inside(state["w"], buffer) and _inside(state["b"], buffer)
    torch.testing.assert_close(state["w"], _state()["w"])
    torch.testing.assert_close(state["b"], _state()["b"])
    assert state["step"] == 3


def test_decode_of_bytes_copies_once_and_is_writable() -> None:
    raw = b"".join(bytes(p) for p in encode(_state()))
    state = decode(raw, "cpu")
    state["w"].add_(1.0)  # writable: its own copy, not the caller's bytes
    torch.testing.assert_close(decode(raw, "cpu")["w"], _state()["w"])


def test_local_get_writable_is_the_file(tmp_path: Path) -> None:
    store = LocalByteStore(tmp_path)
    store.put("k.ckpt", [b"abc", b"", b"defgh"])
    got = store.get_writable("k.ckpt")
    assert isinstance(got, bytearray) and got == bytearray(b"abcdefgh")
    with pytest.raises(FileNotFoundError):
        store.get_writable("missing.ckpt")


def test_loads_are_independent(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    ref = store.save("a", _state(), {"root": "r", "node": 1, "step": 3}).ref
    first = store.load(ref, of={"node": 1, "step": 3})
    first["w"].mul_(0.0)
    second = store.load(ref)
    torch.testing.assert_close(second["w"], _state()["w"])
    assert first["w"].data_ptr() != second["w"].data_ptr()
