"""Serving the dashboard: ``stagetree dashboard STORAGE_URL`` (:func:`serve_dashboard`,
blocking) and the dashboard beside a running study (:func:`start_dashboard`, a
background thread: ``stagetree run --dashboard``, tests).

Everything is checked before anything listens, each failure a
:class:`~stagetree.exceptions.StagetreeError` that names it: the web packages, a
storage that cannot be opened (a missing SQLite file is never created), a database of
a newer schema, a host other than loopback without ``--token-file``, a port in use.

On a loopback host the dashboard answers requests to ``localhost``, ``127.0.0.1`` and
``[::1]`` (and the names of ``allowed_hosts``) only, and refuses a foreign ``Origin``:
a web page cannot read it through DNS rebinding (:mod:`stagetree.web.hosts`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from stagetree.exceptions import StagetreeError
from stagetree.extras import install_hint
from stagetree.reports.open import open_existing_storage
from stagetree.web.auth import is_loopback, read_token_file
from stagetree.web.hosts import allowed_hosts as hosts_allowed
from stagetree.web.listen import listen, quiet_server, shown_host, shown_url

try:  # the routes need starlette (the dashboard extra): check_web() says what to install
    from stagetree.dashboard.app import create_dashboard_app
except ImportError:  # pragma: no cover - without the extra: calling it says what to install

    def create_dashboard_app(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        """Raise :func:`check_web`'s error (starlette or uvicorn is missing)."""
        check_web()
        raise StagetreeError(f"the dashboard needs starlette: {install_hint('dashboard')}")


if TYPE_CHECKING:
    from stagetree.checkpoints import CheckpointStore
    from stagetree.plan.base import BasePlanStorage

__all__ = [
    "DEFAULT_PORT",
    "DashboardServer",
    "check_web",
    "create_dashboard_app",
    "serve_dashboard",
    "start_dashboard",
]

#: ``stagetree dashboard``'s port (``stagetree serve`` has 8642).
DEFAULT_PORT = 8643


def check_web() -> None:
    """Raise a clear error when the web packages are missing.

    Raises:
        StagetreeError: starlette or uvicorn is not installed (says what to install).
    """
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise StagetreeError(
            f"the dashboard needs starlette and uvicorn ({exc.name} is missing): "
            f"{install_hint('dashboard')}"
        ) from None


