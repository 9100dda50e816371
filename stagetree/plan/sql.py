"""A search plan in a SQL database (SQLite file or PostgreSQL) through SQLAlchemy Core.

Concurrency: processes share the database, so every write transaction is serialised —
``BEGIN IMMEDIATE`` on SQLite (WAL journal, busy timeout), a transaction-scoped
advisory lock on PostgreSQL. The insertion walk reads the tree and writes its new
nodes inside one such transaction, so two processes can never both create the same
child. Each process caches trees in memory; as trees are append-only and node ids grow
in commit order (they are allocated under the write lock), a cache is refreshed by
loading the nodes of its tree with an id above the largest it holds.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import sqlite3
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import Any, TypeVar
from typing import cast as typed

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    Select,
    String,
    Table,
    Text,
    and_,
    bindparam,
    cast,
    create_engine,
    event,
    func,
    inspect,
    or_,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from stagetree.exceptions import PlanKeyError, SchemaVersionError, StorageError
from stagetree.hp import Sequence, dumps_hp, loads_hp
from stagetree.plan import _codec
from stagetree.plan._seqcache import SeqCache
from stagetree.plan.base import (
    PARTIAL_KEY,
    ActivityRecord,
    BasePlanStorage,
    CheckpointRecord,
    MetricsItem,
    TrialEnd,
    TrialFinal,
    activity_row,
    after_add,
    after_release,
    check_canonical,
    check_metrics,
    evaluated_metrics,
    merge_metrics,
    trial_changes,
)
from stagetree.plan.leases import ClaimResult, Lease, host_pid, stage_conflicts, study_conflicts
from stagetree.plan.model import Node, NodeLink, Request, RequestState
from stagetree.plan.tree import Insertion, TreeIndex, check_items, check_trial, insert, walk
from stagetree.retry import DB_RETRY_ENV, Outage, RideThrough, window_from_env

__all__ = ["SCHEMA_VERSION", "SQLPlanStorage"]

SCHEMA_VERSION = 1
"""Version of the tables below; bump it (and add a migration) on any change."""

_PG_LOCK_KEY = 0x5747_A6E7  # advisory lock id serialising stagetree writers on PostgreSQL
_CHUNK = 500  # bound parameters per IN (...) query

_md = MetaData()
_meta = Table(
    "stagetree_meta",
    _md,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)
_roots = Table(
    "stagetree_roots",
    _md,
    Column("root_key", String(512), primary_key=True),
    Column("config", Text, nullable=False),
)
_nodes = Table(
    "stagetree_nodes",
    _md,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("root_key", String(512), nullable=False),
    Column("parent", Integer, nullable=True),
    Column("branch_step", Integer, nullable=False),
    Column("hp", Text, nullable=False),
    Index("ix_stagetree_nodes_root", "root_key", "id"),
)
_requests = Table(
    "stagetree_requests",
    _md,
    Column("node", Integer, primary_key=True, autoincrement=False),
    Column("step", Integer, primary_key=True, autoincrement=False),
    Column("root_key", String(512), nullable=False),
    Column("refcount", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("error", Text, nullable=True),
    Index("ix_stagetree_requests_root", "root_key"),
)
_checkpoints = Table(
    "stagetree_checkpoints",
    _md,
    Column("node", Integer, primary_key=True, autoincrement=False),
    Column("step", Integer, primary_key=True, autoincrement=False),
    Column("root_key", String(512), nullable=False),
    Column("ref", Text, nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("created", Float, nullable=False),
    Index("ix_stagetree_checkpoints_root", "root_key"),
)
# Metrics are JSON text: SQLite turns a REAL NaN into NULL, and JSON keeps NaN/inf.
_metrics = Table(
    "stagetree_metrics",
    _md,
    Column("node", Integer, primary_key=True, autoincrement=False),
    Column("step", Integer, primary_key=True, autoincrement=False),
    Column("root_key", String(512), nullable=False),
    Column("data", Text, nullable=False),
)
_stats = Table(
    "stagetree_stats",
    _md,
    Column("scope", String(512), primary_key=True),
    Column("key", String(128), primary_key=True),
    Column("value", Float, nullable=False),
)
_studies = Table(
    "stagetree_studies",
    _md,
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("name", String(512), nullable=False, unique=True),
    Column("meta", Text, nullable=False),
    Column("created", Float, nullable=False),
)
_trials = Table(
    "stagetree_trials",
    _md,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("study", String(512), nullable=False),
    Column("root_key", String(512), nullable=False),
    Column("config", Text, nullable=False),
    Column("hp", Text, nullable=False),
    Column("steps", Integer, nullable=False),
    Column("node", Integer, nullable=True),
    Column("step", Integer, nullable=True),
    Column("state", String(32), nullable=False),
    Column("attrs", Text, nullable=False),
    Column("created", Float, nullable=False),
    Index("ix_stagetree_trials_study", "study", "id"),
)
_logs = Table(
    "stagetree_logs",
    _md,
    Column("study", String(512), primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("record", Text, nullable=False),
)
# Leases (stagetree.plan.leases): node NULL marks a study lease (scope = study name).
_leases = Table(
    "stagetree_leases",
    _md,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("owner", String(64), nullable=False),
    Column("scope", String(512), nullable=False),
    Column("node", Integer, nullable=True),
    Column("start", Integer, nullable=False),
    Column("stop", Integer, nullable=False),
    Column("host", String(256), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("created", Float, nullable=False),
    Column("expires", Float, nullable=False),
    Index("ix_stagetree_leases_owner", "owner"),
)
# Activity of the workers (ActivityRecord), append-only; seq orders it (writers are
# serialised, so seq order is commit order).
_activity = Table(
    "stagetree_activity",
    _md,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("owner", String(64), nullable=False),
    Column("batch", Integer, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("worker", Integer, nullable=False),
    Column("root_key", String(512), nullable=False),
    Column("node", Integer, nullable=True),
    Column("step", Integer, nullable=True),
    Column("time", Float, nullable=False),
    Column("seconds", Float, nullable=False),
    Column("data", Text, nullable=False),
    Index("ix_stagetree_activity_root", "root_key", "seq"),
)
TABLES = tuple(_md.sorted_tables)

# PostgreSQL error classes of a server out of reach for a while: 08 (connection
# exception), 57P01-57P03 (admin or crash shutdown, "the database system is starting
# up / shutting down"), 53300 (too many connections), 40001/40P01 (serialisation
# failure, deadlock: the transaction may simply run again).
_PG_TRANSIENT = ("08", "57P01", "57P02", "57P03", "53300", "40001", "40P01")


@dataclasses.dataclass
class _Written:
    """What the open write transaction of a handle knows for sure: it holds the write
    lock (every writer of every process takes it), so nothing it read or wrote changes
    under it until it commits. Reads are answered from here instead of the database.

    Attributes:
        fresh: trees read up to their last node (``_refresh``) in this transaction.
        bare: nodes it created that no metrics or checkpoint were written on yet (and
            no request but those in ``requests``).
        trials: trial rows (column -> stored value) as this transaction wrote or read them.
        requests: requests as this transaction wrote or read them (None: none stored).
    """

    fresh: set[str] = dataclasses.field(default_factory=set)
    bare: set[int] = dataclasses.field(default_factory=set)
    trials: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    requests: dict[tuple[int, int], Request | None] = dataclasses.field(default_factory=dict)


def _transient(exc: SQLAlchemyError, pg: bool) -> bool:
    """Whether ``exc`` is a fault that goes away by itself (a lost connection, a server
    restarting, a busy SQLite file), so that the transaction is worth running again."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    message = str(exc.orig).lower()
    if not pg:
        return "database is locked" in message or "database is busy" in message
    code = getattr(exc.orig, "sqlstate", None) or ""
    if code:
        return code.startswith(_PG_TRANSIENT)
    # No SQLSTATE: the driver's own errors (no connection, a refused or broken socket).
    return type(exc.orig).__name__ in ("OperationalError", "InterfaceError")


F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def _retried(method: F) -> F:
    """Run ``method`` again, with backoff, while its transaction fails with a transient
    error, within the storage's ride-through window (see :class:`SQLPlanStorage`)."""

    @functools.wraps(method)
    def retried(self: SQLPlanStorage, *args: Any, **kwargs: Any) -> Any:
        return self._retrying(lambda: method(self, *args, **kwargs))

    return typed(F, retried)


# The change counter (BasePlanStorage.revision): a row of the meta table that every
# write transaction increments (text, like every meta value).
_REVISION = "revision"
_BUMP = (
    _meta.update()
    .where(_meta.c.key == _REVISION)
    .values(value=cast(cast(_meta.c.value, Integer) + 1, Text))
)

