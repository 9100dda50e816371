"""The dashboard's web layer (Starlette): the JSON API of ``docs/dashboard-api.md`` over
:mod:`stagetree.reports.views`, and the static pages.

* **Reads.** Every query runs in Starlette's thread pool (the event loop never waits on
  the storage) inside ``reader()``: a context manager that yields the storage. Standalone
  (``stagetree dashboard``) that is a read-only handle; in a tuning server it is the
  engine's :meth:`~stagetree.engine.core.Engine.reading`, which holds the engine's lock, so
  reads are short and never span an ``await``: the stage tree is read under the lock
  (:func:`~stagetree.reports.views.read_tree`) and computed after it is released.
* **Live updates.** ``GET /api/changes?after=REV`` polls the storage's revision (every
  0.2 s, a short read each) until it exceeds ``REV``, the timeout passes, the client
  goes away or the server stops; a change is answered at the pace of :class:`Pacer`
  (at once for small studies). Trees are kept per study for the last few revisions
  (:class:`TreeCache`), so that ``tree?after=REV`` sends only the nodes that changed;
  a tree is built from the last one kept (its unchanged nodes are shared). The answers
  of the views that depend on the plan alone (curves, trials table) are kept while the
  revision they were read at is current (:class:`AnswerCache`).
* **Authentication.** With a token, every ``/api`` request needs it: ``Authorization:
  Bearer <token>``, or the cookie that ``?token=<token>`` on any page sets (HttpOnly,
  SameSite=Strict), so that a browser's later requests carry it. Tokens are compared
  with :func:`hmac.compare_digest` and never logged. Pages themselves hold no data.

Nothing here writes to the storage.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from stagetree.checkpoints import CheckpointStore, LocalByteStore, open_byte_store
from stagetree.checkpoints.format import REF_RE
from stagetree.checkpoints.location import default_checkpoint_dir
from stagetree.exceptions import PlanKeyError, RequestRefusedError
from stagetree.reports import trials as reports
from stagetree.reports import views
from stagetree.web.auth import check_authorization
from stagetree.web.hosts import HostGuard

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage

__all__ = [
    "STATIC_DIR",
    "TOKEN_COOKIE",
    "AnswerCache",
    "Pacer",
    "Reader",
    "TreeCache",
    "create_dashboard_app",
]

log = logging.getLogger("stagetree.dashboard")

#: The pages and their scripts, shipped in the wheel.
STATIC_DIR = Path(__file__).parent / "static"

#: The cookie that carries the token after ``?token=`` (HttpOnly, SameSite=Strict).
TOKEN_COOKIE = "stagetree_token"

#: ``reader()`` -> a context manager yielding the storage to read (held briefly).
Reader = Callable[[], AbstractContextManager["BasePlanStorage"]]

_POLL = 0.2  # seconds between two reads of the revision in a long-poll
_DEFAULT_WAIT = 25.0
_MAX_WAIT = 60.0
_T = TypeVar("_T")


def render(content: Any) -> bytes:
    """Strict JSON (no NaN: :mod:`stagetree.reports.views` sends None for them)."""
    try:
        text = json.dumps(content, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite number slipped through: null, as promised
        text = json.dumps(_finite(content), separators=(",", ":"))
    return text.encode()


class JSON(Response):
    """A response of :func:`render`'s JSON (of ``content``, or ``body`` as rendered)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else render(content)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _error(status: int, message: str) -> JSON:
    return JSON({"error": message}, status_code=status)


