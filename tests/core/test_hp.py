"""Tests of stagetree.hp: values, composition, identity, JSON, templates, validation.

PyTorch parity lives in test_hp_torch_parity.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
import random
import sys
from typing import Any

import pytest

import stagetree.hp
from stagetree.distributions import Choice, IntUniform, LogUniform, Uniform
from stagetree.exceptions import InvalidSequenceError
from stagetree.hp import (
    Constant,
    Cosine,
    CosineWarmRestarts,
    Cyclic,
    Exponential,
    Linear,
    MultiStep,
    OneCycle,
    Piecewise,
    Sequence,
    SequenceTemplate,
    Step,
    Then,
    Warmup,
    as_sequence,
    canonical_value,
    dumps_hp,
    first_difference,
    from_json,
    loads_hp,
)

# The same module, untyped: for calls that pass distributions or deliberately bad
# arguments, which a type checker would (rightly) reject.
H: Any = stagetree.hp

# One or more instances of every family (used by the generic tests).
EXAMPLES: list[Sequence] = [
    Constant(0.1),
    Constant(32),
    Constant("sgd"),
    Constant(True),
    Step(0.1, 30, 0.1),
    MultiStep(0.1, [30, 80], 0.1),
    MultiStep(1.0, [], 0.5),
    Exponential(0.1, 0.99),
    Cosine(0.1, 100),
    Cosine(0.5, 37, 1e-3),
    CosineWarmRestarts(0.1, 10),
    CosineWarmRestarts(0.1, 10, 2, 1e-4),
    Linear(0.0, 1.0, 10),
    Linear(0.5, 0.1, 0),
    Cyclic(1e-3, 0.1, 20),
    Cyclic(0.01, 0.1, 20, 50, "triangular2"),
    Cyclic(0.001, 0.006, 7, 3, "exp_range", 0.9995),
    OneCycle(0.1, 1000),
    OneCycle(1.0, 100, 0.25, "linear", 10.0, 100.0),
    Warmup(5, 0.1),
    Warmup(10, 1.0, 0.5),
    Piecewise([32, 64, 128], [10, 20]),
    Piecewise(["sgd", "adam"], [1500]),
    Piecewise([0.1, 1, True, "x"], [1, 2, 3]),
    Then(Warmup(5, 0.1), Cosine(0.1, 95), 5),
    Warmup(5, 0.1).then(Cosine(0.1, 95), 5).then(Constant(0.0), 100),
]
IDS = [repr(s)[:60] for s in EXAMPLES]


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("seq", EXAMPLES, ids=IDS)
def test_values_equal_calls(seq: Sequence) -> None:
    # Ranges inside one chunk, across chunk boundaries (1024), and empty ones.
    for start, stop in [(0, 1), (0, 50), (3, 1030), (1000, 3100), (2047, 2049), (7, 7), (9, 2)]:
        got = seq.values(start, stop)
        want = [seq(t) for t in range(start, stop)]
        assert got == want
        assert [type(v) for v in got] == [type(v) for v in want]


def test_values_returns_a_fresh_list() -> None:
    seq = Constant(0.1)
    first = seq.values(0, 5)
    first[0] = 99.0
    assert seq.values(0, 5) == [0.1] * 5


def test_family_values() -> None:
    assert Step(1.0, 3, 0.5).values(0, 7) == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    assert (
        MultiStep(0.1, [2, 4], 0.1).values(0, 6)
        == [0.1, 0.1, 0.1 * 0.1, 0.1 * 0.1] + [0.1 * 0.1**2] * 2
    )
    assert MultiStep(1.0, [0], 0.5)(0) == 0.5  # a milestone at 0 applies from the start
    assert Exponential(2.0, 0.5).values(0, 4) == [2.0, 1.0, 0.5, 0.25]
    assert Linear(0.0, 1.0, 4).values(0, 7) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert Linear(0.3, 0.1, 0).values(0, 2) == [0.1, 0.1]
    assert Warmup(4, 1.0).values(0, 6) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert Warmup(2, 1.0, 0.5).values(0, 3) == [0.5, 0.75, 1.0]
    assert Warmup(0, 0.3)(0) == 0.3
    assert Cyclic(0.0, 1.0, 2).values(0, 9) == [0.0, 0.5, 1.0, 0.5, 0.0, 0.5, 1.0, 0.5, 0.0]
    assert Cyclic(0.0, 1.0, 1, 3).values(0, 5) == pytest.approx([0.0, 1.0, 2 / 3, 1 / 3, 0.0])
    tri2 = Cyclic(0.0, 1.0, 1, 1, "triangular2")
    assert [tri2(t) for t in (1, 3, 5)] == [1.0, 0.5, 0.25]
    assert tri2(10**6 + 1) == 0.0  # amplitude 2**-500000: no OverflowError


def test_cosine_is_periodic_like_pytorch() -> None:
    seq = Cosine(1.0, 10, 0.1)
    assert seq(0) == 1.0
    assert seq(5) == pytest.approx(0.55)
    assert seq(10) == pytest.approx(0.1)
    assert seq(20) == pytest.approx(1.0)  # climbs back after t_max, as CosineAnnealingLR
    held = seq.then(Constant(0.1), 10)
    assert held(15) == 0.1


def test_cosine_warm_restarts_cycles() -> None:
    seq = CosineWarmRestarts(1.0, 2, 2)  # cycles of 2, 4, 8 steps start at 0, 2, 6, 14
    assert [seq(t) for t in (0, 2, 6, 14)] == [1.0, 1.0, 1.0, 1.0]
    assert seq(1) == pytest.approx(0.5)
    assert seq(4) == pytest.approx(0.5)
    assert seq(10) == pytest.approx(0.5)


def test_one_cycle_shape_and_hold() -> None:
    seq = OneCycle(1.0, 100, 0.3, div_factor=10.0, final_div_factor=100.0)
    assert seq(0) == pytest.approx(0.1)
    peak = max(seq.values(0, 100))
    assert peak == pytest.approx(1.0, rel=1e-3)
    assert seq(99) == pytest.approx(0.1 / 100)
    assert seq.values(99, 500) == [seq(99)] * 401
    # A warm-up phase of exactly one step: PyTorch divides by zero, we give the peak.
    assert OneCycle(1.0, 10, 0.1)(0) == 1.0


def test_overflow_is_reported() -> None:
    with pytest.raises(InvalidSequenceError, match="overflow"):
        Exponential(1.0, 10.0)(10**5)
    with pytest.raises(InvalidSequenceError, match="overflow"):
        Step(1.0, 1, 10.0)(10**5)


@pytest.mark.parametrize("bad", [-1, 1.0, True, "3", None])
def test_call_rejects_bad_steps(bad: Any) -> None:
    with pytest.raises(InvalidSequenceError, match="step"):
        Constant(0.1)(bad)
    with pytest.raises(InvalidSequenceError):
        Constant(0.1).values(bad, 10)


# --------------------------------------------------------------------------- then


def test_then_semantics() -> None:
    seq = Constant(1.0).then(Linear(0.0, 1.0, 4), at=3)
    assert isinstance(seq, Then)
    assert seq == Then(first=Constant(1.0), second=Linear(0.0, 1.0, 4), at=3)
    # The second sequence counts its steps from `at`.
    assert seq.values(0, 8) == [1.0, 1.0, 1.0, 0.0, 0.25, 0.5, 0.75, 1.0]
    assert Constant(1).then(Constant(2), 0).values(0, 3) == [2, 2, 2]
    assert Constant(0.1).then(0.01, at=2).values(0, 4) == [0.1, 0.1, 0.01, 0.01]


def test_piecewise_ints_and_strings() -> None:
    bs = Piecewise([32, 64, 128], [10, 20])
    assert [bs(t) for t in (0, 9, 10, 19, 20, 10**6)] == [32, 32, 64, 64, 128, 128]
    assert all(type(v) is int for v in bs.values(0, 30))
    opt = Piecewise(["sgd", "adam"], milestones=[5])
    assert opt.values(3, 7) == ["sgd", "sgd", "adam", "adam"]
    assert opt.levels == ("sgd", "adam")
    assert repr(opt) == "Piecewise(values=('sgd', 'adam'), milestones=(5,))"
    assert Piecewise([1], [])(100) == 1


# --------------------------------------------------------------------------- first_difference


def test_first_difference_examples() -> None:
    assert first_difference(MultiStep(0.1, [100], 0.1), Constant(0.1), 0, 1000) == 100
    assert first_difference(MultiStep(0.1, [100], 0.1), Constant(0.1), 0, 100) is None
    assert first_difference(Constant(0.1), Constant(0.1), 0, 10**9) is None  # fast path
    assert first_difference(Cosine(0.1, 100), Cosine(0.1, 100), 0, 5000) is None
    a = Cosine(0.1, 10**5)
    assert first_difference(a, a.then(Constant(0.0), 3000), 0, 10**4) == 3000
    assert first_difference(a, a.then(Constant(0.0), 3000), 3001, 10**4) == 3001
    assert first_difference(a, a.then(Constant(0.0), 3000), 0, 3000) is None
    assert first_difference(Constant(1), Constant(2), 5, 5) is None
    assert first_difference(Constant(1), Constant(2), 7, 3) is None


@pytest.mark.parametrize("at", [0, 1, 1023, 1024, 1025, 5000])
def test_first_difference_across_chunks(at: int) -> None:
    base = Piecewise([1, 2], [at])
    other = Constant(1)
    assert first_difference(base, other, 0, 6000) == at
    assert first_difference(other, base, 0, 6000) == at
    assert first_difference(base, other, max(at - 1, 0), at + 1) == at
    assert first_difference(base, other, at + 3, 6000) == at + 3


def test_first_difference_compares_numbers_by_value() -> None:
    # Issue 25: an int and a float of equal value are one value; a bool is not a number.
    assert first_difference(Constant(1), Constant(1.0), 0, 10) is None
    assert first_difference(Constant(1), Constant(True), 4, 10) == 4
    assert first_difference(Constant(1.0), Constant(True), 0, 10) == 0
    assert first_difference(Piecewise([1, 1.0], [7]), Constant(1), 0, 20) is None
    assert first_difference(Piecewise([1, 1.5], [7]), Constant(1), 0, 20) == 7
    assert first_difference(Constant(0.0), Constant(-0.0), 0, 10) is None
    assert first_difference(MultiStep(128, [40], 2), Constant(128), 0, 60) == 40
    assert first_difference(Constant("1"), Constant(1), 0, 3) == 0


def test_values_are_canonical() -> None:
    # Whichever spelling, setup() gets one value: an integral number as an int.
    assert type(Constant(128.0)(0)) is int
    assert Constant(128.0).values(0, 3) == [128, 128, 128]
    for seq in (MultiStep(128, [40], 2), Piecewise([128.0, 256], [40])):
        assert [type(v) for v in (seq(0), seq(45))] == [int, int]
        assert seq.values(38, 42) == [128, 128, 256, 256]
        assert {type(v) for v in seq.values(0, 60)} == {int}
    assert type(Constant(0.1)(0)) is float
    assert type(Warmup(4, 0.1)(0)) is int  # 0.0 -> 0
    assert Constant(True)(0) is True
    assert canonical_value(2.0) == 2 and type(canonical_value(2.0)) is int
    assert type(canonical_value(2.5)) is float and canonical_value(True) is True


PIECEWISE = [
    MultiStep(128, [40], 2),
    MultiStep(0.1, [3, 5], 0.1),
    MultiStep(1.0, [], 0.5),
    Step(2.0, 3, 0.5),
    Step(0.1, 30, 0.1),
    Piecewise([128.0, 256, 0.5, True, "x"], [2, 4, 6, 8]),
    Then(MultiStep(4.0, [3], 0.5), Piecewise([1.0, 1.5], [2]), 5),
    H.Shifted(MultiStep(8.0, [5, 9], 0.5), 3),
]


@pytest.mark.parametrize(
    "seq", [*PIECEWISE, Then(Warmup(4, 2.0), Step(2.0, 2, 0.5), 4), *EXAMPLES], ids=repr
)
def test_canonical_values_are_the_values_canonicalised(seq: Sequence) -> None:
    """Every family's canonical form is exactly its values, each canonicalised."""
    for start, stop in ((0, 1), (0, 13), (2, 11), (7, 2100)):
        want = [canonical_value(v) for v in seq._values(start, stop)]
        got = seq._canonical_values(start, stop)
        assert [(type(v), v) for v in got] == [(type(v), v) for v in want]