# The statements of a trial's path, built once with bound parameters: putting a select
# together costs SQLAlchemy more than sending it (constructs, coercions, cache key), so
# these are compiled from the cache instead of built again per call.
_N, _T, _R, _M, _C, _L = _nodes.c, _trials.c, _requests.c, _metrics.c, _checkpoints.c, _leases.c
_NODES_ADDED = (
    select(_N.id, _N.parent, _N.branch_step, _N.hp)
    .where(_N.root_key == bindparam("r"), _N.id > bindparam("i"))
    .order_by(_N.id)
)
_NODE = select(_nodes).where(_N.id == bindparam("i"))
_LAST_NODE = select(func.max(_N.id))
_NODES_INSERT = _nodes.insert()
_METRICS_AT = select(_M.data).where(_M.node == bindparam("n"), _M.step == bindparam("s"))
_METRICS_OF = select(_M.node, _M.step, _M.data).where(_M.node.in_(bindparam("ns", expanding=True)))
_METRICS_SPAN = _METRICS_OF.where(_M.step.between(bindparam("lo"), bindparam("hi")))
_METRICS_INSERT = _metrics.insert()
_METRICS_SET = (
    _metrics.update()
    .where(_M.node == bindparam("b_node"), _M.step == bindparam("b_step"))
    .values(data=bindparam("b_data"))
)
_TRIAL = select(_trials).where(_T.id == bindparam("i"))
_TRIALS_ADDED = (
    select(_T.id, _T.root_key, _T.config, _T.hp)
    .where(_T.study == bindparam("s"), _T.id > bindparam("i"))
    .order_by(_T.id)
)
_REQUEST = select(_requests).where(_R.node == bindparam("n"), _R.step == bindparam("s"))
_REQUESTS_OF = select(_requests).where(_R.node.in_(bindparam("ns", expanding=True)))
_REQUESTS_INSERT = _requests.insert()
_REQUESTS_SET = (
    _requests.update()
    .where(_R.node == bindparam("b_node"), _R.step == bindparam("b_step"))
    .values(
        refcount=bindparam("b_refcount"), state=bindparam("b_state"), error=bindparam("b_error")
    )
)
_CHECKPOINT = select(_checkpoints).where(_C.node == bindparam("n"), _C.step == bindparam("s"))
_CHECKPOINTS_OF = (
    select(_C.node, _C.step, _C.ref, _C.nbytes, _C.created)
    .where(_C.node.in_(bindparam("ns", expanding=True)))
    .order_by(_C.node, _C.step)
)
_LEASES_EXPIRED = _leases.delete().where(_L.expires <= bindparam("now"))
_LEASES = select(_leases).order_by(_L.id)
_LEASES_INSERT = _leases.insert()
_LEASES_RELEASE = _leases.delete().where(
    _L.owner == bindparam("o"), _L.id.in_(bindparam("ids", expanding=True))
)
_STATS_OF = select(_stats.c.key, _stats.c.value).where(_stats.c.scope == bindparam("s"))
_ROOT_CONFIG = select(_roots.c.config).where(_roots.c.root_key == bindparam("r"))
_ACTIVITY_INSERT = _activity.insert()


def _sqlite_readonly(url: URL) -> bool:
    """Whether a SQLite database can only be read here (the file, or the directory its
    journal files go to, is not writable)."""
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return False
    path = os.path.abspath(database)
    if not os.path.exists(path):
        return False
    return not (os.access(path, os.W_OK) and os.access(os.path.dirname(path), os.W_OK))


def _check_sqlite_directory(shown: str, url: URL) -> None:
    """Fail with the cause when a SQLite file's directory does not exist (SQLite only
    says "unable to open database file"); nothing is created for it."""
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return
    directory = os.path.dirname(os.path.abspath(database))
    if not os.path.isdir(directory):
        raise StorageError(
            f"cannot open plan storage {shown!r}: directory {directory} does not exist"
        )


def _refuse_foreign_sqlite(shown: str, url: URL) -> None:
    """Refuse a SQLite file that holds another program's tables and no plan, before
    anything (even the WAL switch) writes to it: a SQLite file is one program's (a
    database server may host several programs' tables: PostgreSQL is not checked)."""
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return
    path = os.path.abspath(database)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    try:
        con = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return  # not readable as SQLite: opening it says why
    names = {str(row[0]) for row in rows}
    foreign = sorted(n for n in names if not n.startswith(("stagetree_", "sqlite_")))
    if foreign and _meta.name not in names:
        listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise StorageError(
            f"{shown!r} is not a stagetree database: it holds other tables ({listed}) and no "
            "stagetree plan; nothing was written to it. Give a new file, or one stagetree "
            "wrote"
        )