class TreeCache:
    """Full trees of the last few revisions of each study, for deltas: at most
    ``per_study`` revisions per study and ``studies`` studies (least recently used
    first out). Thread-safe."""

    def __init__(self, per_study: int = 8, studies: int = 16) -> None:
        self.per_study = per_study
        self.studies = studies
        self._trees: OrderedDict[str, OrderedDict[int, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str, revision: int) -> dict[str, Any] | None:
        """The tree of ``name`` at ``revision``, if kept."""
        with self._lock:
            kept = self._trees.get(name)
            if kept is None or revision not in kept:
                return None
            self._trees.move_to_end(name)
            return kept[revision]

    def latest(self, name: str) -> dict[str, Any] | None:
        """The kept tree of ``name`` of the latest revision, if any."""
        with self._lock:
            kept = self._trees.get(name)
            return kept[max(kept)] if kept else None

    def put(self, name: str, tree: dict[str, Any]) -> None:
        """Keep ``tree`` (a full tree, with its ``revision``)."""
        with self._lock:
            kept = self._trees.setdefault(name, OrderedDict())
            self._trees.move_to_end(name)
            kept[int(tree["revision"])] = tree
            kept.move_to_end(int(tree["revision"]))
            while len(kept) > self.per_study:
                kept.popitem(last=False)
            while len(self._trees) > self.studies:
                self._trees.popitem(last=False)


class AnswerCache:
    """Rendered answers of the views that are functions of the plan alone (the curves
    and the trials table: no clock, no leases), kept for the revision they were read
    at: while the storage's revision stays there (a finished study, a page switching
    between its tabs) the same request is answered without reading or rendering
    again. At most ``size`` answers (least recently used first out). Thread-safe.

    An answer carries the revision read before its data, so its data is at least that
    new: it is only served while the storage is still at that revision (never at 0,
    the revision of a storage whose writers do not keep it)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._kept: OrderedDict[tuple[Any, ...], tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], revision: int) -> bytes | None:
        """The body kept for ``key`` at ``revision``, if any."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is None or kept[0] != revision or revision <= 0:
                return None
            self._kept.move_to_end(key)
            return kept[1]

    def put(self, key: tuple[Any, ...], revision: int, body: bytes) -> None:
        """Keep ``body``, the answer to ``key`` read at ``revision``."""
        with self._lock:
            self._kept[key] = (revision, body)
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)


class Pacer:
    """Paces live updates by what answering them costs: a long-poll that finds a change
    answers no sooner than ``factor`` times the recent cost of a view after it was
    asked (at most ``most`` seconds), so that a page following a study that changes
    all the time spends at most about ``factor / (factor + 1)`` of the time (and of a
    server engine's lock) on reads. A change that finds the page waiting is answered at
    once, and small studies cost milliseconds: their updates are immediate.

    The recent cost is the largest answer's, halving every ``half_life`` seconds.
    """

    def __init__(self, factor: float = 1.0, most: float = 2.0, half_life: float = 2.0) -> None:
        self.factor = factor
        self.most = most
        self.half_life = half_life
        self._cost = 0.0
        self._at = 0.0

    def cost(self, now: float | None = None) -> float:
        """The recent cost of an answer, in seconds."""
        now = time.monotonic() if now is None else now
        return self._cost * 0.5 ** (max(now - self._at, 0.0) / self.half_life)

    def record(self, seconds: float, now: float | None = None) -> None:
        """One view answered in ``seconds``."""
        now = time.monotonic() if now is None else now
        self._cost, self._at = max(seconds, self.cost(now)), now

    def gap(self, now: float | None = None) -> float:
        """Seconds between a long-poll's arrival and its answer to a change, at least."""
        return min(self.cost(now) * self.factor, self.most)


#: The largest id or revision a storage holds (a 64-bit integer).
_MAX_ID = 2**63 - 1


def _int_param(request: Request, name: str, default: int = 0) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise RequestRefusedError(
            400, "BadRequest", f"{name!r} must be an integer, got {raw!r:.40}"
        ) from None
    if not 0 <= value <= _MAX_ID:
        raise RequestRefusedError(
            400, "BadRequest", f"{name!r} must be from 0 to 2**63-1, got {raw:.40}"
        )
    return value


def _id_param(request: Request, name: str) -> int:
    """A path id (``{node:int}``, ``{trial:int}``); beyond what a storage holds: 404."""
    value = int(request.path_params[name])
    if value > _MAX_ID:
        raise RequestRefusedError(404, "NotFound", f"no {name} {value!s:.40}")
    return value


