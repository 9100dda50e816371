"""Checkpoint clean-up (``stagetree gc`` / ``collect_garbage``) on real studies: what each
keep mode removes, that resumed studies answer what was kept and retrain exactly what
was removed, orphans, old trainer versions, live work, and bad input."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.checkpoints import CheckpointStore, needed_checkpoints
from stagetree.checkpoints.eviction import evict_to_budget
from stagetree.cli import main
from stagetree.exceptions import CheckpointError, CheckpointsInUseError, PlanKeyError, StorageError
from stagetree.hp import Constant, MultiStep
from stagetree.plan import RequestState, open_storage
from stagetree.space import GridSpace
from stagetree.tools.gc import collect_garbage, parse_duration
from stagetree.tuners import GridSearch

# One plan tree (seed 1): Constant(0.05) is the root path; the two MultiSteps branch off
# it at steps 5 and 10 (branch checkpoints there); Constant(0.02) branches at 0.
LRS = [Constant(0.05), MultiStep(0.05, [5], 0.5), MultiStep(0.05, [10], 0.5), Constant(0.02)]
SPACE = GridSpace({"lr": LRS}, fixed={"seed": [1]})
CONFIG = {"seed": 1}


def url_of(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/plan.db"


def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "plan.db.checkpoints"


def make(tmp_path: Path, trainer: type = LinearTrainer, **kw: Any) -> Study:
    kw.setdefault("executor", "inline")
    return Study("s", trainer, storage=url_of(tmp_path), **kw)


def tuned(tmp_path: Path, steps: int = 20) -> dict[tuple[int, int], str]:
    """Tune the grid to ``steps``; returns the plan's checkpoint records (key -> ref)."""
    with make(tmp_path) as study:
        study.tune(GridSearch(SPACE, steps=steps, metric="score"))
    return records(tmp_path)


def records(tmp_path: Path) -> dict[tuple[int, int], str]:
    with open_storage(url_of(tmp_path)) as plan:
        return {key: rec.ref for key, rec in plan.checkpoints().items()}


def files(tmp_path: Path) -> set[str]:
    return {p.name for p in ckpt_dir(tmp_path).iterdir() if p.suffix == ".ckpt"}


def finals(tmp_path: Path) -> dict[str, tuple[int, int]]:
    """str(lr) -> canonical key of each trial's end."""
    with open_storage(url_of(tmp_path)) as plan:
        return {str(t["hp"]["lr"]): (t["node"], t["step"]) for t in plan.trials("s")}


def test_dry_run_reports_and_removes_nothing(tmp_path: Path) -> None:
    before = tuned(tmp_path)
    on_disk = files(tmp_path)
    assert set(before.values()) == on_disk and len(before) == 6  # 4 finals + 2 branches
    report = collect_garbage(url_of(tmp_path), keep="best", dry_run=True)
    assert report.dry_run and len(report.removed) == 5
    assert report.freed_bytes == sum(
        (ckpt_dir(tmp_path) / i.ref).stat().st_size for i in report.removed
    )
    assert {r: n for r, (n, _) in report.by_reason().items()} == {"intermediate": 2, "not best": 3}
    assert report.lines()[0].startswith("would free 5 checkpoints")
    assert records(tmp_path) == before and files(tmp_path) == on_disk


@pytest.mark.parametrize("keep", ["all", "leaves", "best"])
def test_each_keep_mode_removes_exactly_what_it_should(tmp_path: Path, keep: str) -> None:
    before = tuned(tmp_path)
    ends = finals(tmp_path)
    best = ends[str(Constant(0.05))]  # the largest lr reaches the lowest loss in 20 steps
    expected = {
        "all": set(before),
        "leaves": set(ends.values()),
        "best": {best},
    }[keep]
    report = collect_garbage(url_of(tmp_path), keep=keep)
    after = records(tmp_path)
    assert set(after) == expected
    assert files(tmp_path) == {before[k] for k in expected}  # record and file go together
    assert {(i.node, i.step) for i in report.removed} == set(before) - expected
    # Nothing more to do the second time.
    assert collect_garbage(url_of(tmp_path), keep=keep).removed == []


