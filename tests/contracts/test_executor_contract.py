"""The executor contract (:class:`stagetree.executors.BaseExecutor`'s docstring), one
suite run against every executor: inline, local processes, simulated (virtual time) and
Ray actors (on a one-machine Ray started for this module).

Ready events, one terminal event per batch, checkpoints durable before it, events of a
batch in order, ``AddCheckpoint`` honoured ahead and answered with ``SplitMissed`` after
the batch, ``Abort``, lost workers reported and replaced, the clock, ``close``; several
trainers on one pool (``add_trainer``, ``RunBatch.trainer``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from ray_local import private_ray

from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import StagetreeError
from stagetree.executors import (
    BaseExecutor,
    InlineExecutor,
    LocalExecutor,
    SimulatedExecutor,
    TrainerSpec,
)
from stagetree.executors.simulated import StepCost
from stagetree.hp import Constant
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

KINDS = ["inline", "local", "simulated", "ray"]
HP = {"lr": Constant(0.5)}


class Sleeper(Trainer):
    """Adds ``lr`` per step; ``sleep`` seconds per step (config)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.t = 0
        self.total = 0.0
        self.lr = 0.0

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = hp.get("lr", self.lr)

    def train(self) -> None:
        time.sleep(float(self.config.get("sleep", 0.0)))
        self.total += self.lr
        self.t += 1

    def evaluate(self) -> dict[str, float]:
        return {"total": self.total, "t": float(self.t)}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "total": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t, self.total = int(state["t"]), float(state["total"])


