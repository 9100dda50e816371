"""Worker: the setup contract, exact resumes, background checkpoints, live splits,
aborts and failures, driven by hand-written RunBatch instructions."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stagetree.checkpoints import CheckpointInfo, CheckpointStore
from stagetree.executors._spec import TrainerClasses, TrainerSpec
from stagetree.executors.worker import Worker as _Worker
from stagetree.executors.worker import snapshot_state
from stagetree.hp import Constant, MultiStep, Step
from stagetree.trainer import Trainer
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    CheckpointFailed,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    Segment,
    SplitMissed,
)


class Worker(_Worker):
    """The worker, waiting after each batch for the background writes that outlive it
    (these tests read the checkpoints a batch wrote as soon as it returns)."""

    def run(self, *args: Any, **kwargs: Any) -> None:
        super().run(*args, **kwargs)
        self.flush()


# Every call of every Noisy trainer, in order: (trainer id, call, detail).
CALLS: list[tuple[int, str, Any]] = []
_IDS = itertools.count()


class Noisy(Trainer):
    """A tiny stochastic trainer in numpy: RNG, in-place state, sequential hps."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.id = next(_IDS)
        self.rng = np.random.default_rng(config["seed"])
        self.w = np.zeros(3)
        self.hp: dict[str, Any] = {}
        self.t = 0
        if config.get("fail") == "init":
            raise RuntimeError("init exploded")
        CALLS.append((self.id, "init", dict(config)))

    def setup(self, hp: Mapping[str, Any]) -> None:
        CALLS.append((self.id, "setup", dict(hp)))
        if self.config.get("fail") == "setup" and self.t == 2:
            raise ValueError("bad hp")
        self.hp.update(hp)

    def train(self) -> dict[str, float]:
        CALLS.append((self.id, "train", self.t))
        if self.config.get("fail") == "train" and self.t == 3:
            raise FloatingPointError("loss is nan")
        noise = self.rng.normal(size=3)
        self.w *= 1.0 - self.hp["lr"]  # in place: snapshots must copy
        self.w += self.hp["lr"] * self.hp["scale"] * noise
        self.t += 1
        return {"loss": float(self.w @ self.w)}

    def evaluate(self) -> dict[str, float]:
        CALLS.append((self.id, "evaluate", self.t))
        if self.config.get("fail") == "evaluate":
            raise KeyError("no metric")
        return {"norm": float(np.sum(self.w**2)), "t": self.t}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "rng": self.rng.bit_generator.state, "t": self.t}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        CALLS.append((self.id, "load", state["t"]))
        if self.config.get("fail") == "load":
            raise RuntimeError("incompatible state")
        self.w = np.array(state["w"])
        self.rng.bit_generator.state = state["rng"]
        self.t = int(state["t"])


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    CALLS.clear()


LR = MultiStep(0.5, [4, 7], 0.5)
SCALE = Constant(1.0)
HP = {"lr": LR, "scale": SCALE}
CONFIG = {"seed": 3}


def _batch(
    batch_id: int,
    segments: list[tuple[int, int, int, Mapping[str, Any]]],
    *,
    start_at: tuple[int, int] | None = None,
    start_checkpoint: str | None = None,
    evaluate_at: tuple[tuple[int, int], ...] = (),
    checkpoint_at: tuple[tuple[int, int], ...] = (),
    config: Mapping[str, Any] = CONFIG,
    root_key: str = "root",
) -> RunBatch:
    segs = tuple(Segment(n, a, b, hp) for n, a, b, hp in segments)
    return RunBatch(
        batch_id=batch_id,
        worker=0,
        root_key=root_key,
        config=config,
        start_step=segs[0].start,
        start_at=start_at,
        start_checkpoint=start_checkpoint,
        segments=segs,
        evaluate_at=evaluate_at,
        checkpoint_at=checkpoint_at,
    )


class Collector:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        with self.lock:
            self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def _last_but_writes(events: Collector) -> Any:
    """The last event that is not a background write's (those may follow BatchDone)."""
    return [e for e in events.events if not isinstance(e, CheckpointSaved)][-1]


def _worker(tmp_path: Path, **kwargs: Any) -> tuple[Worker, Collector]:
    events = Collector()
    return Worker(0, Noisy, CheckpointStore(tmp_path), events, **kwargs), events


