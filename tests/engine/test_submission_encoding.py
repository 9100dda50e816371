"""A submission's JSON texts (its config's check, its tuner's log records, the plan's
copies) are encoded without building an encoder per call, with the same texts and the
same refusals as ``json.dumps``."""

from __future__ import annotations

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