def test_resumed_study_answers_kept_trials_and_retrains_only_what_was_removed(
    tmp_path: Path,
) -> None:
    tuned(tmp_path)
    collect_garbage(url_of(tmp_path), keep="best")
    with make(tmp_path) as study:
        executed = study.stats()["steps_executed"]
        again = study.tune(GridSearch(SPACE, steps=20, metric="score"))
        assert again is not None and again.hp["lr"] == Constant(0.05)
        assert study.stats()["steps_executed"] == executed  # answered from the plan
        states = [study.state(CONFIG, {"lr": lr}, 20) for lr in LRS]
        assert [s is not None for s in states] == [True, False, False, False]
        # Extending every trial to 30 steps: the best one goes on from its checkpoint
        # (10 steps); the others train from scratch, sharing the first 10 steps of the
        # root path (10 + 25 + 20 + 30). With every checkpoint kept it would be 4 * 10.
        extended = extend(study, 30)
        assert study.stats()["steps_executed"] - executed == 10 + 10 + 25 + 20 + 30
    with Study("ref", LinearTrainer, storage="memory://", executor="inline") as ref:
        assert extended == extend(ref, 30)


def extend(study: Study, steps: int) -> dict[str, dict[str, float]]:
    """Every trial of the grid to ``steps``, submitted together (so they share)."""

    async def together() -> list[Any]:
        return await asyncio.gather(*[study.submit(CONFIG, {"lr": lr}, steps) for lr in LRS])

    return {str(lr): r.metrics for lr, r in zip(LRS, asyncio.run(together()), strict=True)}


def _orphan_name(tmp_path: Path, node: int, step: int) -> str:
    """A checkpoint name as a worker makes it, of this plan's tree."""
    from stagetree.executors.worker import _checkpoint_name

    with open_storage(url_of(tmp_path)) as plan:
        root = plan.node(node).root_key
    return _checkpoint_name(root, node, step)


def test_orphans_go_after_the_grace_period_and_foreign_files_stay(tmp_path: Path) -> None:
    before = tuned(tmp_path)
    store = CheckpointStore(ckpt_dir(tmp_path))
    orphan = store.save(_orphan_name(tmp_path, 1, 7), {"w": [1.0]}).ref  # a killed worker's
    foreign = store.save("rdeadbeef-n1-s3-0a0b0c0d", {"w": [2.0]}).ref  # another plan's tree
    mine = store.save("my-notes", {"x": 1}).ref  # not a worker's name
    report = collect_garbage(url_of(tmp_path), keep="all")  # default grace: 1 hour
    assert report.removed == [] and report.kept["recent"] == 1 and report.skipped == 2
    old = time.time() - 7200
    for ref in (orphan, foreign, mine):
        os.utime(ckpt_dir(tmp_path) / ref, (old, old))
    report = collect_garbage(url_of(tmp_path), keep="all", grace="1h")
    assert [(i.ref, i.reason) for i in report.removed] == [(orphan, "orphan")]
    assert files(tmp_path) == set(before.values()) | {foreign, mine}
    assert records(tmp_path) == before


def test_old_trainer_version_checkpoints_go_even_with_keep_all(tmp_path: Path) -> None:
    with make(tmp_path, version="v1") as study:
        study.tune(GridSearch(SPACE, steps=10, metric="score"))
    v1 = records(tmp_path)
    with pytest.warns(UserWarning), make(tmp_path, version="v2") as study:
        study.tune(GridSearch(SPACE, steps=10, metric="score"))
    v2 = {k: r for k, r in records(tmp_path).items() if k not in v1}
    assert v2
    report = collect_garbage(url_of(tmp_path), keep="all")
    assert {i.ref for i in report.removed} == set(v1.values())
    assert {i.reason for i in report.removed} == {"old version"}
    assert records(tmp_path) == v2 and files(tmp_path) == set(v2.values())


def test_pending_requests_keep_their_start_and_a_running_study_refuses_keep_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tuned(tmp_path)
    ends = finals(tmp_path)
    with open_storage(url_of(tmp_path)) as plan:
        # Another engine holds the study and a pending request that goes on from the
        # trial Constant(0.02)'s end (a rung promotion): it starts from that checkpoint.
        assert plan.claim_study("other-engine", "s", ttl=300).ok
        node, _ = ends[str(Constant(0.02))]
        plan.add_request(node, 25)
        start = before[(node, 20)]
        assert needed_checkpoints(plan) == {start: 1}
    with pytest.raises(CheckpointsInUseError, match=r"study 's' is running.*--keep leaves") as err:
        collect_garbage(url_of(tmp_path), keep="best")
    assert err.value.study == "s" and err.value.holder == f"{socket.gethostname()}:{os.getpid()}"
    assert f"({err.value.holder} tunes it)" in str(err.value)
    assert main(["gc", "--storage", url_of(tmp_path), "--keep", "best"]) == 2
    assert "error: study 's' is running" in capsys.readouterr().err
    assert records(tmp_path) == before and files(tmp_path) == set(before.values())
    # keep=leaves takes only what no trial ends at; the pending start stays.
    report = collect_garbage(url_of(tmp_path), keep="leaves")
    assert {(i.node, i.step) for i in report.removed} == {(1, 5), (1, 10)}
    assert report.kept["needed"] == 1
    with open_storage(url_of(tmp_path)) as plan:
        plan.release("other-engine")
    # The study no longer runs: best may go, but never the pending request's start.
    report = collect_garbage(url_of(tmp_path), keep="best")
    assert set(records(tmp_path)) == {ends[str(Constant(0.05))], (node, 20)}
    assert start in files(tmp_path)


