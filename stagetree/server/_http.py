"""The client's HTTP transport: one request, errors mapped to stagetree exceptions, and
retries with exponential backoff while the server cannot be reached."""

from __future__ import annotations

import json as _json
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from stagetree import __version__
from stagetree.exceptions import ServerError, ServerUnavailableError, StagetreeError
from stagetree.extras import install_hint
from stagetree.retry import window_from_env
from stagetree.server.protocol import (
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    VERSION_HEADER,
    error_from_json,
)

__all__ = ["RECONNECT_ENV", "Connection", "SessionLost", "Unreachable", "reconnect_timeout"]

T = TypeVar("T")
RECONNECT_ENV = "STAGETREE_RECONNECT_TIMEOUT"
DEFAULT_RECONNECT = 120.0
_MAX_DELAY = 2.0


def reconnect_timeout() -> float:
    """Seconds a client keeps retrying an unreachable server before it raises
    :class:`~stagetree.exceptions.ServerUnavailableError`: ``STAGETREE_RECONNECT_TIMEOUT``
    or 120."""
    return window_from_env(RECONNECT_ENV, DEFAULT_RECONNECT)


def _tls_refused(exc: BaseException) -> bool:
    """Whether a connection failed on the server's TLS certificate (not retried)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(
            seen
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Unreachable(Exception):
    """No answer (connection refused or reset, timeout) or a 502/503/504: retry."""


class SessionLost(Exception):
    """The server does not know the session (it expired, or the server restarted)."""


class Connection:
    """Requests to one server with one token (thread-safe)."""

    def __init__(self, url: str, token: str | None, give_up: float | None = None) -> None:
        try:
            import httpx
        except ImportError:
            raise StagetreeError(f"a remote study needs httpx: {install_hint('server')}") from None

        self.url = url.rstrip("/")
        self.give_up = reconnect_timeout() if give_up is None else give_up
        headers = {PROTOCOL_HEADER: str(PROTOCOL_VERSION), VERSION_HEADER: __version__}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(300.0, connect=5.0)
        )
        self.closed = threading.Event()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        raw: bool = False,
    ) -> Any:
        """One attempt: the JSON answer (``raw``: the bytes, None for 204).

        Raises:
            Unreachable: no answer, or 502/503/504 (retry).
            SessionLost: the session is unknown to the server.
            StagetreeError: the server's error, as the exception a local study raises
                (:func:`~stagetree.server.protocol.error_from_json`).
        """
        import httpx

        extra: dict[str, Any] = {}
        if timeout is not None:
            extra["timeout"] = httpx.Timeout(timeout, connect=5.0)
        if json is not None:  # NaN allowed: the server refuses it with the study's message
            extra["content"] = _json.dumps(json, allow_nan=True, separators=(",", ":"))
            extra["headers"] = {"Content-Type": "application/json"}
        try:
            response = self._client.request(method, path, params=params, **extra)
        except httpx.ConnectError as exc:
            if _tls_refused(exc):  # retrying cannot help: say what to do
                raise ServerError(
                    f"TLS to {self.url} failed: {exc}. For a self-signed server certificate "
                    "set SSL_CERT_FILE to a file holding it"
                ) from None
            raise Unreachable(f"ConnectError: {exc}") from None
        except httpx.TransportError as exc:
            raise Unreachable(
                f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            ) from None
        except RuntimeError as exc:  # the client was closed by another thread
            raise ServerError(f"the connection to {self.url} is closed ({exc})") from None
        status = response.status_code
        if status in (502, 503, 504):
            raise Unreachable(f"HTTP {status}")
        if status >= 400:
            try:
                payload = response.json()
            except ValueError:
                payload = response.text[:200]
            if (
                isinstance(payload, dict)
                and (payload.get("error") or {}).get("type") == "SessionNotFound"
            ):
                raise SessionLost(str(payload["error"].get("message", "")))
            raise error_from_json(status, payload)
        if raw:
            return None if status == 204 else response.content
        try:
            return response.json()
        except ValueError:
            raise ServerError(
                f"{self.url} answered {method} {path} with something that is not JSON", status
            ) from None

    def retrying(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, retried with exponential backoff (0.1 s doubling up to 2 s)
        while the server is unreachable, for at most :attr:`give_up` seconds.

        Raises:
            ServerUnavailableError: still unreachable after :attr:`give_up` seconds
                (naming the URL and how long it tried).
        """
        start = time.monotonic()
        delay = 0.1
        while True:
            try:
                return attempt()
            except Unreachable as exc:
                spent = time.monotonic() - start
                if self.closed.is_set() or spent + delay > self.give_up:
                    raise ServerUnavailableError(
                        f"cannot reach the stagetree server at {self.url}: tried for "
                        f"{spent:.1f} s ({exc}); is `stagetree serve` running there? "
                        f"(set {RECONNECT_ENV} to wait longer)"
                    ) from None
                if self.closed.wait(delay):
                    continue  # closed meanwhile: the next failure gives up
                delay = min(delay * 2, _MAX_DELAY)

    def close(self) -> None:
        self.closed.set()
        self._client.close()