@pytest.mark.parametrize("seq", PIECEWISE, ids=repr)
def test_piecewise_families_canonicalise_per_piece(
    seq: Sequence, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of a piecewise-constant sequence (and of one made of them) takes one
    canonical form per piece, not one per step: ASHA's work keys and the study's
    inserts build a chunk for each of 100,000 drawn sequences."""

    def per_step(values: list[Any]) -> list[Any]:
        raise AssertionError("canonicalised step by step")

    monkeypatch.setattr(stagetree.hp, "_canonical_list", per_step)
    assert len(H._chunk.__wrapped__(seq, 0)) == H._CHUNK


def test_first_difference_matches_brute_force() -> None:
    seqs = [s for s in EXAMPLES if not isinstance(s.values(0, 1)[0], str)]
    for a in seqs[:12]:
        for b in seqs[:12]:
            brute = next(
                (t for t in range(0, 2100) if a(t) != b(t) or type(a(t)) is not type(b(t))),
                None,
            )
            assert first_difference(a, b, 0, 2100) == brute, (a, b)


# --------------------------------------------------------------------------- identity


def test_equality_and_hash() -> None:
    assert MultiStep(0.1, [30, 80], 0.1) == MultiStep(0.1, (30, 80), 0.1)
    assert hash(MultiStep(0.1, [30, 80], 0.1)) == hash(MultiStep(0.1, (30, 80), 0.1))
    assert MultiStep(0.1, [30, 80], 0.1).milestones == (30, 80)
    assert Step(1, 10, 1) == Step(1.0, 10, 1.0)  # numeric families store floats
    assert Step(1, 10, 1).init.__class__ is float
    assert Constant(1) == Constant(1.0)  # numbers by value (issue 25)
    assert hash(Constant(1)) == hash(Constant(1.0))
    assert Constant(1) != Constant(True)
    assert Constant(0.1) != Step(0.1, 10, 1.0)
    assert Constant(0.1) != 0.1
    assert len({Constant(1), Constant(1.0), Constant(True), Constant(1)}) == 2
    assert Then(Constant(1), Constant(2), 5) == Then(Constant(1.0), Constant(2), 5)
    assert Constant(1.0).to_json() == {"type": "Constant", "value": 1.0}  # as written
    assert len(set(EXAMPLES)) == len(EXAMPLES)


def _typed(value: Any) -> Any:
    """The identity key's rule as it was first written (nested ``(type, value)`` pairs):
    the reference the flat key must agree with."""
    if type(value) is tuple:
        return tuple(_typed(v) for v in value)
    if type(value) in (int, float, str, bool):
        value = canonical_value(value)
        return (type(value), value)
    return value


def _reference_eq(a: Sequence, b: Sequence) -> bool:
    fields = [tuple(getattr(s, f.name) for f in dataclasses.fields(s)) for s in (a, b)]  # type: ignore[arg-type]
    return type(a) is type(b) and _typed(fields[0]) == _typed(fields[1])


def test_flat_identity_key_agrees_with_typed_pairs() -> None:
    """Equality (and so sharing) is what the nested typed key gave, pair by pair, over
    values that differ by type only (1, 1.0, True, "1"), nested sequences and tuples."""
    seqs = [
        *EXAMPLES,
        Constant(1),
        Constant(1.0),
        Constant(True),
        Constant("1"),
        Constant(0),
        Constant(False),
        Constant(0.0),
        Piecewise([1, True], [3]),
        Piecewise([1.0, 1], [3]),
        Piecewise([1, 1], [3]),
        Piecewise([True, 1], [3]),
        Piecewise([1, 1, 1], [3, 4]),
        MultiStep(1, [3], 1),
        MultiStep(1.0, [3], 1.0),
        MultiStep(1.0, [3, 4], 1.0),
        Then(Constant(1), Constant(2), 5),
        Then(Constant(1.0), Constant(2), 5),
        Then(Constant(True), Constant(2), 5),
        H.Shifted(Constant(1), 2),
        H.Shifted(Constant(1.0), 2),
    ]
    for a in seqs:
        for b in seqs:
            assert (a == b) is _reference_eq(a, b), (a, b)
            if a == b:
                assert hash(a) == hash(b)


def _deep_size(obj: Any) -> int:
    """Bytes of a key: its tuples and the numbers made for it (not shared singletons)."""
    if type(obj) is tuple:
        return sys.getsizeof(obj) + sum(_deep_size(v) for v in obj)
    if type(obj) in (int, float) and not -5 <= obj <= 256:
        return sys.getsizeof(obj)
    return 0


def test_identity_key_is_one_flat_tuple() -> None:
    """A drawn sequence's cached identity key is one tuple of its values (a study keeps
    one per trial): no (type, value) pair per value."""
    seq = MultiStep(0.0123, [32, 48], 0.1)
    hash(seq)
    key = seq.__dict__["_cached_key"]
    assert not any(type(v) is tuple for v in key)
    assert _deep_size(key) <= 200


def test_frozen() -> None:
    seq = Step(0.1, 30, 0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        seq.init = 0.2  # type: ignore[misc]


@pytest.mark.parametrize("seq", EXAMPLES, ids=IDS)
def test_pickle_and_copy(seq: Sequence) -> None:
    hash(seq)  # fills the cached key, which must not travel (str hashes are per process)
    assert "_cached_key" not in seq.__getstate__()
    for clone in (pickle.loads(pickle.dumps(seq)), copy.copy(seq), copy.deepcopy(seq)):
        assert type(clone) is type(seq)
        assert clone == seq
        assert hash(clone) == hash(seq)
        assert clone.values(0, 50) == seq.values(0, 50)


def test_user_family_is_json_loadable_but_cannot_shadow_builtins() -> None:
    @dataclasses.dataclass(frozen=True, eq=False)
    class Doubling(Sequence):
        init: float

        def _value(self, t: int) -> float:
            return self.init * 2**t

    seq = Doubling(1.0)
    assert seq.values(0, 4) == [1.0, 2.0, 4.0, 8.0]
    assert from_json(seq.to_json()) == seq
    assert seq.then(Constant(0.0), 2).values(0, 4) == [1.0, 2.0, 0.0, 0.0]

    # A user class named like a built-in family does not replace it in JSON loading.
    shadow = type("Constant", (Doubling,), {})
    assert shadow.__name__ == "Constant"
    assert type(from_json({"type": "Constant", "value": 3})) is stagetree.hp.Constant


def test_repr_is_readable() -> None:
    assert repr(MultiStep(0.1, [30], 0.1)) == "MultiStep(init=0.1, milestones=(30,), gamma=0.1)"


def test_as_sequence() -> None:
    seq = Cosine(0.1, 10)
    assert as_sequence(seq) is seq
    assert as_sequence(0.1) == Constant(0.1)
    assert as_sequence(32) == Constant(32)
    assert as_sequence("adam") == Constant("adam")
    assert as_sequence(False) == Constant(False)
    for bad in ([0.1], None, {"a": 1}, object(), float("nan")):
        with pytest.raises(InvalidSequenceError):
            as_sequence(bad)
    with pytest.raises(InvalidSequenceError, match="template"):
        as_sequence(H.Constant(Uniform(0.0, 1.0)))


# --------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("seq", EXAMPLES, ids=IDS)
def test_json_round_trip(seq: Sequence) -> None:
    data = seq.to_json()
    assert data["type"] == type(seq).__name__
    text = json.dumps(data, allow_nan=False)
    back = from_json(json.loads(text))
    assert back == seq
    assert type(back) is type(seq)
    assert back.values(0, 40) == seq.values(0, 40)


def test_json_shapes() -> None:
    assert MultiStep(0.1, [30], 0.1).to_json() == {
        "type": "MultiStep",
        "init": 0.1,
        "milestones": [30],
        "gamma": 0.1,
    }
    assert Piecewise([1, "a"], [3]).to_json() == {
        "type": "Piecewise",
        "values": [1, "a"],
        "milestones": [3],
    }
    assert Constant(1.0).then(2, 3).to_json()["second"] == {"type": "Constant", "value": 2}


def test_dumps_loads_hp() -> None:
    hp: dict[str, Any] = {
        "lr": Warmup(5, 0.1).then(Cosine(0.1, 95), 5),
        "bs": Constant(32),
        "opt": "sgd",
    }
    text = dumps_hp(hp)
    assert json.loads(text) == json.loads(dumps_hp(dict(reversed(list(hp.items())))))
    assert text == dumps_hp(dict(reversed(list(hp.items()))))  # canonical
    assert " " not in text
    assert list(json.loads(text)) == ["bs", "lr", "opt"]
    back = loads_hp(text)
    assert back == {"lr": hp["lr"], "bs": Constant(32), "opt": Constant("sgd")}
    assert type(back["bs"].values(0, 1)[0]) is int
    assert dumps_hp({}) == "{}"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"value": 1}, "type"),
        ({"type": "Nope", "value": 1}, "unknown"),
        ({"type": "Constant", "value": 1, "extra": 2}, "extra"),
        ({"type": "Step", "init": 0.1}, "Step"),
        ({"type": "MultiStep", "init": 0.1, "milestones": [5, 3], "gamma": 0.1}, "milestones"),
        ([1, 2], "type"),
    ],
)
def test_from_json_errors(data: Any, match: str) -> None:
    with pytest.raises(InvalidSequenceError, match=match):
        from_json(data)


@pytest.mark.parametrize("seq", EXAMPLES, ids=IDS)
def test_from_json_of_plain_json_skips_the_template_check(
    seq: Sequence, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding stored sequences (100,000 in a large study's trials) never looks for a
    distribution among arguments that JSON cannot hold one in, and builds what the
    constructor builds."""

    def no_check(value: Any) -> bool:
        raise AssertionError("looked for a distribution in plain JSON")

    monkeypatch.setattr(stagetree.hp, "_is_random", no_check)
    back = from_json(json.loads(json.dumps(seq.to_json())))
    assert type(back) is type(seq) and back == seq and repr(back) == repr(seq)


