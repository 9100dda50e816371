"""The checkpoint file format: container, sha256 checksum, safe loading.

A checkpoint is one object; its bytes are the same on every byte store (a local
directory, a shared mount, a bucket)::

    magic  b"STCKPT\\x00\\x01"                 8 bytes
    n      header length, little-endian u64   8 bytes
    header JSON {"format": 1, "sha256": hex, "sections": [n_skeleton, n_arrays, n_tensors],
                 "of": {"root": root_key, "node": node, "step": step}}
    body   skeleton (JSON) | numpy arrays (.npz) | torch tensors (torch.save)

The *skeleton* is the state with every array and tensor replaced by an index; it keeps
tuples, dicts with non-string keys, ``OrderedDict``, numpy scalars and non-finite
floats exactly. Arrays are read back with ``numpy.load(allow_pickle=False)`` and tensors
with ``torch.load(weights_only=True)``; torch is imported only when a state holds
tensors, so plain states save and load without torch installed. The sha256 covers the
section lengths and the body; bytes that fail it are reported as
:class:`~stagetree.exceptions.CheckpointError`, which callers treat as a missing
checkpoint (and recompute). Sections are serialised in memory (peak memory about twice
the state's size while writing).

Integrity: a checkpoint says what it is (``"of"``: the plan tree's root key, the node
and the step it was saved at), and its ref (the object's name the plan records) ends
with the first 128 bits of its sha256 (``-h<32 hex digits>.ckpt``, see
:func:`tagged_ref`). :func:`check_content` refuses bytes whose checksum is not the one
the ref names, or that say they are another point's: a file swapped for another
trial's checkpoint, a stale copy or a foreign file is a
:class:`~stagetree.exceptions.CheckpointError` (recomputed), never a result. The hash is
the one the format computes anyway, so this costs nothing. Refs without the tag (written
before it existed) are read as before, on their checksum alone.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import struct
import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from stagetree.exceptions import CheckpointError

__all__ = [
    "HEADER_BYTES",
    "NAME_RE",
    "REF_RE",
    "SUFFIX",
    "check_content",
    "check_state",
    "decode",
    "encode",
    "pack",
    "read_header",
    "read_meta",
    "tagged_ref",
]

_MAGIC = b"STCKPT\x00\x01"
_FORMAT = 1
SUFFIX = ".ckpt"
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,200}")
# A ref is a name, with the content tag (``-h`` and 32 hex digits) when it has one.
REF_RE = re.compile(r"[A-Za-z0-9_-]{1,240}\.ckpt")
_TAG_RE = re.compile(r"-h([0-9a-f]{32})\.ckpt")
# Bytes to read from the start of a checkpoint to be sure to hold its header.
HEADER_BYTES = 4096


# ---------------------------------------------------------------------- file format


def check_state(state: Any, what: str = "the state") -> None:
    """Raise :class:`~stagetree.exceptions.CheckpointError` unless ``state`` can be
    saved: a mapping made of what the format holds. The message names the first part
    that cannot be saved (``state['sched']['fn']: cannot save a function ...``). Cheap:
    it walks the state without copying or encoding anything."""
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{what} must return a dict of the training state, got {type(state).__name__}"
        )
    _to_skeleton(state, [], [], "state")


def encode(state: Mapping[str, Any], of: Mapping[str, Any] | None = None) -> list[bytes]:
    """The bytes of a checkpoint of ``state``, as parts (header first); ``of`` (what the
    checkpoint is: ``{"root": root_key, "node": node, "step": step}``) goes in its
    header.

    Raises:
        CheckpointError: ``state`` holds something the format cannot hold.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"a checkpoint state must be a mapping, got {type(state).__name__}")
    arrays: list[Any] = []
    tensors: list[Any] = []
    skeleton = _to_skeleton(state, arrays, tensors, "state")
    skel = json.dumps(skeleton, separators=(",", ":")).encode()
    arr = b""
    if arrays:
        import numpy as np

        buf = io.BytesIO()
        np.savez(buf, *arrays)
        arr = buf.getvalue()
    ten = b""
    if tensors:
        import torch

        buf = io.BytesIO()
        torch.save(tensors, buf)
        ten = buf.getvalue()
    return pack(skel, arr, ten, of)