def _check_setup_contract(hp_by_step: Mapping[int, Mapping[str, Any]]) -> None:
    """Replay CALLS: before train at step t every trainer holds every hp at its value at
    t; all values after init/restore; only changed values otherwise."""
    known: dict[int, dict[str, Any]] = {}
    fresh: dict[int, bool] = {}
    for tid, call, detail in CALLS:
        if call in ("init", "load"):
            known[tid] = {}
            fresh[tid] = True
        elif call == "setup":
            if fresh[tid]:
                assert set(detail) == set(hp_by_step[0]), "all values after init/restore"
            else:
                for name, value in detail.items():
                    assert known[tid].get(name) != value, f"unchanged {name} given again"
            fresh[tid] = False
            known[tid].update(detail)
        elif call == "train":
            expected = hp_by_step[detail]
            assert known[tid] == expected, f"step {detail}: {known[tid]} != {expected}"
            assert not fresh[tid]


def _values(hp: Mapping[str, Any], t: int) -> dict[str, Any]:
    return {name: seq(t) for name, seq in hp.items()}


def test_setup_contract_across_segments_and_batches(tmp_path: Path) -> None:
    lr2 = Step(0.2, 2, 0.5)
    worker, events = _worker(tmp_path)
    # Node 1 trains 0..5, node 2 (branching at 5) trains 5..9.
    worker.run(_batch(1, [(1, 0, 5, HP), (2, 5, 9, {"lr": lr2, "scale": SCALE})]))
    # A second batch continues the in-memory trainer from (2, 9): no load.
    worker.run(_batch(2, [(3, 9, 12, {"lr": lr2, "scale": Constant(2.0)})], start_at=(2, 9)))
    expected = {t: _values(HP, t) for t in range(5)}
    expected.update({t: {"lr": lr2(t), "scale": 1.0} for t in range(5, 9)})
    expected.update({t: {"lr": lr2(t), "scale": 2.0} for t in range(9, 12)})
    _check_setup_contract(expected)
    assert [c[1] for c in CALLS].count("init") == 1
    assert worker.stats.reuses == 1 and worker.stats.loads == 0
    setups = [c[2] for c in CALLS if c[1] == "setup"]
    # All at step 0, then exactly the changes: lr at 4, lr at 5 (new node), lr at 6 and
    # 8 (Step decays every 2 steps), scale at 9, lr at 10.
    assert setups == [
        {"lr": 0.5, "scale": 1.0},
        {"lr": 0.25},
        {"lr": lr2(5)},
        {"lr": lr2(6)},
        {"lr": lr2(8)},
        {"scale": 2.0},
        {"lr": lr2(10)},
    ]
    done = events.of(BatchDone)
    assert [(d.batch_id, d.steps) for d in done] == [(1, 9), (2, 3)]
    assert worker.position == ("root", (3, 12))


def test_restore_gives_all_values_and_matches_uninterrupted_run(tmp_path: Path) -> None:
    # Uninterrupted: 0..10 on one node, metrics at 10.
    solo, solo_events = _worker(tmp_path / "solo")
    solo.run(_batch(1, [(1, 0, 10, HP)], evaluate_at=((1, 10),)))
    solo_state = snapshot_state(solo._trainer.state_dict())  # type: ignore[union-attr]

    # Split: 0..6 with a checkpoint at the branch point 6, then a *different* worker
    # resumes from the checkpoint.
    store = CheckpointStore(tmp_path / "split")
    first_events = Collector()
    Worker(0, Noisy, store, first_events).run(_batch(1, [(1, 0, 6, HP)], checkpoint_at=((1, 6),)))
    [saved] = first_events.of(CheckpointSaved)
    assert (saved.node, saved.step) == (1, 6) and store.exists(saved.ref)
    assert saved.nbytes == store.size(saved.ref)
    # BatchDone ends the batch; only its background writes may follow it.
    assert isinstance(_last_but_writes(first_events), BatchDone)
    second_events = Collector()
    second = Worker(1, Noisy, store, second_events)
    second.run(
        _batch(
            2,
            [(1, 6, 10, HP)],
            start_at=(1, 6),
            start_checkpoint=saved.ref,
            evaluate_at=((1, 10),),
        )
    )
    state = second._trainer.state_dict()  # type: ignore[union-attr]
    np.testing.assert_array_equal(state["w"], solo_state["w"])
    assert state["rng"] == solo_state["rng"]
    assert (
        second_events.of(MetricsReported)[0].metrics == solo_events.of(MetricsReported)[0].metrics
    )
    assert second.stats.loads == 1
    assert second_events.of(BatchDone)[0].steps == 4
    _check_setup_contract({t: _values(HP, t) for t in range(10)})
    # The restored trainer was given every value before its first step.
    loaded = next(i for i, c in enumerate(CALLS) if c[1] == "load")
    assert CALLS[loaded + 1][1] == "setup" and set(CALLS[loaded + 1][2]) == {"lr", "scale"}