class GatedTrainer(LinearTrainer):
    """LinearTrainer that waits at step 15 of an lr-0.0125 stretch until the test opens
    the gate (so a study is surely running while ``gc`` runs)."""

    gate = threading.Event()
    waiting = threading.Event()

    def train(self) -> dict[str, float]:
        if self.t == 15 and self.lr == 0.0125:
            GatedTrainer.waiting.set()
            assert GatedTrainer.gate.wait(30)
        return super().train()


def test_gc_while_a_study_runs_keeps_what_it_needs_and_results_match(tmp_path: Path) -> None:
    with make(tmp_path, GatedTrainer) as study:
        study.tune(GridSearch(SPACE, steps=20, metric="score"))
    new = MultiStep(0.05, [15], 0.25)  # branches off the root path at 15
    GatedTrainer.gate.clear()
    GatedTrainer.waiting.clear()
    out: dict[str, Any] = {}

    def run() -> None:
        with Study("live", GatedTrainer, storage=url_of(tmp_path), executor="inline") as live:
            space = GridSpace({"lr": [*LRS, new]}, fixed={"seed": [1]})
            out["best"] = live.tune(GridSearch(space, steps=20, metric="score"))
            out["metrics"] = live.run(CONFIG, {"lr": new}, 20).metrics

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert GatedTrainer.waiting.wait(30)
        before = records(tmp_path)
        with pytest.raises(CheckpointsInUseError, match="study 'live' is running"):
            collect_garbage(url_of(tmp_path), keep="best", grace=0)
        assert records(tmp_path) == before
        report = collect_garbage(url_of(tmp_path), keep="leaves", grace=0)
        # The branch checkpoint at 5 goes; where the gated batch started (10, or 15 if
        # its branch checkpoint was recorded already) stays.
        assert (1, 5) in {(i.node, i.step) for i in report.removed}
        assert report.kept["needed"] >= 1
        with open_storage(url_of(tmp_path)) as plan:
            live = plan.requests(states=[RequestState.PENDING, RequestState.SCHEDULED])
            assert live  # the gated trial's request
            left = {rec.ref for rec in plan.checkpoints().values()}
            assert set(needed_checkpoints(plan)) <= left <= files(tmp_path)
    finally:
        GatedTrainer.gate.set()
        thread.join(60)
    assert not thread.is_alive()
    with Study("ref", GatedTrainer, storage="memory://", executor="inline") as ref:
        assert out["metrics"] == ref.run(CONFIG, {"lr": new}, 20).metrics


def test_budget_eviction_uses_the_same_rule_and_removes_records_first(tmp_path: Path) -> None:
    before = tuned(tmp_path)
    ends = finals(tmp_path)
    with open_storage(url_of(tmp_path)) as plan:
        node, _ = ends[str(Constant(0.02))]
        plan.add_request(node, 25)
        store = CheckpointStore(ckpt_dir(tmp_path), budget_bytes=0)
        removed = evict_to_budget(plan, store)
        assert set(removed) == set(before) - {(node, 20)}  # all but the needed one
        assert {rec.ref for rec in plan.checkpoints().values()} == {before[(node, 20)]}
    assert files(tmp_path) == {before[(node, 20)]}


