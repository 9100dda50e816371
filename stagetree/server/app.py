"""The HTTP API of a tuning server (Starlette), versioned under ``/v1``.

Every request needs ``Authorization: Bearer <token>`` (401 missing or malformed, 403
wrong), also ``/v1/info``. A client sends ``X-Stagetree-Protocol``; another protocol
version than the server's is refused (400, ``VersionMismatchError``, naming both).
Bodies are JSON objects, at most 1 MiB (64 MiB for ``POST /v1/studies``, which carries
the pickled trainer; 413 beyond). A malformed request (not JSON, unknown or missing
fields, wrong types, an unknown session or submission, a trial that does not fit the
study) gets a 4xx ``{"error": {"type": ..., "message": ...}}`` naming the problem, and
writes nothing.

=================================================  ======================================
``GET /v1/info``                                   ``{"stagetree", "protocol", "lease_ttl"}``
``POST /v1/studies``                               open a session on a study (created or
                                                   continued): ``{"name", "trainer",
                                                   "protocol", "version"?, "share"?,
                                                   "weight"?, "client"?, "fuse"?}`` ->
                                                   ``{"session", "lease_ttl", ...}``
``DELETE /v1/sessions/{s}``                        close it (pending submissions cancelled)
``POST /v1/sessions/{s}/submissions``              ``{"id", "config", "hp", "steps"}``: start
                                                   ``study.submit``; ``{"event"}`` when it
                                                   ended at once, else the result comes
                                                   by the long-poll
``DELETE /v1/sessions/{s}/submissions/{id}``       cancel it
``GET /v1/sessions/{s}/results?after=N&timeout=T`` long-poll: ``{"events": [...]}``, each
                                                   ``{"seq", "id", "result" | "error"}``
``POST /v1/sessions/{s}/check``                    ``{"config", "hp"}``
``POST /v1/sessions/{s}/declare``                  ``{"trials": [[config, hp], ...]}``
``POST /v1/sessions/{s}/tuning``                   begin tuning ``{"metric", "mode",
                                                   "tuner", "horizon"}``; ``DELETE``: end it
``GET|POST /v1/sessions/{s}/log``                  the tuner's log; append ``{"record"}``
``GET /v1/sessions/{s}/trials``                    ``{"trials": [TrialRecord...]}``
``GET /v1/sessions/{s}/best?metric=&mode=``        ``{"trial": TrialRecord | null}``
``GET /v1/sessions/{s}/stats|progress``            ``{"stats": {...}}``
``GET /v1/sessions/{s}/failures``                  ``{"failures": [[id, error], ...]}``
``GET /v1/sessions/{s}/workers``                   ``{"num_workers", "locations"}``
``POST /v1/sessions/{s}/eval``                     ``{"config", "hp", "step"}`` ->
                                                   ``{"metrics": {...} | null}``
``POST /v1/sessions/{s}/state``                    ``{"config", "hp", "step"}`` -> the state
                                                   in the checkpoint format
                                                   (octet-stream), 204 when there is none
=================================================  ======================================

The dashboard (:mod:`stagetree.dashboard`) is served at ``/``, its JSON under ``/api``,
read-only through the studies' engine and behind the same token.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagetree import __version__
from stagetree.checkpoints.format import encode
from stagetree.dashboard.app import create_dashboard_app
from stagetree.exceptions import RequestRefusedError
from stagetree.plan.tree import check_steps
from stagetree.server.hub import Hub, Session
from stagetree.server.protocol import (
    BODY_LIMIT,
    MAX_POLL,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    STUDY_BODY_LIMIT,
    dumps,
    error_to_json,
    hp_from_json,
    record_to_json,
)
from stagetree.web.auth import check_authorization
from stagetree.web.hosts import HostGuard
from stagetree.web.listen import shown_url

__all__ = ["create_app"]

log = logging.getLogger("stagetree.server")
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,100}")


class JSON(Response):
    """A JSON response that allows NaN and infinities (metrics can be NaN)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def _error(exc: BaseException) -> Response:
    status, body = error_to_json(exc)
    if status >= 500 and not isinstance(exc, RequestRefusedError):
        log.error("request failed", exc_info=exc)
    return JSON(body, status_code=status, headers={PROTOCOL_HEADER: str(PROTOCOL_VERSION)})


def _mismatch(theirs: str) -> RequestRefusedError:
    return RequestRefusedError(
        400,
        "VersionMismatchError",
        f"the client speaks stagetree protocol {theirs}, this server (stagetree "
        f"{__version__}) speaks protocol {PROTOCOL_VERSION}: install the same stagetree "
        "version on both sides",
    )