def pack(
    skeleton: bytes, arrays: bytes, tensors: bytes, of: Mapping[str, Any] | None = None
) -> list[bytes]:
    """Header and sections of a checkpoint from its serialised sections."""
    lengths = struct.pack("<QQQ", len(skeleton), len(arrays), len(tensors))
    digest = hashlib.sha256(lengths)
    for part in (skeleton, arrays, tensors):
        digest.update(part)
    fields: dict[str, Any] = {
        "format": _FORMAT,
        "sha256": digest.hexdigest(),
        "sections": [len(skeleton), len(arrays), len(tensors)],
    }
    if of is not None:
        fields["of"] = dict(of)
    header = json.dumps(fields).encode()
    return [_MAGIC + struct.pack("<Q", len(header)) + header, skeleton, arrays, tensors]


def read_meta(prefix: bytes) -> dict[str, Any] | None:
    """The header of a checkpoint (a dict) from its first bytes, or None when ``prefix``
    is not the start of a checkpoint."""
    if len(prefix) < 16 or prefix[:8] != _MAGIC:
        return None
    (hlen,) = struct.unpack("<Q", prefix[8:16])
    if 16 + hlen > len(prefix):
        return None
    try:
        header = json.loads(prefix[16 : 16 + hlen])
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


def tagged_ref(name: str, parts: list[bytes]) -> str:
    """The ref of checkpoint ``parts`` (from :func:`encode`) saved under ``name``: the
    name, ``-h`` and the first 32 hex digits of its sha256, ``.ckpt``."""
    header = read_header(parts[0])
    if header is None:
        raise CheckpointError("not the parts of a stagetree checkpoint")
    return f"{name}-h{header[0][:32]}{SUFFIX}"


def check_content(ref: str, raw: bytes, of: Mapping[str, Any] | None = None) -> None:
    """Refuse bytes that are not the checkpoint ``ref`` names, from their header (call it
    before :func:`decode`, which verifies that the body has the header's checksum): the
    sha256 the ref's tag names, and, when ``of`` is given and the checkpoint says what it
    is, the same tree, node and step.

    Raises:
        CheckpointError: naming what does not match (a swapped, stale or foreign file).
    """
    meta = read_meta(raw) or {}
    tag = _TAG_RE.search(ref)
    if tag is not None and not str(meta.get("sha256", "")).startswith(tag.group(1)):
        raise CheckpointError(
            f"checkpoint {ref} does not hold what the plan recorded (its content hash "
            "differs): the file was replaced by another checkpoint, a stale copy or a "
            "foreign file"
        )
    said = meta.get("of")
    if of is not None and isinstance(said, dict):
        want = {k: of[k] for k in ("root", "node", "step") if k in of}
        got = {k: said.get(k) for k in want}
        if got != want:
            raise CheckpointError(
                f"checkpoint {ref} is of {got}, not of {want}: another point's checkpoint"
            )


def read_header(prefix: bytes) -> tuple[str, int] | None:
    """The sha256 and total size a checkpoint declares, from its first bytes (at least
    the magic, the length and the header: :data:`HEADER_BYTES` is enough); None when
    ``prefix`` is not the start of a checkpoint."""
    header = read_meta(prefix)
    if header is None:
        return None
    try:
        sections = [int(n) for n in header["sections"]]
        digest = str(header["sha256"])
    except (ValueError, KeyError, TypeError):
        return None
    if not re.fullmatch(r"[0-9a-f]{64}", digest) or min(sections) < 0:
        return None
    (hlen,) = struct.unpack("<Q", prefix[8:16])
    return digest, 16 + hlen + sum(sections)


