"""The efficiency figure (issue 13): ``reports.efficiency`` on hand-written activity
records (the exact definition), and on real studies through ``Study.stats()``,
``report_study`` (``stagetree run``'s report) and ``stagetree status``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer, SlowLinearTrainer

from stagetree import Study, reports
from stagetree.cli import efficiency_line, report_study, status
from stagetree.hp import Constant, MultiStep
from stagetree.plan import MemoryPlanStorage, open_storage
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

PARTS = (
    "limit_seconds",
    "startup_seconds",
    "ckpt_load_wait_seconds",
    "ckpt_save_wait_seconds",
    "idle_seconds",
    "scheduling_seconds",
)
LRS = [Constant(0.05), MultiStep(0.05, [3], 0.5), MultiStep(0.05, [6], 0.5)]


def _record(owner: str, batch: int, kind: str, worker: int, time: float, **kw: Any) -> dict:
    return {
        "owner": owner,
        "batch": batch,
        "kind": kind,
        "worker": worker,
        "root_key": "r",
        "time": time,
        **kw,
    }


def _batch(
    owner: str,
    batch: int,
    worker: int,
    span: tuple[float, float],
    segment: list[int],
    busy: float,
    steps: int,
    load: float = 0.0,
    wait: float = 0.0,
) -> list[dict[str, Any]]:
    start = {"segments": [segment], "start_step": segment[1], "stop_step": segment[2]}
    done = {"steps": steps, "load_seconds": load, "save_wait_seconds": wait}
    return [
        _record(owner, batch, "start", worker, span[0], data=start),
        _record(owner, batch, "done", worker, span[1], seconds=busy, data=done),
    ]


def _storage(run: dict[str, Any] | None) -> MemoryPlanStorage:
    storage = MemoryPlanStorage()
    storage.create_study("s", {"version": "v", **({"run": run} if run else {})})
    storage.add_trial("s", "r", {}, {}, 9, None, None, attrs={"version": "v"})
    return storage


def test_the_definition_on_hand_written_records() -> None:
    run = {"started": 100.0, "ended": 110.0, "workers": 2, "owner": "me", "version": "v"}
    storage = _storage(run)
    records = [
        *_batch("old", 1, 0, (90.0, 95.0), [1, 0, 4], 5.0, 4),  # an earlier run
        # worker 0: steps 0-3 of node 1 at 1 s a step (after a 0.5 s load)
        *_batch("me", 1, 0, (101.0, 106.0), [1, 0, 4], 4.5, 4, load=0.5),
        # worker 1: steps 4-8 of node 2 at 1 s a step, 0.5 s load, 1 s waiting for saves
        *_batch("me", 2, 1, (102.0, 109.0), [2, 4, 9], 6.5, 5, load=0.5, wait=1.0),
        # worker 0 again: step 0 of node 1 a second time (not a unique step), slower
        *_batch("me", 3, 0, (106.5, 108.0), [1, 0, 4], 1.5, 1),
        *_batch("other", 1, 1, (103.0, 104.0), [3, 0, 1], 1.0, 1),  # another engine's
    ]
    storage.record_activity(records)
    got = reports.efficiency(storage, "s")
    # W x T = 20 worker-seconds: the limit is 9 unique steps x 1 s (the step-weighted
    # median) = 9; start-up until the first step (101.5, after batch 1's load) on both
    # workers = 3; loads after it 0.5 (batch 2's), save waits 1; idle: 2 x 8.5 s after
    # the first step less 6 s (worker 0) and 7 s (worker 1) = 4; scheduling the rest,
    # 2.5. Each divided by W: seconds of the wall-clock.
    expected = {
        "efficiency": 0.45,
        "wall_seconds": 10.0,
        "limit_seconds": 4.5,
        "startup_seconds": 1.5,
        "ckpt_load_wait_seconds": 0.25,
        "ckpt_save_wait_seconds": 0.5,
        "idle_seconds": 2.0,
        "scheduling_seconds": 1.25,
        "workers": 2.0,
        "steps_unique_trained": 9.0,
        "seconds_per_step": 1.0,
    }
    assert got == pytest.approx(expected)
    assert set(got) == set(reports.EFFICIENCY_KEYS)
    assert sum(got[k] for k in PARTS) == pytest.approx(got["wall_seconds"])
    line = efficiency_line(got)
    assert line.startswith("0.45 (limit 4.50 s of 10.0 s on 2 workers; start-up 1.50 s")
    assert "load 0.25 s + save 0.50 s, idle 2.00 s, scheduling 1.25 s)" in line


def test_steps_faster_than_the_median_never_make_scheduling_negative() -> None:
    run = {"started": 100.0, "ended": 103.2, "workers": 1, "owner": "me", "version": "v"}
    storage = _storage(run)
    storage.record_activity(
        [
            # 2 steps at 0.1 s, then 3 at 1 s: the step-weighted median is 1 s a step,
            # so the limit (5 unique steps x 1 s) would exceed the 3.2 s the run took.
            *_batch("me", 1, 0, (100.0, 100.2), [1, 0, 2], 0.2, 2),
            *_batch("me", 2, 0, (100.2, 102.2), [2, 0, 2], 2.0, 2),
            *_batch("me", 3, 0, (102.2, 103.2), [3, 0, 1], 1.0, 1),
        ]
    )
    got = reports.efficiency(storage, "s")
    assert got["scheduling_seconds"] == 0.0
    assert all(got[k] >= 0.0 for k in PARTS)
    assert sum(got[k] for k in PARTS) == pytest.approx(got["wall_seconds"])
    assert got["limit_seconds"] == pytest.approx(3.2)
    assert got["efficiency"] == pytest.approx(1.0)
    assert "scheduling -" not in efficiency_line(got)


def test_a_run_without_an_end_is_measured_until_now() -> None:
    storage = _storage({"started": 100.0, "workers": 1, "owner": "me", "version": "v"})
    storage.record_activity(_batch("me", 1, 0, (101.0, 103.0), [1, 0, 2], 2.0, 2))
    got = reports.efficiency(storage, "s", now=104.0)
    assert got["wall_seconds"] == pytest.approx(4.0)
    assert got["efficiency"] == pytest.approx(0.5)
    assert got["idle_seconds"] == pytest.approx(1.0)


def test_no_figure_without_a_recorded_run() -> None:
    # A storage written before runs were recorded: its batches are there, no run.
    storage = _storage(None)
    storage.record_activity(_batch("me", 1, 0, (101.0, 103.0), [1, 0, 2], 2.0, 2))
    assert reports.efficiency(storage, "s") == {}
    assert reports.study_status(storage, "s").efficiency == {}
    # A run of another trainer version, or one that trained nothing: no figure either.
    ran = _storage({"started": 100.0, "ended": 110.0, "owner": "me", "version": "v"})
    assert reports.efficiency(ran, "s") == {}
    ran.record_activity(_batch("me", 1, 0, (101.0, 103.0), [1, 0, 2], 2.0, 2))
    assert reports.efficiency(ran, "s", "w") == {}
    assert reports.efficiency(ran, "s", "v")["efficiency"] == pytest.approx(0.2)
    assert reports.efficiency(storage, "nosuch") == {}
    assert efficiency_line({}) == ""


def _check(stats: dict[str, float], workers: int) -> None:
    for key in reports.EFFICIENCY_KEYS:
        assert key in stats, key
    assert 0.0 < stats["efficiency"] <= 1.0
    assert stats["workers"] == workers
    assert stats["wall_seconds"] > 0
    assert stats["steps_unique_trained"] == stats["steps_unique"]  # a fresh run
    for key in PARTS[:-1]:  # each part, but scheduling (a remainder), is >= 0
        assert stats[key] >= 0.0, key
    assert stats["limit_seconds"] <= stats["wall_seconds"]
    total = sum(stats[k] for k in PARTS)
    assert total == pytest.approx(stats["wall_seconds"], rel=1e-6, abs=1e-6)
    # the remainder is small next to the whole (no more than a sliver is unexplained)
    assert abs(stats["scheduling_seconds"]) <= stats["wall_seconds"]


@pytest.mark.parametrize(
    ("executor", "workers", "trainer"),
    [("inline", 1, LinearTrainer), ("local", 2, SlowLinearTrainer)],
)
def test_real_studies_report_it_everywhere(
    tmp_path: Path, executor: str, workers: int, trainer: type
) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    space = GridSpace({"lr": LRS}, fixed={"seed": [0, 1]})
    with Study("s", trainer, storage=url, executor=executor, workers=workers) as study:
        best = study.tune(GridSearch(space, "score", steps=9))
        stats = study.stats()
        out = io.StringIO()
        numbers = report_study(study, best, "score", out=out, rich_output=False)
    _check(stats, workers)
    if executor == "local":  # worker processes start: that takes time
        assert stats["startup_seconds"] > 0.0
    assert numbers["efficiency"] == stats["efficiency"]
    (line,) = [x for x in out.getvalue().splitlines() if x.startswith("efficiency:")]
    assert efficiency_line(stats) in line
    # Read later, by another process, from the storage alone: the same figure.
    with open_storage(url, readonly=True) as storage:
        assert reports.efficiency(storage, "s") == {k: stats[k] for k in reports.EFFICIENCY_KEYS}
        # it saved checkpoints, and no batch's end waited for them (off the critical path)
        ends = [r for r in storage.activity() if r.kind == "done"]
        assert ends and all(r.data["save_wait_seconds"] == 0.0 for r in ends)
        assert [r for r in storage.activity() if r.kind == "save"]
    text = io.StringIO()
    result = status(url, out=text, rich_output=False)
    assert result.studies[0].efficiency["efficiency"] == stats["efficiency"]
    assert f"efficiency:           {efficiency_line(stats)}" in text.getvalue()


def test_a_study_without_a_tuner_or_a_recorded_run_gives_none(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        study.run({"seed": 0}, {"lr": Constant(0.05)}, 3)
        stats = study.stats()
        out = io.StringIO()
        report_study(study, None, "score", out=out, rich_output=False)
    assert "efficiency" not in stats and "wall_seconds" not in stats
    assert "efficiency" not in out.getvalue()
    text = io.StringIO()
    status(url, out=text, rich_output=False)
    assert "efficiency" not in text.getvalue()


def test_a_run_counts_only_what_it_trained(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/plan.db"
    space = GridSpace({"lr": LRS}, fixed={"seed": [0]})
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        study.tune(GridSearch(space, "score", steps=6))
        first = study.stats()
    assert first["steps_unique_trained"] == first["steps_unique"]
    with Study("s", LinearTrainer, storage=url, executor="inline") as study:
        study.tune(GridSearch(space, "score", steps=6))  # everything known: no training
        again = study.stats()
    assert "efficiency" not in again  # it trained nothing: no figure
    # Another study of the same trials, two steps further: it trains only those.
    with Study("t", LinearTrainer, storage=url, executor="inline") as study:
        study.tune(GridSearch(space, "score", steps=8))
        more = study.stats()
    assert 0 < more["steps_unique_trained"] < more["steps_unique"]  # this run's work only
    assert more["wall_seconds"] > 0 and 0.0 < more["efficiency"] <= 1.0


class _CountingStorage(MemoryPlanStorage):
    """A memory plan that records each write of counters (one entry per transaction a
    database would commit)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[dict[str, dict[str, float]]] = []

    def add_stats(self, scope: str, **deltas: float) -> None:
        self.writes.append({scope: dict(deltas)})
        super().add_stats(scope, **deltas)

    def add_stats_many(self, deltas: Any) -> None:
        self.writes.append({s: dict(d) for s, d in deltas.items()})
        super().add_stats_many(deltas)


def test_a_batch_end_counts_the_storage_and_its_tree_in_one_write() -> None:
    storage = _CountingStorage()
    with Study("s", LinearTrainer, storage=storage, executor="inline") as study:
        study.tune(GridSearch(GridSpace({"lr": LRS}, fixed={"seed": [0]}), "score", steps=8))
    ends = [w for w in storage.writes if "device_seconds" in w.get("engine", {})]
    assert ends  # every batch's end is counted...
    for write in ends:  # ...for the storage and for its tree at once
        assert any(scope.startswith("root:") for scope in write), write
