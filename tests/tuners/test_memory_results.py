"""The tuner's memory per trial (issue 24, item 3): ``Tuner.results`` keeps its
results' metrics in columns (no metrics and history dict per result) and gives back
results equal to those observed; a trial keeps no fingerprint (computed when asked); ASHA's rungs
keep their members in columns."""

from __future__ import annotations

import gc
import math
import tempfile
from typing import Any

from memory_helpers import reached_bytes, simulated_study

from stagetree.distributions import LogUniform
from stagetree.hp import Constant, MultiStep
from stagetree.records import trial_fingerprint
from stagetree.space import RandomSpace
from stagetree.tuners import ASHA, RandomSearch, Trial, TrialResult
from stagetree.tuners.asha import RungValues
from stagetree.tuners.base import ResultLog

TRIALS = 40


def _space() -> RandomSpace:
    return RandomSpace(
        hp={"lr": MultiStep(init=LogUniform(1e-3, 0.3), milestones=[4], gamma=0.1)},  # type: ignore[arg-type]
        fixed={"wd": LogUniform(1e-5, 1e-3)},
    )


def _asha() -> ASHA:
    """An ASHA run of ``TRIALS`` trials (its study closed: what the tuner keeps)."""
    with tempfile.TemporaryDirectory() as tmp:
        study = simulated_study(tmp)
        tuner = ASHA(_space(), "accuracy", min_steps=2, max_steps=8, num_trials=TRIALS, eta=2)
        try:
            study.tune(tuner)
        finally:
            study.close()
    gc.collect()
    return tuner


def test_results_hold_no_dict_per_result() -> None:
    # Was about 500 bytes a result beyond its trial: a pair, a TrialResult, a metrics
    # and a history dict; now a few columns' entries.
    tuner = _asha()
    seen: set[int] = set()
    reached_bytes([tuner.trials], seen)  # configs, sequences
    per_result = reached_bytes([tuner.results], seen) / len(tuner.results)
    assert len(tuner.results) > TRIALS  # promotions: several results per trial
    assert per_result < 200, per_result


def test_results_are_the_observed_ones() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study = simulated_study(tmp)
        tuner = ASHA(_space(), "accuracy", min_steps=2, max_steps=8, num_trials=12, eta=2)
        seen: list[tuple[int, TrialResult]] = []
        observe = tuner._observe

        def spy(job: Any) -> float:
            seen.append((job.trial.id, job.result()))
            return observe(job)

        tuner._observe = spy  # type: ignore[method-assign]
        try:
            best = study.tune(tuner)
        finally:
            study.close()
    assert list(tuner.results) == seen
    for tid, result in tuner.results:
        trial = tuner.trials[tid]
        assert result.config is trial.config and result.hp is trial.hp
        assert result.metrics is result.history[result.steps]
        assert len(result.history) > 1 or result.steps == 2  # promoted: earlier rungs too
    by_list = RandomSearch(_space(), "accuracy", steps=8, num_trials=1)
    by_list.results = list(seen)
    assert best is not None and best == by_list.best() == tuner.best()


def test_a_result_the_columns_cannot_give_back_is_kept_as_it_came() -> None:
    trials = {0: Trial(0, {"a": 1}, {"lr": Constant(0.1)}), 1: Trial(1, {"a": 2}, {})}
    log = ResultLog(trials)
    curve = {2: {"x": 0.5, "y": -0.0}, 4: {"x": 0.25, "y": 1.0}}
    plain = TrialResult({"a": 1}, {"lr": trials[0].hp["lr"]}, 4, curve[4], curve)
    odd = [
        TrialResult({"a": 2}, {}, 4, {"x": 3}),  # an int
        TrialResult({"a": 2}, {}, 4, {"x": math.nan}),  # not finite
        TrialResult({"a": 2}, {}, 4, {"x": 0.5, "t": 1.0}, {4: {"x": 0.5}}),  # train()'s too
        TrialResult({"a": 3}, {}, 4, {"x": 0.5}),  # not its trial's config
        TrialResult({"a": 2}, {}, 4, {"x": 0.5}, {2: {"x": 0.1}}),  # no entry at its steps
    ]
    log.append((0, plain))
    for result in odd:
        log.append((1, result))
    log.append((7, plain))  # a trial the tuner does not know
    assert len(log) == 7 and len(log._kept) == 6
    tid, got = log[0]
    assert tid == 0 and got == plain and got is not plain
    assert got.config is trials[0].config and got.hp is trials[0].hp
    assert got.metrics is got.history[4] and list(got.history) == [2, 4]
    assert math.copysign(1.0, got.history[2]["y"]) == -1.0  # -0.0 stays -0.0
    assert [r for _, r in log[1:6]] == odd  # the NaN one too: its very dicts
    assert all(log[i][1] is log[i][1] for i in range(1, 7))  # kept: one object each
    assert log[1][1].config is trials[1].config  # its trial's dicts where equal
    assert log[-1] == (7, plain) and log[-1][1] is plain
    assert [(i, t, s) for i, t, s, _ in log.metric_items("x")] == [
        (i, t, 4) for i, t in enumerate([0, 1, 1, 1, 1, 1, 7])
    ]
    assert next(iter(log.metric_items("y")))[3] == 1.0
    assert log == list(log) and log != [] and ResultLog({}) == []


def test_a_trial_keeps_no_fingerprint() -> None:
    trial = Trial(0, {"wd": 1e-4}, {"lr": MultiStep(0.1, [4], 0.1)})
    assert trial.fingerprint == trial_fingerprint(trial.config, trial.hp)
    assert Trial.__slots__ == ("id", "config", "hp")  # computed when asked


def test_asha_rungs_keep_their_members_in_columns() -> None:
    tuner = _asha()
    (rungs,) = tuner.rungs
    seen: set[int] = set()
    reached_bytes([tuner.trials, tuner.results], seen)  # ids and values: the results'
    members = sum(len(r) for r in rungs)
    per_member = reached_bytes([tuner.rungs], seen) / members
    assert len(rungs[0]) == TRIALS and members > TRIALS
    assert per_member < 40, per_member  # a dict entry, its id and its value: over 70


def test_rung_values_are_a_mapping_in_entry_order() -> None:
    rung = RungValues()
    for tid, value in ((5, 0.5), (2, -math.inf), (9, 0.75)):
        rung.add(tid, value)
    assert list(rung) == [5, 2, 9] and len(rung) == 3 and 2 in rung and 3 not in rung
    assert rung == {5: 0.5, 2: -math.inf, 9: 0.75} and rung[9] == 0.75
    rung.add(7, 0.25)  # after the index was built
    assert rung[7] == 0.25 and list(rung.items())[-1] == (7, 0.25)
    try:
        rung.add(5, 1.0)
    except ValueError:
        pass
    else:
        raise AssertionError("a trial enters a rung once")