class Scaled(Trainer):
    """Another trainer than :class:`Sleeper`: multiplies ``x`` by ``1 + lr`` per step.
    Defined in this test module, it travels to worker processes and actors by value."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.x = float(config.get("x0", 1.0))
        self.lr = 0.0
        self.t = 0

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = hp.get("lr", self.lr)

    def train(self) -> None:
        self.x *= 1.0 + self.lr
        self.t += 1

    def evaluate(self) -> dict[str, float]:
        return {"x": self.x, "t": float(self.t)}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "x": self.x}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t, self.x = int(state["t"]), float(state["x"])


STUDY_TRAINERS = Path(__file__).resolve().parents[1] / "fakes" / "study_trainers.py"


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    with private_ray(ray, num_cpus=2):
        yield ray


class Harness:
    """One executor kind: how to build it and how to lose one of its workers."""

    def __init__(self, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.kind = kind
        self.store = CheckpointStore(tmp_path / "ckpt")
        self.request = request

    def make(self, num_workers: int = 2) -> BaseExecutor:
        if self.kind == "inline":
            return InlineExecutor(Sleeper, num_workers, checkpoint_dir=self.store)
        if self.kind == "local":
            return LocalExecutor(
                Sleeper,
                num_workers,
                checkpoint_dir=self.store,
                devices=[],
                threads_per_worker=1,
                progress_interval=0.0,
            )
        if self.kind == "simulated":
            return SimulatedExecutor(num_workers, step_cost=StepCost(1.0), checkpoint_bytes=10)
        self.request.getfixturevalue("ray_runtime")
        from stagetree.executors.ray import RayExecutor

        return RayExecutor(
            Sleeper,
            num_workers,
            checkpoint_dir=self.store,
            worker_resources={"CPU": 1},
            progress_interval=0.0,
        )

    @property
    def real_time(self) -> bool:
        return self.kind != "simulated"

    def linear(self) -> Any:
        """``study_trainers.LinearTrainer``, by reference where a worker process or
        actor loads it (it imports the file by path), the class elsewhere."""
        if self.kind in ("local", "ray"):
            spec = TrainerSpec.of(f"{STUDY_TRAINERS}:LinearTrainer")
            assert not spec.by_value
            return spec
        from study_trainers import LinearTrainer

        return LinearTrainer

    def kill(self, ex: BaseExecutor, worker: int) -> None:
        """Kill a worker the hard way (its process or actor)."""
        if isinstance(ex, LocalExecutor):
            pid = ex.pid(worker)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            return
        import ray

        ray.kill(ex._slots[worker].actor, no_restart=True)  # type: ignore[attr-defined]


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    return Harness(request.param, tmp_path, request)


def _batch(
    batch_id: int,
    worker: int,
    steps: int,
    sleep: float = 0.0,
    evaluate_at: tuple[tuple[int, int], ...] = (),
    checkpoint_at: tuple[tuple[int, int], ...] = (),
) -> RunBatch:
    return RunBatch(
        batch_id=batch_id,
        worker=worker,
        root_key="r",
        config={"sleep": sleep},
        start_step=0,
        start_at=None,
        start_checkpoint=None,
        segments=(Segment(1, 0, steps, HP),),
        evaluate_at=evaluate_at,
        checkpoint_at=checkpoint_at,
    )


def _until(ex: BaseExecutor, done: Callable[[list[Any]], bool], timeout: float = 90.0) -> list[Any]:
    seen: list[Any] = []
    deadline = time.monotonic() + timeout
    while not done(seen):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; events so far: {seen}")
        seen.extend(ex.events(timeout=0.5))
    return seen


def _terminal(e: Any) -> bool:
    return isinstance(e, (BatchDone, BatchFailed, WorkerLost))


def _ended(ids: set[int]) -> Callable[[list[Any]], bool]:
    return lambda ev: ids <= {e.batch_id for e in ev if _terminal(e)}


def _ready(n: int) -> Callable[[list[Any]], bool]:
    return lambda ev: len({e.worker for e in ev if isinstance(e, WorkerReady)}) >= n


def _of(events: list[Any], kind: type, batch_id: int | None = None) -> list[Any]:
    return [
        e
        for e in events
        if isinstance(e, kind) and (batch_id is None or getattr(e, "batch_id", None) == batch_id)
    ]


def test_every_worker_announces_itself(harness: Harness) -> None:
    with harness.make(2) as ex:
        assert ex.num_workers == 2
        events = _until(ex, _ready(2))
        assert sorted(e.worker for e in _of(events, WorkerReady)) == [0, 1]


def test_one_terminal_event_per_batch_and_its_checkpoints(harness: Harness) -> None:
    with harness.make(2) as ex:
        _until(ex, _ready(2))
        for b, w in ((1, 0), (2, 1)):
            ex.submit(_batch(b, w, 6, evaluate_at=((1, 3), (1, 6)), checkpoint_at=((1, 3), (1, 6))))
        with pytest.raises(ValueError, match="still running"):
            ex.submit(_batch(3, 0, 2))

        def written(ev: list[Any]) -> bool:  # the writes may end after BatchDone
            return _ended({1, 2})(ev) and len(_of(ev, CheckpointSaved)) >= 4

        events = _until(ex, written)
        events += ex.events(timeout=0.3)  # nothing more may come for these batches
        for b in (1, 2):
            mine = [e for e in events if getattr(e, "batch_id", None) == b]
            ends = [e for e in mine if _terminal(e)]
            assert len(ends) == 1 and isinstance(ends[0], BatchDone), ends
            assert ends[0].steps == 6
            after = mine[mine.index(ends[0]) + 1 :]
            assert all(isinstance(e, CheckpointSaved) for e in after), after
            saved = _of(mine, CheckpointSaved)
            assert [(e.node, e.step) for e in saved] == [(1, 3), (1, 6)]
            assert [e.step for e in _of(mine, MetricsReported)] == [3, 6]
            steps = [e.step for e in _of(mine, Progress)]
            assert steps == sorted(steps), "events of a batch out of order"
            if harness.real_time:  # durable: the store has them when they are reported
                for e in saved:
                    assert harness.store.load(e.ref)["t"] == e.step
        # The worker is free again once its batch ended.
        ex.submit(_batch(3, 0, 2))
        assert _of(_until(ex, _ended({3})), BatchDone)[0].steps == 2


def test_live_split_ahead_is_honoured_and_after_the_batch_missed(harness: Harness) -> None:
    with harness.make(1) as ex:
        _until(ex, _ready(1))
        ex.submit(_batch(1, 0, 40, sleep=0.05))
        ex.submit(AddCheckpoint(1, 0, node=1, step=35, evaluate=True))
        ex.submit(AddCheckpoint(9, 0, node=1, step=2))  # not running
        events = _until(ex, _ended({1}))
        assert [(e.node, e.step) for e in _of(events, CheckpointSaved, 1)] == [(1, 35)]
        assert [e.step for e in _of(events, MetricsReported, 1)] == [35]
        assert [(e.batch_id, e.step) for e in _of(events, SplitMissed)] == [(9, 2)]
        ex.submit(Abort(1, 0))  # ended: ignored
        ex.submit(AddCheckpoint(1, 0, node=1, step=39))
        events = _until(ex, lambda ev: bool(_of(ev, SplitMissed)))
        assert _of(events, SplitMissed) == [SplitMissed(1, 0, 1, 39)]


def test_abort_ends_the_batch_early(harness: Harness) -> None:
    with harness.make(1) as ex:
        _until(ex, _ready(1))
        ex.submit(_batch(1, 0, 10_000, sleep=0.01, evaluate_at=((1, 10_000),)))
        if harness.real_time and harness.kind != "inline":
            _until(ex, lambda ev: bool(_of(ev, Progress)))
        ex.submit(Abort(1, 0))
        events = _until(ex, _ended({1}))
        [done] = _of(events, BatchDone)
        assert done.steps < 10_000
        assert not _of(events, MetricsReported)


def test_lost_worker_is_reported_and_replaced(harness: Harness) -> None:
    if harness.kind in ("inline", "simulated"):
        pytest.skip(f"the {harness.kind} executor has no worker process that can be lost")
    with harness.make(1) as ex:
        _until(ex, _ready(1))
        ex.submit(_batch(1, 0, 10_000, sleep=0.01, checkpoint_at=((1, 2),)))
        [saved] = _of(_until(ex, lambda ev: bool(_of(ev, CheckpointSaved))), CheckpointSaved)
        harness.kill(ex, 0)
        events = _until(ex, lambda ev: bool(_of(ev, WorkerLost)) and bool(_of(ev, WorkerReady)))
        [lost] = _of(events, WorkerLost)
        assert (lost.worker, lost.batch_id) == (0, 1)
        assert events.index(lost) < events.index(_of(events, WorkerReady)[0])
        assert not _of(events, BatchDone, 1), "a lost batch has no other terminal event"
        assert harness.store.load(saved.ref)["t"] == 2  # what it reported stays durable
        # The replacement works.
        ex.submit(_batch(2, 0, 3, evaluate_at=((1, 3),)))
        assert _of(_until(ex, _ended({2})), BatchDone)[0].steps == 3


def test_clock_and_close(harness: Harness) -> None:
    ex = harness.make(1)
    assert ex.virtual_time is (harness.kind == "simulated")
    if harness.kind != "simulated":
        with pytest.raises(StagetreeError):
            ex.submit(_batch(1, 0, 1))
    ex.start()
    _until(ex, _ready(1))
    ex.close()
    ex.close()  # idempotent
    if harness.kind != "simulated":
        with pytest.raises(StagetreeError):
            ex.submit(_batch(2, 0, 1))


def test_root_key_does_not_depend_on_the_executor(tmp_path: Path) -> None:
    from stagetree import Study

    keys = set()
    for executor in ("local", "inline", "simulated", "ray"):
        study = Study("k", Sleeper, storage=f"sqlite:///{tmp_path}/p.db", executor=executor)
        with contextlib.closing(study):
            keys.add(study.root_key({"sleep": 0.0}))
    assert len(keys) == 1


# ---------------------------------------------------------------------- several trainers

LINEAR_HP = {"lr": Constant(0.05)}


def _run(
    batch_id: int,
    worker: int,
    trainer: str,
    stop: int,
    config: Mapping[str, Any],
    hp: Mapping[str, Any] = HP,
    start_at: tuple[int, int] | None = None,
    node: int = 1,
) -> RunBatch:
    """A batch of ``trainer`` from ``start_at`` (fresh: step 0) to ``stop``, on ``node``,
    evaluated at its end, with no start checkpoint."""
    start = 0 if start_at is None else start_at[1]
    return RunBatch(
        batch_id=batch_id,
        worker=worker,
        root_key="r",
        config=config,
        start_step=start,
        start_at=start_at,
        start_checkpoint=None,
        segments=(Segment(node, start, stop, hp),),
        evaluate_at=((node, stop),),
        trainer=trainer,
    )


def _alone(cls: type[Trainer], config: Mapping[str, Any], lr: float, steps: int) -> Any:
    """Metrics of ``cls`` trained alone from step 0, in this process."""
    trainer = cls(config)
    trainer.setup({"lr": lr})
    for _ in range(steps):
        trainer.train()
    return {k: float(v) for k, v in trainer.evaluate().items()}


def test_several_trainers_share_one_pool(harness: Harness) -> None:
    from study_trainers import LinearTrainer

    assert TrainerSpec.of(Scaled).by_value  # and "linear" travels by reference
    ex = harness.make(2)
    linear = harness.linear()
    ex.add_trainer("linear", linear)  # before start
    with ex:
        ex.add_trainer("scaled", Scaled)  # after start
        _until(ex, _ready(2))
        # (batch id, worker, key, steps, config, hp): each round runs both workers.
        rounds = [
            [(1, 0, "linear", 5, {"seed": 1}, LINEAR_HP), (2, 1, "scaled", 4, {"x0": 2.0}, HP)],
            [(3, 0, "scaled", 3, {"x0": 1.0}, HP), (4, 1, "linear", 6, {"seed": 2}, LINEAR_HP)],
            [(5, 0, "", 4, {}, HP), (6, 1, "linear", 5, {"seed": 1}, LINEAR_HP)],
        ]
        classes = {"": Sleeper, "linear": LinearTrainer, "scaled": Scaled}
        for batches in rounds:
            for bid, w, key, steps, config, hp in batches:
                ex.submit(_run(bid, w, key, steps, config, hp))
            ex.add_trainer("linear", linear)  # the same again, while batches run: no-op
            events = _until(ex, _ended({b[0] for b in batches}))
            for bid, _w, key, steps, config, hp in batches:
                assert [e.steps for e in _of(events, BatchDone, bid)] == [steps], events
                if harness.kind == "simulated":
                    continue  # its metrics come from the curve model, not the trainer
                [metrics] = _of(events, MetricsReported, bid)
                lr = hp["lr"](0)
                assert dict(metrics.metrics) == _alone(classes[key], config, lr, steps), key


def test_a_batch_of_another_trainer_does_not_continue_the_model_in_memory(
    harness: Harness,
) -> None:
    from study_trainers import LinearTrainer

    ex = harness.make(1)
    ex.add_trainer("a", harness.linear())
    ex.add_trainer("b", Scaled)
    config = {"seed": 4}
    with ex:
        _until(ex, _ready(1))
        ex.submit(_run(1, 0, "a", 4, config, LINEAR_HP))
        _until(ex, _ended({1}))
        # Same key, starting where the worker stopped: it continues the model in memory
        # (no start checkpoint is given).
        ex.submit(_run(2, 0, "a", 8, config, LINEAR_HP, start_at=(1, 4)))
        events = _until(ex, _ended({2}))
        assert [e.steps for e in _of(events, BatchDone, 2)] == [4], events
        if harness.kind != "simulated":
            [metrics] = _of(events, MetricsReported, 2)
            assert dict(metrics.metrics) == _alone(LinearTrainer, config, 0.05, 8)
        # Another key at the very same (node, step): the model in memory is not its own.
        ex.submit(_run(3, 0, "b", 10, config, start_at=(1, 8)))
        events = _until(ex, _ended({3}))
        [failed] = _of(events, BatchFailed, 3)
        assert (failed.phase, failed.kind, failed.step) == ("start", "checkpoint", 8), failed
        assert not _of(events, BatchDone, 3)


def test_unknown_trainer_key_fails_only_its_batch(harness: Harness) -> None:
    with harness.make(1) as ex:
        _until(ex, _ready(1))
        ex.submit(_run(1, 0, "nope", 3, {}))
        [failed] = _of(_until(ex, _ended({1})), BatchFailed, 1)
        assert failed.phase == "start" and "'nope'" in failed.error, failed
        # The worker goes on serving batches of its trainers, the default and new ones.
        ex.submit(_run(2, 0, "", 3, {}))
        assert [e.steps for e in _of(_until(ex, _ended({2})), BatchDone, 2)] == [3]
        ex.add_trainer("nope", Scaled)
        ex.submit(_run(3, 0, "nope", 2, {}))
        events = _until(ex, _ended({3}))
        assert [e.steps for e in _of(events, BatchDone, 3)] == [2], events


def test_a_trainer_its_workers_cannot_load_fails_only_its_batch(harness: Harness) -> None:
    if harness.kind not in ("local", "ray"):
        why = "it holds the classes themselves" if harness.kind == "inline" else "it trains nothing"
        pytest.skip(f"the {harness.kind} executor loads no trainer on a worker ({why})")
    ex = harness.make(1)
    broken: Any = TrainerSpec("no_such_module_xyz", "T")  # imported on the worker only
    ex.add_trainer("broken", broken)
    ex.add_trainer("scaled", Scaled)
    with ex:
        _until(ex, _ready(1))
        ex.submit(_run(1, 0, "broken", 3, {}))
        [failed] = _of(_until(ex, _ended({1})), BatchFailed, 1)
        assert failed.phase == "start", failed
        assert "'broken'" in failed.error and "no_such_module_xyz" in failed.error, failed
        ex.submit(_run(2, 0, "scaled", 2, {}))
        events = _until(ex, _ended({2}))
        assert [e.steps for e in _of(events, BatchDone, 2)] == [2], events


def test_a_trainer_key_names_one_class(harness: Harness) -> None:
    ex = harness.make(1)
    try:
        ex.add_trainer("k", Scaled)
        ex.add_trainer("k", Scaled)  # the same class again: nothing happens
        with pytest.raises(ValueError, match="'k'"):
            ex.add_trainer("k", Sleeper)
        with pytest.raises(ValueError, match="non-empty"):
            ex.add_trainer("", Scaled)
    finally:
        ex.close()