def test_batch_not_at_held_position_reloads(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    events = Collector()
    worker = Worker(0, Noisy, store, events)
    worker.run(_batch(1, [(1, 0, 6, HP)], checkpoint_at=((1, 3), (1, 6))))
    refs = {e.step: e.ref for e in events.of(CheckpointSaved)}
    # Next batch branches at 3 (not where the trainer is): it must load the checkpoint.
    worker.run(_batch(2, [(2, 3, 5, HP)], start_at=(1, 3), start_checkpoint=refs[3]))
    assert worker.stats.loads == 1 and worker.stats.reuses == 0
    # Different root key at the same position: fresh trainer too.
    worker.run(
        _batch(3, [(9, 6, 7, HP)], start_at=(1, 6), start_checkpoint=refs[6], root_key="other")
    )
    assert worker.stats.loads == 2
    assert [c[1] for c in CALLS].count("init") == 3
    assert worker.stats.last_load_seconds > 0
    assert not events.of(BatchFailed)
    # Each restored trainer got every value first, although the worker had given some
    # of the same values to its previous trainer.
    _check_setup_contract({t: _values(HP, t) for t in range(7)})


class Doubled(Noisy):
    """Another trainer class (a batch's key picks it)."""


def test_factories_by_trainer_key(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    events = Collector()

    # Factories by key, as a worker process holds them: loaded when a batch needs them.
    factories = TrainerClasses(Noisy)
    # By name: resolving a by-value spec in this process would make cloudpickle reset
    # the methods of the very classes it was pickled from (Noisy's, used by every test).
    factories.add("other", TrainerSpec(__name__, "Doubled"))
    factories.add("broken", TrainerSpec("no_such_module_xyz", "T"))
    worker = Worker(0, factories, store, events)
    worker.run(dataclasses.replace(_batch(1, [(1, 0, 3, HP)]), trainer="other"))
    assert worker.trainer_key == "other" and worker.position == ("root", (1, 3))
    # The same key where it stopped: continued; another key there: not.
    worker.run(dataclasses.replace(_batch(2, [(1, 3, 5, HP)], start_at=(1, 3)), trainer="other"))
    assert worker.stats.reuses == 1 and isinstance(events.events[-1], BatchDone)
    worker.run(_batch(3, [(1, 5, 6, HP)], start_at=(1, 5)))
    failed = events.events[-1]
    assert isinstance(failed, BatchFailed) and failed.kind == "checkpoint", failed
    assert worker.stats.reuses == 1 and worker.trainer_key is None
    # A key with no factory, or one whose lookup raises: that batch fails at its start.
    for bid, key, words in (
        (4, "nope", "unknown trainer key 'nope'"),
        (5, "broken", "no_such_module_xyz"),
    ):
        worker.run(dataclasses.replace(_batch(bid, [(1, 0, 2, HP)]), trainer=key))
        failed = events.events[-1]
        assert isinstance(failed, BatchFailed) and failed.phase == "start", failed
        assert failed.kind == "trainer" and words in failed.error, failed
    # The default key still works, with the plain class as before.
    worker.run(_batch(6, [(1, 0, 2, HP)]))
    assert isinstance(events.events[-1], BatchDone) and worker.trainer_key == ""


def test_evaluation_and_progress_points(tmp_path: Path) -> None:
    worker, events = _worker(tmp_path, progress_interval=1e9)
    worker.run(
        _batch(
            7,
            [(1, 0, 4, HP), (2, 4, 8, HP)],
            evaluate_at=((1, 0), (1, 2), (2, 8)),
            checkpoint_at=((1, 4),),
        )
    )
    metrics = events.of(MetricsReported)
    assert [(m.node, m.step, m.metrics["t"]) for m in metrics] == [(1, 0, 0), (1, 2, 2), (2, 8, 8)]
    # With throttling off, Progress comes exactly at points and segment ends.
    progress = events.of(Progress)
    assert [(p.node, p.step) for p in progress] == [(1, 2), (1, 4), (2, 8)]
    assert all(p.seconds_per_step >= 0 and p.batch_id == 7 for p in progress)
    # Every point is reported after its Progress, and BatchDone is last.
    kinds = [type(e).__name__ for e in events.events]
    assert type(_last_but_writes(events)).__name__ == "BatchDone"
    assert kinds.index("MetricsReported", 1) > kinds.index("Progress")


def test_checkpoint_is_captured_synchronously_and_written_in_background(tmp_path: Path) -> None:
    released = threading.Event()
    seen_release: list[bool] = []

    class SlowStore(CheckpointStore):
        def save(self, name: str, state: Mapping[str, Any], of: Any = None) -> CheckpointInfo:
            # Training must reach step 8 while this write is still in progress.
            seen_release.append(released.wait(timeout=30))
            return super().save(name, state, of)

    class Releasing(Noisy):
        def train(self) -> dict[str, float]:
            if self.t == 8:
                released.set()
            return super().train()

    events = Collector()
    store = SlowStore(tmp_path)
    worker = Worker(0, Releasing, store, events)
    worker.run(_batch(1, [(1, 0, 12, HP)], checkpoint_at=((1, 5),)))
    assert seen_release == [True]
    [saved] = events.of(CheckpointSaved)
    # The checkpoint holds the state at step 5 although w was mutated in place since.
    reference, _ = _worker(tmp_path / "ref")
    reference.run(_batch(1, [(1, 0, 5, HP)]))
    expected = reference._trainer.state_dict()  # type: ignore[union-attr]
    loaded = store.load(saved.ref)
    assert loaded["t"] == 5
    np.testing.assert_array_equal(loaded["w"], expected["w"])
    assert loaded["rng"] == expected["rng"]


class _DoneEvents(Collector):
    """Collects events; ``done`` is set at the first ``BatchDone``."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()

    def __call__(self, event: Any) -> None:
        super().__call__(event)
        if isinstance(event, BatchDone):
            self.done.set()


def test_batch_done_does_not_wait_for_its_last_checkpoint_write(tmp_path: Path) -> None:
    events = _DoneEvents()
    done = events.done

    class WaitingStore(CheckpointStore):
        def save(self, name: str, state: Mapping[str, Any], of: Any = None) -> CheckpointInfo:
            assert done.wait(timeout=30), "BatchDone waited for the checkpoint write"
            return super().save(name, state, of)

    worker = _Worker(0, Noisy, WaitingStore(tmp_path), events)
    worker.run(_batch(1, [(1, 0, 6, HP)], checkpoint_at=((1, 6),), evaluate_at=((1, 6),)))
    assert done.is_set()
    worker.flush()
    kinds = [type(e).__name__ for e in events.events]
    assert kinds.index("BatchDone") < kinds.index("CheckpointSaved")
    [saved] = events.of(CheckpointSaved)
    assert (saved.node, saved.step) == (1, 6) and worker.store.load(saved.ref)["t"] == 6
    worker.close()


def test_a_write_failing_after_the_batch_ended_is_reported(tmp_path: Path) -> None:
    events = _DoneEvents()
    done = events.done

    class FailingStore(CheckpointStore):
        def save(self, name: str, state: Mapping[str, Any], of: Any = None) -> CheckpointInfo:
            done.wait(timeout=30)
            raise OSError("disk full")

    worker = _Worker(0, Noisy, FailingStore(tmp_path), events)
    worker.run(_batch(1, [(1, 0, 6, HP)], checkpoint_at=((1, 6),)))
    worker.flush()
    assert events.of(BatchFailed) == [] and len(events.of(BatchDone)) == 1
    [failed] = events.of(CheckpointFailed)
    assert (failed.batch_id, failed.node, failed.step) == (1, 1, 6)
    assert "disk full" in failed.error
    worker.close()


class Script:
    """poll() that hands out instructions when the trainer reaches given steps."""

    def __init__(self, worker: Worker, plan: Mapping[int, list[Any]]) -> None:
        self.worker = worker
        self.plan = dict(plan)

    def __call__(self) -> list[Any]:
        trainer = self.worker._trainer
        t = trainer.t if trainer is not None else -1  # type: ignore[attr-defined]
        return self.plan.pop(t, [])


def test_add_checkpoint_ahead_behind_now_and_beyond(tmp_path: Path) -> None:
    worker, events = _worker(tmp_path, progress_interval=1e9)
    batch = _batch(5, [(1, 0, 4, HP), (2, 4, 10, HP)])
    script = Script(
        worker,
        {
            3: [
                AddCheckpoint(5, 0, node=2, step=7, evaluate=True),  # ahead
                AddCheckpoint(5, 0, node=1, step=2),  # behind
                AddCheckpoint(5, 0, node=1, step=3),  # exactly now
                AddCheckpoint(5, 0, node=2, step=11),  # beyond the batch
                AddCheckpoint(4, 0, node=1, step=8),  # another batch
            ]
        },
    )
    worker.run(batch, script)
    saved = sorted((e.node, e.step) for e in events.of(CheckpointSaved))
    assert saved == [(1, 3), (2, 7)]
    assert [(m.node, m.step) for m in events.of(MetricsReported)] == [(2, 7)]
    missed = [(m.batch_id, m.node, m.step) for m in events.of(SplitMissed)]
    assert missed == [(5, 1, 2), (5, 2, 11), (4, 1, 8)]
    store = worker.store
    for event in events.of(CheckpointSaved):
        assert store.load(event.ref)["t"] == event.step
    assert events.of(BatchDone)[0].steps == 10


def test_abort_stops_after_current_step_and_saves_nothing_more(tmp_path: Path) -> None:
    worker, events = _worker(tmp_path)
    batch = _batch(3, [(1, 0, 10, HP)], checkpoint_at=((1, 2), (1, 6)))
    script = Script(
        worker, {4: [Abort(3, 0), AddCheckpoint(3, 0, node=1, step=5)], 2: [Abort(99, 0)]}
    )
    worker.run(batch, script)
    assert [e.step for e in events.of(CheckpointSaved)] == [2]
    assert [(m.node, m.step) for m in events.of(SplitMissed)] == [(1, 5)]
    [done] = events.of(BatchDone)
    assert done.steps == 4 and isinstance(_last_but_writes(events), BatchDone)
    assert [c[2] for c in CALLS if c[1] == "train"] == [0, 1, 2, 3]
    # The aborted trainer stays in memory where it stopped and can continue.
    assert worker.position == ("root", (1, 4))
    worker.run(_batch(4, [(1, 4, 6, HP)], start_at=(1, 4)))
    assert worker.stats.reuses == 1
    _check_setup_contract({t: _values(HP, t) for t in range(6)})


def test_abort_before_first_step(tmp_path: Path) -> None:
    worker, events = _worker(tmp_path)
    worker.run(_batch(3, [(1, 0, 10, HP)]), lambda: [Abort(3, 0)])
    assert [type(e) for e in events.events] == [BatchDone]
    assert events.events[0].steps == 0


def test_abort_with_save_checkpoints_where_the_batch_stops(tmp_path: Path) -> None:
    """``Abort(save=True)`` (a stopping run): the model where the batch stops is
    checkpointed, and its ``CheckpointSaved`` comes before the ``BatchDone`` (the
    engine records it in the plan before it lets the run end)."""
    worker, events = _worker(tmp_path)
    batch = _batch(3, [(1, 0, 3, HP), (2, 3, 10, HP)], checkpoint_at=((1, 2),))
    worker.run(batch, Script(worker, {5: [Abort(3, 0, save=True)]}))
    saved = events.of(CheckpointSaved)
    assert [(c.node, c.step) for c in saved] == [(1, 2), (2, 5)]
    kinds = [type(e) for e in events.events]
    assert kinds[-1] is BatchDone and events.of(BatchDone)[0].steps == 5
    assert worker.store.load(saved[-1].ref)["t"] == 5
    # A fresh trainer restored from it goes on exactly as the one that was aborted.
    again, _ = _worker(tmp_path)
    again.run(_batch(4, [(2, 5, 8, HP)], start_at=(2, 5), start_checkpoint=saved[-1].ref))
    worker.run(_batch(5, [(2, 5, 8, HP)], start_at=(2, 5)))
    assert again._trainer is not None and worker._trainer is not None
    assert np.array_equal(again._trainer.w, worker._trainer.w)  # type: ignore[attr-defined]


@pytest.mark.parametrize("at", [0, 2])
def test_abort_with_save_adds_nothing_where_nothing_is_new(tmp_path: Path, at: int) -> None:
    """Aborted before its first step, or where it has just checkpointed: no more save."""
    worker, events = _worker(tmp_path)
    batch = _batch(3, [(1, 0, 10, HP)], checkpoint_at=((1, 2),))
    worker.run(batch, Script(worker, {at: [Abort(3, 0, save=True)]}))
    assert [c.step for c in events.of(CheckpointSaved)] == ([2] if at else [])
    assert events.of(BatchDone)[0].steps == at


@pytest.mark.parametrize(
    ("fail", "node", "step", "error", "where"),
    [
        ("train", 2, 3, "FloatingPointError: loss is nan", "in train"),
        ("setup", 2, 2, "ValueError: bad hp", "in setup"),
        ("evaluate", 1, 1, "KeyError: 'no metric'", "in evaluate"),
        ("init", 1, 0, "RuntimeError: init exploded", "in __init__"),
    ],
)
def test_trainer_exception_fails_batch_with_traceback(
    tmp_path: Path, fail: str, node: int, step: int, error: str, where: str
) -> None:
    worker, events = _worker(tmp_path)
    lr = Step(0.5, 1, 0.5)  # changes every step, so setup is called at step 2
    batch = _batch(
        8,
        [(1, 0, 2, {"lr": lr, "scale": SCALE}), (2, 2, 6, {"lr": lr, "scale": SCALE})],
        config={"seed": 1, "fail": fail},
        evaluate_at=((1, 1),),
        checkpoint_at=((1, 1),),
    )
    worker.run(batch)
    failed = events.events[-1]
    assert isinstance(failed, BatchFailed)
    assert (failed.batch_id, failed.worker, failed.node, failed.step) == (8, 0, node, step)
    assert failed.error == error
    assert "Traceback" in failed.traceback and where in failed.traceback
    assert not events.of(BatchDone)
    assert worker.position is None  # trainer dropped
    if fail in ("train", "setup"):
        # The checkpoint taken before the failure is still reported, before BatchFailed.
        assert [e.step for e in events.of(CheckpointSaved)] == [1]


def test_load_failures_fail_the_batch(tmp_path: Path) -> None:
    worker, events = _worker(tmp_path)
    worker.run(_batch(1, [(1, 0, 3, HP)], checkpoint_at=((1, 3),)))
    ref = events.of(CheckpointSaved)[0].ref
    worker.drop_trainer()
    worker.run(
        _batch(
            2,
            [(1, 3, 5, HP)],
            start_at=(1, 3),
            start_checkpoint=ref,
            config={"seed": 3, "fail": "load"},
        )
    )
    failed = events.events[-1]
    assert isinstance(failed, BatchFailed) and failed.error.startswith("RuntimeError")
    assert (failed.node, failed.step) == (1, 3) and "in load_state_dict" in failed.traceback
    # A missing checkpoint is a CheckpointError the scheduler can tell apart.
    worker.store.delete(ref)
    worker.run(_batch(3, [(1, 3, 5, HP)], start_at=(1, 3), start_checkpoint=ref))
    missing = events.events[-1]
    assert isinstance(missing, BatchFailed)
    assert missing.error.startswith("CheckpointError") and "does not exist" in missing.error
    # Starting past step 0 without a checkpoint or a held trainer is refused.
    worker.run(_batch(4, [(1, 3, 5, HP)], start_at=(1, 3)))
    assert isinstance(events.events[-1], BatchFailed)
    assert "without a start checkpoint" in events.events[-1].error


def test_snapshot_state_is_independent() -> None:
    arr = np.zeros(2)
    state = {"a": arr, "l": [arr, (1, "x")], "n": None}
    snap = snapshot_state(state)
    arr += 1
    assert snap["a"].tolist() == [0.0, 0.0] and snap["l"][0].tolist() == [0.0, 0.0]
    assert snap["l"][1] == (1, "x")


@pytest.mark.torch
def test_digits_trainer_split_run_is_bit_exact(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from stagetree.torch.examples import DigitsTrainer

    torch.set_num_threads(1)
    config = {"seed": 0, "batches_per_step": 2, "hidden": 16, "optimizer": "momentum"}
    hp = {"lr": MultiStep(0.1, [3], 0.5), "batch_size": Constant(32)}
    hp_b = {"lr": Constant(0.02), "batch_size": Step(16, 2, 2.0)}

    # Alone: root 0..4, then branch b 4..7.
    solo_store = CheckpointStore(tmp_path / "solo")
    solo_events = Collector()
    solo = Worker(0, DigitsTrainer, solo_store, solo_events)
    solo.run(_batch(1, [(1, 0, 4, hp), (2, 4, 7, hp_b)], config=config, evaluate_at=((2, 7),)))
    # Shared: root 0..4 with a checkpoint, then another worker resumes branch b.
    store = CheckpointStore(tmp_path / "shared")
    events = Collector()
    Worker(0, DigitsTrainer, store, events).run(
        _batch(1, [(1, 0, 4, hp)], config=config, checkpoint_at=((1, 4),))
    )
    ref = events.of(CheckpointSaved)[0].ref
    resumed = Worker(1, DigitsTrainer, store, events)
    resumed.run(
        _batch(
            2,
            [(2, 4, 7, hp_b)],
            config=config,
            start_at=(1, 4),
            start_checkpoint=ref,
            evaluate_at=((2, 7),),
        )
    )
    assert events.of(MetricsReported)[0].metrics == solo_events.of(MetricsReported)[0].metrics
    a = solo._trainer.model.state_dict()  # type: ignore[union-attr]
    b = resumed._trainer.model.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(a[k], b[k]) for k in a)


class _CountingStore(CheckpointStore):
    """A checkpoint store that counts the files it reads back."""

    reads = 0

    def load(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.reads += 1
        return super().load(*args, **kwargs)


def test_a_batch_starts_from_the_checkpoint_its_worker_kept_without_reading_it(
    tmp_path: Path,
) -> None:
    store = _CountingStore(tmp_path)
    events = Collector()
    worker = Worker(0, Noisy, store, events)
    worker.run(_batch(1, [(1, 0, 6, HP)], checkpoint_at=((1, 3), (1, 6))))
    refs = {e.step: e.ref for e in events.of(CheckpointSaved)}
    # The siblings of branch point 3, on the worker that wrote it: no file read.
    for bid in (2, 3):
        worker.run(
            _batch(bid, [(bid, 3, 5, HP)], start_at=(1, 3), start_checkpoint=refs[3],
                   evaluate_at=((bid, 5),))
        )  # fmt: skip
    assert store.reads == 0
    assert worker.stats.loads == 2 and worker.stats.kept_loads == 2
    # Another worker reads the file: the same results, step for step.
    other_events = Collector()
    other = Worker(1, Noisy, store, other_events)
    other.run(
        _batch(4, [(2, 3, 5, HP)], start_at=(1, 3), start_checkpoint=refs[3],
               evaluate_at=((2, 5),))
    )  # fmt: skip
    assert store.reads == 1 and other.stats.kept_loads == 0
    kept = [e.metrics for e in events.of(MetricsReported)]
    assert kept[0] == kept[1] == other_events.of(MetricsReported)[0].metrics
    # A position that does not match the ref's, or no bytes to keep: read from the store.
    worker.run(_batch(5, [(9, 6, 7, HP)], start_at=(1, 6), start_checkpoint=refs[6]))
    assert worker.stats.kept_loads == 3 and store.reads == 1
    bare_events = Collector()
    bare = Worker(2, Noisy, store, bare_events, keep_bytes=0)
    bare.run(_batch(1, [(1, 0, 4, HP)], checkpoint_at=((1, 3),)))
    bare.run(
        _batch(2, [(2, 3, 4, HP)], start_at=(1, 3),
               start_checkpoint=bare_events.of(CheckpointSaved)[0].ref)
    )  # fmt: skip
    assert bare.stats.kept_loads == 0 and store.reads == 2


def test_a_checkpoint_read_once_is_kept_for_the_next_sibling_batch(tmp_path: Path) -> None:
    writer_events = Collector()
    Worker(0, Noisy, CheckpointStore(tmp_path), writer_events).run(
        _batch(1, [(1, 0, 6, HP)], checkpoint_at=((1, 3),))
    )
    ref = writer_events.of(CheckpointSaved)[0].ref
    store = _CountingStore(tmp_path)
    events = Collector()
    reader = Worker(1, Noisy, store, events)
    # Two siblings of branch point 3 on a worker that did not write it: one read.
    for bid in (2, 3):
        reader.run(
            _batch(bid, [(bid, 3, 5, HP)], start_at=(1, 3), start_checkpoint=ref,
                   evaluate_at=((bid, 5),))
        )  # fmt: skip
    assert store.reads == 1
    assert reader.stats.loads == 2 and reader.stats.kept_loads == 1
    # The same results as a worker that reads the file each time.
    bare_events = Collector()
    bare = Worker(2, Noisy, store, bare_events, keep_bytes=0)
    for bid in (2, 3):
        bare.run(
            _batch(bid, [(bid, 3, 5, HP)], start_at=(1, 3), start_checkpoint=ref,
                   evaluate_at=((bid, 5),))
        )  # fmt: skip
    assert store.reads == 3 and bare.stats.kept_loads == 0
    got = [e.metrics for e in events.of(MetricsReported)]
    assert got == [e.metrics for e in bare_events.of(MetricsReported)]
    assert got[0] == got[1]
    # A file gone since: the batch fails as a lost checkpoint, kept copy or not.
    store.delete(ref)
    reader.run(_batch(4, [(4, 3, 5, HP)], start_at=(1, 3), start_checkpoint=ref))
    assert events.of(BatchFailed)[-1].kind == "checkpoint"


def test_kept_states_are_bounded_and_match_their_position() -> None:
    from stagetree.executors.kept import KeptStates, host_nbytes

    kept = KeptStates(max_bytes=200)
    a, b, c = ({"w": np.zeros(10), "t": i} for i in range(3))  # 80 bytes each
    assert kept.put("a", (1, 2), a) and kept.put("b", (1, 3), b)
    assert kept.get("a", (1, 2)) is a  # a is now the most recent
    assert kept.get("a", (1, 3)) is None and kept.get("x", (1, 2)) is None
    assert kept.put("c", (2, 3), c)  # 240 > 200: b (least recently used) goes
    assert kept.get("b", (1, 3)) is None and kept.get("c", None) is c
    assert kept.nbytes == 160 and len(kept) == 2
    assert not kept.put("d", (1, 1), {"w": np.zeros(30)})  # larger than the bound
    assert host_nbytes({"f": object()}) is None
    assert not kept.put("e", (1, 1), {"f": object()})
    kept.clear()
    assert len(kept) == 0 and kept.nbytes == 0


@pytest.mark.torch
def test_digits_trainer_restored_from_a_kept_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from stagetree.torch.examples import DigitsTrainer

    torch.set_num_threads(1)
    config = {"seed": 0, "batches_per_step": 2, "hidden": 16, "optimizer": "momentum",
              "dropout": 0.1}  # fmt: skip
    hp = {"lr": MultiStep(0.1, [3], 0.5), "batch_size": Constant(32)}
    hp_b = {"lr": Constant(0.02), "batch_size": Step(16, 2, 2.0)}
    store = _CountingStore(tmp_path)
    events = Collector()
    worker = Worker(0, DigitsTrainer, store, events)
    # Root 0..4 with a checkpoint at 4, continued to 6: the worker no longer holds 4.
    worker.run(_batch(1, [(1, 0, 6, hp)], config=config, checkpoint_at=((1, 4),)))
    ref = events.of(CheckpointSaved)[0].ref
    branch = _batch(2, [(2, 4, 7, hp_b)], config=config, start_at=(1, 4),
                    start_checkpoint=ref, evaluate_at=((2, 7),))  # fmt: skip
    models = []
    for w in (worker, worker, Worker(1, DigitsTrainer, store, events)):
        w.run(branch)
        models.append(w._trainer.state_dict())  # type: ignore[union-attr]
    # Twice from the kept state (the first run did not change it), once from the file.
    assert worker.stats.kept_loads == 2 and store.reads == 1
    metrics = [e.metrics for e in events.of(MetricsReported)]
    assert metrics[0] == metrics[1] == metrics[2]
    # Every tensor and array of the trainers' states (model, optimizer, generators).
    flat = [dict(_tensors(m)) for m in models]
    assert flat[0].keys() == flat[1].keys() == flat[2].keys()
    assert any(k.startswith("/objects/optimizer") for k in flat[0])
    for key, value in flat[0].items():
        same = np.array_equal if isinstance(value, np.ndarray) else torch.equal
        assert same(value, flat[1][key]) and same(value, flat[2][key]), key


def _tensors(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """The tensors of a nested state with their paths."""
    if isinstance(obj, Mapping):
        return [t for k, v in obj.items() for t in _tensors(v, f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [t for i, v in enumerate(obj) for t in _tensors(v, f"{path}/{i}")]
    return [(path, obj)] if hasattr(obj, "dtype") and hasattr(obj, "shape") else []


def test_a_points_events_and_the_batch_end_go_out_in_one_message_each(tmp_path: Path) -> None:
    """With ``emit_many`` (a process worker's pipe), a point's curve and metrics go out
    as one message, the last step's with the BatchDone; Progress is never held, and the
    events and their order are those of a worker that sends them one by one."""
    batch = _batch(
        7,
        [(1, 0, 4, HP), (2, 4, 8, HP)],
        evaluate_at=((1, 2), (2, 8)),
        checkpoint_at=((1, 4),),
    )
    messages: list[Any] = []
    lock = threading.Lock()

    def send(message: Any) -> None:
        with lock:
            messages.append(message)

    worker = Worker(0, Noisy, CheckpointStore(tmp_path / "a"), send, emit_many=send)
    worker.progress_interval = 1e9
    worker.run(batch)
    one_by_one, events = _worker(tmp_path / "b", progress_interval=1e9)
    one_by_one.run(batch)

    def kinds(seq: list[Any]) -> list[str]:
        return [type(e).__name__ for e in seq if not isinstance(e, CheckpointSaved)]

    flat = [e for m in messages for e in (m if isinstance(m, list) else [m])]
    assert kinds(flat) == kinds(events.events)
    groups = [kinds(m) for m in messages if isinstance(m, list)]
    assert groups == [
        ["CurveReported", "MetricsReported"],
        ["CurveReported", "MetricsReported", "BatchDone"],
    ]
    # The checkpoint at step 4 is reported after its step's Progress.
    [saved] = [i for i, e in enumerate(flat) if isinstance(e, CheckpointSaved)]
    progress_4 = next(i for i, e in enumerate(flat) if isinstance(e, Progress) and e.step == 4)
    assert saved > progress_4
