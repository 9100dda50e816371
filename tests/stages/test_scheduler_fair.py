"""Fair share across studies: scheduler decisions alone, driven by a tick simulator in
which every busy worker trains one step per tick (no processes)."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from stagetree.exceptions import SchedulerError
from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.scheduler import (
    NodeAdded,
    RequestAdded,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RootAdded,
    Scheduler,
    StudyWeight,
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
)

Key = tuple[int, int]


@dataclass
class _Worker:
    batch: RunBatch
    pos: int
    evaluate: set[Key]
    checkpoint: set[Key]
    aborted: bool = False


class FairSim:
    """A scheduler and workers that train one step per tick, reporting like real ones.

    Roots are named after their study (``"A3"`` belongs to study ``"A"``) where a test
    needs to tell which study a batch works for. Inside ``with sim.together():`` events
    are held back and handled at once on leaving (one decision sees them all, like a
    study loading its plan).
    """

    def __init__(self, workers: int, policy: str = "critical_path") -> None:
        self.plan = MemoryPlanStorage()
        self.sched = Scheduler(num_workers=workers, policy=policy)
        self.held: list[Any] | None = None
        self.workers: dict[int, _Worker | None] = dict.fromkeys(range(workers))
        self.batches: list[RunBatch] = []
        self.done: dict[Key, dict[str, float]] = {}
        self.keys: dict[str, set[Key]] = {}  # every key each study asked for
        self.roots: set[str] = set()
        self.aborts = 0

    @contextmanager
    def together(self) -> Iterator[None]:
        self.held = []
        try:
            yield
        finally:
            events, self.held = self.held, None
        self.feed(*events)

    def feed(self, *events: Any) -> list[Any]:
        if self.held is not None:
            self.held.extend(events)
            return []
        out: list[Any] = []
        queue: deque[Any] = deque([events])
        while queue:
            for x in self.sched.handle_all(queue.popleft()):
                out.append(x)
                if isinstance(x, RunBatch):
                    assert self.workers[x.worker] is None, "worker not idle"
                    self.batches.append(x)
                    self.workers[x.worker] = _Worker(
                        x, x.start_step, set(x.evaluate_at), set(x.checkpoint_at)
                    )
                elif isinstance(x, AddCheckpoint):
                    w = self.workers.get(x.worker)
                    if w is None or w.batch.batch_id != x.batch_id:
                        continue
                    if x.step > w.pos:
                        w.checkpoint.add((x.node, x.step))
                        if x.evaluate:
                            w.evaluate.add((x.node, x.step))
                    else:
                        queue.append([SplitMissed(x.batch_id, x.worker, x.node, x.step)])
                elif isinstance(x, Abort):
                    w = self.workers.get(x.worker)
                    if w is not None and w.batch.batch_id == x.batch_id:
                        w.aborted = True
                        self.aborts += 1
                elif isinstance(x, RequestDone):
                    self.done[(x.node, x.step)] = dict(x.metrics)
                elif isinstance(x, RequestFailed):
                    raise AssertionError(f"unexpected failure {x}")
        return out

    def trial(
        self,
        study: str,
        root: str,
        hp: dict[str, Any] | None = None,
        steps: int = 100,
        rungs: tuple[int, ...] = (),
    ) -> list[Key]:
        """Insert a trial; request its last step (and ``rungs``) for ``study``."""
        if root not in self.roots:
            self.roots.add(root)
            self.feed(RootAdded(root, {"root": root}))
        hp = {"lr": Constant(0.1)} if hp is None else hp
        ins = self.plan.insert_trial(root, hp, steps, request=False)
        for node in ins.new_nodes:
            self.feed(NodeAdded(node))
        keys = []
        for r in (*rungs, steps):
            key = self.plan.locate(root, hp, r)
            assert key is not None
            keys.append(key)
            self.keys.setdefault(study, set()).add(key)
            self.feed(RequestAdded(*key, study=study))
        return keys

    def tick(self) -> None:
        for wid in sorted(self.workers):
            w = self.workers[wid]
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

    def running(self) -> list[str]:
        """The study of each busy worker's batch (from its root's name), in order."""
        return sorted(w.batch.root_key[0] for w in self.workers.values() if w is not None)

    def open(self, study: str) -> bool:
        """Whether ``study`` still has requests without metrics."""
        return any(k not in self.done for k in self.keys.get(study, ()))

    def run(self, limit: int = 100_000) -> None:
        for _ in range(limit):
            if self.sched.idle():
                return
            self.tick()
        raise AssertionError("simulation does not finish")

    @property
    def usage(self) -> dict[str, float]:
        return self.sched.usage


def many(sim: FairSim, study: str, n: int, steps: int = 100, first: int = 0) -> None:
    """``n`` disjoint trials of ``steps`` steps for ``study`` (one root each, numbered
    from ``first``)."""
    for i in range(first, first + n):
        sim.trial(study, f"{study}{i}", steps=steps)


# ------------------------------------------------------------------------- weights


def test_equal_weights_share_two_workers_one_each() -> None:
    sim = FairSim(workers=2)
    with sim.together():
        many(sim, "A", 8)
        many(sim, "B", 8)
    assert sim.running() == ["A", "B"]
    while sim.open("A") and sim.open("B"):
        assert sim.running() == ["A", "B"]
        usage = sim.usage
        assert abs(usage["A"] - usage["B"]) <= 100  # one batch
        sim.tick()
    sim.run()
    assert sim.usage == {"A": 800.0, "B": 800.0}
    assert sim.sched.steps_executed == 1600


def test_weights_two_to_one_on_three_workers() -> None:
    sim = FairSim(workers=3)
    sim.feed(StudyWeight("A", 2.0))
    with sim.together():
        many(sim, "A", 12)
        many(sim, "B", 12)
    assert sim.running() == ["A", "A", "B"]
    ticks = 0
    while sim.open("A") and sim.open("B"):
        assert sim.running() == ["A", "A", "B"]
        usage = sim.usage
        # Per unit of weight the studies stay within one batch of each other.
        assert abs(usage["A"] / 2 - usage["B"]) <= 100
        sim.tick()
        ticks += 1
    assert ticks == 600  # B's 12 batches on one worker; A's 12 took two at a time
    assert sim.usage == {"A": 1200.0, "B": 600.0}
    sim.run()


def test_weights_two_to_one_on_one_worker_over_time() -> None:
    sim = FairSim(workers=1)
    sim.feed(StudyWeight("B", 1.0))
    sim.feed(StudyWeight("A", 2.0))
    with sim.together():
        many(sim, "A", 10, steps=50)
        many(sim, "B", 10, steps=50)
    while sim.open("A") and sim.open("B"):
        usage = sim.usage
        assert abs(usage["A"] / 2 - usage["B"]) <= 50  # one batch
        sim.tick()
    order = "".join(b.root_key[0] for b in sim.batches)
    assert order.startswith("ABAABAABAABAAB")
    sim.run()
    assert sim.usage == {"A": 500.0, "B": 500.0}


@pytest.mark.parametrize("seed", range(10))
def test_usage_per_weight_stays_within_one_batch(seed: int) -> None:
    """Random weights, batch lengths and worker counts: while both studies have work
    waiting, their usage per unit of weight differs by at most the longest batch in
    the lighter study's units (the fair choice is made a batch at a time; batches
    already given out count at once, so workers freed together are shared out)."""
    rng = random.Random(seed)
    sim = FairSim(workers=rng.randint(1, 6))
    weights = {"A": rng.choice([0.5, 1.0, 2.0, 3.0]), "B": rng.choice([0.5, 1.0, 2.0, 3.0])}
    sim.feed(*(StudyWeight(s, w) for s, w in weights.items()))
    longest = 0
    with sim.together():
        for study in weights:
            for i in range(rng.randint(10, 30)):
                steps = rng.randint(20, 200)
                longest = max(longest, steps)
                sim.trial(study, f"{study}{i}", steps=steps)
    tolerance = longest / min(weights.values())
    while {sim.plan.node(n).root_key[0] for n, _ in sim.sched.pending()} == {"A", "B"}:
        usage = sim.usage
        assert abs(usage["A"] / weights["A"] - usage["B"] / weights["B"]) <= tolerance
        sim.tick()
    sim.run()


def test_a_study_alone_gets_every_worker_whatever_its_weight() -> None:
    sim = FairSim(workers=4)
    sim.feed(StudyWeight("solo", 0.1))
    sim.feed(StudyWeight("other", 10.0))  # weighs a lot but asks for nothing
    for i in range(6):
        sim.trial("solo", f"s{i}")
    assert len(sim.batches) == 4 and sim.sched.idle_workers == []
    sim.run()
    assert sim.usage == {"solo": 600.0, "other": 0.0}


def test_work_conserving_when_a_study_has_nothing_ready() -> None:
    """A's single chain can use one worker at a time, however heavy A is: B takes the
    others, and every worker stays busy while B has work."""
    sim = FairSim(workers=3)
    sim.feed(StudyWeight("A", 100.0))
    sim.trial("A", "A0", steps=400, rungs=(100, 200, 300))
    many(sim, "B", 6)
    assert sim.running() == ["A", "B", "B"]
    while sim.open("B"):
        assert sim.sched.idle_workers == []
        assert sim.running().count("A") == 1
        sim.tick()
    sim.run()
    assert sim.usage == {"A": 400.0, "B": 600.0}


def test_a_late_study_does_not_take_every_worker_to_catch_up() -> None:
    """Virtual time: B arrives after A used 1100 steps; it starts level with A (its own
    usage still counts only what it trained) and the studies share the workers from
    then on instead of B taking both for 1100 steps."""
    sim = FairSim(workers=2)
    many(sim, "A", 20)
    for _ in range(550):
        sim.tick()
    assert sim.usage == {"A": 1100.0}
    many(sim, "B", 10)
    assert sim.usage["B"] == 0.0
    for _ in range(50):  # A's two batches run out; then one worker each
        sim.tick()
    for _ in range(400):
        assert sim.running() == ["A", "B"]
        sim.tick()
    assert sim.usage == {"A": 1600.0, "B": 400.0}
    sim.run()


def test_a_study_that_comes_back_starts_level_with_the_active_ones() -> None:
    sim = FairSim(workers=2)
    with sim.together():
        many(sim, "A", 1)
        many(sim, "B", 4)
    sim.run()
    assert sim.usage == {"A": 100.0, "B": 400.0}
    # Both come back: B's lead of 300 steps, taken while A had nothing to do, is not
    # held against B: A starts level with B.
    with sim.together():
        many(sim, "B", 4, first=10)
        many(sim, "A", 4, first=10)
    while sim.open("A") and sim.open("B"):
        assert sim.running() == ["A", "B"]
        sim.tick()
    assert sim.usage == {"A": 500.0, "B": 800.0}


# ------------------------------------------------------------------------- sharing


def test_a_request_both_studies_hold_is_trained_once_and_charged_to_both() -> None:
    sim = FairSim(workers=2)
    (key,) = sim.trial("A", "r")
    assert sim.trial("B", "r") == [key]
    assert len(sim.batches) == 1 and sim.sched.idle_workers == [1]
    assert sim.sched.live_claims == {key: {"A": 1, "B": 1}}
    assert sim.sched.live_requests == {key: 2}
    sim.run()
    assert sim.usage == {"A": 100.0, "B": 100.0}
    assert sim.sched.steps_executed == 100


def test_a_shared_prefix_is_trained_once_and_charged_to_both() -> None:
    """A's trial and B's share steps 0..50: the chain chosen for A trains them once,
    checkpointing at the branch point, where B's continuation starts."""
    sim = FairSim(workers=2)
    with sim.together():
        sim.trial("A", "r", {"lr": Constant(0.1)}, 100)
        sim.trial("B", "r", {"lr": MultiStep(0.1, [50], 0.1)}, 120)
    (first,) = sim.batches
    assert [(s.node, s.start, s.stop) for s in first.segments] == [(1, 0, 50), (1, 50, 100)]
    assert (1, 50) in first.checkpoint_at
    assert sim.sched.idle_workers == [1]  # B waits for the checkpoint; no recomputation
    sim.run()
    second = sim.batches[1]
    assert (second.start_step, second.start_at) == (50, (1, 50))
    assert sim.sched.steps_executed == 50 + 50 + 70
    assert sim.usage == {"A": 100.0, "B": 50.0 + 70.0}


