"""Tests of stagetree.space: grids, random spaces, trials, validation, space files."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest

from stagetree.distributions import Choice, IntUniform, LogUniform, Uniform
from stagetree.exceptions import InvalidSpaceError, InvalidTrialError, StagetreeError
from stagetree.hp import Constant, Cosine, MultiStep, Piecewise, Sequence, SequenceTemplate
from stagetree.space import (
    GridSpace,
    RandomSpace,
    SpaceFile,
    TrialSpec,
    canonical_json,
    config_key,
    load_space_file,
    validate_trial,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# --------------------------------------------------------------------------- TrialSpec


def test_trialspec_turns_plain_values_into_constants_and_sorts_names() -> None:
    t = TrialSpec({"wd": 1e-4, "opt": "sgd"}, {"lr": 0.1, "bs": Constant(128)})
    assert list(t.config) == ["opt", "wd"]
    assert list(t.hp) == ["bs", "lr"]
    assert t.hp["lr"] == Constant(0.1)
    assert t.root_config == {"opt": "sgd", "wd": 1e-4}


def test_trialspec_equality_and_hash_are_canonical() -> None:
    a = TrialSpec({"opt": "sgd", "wd": 1e-4}, {"lr": MultiStep(0.1, [30], 0.1)})
    b = TrialSpec({"wd": 1e-4, "opt": "sgd"}, {"lr": MultiStep(0.1, (30,), 0.1)})
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    # Fixed values are compared as written (their JSON picks the plan tree); sequences
    # by value, as in stagetree.hp (issue 25): 1 and 1.0 are one value, True is not.
    assert TrialSpec({"x": 1}, {"lr": 0.1}) != TrialSpec({"x": 1.0}, {"lr": 0.1})
    assert TrialSpec({}, {"bs": 1}) == TrialSpec({}, {"bs": 1.0})
    assert TrialSpec({}, {"bs": 1}) != TrialSpec({}, {"bs": True})


def test_trialspec_pickles_and_root_key_is_stable() -> None:
    t = TrialSpec({"opt": "sgd", "layers": (64, 32)}, {"lr": Cosine(0.1, 50)})
    u = pickle.loads(pickle.dumps(t))
    assert u == t and hash(u) == hash(t)
    assert t.root_key() == config_key({"layers": [64, 32], "opt": "sgd"})
    assert len(t.root_key()) == 16
    assert t.root_key() != t.root_key(salt="trainer-a")
    assert canonical_json({"b": 1, "a": (1, 2)}) == '{"a":[1,2],"b":1}'


def test_trialspec_rejects_bad_input() -> None:
    with pytest.raises(InvalidTrialError, match="both fixed and sequential"):
        TrialSpec({"lr": 0.1}, {"lr": 0.1})
    with pytest.raises(InvalidTrialError, match="names must be str"):
        TrialSpec({}, {1: 0.1})  # type: ignore[dict-item]
    with pytest.raises(InvalidTrialError, match="'opt'"):
        TrialSpec({"opt": None}, {"lr": 0.1})
    with pytest.raises(InvalidTrialError, match="'lr'"):
        TrialSpec({}, {"lr": [0.1, 0.2]})  # type: ignore[dict-item]


# --------------------------------------------------------------------------- GridSpace


def test_grid_product_size_and_order() -> None:
    space = GridSpace({"lr": [0.1, 0.01, 0.001], "bs": [32, 64]})
    trials = space.trials()
    assert len(space) == 6 == len(trials)
    # First entry varies slowest, options in list order.
    assert [(t.hp["lr"](0), t.hp["bs"](0)) for t in trials] == [
        (0.1, 32),
        (0.1, 64),
        (0.01, 32),
        (0.01, 64),
        (0.001, 32),
        (0.001, 64),
    ]
    assert list(space) == trials
    assert space.trials() == GridSpace({"lr": [0.1, 0.01, 0.001], "bs": [32, 64]}).trials()
    assert space.names == ("bs", "lr")
    assert space.fixed_names == ()


def test_grid_fixed_times_hp_fixed_varies_slowest() -> None:
    space = GridSpace(
        {"lr": [Constant(0.1), MultiStep(0.1, [5], 0.1)]},
        fixed={"opt": ["sgd", "adam"], "wd": [0.0, 1e-4]},
    )
    trials = space.trials()
    assert len(trials) == 8
    assert space.fixed_names == ("opt", "wd")
    configs = [(t.config["opt"], t.config["wd"]) for t in trials]
    assert configs == [
        ("sgd", 0.0),
        ("sgd", 0.0),
        ("sgd", 1e-4),
        ("sgd", 1e-4),
        ("adam", 0.0),
        ("adam", 0.0),
        ("adam", 1e-4),
        ("adam", 1e-4),
    ]
    assert [t.hp["lr"] for t in trials[:2]] == [Constant(0.1), MultiStep(0.1, [5], 0.1)]
    assert len(set(trials)) == 8
    assert len({t.root_key() for t in trials}) == 4


def test_grid_bare_option_counts_as_one() -> None:
    space = GridSpace({"lr": Cosine(0.1, 10), "bs": [1, 2]}, fixed={"opt": "sgd"})
    assert len(space) == 2
    assert all(t.config == {"opt": "sgd"} for t in space)


def test_grid_list_valued_fixed_option() -> None:
    space = GridSpace({"lr": [0.1]}, fixed={"layers": [[64, 64], [128]]})
    assert [t.config["layers"] for t in space] == [[64, 64], [128]]


def test_grid_where_filter() -> None:
    space = GridSpace(
        {"lr": [0.1, 0.01], "momentum": [0.0, 0.9]},
        fixed={"opt": ["adam", "sgd"]},
        where=lambda t: not (t.config["opt"] == "adam" and t.hp["momentum"](0) != 0.0),
    )
    assert space.size_before_filter == 8
    assert len(space) == 6
    assert all(t.hp["momentum"] == Constant(0.0) for t in space if t.config["opt"] == "adam")


def test_grid_subset_is_seeded_and_in_grid_order() -> None:
    space = GridSpace({"lr": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]})
    everything = space.trials()
    a = space.trials(3, seed=1)
    assert a == space.trials(3, seed=1)
    assert len(set(a)) == 3
    assert a == sorted(a, key=everything.index)
    assert {tuple(space.trials(3, seed=s)) for s in range(10)} != {tuple(a)}
    with pytest.raises(InvalidSpaceError, match=r"\[1, 6\]"):
        space.trials(7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hp": {}}, "hp is empty"),
        ({"hp": {"lr": []}}, "'lr' has no options"),
        ({"hp": {"lr": [0.1]}, "fixed": {"opt": []}}, "'opt' has no options"),
        ({"hp": {"lr": [{"a": 1}]}}, "'lr'.*dict"),
        ({"hp": {"lr": [None]}}, "'lr'.*None"),
        ({"hp": {"lr": [object()]}}, "'lr'"),
        ({"hp": {"lr": [[0.1, 0.01]]}}, "'lr'.*list"),
        ({"hp": {"lr": [LogUniform(1e-3, 1.0)]}}, "'lr'.*RandomSpace"),
        ({"hp": {"lr": [MultiStep(LogUniform(1e-3, 1.0), [5], 0.1)]}}, "'lr'.*RandomSpace"),
        ({"hp": {"lr": [0.1]}, "fixed": {"opt": [None]}}, "'opt'.*None"),
        ({"hp": {"lr": [0.1]}, "fixed": {"opt": [{"x": 1}]}}, "'opt'.*dict"),
        ({"hp": {"lr": [0.1]}, "fixed": {"opt": [float("nan")]}}, "'opt'.*non-finite"),
        ({"hp": {"lr": [0.1]}, "fixed": {"wd": [Choice([1, 2])]}}, "'wd'.*RandomSpace"),
        ({"hp": {"lr": [0.1]}, "fixed": {"lr": [1]}}, r"both in hp and in fixed: \['lr'\]"),
        ({"hp": {1: [0.1]}}, "names must be non-empty str"),
        ({"hp": {"lr": [0.1]}, "fixed": {("a",): [1]}}, "names must be non-empty str"),
        ({"hp": {"lr": [0.1, 0.1]}}, "'lr' lists the option"),
        ({"hp": {"lr": [0.1]}, "fixed": {"opt": ["sgd", "sgd"]}}, "'opt' lists the option"),
        ({"hp": [0.1]}, "hp must be a dict"),
        ({"hp": {"lr": [0.1]}, "where": lambda t: False}, "where=.*rejects all 1"),
    ],
)
def test_grid_validation_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidSpaceError, match=match):
        GridSpace(**kwargs)


def test_grid_accepts_sequences_and_all_scalar_types() -> None:
    space = GridSpace(
        {"lr": [Cosine(0.1, 10), 0.1], "bs": [64], "aug": ["flip"], "on": [True]},
        fixed={"a": ["x"], "b": [1], "c": [1.5], "d": [False], "e": [(1, 2)]},
    )
    assert len(space) == 2
    assert all(isinstance(s, Sequence) for t in space for s in t.hp.values())


# --------------------------------------------------------------------------- RandomSpace


def _random_space(**kwargs: object) -> RandomSpace:
    return RandomSpace(
        {
            "lr": MultiStep(
                init=LogUniform(1e-3, 0.3), milestones=Choice([[30, 45], [40]]), gamma=0.1
            ),
            "bs": Choice([Constant(128), Piecewise([128, 256], [70])]),
            "momentum": 0.9,
        },
        fixed={"opt": Choice(["sgd", "adam"]), "wd": Uniform(0.0, 1e-3), "depth": IntUniform(2, 8)},
        **kwargs,  # type: ignore[arg-type]
    )


def test_random_reproducible_from_seed() -> None:
    space = _random_space()
    a = space.sample(20, seed=3)
    assert a == _random_space().sample(20, seed=3)
    assert a == space.trials(20, seed=3)
    assert a != space.sample(20, seed=4)
    # sample_one draws from the rng it is given, as sample() does.
    rng = random.Random(3)
    assert [space.sample_one(rng) for _ in range(20)] == a


def test_random_templates_are_sampled_per_trial() -> None:
    trials = _random_space().sample(40, seed=0)
    lrs = [t.hp["lr"] for t in trials]
    assert all(isinstance(s, MultiStep) for s in lrs)
    inits = {s.init for s in lrs}  # type: ignore[attr-defined]
    assert len(inits) == 40
    assert all(1e-3 <= x <= 0.3 for x in inits)
    assert {s.milestones for s in lrs} == {(30, 45), (40,)}  # type: ignore[attr-defined]
    assert {t.hp["bs"] for t in trials} == {Constant(128), Piecewise([128, 256], [70])}
    assert {t.hp["momentum"] for t in trials} == {Constant(0.9)}
    assert {t.config["opt"] for t in trials} == {"sgd", "adam"}
    assert all(2 <= t.config["depth"] <= 8 and isinstance(t.config["depth"], int) for t in trials)
    assert all(0.0 <= t.config["wd"] <= 1e-3 for t in trials)


def test_random_choice_of_templates_and_list_valued_fixed_choice() -> None:
    space = RandomSpace(
        {"lr": Choice([Cosine(LogUniform(0.01, 0.1), 50), Constant(0.05)])},
        fixed={"layers": Choice([[64, 64], [128]]), "tag": ("a", "b")},
    )
    trials = space.sample(30, seed=1)
    assert {type(t.hp["lr"]) for t in trials} == {Cosine, Constant}
    assert {t.config["layers"] for t in trials} == {(64, 64), (128,)}
    assert {t.config["tag"] for t in trials} == {("a", "b")}


def test_random_where_resamples_and_gives_up() -> None:
    space = _random_space(where=lambda t: t.config["opt"] == "sgd")
    assert {t.config["opt"] for t in space.sample(10, seed=0)} == {"sgd"}
    never = _random_space(where=lambda t: False, max_rejections=50)
    with pytest.raises(InvalidSpaceError, match="rejected 50 draws in a row"):
        never.sample(1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hp": {}}, "hp is empty"),
        ({"hp": {"lr": None}}, "'lr'.*None"),
        ({"hp": {"lr": {"a": 1}}}, "'lr'.*dict"),
        ({"hp": {"lr": [0.1, 0.2]}}, "'lr'.*list"),
        ({"hp": {"lr": Choice([0.1, None])}}, "'lr'.*None"),
        ({"hp": {"lr": 0.1}, "fixed": {"opt": ["sgd", "adam"]}}, "'opt'.*ambiguous.*Choice"),
        ({"hp": {"lr": 0.1}, "fixed": {"opt": None}}, "'opt'.*None"),
        ({"hp": {"lr": 0.1}, "fixed": {"opt": Choice(["sgd", {"x": 1}])}}, "'opt'.*dict"),
        ({"hp": {"lr": 0.1}, "fixed": {"s": Cosine(LogUniform(0.1, 1.0), 5)}}, "'s'.*belong in hp"),
        ({"hp": {"lr": 0.1}, "fixed": {"lr": 1}}, r"both in hp and in fixed: \['lr'\]"),
        ({"hp": {2: 0.1}}, "names must be non-empty str"),
        ({"hp": {"lr": 0.1}, "max_rejections": 0}, "max_rejections"),
    ],
)
def test_random_validation_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidSpaceError, match=match):
        RandomSpace(**kwargs)


def test_random_bad_sampled_values_name_the_entry() -> None:
    # A template whose drawn arguments are invalid for the family.
    space = RandomSpace({"lr": MultiStep(0.1, Choice([[40, 30]]), 0.1)})
    with pytest.raises(InvalidSpaceError, match="'lr'"):
        space.sample(1)
    with pytest.raises(InvalidSpaceError, match="needs the number of trials"):
        space.trials()
    with pytest.raises(InvalidSpaceError, match="n must be an int >= 1"):
        space.sample(0)


def test_template_is_a_template() -> None:
    t = MultiStep(init=LogUniform(1e-3, 0.3), milestones=[30], gamma=0.1)
    assert isinstance(t, SequenceTemplate)


# --------------------------------------------------------------------------- validate_trial


def test_validate_trial_names_missing_and_extra() -> None:
    space = GridSpace({"lr": [0.1], "bs": [32]}, fixed={"opt": ["sgd"]})
    good = space.trials()[0]
    assert validate_trial(space, good) is good
    assert space.validate(good) is good
    with pytest.raises(InvalidTrialError, match=r"missing \['bs'\], unexpected \['momentum'\]"):
        validate_trial(space, TrialSpec({"opt": "sgd"}, {"lr": 0.1, "momentum": 0.9}))
    with pytest.raises(InvalidTrialError, match=r"fixed.*missing \['opt'\], unexpected \[\]"):
        validate_trial(space, TrialSpec({}, {"lr": 0.1, "bs": 32}))
    # Names only: fixed names are checked only when given.
    assert validate_trial(["bs", "lr"], TrialSpec({"x": 1}, {"lr": 0.1, "bs": 32}))
    with pytest.raises(InvalidTrialError, match=r"unexpected \['x'\]"):
        validate_trial(["bs", "lr"], TrialSpec({"x": 1}, {"lr": 0.1, "bs": 32}), fixed_names=[])
    with pytest.raises(InvalidTrialError, match="expected a TrialSpec"):
        validate_trial(space, {"lr": 0.1})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- files


def _write(tmp_path: Path, text: str, name: str = "space.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


HEADER = (
    "from stagetree.space import GridSpace, RandomSpace\n"
    "from stagetree.distributions import Uniform\n"
)


def test_load_space_file_grid(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "space = GridSpace({'lr': [0.1, 0.2]})\nsteps = 50\n")
    f = load_space_file(path)
    assert isinstance(f, SpaceFile)
    assert f.name == "space" and f.steps == 50 and f.num_trials is None and f.seed == 0
    assert len(f.trials()) == 2
    assert f.steps_for(f.trials()[0]) == 50


def test_load_space_file_random_with_callable_steps(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        HEADER
        + "space = RandomSpace({'lr': Uniform(0.01, 0.1)})\n"
        + "num_trials = 5\nseed = 7\nname = 'demo'\n"
        + "def steps(trial):\n    return 10 if trial.hp['lr'](0) < 0.05 else 20\n"
        + "if __name__ == '__main__':\n    raise SystemExit('must not run')\n",
    )
    f = load_space_file(path)
    assert f.name == "demo" and f.num_trials == 5 and f.seed == 7
    trials = f.trials()
    assert trials == f.space.trials(5, seed=7)
    assert [f.steps_for(t) for t in trials] == [10 if t.hp["lr"](0) < 0.05 else 20 for t in trials]
    assert len(f.trials(num_trials=2, seed=1)) == 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("steps = 10\n", "defines no variable 'space'"),
        ("space = GridSpace({'lr': [0.1]})\n", "defines no variable 'steps'"),
        ("space = {'lr': [0.1]}\nsteps = 10\n", "'space' must be a stagetree.space.BaseSpace"),
        ("space = GridSpace({'lr': [0.1]})\nsteps = 0\n", "'steps' must be an int >= 1"),
        ("space = GridSpace({'lr': [0.1]})\nsteps = '10'\n", "'steps' must be an int >= 1"),
        ("space = RandomSpace({'lr': Uniform(0, 1)})\nsteps = 5\n", "needs 'num_trials'"),
        ("space = GridSpace({'lr': [0.1]})\nsteps = 5\nnum_trials = -1\n", "'num_trials'"),
        ("space = GridSpace({'lr': [0.1]})\nsteps = 5\nseed = 'x'\n", "'seed' must be an int"),
        ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
        ("space = GridSpace({'lr': []})\nsteps = 5\n", "'lr' has no options"),
    ],
)
def test_load_space_file_errors(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(StagetreeError, match=match):
        load_space_file(_write(tmp_path, HEADER + text))


def test_load_space_file_missing(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpaceError, match="does not exist"):
        load_space_file(tmp_path / "nope.py")


def test_callable_steps_must_return_positive_int(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "space = GridSpace({'lr': [0.1]})\nsteps = lambda t: 0\n")
    f = load_space_file(path)
    with pytest.raises(InvalidSpaceError, match="returned 0"):
        f.steps_for(f.trials()[0])


def test_resnet56_example_space() -> None:
    f = load_space_file(EXAMPLES / "resnet56_space.py")
    trials = f.trials()
    assert len(trials) == 5 * 2 * 2 * 2 * 3 == 120
    assert len(set(trials)) == 120
    assert f.steps == 120
    assert len({t.root_key() for t in trials}) == 6
    lrs = {t.hp["lr"] for t in trials}
    assert len(lrs) == 5
    # Step decay and warm-up + step decay reach the same values after epoch 5.
    plain = MultiStep(0.1, [90, 135], 0.1)
    warm = next(s for s in lrs if s != plain and s(89) == plain(89) and s(0) == 0.0)
    assert [warm(t) for t in (5, 89, 90, 119)] == [plain(t) for t in (5, 89, 90, 119)]


def test_a_huge_grid_is_sized_and_indexed_without_building_its_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 2 * 10**9 points: enumerating them would take hours (and not fit in memory).
    options = [Constant(0.001 * (i + 1)) for i in range(1000)]
    built = 0
    real_init = TrialSpec.__init__

    def counting(self: TrialSpec, *args: object, **kwargs: object) -> None:
        nonlocal built
        built += 1
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TrialSpec, "__init__", counting)
    space = GridSpace({"a": options, "b": options}, fixed={"c": list(range(1000)), "d": [1, 2]})
    assert len(space) == space.size == 2 * 10**9
    assert built == 0
    # Points by index, in grid order (fixed slowest, the last entry fastest).
    first, last = space[0], space[-1]
    assert dict(first.config) == {"c": 0, "d": 1} and first.hp == {"a": options[0], "b": options[0]}
    assert dict(last.config) == {"c": 999, "d": 2} and last.hp == {
        "a": options[-1],
        "b": options[-1],
    }
    assert space[1].hp["b"] == options[1] and space[1000].hp["a"] == options[1]
    assert next(iter(space)) == first
    picked = space.trials(3, seed=0)
    assert len(set(picked)) == 3  # a sample, built point by point
    assert built < 20


def test_grid_indexing_agrees_with_enumeration() -> None:
    space = GridSpace(
        {"lr": [0.1, 0.2, 0.3], "m": [Constant(0.9), Constant(0.99)]}, fixed={"opt": ["a", "b"]}
    )
    assert [space[i] for i in range(len(space))] == list(space) == space.trials()
    filtered = GridSpace({"lr": [0.1, 0.2, 0.3]}, where=lambda t: t.hp["lr"](0) > 0.15)
    assert len(filtered) == 2 and [filtered[i] for i in range(2)] == filtered.trials()
    with pytest.raises(IndexError):
        space[len(space)]