def test_cli_gc_prints_what_it_frees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tuned(tmp_path)
    assert main(["gc", "--storage", url_of(tmp_path), "--keep", "best", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would free 5 checkpoints" in out and "not best" in out and "intermediate" in out
    assert len(files(tmp_path)) == 6
    assert main(["gc", "--storage", url_of(tmp_path), "--study", "s", "--keep", "leaves"]) == 0
    assert capsys.readouterr().out.startswith("freed 2 checkpoints")
    assert len(files(tmp_path)) == 4


def test_study_option_leaves_other_studies_trees_whole(tmp_path: Path) -> None:
    before = tuned(tmp_path)
    with Study("other", LinearTrainer, storage=url_of(tmp_path), executor="inline") as other:
        other.run({"seed": 2}, {"lr": Constant(0.05)}, 10)
    theirs = {k: r for k, r in records(tmp_path).items() if k not in before}
    # "other" shares nothing with "s" (seed 2 is its own tree): gc of "s" leaves it.
    collect_garbage(url_of(tmp_path), keep="best", study="s")
    assert set(theirs.values()) <= files(tmp_path)
    assert len(records(tmp_path)) == 1 + len(theirs)


def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.db"
    with pytest.raises(StorageError, match="does not exist"):
        collect_garbage(f"sqlite:///{missing}")
    assert not missing.exists()
    assert main(["gc", "--storage", f"sqlite:///{missing}"]) == 2
    assert "does not exist" in capsys.readouterr().err and not missing.exists()
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("create table t(x)")
    content = other.read_bytes()
    with pytest.raises(StorageError, match="not a stagetree plan storage"):
        collect_garbage(f"sqlite:///{other}", tmp_path)
    assert other.read_bytes() == content
    before = tuned(tmp_path)
    with pytest.raises(ValueError, match="keep must be one of best, leaves, all"):
        collect_garbage(url_of(tmp_path), keep="some")
    assert main(["gc", "--storage", url_of(tmp_path), "--keep", "some"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="grace must be a non-negative duration"):
        collect_garbage(url_of(tmp_path), grace="-5m")
    with pytest.raises(PlanKeyError, match=r"no study 'x'.*studies: s"):
        collect_garbage(url_of(tmp_path), study="x")
    with pytest.raises(CheckpointError, match="does not exist"):
        collect_garbage(url_of(tmp_path), tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds none of the 6 checkpoints"):
        collect_garbage(url_of(tmp_path), tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint location"):
        collect_garbage(open_storage("memory://"))
    assert main(["gc", "--storage", url_of(tmp_path), "--study", ""]) == 2
    assert "study must be a non-empty string" in capsys.readouterr().err
    assert main(["gc", "--storage", "memory://"]) == 2
    assert "no checkpoint location" in capsys.readouterr().err
    assert records(tmp_path) == before and files(tmp_path) == set(before.values())


def test_parse_duration() -> None:
    assert parse_duration("90") == 90 and parse_duration("2h") == 7200
    assert parse_duration("30m") == 1800 and parse_duration(0) == 0
    for bad in ("", "soon", "-1", True, float("nan"), "inf"):
        with pytest.raises(ValueError):
            parse_duration(bad)  # type: ignore[arg-type]


def test_gc_on_an_fsspec_location_and_its_ages(tmp_path: Path) -> None:
    location = f"memory://stagetree-gc/{tmp_path.name}"
    with make(tmp_path, checkpoint_dir=location) as study:
        study.tune(GridSearch(SPACE, steps=20, metric="score"))
    store = CheckpointStore(location)
    orphan = store.save(_orphan_name(tmp_path, 1, 7), {"w": [1.0]}).ref
    ages = store.modified()
    assert set(ages) == set(store.refs()) and abs(ages[orphan] - time.time()) < 60
    report = collect_garbage(url_of(tmp_path), location, keep="leaves", now=time.time() + 7200)
    assert sorted(i.reason for i in report.removed) == ["intermediate", "intermediate", "orphan"]
    assert set(store.refs()) == set(records(tmp_path).values())
    assert len(store.refs()) == 4


def test_keep_best_without_a_ranked_trial_keeps_every_final(tmp_path: Path) -> None:
    with Study("nan", LinearTrainer, storage=url_of(tmp_path), executor="inline") as study:
        space = GridSpace({"lr": LRS}, fixed={"seed": [1], "nan_at": [1]})
        study.tune(GridSearch(space, steps=20, metric="score"))
    report = collect_garbage(url_of(tmp_path), keep="best")
    assert {i.reason for i in report.removed} == {"intermediate"}
    assert report.kept["kept trial"] == 4
    assert "no trial with a finite final metric" in report.lines()[-1]


def test_a_crash_midway_leaves_no_record_without_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = tuned(tmp_path)
    real = CheckpointStore.delete
    calls: list[str] = []

    def dies_on_the_second(self: CheckpointStore, ref: str) -> bool:
        calls.append(ref)
        if len(calls) == 2:
            raise SystemExit("killed")  # the process dies between record and file
        return real(self, ref)

    monkeypatch.setattr(CheckpointStore, "delete", dies_on_the_second)
    with pytest.raises(SystemExit):
        collect_garbage(url_of(tmp_path), keep="best")
    monkeypatch.undo()
    left = records(tmp_path)
    assert len(left) == 4 and set(left.values()) <= files(tmp_path)  # every record has its file
    assert calls[1] in files(tmp_path) and calls[1] not in left.values()  # an orphan now
    report = collect_garbage(url_of(tmp_path), keep="best", grace=0)
    assert calls[1] in {i.ref for i in report.removed if i.reason == "orphan"}
    assert files(tmp_path) == set(records(tmp_path).values()) and len(records(tmp_path)) == 1
    assert set(before) >= set(records(tmp_path))