@pytest.mark.parametrize("policy", ["critical_path", "bfs", "thr"])
@pytest.mark.parametrize("seed", range(4))
def test_two_studies_on_shared_trees_train_unique_steps_only(seed: int, policy: str) -> None:
    """Trials of two studies on two shared roots, requested before training starts:
    sharing is never given up for fairness (executed steps are the unique steps), and
    each study is charged exactly the unique steps of its own requests."""
    rng = random.Random(seed)
    sim = FairSim(workers=rng.randint(2, 4), policy=policy)
    sim.feed(StudyWeight("B", rng.choice([0.5, 1.0, 3.0])))
    values = [0.1, 0.03, 0.01]
    for _ in range(rng.randint(6, 16)):
        lr = Piecewise([rng.choice(values) for _ in range(4)], [30, 60, 90])
        steps = rng.choice((30, 60, 90, 120))
        rungs = tuple(r for r in (30, 60, 90) if r < steps)
        sim.trial(rng.choice("AB"), rng.choice(("x", "y")), {"lr": lr}, steps, rungs)
    sim.run()
    nodes = {n.id: n for n in sim.plan.nodes()}
    every = set().union(*sim.keys.values())
    assert sim.done.keys() == every
    assert sim.sched.steps_executed == unique_steps(nodes, every)
    for study, keys in sim.keys.items():
        assert sim.usage[study] == unique_steps(nodes, keys)