def _use_wal(cur: Any, wait: float = 60.0) -> None:
    """Put the database in WAL mode (persistent: once set, every later connection finds
    it so). Switching needs the database to itself, and SQLite answers "database is
    locked" at once instead of waiting when another process is opening it at the same
    moment, so retry for up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            mode = cur.execute("PRAGMA journal_mode").fetchone()
            if mode is not None and str(mode[0]).lower() == "wal":
                return
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = "locked" in str(exc) or "busy" in str(exc)
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sqlite_engine(url: URL, readonly: bool = False) -> Engine:
    database = url.database or ""
    if database in ("", ":memory:"):
        # One shared connection, or every checkout would see a fresh empty database.
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
    elif readonly:
        path = os.path.abspath(database)
        # mode=ro never writes; a WAL database in a read-only directory cannot make its
        # shared-memory file, so it is read as immutable (nobody can write it there).
        flags = "mode=ro" if os.access(os.path.dirname(path), os.W_OK) else "immutable=1"
        uri = f"file:{urllib.parse.quote(path)}?{flags}"

        def connect() -> Any:
            return sqlite3.connect(uri, uri=True, timeout=60.0, check_same_thread=False)

        engine = create_engine("sqlite://", creator=connect)
    else:
        engine = create_engine(url, connect_args={"timeout": 60.0})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event (below) emit BEGIN instead of pysqlite.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=60000")
        if database not in ("", ":memory:") and not readonly:
            _use_wal(cur)
            cur.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; fsync at checkpoints
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front: a deferred transaction that reads
        # and later writes can fail with SQLITE_BUSY without waiting under WAL.
        options = conn.get_execution_options()
        write = options.get("stagetree_write", False)
        if not write and options.get("stagetree_single", False):
            return  # one SELECT: its own snapshot in autocommit mode, no BEGIN sent
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


# The engines of this process's storages: a forked child drops their pooled
# connections (the parent's) without closing them, as SQLAlchemy's docs on
# multiprocessing say; a storage the child uses then connects afresh.
_OPEN_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_connections() -> None:
    for engine in list(_OPEN_ENGINES):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_connections)


class SQLPlanStorage(BasePlanStorage):
    """:class:`BasePlanStorage` in SQLite or PostgreSQL tables (``stagetree_*``).

    Args:
        url: SQLAlchemy URL (``sqlite:///plan.db``, ``postgresql+psycopg://...``);
            ``postgresql://`` and ``postgres://`` get the psycopg driver.
        readonly: open to read only: nothing is ever written (no tables are created; a
            database without stagetree's tables is refused) and every write raises
            :class:`~stagetree.exceptions.StorageError`. None (the default): read-only
            exactly when the SQLite file cannot be written here.
        retry_seconds: the ride-through window: a transaction that fails with a
            transient error (the connection lost, the server restarting or shutting
            down, SQLite busy) runs again with exponential backoff (0.05 s up to 2 s
            apart) for up to this many seconds after the first failure, then raises
            :class:`~stagetree.exceptions.StorageError` naming the outage. None: the
            environment variable ``STAGETREE_DB_RETRY_SECONDS``, else 30; 0: no retry.
            A transaction is never run twice when its COMMIT was sent and failed (it
            may have been applied): that fails at once. Opening the storage is not
            retried either (a wrong URL fails fast).

    Raises:
        StorageError: the database cannot be opened (or, read-only, holds no plan).
        SchemaVersionError: it was written by another schema version.
    """

    def __init__(
        self, url: str, readonly: bool | None = None, retry_seconds: float | None = None
    ) -> None:
        self._lock = threading.RLock()
        self._outer = threading.local()  # the retried call this thread is in, if any
        self._joined = threading.local()  # the transaction of atomically(), if any
        self._closed = False
        self._absent: set[str] = set()  # tables a read-only handle found missing
        self._trees: dict[str, TreeIndex] = {}
        self._node_cache: dict[int, Node] = {}
        self._seqs = SeqCache()
        # study -> (largest trial id read, {hash of (root_key, config, hp): first id}):
        # add_trial(unique=True) looks its row up here and reads only the rows added
        # since, instead of comparing every row of the study
        self._trial_keys: dict[str, tuple[int, dict[int, int]]] = {}
        self._changes = 0  # write transactions committed through this handle
        self._roots_seen: dict[str, str] = {}  # root key -> config registered (committed)
        # Studies found stored: no API deletes one (drop_all clears this), so a trial or
        # a log record checks its study's row once per handle, not per write.
        self._studies_seen: set[str] = set()
        self._w: _Written | None = None  # the open write transaction's (lock held)
        try:
            parsed = make_url(url)
        except ArgumentError as exc:
            raise StorageError(f"cannot open plan storage {url!r}: {exc}") from None
        if parsed.drivername in ("postgresql", "postgres"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        self._url = parsed.render_as_string(hide_password=True)
        backend = parsed.get_backend_name()
        if readonly is None:
            readonly = backend == "sqlite" and _sqlite_readonly(parsed)
        self.readonly = readonly
        if backend == "sqlite":
            _check_sqlite_directory(self._url, parsed)
            if not readonly:
                _refuse_foreign_sqlite(self._url, parsed)
        try:
            if backend == "sqlite":
                self._engine = _sqlite_engine(parsed, readonly)
            elif backend == "postgresql":
                args = {} if "connect_timeout" in parsed.query else {"connect_timeout": 10}
                self._engine = create_engine(parsed, connect_args=args, pool_pre_ping=True)
            else:
                raise StorageError(
                    f"cannot open plan storage {self._url!r}: unsupported database {backend!r} "
                    "(use sqlite:///path.db or postgresql://...)"
                )
        except (ArgumentError, ImportError, SQLAlchemyError) as exc:
            raise StorageError(f"cannot open plan storage {self._url!r}: {exc}") from None
        _OPEN_ENGINES.add(self._engine)
        self._pg = backend == "postgresql"
        window = window_from_env(DB_RETRY_ENV) if retry_seconds is None else retry_seconds
        self._ride = RideThrough(max(0.0, window), f"plan storage {self._url!r}", DB_RETRY_ENV)
        try:
            RideThrough(0.0, self._ride.what, DB_RETRY_ENV).call(self._init_schema)
        except BaseException:
            self._engine.dispose()
            raise

    shared = True

    @property
    def retry_seconds(self) -> float:
        return self._ride.window

    @property
    def url(self) -> str:
        """The database URL (password hidden)."""
        return self._url

    def database_url(self) -> str:
        """The full database URL, password included (for a library that keeps its own
        tables beside the plan: the Optuna bridge)."""
        return self._engine.url.render_as_string(hide_password=False)

    def __repr__(self) -> str:
        return f"SQLPlanStorage({self._url!r})"

    # -- transactions --------------------------------------------------------------------

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the ride-through window; a call made inside another retried
        call leaves the retrying to the outer one."""
        if getattr(self._outer, "active", False):
            return fn()
        self._outer.active = True
        try:
            return self._ride.call(fn)
        finally:
            self._outer.active = False

    @contextmanager
    def _tx(self, write: bool, bump: bool = True, single: bool = False) -> Iterator[Connection]:
        """One transaction; writers are serialised across processes. A write transaction
        increments the revision (unless ``bump`` is False) when it commits. A read that
        sends one statement only says so with ``single``: SQLite then reads it without
        a BEGIN (a statement is its own consistent snapshot).

        A transient failure raises :class:`~stagetree.retry.Outage` (the retried method
        runs again), unless it struck the COMMIT of a write, which may have been applied.
        """
        with self._lock:
            joined = getattr(self._joined, "conn", None)
            if joined is not None:  # inside atomically(): its transaction, its commit
                yield joined
                return
            if self._closed:
                raise StorageError(f"plan storage {self._url!r} is closed")
            if write and self.readonly:
                raise StorageError(
                    f"plan storage {self._url!r} is open read-only (it cannot be written "
                    "here): results can be read, nothing can be trained or recorded"
                )
            committing = False
            try:
                with self._engine.connect() as conn:
                    conn.execution_options(stagetree_write=write, stagetree_single=single)
                    with conn.begin():
                        if write and self._pg:
                            conn.execute(
                                text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY}
                            )
                        if write:
                            self._w = _Written()
                        try:
                            yield conn
                        finally:
                            if write:  # a read nested in the thread's write keeps it
                                self._w = None
                        if write and bump:
                            conn.execute(_BUMP)
                        committing = write
                if write and bump:
                    self._changes += 1
            except SQLAlchemyError as exc:
                where = f"plan storage {self._url!r}"
                if _transient(exc, self._pg) and not committing:
                    cause = str(exc)

                    def final(note: str) -> StorageError:
                        return StorageError(f"{where} {note}: {cause}")

                    raise Outage(cause, final) from exc
                raise StorageError(f"{where}: {exc}") from exc

    def atomically(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in one write transaction: the storage calls it makes join it (one
        commit, one revision); on a transient failure it is rolled back and ``fn`` runs
        again, within the ride-through window."""

        def run() -> T:
            with self._lock:
                if getattr(self._joined, "conn", None) is not None:
                    return fn()  # already inside one
                try:
                    with self._tx(write=True) as conn:
                        self._joined.conn = conn
                        try:
                            return fn()
                        finally:
                            self._joined.conn = None
                except BaseException:
                    # What the calls cached may be rolled back (nodes, trees, trial
                    # rows, roots): read again from the database.
                    self._trees.clear()
                    self._node_cache.clear()
                    self._trial_keys.clear()
                    self._roots_seen.clear()
                    raise

        return typed(T, self._retrying(run))

    def _init_schema(self) -> None:
        # Check the version with a read first, so that a newer database is not touched.
        with self._tx(write=False) as conn:
            found = self._check_version(conn)
            missing = [t.name for t in TABLES if not inspect(conn).has_table(t.name)]
        # A read-only handle on a plan written before a table existed reads it as empty.
        self._absent = set(missing) if self.readonly else set()
        if self.readonly or (not missing and found is not None):  # nothing to write
            if found is None:
                raise StorageError(
                    f"{self._url!r} is not a stagetree plan storage (it has no stagetree "
                    "tables); nothing was written to it"
                )
            return
        with self._tx(write=True) as conn:
            found = self._check_version(conn)
            _md.create_all(conn)
            if found is None:
                conn.execute(
                    _meta.insert(), {"key": "schema_version", "value": str(SCHEMA_VERSION)}
                )
            has_revision = conn.execute(
                select(_meta.c.key).where(_meta.c.key == _REVISION)
            ).scalar_one_or_none()
            if has_revision is None:  # a new storage, or one written before it was kept
                conn.execute(_meta.insert(), {"key": _REVISION, "value": "0"})

    def _check_version(self, conn: Connection) -> int | None:
        if not inspect(conn).has_table(_meta.name):
            return None
        raw = conn.execute(
            select(_meta.c.value).where(_meta.c.key == "schema_version")
        ).scalar_one_or_none()
        if raw is None:
            return None
        try:
            version = int(raw)
        except ValueError:
            raise SchemaVersionError(
                f"plan storage {self._url!r} has an unreadable schema version {raw!r}"
            ) from None
        if version != SCHEMA_VERSION:
            newer = "a newer" if version > SCHEMA_VERSION else "an older"
            raise SchemaVersionError(
                f"plan storage {self._url!r} has schema version {version}, written by "
                f"{newer} stagetree; this one reads version {SCHEMA_VERSION}"
            )
        return version

    # -- node cache ----------------------------------------------------------------------

    def _refresh(self, conn: Connection, root_key: str) -> TreeIndex:
        """The tree of ``root_key`` with every committed node (append-only: load only
        ids above the largest cached one)."""
        tree = self._trees.get(root_key)
        w = self._w
        if w is not None:
            if tree is not None and root_key in w.fresh:
                return tree  # no other writer commits before this transaction does
            w.fresh.add(root_key)
        if tree is None:
            tree = self._trees[root_key] = TreeIndex(root_key, self._seqs)
        rows = conn.execute(_NODES_ADDED, {"r": root_key, "i": tree.last_id}).all()
        cache = self._node_cache
        fresh = [row for row in rows if row.id not in cache]
        for row, hp in zip(fresh, self._seqs.decode_hp_many([row.hp for row in fresh])):
            cache[row.id] = Node(row.id, root_key, row.parent, row.branch_step, hp)
        for row in rows:
            tree.add(cache[row.id])
        return tree

    def _cached_walk(self, root_key: str, hp: Mapping[str, Sequence], steps: int) -> Any:
        """:func:`walk` of a trial in tree ``root_key`` as this handle caches it, when
        it finds the trial's end (else None): trees are append-only, and a node's
        children are keyed by where and how they branch, so a path found in the cache
        is the path the whole tree holds; only a path not found needs the nodes
        appended since (:meth:`_refresh`)."""
        with self._lock:
            tree = self._trees.get(root_key)
            if self._closed or tree is None or tree.root is None:
                return None
            found = walk(tree, hp, steps)
            return found if found.end is not None else None

    def _node(self, conn: Connection, node_id: int) -> Node:
        node = self._node_cache.get(node_id)
        if node is not None:
            return node
        row = conn.execute(_NODE, {"i": node_id}).first()
        if row is None:
            raise PlanKeyError(f"no node {node_id} in plan storage {self._url!r}")
        hp = self._seqs.decode_hp(row.hp)
        node = Node(row.id, row.root_key, row.parent, row.branch_step, hp)
        self._node_cache[node_id] = node
        return node

    # -- roots ---------------------------------------------------------------------------

    @_retried
    def register_root(self, root_key: str, config: Mapping[str, Any]) -> None:
        data = _codec.dumps(dict(config), "root config")
        if self._roots_seen.get(root_key) == data:  # roots never change: no transaction
            return
        with self._tx(write=True) as conn:
            old = conn.execute(_ROOT_CONFIG, {"r": root_key}).scalar_one_or_none()
            if old is None:
                conn.execute(_roots.insert(), {"root_key": root_key, "config": data})
            elif old != data:
                raise StorageError(f"root {root_key!r} is registered with another config")
        self._roots_seen[root_key] = data

    @_retried
    def root_config(self, root_key: str) -> dict[str, Any]:
        with self._tx(write=False) as conn:
            raw = conn.execute(_ROOT_CONFIG, {"r": root_key}).scalar_one_or_none()
        if raw is None:
            raise PlanKeyError(f"root {root_key!r} is not registered")
        return _codec.loads(raw)

    @_retried
    def root_keys(self) -> list[str]:
        with self._tx(write=False) as conn:
            keys = set(conn.execute(select(_roots.c.root_key)).scalars())
            keys.update(conn.execute(select(_nodes.c.root_key).distinct()).scalars())
        return sorted(keys)

    # -- trees ---------------------------------------------------------------------------

    @_retried
    def insert_trials(
        self,
        root_key: str,
        items: Seq[tuple[Mapping[str, Sequence], int]],
        *,
        request: bool = True,
    ) -> list[Insertion]:
        with self._lock:
            if not request and not self.readonly:
                known = self._inserted_already(root_key, items)
                if known is not None:
                    return known
            mark: int | None = None
            tree: TreeIndex | None = None
            try:
                with self._tx(write=True) as conn:
                    tree = self._refresh(conn, root_key)
                    checked = check_items(tree, items)
                    mark = tree.last_id
                    next_id = [(conn.execute(_LAST_NODE).scalar() or 0) + 1]

                    def new_id() -> int:
                        next_id[0] += 1
                        return next_id[0] - 1

                    out = [insert(tree, hp, steps, new_id, checked=True) for hp, steps in checked]
                    rows = [
                        {
                            "id": n.id,
                            "root_key": root_key,
                            "parent": n.parent,
                            "branch_step": n.branch_step,
                            "hp": self._seqs.encode_hp(n.hp),
                        }
                        for ins in out
                        for n in ins.new_nodes
                    ]
                    if rows:
                        conn.execute(_NODES_INSERT, rows)
                        if self._w is not None:
                            self._w.bare.update(n.id for ins in out for n in ins.new_nodes)
                    if request:
                        counts: dict[tuple[int, int], int] = {}
                        for ins in out:
                            key = (ins.node, ins.step)
                            counts[key] = counts.get(key, 0) + 1
                        self._add_requests(conn, root_key, counts)
            except BaseException:
                if tree is not None and mark is not None:
                    tree.discard_after(mark)
                raise
            for ins in out:
                for node in ins.new_nodes:
                    self._node_cache[node.id] = node
            return out

    def _inserted_already(
        self, root_key: str, items: Seq[tuple[Mapping[str, Sequence], int]]
    ) -> list[Insertion] | None:
        """The insertions of ``items`` when every one's path is in the tree already (a
        resumed study submits its trials again), found in a read transaction; None when
        one needs a node (then the write transaction does it all)."""
        cached = [self._cached_walk(root_key, hp, steps) for hp, steps in items]
        if all(found is not None for found in cached):  # no transaction
            return [Insertion(found.end, steps) for found, (_, steps) in zip(cached, items)]
        with self._tx(write=False) as conn:
            tree = self._refresh(conn, root_key)
            ends = [walk(tree, hp, steps).end for hp, steps in check_items(tree, items)]
        if any(end is None for end in ends):
            return None
        return [Insertion(typed(int, end), steps) for end, (_, steps) in zip(ends, items)]

    def _load_requests(
        self, conn: Connection, keys: Collection[tuple[int, int]]
    ) -> dict[tuple[int, int], Request]:
        found: dict[tuple[int, int], Request] = {}
        node_ids = sorted({node for node, _ in keys})
        for i in range(0, len(node_ids), _CHUNK):
            rows = conn.execute(_REQUESTS_OF, {"ns": node_ids[i : i + _CHUNK]}).all()
            for row in rows:
                if (row.node, row.step) in keys:
                    found[(row.node, row.step)] = _request(row)
        return found

    def _add_requests(
        self, conn: Connection, root_key: str, counts: Mapping[tuple[int, int], int]
    ) -> dict[tuple[int, int], Request]:
        w = self._w
        unread: Collection[tuple[int, int]] = counts.keys()
        if w is not None:  # nothing stored on a bare node, the rest maybe known already
            unread = [k for k in counts if k[0] not in w.bare and k not in w.requests]
        old = self._load_requests(conn, unread) if unread else {}
        if w is not None:
            old.update((k, r) for k in counts if (r := w.requests.get(k)) is not None)
        new = {key: after_add(old.get(key), *key, n) for key, n in counts.items()}
        inserts = [_request_row(r, root_key) for key, r in new.items() if key not in old]
        updates = [_request_row(r, root_key) for key, r in new.items() if key in old]
        if inserts:
            conn.execute(_REQUESTS_INSERT, inserts)
            if w is not None:
                w.requests.update((key, r) for key, r in new.items() if key not in old)
        if updates:
            self._update_requests(conn, updates)
        return new

    def _update_requests(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        keys = ("node", "step", "refcount", "state", "error")
        conn.execute(_REQUESTS_SET, [{f"b_{k}": row[k] for k in keys} for row in rows])
        if self._w is not None:
            self._w.requests.update(
                ((row["node"], row["step"]), _request(_Row(row))) for row in rows
            )

    @_retried
    def tree_names(self, root_key: str) -> tuple[str, ...] | None:
        tree = self._trees.get(root_key)
        if tree is not None and tree.names is not None:  # a tree's root never changes
            return tree.names
        with self._tx(write=False) as conn:
            # The root is a tree's first node: the (root_key, id) index finds it at once.
            text = conn.execute(
                select(_nodes.c.hp)
                .where(_nodes.c.root_key == root_key)
                .order_by(_nodes.c.id)
                .limit(1)
            ).scalar()
        return None if text is None else tuple(sorted(_codec.loads(text)))

    @_retried
    def locate(
        self, root_key: str, hp: Mapping[str, Sequence], step: int
    ) -> tuple[int, int] | None:
        result = self._cached_walk(root_key, hp, step)  # no transaction when found
        if result is None:
            with self._tx(write=False, single=True) as conn:
                result = walk(self._refresh(conn, root_key), hp, step)
        return None if result.end is None else (result.end, step)

    @_retried
    def node(self, node_id: int) -> Node:
        with self._tx(write=False) as conn:
            return self._node(conn, node_id)

    @_retried
    def nodes(self, root_key: str | None = None) -> list[Node]:
        with self._tx(write=False) as conn:
            if root_key is not None:
                keys = [root_key]
            else:
                keys = list(conn.execute(select(_nodes.c.root_key).distinct()).scalars())
            out = [n for key in keys for n in self._refresh(conn, key).nodes.values()]
        return sorted(out, key=lambda n: n.id)

    @_retried
    def node_links(self, root_key: str) -> dict[int, NodeLink]:
        c = _nodes.c
        query = select(c.id, c.parent, c.branch_step).where(c.root_key == root_key)
        with self._tx(write=False) as conn:
            return {row[0]: NodeLink(*row) for row in conn.execute(query)}

    @_retried
    def last_node_id(self) -> int:
        with self._tx(write=False) as conn:
            return int(conn.execute(_LAST_NODE).scalar() or 0)

    @_retried
    def nodes_after(self, after_id: int, also: Collection[int] = ()) -> list[Node]:
        # One range read on the primary key (plus the few ids asked again), not a read
        # per tree: a poll costs what was appended since, whatever the storage holds.
        wanted = sorted(set(also))
        cond = _nodes.c.id > after_id
        if wanted:
            cond = or_(cond, _nodes.c.id.in_(wanted))
        with self._tx(write=False, single=True) as conn:
            rows = conn.execute(select(_nodes).where(cond).order_by(_nodes.c.id)).all()
        cache = self._node_cache
        fresh = [row for row in rows if row.id not in cache]
        for row, hp in zip(fresh, self._seqs.decode_hp_many([row.hp for row in fresh])):
            cache[row.id] = Node(row.id, row.root_key, row.parent, row.branch_step, hp)
        return [cache[row.id] for row in rows]

    @_retried
    def path(self, node_id: int) -> list[Node]:
        # Up the parent links, each node read once and cached: a path is a few nodes,
        # its tree may hold 100,000 (a study's best trial reads its own path only).
        with self._tx(write=False) as conn:
            out = [self._node(conn, node_id)]
            while out[-1].parent is not None:
                out.append(self._node(conn, out[-1].parent))
        out.reverse()
        return out

    # -- requests ------------------------------------------------------------------------

    @_retried
    def add_request(self, node: int, step: int, count: int = 1) -> Request:
        with self._tx(write=True) as conn:
            n = self._node(conn, node)
            check_canonical(n, step)
            return self._add_requests(conn, n.root_key, {(node, step): count})[(node, step)]

    def _get_request(self, conn: Connection, node: int, step: int) -> Request | None:
        w = self._w
        if w is not None:
            if (node, step) in w.requests:
                return w.requests[(node, step)]
            if node in w.bare:
                return None
        row = conn.execute(_REQUEST, {"n": node, "s": step}).first()
        req = None if row is None else _request(row)
        if w is not None:
            w.requests[(node, step)] = req
        return req

    @_retried
    def release_request(self, node: int, step: int, count: int = 1) -> Request:
        with self._tx(write=True) as conn:
            req = after_release(self._get_request(conn, node, step), node, step, count)
            self._update_requests(conn, [_request_row(req, "")])
            return req

    @_retried
    def set_request_state(
        self, node: int, step: int, state: RequestState | str, error: str | None = None
    ) -> Request:
        state = RequestState(state)
        with self._tx(write=True) as conn:
            req = self._get_request(conn, node, step)
            if req is None:
                raise PlanKeyError(f"no request at (node {node}, step {step})")
            req = Request(node, step, req.refcount, state, error)
            self._update_requests(conn, [_request_row(req, "")])
            return req

    @_retried
    def request(self, node: int, step: int) -> Request | None:
        with self._tx(write=False, single=True) as conn:
            return self._get_request(conn, node, step)

    @_retried
    def requests(
        self,
        root_key: str | None = None,
        states: Collection[RequestState | str] | None = None,
    ) -> list[Request]:
        c = _requests.c
        query = select(c.node, c.step, c.refcount, c.state, c.error).order_by(c.node, c.step)
        if root_key is not None:
            query = query.where(c.root_key == root_key)
        if states is not None:
            query = query.where(c.state.in_([RequestState(s).value for s in states]))
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
        known = _STATES
        return [
            Request(node, step, refcount, known[state], error)
            for node, step, refcount, state, error in rows
        ]

    # -- checkpoints ---------------------------------------------------------------------

    @_retried
    def put_checkpoint(self, node: int, step: int, ref: str, nbytes: int) -> CheckpointRecord:
        record = CheckpointRecord(str(ref), int(nbytes), time.time())
        with self._tx(write=True) as conn:
            n = self._node(conn, node)
            check_canonical(n, step)
            if self._w is not None:
                self._w.bare.discard(node)
            conn.execute(  # an upsert: one statement, replacing a record there
                _put_checkpoint_query(self._pg),
                {
                    "node": node,
                    "step": step,
                    "root_key": n.root_key,
                    "ref": record.ref,
                    "nbytes": record.nbytes,
                    "created": record.created,
                },
            )
        return record

    @_retried
    def remove_checkpoint(self, node: int, step: int) -> bool:
        with self._tx(write=True) as conn:
            result = conn.execute(
                _checkpoints.delete().where(
                    (_checkpoints.c.node == node) & (_checkpoints.c.step == step)
                )
            )
            return bool(result.rowcount)

    @_retried
    def checkpoint(self, node: int, step: int) -> CheckpointRecord | None:
        with self._tx(write=False, single=True) as conn:
            if self._w is not None and node in self._w.bare:
                return None
            row = conn.execute(_CHECKPOINT, {"n": node, "s": step}).first()
        return None if row is None else CheckpointRecord(row.ref, row.nbytes, row.created)

    @_retried
    def checkpoints(self, root_key: str | None = None) -> dict[tuple[int, int], CheckpointRecord]:
        c = _checkpoints.c
        query = select(c.node, c.step, c.ref, c.nbytes, c.created).order_by(c.node, c.step)
        if root_key is not None:
            query = query.where(c.root_key == root_key)
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
        return {
            (node, step): CheckpointRecord(ref, nbytes, created)
            for node, step, ref, nbytes, created in rows
        }

    @_retried
    def checkpoints_on(self, nodes: Collection[int]) -> dict[tuple[int, int], CheckpointRecord]:
        # By the primary key (node, step): a path's few nodes, whatever their tree holds.
        out: dict[tuple[int, int], CheckpointRecord] = {}
        with self._tx(write=False, single=len(set(nodes)) <= _CHUNK) as conn:
            bare = self._w.bare if self._w is not None else ()
            ids = sorted(n for n in set(nodes) if n not in bare)  # bare: none there
            for i in range(0, len(ids), _CHUNK):
                rows = conn.execute(_CHECKPOINTS_OF, {"ns": ids[i : i + _CHUNK]}).all()
                for node, step, ref, nbytes, created in rows:
                    out[(node, step)] = CheckpointRecord(ref, nbytes, created)
        return out

    # -- metrics -------------------------------------------------------------------------

    def put_metrics(self, node: int, step: int, metrics: Mapping[str, float]) -> None:
        self.put_metrics_many([(node, step, metrics, True)])

    @_retried
    def put_metrics_many(self, items: Iterable[MetricsItem]) -> None:
        checked = [(node, step, check_metrics(m), bool(ev)) for node, step, m, ev in items]
        if not checked:
            return
        with self._tx(write=True) as conn:
            spans: dict[int, tuple[int, int]] = {}
            roots: dict[int, str] = {}
            for node, step, _values, _evaluated in checked:
                n = self._node(conn, node)
                check_canonical(n, step)
                roots[node] = n.root_key
                lo, hi = spans.get(node, (step, step))
                spans[node] = (min(lo, step), max(hi, step))
            # What is stored already: one query per chunk of nodes (a batch of the
            # engine's curve points spans many trials), over the steps the batch spans.
            stored: dict[tuple[int, int], dict[str, float]] = {}
            w = self._w
            ids = sorted(n for n in spans if w is None or n not in w.bare)
            if w is not None:
                w.bare.difference_update(spans)
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i : i + _CHUNK]
                lo = min(spans[n][0] for n in chunk)
                hi = max(spans[n][1] for n in chunk)
                rows = conn.execute(_METRICS_SPAN, {"ns": chunk, "lo": lo, "hi": hi}).all()
                rows = [r for r in rows if spans[r[0]][0] <= r[1] <= spans[r[0]][1]]
                datas = _codec.loads_many([r[2] for r in rows])
                stored.update(((r[0], r[1]), data) for r, data in zip(rows, datas))
            merged: dict[tuple[int, int], dict[str, float]] = {}
            for node, step, values, evaluated in checked:
                key = (node, step)
                old = merged.get(key, stored.get(key))
                merged[key] = merge_metrics(old, values, evaluated)
            new = [
                {
                    "node": key[0],
                    "step": key[1],
                    "root_key": roots[key[0]],
                    "data": _codec.dumps(data),
                }
                for key, data in merged.items()
                if key not in stored
            ]
            if new:
                conn.execute(_METRICS_INSERT, new)
            changed = [
                {"b_node": key[0], "b_step": key[1], "b_data": _codec.dumps(data)}
                for key, data in merged.items()
                if key in stored
            ]
            if changed:
                conn.execute(_METRICS_SET, changed)

    @_retried
    def get_metrics(self, node: int, step: int) -> dict[str, float] | None:
        with self._tx(write=False, single=True) as conn:
            if self._w is not None and node in self._w.bare:
                return None  # created by this transaction: nothing stored on it yet
            raw = conn.execute(_METRICS_AT, {"n": node, "s": step}).scalar_one_or_none()
        return None if raw is None else evaluated_metrics(_codec.loads(raw))

    @_retried
    def metrics_along(
        self, root_key: str, hp: Mapping[str, Sequence], steps: int
    ) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        cached = self._cached_walk(root_key, hp, steps)  # then one statement
        with self._tx(write=False, single=cached is not None) as conn:
            found = cached if cached is not None else walk(self._refresh(conn, root_key), hp, steps)
            segments = found.segments
            ranges = {node: (first, last) for node, first, last in segments}
            if not ranges:
                return out
            rows = conn.execute(_METRICS_OF, {"ns": list(ranges)}).all()
        rows = [r for r in rows if ranges[r.node][0] <= r.step <= ranges[r.node][1]]
        for row, data in zip(rows, _codec.loads_many([r.data for r in rows])):
            out[row.step] = _shown(data)
        return dict(sorted(out.items()))

    @_retried
    def metrics(
        self, root_key: str, nodes: Collection[int] | None = None
    ) -> dict[int, dict[int, dict[str, float]]]:
        query = select(_metrics.c.node, _metrics.c.step, _metrics.c.data).order_by(
            _metrics.c.node, _metrics.c.step
        )
        out: dict[int, dict[int, dict[str, float]]] = {}
        with self._tx(write=False) as conn:
            if nodes is None:
                rows = conn.execute(query.where(_metrics.c.root_key == root_key)).all()
            else:
                ids = sorted(set(nodes))
                rows = []
                for i in range(0, len(ids), _CHUNK):  # chunks in node order: rows stay sorted
                    chunk = query.where(
                        _metrics.c.root_key == root_key, _metrics.c.node.in_(ids[i : i + _CHUNK])
                    )
                    rows.extend(conn.execute(chunk).all())
        partial = PARTIAL_KEY
        for (node, step, _), data in zip(rows, _codec.loads_many([r.data for r in rows])):
            points = out.get(node)
            if points is None:
                points = out[node] = {}
            if partial in data:  # (shown_metrics, inline: this loop runs per point)
                del data[partial]
            points[step] = data
        return out

    @_retried
    def metrics_at(
        self, keys: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], dict[str, float]]:
        wanted = sorted({(int(node), int(step)) for node, step in keys})
        rows: list[Any] = []
        with self._tx(write=False) as conn:
            for i in range(0, len(wanted), _AT_CHUNK):
                chunk = wanted[i : i + _AT_CHUNK]
                chunk += [chunk[-1]] * (_AT_CHUNK - len(chunk))  # one statement, cached
                params = {f"n{j}": node for j, (node, _) in enumerate(chunk)}
                params.update((f"s{j}", step) for j, (_, step) in enumerate(chunk))
                rows.extend(conn.execute(_metrics_at_query(), params).all())
        rows.sort(key=lambda r: (r[0], r[1]))
        datas = _codec.loads_many([r[2] for r in rows])
        return {(node, step): _shown(data) for (node, step, _), data in zip(rows, datas)}

    @_retried
    def metric_steps(self, root_key: str) -> dict[int, int]:
        query = (
            select(_metrics.c.node, func.max(_metrics.c.step))
            .where(_metrics.c.root_key == root_key)
            .group_by(_metrics.c.node)
            .order_by(_metrics.c.node)
        )
        with self._tx(write=False) as conn:
            return {int(node): int(step) for node, step in conn.execute(query).all()}

    # -- accounting ----------------------------------------------------------------------

    @_retried
    def add_stats(self, scope: str, **deltas: float) -> None:
        self.add_stats_many({scope: deltas})

    @_retried
    def add_stats_many(self, deltas: Mapping[str, Mapping[str, float]]) -> None:
        rows = [
            {"scope": scope, "key": key, "value": float(delta)}
            for scope, values in deltas.items()
            for key, delta in values.items()
        ]
        if not rows:
            return
        with self._tx(write=True) as conn:  # one statement, whatever the counters
            conn.execute(_add_stats_query(self._pg), rows)

    @_retried
    def stats(self, scope: str | None = None) -> dict[str, float]:
        if scope is None:
            query = select(_stats.c.key, func.sum(_stats.c.value)).group_by(_stats.c.key)
        else:
            query = _STATS_OF
        with self._tx(write=False, single=True) as conn:
            rows = conn.execute(query, {"s": scope}).all()
            return {key: float(value) for key, value in sorted(rows)}

    # -- studies -------------------------------------------------------------------------

    @_retried
    def create_study(self, name: str, meta: Mapping[str, Any]) -> bool:
        data = _codec.dumps(dict(meta), "study meta")
        with self._tx(write=True) as conn:
            if conn.execute(select(_studies.c.seq).where(_studies.c.name == name)).first():
                return False
            seq = (conn.execute(select(func.max(_studies.c.seq))).scalar() or 0) + 1
            conn.execute(
                _studies.insert(),
                {"seq": seq, "name": name, "meta": data, "created": time.time()},
            )
            return True

    @_retried
    def update_study_meta(self, name: str, meta: Mapping[str, Any]) -> dict[str, Any]:
        _codec.dumps(dict(meta), "study meta")  # JSON-able, checked before the write
        with self._tx(write=True) as conn:
            old = conn.execute(
                select(_studies.c.meta).where(_studies.c.name == name)
            ).scalar_one_or_none()
            if old is None:
                raise PlanKeyError(f"no study {name!r}")
            merged = {**_codec.loads(old), **dict(meta)}
            conn.execute(
                _studies.update()
                .where(_studies.c.name == name)
                .values(meta=_codec.dumps(merged, "study meta"))
            )
            return merged

    @_retried
    def studies(self) -> list[dict[str, Any]]:
        with self._tx(write=False) as conn:
            rows = conn.execute(select(_studies).order_by(_studies.c.seq)).all()
        return [{"name": r.name, "meta": _codec.loads(r.meta), "created": r.created} for r in rows]

    def _check_study(self, conn: Connection, study: str) -> None:
        if study in self._studies_seen:
            return
        if conn.execute(select(_studies.c.seq).where(_studies.c.name == study)).first() is None:
            raise PlanKeyError(f"no study {study!r}")
        self._studies_seen.add(study)

    @_retried
    def add_trial(
        self,
        study: str,
        root_key: str,
        config: Mapping[str, Any],
        hp: Mapping[str, Sequence],
        steps: int,
        node: int | None,
        step: int | None,
        *,
        state: str = "pending",
        attrs: Mapping[str, Any] | None = None,
        unique: bool = False,
        encoded: tuple[str, str] | None = None,
    ) -> int:
        checked = check_trial(TreeIndex(root_key), hp, steps)
        if encoded is None:
            encoded = (_codec.dumps(dict(config), "trial config"), dumps_hp(checked))
        ident = (root_key, *encoded)
        row = {
            "study": study,
            "root_key": root_key,
            "config": ident[1],
            "hp": ident[2],
            "steps": steps,
            "node": node,
            "step": step,
            "state": str(state),
            "attrs": _codec.dumps(dict(attrs or {}), "trial attrs"),
            "created": time.time(),
        }
        with self._tx(write=True) as conn:
            self._check_study(conn, study)
            if unique:  # one row per (study, root, config, hp)
                old = self._same_trial(conn, study, ident)
                if old is not None:
                    return old
            if self._engine.dialect.insert_returning:  # the next id and the row at once
                trial_id = int(conn.execute(_add_trial_query(), row).scalar_one())
            else:
                trial_id = int((conn.execute(select(func.max(_trials.c.id))).scalar() or 0) + 1)
                conn.execute(_trials.insert(), {"id": trial_id, **row})
            if self._w is not None:  # the row as stored, for reads in this transaction
                self._w.trials[trial_id] = {"id": trial_id, **row}
            return trial_id

    def _same_trial(self, conn: Connection, study: str, ident: tuple[str, str, str]) -> int | None:
        """The first trial of ``study`` with ``ident`` (root key, config and hp as
        stored), through this handle's index of the study's rows: the rows added since
        its last look (by this process or another) are read by id, a match is checked
        on its row, and only a hash collision compares the study's rows in SQL."""
        c = _trials.c
        last, index = self._trial_keys.get(study, (0, {}))
        added = conn.execute(_TRIALS_ADDED, {"s": study, "i": last}).all()
        for r in added:
            index.setdefault(hash((r.root_key, r.config, r.hp)), int(r.id))
        self._trial_keys[study] = (int(added[-1].id) if added else last, index)
        found = index.get(hash(ident))
        if found is None:
            return None
        row = conn.execute(select(c.root_key, c.config, c.hp).where(c.id == found)).first()
        if row is not None and tuple(row) == ident:
            return found
        old = conn.execute(  # another row with the same hash came first
            select(c.id)
            .where(c.study == study, c.root_key == ident[0], c.config == ident[1], c.hp == ident[2])
            .order_by(c.id)
        ).first()
        return None if old is None else int(old.id)

    @_retried
    def update_trial(
        self,
        trial_id: int,
        *,
        steps: int | None = None,
        node: int | None = None,
        step: int | None = None,
        state: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        seen: Mapping[str, Any] | None = None,
        only_from: str | None = None,
    ) -> dict[str, Any]:
        changes = trial_changes(steps, node, step, state)
        if attrs is not None:
            changes["attrs"] = _codec.dumps(dict(attrs), "trial attrs")
        if only_from is not None:  # compare and set: one statement, no read before
            with self._tx(write=True) as conn:
                return self._write_trial(conn, trial_id, changes, only_from)
        if seen is not None:  # the caller's read of the row, to spare this one
            stored = {k: seen[k] for k in changes if k != "attrs"}
            if "attrs" in changes:
                stored["attrs"] = _codec.dumps(dict(seen["attrs"] or {}), "trial attrs")
            if stored == changes:
                return dict(seen)
        else:
            with self._tx(write=False, single=True) as conn:  # nothing changes: no write
                row = conn.execute(_TRIAL, {"i": trial_id}).first()
            if row is None:
                raise PlanKeyError(f"no trial {trial_id}")
            if all(getattr(row, k) == v for k, v in changes.items()):
                return _trial(row)
        with self._tx(write=True) as conn:
            return self._write_trial(conn, trial_id, changes, None)

    def _write_trial(
        self, conn: Connection, trial_id: int, changes: dict[str, Any], only_from: str | None
    ) -> dict[str, Any]:
        """The ``UPDATE`` of :meth:`update_trial` (where the state is ``only_from`` when
        given: checked and set at once); the row as stored after it, returned with it
        (RETURNING), else read."""
        returning = self._engine.dialect.update_returning
        values = {f"b_{k}": v for k, v in changes.items()}
        values["b_id"] = trial_id
        if only_from is not None:
            values["b_from"] = only_from
        query = _update_trial_query(tuple(changes), returning, only_from is not None)
        row = conn.execute(query, values).first() if returning else None
        if row is None:  # no RETURNING, or nothing changed (only_from): the row as it is
            if not returning:
                conn.execute(query, values)
            row = conn.execute(_TRIAL, {"i": trial_id}).first()
        if row is None:
            raise PlanKeyError(f"no trial {trial_id}")
        if self._w is not None:
            self._w.trials[trial_id] = dict(row._mapping)
        # Decoded through the sequence cache (under the lock), as in trials(): a batch's
        # start and a trial's end write its row, whose sequences the cache holds.
        return _trial(row, self._seqs.decode_hp)

    @_retried
    def trial(self, trial_id: int) -> dict[str, Any]:
        with self._tx(write=False, single=True) as conn:
            w = self._w
            if w is not None and trial_id in w.trials:  # written or read by this transaction
                return _trial(_Row(w.trials[trial_id]), self._seqs.decode_hp)
            row = conn.execute(_TRIAL, {"i": trial_id}).first()
            if row is not None and w is not None:
                w.trials[trial_id] = dict(row._mapping)
            if row is None:
                raise PlanKeyError(f"no trial {trial_id}")
            return _trial(row, self._seqs.decode_hp)  # under the lock: the cache's

    @_retried
    def trials(self, study: str, *, light: bool = False) -> list[dict[str, Any]]:
        c = _trials.c
        columns = [col for col in _trials.c if not (light and col.name in ("config", "hp"))]
        with self._tx(write=False) as conn:
            rows = conn.execute(select(*columns).where(c.study == study).order_by(c.id)).all()
            # Decoded through the sequence cache (under the lock): a study's trials
            # share a few sequences, and their nodes hold the same ones.
            return _trials_of(rows, None if light else self._seqs.decode_hp_many)

    @_retried
    def final_metrics(self, study: str) -> dict[int, dict[str, float]]:
        t, m = _trials.c, _metrics.c
        query = (
            select(t.id, m.data)
            .select_from(_trials.join(_metrics, (m.node == t.node) & (m.step == t.steps)))
            .where(t.study == study, t.step == t.steps)
            .order_by(t.id)
        )
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
        datas = _codec.loads_many([data for _, data in rows])
        return {tid: _shown(data) for (tid, _), data in zip(rows, datas)}

    @_retried
    def trial_ends(self, study: str) -> list[TrialEnd]:
        t, m = _trials.c, _metrics.c
        at_end = (m.node == t.node) & (m.step == t.steps) & (t.step == t.steps)
        query = (
            select(t.id, t.steps, t.node, t.step, t.attrs, m.data)
            .select_from(_trials.outerjoin(_metrics, at_end))
            .where(t.study == study)
            .order_by(t.id)
        )
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
        texts = list(dict.fromkeys(attrs for *_, attrs, _ in rows))  # a few distinct ones
        attrs_of = dict(zip(texts, _codec.loads_many(texts)))
        datas = iter(_codec.loads_many([data for *_, data in rows if data is not None]))
        return [
            TrialEnd(
                tid,
                steps,
                node,
                step,
                attrs_of[attrs],
                None if data is None else _shown(next(datas)),
            )
            for tid, steps, node, step, attrs, data in rows
        ]

    @_retried
    def trial_finals(self, study: str) -> list[TrialFinal]:
        t, m = _trials.c, _metrics.c
        at_end = (m.node == t.node) & (m.step == t.steps) & (t.step == t.steps)
        query = (
            select(t.id, t.config, t.hp, t.steps, t.node, t.step, t.state, t.attrs, m.data)
            .select_from(_trials.outerjoin(_metrics, at_end))
            .where(t.study == study)
            .order_by(t.id)
        )
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
            # Decoded through the sequence cache (under the lock), as in trials().
            hps = self._seqs.decode_hp_many([row[2] for row in rows])
        configs = _codec.loads_many([row[1] for row in rows])
        texts = list(dict.fromkeys(row[7] for row in rows))  # a few distinct ones
        attrs_of = dict(zip(texts, _codec.loads_many(texts)))
        datas = iter(_codec.loads_many([row[8] for row in rows if row[8] is not None]))
        return [
            TrialFinal(
                tid,
                config,
                hp,
                steps,
                node,
                step,
                state,
                attrs_of[attrs],
                None if data is None else _shown(next(datas)),
            )
            for (tid, _, _, steps, node, step, state, attrs, data), config, hp in zip(
                rows, configs, hps
            )
        ]

    @_retried
    def append_log(self, study: str, record: Mapping[str, Any]) -> int:
        data = _codec.dumps(dict(record), "log record")
        with self._tx(write=True) as conn:
            self._check_study(conn, study)
            if self._engine.dialect.insert_returning:  # the next seq and the row at once
                return int(conn.execute(_append_log_query(), {"s": study, "r": data}).scalar_one())
            last = conn.execute(
                select(func.max(_logs.c.seq)).where(_logs.c.study == study)
            ).scalar()
            seq = 0 if last is None else int(last) + 1
            conn.execute(_logs.insert(), {"study": study, "seq": seq, "record": data})
            return seq

    @_retried
    def read_log(self, study: str) -> list[dict[str, Any]]:
        with self._tx(write=False) as conn:
            rows = conn.execute(
                select(_logs.c.record).where(_logs.c.study == study).order_by(_logs.c.seq)
            ).scalars()
            return [_codec.loads(r) for r in rows]

    @_retried
    def last_log(self, study: str, event: str | None = None) -> dict[str, Any] | None:
        c = _logs.c
        query = select(c.record).where(c.study == study).order_by(c.seq.desc())
        needle = None if event is None else _codec.event_needle(event)
        if needle is not None and needle.replace('"', "").replace(":", "").isalnum():
            # LIKE's wildcards and escapes aside (an event name of letters and digits)
            query = query.where(c.record.like(f"%{needle}%"))
        elif needle is None:
            query = query.limit(1)
        with self._tx(write=False) as conn:
            for (text,) in conn.execute(query):  # from the end, decoded one at a time
                if needle is not None and needle not in text:
                    continue
                record: dict[str, Any] = _codec.loads(text)
                if event is None or record.get("event") == event:
                    return record
        return None

    # -- leases --------------------------------------------------------------------------

    def _grant(
        self,
        conn: Connection,
        live: list[Lease],
        owner: str,
        scope: str,
        spans: list[tuple[int | None, int, int]],
        ttl: float,
    ) -> tuple[Lease, ...]:
        host, pid = host_pid()
        now = time.time()
        # every row of the table was read by _live_leases (the expired ones deleted)
        first = max((lease.id for lease in live), default=0) + 1
        out = tuple(
            Lease(first + i, owner, scope, n, a, b, host, pid, now, now + ttl)
            for i, (n, a, b) in enumerate(spans)
        )
        if out:
            conn.execute(_LEASES_INSERT, [_lease_row(lease) for lease in out])
        return out

    def _live_leases(self, conn: Connection, now: float) -> list[Lease]:
        # Read first, delete only when some expired (a claim's usual case is none: one
        # statement fewer in every claim's transaction). The write lock is held, so
        # what was read is what stays.
        rows = [_lease(row) for row in conn.execute(_LEASES)]
        live = [lease for lease in rows if lease.expires > now]
        if len(live) < len(rows):
            conn.execute(_LEASES_EXPIRED, {"now": now})
        return live

    @_retried
    def claim(
        self, owner: str, root_key: str, segments: Seq[tuple[int, int, int]], ttl: float
    ) -> ClaimResult:
        with self._tx(write=True) as conn:
            now = time.time()
            live = self._live_leases(conn, now)
            conflicts = stage_conflicts(live, owner, segments, now)
            if conflicts:
                return ClaimResult(conflicts=tuple(conflicts))
            spans: list[tuple[int | None, int, int]] = [(n, a, b) for n, a, b in segments if b > a]
            return ClaimResult(granted=self._grant(conn, live, owner, root_key, spans, ttl))

    @_retried
    def claim_study(self, owner: str, study: str, ttl: float) -> ClaimResult:
        with self._tx(write=True) as conn:
            now = time.time()
            live = self._live_leases(conn, now)
            conflicts = study_conflicts(live, owner, study, now)
            if conflicts:
                return ClaimResult(conflicts=tuple(conflicts))
            for lease in live:
                if lease.node is None and lease.scope == study and lease.owner == owner:
                    conn.execute(
                        _leases.update().where(_leases.c.id == lease.id).values(expires=now + ttl)
                    )
                    return ClaimResult(granted=(_replace_expiry(lease, now + ttl),))
            return ClaimResult(granted=self._grant(conn, live, owner, study, [(None, 0, 0)], ttl))

    @_retried
    def renew(self, owner: str, ttl: float) -> int:
        with self._tx(write=True, bump=False) as conn:  # a heartbeat changes nothing shown
            result = conn.execute(
                _leases.update().where(_leases.c.owner == owner).values(expires=time.time() + ttl)
            )
            return int(result.rowcount or 0)

    @_retried
    def release(self, owner: str, lease_ids: Collection[int] | None = None) -> int:
        if lease_ids is not None:
            if not lease_ids:
                return 0
            with self._tx(write=True) as conn:
                done = conn.execute(_LEASES_RELEASE, {"o": owner, "ids": list(lease_ids)})
                return int(done.rowcount or 0)
        query = _leases.delete().where(_leases.c.owner == owner)
        with self._tx(write=True) as conn:
            return int(conn.execute(query).rowcount or 0)

    @_retried
    def requests_on(self, nodes: Collection[int]) -> list[Request]:
        wanted = sorted(set(nodes))
        if not wanted:
            return []
        with self._tx(write=False, single=True) as conn:  # by the primary key (node, step)
            rows = conn.execute(_requests_on_query(), {"nodes": wanted}).all()
        known = _STATES
        return [
            Request(node, step, refcount, known[state], error)
            for node, step, refcount, state, error in rows
        ]

    @_retried
    def leases(self, scope: str | None = None, live_only: bool = True) -> list[Lease]:
        if _leases.name in self._absent:
            return []
        query = select(_leases).order_by(_leases.c.id)
        if scope is not None:
            query = query.where(_leases.c.scope == scope)
        if live_only:
            query = query.where(_leases.c.expires > time.time())
        with self._tx(write=False) as conn:
            return [_lease(row) for row in conn.execute(query)]

    # -- change feed ---------------------------------------------------------------------

    def writes_here(self) -> int:  # a counter in this process: nothing to retry
        return self._changes

    def revision(self) -> int:
        with self._tx(write=False) as conn:
            raw = conn.execute(
                select(_meta.c.value).where(_meta.c.key == _REVISION)
            ).scalar_one_or_none()
        return int(raw) if raw is not None else 0

    @_retried
    def record_activity(self, items: Iterable[Mapping[str, Any]]) -> None:
        rows = [activity_row(item) for item in items]
        if not rows:
            return
        for row in rows:
            row["data"] = _codec.dumps(row["data"], "activity data")
        with self._tx(write=True) as conn:
            conn.execute(_ACTIVITY_INSERT, rows)

    @_retried
    def activity(
        self, after: int = 0, root_keys: Collection[str] | None = None
    ) -> list[ActivityRecord]:
        if _activity.name in self._absent:
            return []
        query = select(*_ACTIVITY_COLUMNS).where(_activity.c.seq > after).order_by(_activity.c.seq)
        keys = None if root_keys is None else list(root_keys)
        rows: list[Any] = []
        with self._tx(write=False) as conn:
            if keys is None:
                rows = list(conn.execute(query).all())
            else:
                for i in range(0, len(keys), _CHUNK):
                    chunk = query.where(_activity.c.root_key.in_(keys[i : i + _CHUNK]))
                    rows.extend(conn.execute(chunk).all())
        if keys is not None and len(keys) > _CHUNK:
            rows.sort(key=lambda r: r[0])
        datas = _codec.loads_many([row[-1] for row in rows])
        return [
            ActivityRecord(seq, owner, batch, kind, worker, root, node, step, at, seconds, data)
            for (seq, owner, batch, kind, worker, root, node, step, at, seconds, _), data in zip(
                rows, datas
            )
        ]

    # -- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._engine.dispose()

    @_retried
    def drop_all(self) -> None:
        """Drop every stagetree table (tests; irreversible)."""
        with self._tx(write=True, bump=False) as conn:
            _md.drop_all(conn)
        self._trees.clear()
        self._node_cache.clear()
        self._trial_keys.clear()
        self._roots_seen.clear()
        self._studies_seen.clear()


# The columns of an ActivityRecord, in its fields' order.
_ACTIVITY_COLUMNS = tuple(_activity.c[f.name] for f in dataclasses.fields(ActivityRecord))


# Keys per query of metrics_at: (node = ? AND step = ?) OR ..., which both SQLite and
# PostgreSQL answer by index look-ups (SQLite scans the whole table for a row-value
# IN list); a short last chunk repeats its last key, so that one statement serves all.
_AT_CHUNK = 250


@functools.cache
def _add_trial_query() -> Any:
    """``INSERT ... SELECT`` of a trial row (a parameter per column but ``id``),
    returning its id: the largest plus one, 1 for the first; built once."""
    values = [bindparam(c.name, type_=c.type) for c in _trials.c if c.name != "id"]
    rows = select(func.coalesce(func.max(_trials.c.id), 0) + 1, *values)
    return _trials.insert().from_select(list(_trials.c.keys()), rows).returning(_trials.c.id)


@functools.cache
def _append_log_query() -> Any:
    """``INSERT ... SELECT`` of a study's next log record (parameters ``s``, the study,
    and ``r``, the record's text), returning its seq: the study's largest plus one, 0
    for its first; built once."""
    study = bindparam("s", type_=String)
    seq = func.coalesce(func.max(_logs.c.seq) + 1, 0)
    rows = select(study, seq, bindparam("r", type_=Text)).where(_logs.c.study == study)
    return _logs.insert().from_select(["study", "seq", "record"], rows).returning(_logs.c.seq)


@functools.cache
def _metrics_at_query() -> Select[Any]:
    c = _metrics.c
    return select(c.node, c.step, c.data).where(
        or_(
            *(
                and_(c.node == bindparam(f"n{j}"), c.step == bindparam(f"s{j}"))
                for j in range(_AT_CHUNK)
            )
        )
    )


@functools.cache
def _add_stats_query(pg: bool) -> Any:
    """Adds the bound ``value`` to counter (``scope``, ``key``), created at 0: an
    upsert, so that a round's counters take one statement (built once)."""
    stmt = (pg_insert if pg else sqlite_insert)(_stats)
    return stmt.on_conflict_do_update(
        index_elements=[_stats.c.scope, _stats.c.key],
        set_={"value": _stats.c.value + stmt.excluded.value},
    )


@functools.cache
def _update_trial_query(keys: tuple[str, ...], returning: bool, only_from: bool = False) -> Any:
    """``UPDATE`` of trial ``b_id``'s columns ``keys`` (parameters ``b_<key>``), where its
    state is ``b_from`` too when ``only_from``, the row returned with it when
    ``returning``; built once per set of columns."""
    update = _trials.update().where(_T.id == bindparam("b_id"))
    if only_from:
        update = update.where(_T.state == bindparam("b_from"))
    update = update.values({k: bindparam(f"b_{k}") for k in keys})
    return update.returning(*_trials.c) if returning else update


@functools.cache
def _put_checkpoint_query(pg: bool) -> Any:
    """Stores checkpoint record (``node``, ``step``), replacing the one there: an upsert,
    one statement (built once)."""
    stmt = (pg_insert if pg else sqlite_insert)(_checkpoints)
    return stmt.on_conflict_do_update(
        index_elements=[_checkpoints.c.node, _checkpoints.c.step],
        set_={k: stmt.excluded[k] for k in ("root_key", "ref", "nbytes", "created")},
    )


@functools.cache
def _requests_on_query() -> Select[Any]:
    """Requests on the nodes bound as ``nodes`` (built once: a poll's statement is
    compiled from the cache, not put together again)."""
    c = _requests.c
    return (
        select(c.node, c.step, c.refcount, c.state, c.error)
        .where(c.node.in_(bindparam("nodes", expanding=True)))
        .order_by(c.node, c.step)
    )


def _shown(stored: dict[str, float]) -> dict[str, float]:
    """:func:`shown_metrics` of freshly decoded metrics (changed in place)."""
    stored.pop(PARTIAL_KEY, None)
    return stored


_STATES = {state.value: state for state in RequestState}  # RequestState(x) is slow


class _Row:
    """A row given as a mapping, read by attribute (as SQLAlchemy's rows are)."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = values

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None


def _request(row: Any) -> Request:
    return Request(row.node, row.step, row.refcount, _STATES[row.state], row.error)


def _request_row(req: Request, root_key: str) -> dict[str, Any]:
    return {
        "node": req.node,
        "step": req.step,
        "root_key": root_key,
        "refcount": req.refcount,
        "state": req.state.value,
        "error": req.error,
    }


def _lease(row: Any) -> Lease:
    return Lease(
        row.id,
        row.owner,
        row.scope,
        row.node,
        row.start,
        row.stop,
        row.host,
        row.pid,
        row.created,
        row.expires,
    )


def _lease_row(lease: Lease) -> dict[str, Any]:
    return {
        "id": lease.id,
        "owner": lease.owner,
        "scope": lease.scope,
        "node": lease.node,
        "start": lease.start,
        "stop": lease.stop,
        "host": lease.host,
        "pid": lease.pid,
        "created": lease.created,
        "expires": lease.expires,
    }


def _replace_expiry(lease: Lease, expires: float) -> Lease:
    return Lease(**{**_lease_row(lease), "expires": expires})


def _trials_of(
    rows: Seq[Any], decode_hp: Callable[[list[str]], list[dict[str, Sequence]]] | None
) -> list[dict[str, Any]]:
    """:func:`_trial` of many rows (all ``_trials`` columns in table order, or without
    ``config`` and ``hp`` when ``decode_hp`` is None), their JSON decoded in bulk. The
    columns are taken by position: a named column of a SQLAlchemy row costs a
    microsecond, and ten of them per row were most of a 100,000-trial read."""
    if decode_hp is None:
        common, attrs_at = operator.itemgetter(0, 1, 2, 3, 4, 5, 6, 8), 7
        loaded: list[dict[str, Any]] = [{}] * len(rows)
    else:
        common, attrs_at = operator.itemgetter(0, 1, 2, 5, 6, 7, 8, 10), 9
        configs = _codec.loads_many([row[3] for row in rows])
        hps = decode_hp([row[4] for row in rows])
        loaded = [{"config": c, "hp": h} for c, h in zip(configs, hps)]
    attrs_all = _attrs_many([row[attrs_at] for row in rows])
    return [
        {
            "id": tid,
            "study": study,
            "root_key": root_key,
            **config_hp,  # in _trial's key order
            "steps": steps,
            "node": node,
            "step": step,
            "state": state,
            "attrs": attrs,
            "created": created,
        }
        for (tid, study, root_key, steps, node, step, state, created), attrs, config_hp in zip(
            map(common, rows), attrs_all, loaded
        )
    ]


def _attrs_many(texts: list[str]) -> list[dict[str, Any]]:
    """The trial attributes of ``texts``, each text decoded once (a study's trials carry
    a few distinct ones: the trainer version, when the run opened them), each row its
    own copy."""
    unique = list(dict.fromkeys(texts))
    decoded = dict(zip(unique, _codec.loads_many(unique)))
    flat = {
        text: isinstance(d, dict) and not any(isinstance(v, (dict, list)) for v in d.values())
        for text, d in decoded.items()
    }
    return [dict(decoded[t]) if flat[t] else _codec.detach(decoded[t]) for t in texts]


def _trial(row: Any, decode_hp: Callable[[str], dict[str, Sequence]] = loads_hp) -> dict[str, Any]:
    return {
        "id": row.id,
        "study": row.study,
        "root_key": row.root_key,
        "config": _codec.loads(row.config),
        "hp": decode_hp(row.hp),
        "steps": row.steps,
        "node": row.node,
        "step": row.step,
        "state": row.state,
        "attrs": _codec.loads(row.attrs),
        "created": row.created,
    }