def decode(raw: bytes, map_location: Any) -> Any:
    """The state held by the bytes of one checkpoint.

    Raises:
        CheckpointError: not a checkpoint, truncated, or failing its checksum.
    """
    if len(raw) < 16 or raw[:8] != _MAGIC:
        raise CheckpointError("not a stagetree checkpoint (bad magic or truncated)")
    (hlen,) = struct.unpack("<Q", raw[8:16])
    if 16 + hlen > len(raw):
        raise CheckpointError("truncated header")
    try:
        header = json.loads(raw[16 : 16 + hlen])
        n_skel, n_arr, n_ten = (int(n) for n in header["sections"])
        expected = str(header["sha256"])
        fmt = header["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable header: {exc}") from None
    if fmt != _FORMAT:
        raise CheckpointError(f"unknown format version {fmt!r}")
    body = memoryview(raw)[16 + hlen :]
    if min(n_skel, n_arr, n_ten) < 0 or len(body) != n_skel + n_arr + n_ten:
        raise CheckpointError(f"size mismatch: {len(body)} body bytes, header says otherwise")
    digest = hashlib.sha256(struct.pack("<QQQ", n_skel, n_arr, n_ten))
    digest.update(body)
    if digest.hexdigest() != expected:
        raise CheckpointError("sha256 checksum mismatch")
    try:
        return _decode_body(body, n_skel, n_arr, map_location)
    except (CheckpointError, ImportError):
        raise
    except Exception as exc:
        # Bytes that pass their checksum but do not decode (a file tampered with and
        # its checksum recomputed: torch refuses a pickle payload, ...).
        raise CheckpointError(f"cannot decode: {type(exc).__name__}: {exc}") from exc


def _decode_body(body: memoryview, n_skel: int, n_arr: int, map_location: Any) -> Any:
    skeleton = json.loads(bytes(body[:n_skel]))
    arrays: list[Any] = []
    if n_arr:
        import numpy as np

        with np.load(io.BytesIO(body[n_skel : n_skel + n_arr]), allow_pickle=False) as npz:
            arrays = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    tensors: list[Any] = []
    if len(body) > n_skel + n_arr:
        import torch

        tensors = torch.load(
            io.BytesIO(body[n_skel + n_arr :]), map_location=map_location, weights_only=True
        )
    return _from_skeleton(skeleton, arrays, tensors)


# Skeleton: JSON scalars stand for themselves; every JSON array is a tagged node
# [tag, payload], so nothing in user data can be mistaken for a tag.
_LIST, _TUPLE, _DICT, _ODICT, _ARRAY, _NPSCALAR, _TENSOR = "l", "t", "d", "o", "a", "n", "T"


def _to_skeleton(obj: Any, arrays: list[Any], tensors: list[Any], path: str) -> Any:
    kind = type(obj)
    if obj is None or kind is bool or kind is int or kind is float or kind is str:
        return obj
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(obj, numpy.ndarray):
            if obj.dtype.hasobject:
                raise CheckpointError(f"{path}: numpy arrays of dtype object cannot be saved")
            arrays.append(obj)
            return [_ARRAY, len(arrays) - 1]
        if isinstance(obj, numpy.generic):
            if obj.dtype.hasobject:
                raise CheckpointError(f"{path}: numpy object scalars cannot be saved")
            arrays.append(numpy.asarray(obj))
            return [_NPSCALAR, len(arrays) - 1]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return [_TENSOR, len(tensors) - 1]
    if isinstance(obj, Mapping):
        items = [
            [
                _to_skeleton(k, arrays, tensors, f"{path} key"),
                _to_skeleton(v, arrays, tensors, f"{path}[{k!r}]"),
            ]
            for k, v in obj.items()
        ]
        return [_ODICT if isinstance(obj, OrderedDict) else _DICT, items]
    if isinstance(obj, (list, tuple)):
        tag = _TUPLE if isinstance(obj, tuple) else _LIST
        return [tag, [_to_skeleton(v, arrays, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]]
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    raise CheckpointError(
        f"{path}: cannot save a {kind.__module__}.{kind.__qualname__}; a state may hold "
        "tensors, numpy arrays, numbers, strings, None, lists, tuples and dicts only"
    )


def _from_skeleton(node: Any, arrays: list[Any], tensors: list[Any]) -> Any:
    if not isinstance(node, list):
        return node
    tag, payload = node
    if tag in (_DICT, _ODICT):
        pairs = [
            (_from_skeleton(k, arrays, tensors), _from_skeleton(v, arrays, tensors))
            for k, v in payload
        ]
        return OrderedDict(pairs) if tag == _ODICT else dict(pairs)
    if tag == _LIST:
        return [_from_skeleton(v, arrays, tensors) for v in payload]
    if tag == _TUPLE:
        return tuple(_from_skeleton(v, arrays, tensors) for v in payload)
    if tag == _ARRAY:
        return arrays[payload]
    if tag == _NPSCALAR:
        return arrays[payload][()]
    if tag == _TENSOR:
        return tensors[payload]
    raise CheckpointError(f"unknown skeleton tag {tag!r}")