@pytest.mark.parametrize("seed", range(6))
def test_two_studies_arriving_while_batches_run_still_share_every_step(seed: int) -> None:
    """As in the single-study simulation, trials that request every rung on their way
    never cost a recomputation, even when they arrive (for either study) mid-run."""
    rng = random.Random(100 + seed)
    sim = FairSim(workers=rng.randint(1, 4))
    sim.feed(StudyWeight("A", rng.choice([0.5, 1.0, 2.0])))
    values = [0.1, 0.03, 0.01]
    arrivals = []
    for _ in range(rng.randint(8, 20)):
        lr = Piecewise([rng.choice(values) for _ in range(4)], [30, 60, 90])
        steps = rng.choice((30, 60, 90, 120))
        rungs = tuple(r for r in (30, 60, 90) if r < steps)
        spec = (rng.choice("AB"), rng.choice(("x", "y")), {"lr": lr}, steps, rungs)
        arrivals.append((rng.randint(0, 150), spec))
    arrivals.sort(key=lambda a: a[0])
    t = 0
    while arrivals or not sim.sched.idle():
        while arrivals and arrivals[0][0] <= t:
            study, root, hp, steps, rungs = arrivals.pop(0)[1]
            sim.trial(study, root, hp, steps, rungs)
        sim.tick()
        t += 1
    nodes = {n.id: n for n in sim.plan.nodes()}
    every = set().union(*sim.keys.values())
    assert sim.done.keys() == every
    assert sim.sched.steps_executed == unique_steps(nodes, every)
    assert sim.keys.keys() <= sim.usage.keys()


