"""Worker processes kept alive for the next LocalExecutor of the same process (the pool):
reuse, a fresh Worker per lease, dead pooled processes, expiry, shutdown, exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_local_executor import HP, Counter, _batch, _ended, _of, _until

from stagetree import Study
from stagetree.executors import LocalExecutor
from stagetree.executors.local import pooled_pids, shutdown_pool
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace
from stagetree.tuners import ASHA
from stagetree.work import (
    BatchDone,
    BatchFailed,
    MetricsReported,
    Progress,
    RunBatch,
    Segment,
    WorkerReady,
)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _gone(pids: set[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(autouse=True)
def _empty_pool() -> Iterator[None]:
    shutdown_pool()
    yield
    shutdown_pool()


def _ready(ex: LocalExecutor) -> None:
    _until(ex, lambda ev: len(_of(ev, WorkerReady)) >= ex.num_workers)


def _continuation(batch_id: int, worker: int) -> RunBatch:
    """Steps 3..6 of ``_batch(_, _, 3)``'s model, without a start checkpoint: only a
    worker holding that model in memory can train it."""
    return RunBatch(
        batch_id=batch_id,
        worker=worker,
        root_key="r",
        config={},
        start_step=3,
        start_at=(1, 3),
        start_checkpoint=None,
        segments=(Segment(1, 3, 6, HP),),
        evaluate_at=((1, 6),),
        checkpoint_at=(),
    )


def _total(ex: LocalExecutor, batch: RunBatch) -> float:
    ex.submit(batch)
    events = _until(ex, _ended({batch.batch_id}))
    assert _of(events, BatchDone), events
    [metrics] = _of(events, MetricsReported)
    return float(metrics.metrics["total"])


def test_the_next_executor_reuses_the_processes_with_a_fresh_worker(tmp_path: Path) -> None:
    first = LocalExecutor(Counter, 2, checkpoint_dir=tmp_path / "a", devices=[])
    first.start()
    _ready(first)
    pids = [first.pid(0), first.pid(1)]
    fresh = _total(first, _batch(1, 0, 3, evaluate_at=((1, 3),)))
    continued = _total(first, _continuation(2, 0))  # in memory, within one executor
    first.close()
    assert first.pid(0) is None and set(pooled_pids()) == set(pids)

    second = LocalExecutor(Counter, 2, checkpoint_dir=tmp_path / "b", devices=[])
    second.start()
    assert {second.pid(0), second.pid(1)} == set(pids)
    assert pooled_pids() == []
    _ready(second)
    # No model survives a lease: a batch that only the previous executor's in-memory
    # trainer could continue fails at its start on both processes.
    for bid, worker in ((3, 0), (4, 1)):
        second.submit(_continuation(bid, worker))
        [failed] = _of(_until(second, _ended({bid})), BatchFailed)
        assert failed.phase == "start" and "does not hold that model" in failed.error
    # ...and training from scratch gives what a fresh process gave.
    assert _total(second, _batch(5, 1, 3, evaluate_at=((1, 3),))) == fresh
    assert _total(second, _continuation(6, 1)) == continued
    second.close()
    shutdown_pool()
    assert pooled_pids() == [] and _gone({p for p in pids if p is not None})


def test_a_pooled_process_that_died_is_replaced(tmp_path: Path) -> None:
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[]) as first:
        _ready(first)
        old = first.pid(0)
    assert old is not None and pooled_pids() == [old]
    os.kill(old, signal.SIGKILL)
    assert _gone({old})
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[]) as second:
        _ready(second)
        new = second.pid(0)
        assert new not in (None, old)
        assert _total(second, _batch(1, 0, 3, evaluate_at=((1, 3),))) > 0
    assert pooled_pids() == [new]


def test_pool_is_bounded_expires_and_can_be_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a process keeps its thread count: the same threads_per_worker, so it is reusable)
    with LocalExecutor(Counter, 2, checkpoint_dir=tmp_path, devices=[], threads_per_worker=1) as ex:
        _ready(ex)
    assert len(pooled_pids()) == 2
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[], threads_per_worker=1) as ex:
        _ready(ex)
        assert len(pooled_pids()) == 1
    kept = pooled_pids()
    assert len(kept) == 1  # at most as many as the last executor had workers
    shutdown_pool()
    assert _gone(set(kept))

    monkeypatch.setenv("STAGETREE_WORKER_IDLE", "0.3")
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[]) as ex:
        _ready(ex)
        pid = ex.pid(0)
    assert pooled_pids() == [pid]
    assert pid is not None and _gone({pid})  # idle too long: stopped
    assert pooled_pids() == []

    monkeypatch.setenv("STAGETREE_WORKER_IDLE", "0")  # no pool
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[]) as ex:
        _ready(ex)
        pid = ex.pid(0)
    assert pooled_pids() == [] and pid is not None and not _alive(pid)
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[], keep_workers=False) as ex:
        _ready(ex)
        pid = ex.pid(0)
    assert pooled_pids() == [] and pid is not None and not _alive(pid)


def _study(tmp_path: Path, name: str) -> tuple[dict[str, object], float]:
    from study_trainers import LinearTrainer

    space = GridSpace(
        {"lr": [Constant(0.05), MultiStep(0.05, [3], 0.5), Constant(0.02)]},
        fixed={"seed": [0, 1]},
    )
    tuner = ASHA(space, "score", "max", min_steps=1, max_steps=8, eta=2, num_trials=len(space))
    url = f"sqlite:///{tmp_path}/{name}.db"
    with Study(name, LinearTrainer, storage=url, workers=2) as study:
        best = study.tune(tuner)
    assert best is not None
    return dict(best.config), float(best.metrics["score"])


def test_a_second_study_in_the_process_trains_on_the_first_ones_workers(tmp_path: Path) -> None:
    first = _study(tmp_path, "one")
    pids = set(pooled_pids())
    assert len(pids) == 2
    second = _study(tmp_path, "two")
    assert set(pooled_pids()) == pids  # the same processes served the second study
    assert second == first  # ...with the results of a fresh run


SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from study_trainers import LinearTrainer
    from stagetree import Study
    from stagetree.executors.local import pooled_pids
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import ASHA

    if __name__ == "__main__":
        for name in ("one", "two"):
            space = GridSpace({{"lr": [Constant(0.05), Constant(0.02)]}})
            tuner = ASHA(space, "score", "max", min_steps=1, max_steps=4, eta=2,
                         num_trials=len(space))
            with Study(name, LinearTrainer, storage={url!r} + name, workers=2) as study:
                study.tune(tuner)
        print("POOLED", *pooled_pids(), flush=True)
        print("EXITING", time.monotonic(), flush=True)
    """
)