def _token(token_file: str | os.PathLike[str] | None, host: str) -> str | None:
    """The token from ``token_file``; None on loopback without one.

    Raises:
        StagetreeError: no token file for a host other than loopback, or an unreadable
            token file.
    """
    if token_file is not None:
        return read_token_file(token_file)
    if not is_loopback(host):
        raise StagetreeError(
            f"refusing to serve the dashboard on {host} without --token-file: anyone who "
            "reaches it could read every study. Write a token to a file only you can read "
            "(python -c 'import secrets; print(secrets.token_urlsafe())' > dashboard.token; "
            "chmod 600 dashboard.token) and pass --token-file dashboard.token, or listen on "
            "127.0.0.1"
        )
    return None


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port).

    Raises:
        StagetreeError: the address cannot be bound, naming it (and ``--port`` when the
            port is taken).
    """
    try:
        return listen(host, port)
    except StagetreeError as exc:
        hint = " (another program listens there: pick another with --port)"
        busy = "in use" in str(exc).lower()
        raise StagetreeError(f"{exc}{hint if busy else ''}") from None


def _open(url: str) -> BasePlanStorage:
    """The storage at ``url``, read-only.

    Raises:
        StagetreeError: it cannot be opened, is of another schema version, or lives in
            another process's memory.
    """
    if url.strip().startswith(("memory", ":memory:")):
        raise StagetreeError(
            f"{url} lives in the memory of the process that runs the study: the dashboard "
            "cannot read it from here (use stagetree run --dashboard, or a SQLite or "
            "PostgreSQL storage)"
        )
    return open_existing_storage(url)


@dataclass
class DashboardServer:
    """A dashboard listening in a background thread (:func:`start_dashboard`).

    Attributes:
        url: the address to open (``http://host:port/``, never with the token).
        token: the token every ``/api`` request needs (None: none).
    """

    url: str
    token: str | None
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _close: Callable[[], None] = field(repr=False)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (open long-polls return) and release the storage handle."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._close()

    def __enter__(self) -> DashboardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class _Prepared:
    app: Any
    server: Any
    sock: socket.socket
    token: str | None
    close: Callable[[], None]

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        shown = shown_host(str(host))
        return f"http://{shown}:{port}/"


def _fixed(
    storage: BasePlanStorage | None,
) -> Callable[[], AbstractContextManager[BasePlanStorage]]:
    """A reader of one storage handle (its own lock serialises the reads)."""
    assert storage is not None

    def read() -> AbstractContextManager[BasePlanStorage]:
        return contextlib.nullcontext(storage)

    return read


def _prepare(
    url: str,
    host: str,
    port: int,
    token_file: str | os.PathLike[str] | None,
    checkpoints: str | os.PathLike[str] | CheckpointStore | None,
    reader: Callable[[], AbstractContextManager[BasePlanStorage]] | None,
    allowed_hosts: Iterable[str] = (),
) -> _Prepared:
    """Check everything, open the storage and bind the socket; nothing serves yet."""
    check_web()
    token = _token(token_file, host)
    owned = _open(url) if reader is None else None
    read = reader if reader is not None else _fixed(owned)

    def close() -> None:
        if owned is not None:
            owned.close()

    try:
        sock = _listen(host, port)
    except BaseException:
        close()
        raise
    holder: dict[str, Any] = {}
    app = create_dashboard_app(
        read,
        url=shown_url(url),
        token=token,
        checkpoints=checkpoints,
        stopping=lambda: bool(holder["server"].should_exit),
        allowed_hosts=hosts_allowed(host, allowed_hosts),
    )
    server = holder["server"] = quiet_server(app, lifespan="off")
    return _Prepared(app, server, sock, token, close)


def start_dashboard(
    url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token_file: str | os.PathLike[str] | None = None,
    checkpoints: str | os.PathLike[str] | CheckpointStore | None = None,
    reader: Callable[[], AbstractContextManager[BasePlanStorage]] | None = None,
    timeout: float = 10.0,
    allowed_hosts: Iterable[str] = (),
) -> DashboardServer:
    """Serve the dashboard of the storage at ``url`` from a background thread of this
    process; returns once it listens.

    Args:
        url: the plan storage (opened read-only unless ``reader`` is given).
        host, port: where to listen (port 0: any free port; see
            :attr:`DashboardServer.url`).
        token_file: the token every ``/api`` request needs (required off loopback).
        checkpoints: the checkpoint location downloads read (default: beside a SQLite
            plan).
        reader: how to read the storage instead (e.g. a study's engine's
            ``reading``: for a ``memory://`` plan); ``url`` is then only shown.
        timeout: seconds to wait for the server to start.
        allowed_hosts: host names the dashboard answers to besides the loopback
            names (see the module docstring).

    Raises:
        StagetreeError: see the module docstring.
    """
    prepared = _prepare(url, host, port, token_file, checkpoints, reader, allowed_hosts)
    server, sock = prepared.server, prepared.sock

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException:  # SystemExit from a failed start: reported below
            logging.getLogger("stagetree.dashboard").exception("the dashboard stopped")
        finally:
            sock.close()

    thread = threading.Thread(target=run, name="stagetree-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            prepared.close()
            raise StagetreeError(f"the dashboard did not start on {prepared.url}")
        time.sleep(0.01)
    return DashboardServer(prepared.url, prepared.token, server, thread, prepared.close)


def _announce(
    prepared: _Prepared, url: str, token_file: str | os.PathLike[str] | None, show_token: bool
) -> str:
    where = prepared.url
    line = f"stagetree dashboard: {where} (storage {shown_url(url)}, read-only)"
    if prepared.token is not None:
        path = Path(token_file).resolve() if token_file is not None else None
        if show_token:
            line += f"\nopen {where}?token={prepared.token}"
        else:
            line += f"; token in {path}: open {where}?token=<token> once"
    return line


def serve_dashboard(
    url: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token_file: str | os.PathLike[str] | None = None,
    checkpoints: str | os.PathLike[str] | CheckpointStore | None = None,
    ready: Callable[[str], None] | None = None,
    *,
    show_token: bool = False,
    allowed_hosts: Iterable[str] = (),
    out: TextIO | None = None,
) -> int:
    """``stagetree dashboard``: serve the dashboard of the storage at ``url`` until
    SIGINT/SIGTERM; returns the exit status.

    Prints the address to open, and with a token the path of its file (the token itself
    only with ``show_token``, as ``?token=``).

    Args:
        ready: called with the address once the server listens (tests).
        allowed_hosts: host names it answers to besides the loopback names.

    Raises:
        StagetreeError: see the module docstring (nothing listens then).
    """
    stream = out if out is not None else sys.stdout
    prepared = _prepare(url, host, port, token_file, checkpoints, None, allowed_hosts)
    print(_announce(prepared, url, token_file, show_token), file=stream, flush=True)
    server = prepared.server
    if ready is not None:
        threading.Thread(
            target=_when_started, args=(server, prepared.url, ready), daemon=True
        ).start()
    try:
        server.run(sockets=[prepared.sock])
    except KeyboardInterrupt:  # uvicorn stops cleanly, then raises the Ctrl-C it caught
        pass
    except SystemExit as exc:  # uvicorn exits when its start-up fails
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        prepared.sock.close()
        prepared.close()
    print("stagetree dashboard: stopped", file=stream, flush=True)
    return 0


def _when_started(server: Any, url: str, ready: Callable[[str], None]) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.started:
        ready(url)
