"""The ``Host`` and ``Origin`` check of the server and the dashboard, against DNS
rebinding.

A page on any web site can make the browser send requests to ``127.0.0.1``; with DNS
rebinding (a domain that resolves to 127.0.0.1 after the page loaded) its scripts can
also read the answers, because the browser thinks both are the page's own origin. A
server listening on loopback therefore answers only requests whose ``Host`` names this
machine: ``localhost``, ``127.0.0.1`` or ``[::1]`` (any port), or a name the user
allowed (``--allowed-host``), and refuses a request whose ``Origin`` (browsers send it
on cross-site and state-changing requests) names another host, as notebook servers do.
A refused request is a 403 JSON error that says what to do. A server listening on any
other address needs a token, which a rebinding page does not have; it checks the
headers only against the names given to it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from stagetree.web.auth import is_loopback

if TYPE_CHECKING:  # starlette is an optional extra
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["LOOPBACK_NAMES", "HostGuard", "allowed_hosts", "host_name"]

#: The names of this machine a loopback server answers to.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The host names a server listening on ``host`` answers to: the loopback names
    and ``extra`` on a loopback address; ``extra`` (with the loopback names) elsewhere,
    None (any name) when none is given there."""
    names = frozenset(name.strip().lower().strip("[]") for name in extra if name.strip())
    if is_loopback(host):
        return LOOPBACK_NAMES | names
    return LOOPBACK_NAMES | names if names else None


def _nested(message: str) -> bytes:
    return json.dumps({"error": {"type": "HostRefused", "message": message}}).encode()


def host_name(value: str) -> str:
    """The host name of a ``Host`` header (without the port, IPv6 without brackets,
    lower case); "" when it has none."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else ""
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class HostGuard:
    """ASGI middleware: a request whose ``Host`` or ``Origin`` names a host outside
    ``allowed`` is a 403 before any route sees it.

    Args:
        app: the application.
        allowed: host names (see :func:`allowed_hosts`); None checks nothing.
        body: the JSON body of a refusal from its message (the application's error
            form); default ``{"error": {"type": "HostRefused", "message": ...}}``.
    """

    def __init__(
        self,
        app: ASGIApp,
        allowed: frozenset[str] | None,
        body: Callable[[str], bytes] | None = None,
    ) -> None:
        self.app = app
        self.allowed = allowed
        self.body = body or _nested

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refused = self._refusal(headers.get("host", ""), headers.get("origin"))
        if refused is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "host refused"})
            return
        body = self.body(refused)
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, host: str, origin: str | None) -> str | None:
        """Why a request is refused, or None."""
        assert self.allowed is not None
        hint = (
            "this server answers requests to "
            + ", ".join(sorted(self.allowed))
            + " only (a guard against DNS rebinding); open it under one of those names, "
            "or start it with --allowed-host NAME"
        )
        name = host_name(host)
        if name not in self.allowed:
            return f"refused Host {host!r}: {hint}"
        if origin is not None:
            parts = urlsplit(origin.strip())
            if parts.scheme not in ("http", "https") or (parts.hostname or "") not in self.allowed:
                return f"refused Origin {origin!r}: {hint}"
        return None