def test_a_script_with_pooled_workers_exits_promptly_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    script = tmp_path / "two_studies.py"
    url = f"sqlite:///{tmp_path}/plan-"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1] / "fakes"), url=url))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    ended = time.monotonic()
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    pids = {int(p) for p in lines["POOLED"]}
    assert len(pids) == 2
    assert ended - float(lines["EXITING"][0]) < 10  # the pool is stopped at exit, quickly
    assert _gone(pids, timeout=1.0)


def test_forkserver_workers_train_like_spawned_ones(tmp_path: Path) -> None:
    totals = []
    for method in ("spawn", "forkserver"):
        with LocalExecutor(
            Counter, 1, checkpoint_dir=tmp_path / method, devices=[], start_method=method
        ) as ex:
            _ready(ex)
            totals.append(_total(ex, _batch(1, 0, 3, evaluate_at=((1, 3),))))
    assert totals[0] == totals[1]
    assert len(pooled_pids()) == 1  # pooled by start method: spawn's went for forkserver's
    with pytest.raises(ValueError, match="start_method"):
        LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, start_method="fork")


def test_forked_workers_see_the_environment_of_when_they_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def mark(name: str) -> float:
        with LocalExecutor(
            Counter, 1, checkpoint_dir=tmp_path / name, devices=[], start_method="forkserver"
        ) as ex:
            _ready(ex)
            ex.submit(_batch(1, 0, 1, evaluate_at=((1, 1),)))
            [metrics] = _of(_until(ex, _ended({1})), MetricsReported)
            return float(metrics.metrics["mark"])

    monkeypatch.delenv("STAGETREE_TEST_MARK", raising=False)
    assert mark("before") == -1  # the fork server is running now, without the variable
    monkeypatch.setenv("STAGETREE_TEST_MARK", "7")
    assert mark("after") == 7  # not the server's environment: the parent's, now


def test_a_process_older_than_an_edited_module_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[]) as ex:
        _ready(ex)
        old = ex.pid(0)
    assert pooled_pids() == [old]
    module = tmp_path / "edited_since.py"
    module.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_since  # noqa: F401  (this process now runs code newer than the worker)

    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[]) as ex:
        _ready(ex)
        assert ex.pid(0) not in (None, old)
    assert old is not None and _gone({old})
    monkeypatch.delitem(sys.modules, "edited_since")


def test_closing_during_a_batch_stops_it_and_pools_the_process(tmp_path: Path) -> None:
    ex = LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[])
    ex.start()
    _ready(ex)
    ex.submit(_batch(1, 0, 10_000, config={"sleep": 0.01}))
    _until(ex, lambda ev: bool(_of(ev, Progress)))  # it trains
    pid = ex.pid(0)
    began = time.monotonic()
    ex.close()
    assert time.monotonic() - began < 5  # stopped at its next step, not at close_timeout
    assert pooled_pids() == [pid]
    with LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[]) as again:
        _ready(again)
        assert again.pid(0) == pid
        assert _total(again, _batch(2, 0, 3, evaluate_at=((1, 3),))) > 0


def test_the_fork_server_imports_what_a_torch_trainer_warms_up_with() -> None:
    # A TorchTrainer's warmup imports torch._dynamo (seconds): once in the fork server,
    # not once per worker. It starts no thread, so forking from the server stays safe.
    pytest.importorskip("torch")
    from stagetree.executors.local import _preload_modules
    from stagetree.torch.examples import DigitsTrainer

    assert "torch._dynamo" in _preload_modules(DigitsTrainer)
    assert "torch._dynamo" not in _preload_modules(Counter)  # not a torch trainer
