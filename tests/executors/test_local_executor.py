"""LocalExecutor (worker processes) and InlineExecutor, driven by hand-written batches."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import StagetreeError, TrainerError
from stagetree.executors import BaseExecutor, InlineExecutor, LocalExecutor, TrainerSpec
from stagetree.executors.local import pooled_pids, shutdown_pool
from stagetree.hp import Constant, MultiStep
from stagetree.trainer import Trainer
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    Segment,
    SplitMissed,
    WorkerLost,
    WorkerReady,
)

HP = {"lr": MultiStep(0.1, [3], 0.5), "scale": Constant(2)}


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


def _waiting(gate: Path) -> Path:
    """File a trainer creates once it is blocked at ``gate``."""
    return gate.with_name(gate.name + ".waiting")


class Counter(Trainer):
    """Deterministic trainer; optional file gates make tests independent of timing.

    Config: ``gates``: {step: file} -- ``train()`` at that step waits for the file;
    ``arrive``: (file to create, file to wait for) at step 1 (a rendezvous of two
    workers); ``sleep``: seconds per step.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.t = 0
        self.total = 0.0
        self.lr = self.scale = 0.0

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = hp.get("lr", self.lr)
        self.scale = hp.get("scale", self.scale)

    def train(self) -> None:
        gate = self.config.get("gates", {}).get(self.t)
        if gate:
            _waiting(Path(gate)).touch()
            _wait_for(Path(gate))
        if self.t == 1 and "arrive" in self.config:
            mine, theirs = self.config["arrive"]
            Path(mine).touch()
            _wait_for(Path(theirs))  # both batches must be running at once
        if self.config.get("sleep"):
            time.sleep(self.config["sleep"])
        self.total += self.lr * self.scale
        self.t += 1

    def evaluate(self) -> dict[str, float]:
        return {
            "total": self.total,
            "t": self.t,
            "pid": os.getpid(),
            "device": float(os.environ.get("CUDA_VISIBLE_DEVICES", "-1")),
            "omp": float(os.environ.get("OMP_NUM_THREADS", "-1")),
            "mark": float(os.environ.get("STAGETREE_TEST_MARK", "-1")),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "total": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t, self.total = int(state["t"]), float(state["total"])


def _batch(
    batch_id: int,
    worker: int,
    steps: int,
    *,
    config: Mapping[str, Any] | None = None,
    node: int = 1,
    evaluate_at: tuple[tuple[int, int], ...] = (),
    checkpoint_at: tuple[tuple[int, int], ...] = (),
) -> RunBatch:
    return RunBatch(
        batch_id=batch_id,
        worker=worker,
        root_key="r",
        config=config or {},
        start_step=0,
        start_at=None,
        start_checkpoint=None,
        segments=(Segment(node, 0, steps, HP),),
        evaluate_at=evaluate_at,
        checkpoint_at=checkpoint_at,
    )


def _until(ex: BaseExecutor, done: Callable[[list[Any]], bool], timeout: float = 60.0) -> list[Any]:
    """Collect events until ``done(events)`` holds."""
    seen: list[Any] = []
    deadline = time.monotonic() + timeout
    while not done(seen):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; events so far: {seen}")
        seen.extend(ex.events(timeout=1.0))
    return seen


def _ended(batch_ids: set[int]) -> Callable[[list[Any]], bool]:
    def done(events: list[Any]) -> bool:
        ended = {e.batch_id for e in events if isinstance(e, (BatchDone, BatchFailed, WorkerLost))}
        return batch_ids <= ended

    return done


def _of(events: list[Any], kind: type, batch_id: int | None = None) -> list[Any]:
    return [
        e
        for e in events
        if isinstance(e, kind) and (batch_id is None or getattr(e, "batch_id", None) == batch_id)
    ]


# ---------------------------------------------------------------------- TrainerSpec


def test_trainer_spec_of_class_and_strings() -> None:
    # A class of the user's own (a test module, no installed distribution) travels
    # pickled by value; the worker never imports its module.
    spec = TrainerSpec.of(Counter)
    assert spec.module == Counter.__module__ and spec.qualname == "Counter"
    assert spec.by_value and spec.path is None
    copy = spec.resolve()
    assert copy.__qualname__ == "Counter" and issubclass(copy, Trainer)
    assert spec.resolve() is copy  # unpickled once per process
    # A library class travels by reference and resolves to the very class.
    from stagetree.torch.examples import DigitsTrainer

    library = TrainerSpec.of(DigitsTrainer)
    assert not library.by_value and library.module == "stagetree.torch.examples"
    assert library.resolve() is DigitsTrainer
    assert TrainerSpec.of("stagetree.trainer:Trainer").resolve() is Trainer
    # Import by name fails (wrong module name): the file path is the fallback.
    fallback = TrainerSpec("no_such_module_xyz", "Counter", os.path.abspath(__file__))
    assert fallback.resolve().__name__ == "Counter"
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        TrainerSpec("no_such_module_xyz", "Counter", None).resolve()

    # A class defined inside a function used to be refused; it travels by value now.
    class Local(Trainer):
        def train(self) -> dict[str, float]:
            return {"local": 1.0}

    local = TrainerSpec.of(Local).resolve()
    assert local.__qualname__ == Local.__qualname__
    assert local({}).train() == {"local": 1.0}
    with pytest.raises(ValueError, match="module:Class"):
        TrainerSpec.of("no colon")


def test_trainer_spec_from_script_file_does_not_run_main(tmp_path: Path) -> None:
    script = tmp_path / "my_script.py"
    script.write_text(
        "from stagetree.trainer import Trainer\n"
        "class Outer:\n"
        "    class Inner(Trainer):\n"
        "        pass\n"
        "if __name__ == '__main__':\n"
        "    raise SystemExit('the script body must not run')\n"
    )
    spec = TrainerSpec.of(f"{script}:Outer.Inner")
    assert spec.path == str(script) and spec.module == ""
    cls = spec.resolve()
    assert cls.__qualname__ == "Outer.Inner" and issubclass(cls, Trainer)
    assert spec.resolve() is cls  # loaded once, under a stable module name


# ---------------------------------------------------------------------- LocalExecutor


def test_two_workers_run_batches_in_parallel_and_deliver_all_events(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with LocalExecutor(
        Counter,
        num_workers=2,
        checkpoint_dir=tmp_path / "ckpt",
        devices=["7", "8"],
        threads_per_worker=1,
    ) as ex:
        assert ex.num_workers == 2 and ex.devices == ["7", "8"]
        ready = _until(ex, lambda ev: len(_of(ev, WorkerReady)) == 2)
        assert sorted(e.worker for e in _of(ready, WorkerReady)) == [0, 1]
        for worker, (mine, theirs) in enumerate([(a, b), (b, a)]):
            ex.submit(
                _batch(
                    10 + worker,
                    worker,
                    6,
                    node=worker + 1,
                    config={"arrive": (str(mine), str(theirs))},
                    evaluate_at=((worker + 1, 6),),
                    checkpoint_at=((worker + 1, 3),),
                )
            )
        events = _until(
            ex, lambda ev: _ended({10, 11})(ev) and len(_of(ev, CheckpointSaved)) >= 2
        )  # a batch's checkpoint writes may end after its BatchDone
        store = CheckpointStore(tmp_path / "ckpt")
        pids = set()
        for worker in (0, 1):
            bid = 10 + worker
            own = [e for e in events if getattr(e, "batch_id", None) == bid]
            assert all(e.worker == worker for e in own)
            [done] = _of(own, BatchDone)
            assert done.steps == 6
            assert all(isinstance(e, CheckpointSaved) for e in own[own.index(done) + 1 :])
            [saved] = _of(own, CheckpointSaved)
            assert (saved.node, saved.step) == (worker + 1, 3)
            assert store.load(saved.ref) == {"t": 3, "total": pytest.approx(0.1 * 2 * 3)}
            [metrics] = _of(own, MetricsReported)
            # lr 0.1 for steps 0-2, 0.05 for 3-5, times scale 2.
            assert metrics.metrics["total"] == pytest.approx(2 * (0.3 + 0.15))
            assert metrics.metrics["device"] == 7 + worker  # pinned per worker
            assert metrics.metrics["omp"] == 1
            pids.add(metrics.metrics["pid"])
            assert _of(own, Progress)[-1].step == 6
        assert len(pids) == 2 and os.getpid() not in pids


def test_killed_worker_is_reported_lost_and_replaced(tmp_path: Path) -> None:
    gate = tmp_path / "never"
    with LocalExecutor(
        Counter, num_workers=1, checkpoint_dir=tmp_path, devices=[], progress_interval=0.0
    ) as ex:
        _until(ex, lambda ev: bool(_of(ev, WorkerReady)))
        ex.submit(_batch(1, 0, 50, config={"gates": {2: str(gate)}}))
        _until(ex, lambda ev: any(e.step == 2 for e in _of(ev, Progress)))
        with pytest.raises(ValueError, match="still running batch 1"):
            ex.submit(_batch(2, 0, 5))
        old = ex.pid(0)
        assert old is not None
        os.kill(old, signal.SIGKILL)
        events = _until(ex, lambda ev: bool(_of(ev, WorkerReady)))
        lost = _of(events, WorkerLost)
        assert [(e.worker, e.batch_id) for e in lost] == [(0, 1)]
        assert "signal 9" in lost[0].reason
        assert events.index(lost[0]) < events.index(_of(events, WorkerReady)[0])
        new = ex.pid(0)
        assert new is not None and new != old
        # The replacement works, and an idle worker's death has no batch.
        ex.submit(_batch(3, 0, 4, evaluate_at=((1, 4),)))
        events = _until(ex, _ended({3}))
        assert _of(events, BatchDone)[0].steps == 4
        os.kill(new, signal.SIGKILL)
        events = _until(ex, lambda ev: bool(_of(ev, WorkerReady)))
        assert [(e.worker, e.batch_id) for e in _of(events, WorkerLost)] == [(0, None)]


def test_live_split_and_abort_reach_the_running_batch(tmp_path: Path) -> None:
    gate5, gate12 = tmp_path / "g5", tmp_path / "g12"
    config = {"gates": {5: str(gate5), 12: str(gate12)}}
    with LocalExecutor(
        Counter, 1, checkpoint_dir=tmp_path / "ckpt", devices=[], progress_interval=0.0
    ) as ex:
        ex.submit(_batch(7, 0, 100, config=config))
        # The worker is now blocked in train() of step 5.
        _until(ex, lambda ev: any(e.step == 5 for e in _of(ev, Progress)))
        ex.submit(AddCheckpoint(7, 0, node=1, step=8, evaluate=True))  # ahead
        ex.submit(AddCheckpoint(7, 0, node=1, step=3))  # behind
        ex.submit(AddCheckpoint(6, 0, node=1, step=9))  # not running
        gate5.touch()
        events = _until(ex, lambda ev: any(e.step == 12 for e in _of(ev, Progress)))
        _wait_for(_waiting(gate12))  # inside train() of step 12: no poll before it ends
        ex.submit(Abort(7, 0))
        gate12.touch()
        # BatchDone may come before the background write's CheckpointSaved (the module's
        # contract): wait for both.
        events += _until(ex, lambda ev: _ended({7})(ev) and bool(_of(events + ev, CheckpointSaved)))
        saved = _of(events, CheckpointSaved)
        assert [(e.node, e.step) for e in saved] == [(1, 8)]
        assert CheckpointStore(tmp_path / "ckpt").load(saved[0].ref)["t"] == 8
        assert [(m.step, m.metrics["t"]) for m in _of(events, MetricsReported)] == [(8, 8.0)]
        assert sorted((e.batch_id, e.step) for e in _of(events, SplitMissed)) == [(6, 9), (7, 3)]
        [done] = _of(events, BatchDone)
        assert done.steps == 13  # stopped right after the step it was training
        # Instructions for a finished batch: SplitMissed, Abort ignored.
        ex.submit(Abort(7, 0))
        ex.submit(AddCheckpoint(7, 0, node=1, step=20))
        assert ex.events(timeout=5) == [SplitMissed(7, 0, 1, 20)]


def test_failure_in_worker_process_and_close(tmp_path: Path) -> None:
    ex = LocalExecutor(Counter, 1, checkpoint_dir=tmp_path, devices=[])
    with pytest.raises(StagetreeError, match="start"):
        ex.submit(_batch(1, 0, 3))
    ex.start()
    ex.submit(_batch(1, 0, 3, config={"gates": "not a dict"}))
    events = _until(ex, _ended({1}))
    [failed] = _of(events, BatchFailed)
    assert failed.error.startswith("AttributeError") and "in train" in failed.traceback
    pid = ex.pid(0)
    assert pid is not None
    ex.close()
    ex.close()  # idempotent
    assert ex.pid(0) is None
    assert pid in pooled_pids()  # kept for the next executor of this process
    shutdown_pool()
    assert pooled_pids() == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(StagetreeError):
        ex.submit(_batch(2, 0, 3))


def test_worker_that_cannot_import_the_trainer_raises(tmp_path: Path) -> None:
    module = tmp_path / "only_here.py"
    module.write_text(
        "import multiprocessing\n"
        "from stagetree.trainer import Trainer\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    raise ImportError('cannot import in workers')\n"
        "class T(Trainer):\n"
        "    pass\n"
    )
    with LocalExecutor(f"{module}:T", 1, checkpoint_dir=tmp_path / "c", devices=[]) as ex:
        with pytest.raises(TrainerError, match="could not start") as info:
            _until(ex, lambda ev: False, timeout=60)
        assert "cannot import in workers" in str(info.value)


def test_defaults_pick_workers_and_threads(tmp_path: Path) -> None:
    ex = LocalExecutor(Counter, checkpoint_dir=tmp_path, devices=[])
    assert ex.num_workers == 1 and ex.devices == [None]
    assert ex.threads_per_worker == max(1, len(os.sched_getaffinity(0)))
    ex.close()
    # Classes defined in functions travel by value now; one that cannot be pickled
    # is refused up front, naming what it holds.
    with pytest.raises(ValueError, match=r"cannot be sent to worker processes.*lock"):

        class Local(Trainer):
            guard = threading.Lock()

        LocalExecutor(Local, checkpoint_dir=tmp_path)


# ---------------------------------------------------------------------- InlineExecutor


def test_inline_executor_follows_the_contract(tmp_path: Path) -> None:
    with InlineExecutor(Counter, 2, checkpoint_dir=tmp_path) as ex:
        assert ex.events(timeout=None) == [WorkerReady(0), WorkerReady(1)]
        assert ex.events(timeout=None) == []  # idle: returns at once
        ex.submit(_batch(1, 0, 6, evaluate_at=((1, 6),)))
        ex.submit(AddCheckpoint(1, 0, node=1, step=4, evaluate=True))
        ex.submit(_batch(2, 1, 10))
        ex.submit(Abort(2, 1))
        with pytest.raises(ValueError, match="still running batch 1"):
            ex.submit(_batch(3, 0, 2))
        events = ex.events(timeout=0)
        assert [(m.step, m.metrics["t"]) for m in _of(events, MetricsReported)] == [
            (4, 4.0),
            (6, 6.0),
        ]
        [saved] = _of(events, CheckpointSaved)
        assert saved.step == 4 and ex.store.load(saved.ref)["t"] == 4
        done = {e.batch_id: e.steps for e in _of(events, BatchDone)}
        assert done == {1: 6, 2: 0}
        ex.submit(AddCheckpoint(1, 0, node=1, step=5))
        assert ex.events() == [SplitMissed(1, 0, 1, 5)]
        # The worker kept its trainer: a batch continuing from (1, 6) needs no checkpoint.
        follow = RunBatch(3, 0, "r", {}, 6, (1, 6), None, (Segment(2, 6, 8, HP),), ((2, 8),))
        ex.submit(follow)
        [metrics] = _of(ex.events(), MetricsReported)
        assert metrics.metrics["t"] == 8
        assert ex.workers[0].stats.reuses == 1


def test_a_message_of_several_events_is_taken_in_order() -> None:
    """A worker process sends a batch's last events as one message (a list): the
    executor takes each, in order, and the batch's end frees its worker."""
    from stagetree.executors._events import accept_event
    from stagetree.work import CurveReported

    class Slot:
        ready = True
        start_failures = 0
        running = {5}

    slot = Slot()
    end = [
        CurveReported(5, 0, ((1, 4, {"t": 4.0}, True),)),
        MetricsReported(5, 0, 1, 4, {"t": 4.0}),
        BatchDone(5, 0, 0.1, 4, 0.0),
    ]
    out: list[Any] = []
    accept_event(slot, end, out, "spec")
    assert out == end
    assert slot.running == set()
