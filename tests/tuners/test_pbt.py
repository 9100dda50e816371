"""PBT over the search space, through the public API: mutations follow the space's
distributions, continuations keep the donor's schedule shape, the new trial shares the
donor's prefix in the plan, and the lineage reaches ``study.trials()`` and ``stagetree
status``."""

from __future__ import annotations

import asyncio
import io
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer
from tuner_fakes import FakeRunner, decisions

from stagetree import Study
from stagetree.cli import status
from stagetree.distributions import Choice, IntUniform, LogUniform, Uniform
from stagetree.exceptions import TunerError
from stagetree.hp import Constant, MultiStep, Shifted, Then, dumps_hp, loads_hp
from stagetree.reports.format import short_sequence
from stagetree.reports.lineage import exploit_parents, lineages
from stagetree.space import GridSpace, RandomSpace, TrialSpec
from stagetree.tuners import PBT, ReplayDivergedWarning, Trial, TrialResult, Tuner


class RecordingTrainer(LinearTrainer):
    """LinearTrainer that reports the sequence values it trained each step with."""

    def setup(self, hp: Mapping[str, Any]) -> None:
        super().setup(hp)
        self.seen = {k: float(v) for k, v in hp.items() if not isinstance(v, str)}

    def train(self) -> dict[str, float]:
        super().train()
        return {f"used_{k}": v for k, v in self.seen.items()}


def run(tuner: Tuner, runner: FakeRunner) -> TrialResult | None:
    return asyncio.run(tuner.run(runner))


def make(tmp_path: Path, name: str = "pbt", trainer: Any = RecordingTrainer) -> Study:
    return Study(name, trainer, storage=f"sqlite:///{tmp_path}/plan.db", executor="inline")


def exploited(tuner: PBT) -> list[tuple[dict[str, Any], Trial, Trial]]:
    return [(e, tuner.trials[e["trial"]], tuner.trials[e["donor"]]) for e in tuner.exploits]


# --------------------------------------------------------------------------- mutations


MIXED = RandomSpace(
    {
        "x": Uniform(0.0, 1.0),
        "lr": LogUniform(1e-3, 1e-1),
        "bs": IntUniform(16, 64),
        "momentum": Choice([0.5, 0.9]),
    }
)


def test_mutations_stay_in_bounds_types_and_choices() -> None:
    tuner = PBT(MIXED, "acc", population=8, interval=2, steps=16, seed=5)
    run(tuner, FakeRunner())
    assert len(tuner.exploits) >= 10
    hows: set[str] = set()
    for e, new, donor in exploited(tuner):
        t = e["step"]
        hows.update(e["mutations"].values())
        assert new.hp["x"].values(0, t) == donor.hp["x"].values(0, t)
        assert 0.0 <= new.hp["x"](t) <= 1.0
        assert 1e-3 <= new.hp["lr"](t) <= 1e-1
        bs = new.hp["bs"](t)
        assert isinstance(bs, int) and 16 <= bs <= 64
        assert new.hp["momentum"](t) in (0.5, 0.9)  # never 1.08
        if e["mutations"]["lr"] == "perturb":  # log scale: by the factor 0.8 or 1.2
            ratio = new.hp["lr"](t) / donor.hp["lr"](t)
            assert any(math.isclose(ratio, f) for f in (0.8, 1.2)) or new.hp["lr"](t) in (
                1e-3,
                1e-1,
            )
        if e["mutations"]["bs"] == "perturb":  # round(0.2 * 48) = 10 either way, clipped
            assert abs(bs - donor.hp["bs"](t)) == 10 or bs in (16, 64)
        if e["mutations"]["momentum"] == "perturb":  # the neighbouring choice
            assert new.hp["momentum"](t) != donor.hp["momentum"](t)
    assert hows == {"perturb", "resample"}


def test_resample_probability_one_draws_from_the_distribution() -> None:
    tuner = PBT(MIXED, "acc", population=6, interval=3, steps=9, seed=1, resample_probability=1.0)
    run(tuner, FakeRunner())
    assert tuner.exploits
    for e, new, _ in exploited(tuner):
        assert set(e["mutations"].values()) == {"resample"}
        assert 1e-3 <= new.hp["lr"](e["step"]) <= 1e-1