# ------------------------------------------------------------------------- cancelling


def test_cancelling_a_studys_requests_removes_its_claim() -> None:
    sim = FairSim(workers=2)
    with sim.together():
        a_keys = [k for i in range(4) for k in sim.trial("A", f"A{i}")]
        many(sim, "B", 4)
    for _ in range(10):
        sim.tick()
    assert sim.running() == ["A", "B"]
    # Another study cannot cancel A's references; A's are dropped one by one.
    sim.feed(RequestCancelled(*a_keys[0], study="B"))
    assert sim.sched.live_claims[a_keys[0]] == {"A": 1}
    out: list[Any] = []
    for key in a_keys:
        out += sim.feed(RequestCancelled(*key, study="A"))
    assert all("A" not in claims for claims in sim.sched.live_claims.values())
    (abort,) = [x for x in out if isinstance(x, Abort)]  # A's running batch is not needed
    assert sim.usage["A"] == 10.0
    sim.tick()  # the aborted batch ends; its worker goes to B
    assert sim.running() == ["B", "B"]
    sim.run()
    assert sim.usage == {"A": 10.0, "B": 400.0}
    assert abort.worker == 0 and sim.aborts == 1


def test_cancelling_one_study_of_a_shared_request_keeps_it_for_the_other() -> None:
    sim = FairSim(workers=1)
    (key,) = sim.trial("A", "r")
    sim.trial("B", "r")
    sim.feed(RequestAdded(*key, count=2, study="A"))
    for _ in range(40):
        sim.tick()
    out = sim.feed(RequestCancelled(*key, count=3, study="A"))
    assert not any(isinstance(x, Abort) for x in out)
    assert sim.sched.live_claims == {key: {"B": 1}}
    assert sim.sched.live_requests == {key: 1}
    sim.run()
    assert sim.done.keys() == {key}
    # A is charged for the 40 steps trained while it held the request.
    assert sim.usage == {"A": 40.0, "B": 100.0}


