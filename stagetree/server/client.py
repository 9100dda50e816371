""":class:`RemoteStudy`: a :class:`~stagetree.Study` whose study runs on a tuning server.

``Study(name, trainer, url="http://host:8642", token=...)`` (or ``STAGETREE_URL``, or
``stagetree run --url``) returns one. It has the same API and return types as a local
study and raises the same exceptions; the tuner runs here (``tune`` is the local one,
calling the public methods below over HTTP), the engine, workers and plan there.

* **Session.** Opened on first use (a module that builds a study stays inert), renewed
  by every call. While submissions are pending (or a tuner runs) one poller thread
  long-polls the server for results (which also renews the session) and resolves the
  submissions' futures.
* **Reconnects.** When the server cannot be reached, calls retry with exponential
  backoff (up to 2 s apart) for ``STAGETREE_RECONNECT_TIMEOUT`` seconds (120), then
  raise :class:`~stagetree.exceptions.ServerUnavailableError`. When the server answers
  again but no longer knows the session (it restarted, or the session expired), a new
  session is opened, the tuning lease taken again if a tuner runs (waiting while the
  dead server's lease in the plan is still live), and every pending submission is
  submitted again (idempotent: the plan has the trial; known metrics answer at once).
  The tuner notices nothing but the delay.
* **Server-side arguments.** The placement (``storage``, ``checkpoint_dir``,
  ``checkpoint_budget``) and the engine settings (``workers``, ``executor``, ``policy``,
  ``max_retries``, ``threads_per_worker``, ``eval_every``, ``max_fused``,
  ``checkpoint_every``, ``devices_per_worker``, ``step_timeout``, ``stop_timeout``) are
  the server's business: accepted, as by a local study, and ignored (a warning, once,
  when one is not the default).
  ``share``, ``version``, ``weight`` and ``fuse`` are sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stagetree.checkpoints.format import decode
from stagetree.engine.settings import EngineSettings, Placement, current_overrides
from stagetree.exceptions import (
    InvalidTrialError,
    RemoteArgumentWarning,
    ServerError,
    ServerUnavailableError,
    StagetreeError,
    StudyBusyError,
    TrialCancelledError,
    VersionMismatchError,
)
from stagetree.identity import trainer_fingerprint
from stagetree.records import TrialError, TrialRecord
from stagetree.reports.export import dataframe, records_table, require
from stagetree.server._http import Connection, SessionLost, Unreachable
from stagetree.server.protocol import (
    MAX_POLL,
    PROTOCOL_VERSION,
    error_from_json,
    hp_to_json,
    record_from_json,
    result_from_json,
)
from stagetree.server.trainers import trainer_payload
from stagetree.study_api import StudyAPI, StudyArguments, check_weight, remote_url
from stagetree.tuners.base import TrialResult
from stagetree.web.auth import client_token

__all__ = ["RemoteArgumentWarning", "RemoteStudy"]


# The arguments that are the server's (its placement and engine settings), in the
# order a study takes them, with their defaults: a remote study warns about the others.
_SERVER_NAMES = {
    f.name for f in (*dataclasses.fields(Placement), *dataclasses.fields(EngineSettings))
}
_SERVER_SIDE = {
    f.name: f.default for f in dataclasses.fields(StudyArguments) if f.name in _SERVER_NAMES
}
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()
_MAX_REOPEN = 10


@dataclass(eq=False)
class _Pending:
    """A submission waiting for its result: its request body and future."""

    id: str
    body: dict[str, Any]
    future: concurrent.futures.Future[Any]
    cancelled: bool = False


class RemoteStudy(StudyAPI):
    """A study run by a tuning server (see the module docstring); built by
    ``Study(..., url=...)``, it takes the same arguments as a local study
    (:class:`~stagetree.study_api.StudyAPI`)."""

    def _configure(self, args: StudyArguments) -> None:
        fuse, share, trainer = args.fuse, args.share, args.trainer
        if fuse is not True and fuse is not False and fuse != "auto":
            raise ValueError(f'fuse must be True, False or "auto", got {fuse!r}')
        self.fuse = fuse
        # Root keys of a fusing study (Study.root_key); "auto" is the server's to decide.
        self.fusible = frozenset(getattr(trainer, "fusible", ())) if fuse is True else frozenset()
        if not isinstance(share, bool):
            raise ValueError(f"share must be True or False, got {share!r}")
        self.url = remote_url(args.url)
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be like 'http://host:8642', got {self.url!r}")
        _warn_ignored({name: getattr(args, name) for name in _SERVER_SIDE})
        self.name = args.name
        self.trainer = trainer
        self.share = share
        self.weight = check_weight(args.weight)
        self.eval_every = args.eval_every or 0
        self.version = args.version if args.version is not None else trainer_fingerprint(trainer)
        self._token = client_token(args.token, current_overrides().token)
        self._arguments = dataclasses.replace(
            args, url=self.url, token=self._token, version=self.version, weight=self.weight
        )
        self._closed = False
        self._started = time.monotonic()
        self._conn: Connection | None = None
        self._payload: dict[str, Any] | None = None
        self._lock = threading.RLock()  # session, generation, pending, tuning
        self._session: str | None = None
        self._generation = 0
        self._ttl = 15.0
        self._cursor = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._pending: dict[str, _Pending] = {}
        self._tuning: tuple[str, str, str, int] | None = None
        self._wake = threading.Condition(self._lock)
        self._poller: threading.Thread | None = None
        self._cancels: concurrent.futures.ThreadPoolExecutor | None = None

    # -- life cycle --------------------------------------------------------------------

    def open(self) -> RemoteStudy:
        """Open the session now (it is otherwise opened on first use); returns self.

        Raises:
            ServerUnavailableError, AuthError, VersionMismatchError, ServerError.
        """
        self._ensure_session()
        return self

    # -- session -------------------------------------------------------------------------

    def _connection(self) -> Connection:
        if self._closed:
            raise StagetreeError(f"study {self.name!r} is closed")
        if self._conn is None:
            self._conn = Connection(self.url, self._token)
        return self._conn

    def _ensure_session(self) -> tuple[int, str]:
        with self._lock:
            if self._session is None:
                self._open_session()
            assert self._session is not None
            return self._generation, self._session

    def _lost(self, generation: int) -> None:
        """The server lost session ``generation``: the next call opens a new one (unless
        another thread already did)."""
        with self._lock:
            if self._generation == generation:
                self._session = None

    def _open_session(self) -> None:
        """Open a session (lock held): the study, then the tuning lease again if a tuner
        runs, then every pending submission again."""
        conn = self._connection()
        if self._payload is None:
            self._payload = trainer_payload(self.trainer)
        body = {
            "name": self.name,
            "trainer": self._payload,
            "protocol": PROTOCOL_VERSION,
            "version": self.version,
            "share": self.share,
            "weight": self.weight,
            "client": f"{socket.gethostname()}:{os.getpid()}",
            **({"fuse": self.fuse} if self.fuse is not False else {}),
        }
        data = conn.retrying(functools.partial(conn.request, "POST", "/v1/studies", json=body))
        if data.get("protocol") != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"the server at {self.url} speaks stagetree protocol {data.get('protocol')} "
                f"(stagetree {data.get('stagetree')}), this client protocol {PROTOCOL_VERSION}: "
                "install the same stagetree version on both sides"
            )
        sid = str(data["session"])
        self._ttl = float(data.get("lease_ttl", self._ttl))
        self._generation += 1
        self._session = sid
        self._cursor = 0
        try:
            if self._tuning is not None:
                self._retake_tuning(conn, sid, self._tuning)
            for pending in list(self._pending.values()):
                try:
                    conn.retrying(
                        functools.partial(
                            conn.request,
                            "POST",
                            f"/v1/sessions/{sid}/submissions",
                            json=pending.body,
                        )
                    )
                except ServerError:
                    raise  # unreachable, refused token...: the whole reopen failed
                except StagetreeError as exc:  # this submission was refused: say so to it
                    self._pending.pop(pending.id, None)
                    if not pending.future.done():
                        pending.future.set_exception(exc)
        except (SessionLost, ServerError):
            self._session = None
            raise
        self._wake.notify_all()

    def _retake_tuning(self, conn: Connection, sid: str, args: tuple[str, str, str, int]) -> None:
        """Take the tuning lease again, waiting while a dead server's lease in the plan
        is still live (it expires after its ttl)."""
        metric, mode, tuner, horizon = args
        body = {"metric": metric, "mode": mode, "tuner": tuner, "horizon": horizon}
        deadline = time.monotonic() + conn.give_up
        while True:
            try:
                conn.retrying(
                    functools.partial(conn.request, "POST", f"/v1/sessions/{sid}/tuning", json=body)
                )
                return
            except StudyBusyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(min(1.0, self._ttl / 4))

    def _call(self, method: str, path: str, *, retry: bool = True, **kw: Any) -> Any:
        """A request on this study's session (``path`` below it), reconnecting as the
        module docstring says (``retry=False``: one attempt on the current session;
        :class:`~stagetree.exceptions.ServerUnavailableError` when it gets no answer)."""
        for _ in range(_MAX_REOPEN):
            generation = self._generation
            try:
                generation, sid = self._ensure_session()
                conn = self._connection()
                if not retry:
                    try:
                        return conn.request(method, f"/v1/sessions/{sid}{path}", **kw)
                    except (Unreachable, SessionLost) as exc:
                        raise ServerUnavailableError(f"{self.url}: {exc}") from None
                return conn.retrying(
                    functools.partial(conn.request, method, f"/v1/sessions/{sid}{path}", **kw)
                )
            except SessionLost:
                self._lost(generation)
        raise ServerError(f"the server at {self.url} keeps losing this client's session")

    # -- submissions ---------------------------------------------------------------------

    async def submit(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int
    ) -> TrialResult:
        """As :meth:`Study.submit`, on the server (the result comes by the long-poll).

        Raises:
            InvalidTrialError, TrialFailedError (with the worker's traceback),
            TrialCancelledError, ServerUnavailableError.
        """
        body: dict[str, Any] = {
            "id": f"{self._prefix}-{next(self._ids)}",
            "config": _config(config, hp),
            "hp": hp_to_json(hp),
            "steps": steps,
        }
        pending = _Pending(str(body["id"]), body, concurrent.futures.Future())
        with self._lock:
            self._pending[pending.id] = pending
            self._start_poller()
        try:
            await asyncio.to_thread(self._post, pending)
        except asyncio.CancelledError:
            self._cancel(pending)
            raise
        except BaseException:
            with self._lock:
                self._pending.pop(pending.id, None)
            raise
        try:
            data = await asyncio.wrap_future(pending.future)
        except asyncio.CancelledError:
            self._cancel(pending)
            raise
        return result_from_json(data)

    def _post(self, pending: _Pending) -> None:
        """Send a submission; one cancelled meanwhile is cancelled on the server too
        (the cancel request may have arrived first). A submission that ended at once (the
        plan knew its result) comes back with its event: resolve it now."""
        generation = self._generation
        answer = self._call("POST", "/submissions", json=pending.body)
        event = answer.get("event") if isinstance(answer, Mapping) else None
        if isinstance(event, Mapping) and event.get("id") == pending.id:
            self._resolve(generation, [event], advance=False)
        if pending.cancelled:
            with contextlib.suppress(Exception):
                self._call("DELETE", f"/submissions/{pending.id}", retry=False)

    def _cancel(self, pending: _Pending) -> None:
        """Forget ``pending`` and cancel it on the server in the background."""
        pending.cancelled = True
        with self._lock:
            if self._pending.pop(pending.id, None) is None:
                return
            if self._cancels is None:
                self._cancels = concurrent.futures.ThreadPoolExecutor(1, "stagetree-cancel")
        if not pending.future.done():
            pending.future.set_exception(TrialCancelledError(f"submission {pending.id}"))

        def cancel() -> None:
            with contextlib.suppress(Exception):  # gone with its session: nothing to do
                self._call("DELETE", f"/submissions/{pending.id}")

        self._cancels.submit(cancel)

    def _start_poller(self) -> None:
        if self._poller is None or not self._poller.is_alive():
            self._poller = threading.Thread(
                target=self._poll, name="stagetree-results", daemon=True
            )
            self._poller.start()
        self._wake.notify_all()

    def _poll(self) -> None:
        """Long-poll results while submissions are pending or a tuner runs (that also
        renews the session); resolve the submissions' futures."""
        stalled = False
        while True:
            generation = self._generation
            with self._lock:
                while not self._closed and not (
                    self._pending or (self._tuning is not None and not stalled)
                ):
                    self._wake.wait()
                if self._closed:
                    return
            try:
                generation, sid = self._ensure_session()
                cursor = self._cursor
                timeout = min(MAX_POLL, self._ttl / 2)
                conn = self._connection()
                data = conn.retrying(
                    functools.partial(
                        conn.request,
                        "GET",
                        f"/v1/sessions/{sid}/results",
                        params={"after": cursor, "timeout": timeout},
                        timeout=timeout + 30,
                    )
                )
            except SessionLost:
                self._lost(generation)
                continue
            except Exception as exc:  # unreachable for good, or closed: fail the waiting
                if self._closed:
                    return
                self._fail_pending(exc)
                stalled = True
                continue
            stalled = False
            self._deliver(generation, data.get("events", []))

    def _deliver(self, generation: int, events: Iterable[Mapping[str, Any]]) -> None:
        self._resolve(generation, events, advance=True)

    def _resolve(self, generation: int, events: Iterable[Mapping[str, Any]], advance: bool) -> None:
        """Resolve the submissions ``events`` answer; ``advance``: they came by the
        long-poll, whose cursor moves past them (an event a submit's answer carried is
        acknowledged by a later long-poll)."""
        with self._lock:
            if generation != self._generation:
                return  # events of a replaced session: its submissions were sent again
            done = []
            for event in events:
                if advance:
                    self._cursor = max(self._cursor, int(event["seq"]))
                pending = self._pending.pop(str(event["id"]), None)
                if pending is not None:
                    done.append((pending, event))
        for pending, event in done:
            if pending.future.done():
                continue
            if "result" in event:
                pending.future.set_result(event["result"])
            else:
                pending.future.set_exception(error_from_json(400, {"error": event.get("error")}))

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            if not p.future.done():
                p.future.set_exception(exc)

    # -- the tuner's other calls -----------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return int(self._call("GET", "/workers")["num_workers"])

    def worker_locations(self) -> dict[int, str]:
        """Where the server's workers run (worker -> node), with a cluster executor."""
        locations = self._call("GET", "/workers")["locations"]
        return {int(k): str(v) for k, v in locations.items()}

    def declare(self, trials: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
        pairs = [[_config(config, hp), hp_to_json(hp)] for config, hp in trials]
        self._call("POST", "/declare", json={"trials": pairs})

    def check(self, config: Mapping[str, Any], hp: Mapping[str, Any]) -> None:
        self._call("POST", "/check", json={"config": _config(config, hp), "hp": hp_to_json(hp)})

    def begin_tuning(self, metric: str, mode: str, tuner: str, horizon: int = 0) -> None:
        body = {"metric": metric, "mode": mode, "tuner": tuner, "horizon": int(horizon)}
        self._call("POST", "/tuning", json=body)
        with self._lock:
            self._tuning = (metric, mode, tuner, int(horizon))
            self._start_poller()

    def end_tuning(self) -> None:
        """Release the tuning lease (one attempt: a server that cannot be reached
        releases it when the session expires)."""
        with self._lock:
            self._tuning = None
            if self._closed or self._session is None:
                return
        with contextlib.suppress(ServerUnavailableError):
            self._call("DELETE", "/tuning", retry=False)

    def read_log(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/log")["log"])

    def append_log(self, record: Mapping[str, Any]) -> None:
        self._call("POST", "/log", json={"record": dict(record)})

    # -- reports -------------------------------------------------------------------------

    def trials(self, history: bool = True) -> list[TrialRecord]:
        params = None if history else {"history": "0"}
        return [record_from_json(t) for t in self._call("GET", "/trials", params=params)["trials"]]

    def best(self, metric: str, mode: str = "max") -> TrialRecord | None:
        raw = self._call("GET", "/best", params={"metric": metric, "mode": mode})["trial"]
        return None if raw is None else record_from_json(raw)

    def stats(self) -> dict[str, float]:
        return _figures(self._call("GET", "/stats")["stats"])

    def progress(self) -> dict[str, float]:
        out = _figures(self._call("GET", "/progress")["stats"])
        out["elapsed"] = time.monotonic() - self._started  # this object's age, as locally
        return out

    def failures(self) -> list[tuple[int, TrialError]]:
        out = []
        for tid, error in self._call("GET", "/failures")["failures"]:
            parsed = TrialError.from_attrs({"error": error})
            out.append((int(tid), parsed or TrialError("Error", "no error was recorded")))
        return out

    def trials_dataframe(self, history: bool = False) -> Any:
        """As :meth:`Study.trials_dataframe`, from the server's trial records.

        Raises:
            MissingExtraError: pandas is not installed.
        """
        require("pandas", "pandas", "a DataFrame of trials")  # before asking the server
        found = [(self.name, record) for record in self.trials()]
        return dataframe(records_table(found, history))

    def eval(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, float] | None:
        body = {"config": _config(config, hp), "hp": hp_to_json(hp), "step": step}
        metrics = self._call("POST", "/eval", json=body)["metrics"]
        return None if metrics is None else {str(k): float(v) for k, v in metrics.items()}

    def state(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], step: int
    ) -> dict[str, Any] | None:
        body = {"config": _config(config, hp), "hp": hp_to_json(hp), "step": step}
        raw = self._call("POST", "/state", json=body, raw=True)
        return None if raw is None else decode(raw, "cpu")

    # -- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        """End the session (pending submissions are cancelled on the server)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sid, self._session = self._session, None
            self._wake.notify_all()
        conn = self._conn
        if conn is not None:
            conn.closed.set()  # retries end now
        self._fail_pending(TrialCancelledError(f"the study {self.name!r} was closed"))
        if self._cancels is not None:
            self._cancels.shutdown(wait=False)
        if conn is None:
            return
        if sid is not None:
            with contextlib.suppress(Exception):  # the server forgets it after its ttl anyway
                conn.request("DELETE", f"/v1/sessions/{sid}", timeout=5.0)
        conn.close()


def _config(config: Any, hp: Any) -> dict[str, Any]:
    """A trial's fixed config as it travels (JSON; NaN is refused by the server as by a
    local study).

    Raises:
        InvalidTrialError: not mappings, or a config that is not JSON.
    """
    if not isinstance(config, Mapping) or not isinstance(hp, Mapping):
        raise InvalidTrialError("config and hp must be mappings")
    cfg = dict(config)
    try:
        json.dumps(cfg)
    except (TypeError, ValueError) as exc:
        raise InvalidTrialError(
            f"config {cfg!r} cannot be a fixed configuration ({exc}): use finite numbers, "
            "strings, booleans, None, and lists or dicts of those"
        ) from None
    return cfg


def _warn_ignored(given: Mapping[str, Any]) -> None:
    """Warn once per process and argument when a server-side argument is not its default."""
    names = [k for k, v in given.items() if v != _SERVER_SIDE[k]]
    with _WARNED_LOCK:
        new = [n for n in names if n not in _WARNED]
        _WARNED.update(new)
    if new:
        warnings.warn(
            f"a remote study runs with the server's settings: {', '.join(new)} "
            "ignored (set them on `stagetree serve`)",
            RemoteArgumentWarning,
            stacklevel=3,
        )


def _figures(raw: Mapping[str, Any]) -> dict[str, float]:
    """A study's figures as the server sent them: counts stay ints, the rest floats."""
    return {str(k): v if isinstance(v, int) else float(v) for k, v in raw.items()}
