"""The checkpoint file format: container, sha256 checksum, safe loading.

A checkpoint is one object; its bytes are the same on every byte store (a local
directory, a shared mount, a bucket)::

    magic  b"STCKPT\\x00\\x01"                 8 bytes
    n      header length, little-endian u64   8 bytes
    header JSON {"format": 2, "sha256": hex,
                 "sections": [n_skeleton, n_arrays, n_tensors, n_raw],
                 "of": {"root": root_key, "node": node, "step": step}}
    body   skeleton (JSON) | numpy arrays (.npz) | torch tensors (torch.save) | raw tensors

The *skeleton* is the state with every array and tensor replaced by an index; it keeps
tuples, dicts with non-string keys, ``OrderedDict``, numpy scalars and non-finite
floats exactly. Dense tensors of the usual dtypes on the CPU or a CUDA device are *raw*:
their bytes, 64-byte aligned, with dtype, shape, device and offset in the skeleton, read
back as views of one buffer (``torch.frombuffer``): loading a checkpoint costs about
what reading and hashing its bytes costs (``torch.load`` of the same tensors, even
with ``weights_only``, cost about 10x more for a small model). Other tensors (sparse,
quantized, other devices or dtypes) go to the ``torch.save`` section, read back with
``torch.load(weights_only=True)``; arrays are read back with
``numpy.load(allow_pickle=False)``. Nothing in a checkpoint is unpickled beyond what
those two allow. torch is imported only when a state holds tensors, so plain states save
and load without torch installed. Format 1 (no raw section) is still read. The sha256
covers the section lengths and the body; bytes that fail it are reported as
:class:`~stagetree.exceptions.CheckpointError`, which callers treat as a missing
checkpoint (and recompute). Sections are serialised in memory, except the raw tensors:
their parts are views of the tensors' own memory (on the CPU), written as they are, so
that a save copies a state's raw tensors once, into the file.

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
import math
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
_FORMAT = 2
_FORMATS = (1, 2)  # the formats read; 1 has no raw section
# Raw tensors start at multiples of this (aligned views for vectorised kernels).
_ALIGN = 64
# dtype name -> (torch dtype attribute); the dtypes torch.frombuffer reads.
_RAW_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64",
    "int64", "int32", "int16", "int8", "uint8", "bool",
)  # fmt: skip
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
    header. The parts of its raw tensors are views of the memory of ``state``'s CPU
    tensors: write them before ``state`` changes.

    Raises:
        CheckpointError: ``state`` holds something the format cannot hold.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"a checkpoint state must be a mapping, got {type(state).__name__}")
    arrays: list[Any] = []
    tensors: list[Any] = []
    raw: list[Any] = []
    skeleton = _to_skeleton(state, arrays, tensors, "state", raw)
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
    return pack(skel, arr, ten, _raw_section(raw), of)


def _raw_section(raw: list[Any]) -> list[bytes]:
    """The raw tensors' bytes at the offsets their skeleton nodes say (see
    :func:`_raw_node`), as parts: zero padding, and views of each tensor's memory (no
    copy; a view keeps its tensor alive)."""
    parts: list[Any] = []
    at = 0
    for tensor, offset in raw:
        nbytes = tensor.numel() * tensor.element_size()
        if offset > at:
            parts.append(bytes(offset - at))
            at = offset
        if nbytes:
            parts.append(memoryview(tensor.reshape(-1).view(_torch().uint8).numpy()).cast("B"))
            at += nbytes
    return parts


def pack(
    skeleton: bytes,
    arrays: bytes,
    tensors: bytes,
    raw: bytes | list[bytes] | None = None,
    of: Mapping[str, Any] | None = None,
) -> list[bytes]:
    """Header and sections of a checkpoint from its serialised sections (format 1 when
    ``raw`` is None, else 2; the raw section may come in parts); ``of`` names the tree,
    node and step it holds. Returns the header, then the sections' parts."""
    sections: list[list[bytes]] = [[skeleton], [arrays], [tensors]]
    if raw is not None:
        sections.append([raw] if isinstance(raw, bytes) else raw)
    sizes = [sum(len(p) for p in section) for section in sections]
    digest = hashlib.sha256(struct.pack(f"<{len(sizes)}Q", *sizes))
    for section in sections:
        for part in section:
            digest.update(part)
    fields: dict[str, Any] = {
        "format": 1 if raw is None else _FORMAT,
        "sha256": digest.hexdigest(),
        "sections": sizes,
    }
    if of is not None:
        fields["of"] = dict(of)
    header = json.dumps(fields).encode()
    return [_MAGIC + struct.pack("<Q", len(header)) + header, *(p for s in sections for p in s)]


