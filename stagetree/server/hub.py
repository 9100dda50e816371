"""What a tuning server owns: the studies, the clients' sessions and their submissions.

The hub calls only the public API of local :class:`~stagetree.Study` objects (created
with ``url=""``): one per (study name, trainer version, share, weight), kept open for
the server's life. Trainer classes come from the :class:`TrainerRegistry` (one class
object per version), so every study of one trainer version shares one engine: one
worker pool, shared stages.

* **Sessions.** A client opens one session per remote study. Every call renews it for
  the lease time-to-live (``ttl``); a long-poll renews it for its own wait plus the
  ttl. A session not heard from for the ttl is reaped: its pending submissions are
  cancelled through the study's cancel path (the awaiting task is cancelled, the engine
  releases the request; stages another live request needs go on) and its tuning lease
  is released.
* **Submissions** run as tasks of ``study.submit`` on the hub's own event loop thread
  (so a slow engine call never stalls the HTTP server). Their ids are chosen by the
  client and unique in a session: submitting an id twice does nothing (a client
  re-sends its in-flight submissions after a reconnect). A finished submission becomes
  an event ``{"seq": n, "id": ..., "result": {...}}`` or ``{"seq": n, "id": ...,
  "error": {...}}`` in the session's queue, which the client reads with a long-poll
  (:meth:`Hub.events`, ``after`` acknowledges what it has).
* **Tuning.** One session tunes a study at a time on this server; across processes the
  plan's study lease decides (:meth:`~stagetree.Study.begin_tuning`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.exceptions import RequestRefusedError, StudyBusyError
from stagetree.executors.base import BaseExecutor
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.registry import open_storage
from stagetree.server.protocol import error_to_json, result_to_json
from stagetree.server.trainers import TrainerRegistry
from stagetree.study import Study
from stagetree.study_api import check_weight

__all__ = ["Hub", "HubConfig", "Session"]

log = logging.getLogger("stagetree.server")


@dataclass(frozen=True)
class HubConfig:
    """How the server's studies run (the ``stagetree serve`` options).

    Attributes:
        storage: plan storage URL every study uses.
        executor: executor name (``local``, ``ray``, ``inline``...), or one executor
            object every study shares (``stagetree serve --executor ray --address``).
        workers: the size of the one worker pool every study shares (the storage's
            engine); None: the default.
        checkpoint_dir: checkpoint location; None: the study default.
        ttl: session lease time-to-live in seconds.
    """

    storage: str
    executor: str | BaseExecutor = "local"
    workers: int | None = None
    checkpoint_dir: str | None = None
    ttl: float = 15.0


@dataclass(eq=False)
class Session:
    """One client's view of one study. Guarded by ``lock`` (any thread)."""

    id: str
    study: Study
    client: str
    expires: float
    pending: dict[str, concurrent.futures.Future[None]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    events: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def push(self, sub_id: str, event: dict[str, Any] | None) -> None:
        """Record the end of submission ``sub_id`` (``event`` None: cancelled, no
        event) and wake the long-polls."""
        with self.lock:
            self.pending.pop(sub_id, None)
            self.finished.add(sub_id)
            if event is None:
                return
            self.seq += 1
            self.events.append({"seq": self.seq, "id": sub_id, **event})
            waiters, self.waiters = self.waiters, []
        for loop, ready in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(ready.set)


class Hub:
    """Studies, sessions and submissions of one server (see the module docstring)."""

    def __init__(self, config: HubConfig) -> None:
        self.config = config
        self.ttl = config.ttl
        self.registry = TrainerRegistry()
        self.closing = False
        self._studies: dict[tuple[str, str, bool, float, bool | str], Study] = {}
        self._sessions: dict[str, Session] = {}
        self._tuning: dict[str, str] = {}  # study name -> id of the session tuning it
        self._reader: BasePlanStorage | None = None  # read-only, before any study opens
        self._lock = threading.RLock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="stagetree-hub", daemon=True
        )
        self._thread.start()
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap_loop, name="stagetree-reaper", daemon=True
        )
        self._reaper.start()

    # -- sessions ------------------------------------------------------------------------

    def open(
        self,
        name: str,
        trainer: Any,
        version: str | None,
        share: bool,
        weight: float,
        client: str,
        fuse: bool | str = False,
    ) -> Session:
        """Open a session on study ``name`` (created or continued) with the trainer of
        payload ``trainer``; blocking (opens the storage).

        Raises:
            RequestRefusedError: a trainer the server cannot load, bad arguments.
            StorageError: the storage cannot be opened.
        """
        cls = self.registry.resolve(trainer)
        weight = check_weight(weight)
        version = version or str(trainer["fingerprint"])
        key = (name, version, share, weight, fuse)
        with self._lock:
            self._check_open()
            study = self._studies.get(key)
        if study is None:  # opened without the lock: other sessions' calls go on meanwhile
            made = Study(
                name,
                cls,
                storage=self.config.storage,
                workers=self.config.workers,
                executor=self.config.executor,
                checkpoint_dir=self.config.checkpoint_dir,
                share=share,
                version=version,
                weight=weight,
                url="",  # the server runs its studies itself
                fuse=fuse,
            )
            made.open()
            with self._lock:
                study = self._studies.setdefault(key, made)
            if study is not made:  # another session opened it first
                made.close()
        with self._lock:
            self._check_open()
            session = Session(secrets.token_hex(12), study, client, time.monotonic() + self.ttl)
            self._sessions[session.id] = session
        log.info("session %s: %s opened study %r", session.id, client, name)
        return session

    def session(self, sid: str, extra: float = 0.0) -> Session:
        """The live session ``sid``, renewed for the ttl (plus ``extra`` seconds).

        Raises:
            RequestRefusedError: 404 for an unknown (expired, closed, or a previous server's)
                session; 503 while the server shuts down.
        """
        with self._lock:
            self._check_open()
            session = self._sessions.get(sid)
            if session is None:
                raise RequestRefusedError(
                    404,
                    "SessionNotFound",
                    f"unknown session {sid!r}: it was closed, expired ({self.ttl:g} s without "
                    "a call) or opened on a server that has restarted since",
                )
            session.expires = max(session.expires, time.monotonic() + self.ttl + extra)
            return session

    def close_session(self, session: Session, reason: str = "closed") -> None:
        """End ``session``: cancel its pending submissions, release its tuning lease."""
        with self._lock:
            if self._sessions.pop(session.id, None) is None:
                return
            tuning = self._tuning.get(session.study.name) == session.id
            if tuning:
                del self._tuning[session.study.name]
        with session.lock:
            pending = list(session.pending.items())
        for sub_id, fut in pending:
            fut.cancel()
            session.push(sub_id, None)
        if tuning:
            with contextlib.suppress(Exception):  # a storage error leaves it to expire
                session.study.end_tuning()
        if pending or tuning or reason != "closed":
            log.info(
                "session %s (%s, study %r) %s: %d pending submission(s) cancelled%s",
                session.id,
                session.client,
                session.study.name,
                reason,
                len(pending),
                ", tuning lease released" if tuning else "",
            )

    def _reap_loop(self) -> None:
        interval = min(1.0, self.ttl / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                expired = [s for s in self._sessions.values() if s.expires < now]
            for session in expired:
                self.close_session(session, f"expired ({self.ttl:g} s without a call)")

    # -- submissions ---------------------------------------------------------------------

    def submit(self, session: Session, sub_id: str, config: Any, hp: Any, steps: int) -> bool:
        """Start submission ``sub_id`` (``study.submit(config, hp, steps)``); False when
        the session already has that id (nothing is done)."""
        with session.lock:
            if sub_id in session.pending or sub_id in session.finished:
                return False
            fut = asyncio.run_coroutine_threadsafe(
                self._run(session, sub_id, config, hp, steps), self._loop
            )
            session.pending[sub_id] = fut
        return True

    async def settled(self, session: Session, sub_id: str, timeout: float) -> dict[str, Any] | None:
        """The event of submission ``sub_id`` if it ends within ``timeout`` seconds (a
        trial the plan already answers), else None: the long-poll delivers it later."""
        with session.lock:
            fut = session.pending.get(sub_id)
        if fut is not None:
            await asyncio.wait({asyncio.wrap_future(fut)}, timeout=timeout)
        with session.lock:
            for event in reversed(session.events):
                if event["id"] == sub_id:
                    return dict(event)
        return None

    async def _run(self, session: Session, sub_id: str, config: Any, hp: Any, steps: int) -> None:
        try:
            result = await session.study.submit(config, hp, steps)
        except asyncio.CancelledError:
            session.push(sub_id, None)
            raise
        except Exception as exc:
            if self.closing:
                return  # the client reconnects to the next server and submits again
            session.push(sub_id, error_to_json(exc)[1])
            return
        if not self.closing:
            session.push(sub_id, {"result": result_to_json(result)})

    def cancel(self, session: Session, sub_id: str) -> bool:
        """Cancel submission ``sub_id``: its request is released (work another live
        request needs goes on). False when it had already finished.

        Raises:
            RequestRefusedError: 404 for an id the session never had.
        """
        with session.lock:
            fut = session.pending.get(sub_id)
            if fut is None:
                if sub_id in session.finished:
                    return False
                raise RequestRefusedError(
                    404, "SubmissionNotFound", f"unknown submission {sub_id!r}"
                )
        fut.cancel()
        session.push(sub_id, None)
        return True

    async def events(self, session: Session, after: int, timeout: float) -> list[dict[str, Any]]:
        """Events of ``session`` after ``after`` (those up to it are acknowledged and
        dropped), waiting at most ``timeout`` seconds for the first one.

        Raises:
            RequestRefusedError: 503 when the server began to shut down meanwhile.
        """
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        with session.lock:
            session.events = [e for e in session.events if e["seq"] > after]
            if session.events or timeout <= 0:
                return list(session.events)
            session.waiters.append((loop, ready))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ready.wait(), timeout)
        with session.lock:
            if (loop, ready) in session.waiters:
                session.waiters.remove((loop, ready))
            out = list(session.events)
        if self.closing:
            raise RequestRefusedError(503, "ServerClosing", "the server is shutting down")
        return out

    # -- tuning --------------------------------------------------------------------------

    def begin_tuning(
        self, session: Session, metric: str, mode: str, tuner: str, horizon: int
    ) -> None:
        """Take study's tuning lease for ``session`` (blocking).

        Raises:
            StudyBusyError: another session of this server, or another process, tunes it.
        """
        name = session.study.name
        with self._lock:
            holder = self._tuning.get(name)
            if holder is not None and holder != session.id and holder in self._sessions:
                raise StudyBusyError(
                    f"study {name!r} is being tuned by another client of this server "
                    f"({self._sessions[holder].client}); running it twice at once would "
                    "duplicate its trials and its tuner's log. Wait for that run to finish, "
                    f"or give this run another study name. If that client is gone, its "
                    f"session expires {self.ttl:g} s after its last call.",
                    study=name,
                    holder=self._sessions[holder].client,
                )
            self._tuning[name] = session.id
        try:
            session.study.begin_tuning(metric, mode, tuner, horizon)
        except BaseException:
            with self._lock:
                if self._tuning.get(name) == session.id:
                    del self._tuning[name]
            raise

    def end_tuning(self, session: Session) -> None:
        """Release the tuning lease ``session`` holds (nothing when it holds none)."""
        name = session.study.name
        with self._lock:
            if self._tuning.get(name) != session.id:
                return
            del self._tuning[name]
        session.study.end_tuning()

    # -- life cycle ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closing:
            raise RequestRefusedError(503, "ServerClosing", "the server is shutting down")

    def close(self) -> None:
        """Shut down: no more events are delivered (clients reconnect to the next
        server and submit again), then every study is closed (workers stop)."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
            sessions = list(self._sessions.values())
            self._sessions.clear()
            studies = list(self._studies.values())
            self._studies.clear()
        self._stop.set()
        for session in sessions:
            with session.lock:
                waiters, session.waiters = session.waiters, []
            for loop, ready in waiters:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(ready.set)
        for study in studies:
            try:
                study.close()
            except Exception:  # one study's failure must not keep the others open
                log.exception("closing study %r failed", study.name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._reader is not None:
            self._reader.close()

    @contextlib.contextmanager
    def reading(self) -> Iterator[BasePlanStorage]:
        """The plan for read-only queries (the dashboard at ``/``): through the engine
        of this server's studies (:meth:`Study.reading <stagetree.Study.reading>`, its
        lock held: keep reads short); before any study is open, a read-only handle of
        the storage, opened once.

        Raises:
            RequestRefusedError: 503 while the server shuts down.
        """
        with self._lock:
            self._check_open()
            study = next(iter(self._studies.values()), None)
            if study is None and self._reader is None:
                self._reader = _read_only(self.config.storage)
            reader = self._reader
        if study is not None:
            with study.reading() as storage:
                yield storage
        else:
            assert reader is not None
            yield reader

    def describe(self) -> Mapping[str, Any]:
        """Counts for ``/v1/info``: sessions, studies, trainer versions."""
        with self._lock:
            return {"sessions": len(self._sessions), "studies": len(self._studies)}


def _read_only(url: str) -> BasePlanStorage:
    """A read-only handle of the storage at ``url`` (an empty plan for ``memory://``:
    the studies that will fill it are not open yet)."""
    if url.strip().startswith(("memory", ":memory:")):
        return MemoryPlanStorage()
    return open_storage(url, readonly=True)
