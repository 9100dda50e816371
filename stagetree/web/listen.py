"""Listening sockets and shown addresses, for the server and the dashboard."""

from __future__ import annotations

import socket
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from stagetree.exceptions import StagetreeError

__all__ = ["listen", "quiet_server", "shown_host", "shown_url"]


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port), inheritable by
    uvicorn's workers.

    Raises:
        StagetreeError: the address cannot be resolved or bound (e.g. the port is in use),
            or the port is not 0-65535.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise StagetreeError(f"cannot listen on port {port!r}: a port is 0-65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StagetreeError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StagetreeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def shown_host(host: str) -> str:
    """``host`` as it appears in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def shown_url(url: str) -> str:
    """The storage URL without its password."""
    if "://" not in url or url.startswith("memory"):
        return url
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def quiet_server(app: Any, **options: Any) -> Any:
    """A ``uvicorn.Server`` of ``app`` that logs warnings only (no access log) and
    gives open requests 2 s when it stops; run it with ``sockets=[listen(...)]``.

    Args:
        app: the ASGI application.
        **options: more ``uvicorn.Config`` options (TLS files, ``lifespan``...).
    """
    import uvicorn  # the server or dashboard extra; callers check it is installed

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=2, **options
    )
    return uvicorn.Server(config)