def test_from_json_of_a_constant_is_the_checked_constant() -> None:
    for value in (0.25, -0.0, 0.0, 3, -7, True, False, "adam", "", 1e300):
        back = from_json({"type": "Constant", "value": value})
        built = Constant(value)
        assert type(back) is Constant and repr(back) == repr(built)
        assert type(back.value) is type(built.value) and back == built
    assert math.copysign(1.0, from_json({"type": "Constant", "value": -0.0}).value) == 1.0
    for bad in (math.nan, math.inf, None, [1], {"a": 1}):
        with pytest.raises(InvalidSequenceError):
            from_json({"type": "Constant", "value": bad})


def test_loads_hp_errors() -> None:
    with pytest.raises(InvalidSequenceError):
        loads_hp("[1, 2]")
    with pytest.raises(InvalidSequenceError):
        dumps_hp({"lr": [0.1]})  # type: ignore[dict-item]
    with pytest.raises(InvalidSequenceError):
        dumps_hp({1: Constant(0.1)})  # type: ignore[dict-item]


# --------------------------------------------------------------------------- templates


def test_template_from_distribution() -> None:
    tmpl = H.MultiStep(init=LogUniform(1e-3, 0.3), milestones=Choice([[30, 45], [40]]), gamma=0.1)
    assert isinstance(tmpl, SequenceTemplate)
    assert not isinstance(tmpl, Sequence)
    assert tmpl.is_template and not Constant(1).is_template
    assert tmpl.family is MultiStep
    seq = tmpl.sample(random.Random(0))
    assert isinstance(seq, MultiStep)
    assert 1e-3 <= seq.init <= 0.3
    assert seq.milestones in ((30, 45), (40,))
    assert seq.gamma == 0.1
    # Reproducible from a seed; different seeds give different trials.
    assert tmpl.sample(random.Random(0)) == seq
    draws = {tmpl.sample(random.Random(s)) for s in range(20)}
    assert len(draws) == 20
    assert {d.milestones for d in draws if isinstance(d, MultiStep)} == {(30, 45), (40,)}
    assert "LogUniform" in repr(tmpl)