class _Guard:
    """ASGI middleware: token, protocol version and body size, before any ``/v1`` route
    (the dashboard's pages and ``/api`` check the same token themselves, also from the
    cookie a browser holds)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_v1(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        limit = STUDY_BODY_LIMIT if scope["path"].rstrip("/") == "/v1/studies" else BODY_LIMIT
        try:
            check_authorization(headers.get("authorization"), self.token)
            protocol = headers.get(PROTOCOL_HEADER.lower())
            if protocol is not None and protocol.strip() != str(PROTOCOL_VERSION):
                raise _mismatch(protocol.strip())
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                raise _too_large(limit)
        except RequestRefusedError as exc:
            await _error(exc)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _too_large(limit)
            return message

        await self.app(scope, limited, send)


def _is_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _too_large(limit: int) -> RequestRefusedError:
    return RequestRefusedError(
        413, "PayloadTooLarge", f"request body larger than {limit // (1 << 20)} MiB"
    )


# ------------------------------------------------------------------------------ parsing


async def _body(
    request: Request,
    required: frozenset[str] | set[str],
    optional: frozenset[str] | set[str] = frozenset(),
) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRefusedError(400, "BadRequest", f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise _too_nested() from None
    if _too_deep(data, _MAX_DEPTH):
        raise _too_nested()
    if not isinstance(data, dict):
        raise RequestRefusedError(
            400, "BadRequest", f"request body must be a JSON object, got {type(data).__name__}"
        )
    unknown = set(data) - required - optional
    if unknown:
        expected = sorted(required | optional)
        raise RequestRefusedError(
            400, "BadRequest", f"unknown field(s) {sorted(unknown)}; expected {expected}"
        )
    missing = required - set(data)
    if missing:
        raise RequestRefusedError(400, "BadRequest", f"missing field(s) {sorted(missing)}")
    return data


#: How deep a request body may nest (a config or a sequence is a few levels deep).
_MAX_DEPTH = 64


def _too_nested() -> RequestRefusedError:
    return RequestRefusedError(
        400, "BadRequest", f"request body is nested deeper than {_MAX_DEPTH} levels"
    )


def _too_deep(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests deeper than ``limit`` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def _object(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data[key]
    if not isinstance(value, dict):
        raise RequestRefusedError(
            400, "BadRequest", f"{key!r} must be a JSON object, got {value!r:.100}"
        )
    return value


def _steps(data: dict[str, Any], key: str) -> int:
    return check_steps(data[key], key)


def _string(data: dict[str, Any], key: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or not value:
        raise RequestRefusedError(
            400, "BadRequest", f"{key!r} must be a non-empty string, got {value!r:.100}"
        )
    return value


def _trial(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return _object(data, "config"), hp_from_json(_object(data, "hp"))


# ------------------------------------------------------------------------------- routes


_SETTLE_WAIT = 0.02  # seconds a submit waits for an answer the plan already holds


class _Dashboard(Mount):
    """The dashboard's mount at ``/``: everything but ``/v1``, whose unknown routes and
    methods stay the API's JSON 404 and 405."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if _is_v1(scope.get("path", "")):
            return Match.NONE, {}
        return super().matches(scope)


def _dashboard(hub: Hub, token: str) -> ASGIApp:
    """The dashboard (:mod:`stagetree.dashboard`) of the hub's storage, read through its
    engine, behind the server's token."""
    return create_dashboard_app(
        hub.reading,
        url=shown_url(hub.config.storage),
        token=token,
        checkpoints=hub.config.checkpoint_dir,
        stopping=lambda: hub.closing,
    )