def test_cancelling_more_than_a_study_holds_is_refused() -> None:
    sim = FairSim(workers=0)
    (key,) = sim.trial("A", "r")
    sim.trial("B", "r")
    with pytest.raises(SchedulerError, match="by study 'A': it holds 1"):
        sim.feed(RequestCancelled(*key, count=2, study="A"))
    # The anonymous study holds nothing here: nothing of its own to cancel.
    assert sim.feed(RequestCancelled(*key)) == []
    assert sim.sched.live_requests == {key: 2}


# ------------------------------------------------------------------------- weights in


@pytest.mark.parametrize("weight", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, "2", None, True])
def test_bad_weights_are_refused_naming_the_study(weight: Any) -> None:
    sched = Scheduler(num_workers=1)
    with pytest.raises(ValueError, match=r"study 'tenant-7'.*" + repr(weight).replace("'", "")):
        sched.handle(StudyWeight("tenant-7", weight))


def test_good_weights_are_accepted() -> None:
    sched = Scheduler(num_workers=1)
    for w in (1, 0.25, 3.5, 1e-9):
        assert sched.handle(StudyWeight("s", w)) == []
    assert sched.usage == {"s": 0.0}


def test_the_anonymous_study_is_a_study_too() -> None:
    """Existing callers pass no study: their requests belong to ``""``, which shares
    with named studies like any other."""
    sim = FairSim(workers=2)
    with sim.together():
        many(sim, "A", 3)
        for i in range(3):
            ins = sim.plan.insert_trial(f"anon{i}", {"lr": Constant(0.1)}, 100, request=False)
            sim.feed(RootAdded(f"anon{i}", {}), *(NodeAdded(n) for n in ins.new_nodes))
            sim.keys.setdefault("", set()).add((ins.node, ins.step))
            sim.feed(RequestAdded(ins.node, ins.step))
    assert sim.running() == ["A", "a"]
    sim.run()
    assert sim.usage == {"A": 300.0, "": 300.0}