def test_template_positional_and_nested() -> None:
    tmpl = H.Piecewise([IntUniform(16, 64), 128], [10])  # distribution inside a list
    assert isinstance(tmpl, SequenceTemplate)
    seq = tmpl.sample(random.Random(3))
    assert isinstance(seq, Piecewise)
    first = seq(0)
    assert type(first) is int and 16 <= first <= 64
    assert seq(10) == 128
    step = H.Step(Uniform(0.01, 0.1), 30)
    assert isinstance(step.sample(random.Random(1)), Step)


def test_template_then() -> None:
    warm = H.Warmup(5, LogUniform(0.01, 0.1))
    tmpl = warm.then(Cosine(0.1, 95), 5)
    assert isinstance(tmpl, SequenceTemplate)
    assert tmpl.family is Then
    seq = tmpl.sample(random.Random(7))
    assert isinstance(seq, Then) and isinstance(seq.first, Warmup)
    assert seq == tmpl.sample(random.Random(7))
    # A random switch step, and a concrete sequence followed by a template.
    tmpl2 = H.Constant(0.1).then(H.Cosine(Uniform(0.01, 0.1), 10), at=IntUniform(5, 9))
    assert isinstance(tmpl2, SequenceTemplate)
    seq2 = tmpl2.sample(random.Random(1))
    assert isinstance(seq2, Then) and 5 <= seq2.at <= 9
    # Choice among whole sequences is a distribution, not a template.
    choice = Choice([Constant(0.1), Cosine(0.1, 10)])
    assert choice.sample(random.Random(0)) in (Constant(0.1), Cosine(0.1, 10))


