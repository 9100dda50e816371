"""Byte stores: where checkpoint bytes live, chosen by URL.

A byte store holds named objects (*keys*: ``[A-Za-z0-9_.-]`` names, no folders) under
one location. :func:`open_byte_store` picks one by the URL's scheme:

- a path or ``file://`` URL: :class:`LocalByteStore`, a directory on this machine or a
  shared mount (NFS, Lustre...) that every worker sees at the same path;
- any other protocol ``fsspec`` knows (``s3://bucket/prefix``, ``gs://``, ``az://``,
  ``memory://``...): :class:`FsspecByteStore`, with the protocol's package installed
  (``pip install s3fs``, ``gcsfs``, ``adlfs``).

:func:`register_byte_store` adds a scheme of one's own. Stores are picklable and cheap
to send: they pickle as their URL (and fsspec options) and connect lazily, so a worker
process or a Ray actor reopens the same location.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stagetree.exceptions import CheckpointError
from stagetree.extras import install_hint

__all__ = [
    "BaseByteStore",
    "FsspecByteStore",
    "LocalByteStore",
    "byte_store_schemes",
    "check_location",
    "is_local_location",
    "open_byte_store",
    "register_byte_store",
]

# A temporary object from another host is removed once it is this old.
_STALE_SECONDS = 3600.0
_KEY_RE = re.compile(r"[A-Za-z0-9_.-]{1,255}")


class BaseByteStore(abc.ABC):
    """Named byte objects under one location (a directory, a bucket prefix).

    Contract (every implementation, tested by ``tests/test_checkpoints.py`` against each):

    - :meth:`put` is durable and atomic as seen by readers: when it returns, the object
      survives a crash of this process and of the machine (fsync; an object store's
      acknowledged put); until then readers see the previous object of that key or none,
      never a part. A failed put leaves the previous object (or none) in place.
    - :meth:`get` returns the whole object; a missing key raises ``FileNotFoundError``,
      any other failure ``OSError`` (or the backend's exception).
    - :meth:`list` gives every complete object with its size; temporaries a writer
      uses (names starting with ``.``) are never listed.
    - :meth:`delete` returns False when the key was already gone.
    - :meth:`check` proves the location reachable and writable (write, read back and
      delete a small marker), raising :class:`~stagetree.exceptions.CheckpointError`
      naming the location and the cause otherwise.
    - An instance pickles as its location and connects lazily (cheap to send to a
      worker process or a Ray actor).

    Attributes:
        url: the location, as given.
        is_local: whether reads are local disk reads (no read cache is worth having).
    """

    url: str
    is_local: bool = False

    @abc.abstractmethod
    def put(self, key: str, parts: Sequence[bytes]) -> None:
        """Store the concatenation of ``parts`` under ``key`` (replacing it)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes of ``key``."""

    def get_prefix(self, key: str, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes of ``key`` (all of it when shorter)."""
        return self.get(key)[:nbytes]

    def get_writable(self, key: str) -> bytearray:
        """The bytes of ``key`` in a buffer of the caller's own, which it may change or
        hand on (a checkpoint's tensors are decoded in place there, see
        :func:`stagetree.checkpoints.format.decode`)."""
        return bytearray(self.get(key))

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is present."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; False when it was already gone."""

    @abc.abstractmethod
    def list(self) -> dict[str, int]:
        """Every complete object: key -> size in bytes."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size of ``key`` in bytes (``FileNotFoundError`` when missing)."""

    def modified(self) -> dict[str, float]:
        """Every complete object whose last write time the store knows: key ->
        ``time.time()`` of that write. The default knows none, and ``stagetree gc``
        never removes an unreferenced object whose age it cannot tell (it may be a
        checkpoint being recorded right now)."""
        return {}

    def cleanup(self) -> builtins.list[str]:
        """Remove temporaries left by writers that died; returns their names."""
        return []

    def check(self) -> None:
        """Write, read back and delete a marker (and remove stale temporaries); raise
        ``CheckpointError`` on failure."""
        key = f".probe-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
        payload = b"stagetree probe " + key.encode()
        try:
            self.cleanup()
            self.put(key, [payload])
            try:
                back = self.get(key)
            finally:
                self.delete(key)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint location {self.url} is not reachable or not writable: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if back != payload:
            raise CheckpointError(
                f"checkpoint location {self.url} does not return what was written to it"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or key in (".", ".."):
        raise ValueError(f"invalid key {key!r}")


def _temp_name(key: str) -> str:
    """``.<key>.<host>.<pid>.<random>.tmp`` (dots of the key replaced): whose writer made
    it, so that :meth:`BaseByteStore.cleanup` knows when it is stale."""
    stem = key.replace(".", "_")
    return f".{stem}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _stale_temp(name: str, mtime: float | None, now: float) -> bool:
    """Whether ``name`` is a temporary whose writer is gone: same host and the process is
    not running, or another host and older than an hour."""
    parts = name.split(".")
    if len(parts) != 6 or parts[0] or parts[5] != "tmp" or not parts[3].isdigit():
        return False
    pid = int(parts[3])
    if parts[2] == _host():
        return pid != os.getpid() and not _pid_alive(pid)
    return mtime is not None and now - mtime > _STALE_SECONDS


class LocalByteStore(BaseByteStore):
    """Files in a directory of this machine or of a shared mount.

    A put writes a temporary file in the same directory, fsyncs it, renames it over the
    final name (:func:`os.replace`, atomic on POSIX, also on NFS) and fsyncs the
    directory. A writer that crashes leaves at most a temporary file, never listed and
    removed by :meth:`cleanup` once its writer process is gone (another host's: after
    an hour).

    Args:
        directory: created if missing.
    """

    is_local = True

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.url = str(self.directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {exc}"
            ) from exc

    def __reduce__(self) -> tuple[Any, ...]:
        return (LocalByteStore, (self.url,))

    def put(self, key: str, parts: Sequence[bytes]) -> None:
        _check_key(key)
        final = self.directory / key
        tmp = self.directory / _temp_name(key)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                for part in parts:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        _check_key(key)
        return (self.directory / key).read_bytes()

    def get_writable(self, key: str) -> bytearray:
        # Read straight into the caller's buffer: one copy from the page cache.
        _check_key(key)
        with open(self.directory / key, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buffer = bytearray(size)
            view = memoryview(buffer)
            done = 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    break
                done += n
            view.release()
        if done < size:  # shrunk while read (never, for a file renamed into place)
            del buffer[done:]
        return buffer

    def get_prefix(self, key: str, nbytes: int) -> bytes:
        _check_key(key)
        with open(self.directory / key, "rb") as f:
            return f.read(nbytes)

    def exists(self, key: str) -> bool:
        _check_key(key)
        return (self.directory / key).is_file()

    def delete(self, key: str) -> bool:
        _check_key(key)
        try:
            (self.directory / key).unlink()
        except FileNotFoundError:
            return False
        return True

    def list(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        try:
            entries = builtins.list(os.scandir(self.directory))
        except FileNotFoundError:
            return sizes
        for entry in entries:
            if not entry.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file():
                        sizes[entry.name] = entry.stat().st_size
        return sizes

    def size(self, key: str) -> int:
        _check_key(key)
        return (self.directory / key).stat().st_size

    def modified(self) -> dict[str, float]:
        times: dict[str, float] = {}
        try:
            entries = builtins.list(os.scandir(self.directory))
        except FileNotFoundError:
            return times
        for entry in entries:
            if not entry.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file():
                        times[entry.name] = entry.stat().st_mtime
        return times

    def cleanup(self) -> builtins.list[str]:
        removed: builtins.list[str] = []
        now = time.time()
        try:
            entries = builtins.list(os.scandir(self.directory))
        except FileNotFoundError:
            return removed
        for entry in entries:
            if not entry.name.startswith("."):
                continue
            try:
                mtime = entry.stat().st_mtime
            except FileNotFoundError:
                continue
            if _stale_temp(entry.name, mtime, now):
                try:
                    os.unlink(entry.path)
                    removed.append(entry.name)
                except FileNotFoundError:
                    pass
        return removed


# Protocols whose single-object put is atomic as seen by readers (the object appears
# whole when the upload completes, multipart included): written in place. Any other
# file system gets a temporary object renamed over the final name.
_ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory"})
# pip packages for fsspec protocols whose implementation is not in fsspec itself, where
# the package is not named after the module.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


class FsspecByteStore(BaseByteStore):
    """Objects under any fsspec URL: ``s3://bucket/prefix``, ``gs://``, ``az://``,
    ``memory://``, ...

    On object stores a put is one object upload (atomic: readers see the object whole or
    not at all); elsewhere it writes a temporary object and renames it. Listings are
    read fresh (fsspec's listing cache is invalidated first), so objects written by
    other processes are seen.

    Args:
        url: ``protocol://location``.
        storage_options: passed to the fsspec file system (credentials,
            ``endpoint_url`` in ``client_kwargs`` for an S3-compatible service, ...).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.protocol = url.split("://", 1)[0].lower()
        _fsspec_class(self.protocol, url)  # fails now when the package is missing
        self._fs: Any = None
        self._root = ""
        self._pid = -1

    def __reduce__(self) -> tuple[Any, ...]:
        return (FsspecByteStore, (self.url, self.storage_options))

    @property
    def fs(self) -> Any:
        """The fsspec file system (made on first use, again in a forked child)."""
        if self._fs is None or self._pid != os.getpid():
            import fsspec.core

            try:
                fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
            except ImportError as exc:
                package = exc.name or str(exc)
                raise CheckpointError(
                    f"checkpoint URL {self.url!r} needs the package {package!r}, which is not "
                    f"installed: pip install {package}"
                ) from exc
            self._fs, self._root, self._pid = fs, root.rstrip("/"), os.getpid()
        return self._fs

    def _path(self, key: str) -> str:
        _check_key(key)
        _ = self.fs  # sets the root
        return f"{self._root}/{key}"

    def put(self, key: str, parts: Sequence[bytes]) -> None:
        path = self._path(key)
        data = b"".join(parts)
        if self.protocol in _ATOMIC_PUT:
            self.fs.pipe_file(path, data)
            return
        tmp = self._path(_temp_name(key))
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            raise

    def get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(key)))

    def get_prefix(self, key: str, nbytes: int) -> bytes:
        return bytes(self.fs.cat_file(self._path(key), start=0, end=nbytes))

    def exists(self, key: str) -> bool:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        try:
            return self.fs.info(path).get("type") == "file"
        except FileNotFoundError:
            return False

    def delete(self, key: str) -> bool:
        if not self.exists(key):
            return False
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def _entries(self) -> builtins.list[dict[str, Any]]:
        fs = self.fs
        fs.invalidate_cache(self._root)
        try:
            return builtins.list(fs.ls(self._root, detail=True))
        except FileNotFoundError:
            return []

    def list(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for entry in self._entries():
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "file" and not name.startswith("."):
                sizes[name] = int(entry.get("size") or 0)
        return sizes

    def size(self, key: str) -> int:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        return int(self.fs.info(path)["size"])

    def modified(self) -> dict[str, float]:
        times: dict[str, float] = {}
        for entry in self._entries():
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            mtime = _mtime(entry)
            if entry.get("type") == "file" and not name.startswith(".") and mtime is not None:
                times[name] = mtime
        return times

    def cleanup(self) -> builtins.list[str]:
        if self.protocol in _ATOMIC_PUT:
            return []  # no temporaries are ever written
        removed: builtins.list[str] = []
        now = time.time()
        for entry in self._entries():
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            mtime = _mtime(entry)
            if _stale_temp(name, mtime, now):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(entry["name"])
                    removed.append(name)
        return removed


def _mtime(entry: Mapping[str, Any]) -> float | None:
    for field in ("mtime", "LastModified", "last_modified", "created"):
        value = entry.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        timestamp = getattr(value, "timestamp", None)
        if callable(timestamp):
            return float(timestamp())
    return None


# ---------------------------------------------------------------------- registry

ByteStoreFactory = Callable[[str, Mapping[str, Any]], BaseByteStore]


def _local(url: str, options: Mapping[str, Any]) -> BaseByteStore:
    check_location(url)
    scheme = _scheme(url)
    return LocalByteStore(url.split("://", 1)[1] if scheme else url)


_REGISTRY: dict[str, ByteStoreFactory] = {"": _local, "file": _local, "local": _local}


def register_byte_store(scheme: str, factory: ByteStoreFactory) -> None:
    """Make checkpoint URLs ``scheme://...`` open with ``factory(url, storage_options)``
    (before fsspec is asked).

    Raises:
        ValueError: ``scheme`` is not a lowercase name, or is taken.
    """
    if not isinstance(scheme, str) or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"a scheme must be a lowercase name, got {scheme!r}")
    if scheme in _REGISTRY:
        raise ValueError(f"byte store scheme {scheme!r} is already registered")
    _REGISTRY[scheme] = factory


def byte_store_schemes() -> list[str]:
    """Schemes a checkpoint URL may use: the registered ones and every protocol fsspec
    knows (whether or not its package is installed), sorted."""
    names = {s for s in _REGISTRY if s}
    try:
        from fsspec.registry import known_implementations, registry

        names |= set(known_implementations) | set(registry)
    except ImportError:
        pass
    return sorted(names)


def _scheme(url: str) -> str:
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", url)
    return match.group(1).lower() if match else ""


def _fsspec_class(protocol: str, url: str) -> Any:
    """fsspec's class for ``protocol``, or a CheckpointError saying what to install."""
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry
    except ImportError:
        raise CheckpointError(f"checkpoint URL {url!r} needs fsspec: pip install fsspec") from None
    if protocol not in known_implementations and protocol not in registry:
        common = "a path, file:///dir, s3://bucket/prefix, gs://bucket/prefix, az://container"
        raise CheckpointError(
            f"unknown checkpoint URL scheme {protocol!r} in {url!r}: use {common}, or another "
            f"protocol fsspec knows ({', '.join(byte_store_schemes())})"
        )
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        module = known_implementations.get(protocol, {}).get("class", "").split(".")[0]
        package = _PACKAGES.get(protocol) or module or protocol
        extra = _EXTRAS.get(protocol)
        hint = install_hint(extra) if extra else f"pip install {package}"
        raise CheckpointError(
            f"checkpoint URL {url!r} needs the package {package!r}, which is not installed: {hint}"
        ) from exc


def check_location(location: str | os.PathLike[str]) -> None:
    """Check a checkpoint location's form without touching it: a path, a ``file:///``
    URL, or a URL whose scheme is registered or known to fsspec with its package
    installed.

    Raises:
        CheckpointError: saying what is wrong (unknown scheme, package to install).
    """
    if isinstance(location, os.PathLike):
        return
    if not isinstance(location, str) or not location:
        raise CheckpointError(f"a checkpoint location must be a path or a URL, got {location!r}")
    scheme = _scheme(location)
    if scheme in ("file", "local") and not location.split("://", 1)[1].startswith("/"):
        raise CheckpointError(
            f"a {scheme}:// URL needs an absolute path ({scheme}:///dir), got {location!r}"
        )
    if scheme not in _REGISTRY:
        _fsspec_class(scheme, location)


def is_local_location(location: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint location is a directory of this machine (a path or a
    ``file:///`` URL), which opening its store creates."""
    if isinstance(location, os.PathLike):
        return True
    return _scheme(location) in ("", "file", "local")


def open_byte_store(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> BaseByteStore:
    """The byte store of a checkpoint location: a path, ``file:///dir``, or a URL of any
    fsspec protocol (``s3://bucket/prefix``...). Opening connects nowhere (see
    :meth:`BaseByteStore.check`).

    Raises:
        CheckpointError: an unknown scheme (the message lists the known ones), or a
            protocol whose package is not installed (the message says what to install).
    """
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    check_location(location)
    scheme = _scheme(location)
    factory = _REGISTRY.get(scheme)
    if factory is not None:
        return factory(location, dict(storage_options or {}))
    return FsspecByteStore(location, storage_options)


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