def create_app(hub: Hub, token: str, allowed: frozenset[str] | None = None) -> Starlette:
    """The Starlette app of ``hub``, guarded by ``token`` (and, with ``allowed``, by the
    ``Host``/``Origin`` check of :mod:`stagetree.web.hosts`): the API under ``/v1`` and
    the dashboard at ``/`` (its JSON under ``/api``). The hub is closed when the app
    shuts down (lifespan)."""

    def endpoint(
        fn: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapper(request: Request) -> Response:
            try:
                return await fn(request)
            except Exception as exc:
                return _error(exc)

        return wrapper

    def session_of(request: Request, extra: float = 0.0) -> Session:
        return hub.session(request.path_params["sid"], extra)

    async def blocking(fn: Callable[..., Any], *args: Any) -> Any:
        return await run_in_threadpool(fn, *args)

    @endpoint
    async def info(request: Request) -> Response:
        return JSON(
            {
                "stagetree": __version__,
                "protocol": PROTOCOL_VERSION,
                "lease_ttl": hub.ttl,
                **hub.describe(),
            }
        )

    @endpoint
    async def open_study(request: Request) -> Response:
        data = await _body(
            request,
            {"name", "trainer", "protocol"},
            {"version", "share", "weight", "client", "fuse"},
        )
        if data["protocol"] != PROTOCOL_VERSION:
            raise _mismatch(str(data["protocol"]))
        name = _string(data, "name")
        version = data.get("version")
        if version is not None and (not isinstance(version, str) or not version):
            raise RequestRefusedError(
                400,
                "BadRequest",
                f"'version' must be a non-empty string or null, got {version!r:.100}",
            )
        share = data.get("share", True)
        if not isinstance(share, bool):
            raise RequestRefusedError(
                400, "BadRequest", f"'share' must be true or false, got {share!r:.100}"
            )
        weight = data.get("weight", 1.0)
        fuse = data.get("fuse", False)
        if fuse is not True and fuse is not False and fuse != "auto":
            raise RequestRefusedError(
                400, "BadRequest", f"'fuse' must be true, false or \"auto\", got {fuse!r:.100}"
            )
        client = data.get("client", "")
        if not isinstance(client, str):
            raise RequestRefusedError(400, "BadRequest", "'client' must be a string")
        host = request.client.host if request.client else "?"
        client = "".join(c for c in client if c.isprintable())[:100]  # it goes to the log
        label = f"{client or 'client'} from {host}"
        session = await blocking(
            hub.open, name, data["trainer"], version, share, weight, label, fuse
        )
        return JSON(
            {
                "session": session.id,
                "lease_ttl": hub.ttl,
                "stagetree": __version__,
                "protocol": PROTOCOL_VERSION,
                "version": session.study.version,
            }
        )

    @endpoint
    async def close_session(request: Request) -> Response:
        session = session_of(request)
        await blocking(hub.close_session, session)
        return JSON({"closed": True})

    @endpoint
    async def submit(request: Request) -> Response:
        session = session_of(request)
        data = await _body(request, {"id", "config", "hp", "steps"})
        sub_id = data["id"]
        if not isinstance(sub_id, str) or not _ID.fullmatch(sub_id):
            raise RequestRefusedError(
                400, "BadRequest", f"'id' must match {_ID.pattern}, got {sub_id!r:.100}"
            )
        steps = _steps(data, "steps")
        config, hp = _trial(data)
        await blocking(session.study.check, config, hp)  # refused input writes nothing
        started = hub.submit(session, sub_id, config, hp, steps)
        # A trial the plan already answers ends within milliseconds: its event comes
        # back at once (the long-poll delivers it again; the client takes it once).
        event = await hub.settled(session, sub_id, _SETTLE_WAIT)
        return JSON({"id": sub_id, "started": started, "event": event})

    @endpoint
    async def cancel(request: Request) -> Response:
        session = session_of(request)
        return JSON({"cancelled": hub.cancel(session, request.path_params["sub"])})

    @endpoint
    async def results(request: Request) -> Response:
        try:
            after = int(request.query_params.get("after", "0"))
            timeout = float(request.query_params.get("timeout", "0"))
        except ValueError:
            raise RequestRefusedError(
                400, "BadRequest", "'after' must be an int and 'timeout' a number"
            ) from None
        if after < 0 or not math.isfinite(timeout) or timeout < 0:
            raise RequestRefusedError(400, "BadRequest", "'after' and 'timeout' must be >= 0")
        timeout = min(timeout, MAX_POLL, hub.ttl / 2)
        session = session_of(request, extra=timeout)
        events = await hub.events(session, after, timeout)
        hub.session(session.id)  # the poll's end renews the session too
        return JSON({"events": events})

    @endpoint
    async def check(request: Request) -> Response:
        session = session_of(request)
        config, hp = _trial(await _body(request, {"config", "hp"}))
        await blocking(session.study.check, config, hp)
        return JSON({"ok": True})

    @endpoint
    async def declare(request: Request) -> Response:
        session = session_of(request)
        raw = (await _body(request, {"trials"}))["trials"]
        if not isinstance(raw, list) or not all(isinstance(t, list) and len(t) == 2 for t in raw):
            raise RequestRefusedError(
                400, "BadRequest", "'trials' must be a list of [config, hp] pairs"
            )
        trials = [_trial({"config": c, "hp": h}) for c, h in raw]
        await blocking(session.study.declare, trials)
        return JSON({"ok": True})

    @endpoint
    async def tuning(request: Request) -> Response:
        session = session_of(request)
        if request.method == "DELETE":
            await blocking(hub.end_tuning, session)
            return JSON({"tuning": False})
        data = await _body(request, {"metric", "mode", "tuner"}, {"horizon"})
        metric, tuner = _string(data, "metric"), _string(data, "tuner")
        mode = data["mode"]
        if mode not in ("max", "min"):
            raise RequestRefusedError(
                400, "BadRequest", f"'mode' must be 'max' or 'min', got {mode!r:.100}"
            )
        horizon = _steps({"horizon": data.get("horizon", 0)}, "horizon")
        await blocking(hub.begin_tuning, session, metric, mode, tuner, horizon)
        return JSON({"tuning": True})

    @endpoint
    async def study_log(request: Request) -> Response:
        session = session_of(request)
        if request.method == "GET":
            return JSON({"log": await blocking(session.study.read_log)})
        record = _object(await _body(request, {"record"}), "record")
        await blocking(session.study.append_log, record)
        return JSON({"ok": True})

    @endpoint
    async def trials(request: Request) -> Response:
        session = session_of(request)
        history = request.query_params.get("history", "1") not in ("0", "false")
        records = await blocking(session.study.trials, history)
        return JSON({"trials": [record_to_json(r) for r in records]})

    @endpoint
    async def best(request: Request) -> Response:
        session = session_of(request)
        metric = request.query_params.get("metric", "")
        mode = request.query_params.get("mode", "max")
        if not metric:
            raise RequestRefusedError(400, "BadRequest", "query parameter 'metric' is required")
        record = await blocking(session.study.best, metric, mode)
        return JSON({"trial": None if record is None else record_to_json(record)})

    @endpoint
    async def stats(request: Request) -> Response:
        session = session_of(request)
        return JSON({"stats": await blocking(session.study.stats)})

    @endpoint
    async def progress(request: Request) -> Response:
        session = session_of(request)
        return JSON({"stats": await blocking(session.study.progress)})

    @endpoint
    async def failures(request: Request) -> Response:
        session = session_of(request)
        out = await blocking(session.study.failures)
        return JSON(
            {
                "failures": [
                    [
                        tid,
                        {
                            "type": e.type,
                            "message": e.message,
                            "traceback": e.traceback,
                            "where": e.where,
                        },
                    ]
                    for tid, e in out
                ]
            }
        )

    @endpoint
    async def workers(request: Request) -> Response:
        session = session_of(request)

        def read() -> dict[str, Any]:
            count = session.study.num_workers
            return {
                "num_workers": count,
                "locations": {str(k): v for k, v in session.study.worker_locations().items()},
            }

        return JSON(await blocking(read))

    async def _point(request: Request) -> tuple[Session, dict[str, Any], dict[str, Any], int]:
        session = session_of(request)
        data = await _body(request, {"config", "hp", "step"})
        step = _steps(data, "step")
        config, hp = _trial(data)
        return session, config, hp, step

    @endpoint
    async def evaluate(request: Request) -> Response:
        session, config, hp, step = await _point(request)
        return JSON({"metrics": await blocking(session.study.eval, config, hp, step)})

    @endpoint
    async def state(request: Request) -> Response:
        session, config, hp, step = await _point(request)

        def read() -> bytes | None:
            loaded = session.study.state(config, hp, step)
            return None if loaded is None else b"".join(encode(loaded))

        raw = await blocking(read)
        if raw is None:
            return Response(status_code=204)
        return Response(raw, media_type="application/octet-stream")

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        what = "no such endpoint" if status == 404 else "method not allowed"
        return _error(
            RequestRefusedError(
                status, "BadRequest", f"{what}: {request.method} {request.url.path}"
            )
        )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await run_in_threadpool(hub.close)

    s = "/v1/sessions/{sid}"
    routes = [
        Route("/v1/info", info, methods=["GET"]),
        Route("/v1/studies", open_study, methods=["POST"]),
        Route(s, close_session, methods=["DELETE"]),
        Route(f"{s}/submissions", submit, methods=["POST"]),
        Route(f"{s}/submissions/{{sub}}", cancel, methods=["DELETE"]),
        Route(f"{s}/results", results, methods=["GET"]),
        Route(f"{s}/check", check, methods=["POST"]),
        Route(f"{s}/declare", declare, methods=["POST"]),
        Route(f"{s}/tuning", tuning, methods=["POST", "DELETE"]),
        Route(f"{s}/log", study_log, methods=["GET", "POST"]),
        Route(f"{s}/trials", trials, methods=["GET"]),
        Route(f"{s}/best", best, methods=["GET"]),
        Route(f"{s}/stats", stats, methods=["GET"]),
        Route(f"{s}/progress", progress, methods=["GET"]),
        Route(f"{s}/failures", failures, methods=["GET"]),
        Route(f"{s}/workers", workers, methods=["GET"]),
        Route(f"{s}/eval", evaluate, methods=["POST"]),
        Route(f"{s}/state", state, methods=["POST"]),
        _Dashboard("/", app=_dashboard(hub, token)),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: not_found},
        lifespan=lifespan,
    )
    app.add_middleware(_Guard, token=token)
    app.add_middleware(HostGuard, allowed=allowed)  # outermost: before anything else
    return app