def test_template_pickles() -> None:
    tmpl = H.MultiStep(LogUniform(1e-3, 0.3), [30], 0.1)
    clone = pickle.loads(pickle.dumps(tmpl))
    assert clone == tmpl
    assert clone.sample(random.Random(5)) == tmpl.sample(random.Random(5))


def test_template_validation() -> None:
    with pytest.raises(InvalidSequenceError, match="MultiStep"):
        H.MultiStep(init=Uniform(0.0, 1.0), milestons=[3])  # misspelt argument
    bad = H.MultiStep(init=Uniform(0.0, 1.0), milestones=Choice([[45, 30]]), gamma=0.1)
    with pytest.raises(InvalidSequenceError, match="milestones"):
        bad.sample(random.Random(0))  # validated when sampled


# --------------------------------------------------------------------------- validation


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: H.Constant(None), "Constant.value"),
        (lambda: H.Constant([0.1]), "Constant.value"),
        (lambda: H.Constant({"a": 1}), "Constant.value"),
        (lambda: H.Constant(object()), "Constant.value"),
        (lambda: H.Constant(NAN), "Constant.value"),
        (lambda: H.Constant(INF), "Constant.value"),
        (lambda: H.Step(0.1, 0, 0.1), "step_size"),
        (lambda: H.Step(0.1, -3, 0.1), "step_size"),
        (lambda: H.Step(0.1, 2.0, 0.1), "step_size"),
        (lambda: H.Step(0.1, True, 0.1), "step_size"),
        (lambda: H.Step(NAN, 10, 0.1), "Step.init"),
        (lambda: H.Step(0.1, 10, "0.1"), "Step.gamma"),
        (lambda: H.Step(0.1, 10, None), "Step.gamma"),
        (lambda: H.Step(True, 10, 0.1), "Step.init"),
        (lambda: H.MultiStep(0.1, [30, 20], 0.1), "MultiStep.milestones"),
        (lambda: H.MultiStep(0.1, [30, 30], 0.1), "MultiStep.milestones"),
        (lambda: H.MultiStep(0.1, [-1], 0.1), r"MultiStep.milestones\[0\]"),
        (lambda: H.MultiStep(0.1, [1.5], 0.1), r"MultiStep.milestones\[0\]"),
        (lambda: H.MultiStep(0.1, 30, 0.1), "MultiStep.milestones"),
        (lambda: H.MultiStep(0.1, "30", 0.1), "MultiStep.milestones"),
        (lambda: H.MultiStep(0.1, [30], INF), "MultiStep.gamma"),
        (lambda: H.Exponential(0.1, NAN), "Exponential.gamma"),
        (lambda: H.Exponential("0.1", 0.9), "Exponential.init"),
        (lambda: H.Cosine(0.1, 0), "Cosine.t_max"),
        (lambda: H.Cosine(0.1, -5), "Cosine.t_max"),
        (lambda: H.Cosine(0.1, "10"), "Cosine.t_max"),  # a float period is fine (issue 25)
        (lambda: H.Cosine(0.1, 10, NAN), "Cosine.eta_min"),
        (lambda: H.CosineWarmRestarts(0.1, 0), "t_0"),
        (lambda: H.CosineWarmRestarts(0.1, 10, 0), "t_mult"),
        (lambda: H.CosineWarmRestarts(0.1, 10, 1.5), "t_mult"),
        (lambda: H.Linear(0.0, 1.0, -1), "Linear.steps"),
        (lambda: H.Linear(0.0, INF, 10), "Linear.end"),
        (lambda: H.Linear(0.0, 1.0, 2.5), "Linear.steps"),
        (lambda: H.Cyclic(0.0, 1.0, 0), "step_size_up"),
        (lambda: H.Cyclic(0.0, 1.0, 5, 0), "step_size_down"),
        (lambda: H.Cyclic(0.0, 1.0, 5, mode="sine"), "Cyclic.mode"),
        (lambda: H.Cyclic(0.0, 1.0, 5, gamma="x"), "Cyclic.gamma"),
        (lambda: H.Cyclic(NAN, 1.0, 5), "Cyclic.base"),
        (lambda: H.OneCycle(0.1, 0), "total_steps"),
        (lambda: H.OneCycle(0.1, 100, 0.0), "pct_start"),
        (lambda: H.OneCycle(0.1, 100, 1.0), "pct_start"),
        (lambda: H.OneCycle(0.1, 100, 1.5), "pct_start"),
        (lambda: H.OneCycle(0.1, 100, anneal="cosine"), "anneal"),
        (lambda: H.OneCycle(0.1, 100, div_factor=0.0), "div_factor"),
        (lambda: H.OneCycle(0.1, 100, final_div_factor=-1.0), "final_div_factor"),
        (lambda: H.OneCycle(INF, 100), "OneCycle.max"),
        (lambda: H.Warmup(-1, 0.1), "Warmup.steps"),
        (lambda: H.Warmup(5, NAN), "Warmup.target"),
        (lambda: H.Piecewise([1, 2], [5, 6]), "len"),
        (lambda: H.Piecewise([1, 2, 3], [5]), "len"),
        (lambda: H.Piecewise([1, None], [5]), r"Piecewise.values\[1\]"),
        (lambda: H.Piecewise([1, [2]], [5]), r"Piecewise.values\[1\]"),
        (lambda: H.Piecewise([1.0, NAN], [5]), r"Piecewise.values\[1\]"),
        (lambda: H.Piecewise([1, 2], [-5]), "Piecewise.milestones"),
        (lambda: H.Piecewise([1, 2, 3], [6, 5]), "Piecewise.milestones"),
        (lambda: H.Piecewise("ab", [1]), "Piecewise.values"),
        (lambda: H.Then(Constant(1), Constant(2), -1), "Then.at"),
        (lambda: H.Then(Constant(1), Constant(2), 1.0), "Then.at"),
        (lambda: H.Then(Constant(1), [2], 3), "Then.second"),
        (lambda: H.Constant(1).then(None, 3), "Then.second"),
    ],
)
def test_validation_errors(make: Any, match: str) -> None:
    with pytest.raises(InvalidSequenceError, match=match):
        make()


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        Step(0.1, 0, 0.1)


