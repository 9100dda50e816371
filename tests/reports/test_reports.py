"""The read side (:mod:`stagetree.reports`): one best-trial rule for ``Study.best``, the
tuners and ``stagetree status``; per-study accounting that ``stagetree status`` shows
and that equals ``Study.stats()``; pure, read-only functions of a storage."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

import stagetree
from stagetree import Study, cli, reports
from stagetree import study as study_module
from stagetree.exceptions import PlanKeyError
from stagetree.hp import Constant, MultiStep
from stagetree.plan import BasePlanStorage, open_storage
from stagetree.ranking import best_key
from stagetree.records import TrialRecord
from stagetree.reports.trials import best_trial
from stagetree.space import GridSpace
from stagetree.tuners import SHA, GridSearch
from stagetree.tuners import base as tuners_base
from stagetree.tuners.base import TrialResult


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/plan.db"


def _study(tmp_path: Path, name: str) -> Study:
    return Study(name, LinearTrainer, storage=_url(tmp_path), executor="inline")


def _status(url: str) -> tuple[cli.StorageStatus, str]:
    buf = io.StringIO()
    result = cli.status(url, out=buf, rich_output=False)
    return result, buf.getvalue()


def _block(text: str, title: str) -> str:
    for block in text.split("\n\n"):
        if block.startswith(title):
            return block
    raise AssertionError(f"no block {title!r} in:\n{text}")


def _row(block: str, label: str) -> str:
    for line in block.splitlines():
        if line.strip().startswith(label + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {label!r} row in:\n{block}")


# --------------------------------------------------------------------------- the one module


def test_records_live_in_reports_and_are_reexported() -> None:
    assert study_module.TrialRecord is reports.TrialRecord is stagetree.TrialRecord
    assert study_module.TrialError is reports.TrialError is stagetree.TrialError
    for name in ("StudyStatus", "StorageStatus", "study_status", "storage_status"):
        assert getattr(cli, name) is getattr(reports, name)
    for name in ("accounting", "export_records", "export_table", "hidden_trials"):
        assert getattr(cli, name) is getattr(reports, name)
    assert tuners_base.best_key is reports.best_key  # Tuner.best ranks with it
    assert all(hasattr(reports, name) for name in reports.__all__)


# --------------------------------------------------------------------------- best


def _rec(tid: int, steps: int, value: float | None) -> TrialRecord:
    metrics = {steps: {"m": value}} if value is not None else {}
    return TrialRecord(tid, {}, {}, steps, "done", metrics)  # type: ignore[arg-type]


def test_best_compares_at_the_largest_step_then_value_then_lowest_id() -> None:
    early = _rec(1, 1, 0.99)  # stopped early with a great early metric
    full = [_rec(3, 4, 0.5), _rec(2, 4, 0.7), _rec(4, 4, 0.7)]
    records = [early, *full]
    assert best_trial(records, "m", "max") is full[1]  # 0.7 at step 4, trial 2 before 4
    assert best_trial(records, "m", "min") is full[0]
    # NaN and infinities are never best, even at the largest step.
    records = [early, _rec(5, 8, math.nan), _rec(6, 8, math.inf), _rec(7, 8, -math.inf)]
    assert best_trial(records, "m", "max") is early
    assert best_trial(records, "m", "min") is early
    assert best_trial([_rec(1, 2, None), _rec(2, 2, math.nan)], "m") is None
    assert best_trial([], "m") is None
    with pytest.raises(ValueError, match="mode"):
        best_trial(records, "m", "best")


def test_best_key_orders_steps_then_value_then_tiebreak() -> None:
    assert best_key(4, 0.1, "max", 9) > best_key(1, 0.9, "max", 0)  # type: ignore[operator]
    assert best_key(4, 0.2, "max", 9) > best_key(4, 0.1, "max", 0)  # type: ignore[operator]
    assert best_key(4, 0.1, "min", 9) > best_key(4, 0.2, "min", 0)  # type: ignore[operator]
    assert best_key(4, 0.1, "max", 1) > best_key(4, 0.1, "max", 2)  # type: ignore[operator]
    for bad in (None, math.nan, math.inf, -math.inf, "x", True):
        assert best_key(4, bad, "max", 0) is None


def test_tuner_best_is_the_same_rule() -> None:
    tuner = GridSearch([], "m", steps=4)
    results = [(0, 1, 0.99), (1, 4, 0.7), (2, 4, 0.7), (3, 4, math.nan), (4, 2, 0.8)]
    tuner.results = [
        (tid, TrialResult({"t": tid}, {}, steps, {"m": value})) for tid, steps, value in results
    ]
    best = tuner.best()
    assert best is not None and best.config == {"t": 1}
    records = [_rec(tid, steps, value) for tid, steps, value in results]
    assert best_trial(records, "m") is records[1]


# An SHA study: both trials train 1 step, the better one (B: lr 0.3 for its first step)
# goes on to 4 steps, where a large lr (0.99) makes its score worse than A's after the
# single step A was allowed.
A = Constant(0.25)
B = MultiStep(0.3, [1], 3.3)


def test_study_best_tuner_and_status_agree_on_a_stopped_trial(tmp_path: Path) -> None:
    space = GridSpace({"lr": [A, B]}, fixed={"seed": [0]})
    with _study(tmp_path, "sha") as study:
        result = study.tune(SHA(space, "score", min_steps=1, max_steps=4, eta=4, num_trials=2))
        trials = {t.steps: t for t in study.trials()}
        stopped, trained = trials[1], trials[4]
        assert stopped.hp == {"lr": A} and trained.hp == {"lr": B}
        # The case the rule is about: the stopped trial's 1-step score is better.
        assert stopped.metrics[1]["score"] > trained.metrics[4]["score"]
        best = study.best("score")
    assert result is not None and result.hp == {"lr": B} and result.steps == 4
    assert best is not None and best.id == trained.id  # not the 1-step trial
    status, text = _status(_url(tmp_path))
    (st,) = status.studies
    assert (st.best_trial, st.best_step, st.best) == (trained.id, 4, result.metrics["score"])
    assert f"trial {trained.id} at step 4" in _row(_block(text, "study sha"), "best score")


# --------------------------------------------------------------------------- accounting


def test_status_shows_each_studys_own_accounting(tmp_path: Path) -> None:
    """Two studies in one storage: they share the plan tree of seed 0 (the same trials:
    b's are answered from a's), and each has a tree of its own (seed 1 for a, 2 for b).
    ``stagetree status`` shows each study's own executed steps and device-seconds,
    equal to its ``Study.stats()``: what was trained for its requests (b's seed-0
    trials were answered by what a had trained: they cost b nothing)."""
    lrs = [Constant(0.05), MultiStep(0.05, [3], 0.5)]
    stats: dict[str, dict[str, float]] = {}
    for name, seed in (("a", 1), ("b", 2)):
        with _study(tmp_path, name) as study:
            space = GridSpace({"lr": lrs}, fixed={"seed": [0, seed]})
            study.tune(GridSearch(space, "score", steps=6 if name == "a" else 5))
            stats[name] = study.stats()
    a, b = stats["a"], stats["b"]
    assert a["steps_executed"] == 2 * (6 + 3)  # two trees: 6 steps + the 3 after the split
    assert b["steps_executed"] == 5 + 2  # its own tree: seed 0's answered from a's
    status, text = _status(_url(tmp_path))
    by_name = {st.name: st for st in status.studies}
    for name, st in by_name.items():
        numbers, own = st.numbers, stats[name]
        assert numbers is not None
        for key in ("steps_requested", "steps_unique", "steps_executed", "device_seconds"):
            assert numbers[key] == own[key], (name, key)
        assert numbers["steps_saved"] == own["steps_requested"] - own["steps_executed"]
        assert numbers["device_seconds"] > 0
        block = _block(text, f"study {name}")
        assert _row(block, "steps executed") == str(round(own["steps_executed"]))
        assert _row(block, "device-seconds") == f"{own['device_seconds']:.1f}"
        assert _row(block, "steps saved").startswith(str(round(numbers["steps_saved"])))
        assert "device-seconds saved" in block
    # The whole storage: every stage once.
    assert status.totals["steps_executed"] == 9 + 9 + 7
    assert status.totals["steps_executed"] == a["steps_executed"] + b["steps_executed"]
    assert _row(_block(text, "all 2 studies"), "steps executed") == "25"


def test_reports_read_a_readonly_storage(tmp_path: Path) -> None:
    space = GridSpace({"lr": [Constant(0.05)]}, fixed={"seed": [0], "fail_train_at": [100, 1]})
    with _study(tmp_path, "s") as study:
        study.tune(GridSearch(space, "score", steps=3))
        expected: dict[str, Any] = {
            "records": study.trials(),
            "stats": study.stats(),
            "failures": study.failures(),
        }
    with open_storage(_url(tmp_path), readonly=True) as storage:
        assert reports.trial_records(storage, "s") == expected["records"]
        # Study.stats(): the accounting and the efficiency of its (ended) run.
        read = {**reports.study_accounting(storage, "s"), **reports.efficiency(storage, "s")}
        assert read == expected["stats"]
        (failure,) = reports.failures(storage, "s")
        assert [failure] == expected["failures"]
        assert failure[1].summary() == "ValueError: boom in train at step 1 (training step 1)"
        assert reports.progress(storage, "s")["finished"] == 1.0
        assert reports.study_status(storage, "s").numbers is not None
        assert len(reports.export_records(storage, "s")) == 2
        assert reports.trial_records(storage, "nosuch") == []
        with pytest.raises(PlanKeyError, match="no study 'nosuch' in the storage"):
            reports.study_status(storage, "nosuch")


def _curves_study(storage: BasePlanStorage) -> None:
    """Study ``s``: trials at their end, short of it, with a NaN final point, with a
    row whose end lags, outside the tree, and ending before a branch."""
    storage.create_study("s", {})
    const, decay, late = Constant(0.1), MultiStep(0.1, [4], 0.5), MultiStep(0.1, [7], 0.5)
    ins = {
        name: storage.insert_trial("r", {"lr": seq}, steps)
        for name, seq, steps in (("const", const, 10), ("decay", decay, 10), ("late", late, 9))
    }
    node = {name: i.node for name, i in ins.items()}
    points = [(node["const"], s, {"m": s / 10, "x": 1.0}, True) for s in range(1, 11)]
    points += [(node["decay"], s, {"m": -s / 10}, s % 2 == 0) for s in (5, 6, 7)]  # short
    points += [(node["late"], 9, {"m": math.nan}, False)]  # final, train() only, NaN
    storage.put_metrics_many(points)
    rows = [
        ("done", {"lr": const}, 10, node["const"], 10),
        ("running", {"lr": decay}, 10, node["decay"], 10),  # short of its end
        ("done", {"lr": late}, 9, node["late"], 9),
        ("pending", {"lr": const}, 12, node["const"], 10),  # its row's end lags
        ("pending", {"lr": MultiStep(0.1, [2], 0.1)}, 5, None, None),  # not in the tree
        ("done", {"lr": decay}, 3, node["const"], 3),  # ends before the branch
    ]
    for state, hp, steps, n, step in rows:
        storage.add_trial("s", "r", {}, hp, steps, n, step, state=state)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_final_and_last_points_are_those_of_the_learning_curves(tmp_path: Path, kind: str) -> None:
    """What the status, the curves and the trials table read of each trial (its final
    point; its last point) is the final and last point of its learning curve
    (:func:`reports.records_of`), without reading the curves."""
    url = "memory://" if kind == "memory" else _url(tmp_path)
    with open_storage(url) as storage:
        _curves_study(storage)
        trials = storage.trials("s")
        full = {r.id: r for r in reports.records_of(storage, trials)}
        finals = reports.final_metrics(storage, trials)
        for curves in (None, reports.TreeCurves(storage)):
            assert reports.final_metrics(storage, trials, curves).keys() == finals.keys()
        lasts = reports.last_points(storage, trials)
        for t in trials:
            rec = full[t["id"]]
            final = rec.metrics.get(rec.steps)
            assert (final is None) == (t["id"] not in finals), t
            if final is not None:
                assert repr(finals[t["id"]]) == repr(final)  # NaN too
            last = max(rec.metrics, default=None)
            expected = None if last is None else (last, rec.metrics[last])
            assert repr(lasts.get(t["id"])) == repr(expected), t
        assert sorted(finals) == [1, 3, 6]
        assert sorted(lasts) == [1, 2, 3, 4, 6]
        light = reports.final_records(storage, trials)
        assert repr([r.metrics for r in light]) == repr(
            [{r.steps: r.metrics[r.steps]} if r.steps in r.metrics else {} for r in full.values()]
        )
        for mode in ("max", "min"):
            best = reports.best_trial(light, "m", mode)
            expected_best = reports.best_trial(list(full.values()), "m", mode)
            assert best is not None and expected_best is not None
            assert best.id == expected_best.id


class _NoCurves:
    """A storage whose plan trees' metrics cannot be read whole: a reader that reads
    every learning curve to answer (100,000 of them in a large study) fails."""

    def __init__(self, storage: BasePlanStorage) -> None:
        self._storage = storage

    def metrics(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("read the learning curves of every trial")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


class _NoTrees:
    """A storage whose plan trees cannot be listed whole (a study of 100,000 trials in
    one tree), and that counts the trials walked through their trees (``walks``: what
    a reader of a row whose end lags must do, and nothing else)."""

    def __init__(self, storage: BasePlanStorage) -> None:
        self._storage = storage
        self.walks = 0

    def metrics_along(self, *args: Any, **kw: Any) -> Any:
        self.walks += 1
        return self._storage.metrics_along(*args, **kw)

    def nodes(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("read a whole tree's nodes")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_best_reads_the_ends_of_the_trials_and_the_best_ones_path(
    tmp_path: Path, kind: str
) -> None:
    """``Study.best()`` of a study's version ranks the trials by one read of their ends
    (:meth:`BasePlanStorage.trial_ends`), reads the best one's curve along its path and
    gives what :func:`reports.best_trial` of the full records gives."""
    url = "memory://" if kind == "memory" else _url(tmp_path)
    with open_storage(url) as storage:
        _curves_study(storage)
        full = reports.trial_records(storage, "s")
        lags = sum(t["node"] is not None and t["step"] != t["steps"] for t in storage.trials("s"))
        for mode in ("max", "min"):
            quick = _NoTrees(storage)
            best = reports.best_record(quick, "s", "m", mode)  # type: ignore[arg-type]
            assert best == reports.best_trial(full, "m", mode)
            assert best is not None and len(best.metrics) > 1
            assert quick.walks == lags == 1  # not the best trial's


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_best_and_final_records_read_final_metrics_by_query(tmp_path: Path, kind: str) -> None:
    """``Study.best()`` (:func:`reports.best_record`) and ``Study.trials(history=False)``
    give what the full records give (the best one with its whole curve), reading final
    points only."""
    url = "memory://" if kind == "memory" else _url(tmp_path)
    with open_storage(url) as storage:
        _curves_study(storage)
        full = reports.trial_records(storage, "s")
        quick: Any = _NoCurves(storage)
        finals = reports.trial_records(quick, "s", history=False)
        assert repr(finals) == repr(
            [
                dataclasses.replace(r, metrics={r.steps: r.metrics[r.steps]})
                if r.steps in r.metrics
                else dataclasses.replace(r, metrics={})
                for r in full
            ]
        )
        for mode in ("max", "min"):
            best = reports.best_record(quick, "s", "m", mode)
            assert best == reports.best_trial(full, "m", mode)
            assert best is not None and len(best.metrics) > 1  # its whole curve
        assert reports.best_record(quick, "s", "nosuch") is None
        with pytest.raises(ValueError, match="mode"):
            reports.best_record(quick, "s", "m", "best")
