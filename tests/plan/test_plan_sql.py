"""SQL-specific behaviour: opening URLs, schema versions, concurrent processes."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from plan_helpers import check_tree, same_values
from sqlalchemy import event

from stagetree.exceptions import SchemaVersionError, StorageError
from stagetree.hp import Constant, MultiStep, Piecewise, Sequence
from stagetree.plan import (
    SCHEMA_VERSION,
    BasePlanStorage,
    MemoryPlanStorage,
    RequestState,
    SQLPlanStorage,
    open_storage,
)
from stagetree.reports.trials import trial_records

PG_URL = os.environ.get("STAGETREE_TEST_DB_URL")
R = "root"


# -- open_storage ----------------------------------------------------------------------


@pytest.mark.parametrize("url", ["memory://", ":memory:", " memory: "])
def test_memory_urls(url: str) -> None:
    assert isinstance(open_storage(url), MemoryPlanStorage)


def test_sqlite_url(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    plan = open_storage(f"sqlite:///{path}")
    assert isinstance(plan, SQLPlanStorage)
    plan.insert_trial(R, {"lr": Constant(0.1)}, 3)
    plan.close()
    assert path.exists()
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_sqlite_in_memory_url() -> None:
    plan = open_storage("sqlite://")
    ins = plan.insert_trial(R, {"lr": Constant(0.1)}, 3)
    assert plan.request(ins.node, 3) is not None
    plan.close()


@pytest.mark.parametrize(
    ("url", "pattern"),
    [
        ("mysql://u@h/db", "unknown scheme 'mysql'"),
        ("plan.db", "unknown scheme ''"),
        ("sqlite:////nonexistent-dir-5e1f/sub/plan.db", "nonexistent-dir-5e1f"),
        ("postgresql://nobody@127.0.0.1:1/db?connect_timeout=2", "127.0.0.1:1"),
    ],
)
def test_unopenable_urls_raise_storage_error(url: str, pattern: str) -> None:
    with pytest.raises(StorageError, match=pattern):
        open_storage(url)


def test_password_is_not_shown() -> None:
    with pytest.raises(StorageError) as info:
        open_storage("postgresql://user:hunter2@127.0.0.1:1/db?connect_timeout=2")
    assert "hunter2" not in str(info.value)


# -- schema version --------------------------------------------------------------------


def test_newer_schema_version_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    plan = SQLPlanStorage(f"sqlite:///{path}")
    plan.insert_trial(R, {"lr": Constant(0.1)}, 3)
    plan.close()
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE stagetree_meta SET value = ? WHERE key = 'schema_version'",
            (str(SCHEMA_VERSION + 1),),
        )
        revision = db.execute("SELECT value FROM stagetree_meta WHERE key = 'revision'")
        before = revision.fetchone()
    db.close()
    with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}"):
        SQLPlanStorage(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:
        meta = dict(db.execute("SELECT key, value FROM stagetree_meta").fetchall())
        assert meta == {"schema_version": str(SCHEMA_VERSION + 1), "revision": meta["revision"]}
        assert (meta["revision"],) == before  # not even the change counter moved
        assert db.execute("SELECT count(*) FROM stagetree_nodes").fetchone() == (1,)
    db.close()


def test_unreadable_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    SQLPlanStorage(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE stagetree_meta SET value = 'v-two'")
    db.close()
    with pytest.raises(SchemaVersionError, match="v-two"):
        open_storage(f"sqlite:///{path}")


def test_version_is_written_once(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    for _ in range(3):
        SQLPlanStorage(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT key, value FROM stagetree_meta").fetchall()
    db.close()
    # Opening writes nothing after the first time: the revision stays where creating the
    # tables left it.
    assert sorted(rows) == [("revision", "1"), ("schema_version", str(SCHEMA_VERSION))]


# -- concurrent processes --------------------------------------------------------------


def _trials(steps: int = 30) -> list[tuple[dict[str, Sequence], int]]:
    """Distinct trials (same length) with heavily shared prefixes."""
    lrs = [Constant(0.1)] + [MultiStep(0.1, [m], g) for m in (5, 12, 20) for g in (0.1, 0.5)]
    moms = [Constant(0.9)] + [Piecewise([0.9, v], [s]) for s in (3, 9, 17, 25) for v in (0.8, 0.99)]
    bss = [Constant(32), Piecewise([32, 64], [15])]
    return [
        ({"lr": lr, "momentum": m, "batch_size": b}, steps) for lr in lrs for m in moms for b in bss
    ]


def _insert_worker(url: str, indices: list[int], seed: int, barrier: Any = None) -> None:
    """Process body: insert the given trials in small random batches."""
    trials = _trials()
    rng = random.Random(seed)
    plan = SQLPlanStorage(url)
    if barrier is not None:
        barrier.wait(60)  # start inserting together
    i = 0
    while i < len(indices):
        size = rng.choice([1, 2, 5, 9])
        chunk = [trials[j] for j in indices[i : i + size]]
        if size == 1:
            plan.insert_trial(R, *chunk[0])
        else:
            plan.insert_trials(R, chunk)
        i += size
    plan.close()


def _concurrent_inserts(url: str) -> None:
    trials = _trials()
    n = len(trials)
    # Overlapping halves; each process also inserts a few of its trials twice.
    first = list(range(0, 2 * n // 3)) + list(range(0, 10))
    second = list(range(n // 3, n)) + list(range(n - 10, n))
    random.Random(1).shuffle(first)
    random.Random(2).shuffle(second)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [
        ctx.Process(target=_insert_worker, args=(url, first, 11, barrier)),
        ctx.Process(target=_insert_worker, args=(url, second, 12, barrier)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    expected = Counter(first + second)

    plan = SQLPlanStorage(url)
    # One process inserting everything gives a tree of the same size.
    alone = MemoryPlanStorage()
    alone.insert_trials(R, [trials[i] for i in first + second])
    check_tree(plan, R)
    nodes = plan.nodes(R)
    assert len(nodes) == len(alone.nodes(R)) == n  # distinct equal-length trials
    assert [x.id for x in nodes] == list(range(1, n + 1))
    requests = {(r.node, r.step): r for r in plan.requests(R)}
    assert len(requests) == n
    assert sorted(r.refcount for r in requests.values()) == sorted(
        r.refcount for r in alone.requests(R)
    )
    for i, (hp, steps) in enumerate(trials):
        key = plan.locate(R, hp, steps)
        assert key is not None
        assert (requests[key].refcount, requests[key].state) == (expected[i], RequestState.PENDING)
    # Sharing by value holds across what the two processes wrote.
    rng = random.Random(5)
    for _ in range(200):
        a, b = rng.sample(range(n), 2)
        s = rng.randrange(31)
        shared = plan.locate(R, trials[a][0], s) == plan.locate(R, trials[b][0], s)
        assert shared == same_values(trials[a][0], trials[b][0], s)
    plan.close()


def test_two_processes_insert_into_one_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    SQLPlanStorage(url).close()  # create the schema up front (not required)
    _concurrent_inserts(url)
    with sqlite3.connect(tmp_path / "shared.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()


@pytest.mark.skipif(not PG_URL, reason="set STAGETREE_TEST_DB_URL to run PostgreSQL tests")
def test_two_processes_insert_into_postgres() -> None:
    assert PG_URL is not None
    fresh = SQLPlanStorage(PG_URL)
    fresh.drop_all()
    fresh.close()
    _concurrent_inserts(PG_URL)


def test_schema_creation_races(tmp_path: Path) -> None:
    # Two processes opening a brand-new file at once both succeed.
    url = f"sqlite:///{tmp_path / 'race.db'}"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_insert_worker, args=(url, [k], k)) for k in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    plan: BasePlanStorage = SQLPlanStorage(url)
    assert len(plan.nodes(R)) == 2
    plan.close()


def _open_at_once(url: str, barrier: Any, name: str) -> None:
    barrier.wait()
    storage = open_storage(url)
    storage.create_study(name, {})
    storage.close()


def test_processes_opening_a_new_sqlite_plan_at_once(tmp_path: Path) -> None:
    """Regression: switching a new file to WAL needs it to itself, and SQLite answered
    "database is locked" at once (no busy wait) to a process opening it meanwhile."""
    ctx = multiprocessing.get_context("spawn")
    for round_ in range(3):
        url = f"sqlite:///{tmp_path / f'race{round_}.db'}"
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=_open_at_once, args=(url, barrier, f"s{i}")) for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        storage = open_storage(url)
        assert sorted(s["name"] for s in storage.studies()) == ["s0", "s1", "s2", "s3"]
        storage.close()


# -- unique trials at scale ------------------------------------------------------------


def test_unique_add_trial_reads_only_the_rows_added_since(tmp_path: Path) -> None:
    """``add_trial(unique=True)`` (one per submission) looks its row up by index: it never
    compares the configs and sequences of every trial of the study (quadratic in a study
    of 100,000 trials), yet sees rows another handle added."""
    url = f"sqlite:///{tmp_path}/plan.db"
    a, b = SQLPlanStorage(url), SQLPlanStorage(url)
    a.create_study("s", {})
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(a._engine, "before_cursor_execute", seen)
    hp = [{"lr": Constant(0.01 * i)} for i in range(20)]
    ids = [a.add_trial("s", "r", {}, h, 5, None, None, unique=True) for h in hp]
    other = b.add_trial("s", "r", {}, {"lr": Constant(0.5)}, 5, None, None, unique=True)
    assert b.add_trial("s", "r", {}, hp[3], 5, None, None, unique=True) == ids[3]
    assert a.add_trial("s", "r", {}, {"lr": Constant(0.5)}, 5, None, None, unique=True) == other
    assert [a.add_trial("s", "r", {}, h, 9, None, None, unique=True) for h in hp] == ids
    assert len(a.trials("s")) == 21
    assert not [s for s in statements if "stagetree_trials.config =" in s]
    # a hash that collides with another row's still finds the right one
    last, index = a._trial_keys["s"]
    a._trial_keys["s"] = (last, {key: ids[0] for key in index})
    assert a.add_trial("s", "r", {}, hp[7], 5, None, None, unique=True) == ids[7]
    a.close()
    b.close()


def test_final_trial_records_read_the_trials_once(tmp_path: Path) -> None:
    """``Study.trials(history=False)`` reads each trial row once, with its final metrics
    joined in the same query (a second pass over 100,000 rows for the final points was
    a third of the read), reads no learning curve, and finds that no exploit made a
    trial without reading the tuner's whole log."""
    plan = SQLPlanStorage(f"sqlite:///{tmp_path}/plan.db")
    plan.create_study("s", {"version": "v"})
    for i in range(5):
        ins = plan.insert_trial("r", {"lr": Constant(0.1 * i)}, 4)
        plan.put_metrics_many([(ins.node, s, {"m": s + i}, True) for s in (2, 4)])
        state = "failed" if i == 3 else "done"
        plan.add_trial("s", "r", {}, {"lr": Constant(0.1 * i)}, 4, ins.node, 4, state=state)
        plan.append_log("s", {"event": "submit", "key": i, "config": {"event": "exploit"}})
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(plan._engine, "before_cursor_execute", seen)
    records = trial_records(plan, "s", "v", history=False)
    assert [(r.id, r.state, r.metrics) for r in records] == [
        (i + 1, "failed" if i == 3 else "done", {4: {"m": 4 + i}}) for i in range(5)
    ]
    reads = [s for s in statements if "FROM stagetree_trials" in s]
    assert len(reads) == 1 and "stagetree_metrics" in reads[0]
    # no exploit logged (lineage): found by a query, without reading the whole log
    assert [s for s in statements if "FROM stagetree_logs" in s and "LIKE" not in s] == []
    plan.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_replayed_trial_takes_no_write_transaction(tmp_path: Path, kind: str) -> None:
    """A resumed study submits each of its trials again: registering its root, inserting
    its existing path without a request and setting the state it has are answered by
    reads (a write transaction per call, 100,000 of each, was most of a replay), and
    still see what another handle wrote."""
    if kind == "postgres" and not PG_URL:
        pytest.skip("set STAGETREE_TEST_DB_URL to run the PostgreSQL backend")
    url = f"sqlite:///{tmp_path}/plan.db" if kind == "sqlite" else str(PG_URL)
    if kind == "postgres":
        SQLPlanStorage(url).drop_all()
    a, b = SQLPlanStorage(url), SQLPlanStorage(url)
    a.create_study("s", {})
    hp = {"lr": Constant(0.1)}
    a.register_root("r", {"x": 1})
    ins = a.insert_trial("r", hp, 5, request=False)
    tid = a.add_trial("s", "r", {}, hp, 5, ins.node, ins.step, state="done", attrs={"v": 1})
    writes: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE", "BEGIN I")):
            writes.append(statement)

    event.listen(a._engine, "before_cursor_execute", seen)
    revision = a.revision()
    a.register_root("r", {"x": 1})
    assert a.insert_trial("r", hp, 5, request=False) == dataclasses.replace(ins, new_nodes=())
    assert a.insert_trial("r", hp, 3, request=False).node == ins.node
    assert a.update_trial(tid, state="done", attrs={"v": 1}) == a.trial(tid)
    assert a.revision() == revision and writes == []
    # what another handle changed is seen, and a change is written
    b.update_trial(tid, state="pending")
    assert a.update_trial(tid, state="done")["state"] == "done"
    assert b.trial(tid)["state"] == "done"
    other = b.insert_trial("r", {"lr": MultiStep(0.1, [2], 0.5)}, 5, request=False)
    assert a.insert_trial("r", {"lr": MultiStep(0.1, [2], 0.5)}, 5, request=False) == (
        dataclasses.replace(other, new_nodes=())
    )
    with pytest.raises(StorageError, match="another config"):
        b.register_root("r", {"x": 2})
    a.close()
    b.close()


def test_metrics_of_many_trials_are_merged_with_one_read(tmp_path: Path) -> None:
    """A batch of curve points over many nodes (the engine writes a batch per event
    round) reads what is stored for them in one query, not one per node, and merges
    the points as before."""
    plan = SQLPlanStorage(f"sqlite:///{tmp_path}/plan.db")
    nodes = [plan.insert_trial("r", {"lr": Constant(0.01 * i)}, 9).node for i in range(1, 40)]
    plan.put_metrics_many([(n, 3, {"a": 1.0}, True) for n in nodes])
    reads: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM stagetree_metrics" in statement:
            reads.append(statement)

    event.listen(plan._engine, "before_cursor_execute", seen)
    plan.put_metrics_many(
        [(n, 3, {"b": 2.0}, True) for n in nodes] + [(n, 4, {"a": 0.5}, False) for n in nodes]
    )
    assert len(reads) == 1
    for n in nodes:
        assert plan.metrics("r", [n])[n] == {3: {"a": 1.0, "b": 2.0}, 4: {"a": 0.5}}
    plan.close()