def _wait_param(request: Request) -> float:
    raw = request.query_params.get("timeout")
    if raw is None or raw == "":
        return _DEFAULT_WAIT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise RequestRefusedError(
            400, "BadRequest", f"'timeout' must be seconds >= 0, got {raw!r:.40}"
        )
    return min(value, _MAX_WAIT)


_FILENAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _filename(study: str, trial: int, step: int) -> str:
    safe = _FILENAME_UNSAFE.sub("_", study).strip("._") or "study"
    return f"{safe}-trial-{trial}-step-{step}.ckpt"


def _index() -> Response:
    index = STATIC_DIR / "index.html"
    if index.is_file():
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})
    return HTMLResponse(
        "<!doctype html><title>stagetree</title><p>the dashboard's pages are missing"
    )


def create_dashboard_app(
    reader: Reader,
    *,
    url: str,
    token: str | None = None,
    checkpoints: str | os.PathLike[str] | CheckpointStore | None = None,
    stopping: Callable[[], bool] | None = None,
    allowed_hosts: frozenset[str] | None = None,
) -> Starlette:
    """The dashboard: the JSON API under ``/api`` and the pages.

    Args:
        reader: ``reader()`` gives a context manager yielding the plan storage
            (read-only use, held only for one read).
        url: the storage's URL as shown (no password).
        token: required on every ``/api`` request when given (see the module
            docstring); None: no authentication (loopback only, the caller checks).
        checkpoints: the checkpoint location (a path, an fsspec URL or a
            :class:`~stagetree.checkpoints.CheckpointStore`) that checkpoint downloads
            read; None: beside a SQLite plan (``default_checkpoint_dir``), else none.
        stopping: True once the server is shutting down: long-polls return at once.
        allowed_hosts: the host names requests may name in ``Host`` and ``Origin``
            (:class:`~stagetree.web.hosts.HostGuard`); None checks nothing.
    """
    trees = TreeCache()
    answers = AnswerCache()
    pacer = Pacer()
    activity = views.ActivityLog()  # the batches, read incrementally
    location = _checkpoint_location(url, checkpoints)

    def read(fn: Callable[..., _T], *args: Any) -> Awaitable[_T]:
        def run() -> _T:
            with reader() as storage:
                return fn(storage, *args)

        return run_in_threadpool(run)

    def rendered(fn: Callable[..., dict[str, Any]], *args: Any) -> Awaitable[tuple[int, bytes]]:
        """``(revision, JSON body)`` of a view: read under the reader, rendered after it
        in the same worker thread (not on the event loop), with the collector paused
        until the answer's objects are freed (:func:`stagetree.reports.trials.quiet_gc`)."""

        @reports.quiet_gc
        def run() -> tuple[int, bytes]:
            with reader() as storage:
                answer = fn(storage, *args)
            return int(answer.get("revision", 0)), render(answer)

        return run_in_threadpool(run)

    async def view(fn: Callable[..., dict[str, Any]], *args: Any) -> Response:
        """The JSON answer of a view (see :func:`rendered`)."""
        return JSON((await rendered(fn, *args))[1])

    def api(
        fn: Callable[[Request], Awaitable[Response]], paced: bool = True
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapper(request: Request) -> Response:
            began = time.monotonic()
            try:
                if token is not None:
                    _check_token(request, token)
                response = await fn(request)
                if paced:
                    pacer.record(time.monotonic() - began)
                return response
            except RequestRefusedError as exc:
                return _error(exc.status, exc.message)
            except PlanKeyError as exc:
                return await _not_found(request, exc)
            except Exception:
                log.exception("dashboard request %s failed", request.url.path)
                return _error(500, "internal error (see the dashboard's log)")

        return wrapper

    async def _not_found(request: Request, exc: PlanKeyError) -> Response:
        name = request.path_params.get("name")
        if name is not None:
            known = [s["name"] for s in await read(lambda s: s.studies())]
            if name not in known:
                listed = ", ".join(known) or "none"
                return _error(404, f"no study {name!r} in {url}; studies: {listed}")
        return _error(404, str(exc))

    async def tree_of(name: str) -> dict[str, Any]:
        kept = trees.get(name, await read(lambda s: s.revision()))
        if kept is not None:  # (an unknown study has no trees kept)
            return kept
        data = await read(views.read_tree, name, activity)  # the reads, under the reader
        kept = trees.get(name, data.revision)
        if kept is None:
            # The computing, after; nodes that did not change are the last tree's.
            kept = await run_in_threadpool(views.build_tree, data, trees.latest(name))
            trees.put(name, kept)
        return kept

    @api
    async def studies(request: Request) -> Response:
        return await view(views.study_summaries, url)

    @api
    async def study(request: Request) -> Response:
        return await view(views.study_detail, request.path_params["name"], activity)

    @api
    async def tree(request: Request) -> Response:
        name = request.path_params["name"]
        after = request.query_params.get("after")
        current = await tree_of(name)
        old = trees.get(name, _int_param(request, "after")) if after else None
        if old is None:  # the whole tree (no cursor, or one no longer kept)
            return JSON(await run_in_threadpool(render, current))
        return JSON(await run_in_threadpool(lambda: render(views.tree_delta(old, current))))

    @api
    async def node(request: Request) -> Response:
        name, node_id = request.path_params["name"], _id_param(request, "node")
        current = await tree_of(name)
        return await view(views.node_detail, name, node_id, current)

    async def kept(key: tuple[Any, ...], fn: Callable[..., dict[str, Any]], *args: Any) -> Response:
        """The answer of ``fn`` (a view of the plan alone), from :class:`AnswerCache`
        while the revision it was read at is current."""
        body = answers.get(key, await read(lambda s: s.revision()))
        if body is None:
            revision, body = await rendered(fn, *args)
            answers.put(key, revision, body)
        return JSON(body)

    @api
    async def curves(request: Request) -> Response:
        name, metric = request.path_params["name"], request.query_params.get("metric") or None
        return await kept(("curves", name, metric), views.curves, name, metric)

    @api
    async def trials(request: Request) -> Response:
        name = request.path_params["name"]
        return await kept(("trials", name), views.trials_table, name)

    @api
    async def timeline(request: Request) -> Response:
        after = _int_param(request, "after")
        return await view(views.timeline, request.path_params["name"], after, activity)

    @api
    async def checkpoint(request: Request) -> Response:
        name, trial = request.path_params["name"], _id_param(request, "trial")
        found = await read(views.checkpoint_of, name, trial)
        if found is None:
            return _error(404, f"trial {trial} of study {name!r} has no checkpoint at its end")
        ref, step, _nbytes = found
        headers = {
            "Content-Disposition": f"attachment; filename={_filename(name, trial, step)}",
            "Cache-Control": "no-store",
        }
        return await _download(location, ref, headers)

    async def changes(request: Request) -> Response:
        after = _int_param(request, "after")
        arrived = time.monotonic()
        deadline = arrived + _wait_param(request)
        changed = False
        while True:
            revision = await read(lambda s: s.revision())
            now = time.monotonic()
            changed = changed or revision > after
            # A change is answered once the pace allows; no change by the deadline.
            due = arrived + pacer.gap(now) if changed else deadline
            ended = await request.is_disconnected() or (stopping is not None and stopping())
            if now >= due or ended:
                return JSON({"revision": revision})
            await anyio.sleep(min(_POLL, due - now))

    @api
    async def no_endpoint(request: Request) -> Response:
        return _error(404, f"no such endpoint: {request.method} {request.url.path}")

    async def page(request: Request) -> Response:
        given = request.query_params.get("token")
        if token is None or given is None:
            return _index()
        if not hmac.compare_digest(given.encode(), token.encode()):
            return _error(403, "wrong token")
        # Keep the token out of the address bar and the history: the cookie carries it.
        rest = request.url.remove_query_params("token")
        target = rest.path + (f"?{rest.query}" if rest.query else "")
        response = RedirectResponse(target, 303)
        _set_cookie(response, request, token)
        return response

    s = "/api/studies/{name}"
    routes = [
        Route("/api/studies", studies),
        Route(s, study),
        Route(f"{s}/tree", tree),
        Route(f"{s}/nodes/{{node:int}}", node),
        Route(f"{s}/curves", curves),
        Route(f"{s}/trials", trials),
        Route(f"{s}/trials/{{trial:int}}/checkpoint", checkpoint),
        Route(f"{s}/timeline", timeline),
        Route("/api/changes", api(changes, paced=False)),
        Route("/api/{rest:path}", no_endpoint, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR, check_dir=False), name="static"),
        Route("/{path:path}", page),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(GZipMiddleware, minimum_size=2048, compresslevel=5)
    app.add_middleware(HostGuard, allowed=allowed_hosts, body=lambda m: render({"error": m}))
    return app


def _given_token(request: Request) -> str | None:
    """The token a request carries: the ``?token=`` parameter, else the cookie."""
    return request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE)


