"""What the memory plan does per trial: a root registered again (every submission does)
compares texts, without encoding the stored config again or decoding the new one; a
request read or written comes back as a copy made field by field."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from stagetree.exceptions import StorageError
from stagetree.hp import Constant, dumps_hp
from stagetree.plan import _codec, memory
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.model import Request, RequestState


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


def test_a_request_comes_back_as_a_detached_copy_of_every_field() -> None:
    # The copy names the fields: a field added to Request must be copied too.
    names = tuple(f.name for f in dataclasses.fields(Request))
    assert names == ("node", "step", "refcount", "state", "error")
    req = Request(3, 7, 2, RequestState.FAILED, "boom")
    copy = memory._copy_request(req)
    assert copy == dataclasses.replace(req) and copy is not req
    storage = MemoryPlanStorage()
    storage.register_root("r", {})
    ins = storage.insert_trial("r", {"lr": Constant(0.1)}, 4)
    added = storage.request(ins.node, ins.step)
    assert added is not None and (added.refcount, added.state) == (1, RequestState.PENDING)
    added.refcount = 99  # a copy: the stored request is not changed
    failed = storage.set_request_state(ins.node, ins.step, RequestState.FAILED, error="x")
    assert (failed.refcount, failed.state, failed.error) == (1, RequestState.FAILED, "x")
    failed.error = "changed"
    [stored] = storage.requests("r")
    assert stored == Request(ins.node, ins.step, 1, RequestState.FAILED, "x")


def test_a_trial_with_its_texts_is_stored_without_encoding_its_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = MemoryPlanStorage()
    storage.create_study("s", {})
    config = {"bs": 64, "opt": {"name": "sgd", "betas": (0.9, 0.99)}}
    hp = {"lr": Constant(0.1)}
    texts = (_codec.dumps(config), dumps_hp(hp))
    encoded: list[str] = []
    real_dumps = _codec.dumps

    def dumps(value: object, what: str = "value") -> str:
        encoded.append(what)
        return real_dumps(value, what)

    monkeypatch.setattr(_codec, "dumps", dumps)
    tid = storage.add_trial("s", "r", config, hp, 4, None, None, encoded=texts)
    assert "trial config" not in encoded  # on main: encoded again to copy it
    row = storage.trial(tid)
    assert row["config"] == {"bs": 64, "opt": {"name": "sgd", "betas": [0.9, 0.99]}}
    row["config"]["opt"]["name"] = "adam"  # a copy: the stored row is its own
    assert storage.trial(tid)["config"]["opt"]["name"] == "sgd"
    again = storage.add_trial("s", "r", dict(config), hp, 4, None, None, unique=True)
    assert again == tid  # the same identity as the texts given


def _kept_per_trial(storage: MemoryPlanStorage, n: int, paths: bool = False) -> float:
    """Container objects the storage keeps per trial added (garbage collected first);
    with ``paths``, each trial's path inserted first, as a submission does."""
    storage.create_study("s", {})
    root = "r"
    storage.register_root(root, {"bs": 64})
    config, attrs = {"bs": 64, "opt": {"name": "sgd"}}, {"version": "v1"}

    def add(first: int, count: int) -> None:
        for i in range(first, first + count):
            hp = {"lr": Constant(i)}
            node = step = None
            if paths:
                ins = storage.insert_trial(root, hp, 4, request=False)
                node, step = ins.node, ins.step
            storage.add_trial("s", root, config, hp, 4, node, step, attrs=attrs)

    add(0, n)
    gc.collect()
    before = len(gc.get_objects())
    add(n, n)
    gc.collect()
    return (len(gc.get_objects()) - before) / n


def test_trials_of_one_config_and_attrs_share_their_stored_values() -> None:
    # The row and its hp mapping a trial (and its own Constant): the config and attrs
    # decoded once for all trials that store the same text. On main: 4 (its config a
    # trial; the collector does not track a dict of plain values such as these attrs).
    storage = MemoryPlanStorage()
    assert _kept_per_trial(storage, 200) <= 3.1
    # Rows still read as detached copies, and an update replaces one row's attrs only.
    first, second = storage.trials("s")[:2]
    assert first["config"] == {"bs": 64, "opt": {"name": "sgd"}} == second["config"]
    first["config"]["opt"]["name"] = "adam"
    first["attrs"]["version"] = "v0"
    again = storage.trial(first["id"])
    assert again["config"]["opt"]["name"] == "sgd" and again["attrs"] == {"version": "v1"}
    storage.update_trial(first["id"], attrs={"version": "v2", "n": 1})
    assert storage.trial(first["id"])["attrs"] == {"version": "v2", "n": 1}
    assert storage.trial(second["id"])["attrs"] == {"version": "v1"}
    ends = {end.id: end for end in storage.trial_ends("s")}
    assert dict(ends[second["id"]].attrs) == {"version": "v1"}


def test_a_trial_row_shares_its_nodes_hp_mapping() -> None:
    # A trial whose insertion made its node keeps one hp mapping (the node's), not two.
    storage = MemoryPlanStorage()
    before_rows = _kept_per_trial(MemoryPlanStorage(), 200)
    # Its path adds the node, its key among its siblings and one hp mapping: on main 3.2.
    assert _kept_per_trial(storage, 200, paths=True) - before_rows <= 2.5
    row = storage.trials("s")[-1]
    node = storage.node(row["node"])
    assert row["hp"] == node.hp and row["hp"] is not node.hp  # read as a copy