def test_explicit_mutations_override_the_space_within_it() -> None:
    tuner = PBT(
        MIXED,
        "acc",
        population=6,
        interval=2,
        steps=8,
        seed=2,
        resample_probability=1.0,
        mutations={"lr": Choice([1e-3, 1e-2]), "bs": [32, 64]},
    )
    run(tuner, FakeRunner())
    assert tuner.exploits
    for e, new, _ in exploited(tuner):
        assert new.hp["lr"](e["step"]) in (1e-3, 1e-2)
        assert new.hp["bs"](e["step"]) in (32, 64)


def test_mutations_come_only_from_the_user_for_a_list_of_trials() -> None:
    specs = [TrialSpec({}, {"x": Constant(v)}) for v in (0.2, 0.4, 0.6, 0.8)]
    tuner = PBT(specs, "acc", population=4, interval=2, steps=6, mutations={"x": Uniform(0, 1)})
    run(tuner, FakeRunner())
    assert tuner.exploits
    with pytest.raises(TunerError, match="nothing to mutate"):
        PBT(specs, "acc", population=4, interval=2, steps=6)
    wrong = PBT(specs, "acc", population=4, interval=2, steps=6, mutations={"y": Uniform(0, 1)})
    runner = FakeRunner()
    with pytest.raises(TunerError, match=r"\['y'\].*not sequences"):
        run(wrong, runner)
    assert runner.log == []  # refused before anything was written


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("mutations", "match"),
    [
        ({"lr": LogUniform(1e-5, 1e-1)}, r"mutations\['lr'\] is outside the search space"),
        ({"lr": Uniform(0.0, 0.05)}, "outside"),  # 0 is not in LogUniform(1e-3, 0.1)
        ({"bs": Uniform(16, 64)}, "draws floats, the space draws ints"),
        ({"momentum": Choice([0.5, 0.99])}, r"0\.99 is not one of the options"),
        ({"momentum": Uniform(0.5, 0.9)}, "not one of the options"),
        ({"depth": Choice([1, 2])}, r"'depth', not a sequence of the space"),
        ({"opt": Choice(["sgd"])}, r"'opt', a fixed hyper-parameter \(config\)"),
        ({"lr": "fast"}, "must be a distribution"),
        ({"sched": Choice([0.1, 0.2])}, "varies what the space fixes"),
        ({"ms": MultiStep(init=LogUniform(1e-4, 1e-1), milestones=[5])}, "argument 'init'"),
        ({"ms": Uniform(0, 1)}, "not a MultiStep template"),
    ],
)
def test_bad_mutations_are_refused_before_anything_is_written(
    tmp_path: Path, mutations: dict[str, Any], match: str
) -> None:
    space = RandomSpace(
        {
            "lr": LogUniform(1e-3, 1e-1),
            "bs": IntUniform(16, 64),
            "momentum": Choice([0.5, 0.9]),
            "sched": Constant(0.3),
            "ms": MultiStep(init=LogUniform(1e-3, 1e-1), milestones=[5]),
        },
        fixed={"opt": Choice(["sgd", "adam"])},
    )
    with pytest.raises(TunerError, match=match):
        PBT(space, "acc", population=4, interval=2, steps=6, mutations=mutations)
    assert not (tmp_path / "plan.db").exists()


def test_bad_pbt_arguments() -> None:
    for kwargs, match in [
        ({"resample_probability": 1.5}, "resample_probability"),
        ({"resample_probability": True}, "resample_probability"),
        ({"perturb": 1.0}, "perturb"),
        ({"mutations": [("lr", Uniform(0, 1))]}, "mutations must be a dict"),
        ({"hp_to_mutate": ["opt"]}, "fixed hyper-parameter"),
    ]:
        with pytest.raises(TunerError, match=match):
            PBT(
                RandomSpace({"lr": Uniform(0, 1)}, fixed={"opt": "sgd"}),
                "acc",
                population=4,
                interval=2,
                steps=6,
                **kwargs,
            )
    with pytest.raises(TunerError, match="nothing to mutate"):
        PBT(RandomSpace({"lr": 0.1}), "acc", population=4, interval=2, steps=6)