def test_negative_zero_is_normalised() -> None:
    assert math.copysign(1.0, Constant(-0.0).value) == 1.0  # type: ignore[arg-type]
    assert Constant(-0.0).to_json() == Constant(0.0).to_json()


# --------------------------------------------------------------------------- issue 25


def test_cosine_takes_a_period_that_is_not_a_whole_number_of_steps() -> None:
    seq = Cosine(1.0, 2.5)
    expected = [(1 + math.cos(math.pi * t / 2.5)) / 2 for t in range(12)]
    assert seq.values(0, 12) == [canonical_value(v) for v in expected]
    assert seq(5) == 1 and seq(10) == 1  # back at init every 2 * t_max = 5 steps
    assert from_json(json.loads(json.dumps(seq.to_json()))) == seq
    assert seq.to_json()["t_max"] == 2.5
    assert Cosine(0.1, 50).to_json()["t_max"] == 50  # a whole number stays as written
    assert Cosine(0.1, 50) == Cosine(0.1, 50.0)
    for bad in (0, 0.0, -1.5, True, math.inf):
        with pytest.raises(InvalidSequenceError, match="t_max"):
            H.Cosine(0.1, bad)


def test_linear_keeps_its_slope_past_the_end_when_asked() -> None:
    held, kept = Linear(0.0, 1.0, 10), Linear(0.0, 1.0, 10, extend=True)
    assert held.values(8, 13) == [0.8, 0.9, 1, 1, 1]
    assert kept.values(8, 13) == [0.8, 0.9, 1, 1.1, 1.2]
    assert kept(20) == 2 and Linear(1.0, 0.5, 4, extend=True)(6) == 0.25
    assert first_difference(held, kept, 0, 20) == 11
    # The default leaves the JSON as it was; extend=True round-trips.
    assert "extend" not in held.to_json()
    assert kept.to_json()["extend"] is True
    assert from_json(kept.to_json()) == kept and from_json(held.to_json()) == held
    assert held == Linear(0.0, 1.0, 10, extend=False) != kept
    with pytest.raises(InvalidSequenceError, match="steps >= 1"):
        Linear(0.0, 1.0, 0, extend=True)
    with pytest.raises(InvalidSequenceError, match="extend"):
        H.Linear(0.0, 1.0, 3, extend=1)
