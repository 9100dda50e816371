"""The scheduler driven by a tiny discrete-time simulator: every busy worker trains one
step per tick and reports Progress / MetricsReported / CheckpointSaved / BatchDone;
trials arrive (and leave) at random ticks while batches run."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest

from stagetree.hp import Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import (
    NodeAdded,
    RequestAdded,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RootAdded,
    Scheduler,
)
from stagetree.stages import unique_steps
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    SplitMissed,
    WorkerLost,
    WorkerReady,
)

Key = tuple[int, int]
RUNGS = (30, 60, 90, 120)


@dataclass
class SimWorker:
    batch: RunBatch
    pos: int
    evaluate: set[Key]
    checkpoint: set[Key]
    aborted: bool = False


@dataclass
class Trial:
    root: str
    hp: dict[str, Any]
    steps: int
    arrive: int
    leave: int | None = None
    rungs: tuple[int, ...] = RUNGS
    keys: list[Key] = field(default_factory=list)


class Sim:
    def __init__(self, workers: int, policy: str = "critical_path") -> None:
        self.plan = MemoryPlanStorage()
        # Chaos kills workers anywhere (external deaths): no death limit here.
        self.sched = Scheduler(num_workers=workers, policy=policy, max_worker_deaths=10**6)
        self.workers: dict[int, SimWorker | None] = dict.fromkeys(range(workers))
        self.next_worker = workers
        self.metrics: dict[Key, dict[str, float]] = {}
        self.refs: dict[Key, int] = {}
        self.requested: set[Key] = set()
        self.batches: list[RunBatch] = []
        self.splits = 0
        self.missed = 0
        self.roots: set[str] = set()

    # -- plumbing

    def feed(self, event: Any) -> None:
        queue: deque[Any] = deque([event])
        while queue:
            for x in self.sched.handle(queue.popleft()):
                if isinstance(x, RunBatch):
                    assert self.workers.get(x.worker, "gone") is None, "worker not idle"
                    self.batches.append(x)
                    self.workers[x.worker] = SimWorker(
                        x, x.start_step, set(x.evaluate_at), set(x.checkpoint_at)
                    )
                elif isinstance(x, AddCheckpoint):
                    w = self.workers.get(x.worker)
                    if w is None or w.batch.batch_id != x.batch_id:
                        continue
                    if x.step > w.pos:
                        self.splits += 1
                        w.checkpoint.add((x.node, x.step))
                        if x.evaluate:
                            w.evaluate.add((x.node, x.step))
                    else:
                        self.missed += 1
                        queue.append(SplitMissed(x.batch_id, x.worker, x.node, x.step))
                elif isinstance(x, Abort):
                    w = self.workers.get(x.worker)
                    if w is not None and w.batch.batch_id == x.batch_id:
                        w.aborted = True
                elif isinstance(x, RequestDone):
                    key = (x.node, x.step)
                    assert self.refs.get(key, 0) > 0, f"done for a request nobody holds: {key}"
                    self.metrics[key] = dict(x.metrics)
                    self.refs.pop(key)
                elif isinstance(x, RequestFailed):
                    raise AssertionError(f"unexpected failure {x}")

    def add(self, trial: Trial) -> None:
        if trial.root not in self.roots:
            self.roots.add(trial.root)
            self.feed(RootAdded(trial.root, {"root": trial.root}))
        ins = self.plan.insert_trial(trial.root, trial.hp, trial.steps, request=False)
        for node in ins.new_nodes:
            self.feed(NodeAdded(node))
        for r in trial.rungs:
            if r > trial.steps:
                break
            key = self.plan.locate(trial.root, trial.hp, r)
            assert key is not None
            trial.keys.append(key)
            self.requested.add(key)
            if key in self.metrics:  # the study answers it from the plan
                continue
            self.refs[key] = self.refs.get(key, 0) + 1
            self.feed(RequestAdded(*key))

    def cancel(self, trial: Trial) -> None:
        for key in trial.keys:
            if self.refs.get(key, 0) > 0:
                self.refs[key] -= 1
                if not self.refs[key]:
                    del self.refs[key]
                self.feed(RequestCancelled(*key))

    def lose(self, rng: random.Random) -> None:
        busy = [w for w, s in self.workers.items() if s is not None]
        if not busy:
            return
        wid = rng.choice(busy)
        state = self.workers.pop(wid)
        assert state is not None
        self.feed(WorkerLost(wid, state.batch.batch_id, "chaos"))
        self.workers[self.next_worker] = None
        self.feed(WorkerReady(self.next_worker))
        self.next_worker += 1

    def tick(self) -> None:
        for wid in sorted(self.workers):
            w = self.workers.get(wid)
            if w is None:
                continue
            b = w.batch
            end = b.segments[-1].stop if b.segments else b.start_step
            if not b.segments and b.start_at in w.evaluate:  # evaluation only
                assert b.start_at is not None
                self.feed(MetricsReported(b.batch_id, wid, *b.start_at, {"loss": 0.0}))
            elif w.pos < end and not w.aborted:
                seg = next(s for s in b.segments if s.start <= w.pos < s.stop)
                w.pos += 1
                key = (seg.node, w.pos)
                self.feed(Progress(b.batch_id, wid, seg.node, w.pos, 1.0))
                if key in w.evaluate:
                    self.feed(MetricsReported(b.batch_id, wid, *key, {"loss": w.pos / 1000}))
                if key in w.checkpoint:
                    self.feed(CheckpointSaved(b.batch_id, wid, *key, f"ck{key}", 1, 0.0))
                if w.pos < end:
                    continue
            self.workers[wid] = None
            self.feed(BatchDone(b.batch_id, wid, 1.0, w.pos - b.start_step))

    def run(
        self,
        trials: list[Trial],
        rng: random.Random | None = None,
        lose_prob: float = 0.0,
        limit: int = 20_000,
    ) -> int:
        t = 0
        arrivals = sorted(trials, key=lambda tr: tr.arrive)
        leaving = sorted((tr for tr in trials if tr.leave is not None), key=lambda tr: tr.leave)  # type: ignore[arg-type, return-value]
        while arrivals or leaving or not self.sched.idle():
            while arrivals and arrivals[0].arrive <= t:
                self.add(arrivals.pop(0))
            while leaving and leaving[0].leave <= t:  # type: ignore[operator]
                self.cancel(leaving.pop(0))
            if rng is not None and rng.random() < lose_prob:
                self.lose(rng)
            self.tick()
            t += 1
            assert t < limit, "simulation does not finish"
        return t

    @property
    def unique(self) -> int:
        nodes = {n.id: n for n in self.plan.nodes()}
        return unique_steps(nodes, self.requested)

    @property
    def planned(self) -> int:
        return sum(s.stop - s.start for b in self.batches for s in b.segments)


def random_trials(rng: random.Random, n: int, horizon: int) -> list[Trial]:
    values = [0.1, 0.03, 0.01]
    trials = []
    for _ in range(n):
        lr = Piecewise([rng.choice(values) for _ in range(4)], [30, 60, 90])
        trials.append(
            Trial(rng.choice("ab"), {"lr": lr}, rng.choice(RUNGS), rng.randint(0, horizon))
        )
    return trials


@pytest.mark.parametrize("policy", ["critical_path", "bfs", "thr"])
@pytest.mark.parametrize("seed", range(8))
def test_executed_steps_equal_unique_steps(seed: int, policy: str) -> None:
    """Trials request every rung on their way (like ASHA), so every branch point is a
    request point: even trials arriving mid-run never need a recomputation."""
    rng = random.Random(seed)
    sim = Sim(workers=rng.randint(1, 4), policy=policy)
    sim.run(random_trials(rng, rng.randint(5, 25), horizon=200))
    assert sim.metrics.keys() == sim.requested
    assert sim.missed == 0
    assert sim.sched.steps_executed == sim.planned == sim.unique


def test_live_splits_happen_in_simulation() -> None:
    """Trials that only ask for their final step, all branching from one long trial
    while it runs: the running worker drops checkpoints at the branch points."""
    sim = Sim(workers=3)
    base = [0.1, 0.1, 0.1, 0.1]
    trials = [Trial("a", {"lr": Piecewise(base, [30, 60, 90])}, 120, 0, rungs=(120,))]
    for i, at in enumerate((30, 60, 90)):
        values = base[: at // 30] + [0.01] * (4 - at // 30)
        lr = Piecewise(values, [30, 60, 90])
        trials.append(Trial("a", {"lr": lr}, 120, 5 + 3 * i, rungs=(120,)))
    sim.run(trials)
    assert sim.splits == 3 and sim.missed == 0
    assert sim.sched.steps_executed == sim.unique == 120 + 90 + 60 + 30
    assert len(sim.metrics) == 4


def test_trials_asking_only_for_their_end_split_running_batches() -> None:
    """Without rung requests a branch point may be passed before its trial arrives (a
    recomputation), but live splits catch those still ahead: never worse than training
    every trial alone, and far better."""
    splits = 0
    for seed in range(6):
        rng = random.Random(200 + seed)
        sim = Sim(workers=rng.randint(1, 3))
        trials = random_trials(rng, 15, horizon=100)
        for trial in trials:
            trial.rungs = (trial.steps,)
        sim.run(trials)
        assert sim.metrics.keys() == sim.requested
        total = sum(tr.steps for tr in trials)
        assert sim.unique <= sim.sched.steps_executed == sim.planned <= total
        splits += sim.splits
    assert splits > 0


@pytest.mark.parametrize("seed", range(6))
def test_cancellations_and_lost_workers_settle_everything(seed: int) -> None:
    rng = random.Random(100 + seed)
    sim = Sim(workers=rng.randint(1, 3))
    trials = random_trials(rng, 20, horizon=150)
    for trial in rng.sample(trials, 6):
        trial.leave = trial.arrive + rng.randint(0, 60)
    sim.run(trials, rng=rng, lose_prob=0.01)
    assert sim.refs == {}  # every live reference was answered
    live_keys = {k for tr in trials if tr.leave is None for k in tr.keys}
    assert live_keys <= sim.metrics.keys()
    assert sim.sched.idle() and sim.sched.running == {}
    nodes = {n.id: n for n in sim.plan.nodes()}
    assert sim.sched.steps_executed >= unique_steps(nodes, live_keys)