# --------------------------------------------------------------------------- schedules


def test_a_template_continues_with_the_donors_shape() -> None:
    space = RandomSpace(
        {"x": MultiStep(init=LogUniform(0.1, 1.0), milestones=Choice([[3, 9], [4, 9]]), gamma=0.5)}
    )
    tuner = PBT(space, "acc", population=6, interval=5, steps=15, seed=0, resample_probability=0)
    run(tuner, FakeRunner())
    assert tuner.exploits
    for e, new, donor in exploited(tuner):
        t = e["step"]
        seq = new.hp["x"]
        assert isinstance(seq, Then) and seq.first == donor.hp["x"] and seq.at == t
        assert isinstance(seq.second, Shifted) and seq.second.offset == t
        schedule = seq.second.base
        assert isinstance(schedule, MultiStep) and schedule.gamma == 0.5
        assert schedule.milestones in ((3, 9), (4, 9))
        assert seq.values(0, t) == donor.hp["x"].values(0, t)
        # from t on: the new schedule in the trial's step numbering, decay at 9 included
        assert seq.values(t, 15) == schedule.values(t, 15)
        if t < 9:
            assert seq(9) == pytest.approx(seq(8) * 0.5)


def test_a_multistep_exploited_mid_way_keeps_its_later_decay() -> None:
    # the example: MultiStep(0.1, [30, 60], 0.1) exploited at 40, init * 1.2
    donor_seq = MultiStep(0.1, [30, 60])
    specs = [TrialSpec({}, {"x": donor_seq}), TrialSpec({}, {"x": 0.01})]
    mutations = {"x": MultiStep(init=LogUniform(0.05, 0.5), milestones=[30, 60])}
    for seed in range(20):
        tuner = PBT(
            specs, "acc", population=2, interval=40, steps=80, seed=seed,
            resample_probability=0, mutations=mutations,
        )  # fmt: skip
        run(tuner, FakeRunner())
        ((e, new, donor),) = exploited(tuner)
        assert donor.hp["x"] == donor_seq and e["step"] == 40
        if new.hp["x"](40) > donor_seq(40):
            break
    hp = new.hp
    seq = hp["x"]
    assert seq.values(0, 40) == donor_seq.values(0, 40)
    for t in (40, 59, 60, 79):
        assert seq(t) == pytest.approx(1.2 * donor_seq(t))
    assert seq(60) == pytest.approx(seq(59) * 0.1)  # the decay at 60 still happens
    assert short_sequence(seq) == (
        "MultiStep(0.1, [30, 60], 0.1) until step 40, then MultiStep(0.12, [30, 60], 0.1) "
        "continued from step 40"
    )
    assert loads_hp(dumps_hp(hp)) == hp  # stored and read back as is


# --------------------------------------------------------------------------- studies


SPACE = RandomSpace(
    {"lr": MultiStep(init=LogUniform(0.005, 0.08), milestones=Choice([[6], [9]]), gamma=0.5)},
    fixed={"seed": 3},
)


def pbt(seed: int = 4) -> PBT:
    return PBT(SPACE, "score", population=4, interval=4, steps=12, seed=seed)


def test_study_shares_the_donor_prefix_and_records_the_lineage(tmp_path: Path) -> None:
    with make(tmp_path) as study:
        tuner = pbt()
        best = study.tune(tuner)
        assert best is not None and best.steps == 12
        stats = study.stats()
        records = {r.id: r for r in study.trials()}
    assert tuner.exploits
    # every generation trains each member `interval` new steps: exploits retrain nothing
    assert stats["steps_executed"] == 4 * 12
    made = {r.id: r for r in records.values() if r.lineage}
    assert len(made) == len(tuner.exploits)
    by_hp = {dumps_hp(r.hp): r.id for r in records.values()}
    for e, new, donor in exploited(tuner):
        rec = records[by_hp[dumps_hp(new.hp)]]
        donor_id = by_hp[dumps_hp(donor.hp)]
        assert rec.lineage[-1] == {"donor": donor_id, "step": e["step"]}
        assert rec.lineage[:-1] == records[donor_id].lineage  # the donor's own, oldest first
        assert [g["step"] for g in rec.lineage] == sorted(g["step"] for g in rec.lineage)
        # the values it trained with: the donor's before the exploit, its own after
        t = e["step"]
        used = [rec.metrics[s + 1]["used_lr"] for s in range(12)]
        assert used[:t] == pytest.approx(donor.hp["lr"].values(0, t))
        assert used == pytest.approx(new.hp["lr"].values(0, 12))
        # shared prefix: identical metrics up to the exploit step
        donor_rec = records[donor_id]
        for s in range(1, t + 1):
            assert rec.metrics[s] == donor_rec.metrics[s]
    # the lineage is in the plan: a new process (a new Study) reads it back
    with make(tmp_path) as again:
        assert {r.id: r.lineage for r in again.trials()} == {
            r.id: r.lineage for r in records.values()
        }
    out = io.StringIO()
    status(f"sqlite:///{tmp_path}/plan.db", "pbt", out=out, rich_output=False)
    text = out.getvalue()
    assert f"{len(made)} trials made by PBT exploits" in text


