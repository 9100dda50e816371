"""Checkpoint store: atomic writes, sha256 checksums, a byte budget with eviction.

A checkpoint is one file ``<name>.ckpt`` in the store's directory; its *ref* is that
file name. The file format is safe to load (no unrestricted pickle anywhere)::

    magic  b"STCKPT\\x00\\x01"                 8 bytes
    n      header length, little-endian u64   8 bytes
    header JSON {"format": 1, "sha256": hex, "sections": [n_skeleton, n_arrays, n_tensors]}
    body   skeleton (JSON) | numpy arrays (.npz) | torch tensors (torch.save)

The *skeleton* is the state with every array and tensor replaced by an index; it keeps
tuples, dicts with non-string keys, ``OrderedDict``, numpy scalars and non-finite
floats exactly. Arrays are read back with ``numpy.load(allow_pickle=False)`` and tensors
with ``torch.load(weights_only=True)``; torch is imported only when a state holds
tensors, so plain states save and load without torch installed. The sha256 covers the
section lengths and the body; a file that fails it is reported as
:class:`~stagetree.exceptions.CheckpointError`, which callers treat as a missing
checkpoint (and recompute).

Writes go to a temporary file in the same directory (``.<name>.<host>.<pid>.<rand>.tmp``),
are fsynced, then renamed over the final name with :func:`os.replace` (atomic), and the
directory is fsynced. Sections are serialised in memory first (peak memory about twice
the state's size while writing). A writer that crashes leaves at most a temporary file, which is
never listed and is removed by the next store opened on the directory once its writer
process is gone.

Eviction (:meth:`CheckpointStore.evict`) follows the cost-benefit rule of Nectar and of
the Hippo/TreeML thesis: the value of keeping a checkpoint is
``recompute_cost * pending_refs / size``; the lowest-valued go first, and a checkpoint
a pending request needs is never evicted.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import socket
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagetree.exceptions import CheckpointError

__all__ = ["CheckpointInfo", "CheckpointStore", "EvictionInfo", "check_state"]

_MAGIC = b"STCKPT\x00\x01"
_FORMAT = 1
_SUFFIX = ".ckpt"
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,200}")
_REF_RE = re.compile(r"[A-Za-z0-9_-]{1,200}\.ckpt")
# A temporary file from another host is removed once it is this old.
_STALE_SECONDS = 3600.0


@dataclass(frozen=True)
class CheckpointInfo:
    """Result of :meth:`CheckpointStore.save`.

    Attributes:
        ref: what :meth:`CheckpointStore.load` takes back (the file name).
        nbytes: size of the file.
        seconds: time spent encoding, writing and syncing it.
    """

    ref: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class EvictionInfo:
    """What eviction knows of one checkpoint.

    Attributes:
        recompute_cost: estimated seconds to recompute it from the nearest checkpoint
            that would remain.
        pending_refs: number of pending requests that would start from it.
    """

    recompute_cost: float
    pending_refs: int


class CheckpointStore:
    """Checkpoints as files in one directory, shared safely by many processes.

    Args:
        directory: where checkpoints live; created if missing.
        budget_bytes: byte budget enforced by :meth:`evict`; None for no budget.
    """

    def __init__(self, directory: str | os.PathLike[str], budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {exc}"
            ) from exc
        self.cleanup()

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r}, budget_bytes={self.budget_bytes})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Cheap to send to worker processes: they reopen the directory.
        return (CheckpointStore, (str(self.directory), self.budget_bytes))

    # ------------------------------------------------------------------ write / read

    def save(self, name: str, state: Mapping[str, Any]) -> CheckpointInfo:
        """Write ``state`` durably under ``name`` (replacing a checkpoint of that name).

        Args:
            name: letters, digits, ``_`` and ``-`` (at most 200).
            state: tensors, numpy arrays and scalars, numbers, strings, None, lists,
                tuples and dicts of those.

        Returns:
            The ref, size and write time.

        Raises:
            CheckpointError: unsupported content or a failed write; nothing is left behind.
        """
        if not _NAME_RE.fullmatch(name):
            raise CheckpointError(f"invalid checkpoint name {name!r}: use [A-Za-z0-9_-]")
        begin = time.perf_counter()
        data = _encode(state)
        ref = name + _SUFFIX
        final = self.directory / ref
        tmp = self.directory / f".{name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                for part in data:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, Exception):
                raise CheckpointError(f"cannot write checkpoint {ref}: {exc}") from exc
            raise
        nbytes = sum(len(part) for part in data)
        return CheckpointInfo(ref, nbytes, time.perf_counter() - begin)

    def load(self, ref: str, map_location: Any = "cpu") -> dict[str, Any]:
        """Read and verify a checkpoint.

        Args:
            ref: a ref returned by :meth:`save`.
            map_location: where tensors go (``torch.load``'s argument); CPU by default,
                so a checkpoint written on a GPU loads anywhere.

        Raises:
            CheckpointError: missing, truncated, failing its checksum, or unsafe content.
        """
        path = self._path(ref)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {ref} does not exist in {self.directory}") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {ref}: {exc}") from exc
        try:
            state = _decode(raw, map_location)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {ref} is corrupt: {exc}") from None
        except Exception as exc:
            raise CheckpointError(f"checkpoint {ref} cannot be decoded: {exc}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {ref} does not hold a dict")
        return state

    # ------------------------------------------------------------------ bookkeeping

    def exists(self, ref: str) -> bool:
        """Whether a checkpoint file ``ref`` is present (its content is not verified)."""
        return self._path(ref).is_file()

    def delete(self, ref: str) -> bool:
        """Remove a checkpoint; returns False when it was already gone."""
        try:
            self._path(ref).unlink()
        except FileNotFoundError:
            return False
        return True

    def refs(self) -> list[str]:
        """Refs of every complete checkpoint, sorted (temporary files are not listed)."""
        return sorted(self._sizes())

    def size(self, ref: str) -> int:
        """Size in bytes of checkpoint ``ref``."""
        try:
            return self._path(ref).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {ref} does not exist in {self.directory}") from None

    def total_bytes(self) -> int:
        """Bytes held by complete checkpoints."""
        return sum(self._sizes().values())

    def cleanup(self) -> list[str]:
        """Remove temporary files left by writers that died; returns their names.

        A temporary file is removed when its writer (same host) is no longer running,
        or, from another host, when it is older than an hour.
        """
        removed: list[str] = []
        host, me, now = _host(), os.getpid(), time.time()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return removed
        for entry in entries:
            parts = entry.name.split(".")
            if len(parts) != 6 or parts[0] or parts[5] != "tmp" or not parts[3].isdigit():
                continue
            pid = int(parts[3])
            if parts[2] == host:
                stale = pid != me and not _pid_alive(pid)
            else:
                try:
                    stale = now - entry.stat().st_mtime > _STALE_SECONDS
                except FileNotFoundError:
                    continue
            if stale:
                try:
                    os.unlink(entry.path)
                    removed.append(entry.name)
                except FileNotFoundError:
                    pass
        return removed

    def evict(self, candidates: Mapping[str, EvictionInfo], needed: set[str]) -> list[str]:
        """Delete checkpoints until the store fits its budget.

        Only refs in ``candidates`` may go, lowest value first, where value =
        ``recompute_cost * pending_refs / size`` (ties: larger first, then by ref);
        a ref in ``needed`` is never deleted. Stops as soon as the total fits.

        Args:
            candidates: evictable refs and what they are worth.
            needed: refs that pending requests start from.

        Returns:
            The deleted refs, in deletion order (empty without a budget).
        """
        if self.budget_bytes is None:
            return []
        sizes = self._sizes()
        total = sum(sizes.values())
        if total <= self.budget_bytes:
            return []

        def key(ref: str) -> tuple[float, int, str]:
            info, size = candidates[ref], sizes[ref]
            return (info.recompute_cost * info.pending_refs / max(size, 1), -size, ref)

        order = sorted((r for r in candidates if r in sizes and r not in needed), key=key)
        evicted: list[str] = []
        for ref in order:
            if total <= self.budget_bytes:
                break
            if self.delete(ref):
                evicted.append(ref)
            total -= sizes[ref]
        return evicted

    # ------------------------------------------------------------------ internals

    def _path(self, ref: str) -> Path:
        if not isinstance(ref, str) or not _REF_RE.fullmatch(ref):
            raise CheckpointError(f"invalid checkpoint ref {ref!r}")
        return self.directory / ref

    def _sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return sizes
        for entry in entries:
            if _REF_RE.fullmatch(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    sizes[entry.name] = entry.stat().st_size
        return sizes


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


def _encode(state: Mapping[str, Any]) -> list[bytes]:
    """The file's bytes, as parts (header first)."""
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
    return _pack(skel, arr, ten)


def _pack(skeleton: bytes, arrays: bytes, tensors: bytes) -> list[bytes]:
    lengths = struct.pack("<QQQ", len(skeleton), len(arrays), len(tensors))
    digest = hashlib.sha256(lengths)
    for part in (skeleton, arrays, tensors):
        digest.update(part)
    header = json.dumps(
        {
            "format": _FORMAT,
            "sha256": digest.hexdigest(),
            "sections": [len(skeleton), len(arrays), len(tensors)],
        }
    ).encode()
    return [_MAGIC + struct.pack("<Q", len(header)) + header, skeleton, arrays, tensors]


def _decode(raw: bytes, map_location: Any) -> Any:
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


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:60] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
