"""The checkpoint store: the checkpoint format on a byte store, a byte budget with
eviction, and a local read cache for remote stores.

A checkpoint is one object ``<name>-h<hash>.ckpt`` (its *ref*) in the store's location, in the
format of :mod:`stagetree.checkpoints.format`. :meth:`CheckpointStore.save` returns
only once the object is durable (see :class:`~stagetree.checkpoints.stores.BaseByteStore`:
rename after fsync on a file system, a single-object put on an object store), so a
checkpoint the engine records in the plan is always complete. A missing object, or one
that fails its checksum, raises :class:`~stagetree.exceptions.CheckpointError`, which
callers treat as a missing checkpoint (and recompute). A ref names its content (the
first 128 bits of its sha256), and a checkpoint says what it is (tree, node, step):
:meth:`CheckpointStore.load` refuses an object that is not the one the ref names (see
:func:`~stagetree.checkpoints.format.check_content`).

Outages: on a remote store, a write or read that fails for another reason than a
missing object or a refused access (the endpoint unreachable, a connection reset, a
5xx answer) is tried again with exponential backoff for the ride-through window
(``retry_seconds``, else ``STAGETREE_STORE_RETRY_SECONDS``, 30 by default; see
:mod:`stagetree.retry`). Past it a write raises ``CheckpointError`` and a read
:class:`~stagetree.exceptions.CheckpointUnreachableError`: the object may still
exist, so the plan keeps its record (only a missing or corrupt object is dropped).

Read cache: a remote store (anything but a local path) keeps the checkpoints it loads
and saves in a local directory, content-addressed by the sha256 and size the
checkpoint's header declares, bounded by ``cache_bytes`` (least recently used go
first). A load reads the first few KiB of the object to learn its sha256; on a hit the
rest comes from local disk and is verified like any checkpoint. So a worker (or every
worker of one machine: they share the directory) that loads the same checkpoint twice
downloads it once.

Eviction (:meth:`CheckpointStore.evict`) follows the cost-benefit rule of Nectar and of
the Hippo/TreeML thesis: the value of keeping a checkpoint is
``recompute_cost * pending_refs / size``; the lowest-valued go first, and a checkpoint
a pending request needs is never evicted. It works on every byte store (it lists
objects with their sizes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagetree.checkpoints.format import (
    HEADER_BYTES,
    NAME_RE,
    REF_RE,
    SUFFIX,
    check_content,
    decode,
    encode,
    read_header,
    tagged_ref,
)
from stagetree.checkpoints.stores import BaseByteStore, LocalByteStore, open_byte_store
from stagetree.exceptions import CheckpointError, CheckpointUnreachableError
from stagetree.retry import STORE_RETRY_ENV, Outage, RideThrough, window_from_env

__all__ = ["CheckpointInfo", "CheckpointStore", "EvictionInfo", "ReadCache", "eviction_order"]

logger = logging.getLogger("stagetree")

#: Default bound of the read cache of a remote store.
DEFAULT_CACHE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class CheckpointInfo:
    """Result of :meth:`CheckpointStore.save`.

    Attributes:
        ref: what :meth:`CheckpointStore.load` takes back (the object's name).
        nbytes: size of the object.
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


def eviction_order(
    candidates: Mapping[str, EvictionInfo],
    sizes: Mapping[str, int],
    needed: set[str],
    budget_bytes: int,
) -> list[str]:
    """The checkpoints to delete so that ``sizes`` (every checkpoint of the store: ref
    -> bytes) fits ``budget_bytes``, in deletion order: the cost-benefit rule of
    :meth:`CheckpointStore.evict`, without I/O (``stagetree.checkpoints.eviction`` applies it
    to the plan and the store in a crash-safe order).

    Only refs in ``candidates`` that the store holds and that are not ``needed`` may go,
    lowest ``recompute_cost * pending_refs / size`` first (ties: larger first, then by
    ref); the list stops as soon as the rest fits (it is empty when everything fits).
    """
    total = sum(sizes.values())
    if total <= budget_bytes:
        return []

    def key(ref: str) -> tuple[float, int, str]:
        info, size = candidates[ref], sizes[ref]
        return (info.recompute_cost * info.pending_refs / max(size, 1), -size, ref)

    order = sorted((r for r in candidates if r in sizes and r not in needed), key=key)
    out: list[str] = []
    for ref in order:
        if total <= budget_bytes:
            break
        out.append(ref)
        total -= sizes[ref]
    return out


def default_cache_dir() -> Path:
    """``$STAGETREE_CACHE_DIR``, else ``$XDG_CACHE_HOME/stagetree/checkpoints`` (``~/.cache``
    without it)."""
    env = os.environ.get("STAGETREE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stagetree" / "checkpoints"


class ReadCache:
    """Checkpoint bytes on local disk, named by content (``<sha256>-<size>.ckpt``),
    bounded by ``max_bytes`` (least recently used first out). Safe to share between
    processes: entries are written to a temporary file and renamed; a damaged entry is
    caught by the checkpoint's checksum and dropped by its reader.

    Args:
        directory: created on first write.
        max_bytes: bound of the directory's size.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes

    def path(self, digest: str, size: int) -> Path:
        return self.directory / f"{digest}-{size}{SUFFIX}"

    def get(self, digest: str, size: int) -> bytes | None:
        path = self.path(digest, size)
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used
        return raw

    def drop(self, digest: str, size: int) -> None:
        with contextlib.suppress(OSError):
            self.path(digest, size).unlink()

    def put(self, digest: str, size: int, parts: list[bytes] | bytes) -> None:
        """Keep an entry (best effort: a full or read-only disk only costs a download)."""
        if size > self.max_bytes:
            return
        path = self.path(digest, size)
        if path.exists():
            return
        tmp = self.directory / f".{digest}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                for part in [parts] if isinstance(parts, bytes) else parts:
                    f.write(part)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        self._trim()

    def _trim(self) -> None:
        entries: list[tuple[float, int, str]] = []
        try:
            scan = list(os.scandir(self.directory))
        except OSError:
            return
        for entry in scan:
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
            total -= size


class CheckpointStore:
    """Checkpoints on a byte store, shared safely by many processes (and machines, on a
    shared mount or a bucket).

    Args:
        location: a directory (path or ``file:///dir``), a URL of any fsspec protocol
            (``s3://bucket/prefix``, ``gs://...``, ``az://...``, with the protocol's
            package installed), or a :class:`~stagetree.checkpoints.stores.BaseByteStore`.
        budget_bytes: byte budget enforced by :meth:`evict`; None for no budget.
        cache_dir: read cache of a remote store (default :func:`default_cache_dir`);
            a local directory is never cached.
        cache_bytes: bound of the read cache; 0 turns it off.
        storage_options: fsspec options of a URL (credentials, ``client_kwargs``...).
        retry_seconds: the ride-through window of a remote store (see the module
            docstring); None: ``STAGETREE_STORE_RETRY_SECONDS``, else 30; 0: no retry.

    Raises:
        CheckpointError: an unknown URL scheme, a missing fsspec package, or a local
            directory that cannot be created. Nothing is contacted over the network
            here; :meth:`check` does that.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | BaseByteStore,
        budget_bytes: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        storage_options: Mapping[str, Any] | None = None,
        retry_seconds: float | None = None,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        if isinstance(location, BaseByteStore):
            self.bytes = location
        else:
            self.bytes = open_byte_store(location, storage_options)
        self.budget_bytes = budget_bytes
        self.retry_seconds = retry_seconds
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.cache_bytes = cache_bytes
        self.cache: ReadCache | None = None
        if not self.bytes.is_local and cache_bytes > 0:
            self.cache = ReadCache(self.cache_dir or default_cache_dir(), cache_bytes)
        if self.bytes.is_local:
            self.cleanup()  # cheap on a local directory; a remote one in check()

    @property
    def location(self) -> str:
        """The store's location (a path or a URL)."""
        return self.bytes.url

    @property
    def directory(self) -> Path:
        """The directory of a store on a local (or mounted) file system.

        Raises:
            CheckpointError: the store is not on a local file system.
        """
        if isinstance(self.bytes, LocalByteStore):
            return self.bytes.directory
        raise CheckpointError(f"checkpoint store {self.location} is not a local directory")

    def __repr__(self) -> str:
        return f"CheckpointStore({self.location!r}, budget_bytes={self.budget_bytes})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Cheap to send to worker processes and Ray actors: they reopen the location.
        return (
            CheckpointStore,
            (
                self.bytes,
                self.budget_bytes,
                self.cache_dir,
                self.cache_bytes,
                None,
                self.retry_seconds,
            ),
        )

    def check(self, ride_through: bool = False) -> None:
        """Prove the location reachable and writable now (write, read back and delete a
        small marker), so that a study fails at its start rather than at its first
        checkpoint. With ``ride_through`` (a location proven before: an engine made
        again during a run), an outage of a remote store is waited out for the
        ride-through window, as the store's writes do.

        Raises:
            CheckpointError: naming the location and the cause (no such bucket, nobody
                listening at the endpoint, access denied...).
        """
        if not ride_through:
            self.bytes.check()
            return

        def failed(exc: Exception) -> CheckpointError:
            return exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))

        self._riding(self.bytes.check, failed, lambda note, exc: CheckpointError(f"{exc} ({note})"))

    # ------------------------------------------------------------------ write / read

    def save(
        self, name: str, state: Mapping[str, Any], of: Mapping[str, Any] | None = None
    ) -> CheckpointInfo:
        """Write ``state`` durably under ``name``: the ref is ``<name>.ckpt``, or with
        ``of``, ``<name>-h<first 32 hex digits of its sha256>.ckpt`` (a ref that names
        its content, so that a plan recording it can tell its file from any other).

        Args:
            name: letters, digits, ``_`` and ``-`` (at most 200); a name saved again
                without ``of`` replaces the checkpoint of that name.
            state: tensors, numpy arrays and scalars, numbers, strings, None, lists,
                tuples and dicts of those.
            of: what the checkpoint is (``{"root": root_key, "node": node, "step":
                step}``), kept in its header and checked by :meth:`load`.

        Returns:
            The ref, size and write time; the checkpoint is durable when it returns.

        Raises:
            CheckpointError: unsupported content or a failed write; nothing is left behind.
        """
        if not NAME_RE.fullmatch(name):
            raise CheckpointError(f"invalid checkpoint name {name!r}: use [A-Za-z0-9_-]")
        begin = time.perf_counter()
        data = encode(state, of)
        ref = name + SUFFIX if of is None else tagged_ref(name, data)
        try:
            self._riding(
                lambda: self.bytes.put(ref, data),
                lambda exc: CheckpointError(f"cannot write checkpoint {ref}: {exc}"),
                lambda note, exc: CheckpointError(f"cannot write checkpoint {ref}: {note}: {exc}"),
            )
        except FileNotFoundError as exc:  # no such bucket or directory
            raise CheckpointError(f"cannot write checkpoint {ref}: {exc}") from exc

        nbytes = sum(len(part) for part in data)
        if self.cache is not None:
            header = read_header(data[0])
            if header is not None:
                self.cache.put(header[0], header[1], data)
        return CheckpointInfo(ref, nbytes, time.perf_counter() - begin)

    def load(
        self, ref: str, map_location: Any = "cpu", of: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Read and verify a checkpoint.

        Args:
            ref: a ref returned by :meth:`save`.
            map_location: where tensors go (``torch.load``'s argument); CPU by default,
                so a checkpoint written on a GPU loads anywhere.
            of: what the caller expects it to be (``root``, ``node``, ``step``).

        Raises:
            CheckpointError: missing, truncated, failing its checksum, unsafe content,
                or not the checkpoint ``ref`` and ``of`` name (swapped, stale, foreign).
        """
        self._check_ref(ref)
        if self.cache is not None:
            hit = self._cached(ref)
            if hit is not None:
                try:
                    return self._decode(ref, hit[1], map_location, of)
                except CheckpointError:
                    self.cache.drop(*hit[0])  # a damaged cache entry: download
        if self.cache is None:
            # Read into a buffer of its own that the raw tensors then view in place.
            buffer = self._read(ref, lambda: self.bytes.get_writable(ref), writable=True)
            return self._decode(ref, buffer, map_location, of)
        raw = self._read(ref, lambda: self.bytes.get(ref))
        state = self._decode(ref, raw, map_location, of)
        header = read_header(raw[:HEADER_BYTES])
        if header is not None and header[1] == len(raw):
            self.cache.put(header[0], header[1], raw)  # verified bytes only
        return state

    def _cached(self, ref: str) -> tuple[tuple[str, int], bytes] | None:
        """The header and bytes of ``ref`` from the read cache, or None (a miss)."""
        assert self.cache is not None
        prefix = self._read(ref, lambda: self.bytes.get_prefix(ref, HEADER_BYTES))
        header = read_header(prefix)
        if header is None:
            return None
        raw = self.cache.get(*header)
        if raw is not None and len(raw) == header[1] and raw[: len(prefix)] == prefix:
            return header, raw
        if raw is not None:
            self.cache.drop(*header)
        return None

    def _read(self, ref: str, read: Callable[[], Any], writable: bool = False) -> Any:
        """``read()``'s bytes (``writable``: the ``bytearray`` it returned)."""
        try:
            data = self._riding(
                read,
                lambda exc: CheckpointError(f"cannot read checkpoint {ref}: {exc}"),
                lambda note, exc: CheckpointUnreachableError(
                    f"cannot read checkpoint {ref}: {self.location} {note}: {exc}"
                ),
            )
            if writable:
                return data if isinstance(data, bytearray) else bytearray(data)
            return bytes(data)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {ref} does not exist in {self.location}") from None

    def _riding(
        self,
        call: Callable[[], Any],
        failed: Callable[[Exception], CheckpointError],
        outage: Callable[[str, Exception], CheckpointError],
    ) -> Any:
        """``call()`` on the byte store. On a remote store an error other than a
        missing object (``FileNotFoundError``, raised as it is), a refused access or a
        bad argument is an outage: retried for the ride-through window, then
        ``outage(note, error)`` is raised; any other error raises ``failed(error)``."""
        window = (
            window_from_env(STORE_RETRY_ENV) if self.retry_seconds is None else self.retry_seconds
        )

        def once() -> Any:
            try:
                return call()
            except FileNotFoundError:
                raise
            except Exception as exc:
                if self.bytes.is_local or isinstance(exc, (PermissionError, ValueError, TypeError)):
                    raise failed(exc) from exc
                error = exc  # the name ``exc`` ends with this block
                raise Outage(str(exc), lambda note: outage(note, error)) from exc

        return RideThrough(
            max(0.0, window), f"checkpoint store {self.location}", STORE_RETRY_ENV
        ).call(once)

    def _decode(
        self,
        ref: str,
        raw: bytes | bytearray,
        map_location: Any,
        of: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        check_content(ref, raw, of)  # before decoding: a wrong file is never decoded
        try:
            state = decode(raw, map_location)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {ref} is corrupt: {exc}") from None
        except Exception as exc:
            raise CheckpointError(f"checkpoint {ref} cannot be decoded: {exc}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {ref} does not hold a dict")
        return state

    # ------------------------------------------------------------------ bookkeeping

    def exists(self, ref: str) -> bool:
        """Whether a checkpoint ``ref`` is present (its content is not verified). A store
        that cannot be reached answers False (logged): the checkpoint counts as missing,
        like a corrupt one, and its steps are recomputed."""
        self._check_ref(ref)
        try:
            return self.bytes.exists(ref)
        except Exception as exc:
            logger.warning("cannot reach checkpoint %s in %s: %s", ref, self.location, exc)
            return False

    def delete(self, ref: str) -> bool:
        """Remove a checkpoint; returns False when it was already gone."""
        self._check_ref(ref)
        try:
            return self.bytes.delete(ref)
        except Exception as exc:
            raise CheckpointError(f"cannot delete checkpoint {ref}: {exc}") from exc

    def refs(self) -> list[str]:
        """Refs of every complete checkpoint, sorted (temporary objects are not listed)."""
        return sorted(self._sizes())

    def size(self, ref: str) -> int:
        """Size in bytes of checkpoint ``ref``."""
        self._check_ref(ref)
        try:
            return self.bytes.size(ref)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {ref} does not exist in {self.location}") from None
        except Exception as exc:
            raise CheckpointError(f"cannot reach checkpoint {ref}: {exc}") from exc

    def sizes(self) -> dict[str, int]:
        """Every complete checkpoint: ref -> size in bytes (one listing)."""
        return self._sizes()

    def total_bytes(self) -> int:
        """Bytes held by complete checkpoints."""
        return sum(self._sizes().values())

    def cleanup(self) -> list[str]:
        """Remove temporary objects left by writers that died; returns their names.

        A temporary file is removed when its writer (same host) is no longer running,
        or, from another host, when it is older than an hour. Object stores write no
        temporaries.
        """
        try:
            return self.bytes.cleanup()
        except Exception as exc:
            raise CheckpointError(f"cannot list checkpoints in {self.location}: {exc}") from exc

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
        evicted: list[str] = []
        for ref in eviction_order(candidates, sizes, needed, self.budget_bytes):
            if self.delete(ref):
                evicted.append(ref)
        return evicted

    def modified(self) -> dict[str, float]:
        """Last write time (``time.time()``) of every complete checkpoint whose store
        tells it (see :meth:`~stagetree.checkpoints.stores.BaseByteStore.modified`)."""
        try:
            times = self.bytes.modified()
        except Exception as exc:
            raise CheckpointError(f"cannot list checkpoints in {self.location}: {exc}") from exc
        return {k: v for k, v in times.items() if REF_RE.fullmatch(k)}

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_ref(ref: str) -> None:
        if not isinstance(ref, str) or not REF_RE.fullmatch(ref):
            raise CheckpointError(f"invalid checkpoint ref {ref!r}")

    def _sizes(self) -> dict[str, int]:
        try:
            listing = self.bytes.list()
        except Exception as exc:
            raise CheckpointError(f"cannot list checkpoints in {self.location}: {exc}") from exc
        return {k: v for k, v in listing.items() if REF_RE.fullmatch(k)}