def test_status_shows_the_best_trials_ancestry(tmp_path: Path) -> None:
    with make(tmp_path) as study:
        study.tune(pbt(seed=7))
        records = study.trials()
        best = study.best("score")
    assert best is not None
    out = io.StringIO()
    st = status(f"sqlite:///{tmp_path}/plan.db", "pbt", out=out, rich_output=False)
    (s,) = st.studies
    assert s.lineage == {r.id: r.lineage for r in records if r.lineage}
    chain = s.lineage[best.id]  # with this seed, two exploits made the best trial
    assert len(chain) == 2 and chain[0]["step"] < chain[1]["step"]
    steps = ", ".join(f"trial {g['donor']} to step {g['step']}" for g in chain)
    assert f"best trial {best.id} follows {steps}" in out.getvalue()


def test_pbt_is_deterministic_and_resumes_by_replaying_its_draws(tmp_path: Path) -> None:
    def trials_of(path: Path) -> list[tuple[str, list[dict[str, int]]]]:
        with make(path) as study:
            return [(dumps_hp(r.hp), r.lineage) for r in study.trials()]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with make(tmp_path / "a") as study:
        study.tune(pbt())
    with make(tmp_path / "b") as study:
        study.tune(pbt())
    assert trials_of(tmp_path / "a") == trials_of(tmp_path / "b")
    # a second run replays the log: the same draws, nothing trained, no divergence
    with make(tmp_path / "a") as study:
        before = study.stats()["steps_executed"]
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplayDivergedWarning)
            study.tune(pbt())
        assert study.stats()["steps_executed"] == before
    assert trials_of(tmp_path / "a") == trials_of(tmp_path / "b")


def test_killed_pbt_resumes_with_the_same_exploits() -> None:
    def go(runner: FakeRunner, tuner: PBT) -> None:
        run(tuner, runner)

    whole = FakeRunner()
    go(whole, PBT(MIXED, "acc", population=6, interval=2, steps=10, seed=7))

    class Killed(Exception):
        pass

    class Dying(FakeRunner):
        def append_log(self, record: dict[str, Any]) -> None:
            super().append_log(record)
            if len(self.log) == 40:
                raise Killed

    first = Dying()
    with pytest.raises(Killed):
        go(first, PBT(MIXED, "acc", population=6, interval=2, steps=10, seed=7))
    resumed = FakeRunner(log=first.log)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergedWarning)
        go(resumed, PBT(MIXED, "acc", population=6, interval=2, steps=10, seed=7))
    assert decisions(resumed.log) == decisions(whole.log)


# --------------------------------------------------------------------------- lineage


