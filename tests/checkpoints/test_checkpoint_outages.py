"""Object-store outages (moto's S3 behind s3fs, reached through a proxy the tests cut):
writes and reads ride through a short outage; past the ride-through window a trial is
never reported finished without its final checkpoint, and a checkpoint that could not
be *loaded* keeps its plan record (only a missing or corrupt object is dropped)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Service
from study_trainers import SlowLinearTrainer
from tcp_proxy import TCPProxy

from stagetree import Study
from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import CheckpointError, CheckpointUnreachableError, TrialFailedError
from stagetree.hp import Constant, MultiStep
from stagetree.plan import SQLPlanStorage
from stagetree.retry import STORE_RETRY_ENV

LRS = [Constant(0.05), MultiStep(0.05, [20], 0.5), MultiStep(0.05, [40], 0.5)]
STEPS = 60  # 20 ms steps


@pytest.fixture
def proxy(s3: S3Service, monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPProxy]:
    import s3fs

    # s3fs and botocore retry by themselves for about 30 s: once each here, so that
    # the store's own ride-through window is what the tests measure.
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    host, port = s3.endpoint.removeprefix("http://").split(":")
    proxy = TCPProxy((host, int(port)))
    yield proxy
    proxy.close()


def _store(s3: S3Service, proxy: TCPProxy, prefix: str, **kw: Any) -> CheckpointStore:
    options = {
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    return CheckpointStore(s3.url(prefix), cache_bytes=0, storage_options=options, **kw)


# -- the store --------------------------------------------------------------------------


def test_a_write_and_a_read_ride_through_a_short_outage(s3: S3Service, proxy: TCPProxy) -> None:
    store = _store(s3, proxy, "short", retry_seconds=30)
    proxy.cut_for(3.0)
    info = store.save("a", {"w": [1.0, 2.0]})
    proxy.cut_for(3.0)
    assert store.load(info.ref) == {"w": [1.0, 2.0]}


def test_past_the_window_a_read_is_unreachable_not_missing(s3: S3Service, proxy: TCPProxy) -> None:
    store = _store(s3, proxy, "long", retry_seconds=1.0)
    info = store.save("a", {"w": 1})
    proxy.cut()
    with pytest.raises(CheckpointUnreachableError, match="unreachable for"):
        store.load(info.ref)
    with pytest.raises(CheckpointError, match="unreachable for") as failed:
        store.save("b", {"w": 2})
    assert not isinstance(failed.value, CheckpointUnreachableError)
    proxy.restore()
    with pytest.raises(CheckpointError, match="does not exist") as missing:
        store.load("b.ckpt")
    assert not isinstance(missing.value, CheckpointUnreachableError)
    assert store.load(info.ref) == {"w": 1}


# -- a study ----------------------------------------------------------------------------


def _study(tmp_path: Path, store: CheckpointStore, name: str = "s") -> Study:
    return Study(
        name,
        SlowLinearTrainer,
        storage=f"sqlite:///{tmp_path / 'plan.db'}",
        checkpoint_dir=store,
        executor="inline",
    )


def _run_all(study: Study, steps: int = STEPS) -> list[dict[str, float]]:
    async def go() -> list[Any]:
        return await asyncio.gather(*(study.submit({"seed": 3}, {"lr": lr}, steps) for lr in LRS))

    return [r.metrics for r in study._drive(go())]


def _expected(tmp_path: Path, steps: int = STEPS) -> list[dict[str, float]]:
    store = CheckpointStore(tmp_path / "expected")
    with Study(
        "e", SlowLinearTrainer, storage="memory://", checkpoint_dir=store, executor="inline"
    ) as study:
        return _run_all(study, steps)


def _states(study: Study, steps: int = STEPS) -> list[Any]:
    return [study.state({"seed": 3}, {"lr": lr}, steps) for lr in LRS]


@pytest.mark.parametrize(
    ("window", "outage"),
    [(30.0, 3.0), (0.5, 4.0)],
    ids=["short-outage-ridden-through", "outage-past-the-window"],
)
def test_no_trial_is_reported_without_its_final_checkpoint(
    tmp_path: Path, s3: S3Service, proxy: TCPProxy, window: float, outage: float
) -> None:
    # Within the window the writes wait for the store; past it, a trial whose final
    # checkpoint could not be written stays pending and is trained again, and is
    # reported once its model is stored.
    expected = _expected(tmp_path)
    with _study(tmp_path, _store(s3, proxy, f"study-{window}", retry_seconds=window)) as study:
        study.open()
        threading.Timer(0.3, proxy.cut_for, args=(outage,)).start()
        assert _run_all(study) == expected
        assert all(state is not None for state in _states(study))
        assert [t.state for t in study.trials()] == ["done"] * len(LRS)


def test_a_checkpoint_that_cannot_be_loaded_keeps_its_plan_record(
    tmp_path: Path, s3: S3Service, proxy: TCPProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STORE_RETRY_ENV, "0.5")
    store = _store(s3, proxy, "load")
    with _study(tmp_path, store) as study:
        short = _run_all(study, 20)
    with SQLPlanStorage(f"sqlite:///{tmp_path / 'plan.db'}") as plan:
        before = {key: rec.ref for key, rec in plan.checkpoints().items()}
    assert before
    # Extending the trials loads their checkpoints at step 20 while the store is down.
    with _study(tmp_path, store) as study:
        study.open()
        proxy.cut_for(3.0)
        assert _run_all(study, 30) == _expected(tmp_path, 30)
        assert _run_all(study, 20) == short
    with SQLPlanStorage(f"sqlite:///{tmp_path / 'plan.db'}") as plan:
        after = {key: rec.ref for key, rec in plan.checkpoints().items()}
    # Every point keeps a checkpoint (the same, or the same model stored again when
    # the store could not even be asked whether it held it) that loads.
    assert set(before) <= set(after)
    assert all(store.load(ref) for ref in after.values())


class _UnreachableOnce(CheckpointStore):
    """A local store whose next load fails as an unreachable store does."""

    fail_next = False

    def load(self, ref: str, map_location: Any = "cpu", **kw: Any) -> dict[str, Any]:
        if _UnreachableOnce.fail_next:
            _UnreachableOnce.fail_next = False
            raise CheckpointUnreachableError(f"cannot read checkpoint {ref}: store down")
        return super().load(ref, map_location, **kw)


def test_an_unreachable_load_recomputes_without_dropping_the_record(tmp_path: Path) -> None:
    store = _UnreachableOnce(tmp_path / "ckpt")
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    hp = {"lr": Constant(0.05)}
    with Study("u", SlowLinearTrainer, storage=url, checkpoint_dir=store, executor="inline") as st:
        st.run({"seed": 3}, hp, 10)
    with SQLPlanStorage(url) as plan:
        before = {key: rec.ref for key, rec in plan.checkpoints().items()}
    _UnreachableOnce.fail_next = True
    with Study("u", SlowLinearTrainer, storage=url, checkpoint_dir=store, executor="inline") as st:
        longer = st.run({"seed": 3}, hp, 15).metrics  # a fresh worker loads step 10
    assert not _UnreachableOnce.fail_next  # the start checkpoint was asked for
    with SQLPlanStorage(url) as plan:
        after = {key: rec.ref for key, rec in plan.checkpoints().items()}
    assert before.items() <= after.items()
    with Study("v", SlowLinearTrainer, storage="memory://", executor="inline") as fresh:
        assert fresh.run({"seed": 3}, hp, 15).metrics == longer


class _WritesFail(CheckpointStore):
    """A local store whose writes fail while ``down`` (an unreachable store past its
    ride-through window)."""

    down = False

    def save(self, name: str, state: Any, of: Any = None) -> Any:
        if _WritesFail.down:
            raise CheckpointError(f"cannot write checkpoint {name}: store down")
        return super().save(name, state, of)


def test_metrics_whose_checkpoint_was_never_stored_do_not_answer_a_later_run(
    tmp_path: Path,
) -> None:
    """Found by benchmarks/chaos.py: the metrics of a request were written to the plan
    as soon as they were reported, before its promised checkpoint was durable; when that
    write failed and the run ended (killed, or failed), the next run answered the trial
    from those metrics and reported it finished with no model stored."""
    store = _WritesFail(tmp_path / "ckpt")
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    hp = {"lr": Constant(0.05)}
    _WritesFail.down = True
    first = Study("w", SlowLinearTrainer, storage=url, checkpoint_dir=store, executor="inline")
    with first, pytest.raises(TrialFailedError, match="could not be stored"):
        first.run({"seed": 3}, hp, 10)
    _WritesFail.down = False
    with Study("w", SlowLinearTrainer, storage=url, checkpoint_dir=store, executor="inline") as st:
        metrics = st.run({"seed": 3}, hp, 10).metrics
        assert st.state({"seed": 3}, hp, 10) is not None  # its model is stored
    with Study("v", SlowLinearTrainer, storage="memory://", executor="inline") as fresh:
        assert fresh.run({"seed": 3}, hp, 10).metrics == metrics


def test_an_engine_made_again_during_an_outage_waits_for_the_store(
    tmp_path: Path, s3: S3Service, proxy: TCPProxy
) -> None:
    """Found by benchmarks/chaos.py: the engine that replaces one stopped on an error
    proved the store with a probe write that was not ridden through, so a store cut at
    that moment failed the run although every write would have waited the cut out."""
    store = _store(s3, proxy, "again", retry_seconds=30)
    hp = {"lr": LRS[1]}
    with _study(tmp_path, store) as study:
        study.run({"seed": 3}, hp, 10)
        assert study._engine_obj is not None
        study._engine_obj.error = RuntimeError("stopped")  # the next call makes another
        proxy.cut_for(3.0)
        longer = study.run({"seed": 3}, hp, 20).metrics
        assert study.state({"seed": 3}, hp, 20) is not None
    with Study("v", SlowLinearTrainer, storage="memory://", executor="inline") as fresh:
        assert fresh.run({"seed": 3}, hp, 20).metrics == longer