def _check_token(request: Request, token: str) -> None:
    """Accept ``Authorization: Bearer``, ``?token=`` or the cookie.

    Raises:
        RequestRefusedError: 401 without a token, 403 with a wrong one.
    """
    header = request.headers.get("authorization")
    if header:
        check_authorization(header, token)
        return
    given = _given_token(request)
    if not given:
        raise RequestRefusedError(
            401,
            "AuthError",
            "this dashboard needs its token: open it with ?token=<token> (the token is in "
            "the file given to --token-file) or send 'Authorization: Bearer <token>'",
        )
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise RequestRefusedError(403, "AuthError", "wrong token")


def _set_cookie(response: Response, request: Request, token: str) -> None:
    response.set_cookie(
        TOKEN_COOKIE,
        token,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )


def _checkpoint_location(
    url: str, checkpoints: str | os.PathLike[str] | CheckpointStore | None
) -> Any:
    """Where checkpoint downloads read: ``checkpoints``, else beside a SQLite plan."""
    if checkpoints is not None:
        return checkpoints
    if url.startswith("sqlite:///"):
        return default_checkpoint_dir(url)[0]
    return None


async def _download(location: Any, ref: str, headers: dict[str, str]) -> Response:
    """The checkpoint ``ref`` of ``location`` as an octet stream (404 JSON when the
    store does not hold it). A local directory is streamed from disk and never
    created; any other store is read through its byte store."""
    if not REF_RE.fullmatch(ref):
        return _error(404, f"the plan's checkpoint reference {ref!r} is not a checkpoint name")
    if location is None:
        return _error(404, "this dashboard has no checkpoint location (pass --checkpoints)")
    store = location.bytes if isinstance(location, CheckpointStore) else None
    directory: Path | None = None
    if isinstance(store, LocalByteStore):
        directory = store.directory
    elif store is None and (isinstance(location, os.PathLike) or "://" not in str(location)):
        directory = Path(location)
    elif store is None and str(location).startswith("file://"):
        directory = Path(str(location)[len("file://") :])
    if directory is not None:
        path = directory / ref
        if not path.is_file():
            return _error(404, f"checkpoint {ref} is not in {directory} (evicted or moved?)")
        return FileResponse(path, media_type="application/octet-stream", headers=headers)

    def fetch() -> bytes | None:
        byte_store = store if store is not None else open_byte_store(str(location))
        with contextlib.suppress(FileNotFoundError):
            return bytes(byte_store.get(ref))
        return None

    try:
        raw = await run_in_threadpool(fetch)
    except Exception as exc:
        return _error(502, f"cannot read checkpoint {ref} from {location}: {exc}")
    if raw is None:
        return _error(404, f"checkpoint {ref} is not in {location} (evicted or moved?)")
    return Response(raw, media_type="application/octet-stream", headers=headers)