def test_lineage_maps_tuner_ids_through_fingerprints() -> None:
    a = Trial(0, {"s": 1}, {"x": Constant(0.1)})
    b = Trial(1, {"s": 1}, {"x": Constant(0.2)})
    c = Trial(2, {"s": 1}, {"x": Then(Constant(0.2), Constant(0.3), 4)})
    d = Trial(3, {"s": 1}, {"x": Then(c.hp["x"], Constant(0.4), 8)})
    log = [
        {"event": "submit", "key": 0, "trial": 0, "steps": 4, "fp": a.fingerprint},
        {"event": "submit", "key": 1, "trial": 1, "steps": 4, "fp": b.fingerprint},
        {"event": "exploit", "trial": 2, "donor": 1, "replaces": 0, "step": 4},
        {"event": "submit", "key": 2, "trial": 2, "steps": 8, "fp": c.fingerprint},
        {"event": "exploit", "trial": 3, "donor": 2, "replaces": 1, "step": 8},
        {"event": "submit", "key": 3, "trial": 3, "steps": 12, "fp": d.fingerprint},
        {"event": "exploit", "trial": 4, "donor": 2, "replaces": 1, "step": 8},  # never ran
    ]
    rows = [{"id": 10 + t.id, "config": dict(t.config), "hp": dict(t.hp)} for t in (a, b, c, d)]
    assert lineages(log, rows) == {
        12: [{"donor": 11, "step": 4}],
        13: [{"donor": 11, "step": 4}, {"donor": 12, "step": 8}],
    }
    # a diverged replay drops the exploit it had logged but not submitted
    dropped = [*log[:4], {"event": "exploit", "trial": 3, "donor": 2, "step": 8}]
    dropped += [{"event": "diverged", "keep": 4, "reason": "test"}, log[5]]
    assert d.fingerprint not in exploit_parents(dropped)
    assert lineages([], rows) == {}


def test_grid_pbt_runs_in_a_study(tmp_path: Path) -> None:
    grid = GridSpace({"lr": [0.01, 0.02, 0.04, 0.08]}, fixed={"seed": [0]})
    with make(tmp_path) as study:
        tuner = PBT(grid, "score", population=4, interval=3, steps=9, seed=0)
        study.tune(tuner)
        records = study.trials()
    assert tuner.exploits
    for r in records:
        assert {r.hp["lr"](s) for s in range(9)} <= {0.01, 0.02, 0.04, 0.08}
    assert sum(1 for r in records if r.lineage) == len(tuner.exploits)


def test_grid_mutations_are_a_subset_of_its_options() -> None:
    grid = GridSpace({"x": [0.1, 0.3, 0.5, 0.7]})
    tuner = PBT(grid, "acc", population=4, interval=2, steps=6, mutations={"x": [0.3, 0.5]})
    run(tuner, FakeRunner())
    assert tuner.exploits
    for e, new, _ in exploited(tuner):
        assert new.hp["x"](e["step"]) in (0.3, 0.5)
    with pytest.raises(TunerError, match=r"0\.4 is not one of the options"):
        PBT(grid, "acc", population=4, interval=2, steps=6, mutations={"x": [0.3, 0.4]})


def test_a_choice_of_schedules_moves_to_a_neighbouring_schedule() -> None:
    options = [
        Constant(0.6),
        MultiStep(0.7, [5]),
        MultiStep(init=Uniform(0.6, 0.8), milestones=[7]),
    ]
    space = RandomSpace({"x": Choice(options)})
    tuner = PBT(space, "acc", population=6, interval=2, steps=10, seed=3, resample_probability=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the space has few distinct trials
        run(tuner, FakeRunner())
    assert tuner.exploits
    for e, new, _ in exploited(tuner):
        t, seq = e["step"], new.hp["x"]
        assert isinstance(seq, Then) and seq.at == t
        tail = seq.second.base if isinstance(seq.second, Shifted) else seq.second
        assert tail in options[:2] or (
            isinstance(tail, MultiStep) and tail.milestones == (7,) and 0.6 <= tail.init <= 0.8
        )
        assert seq.values(t, 10) == tail.values(t, 10)  # in the trial's step numbering


def test_lineage_travels_to_a_remote_study() -> None:
    from stagetree.records import TrialRecord
    from stagetree.server.protocol import record_from_json, record_to_json

    seq = Then(MultiStep(0.1, [30, 60]), Shifted(MultiStep(0.12, [30, 60]), 40), 40)
    record = TrialRecord(7, {"seed": 0}, {"lr": seq}, 80, "done", {}, None, [
        {"donor": 2, "step": 20}, {"donor": 5, "step": 40},
    ])  # fmt: skip
    back = record_from_json(record_to_json(record))
    assert back.lineage == record.lineage and back.hp == record.hp
