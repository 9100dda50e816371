"""A submission's JSON texts (its config's check, its tuner's log records, the plan's
copies) are encoded without building an encoder per call, with the same texts and the
same refusals as ``json.dumps``."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.exceptions import InvalidTrialError
from stagetree.hp import Constant
from stagetree.plan import _codec
from stagetree.space import strict_json
from stagetree.tuners.base import _json

VALUES: list[Any] = [
    {},
    {"b": 1, "a": [1.5, "x", None, True], "c": {"z": 0, "y": (1, 2)}},
    [1, 2.0, "é"],
]


@pytest.fixture
def no_new_encoders(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fails the calls that build a ``json.JSONEncoder`` (what ``json.dumps`` with
    arguments does each call); yields what built one."""
    built: list[str] = []
    init = json.JSONEncoder.__init__

    def counting(self: json.JSONEncoder, *args: Any, **kwargs: Any) -> None:
        built.append(repr(kwargs))
        init(self, *args, **kwargs)

    monkeypatch.setattr(json.JSONEncoder, "__init__", counting)
    yield built


@pytest.mark.parametrize("value", VALUES)
def test_codec_and_strict_texts_are_json_dumps_texts(
    value: Any, no_new_encoders: list[str]
) -> None:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    strict = json.dumps(value, allow_nan=False)
    plain = json.loads(json.dumps(value))
    no_new_encoders.clear()
    assert _codec.dumps(value) == canonical
    assert _codec.copy(value) == plain
    assert strict_json(value) == strict
    if isinstance(value, dict):
        assert _json(value) == plain
    assert no_new_encoders == []


def test_refusals_are_json_dumps_refusals(no_new_encoders: list[str]) -> None:
    assert _codec.dumps({"x": math.nan}) == '{"x":NaN}'  # the plan holds NaN metrics
    with pytest.raises(ValueError, match="record is not JSON-serialisable"):
        _codec.dumps({"x": object()}, "record")
    with pytest.raises(ValueError):
        strict_json({"x": math.inf})
    with pytest.raises(TypeError):
        strict_json({"x": object()})
    with pytest.raises(ValueError):
        _json({"x": math.nan})
    assert no_new_encoders == []


def test_checking_a_trial_builds_no_encoder(no_new_encoders: list[str]) -> None:
    with Study("enc", LinearTrainer, storage="memory://", executor="simulated") as study:
        study.open()
        no_new_encoders.clear()
        study.check({"seed": 1}, {"lr": Constant(0.1)})
        with pytest.raises(InvalidTrialError, match="cannot be a fixed configuration"):
            study.check({"seed": math.nan}, {"lr": Constant(0.1)})
        assert no_new_encoders == []


class Level(enum.IntEnum):
    LOW = 1


SCALAR_RECORDS: list[dict[Any, Any]] = [
    {"event": "submit", "key": 3, "trial": 1, "steps": 8, "fp": "0123abcd"},
    {"event": "done", "key": 3, "status": "ok"},
    {"event": "stop", "value": -0.0, "big": 2**70, "flag": True, "none": None, "x": 1e-300},
]
OTHER_RECORDS: list[dict[Any, Any]] = [
    {"event": "exploit", "hp": [1, 2], "pair": (1, 2)},
    {"event": "x", "nested": {"a": (1,)}},
    {1: "an int key"},
    {"level": Level.LOW},
]


@pytest.mark.parametrize("record", SCALAR_RECORDS)
def test_a_record_of_plain_scalars_is_copied_without_a_json_round_trip(
    record: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = json.loads(json.dumps(record))

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a JSON round trip")

    monkeypatch.setattr(json, "loads", refuse)
    out = _json(record)
    assert out == expected and out is not record
    assert [type(v) for v in out.values()] == [type(v) for v in expected.values()]
    if "value" in out:
        assert repr(out["value"]) == "-0.0"


@pytest.mark.parametrize("record", OTHER_RECORDS)
def test_other_records_come_back_as_json_has_them(record: dict[Any, Any]) -> None:
    expected = json.loads(json.dumps(record))
    out = _json(record)
    assert out == expected
    assert [type(v) for v in out.values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_record_with_a_non_finite_number_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="JSON compliant"):
        _json({"event": "stop", "value": bad})