def read_meta(prefix: bytes | bytearray) -> dict[str, Any] | None:
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


def check_content(ref: str, raw: bytes | bytearray, of: Mapping[str, Any] | None = None) -> None:
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


def decode(raw: bytes | bytearray, map_location: Any) -> Any:
    """The state held by the bytes of one checkpoint.

    The raw tensors of a checkpoint given in a ``bytearray`` are views of its memory
    (no copy): the caller hands the buffer over and must not change or reuse it. Of
    ``bytes``, they view one writable copy of their section.

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
        sections = [int(n) for n in header["sections"]]
        expected = str(header["sha256"])
        fmt = header["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable header: {exc}") from None
    if fmt not in _FORMATS:
        raise CheckpointError(f"unknown format version {fmt!r}")
    if len(sections) != (3 if fmt == 1 else 4):
        raise CheckpointError(f"format {fmt} with {len(sections)} sections")
    n_skel, n_arr, n_ten = sections[:3]
    body = memoryview(raw)[16 + hlen :]
    if min(sections) < 0 or len(body) != sum(sections):
        raise CheckpointError(f"size mismatch: {len(body)} body bytes, header says otherwise")
    digest = hashlib.sha256(struct.pack(f"<{len(sections)}Q", *sections))
    digest.update(body)
    if digest.hexdigest() != expected:
        raise CheckpointError("sha256 checksum mismatch")
    try:
        return _decode_body(body, (n_skel, n_arr, n_ten), fmt, map_location)
    except (CheckpointError, ImportError):
        raise
    except Exception as exc:
        # Bytes that pass their checksum but do not decode (a file tampered with and
        # its checksum recomputed: torch refuses a pickle payload, ...).
        raise CheckpointError(f"cannot decode: {type(exc).__name__}: {exc}") from exc


def _decode_body(
    body: memoryview, lengths: tuple[int, int, int], fmt: int, map_location: Any
) -> Any:
    """The state from a verified body: skeleton, arrays, torch-saved and raw tensors."""
    n_skel, n_arr, n_ten = lengths
    skeleton = json.loads(bytes(body[:n_skel]))
    arrays: list[Any] = []
    if n_arr:
        import numpy as np

        with np.load(io.BytesIO(body[n_skel : n_skel + n_arr]), allow_pickle=False) as npz:
            arrays = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    tensors: list[Any] = []
    if n_ten:
        import torch

        tensors = torch.load(
            io.BytesIO(body[n_skel + n_arr : n_skel + n_arr + n_ten]),
            map_location=map_location,
            weights_only=True,
        )
    # The raw section, which its tensors view (no copy each): in place in a writable
    # buffer handed over by the caller, else one writable copy.
    buffer: bytearray | memoryview = bytearray()
    if fmt != 1:
        section = body[n_skel + n_arr + n_ten :]
        buffer = section if not section.readonly else bytearray(section)
    return _from_skeleton(skeleton, arrays, tensors, (buffer, map_location))


def _torch() -> Any:
    import torch

    return torch


def _raw_node(tensor: Any, raw: list[Any]) -> list[Any] | None:
    """The skeleton node of a tensor stored raw, with the tensor (dense, contiguous, on
    the CPU) and its offset appended to ``raw``; None when it is not stored raw."""
    torch = _torch()
    device = tensor.device.type
    name = str(tensor.dtype).removeprefix("torch.")
    if (
        device not in ("cpu", "cuda")
        or name not in _RAW_DTYPES
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or getattr(tensor, "is_nested", False)
        or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
    ):
        return None
    flat = tensor.resolve_conj().resolve_neg().contiguous().cpu()
    offset = 0
    if raw:
        last, at = raw[-1]
        offset = -(-(at + last.numel() * last.element_size()) // _ALIGN) * _ALIGN
    raw.append((flat, offset))
    where = str(tensor.device)
    return [_RAW, [name, list(tensor.shape), offset, where]]


def _raw_tensor(payload: list[Any], raw: tuple[bytearray | memoryview, Any]) -> Any:
    torch = _torch()
    buffer, map_location = raw
    name, shape, offset, where = payload
    if name not in _RAW_DTYPES:
        raise CheckpointError(f"unknown raw tensor dtype {name!r}")
    dtype = getattr(torch, name)
    count = math.prod(shape)
    if count == 0:
        tensor = torch.empty(shape, dtype=dtype)
    elif offset < 0 or offset + count * dtype.itemsize > len(buffer):
        raise CheckpointError("a raw tensor lies outside its section")
    else:
        tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    return _placed(tensor, str(where), map_location)


def _placed(tensor: Any, where: str, map_location: Any) -> Any:
    """A raw tensor (read on the CPU, saved on device ``where``) where ``torch.load``
    would put it with ``map_location``."""
    if isinstance(map_location, str) and map_location == "cpu":
        return tensor
    torch = _torch()
    if map_location is None:
        target: Any = where
    elif isinstance(map_location, dict):
        target = map_location.get(where, where)
    elif callable(map_location):
        storage = map_location(tensor.untyped_storage(), where)
        if storage is None:
            return tensor.to(where)
        out = torch.empty(0, dtype=tensor.dtype, device=storage.device)
        return out.set_(storage, 0, tensor.shape)
    else:
        target = map_location
    return tensor.to(target)


# Skeleton: JSON scalars stand for themselves; every JSON array is a tagged node
# [tag, payload], so nothing in user data can be mistaken for a tag.
_LIST, _TUPLE, _DICT, _ODICT, _ARRAY, _NPSCALAR, _TENSOR = "l", "t", "d", "o", "a", "n", "T"
_RAW = "R"


def _to_skeleton(
    obj: Any, arrays: list[Any], tensors: list[Any], path: str, raw: list[Any] | None = None
) -> Any:
    """The skeleton of ``obj``, its arrays appended to ``arrays`` and its tensors to
    ``tensors``, or to ``raw`` where they can be stored raw (``raw`` None: none is)."""
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
        node = _raw_node(obj.detach(), raw) if raw is not None else None
        if node is not None:
            return node
        tensors.append(obj.detach())
        return [_TENSOR, len(tensors) - 1]
    if isinstance(obj, Mapping):
        items = [
            [
                _to_skeleton(k, arrays, tensors, f"{path} key", raw),
                _to_skeleton(v, arrays, tensors, f"{path}[{k!r}]", raw),
            ]
            for k, v in obj.items()
        ]
        return [_ODICT if isinstance(obj, OrderedDict) else _DICT, items]
    if isinstance(obj, (list, tuple)):
        tag = _TUPLE if isinstance(obj, tuple) else _LIST
        return [
            tag,
            [_to_skeleton(v, arrays, tensors, f"{path}[{i}]", raw) for i, v in enumerate(obj)],
        ]
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


def _from_skeleton(
    node: Any, arrays: list[Any], tensors: list[Any], raw: tuple[bytearray | memoryview, Any]
) -> Any:
    if not isinstance(node, list):
        return node
    tag, payload = node
    if tag in (_DICT, _ODICT):
        pairs = [
            (_from_skeleton(k, arrays, tensors, raw), _from_skeleton(v, arrays, tensors, raw))
            for k, v in payload
        ]
        return OrderedDict(pairs) if tag == _ODICT else dict(pairs)
    if tag == _LIST:
        return [_from_skeleton(v, arrays, tensors, raw) for v in payload]
    if tag == _TUPLE:
        return tuple(_from_skeleton(v, arrays, tensors, raw) for v in payload)
    if tag == _ARRAY:
        return arrays[payload]
    if tag == _NPSCALAR:
        return arrays[payload][()]
    if tag == _TENSOR:
        return tensors[payload]
    if tag == _RAW:
        return _raw_tensor(payload, raw)
    raise CheckpointError(f"unknown skeleton tag {tag!r}")
