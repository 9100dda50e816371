"""The memory plan keeps each root's config as its canonical text: registering the root
again (every submission does) compares texts, without encoding the stored config again
or decoding the new one."""

from __future__ import annotations

import pytest

from stagetree.exceptions import StorageError
from stagetree.plan import _codec
from stagetree.plan.memory import MemoryPlanStorage


def test_registering_a_root_again_encodes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = MemoryPlanStorage()
    config = {"bs": 64, "opt": {"name": "sgd", "betas": [0.9, 0.99]}, "x": float("nan")}
    storage.register_root("r", config)
    calls = {"dumps": 0, "loads": 0}
    real_dumps, real_loads = _codec.dumps, _codec.loads

    def dumps(value: object, what: str = "value") -> str:
        calls["dumps"] += 1
        return real_dumps(value, what)

    def loads(text: str) -> object:
        calls["loads"] += 1
        return real_loads(text)

    monkeypatch.setattr(_codec, "dumps", dumps)
    monkeypatch.setattr(_codec, "loads", loads)
    for _ in range(5):
        storage.register_root("r", dict(config))
    assert calls == {"dumps": 5, "loads": 0}  # on main: 10 and 5 (the stored one again)
    # What it reads back: a fresh copy of the config, as before.
    got = storage.root_config("r")
    assert got["bs"] == 64 and got["opt"] == config["opt"] and got["x"] != got["x"]
    got["opt"]["name"] = "adam"
    assert storage.root_config("r")["opt"]["name"] == "sgd"
    assert storage.root_keys() == ["r"]


@pytest.mark.parametrize("other", [{"bs": 64.0}, {"bs": True}, {"bs": 65}, {}])
def test_another_config_for_a_root_is_refused(other: dict[str, object]) -> None:
    # Text equality, as the stored config's encoding compared before: 64 and 64.0 differ.
    storage = MemoryPlanStorage()
    storage.register_root("r", {"bs": 64})
    with pytest.raises(StorageError, match="another config"):
        storage.register_root("r", other)
    assert storage.root_config("r") == {"bs": 64}
