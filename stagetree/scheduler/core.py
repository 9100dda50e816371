"""The I/O-free scheduler: events in, instructions and notices out.

In the style of dask.distributed's scheduler state machine: :meth:`Scheduler.handle`
applies one event to an in-memory view (nodes, root configs, live requests with
reference counts, durable checkpoints, running batches and how far they got, idle
workers) and returns what to do. Every decision sees the stage tree
(:func:`stagetree.stages.build_stage_tree`) of the live requests that no running batch
has promised to evaluate, the durable checkpoints and the positions running batches
will still pass; it is kept between decisions one plan tree at a time
(:class:`~stagetree.scheduler.forest.StageForest`), built again only where those
inputs changed, and equals a whole build.

Decisions after each event that can change them:

1. **Live splits.** A pending request whose remaining work starts at a position a
   running batch will pass gets an ``AddCheckpoint`` to that batch (with ``evaluate``
   when the request sits exactly there). Its continuation waits for the checkpoint. A
   ``SplitMissed`` answer makes the scheduler plan it from the latest durable model.
2. **Assignment.** While a worker is idle and a stage tree root is ready (fresh or
   from a durable checkpoint), the policy picks a chain of stages and the scheduler
   emits one ``RunBatch``: evaluate at every request point of the chain, checkpoint
   at request points, at branch points where other stages continue and at the end,
   except where a durable checkpoint exists.
   With several studies holding ready work, the chain is chosen for the study
   furthest behind its fair share, among the stages its requests need (see
   :class:`Scheduler`: fair share across studies).
3. **Preemption.** A running batch that no live request needs any more (nothing it
   will evaluate, nothing waiting for its checkpoints) gets an ``Abort``. Fair share
   never preempts: a study behind its share gets the next free workers instead.

Fusion (``max_fused > 1`` and a tree whose ``RootAdded.fusible`` is not empty): the
chosen chain stops after its first branching stage, and sibling chains that start from
the same model and differ only in fusible sequences join it, up to ``max_fused`` and
shared out over the free workers, as one ``RunFused`` job; each member is an ordinary
batch from then on (its own splits, abort, terminal event; a worker is free once all
its members ended). A tree whose fused steps were measured not to pay (the estimator's
``fused_step``) is no longer fused, nor one whose trainer could not be (``FusionFailed``).

Failures: ``BatchFailed`` plans the stage again up to ``max_retries`` times, then emits
``RequestFailed`` for every live request that cannot be reached without the failed
step or point (requests behind a later durable checkpoint, or covered by another
running batch, are spared); a failure at a point (evaluating or checkpointing the model
at a step) fails the request at that point too, so no failure is retried forever. With
``kind="checkpoint"`` the batch's start checkpoint is forgotten and the work planned
again from an earlier one. ``WorkerLost`` returns its batch's unfinished work to
pending; checkpoints it reported stay valid. A worker that dies more than
``max_worker_deaths`` times in the same stage (a segfault, an out-of-memory kill, an
``os._exit`` in the trainer) fails the requests behind the point it last reported.

Device needs (TreeML §5.2): a tree's stages go only to workers with at least the
devices it needs (``RootAdded.devices``; workers announce theirs in ``WorkerReady``),
the smallest such worker first. A ``BatchFailed`` with ``kind="oom"`` (out of device
memory) is no failure: the tree's need becomes twice the devices of the worker that
ran out, up to the largest worker (a ``DevicesLearned`` notice), and the stage is
planned again. A tree that needs more devices than the largest worker has (declared,
or out of memory on the largest) fails its requests with an error naming the need.

A request is settled (``RequestDone``) once its metrics are reported *and* the
checkpoint its batch promised at that point is durable, so a finished request always
has its model on disk. When that write fails (``CheckpointFailed``: the store is out
of reach past its ride-through window) the request stays pending and is planned
again (it fails after ``_MAX_STORE_FAILURES`` such writes in a row); when the
checkpoint is known not to come otherwise (the worker lost, a split missed) it
settles without it.

Checkpoint writes are off the critical path: a worker reports ``BatchDone`` when its
training is done, and the checkpoints the batch captured become durable afterwards
(``CheckpointSaved``; ``CheckpointFailed`` when a write fails). Until then the batch
stays *saving*: the worker is free, the stage tree counts the pending checkpoints as
positions of that batch (work that needs one on another worker waits for it), and the
worker that holds the model in memory may continue from it at once without any load.
A saving batch's promises end with its ``CheckpointSaved``/``CheckpointFailed``, a
``SplitMissed`` for it, or the loss of its worker. Executors deliver a batch's
``MetricsReported`` before its ``BatchDone``.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.exceptions import SchedulerError
from stagetree.plan.model import Node
from stagetree.scheduler.cost import CostEstimator
from stagetree.scheduler.events import (
    CheckpointAvailable,
    CheckpointLost,
    DevicesLearned,
    Event,
    NodeAdded,
    Notice,
    RequestAdded,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RootAdded,
    SaveSteps,
    StudyWeight,
)
from stagetree.scheduler.forest import StageForest
from stagetree.scheduler.policies import BasePolicy, CriticalPathPolicy, make_policy
from stagetree.stages import (
    CHECKPOINT,
    FRESH,
    RunningPosition,
    Stage,
    StageTree,
    critical_path,
)
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    CheckpointFailed,
    CheckpointSaved,
    CurveReported,
    FusedOutOfMemory,
    FusionFailed,
    Instruction,
    MetricsReported,
    Progress,
    RunBatch,
    RunFused,
    Segment,
    SplitMissed,
    WorkerLost,
    WorkerReady,
)

__all__ = ["BatchInfo", "Scheduler"]

Key = tuple[int, int]


class _Configs:
    """Plan trees' configs by root key, kept as one tuple per tree: the config's names
    (one tuple of each distinct list of names, shared by the trees that have it), then
    its values. A dict per tree holds about 200 bytes; this, 40 plus 8 per value."""

    __slots__ = ("_names", "_rows")

    def __init__(self) -> None:
        self._names: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._rows: dict[str, tuple[Any, ...]] = {}

    def __contains__(self, root_key: object) -> bool:
        return root_key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, root_key: str, config: Mapping[str, Any]) -> None:
        """Keep ``config`` (its values, not a copy of them) as ``root_key``'s."""
        names = tuple(config)
        self._rows[root_key] = (self._names.setdefault(names, names), *config.values())

    def get(self, root_key: str) -> dict[str, Any]:
        """A new dict equal to the config kept for ``root_key`` (same order).

        Raises:
            KeyError: no config was kept for ``root_key``.
        """
        row = self._rows[root_key]
        return dict(zip(row[0], row[1:]))


@dataclass
class _Batch:
    batch_id: int
    worker: int
    segments: tuple[tuple[int, int, int], ...]
    end: Key
    position: int
    evaluate: set[Key]  # promised evaluations not reported yet
    checkpoint: set[Key]  # promised checkpoints not durable yet
    planned: frozenset[Key] = frozenset()  # points of the RunBatch itself (not splits)
    start_at: Key | None = None
    start_ref: str | None = None  # the checkpoint it loads (None: fresh, or in memory)
    aborted: bool = False
    # Metrics reported at a point whose promised checkpoint is not durable yet.
    parked: dict[Key, dict[str, float]] = field(default_factory=dict)
    # Fair-share accounting: the position up to which the batch's steps were charged,
    # and pending requests that wait for a position it will pass (waiting stage-tree
    # roots and covered requests), with that position: refreshed at every decision.
    charged: int = 0
    downstream: dict[Key, int] = field(default_factory=dict)
    # Every key it was ever asked to checkpoint (its entries in ``_promising``).
    indexed: set[Key] = field(default_factory=set)


@dataclass(frozen=True)
class BatchInfo:
    """Read-only view of a running batch.

    Attributes:
        batch_id: the batch.
        worker: the worker running it.
        segments: ``(node, start, stop)`` per segment.
        position: latest model position reported (or known to be passed).
        evaluate_at: promised evaluations not reported yet.
        checkpoint_at: promised checkpoints not durable yet.
        aborted: an ``Abort`` was sent.
    """

    batch_id: int
    worker: int
    segments: tuple[tuple[int, int, int], ...]
    position: int
    evaluate_at: frozenset[Key] = field(default_factory=frozenset)
    checkpoint_at: frozenset[Key] = field(default_factory=frozenset)
    aborted: bool = False


def _where(phase: str, step: int) -> str:
    """What a failure interrupted, in words (see ``BatchFailed.phase``)."""
    if phase == "point":
        return f"evaluating or checkpointing the model at step {step}"
    if phase == "start":
        return "building the trainer" if step == 0 else f"restoring the trainer at step {step}"
    return f"training step {step}"


def _by_step(keys: set[Key]) -> tuple[Key, ...]:
    return tuple(sorted(keys, key=lambda k: (k[1], k[0])))


# Seconds of training a crash may lose in any case (periodic checkpoints are for trials
# long enough that a few percent of them is more).
_CRASH_LOSS = 60.0

# Checkpoints a batch saves where no known node branches off its path yet (a tree that
# grows while it trains, see Scheduler._branch_points): this many, or more while they
# cost at most this share of its training time.
_SPECULATIVE_MIN = 4
_SPECULATIVE_SHARE = 0.1

# Writes of a finished request's model that may fail in a row (each after the store's
# ride-through window) before the request fails: a store that stays down is waited
# for, one that never takes the model (a full disk) does not loop for ever.
_MAX_STORE_FAILURES = 5


def check_checkpoint_every(value: Any) -> None:
    """Raises ValueError unless ``value`` is an int >= 1, ``"auto"`` or None."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"checkpoint_every must be an integer >= 1, 'auto' or None, got {value!r}")


class Scheduler:
    """Decides what every worker trains; performs no I/O.

    Args:
        num_workers: workers ``0 .. num_workers - 1`` start idle; None to learn workers
            from ``WorkerReady`` events only.
        policy: ``"critical_path"`` (Hippo), ``"bfs"``, ``"thr"`` or a
            :class:`~stagetree.scheduler.policies.BasePolicy`.
        estimator: cost per step of plan nodes (a fresh :class:`CostEstimator` when
            None); it learns from ``Progress`` events.
        max_retries: times a failing stage is planned again before the requests that
            depend on it fail.
        max_worker_deaths: times a worker may die in the same stage before the requests
            behind it fail (deaths may be external, e.g. a preempted node, so this is
            counted apart from ``max_retries``).

    Branch checkpoints (``branch_checkpoints=True``, the default): a batch also
    checkpoints where known nodes branch off its path even when they have no request
    yet (the study inserts trials up to the tuner's horizon), and a running batch is
    asked for such a checkpoint when a node that branches off ahead of its worker is
    added. A later promotion then starts at its branch point instead of recomputing,
    also where the batch itself goes on in the branching node. In a tree that gets
    nodes while it trains (configurations proposed from results, e.g. by a sampler),
    batches also checkpoint at the steps where the tree already branches elsewhere,
    where later trials are likely to branch off (see ``_branch_points``). And at the
    steps a tree's tuner asks for results at (``SaveSteps``: its rungs), so that a
    request there that comes after a batch trained past it (a lower bracket's trial on
    the path of a higher bracket's one) starts from that checkpoint.

    Events accepted by :meth:`handle`: the plan events of
    :mod:`stagetree.scheduler.events` and the worker events of :mod:`stagetree.work`.
    Events of batches the scheduler no longer tracks (late messages after an abort or a
    lost worker) are applied where still meaningful (metrics, checkpoints, step counts)
    and otherwise ignored. ``CurveReported`` (learning curves, for the plan only) is
    accepted and ignored: it never resolves a request.

    ``eval_every`` goes into every ``RunBatch``: workers also evaluate every
    ``eval_every`` steps for the learning curve (0: at requested points only).

    Fair share across studies: studies contending for the workers get device time in
    proportion to their weights (``StudyWeight``; 1.0 by default), in the spirit of a
    fair-share cluster scheduler, counted in training steps (see :attr:`usage`). When a
    worker is free, the studies with ready work (a stage-tree root that starts now
    with one of their live requests in or below it) are ranked by standing: charged
    steps, plus the steps their running batches will still train for them (so that
    workers freed together are shared out at once), plus a lift, per unit of weight;
    ties go by study name. The first one's chain is the policy's choice among the
    stages its requests need (a view of the tree without other studies' branches;
    stages are shared, so the chain may serve other studies too, and then counts for
    them). A study without ready work never holds a worker back (work conserving),
    and a study alone gets every worker whatever its weight. Lift, fair queueing's
    virtual time: when a study gets its first live request after having none, its
    standing is raised to the lowest standing of the active studies (those with live
    requests), so a newcomer (or a study coming back) starts level instead of taking
    every worker until it catches up on what others used before it came; the lift is
    not part of :attr:`usage`. Fair share never preempts a running batch: batches are
    the unit of sharing, so a study's usage per unit of weight stays within about one
    batch of the others' while both have work waiting. With one study (e.g. only the
    anonymous ``""``) decisions are exactly the policy's.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        policy: str | BasePolicy = "critical_path",
        estimator: CostEstimator | None = None,
        max_retries: int = 0,
        branch_checkpoints: bool = True,
        max_worker_deaths: int = 2,
        eval_every: int = 0,
        max_fused: int = 1,
        checkpoint_every: int | str | None = "auto",
    ) -> None:
        if eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {eval_every}")
        if isinstance(max_fused, bool) or not isinstance(max_fused, int) or max_fused < 1:
            raise ValueError(f"max_fused must be an integer >= 1, got {max_fused!r}")
        self.max_fused = max_fused
        check_checkpoint_every(checkpoint_every)
        self.checkpoint_every = checkpoint_every
        # Mean seconds of a checkpoint (capture + write), from CheckpointSaved.
        self._save_total = 0.0
        self._save_count = 0
        # Fusible sequence names per plan tree (RootAdded.fusible), minus the trees whose
        # trainer could not be fused (FusionFailed).
        self._fusible: dict[str, frozenset[str]] = {}
        self.eval_every = eval_every
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if max_worker_deaths < 0:
            raise ValueError(f"max_worker_deaths must be >= 0, got {max_worker_deaths}")
        self.max_worker_deaths = max_worker_deaths
        self._deaths: dict[Key, int] = {}
        self.policy = make_policy(policy)
        self.estimator = estimator if estimator is not None else CostEstimator()
        self.max_retries = max_retries
        self.branch_checkpoints = branch_checkpoints
        self._children: dict[int, list[Node]] = {}
        # Steps at which nodes of each plan tree branch, the trees a batch was planned
        # for, and those that got a node after that (see _branch_points).
        self._branch_steps: dict[str, Counter[int]] = {}
        self._trained: set[str] = set()
        self._growing: set[str] = set()
        # Steps where batches of each plan tree checkpoint as they pass (SaveSteps), one
        # set of each (trees of a bracket save at the same rungs: one frozenset for all).
        self._save_steps: dict[str, frozenset[int]] = {}
        self._save_sets: dict[frozenset[int], frozenset[int]] = {}
        # Each plan tree's config (RootAdded), without a dict per tree (see _Configs).
        self._roots = _Configs()
        self._nodes: dict[int, Node] = {}
        self._requests: dict[Key, int] = {}
        # Fair share: references by study per live request, live requests per active
        # study, weights, charged steps, and the virtual-time lift of late studies.
        self._claims: dict[Key, dict[str, int]] = {}
        self._held: dict[str, int] = {}
        self._weights: dict[str, float] = {}
        self._usage: dict[str, float] = {}
        self._lift: dict[str, float] = {}
        self._checkpoints: dict[Key, str] = {}
        # The stage tree, kept per plan tree between decisions: every change to the
        # live requests or the durable checkpoints is reported to it.
        self._forest = StageForest(self._nodes)
        self._batches: dict[int, _Batch] = {}
        # Ended batches whose captured checkpoints are not durable yet (see the module
        # docstring); ``checkpoint`` holds the pending keys, ``parked`` their metrics.
        self._saving: dict[int, _Batch] = {}
        self._saving_left = 0  # batches that left ``_saving`` so far
        # Pending checkpoints whose model an idle worker holds in memory (refreshed by
        # every stage-tree build): work from there may start on that worker at once.
        self._memory: dict[Key, int] = {}
        self._positions: dict[int, int] = {}  # every batch ever: last reported step
        self._workers: set[int] = set(range(num_workers or 0))
        # Devices of each worker (WorkerReady.devices; 1 when not announced) and the
        # devices each plan tree's stages need, where more than one (see _fitting).
        self._devices: dict[int, int] = {}
        self._need: dict[str, int] = {}
        self._expected_devices = 0  # the largest worker the executor will start
        self._fused_width: dict[str, int] = {}  # widest fused job known to fit, by tree
        self._idle: set[int] = set(self._workers)
        self._worker_at: dict[int, Key] = {}  # where an idle worker's trainer stands
        # Idle workers by where their trainer stands, kept by _place whenever a worker's
        # idleness or position changes (not walked per decision), and the positions
        # whose models in memory may have changed since the last decision.
        self._idle_at: dict[Key, set[int]] = {}
        self._idle_key: dict[int, Key] = {}
        self._moved: set[Key] = set()
        # Running batches by the evaluations they promise, and those of them whose
        # promised evaluations are none a live request (what _preempt may abort), kept
        # as evaluations and requests come and go instead of walked per decision.
        self._evaluators: dict[Key, set[int]] = {}
        self._unneeded: set[int] = set()
        # Running batches per worker (a fused job's members share one), and the known
        # workers by their devices (whether they differ, without a walk of them all).
        self._on_worker: Counter[int] = Counter()
        self._kinds: Counter[int] = Counter({1: len(self._workers)} if self._workers else {})
        # Running and saving batches by the checkpoints they were asked for (a superset
        # of those whose ``checkpoint`` or ``parked`` hold the key: a key is let go when
        # its checkpoint is durable or the batch is gone), for _on_checkpoint.
        self._promising: dict[Key, set[int]] = {}
        # Batches given a ``downstream`` by the last _split (the others have none).
        self._downstream: set[int] = set()
        # Starts of ready roots whose model an idle worker holds (see _held_first).
        self._held_starts: set[Key] = set()
        # Ready roots that start at a model an idle worker holds (see _held_first).
        self._held_roots: list[Stage] = []
        self._failures: dict[Key, int] = {}
        self._store_failures: Counter[Key] = Counter()  # see _MAX_STORE_FAILURES
        self._next_batch = 1
        # Running and saving batches whose position or promises may have changed since
        # the forest last heard of them (see _report_batches).
        self._touched: set[int] = set()
        # Saving batches: their place in ``_saving``'s order, the checkpoints each had
        # when last reported and the saving batches by those checkpoints, and the models
        # in memory (``_memory``) with the place of the first batch that holds each.
        self._saving_seq: dict[int, int] = {}
        self._next_saving = 0
        self._saving_keys: dict[int, frozenset[Key]] = {}
        self._holding: dict[Key, set[int]] = {}
        self._first: dict[Key, int] = {}
        self._steps_executed = 0
        self._steps_planned = 0
        self._dirty = False
        self._handlers: dict[type, Callable[[Any, list[Instruction | Notice]], None]] = {
            RootAdded: self._on_root,
            NodeAdded: self._on_node,
            RequestAdded: self._on_request,
            RequestCancelled: self._on_cancel,
            StudyWeight: self._on_weight,
            SaveSteps: self._on_save_steps,
            CheckpointAvailable: self._on_checkpoint,
            CheckpointSaved: self._on_checkpoint,
            CheckpointFailed: self._on_checkpoint_failed,
            CheckpointLost: self._on_checkpoint_lost,
            Progress: self._on_progress,
            MetricsReported: self._on_metrics,
            CurveReported: self._on_curve,
            BatchDone: self._on_done,
            BatchFailed: self._on_failed,
            SplitMissed: self._on_split_missed,
            FusionFailed: self._on_fusion_failed,
            FusedOutOfMemory: self._on_fused_out_of_memory,
            WorkerReady: self._on_worker_ready,
            WorkerLost: self._on_worker_lost,
        }

    # -- public ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction | Notice]:
        """Apply one event; return instructions for executors and notices for the study.

        Raises:
            SchedulerError: an event the scheduler cannot accept (unknown event type,
                unknown node, non-canonical request, releasing more than held, ...).
        """
        return self.handle_all((event,))

    def handle_all(self, events: Iterable[Event]) -> list[Instruction | Notice]:
        """Apply several events, then decide once (e.g. loading a plan at start-up).

        Equivalent to :meth:`handle` on each event in turn, except that no decision is
        taken between them, so no instruction refers to an intermediate state.
        """
        out: list[Instruction | Notice] = []
        for event in events:
            handler = self._handlers.get(type(event))
            if handler is None:
                raise SchedulerError(f"the scheduler does not accept {type(event).__name__} events")
            batch_id = getattr(event, "batch_id", None)
            if batch_id is not None:
                self._touched.add(batch_id)
            handler(event, out)
        if self._dirty:
            self._dirty = False
            self._schedule(out)
        return out

    @property
    def steps_executed(self) -> int:
        """Training steps workers reported (``Progress``), over all batches."""
        return self._steps_executed

    @property
    def steps_planned(self) -> int:
        """Training steps of every ``RunBatch`` emitted so far."""
        return self._steps_planned

    @property
    def workers(self) -> list[int]:
        """Known workers."""
        return sorted(self._workers)

    @property
    def idle_workers(self) -> list[int]:
        """Workers without a batch."""
        return sorted(self._idle)

    @property
    def live_requests(self) -> dict[Key, int]:
        """Unsettled requests and their reference counts."""
        return dict(self._requests)

    def is_live(self, key: Key) -> bool:
        """Whether request ``key`` is unsettled (:attr:`live_requests` without the copy)."""
        return key in self._requests

    @property
    def live_claims(self) -> dict[Key, dict[str, int]]:
        """Unsettled requests and their reference counts by study."""
        return {k: dict(v) for k, v in self._claims.items()}

    @property
    def usage(self) -> dict[str, float]:
        """Training steps charged to each study so far (every study seen, 0.0 at first).

        Steps are charged as workers report them (``Progress``, ``MetricsReported``) and
        when a batch ends (``BatchDone.steps``, the step of a ``BatchFailed``, the last
        position before a ``WorkerLost``). A step is charged in full to *every* study
        with a live request that needs it: the batch evaluates that request at or after
        the step, or the request waits for a position of the batch at or after it. So
        a stage shared by two studies counts for both, and steps no live request needs
        (an aborted batch running out) count for none: the sum over studies is not
        :attr:`steps_executed`. Steps, not seconds, keep decisions deterministic. The
        virtual-time lift of a late study (see the class docstring) is not usage.
        """
        return dict(self._usage)

    @property
    def checkpoints(self) -> dict[Key, str]:
        """Durable checkpoints known to the scheduler."""
        return dict(self._checkpoints)

    @property
    def nodes(self) -> Mapping[int, Node]:
        """Plan nodes known to the scheduler (do not mutate)."""
        return self._nodes

    @property
    def running(self) -> dict[int, BatchInfo]:
        """Batches that have not finished, by id."""
        return {
            b.batch_id: BatchInfo(
                b.batch_id,
                b.worker,
                b.segments,
                b.position,
                frozenset(b.evaluate),
                frozenset(b.checkpoint),
                b.aborted,
            )
            for b in self._batches.values()
        }

    def pending(self) -> list[Key]:
        """Live requests that no running batch has promised to evaluate."""
        promised = self._promised()
        return [k for k in self._requests if k not in promised]

    def stage_tree(self) -> StageTree:
        """The stage tree of the current state (what the next decision would see)."""
        return self._tree()

    def idle(self) -> bool:
        """True when no batch runs and no live request is left."""
        return not self._batches and not self._requests

    def awaits_checkpoint(self, batch_id: int, node: int, step: int) -> bool:
        """Whether metrics that running batch ``batch_id`` reports at ``(node, step)``
        settle a live request only once the checkpoint it promised there is durable."""
        batch = self._batches.get(batch_id)
        key = (node, step)
        return (
            batch is not None
            and key in self._requests
            and key in batch.checkpoint
            and key not in self._checkpoints
        )

    @property
    def saving(self) -> dict[int, frozenset[Key]]:
        """Ended batches whose checkpoints are still being written: the pending
        ``(node, step)`` keys by batch id."""
        return {b.batch_id: frozenset(b.checkpoint) for b in self._saving.values()}

    @property
    def saving_left(self) -> int:
        """How many batches left :attr:`saving` so far (their writes all ended): while it
        and the batches that ended stay the same, :attr:`saving` has lost none."""
        return self._saving_left

    def is_saving(self, batch_id: int) -> bool:
        """Whether ended batch ``batch_id`` is in :attr:`saving` (without the copy)."""
        return batch_id in self._saving

    # -- plan events -----------------------------------------------------------------------

    def _on_root(self, e: RootAdded, out: list[Instruction | Notice]) -> None:
        self._roots.put(e.root_key, e.config)
        self.estimator.register_root(e.root_key, e.config)
        devices = getattr(e, "devices", 1)
        if devices > self._need.get(e.root_key, 1):
            self._need[e.root_key] = devices
        if getattr(e, "fused_width", 0) > 0:
            self._fused_width[e.root_key] = e.fused_width
        if e.fusible:
            self._fusible[e.root_key] = frozenset(e.fusible)
        else:
            self.disable_fusion(e.root_key)

    def _on_fusion_failed(self, e: FusionFailed, out: list[Instruction | Notice]) -> None:
        """The tree's trainer cannot be fused: never fuse its stages again."""
        self.disable_fusion(e.root_key)

    def _on_fused_out_of_memory(self, e: FusedOutOfMemory, out: list[Instruction | Notice]) -> None:
        """A fused job of the tree did not fit: later ones are at most half as wide."""
        width = max(1, e.width // 2)
        if width < self._fused_width.get(e.root_key, e.width):
            self._fused_width[e.root_key] = width
            out.append(DevicesLearned(e.root_key, self.devices_needed(e.root_key), width))

    def disable_fusion(self, root_key: str) -> None:
        """Never fuse the stages of plan tree ``root_key`` (its trainer cannot be fused)."""
        self._fusible.pop(root_key, None)

    def _on_node(self, e: NodeAdded, out: list[Instruction | Notice]) -> None:
        node = e.node
        old = self._nodes.get(node.id)
        if old is not None:
            if (old.root_key, old.parent, old.branch_step) != (
                node.root_key,
                node.parent,
                node.branch_step,
            ):
                raise SchedulerError(f"node {node.id} was added before with other fields")
            return
        if node.root_key not in self._roots:
            raise SchedulerError(f"node {node.id}: root {node.root_key!r} was not added")
        if node.parent is not None:
            parent = self._nodes.get(node.parent)
            if parent is None:
                raise SchedulerError(f"node {node.id}: parent {node.parent} was not added")
            if parent.root_key != node.root_key or node.branch_step < parent.branch_step:
                raise SchedulerError(f"node {node.id} does not fit under node {parent.id}")
        elif node.branch_step != 0:
            raise SchedulerError(f"root node {node.id} must branch at step 0")
        self._nodes[node.id] = node
        if node.parent is not None:
            self._children.setdefault(node.parent, []).append(node)
            self._branch_steps.setdefault(node.root_key, Counter())[node.branch_step] += 1
            if node.root_key in self._trained:
                self._growing.add(node.root_key)
            if self.branch_checkpoints:
                self._checkpoint_new_branch(node, out)

    def _on_save_steps(self, e: SaveSteps, out: list[Instruction | Notice]) -> None:
        steps = self._save_steps.get(e.root_key, frozenset()) | e.steps
        self._save_steps[e.root_key] = self._save_sets.setdefault(steps, steps)

    def _save_points(self, segments: tuple[tuple[int, int, int], ...]) -> set[Key]:
        """Points inside a path at the steps its tree saves at (``SaveSteps``): a request
        there that comes after the batch passed it starts from the checkpoint."""
        if not segments:
            return set()
        steps = self._save_steps.get(self._nodes[segments[0][0]].root_key)
        if not steps:
            return set()
        return {(n, t) for n, a, b in segments for t in steps if a < t <= b}

    def _branch_points(self, segments: Iterable[tuple[int, int, int]]) -> set[Key]:
        """Points of a path where known nodes branch off it, requested or not.

        Nodes without requests come from trials inserted up to the tuner's horizon (a
        trial at rung 1 of ASHA is inserted to its last rung): a checkpoint where they
        branch lets a later promotion start there instead of recomputing the prefix.
        That holds also where the path itself continues in the child: the parent goes
        on past its branch point (the trial that made it was inserted to its horizon),
        and its promotion resumes there.

        In a tree that grows while it trains (it got a node after a batch was planned
        for it: a model-based sampler proposes each configuration from the results so
        far, so its trials cannot be inserted in advance), also at every step where
        some node of the tree branches: later trials branch off paths trained before
        they existed, where the space's sequences change value (milestones, switches),
        which are the steps where the tree already branches elsewhere. A checkpoint
        there lets them start from it instead of training the prefix again. A path
        saves at most :data:`_SPECULATIVE_MIN` of those, or more while they cost at
        most :data:`_SPECULATIVE_SHARE` of its training time (as measured), at the
        steps where most nodes branch: a space whose sequences change at a few steps
        (milestones drawn from a list) gets them all, one whose change points are
        drawn from a range does not save at every step.
        """
        out: set[Key] = set()
        guesses: list[tuple[int, Key]] = []
        steps, root_key = 0, ""
        for node, start, stop in segments:
            for child in self._children.get(node, ()):
                d = child.branch_step
                if start < d <= stop:
                    out.add((node, d))
            steps += stop - start
            root_key = self._nodes[node].root_key
            if root_key in self._growing:
                counts = self._branch_steps[root_key]
                guesses += [(-n, (node, d)) for d, n in counts.items() if start < d < stop]
        guesses = sorted(g for g in guesses if g[1] not in out and g[1] not in self._checkpoints)
        if guesses:  # one path: one tree
            limit = self._speculative_limit(root_key, steps)
            out.update(key for _, key in guesses[:limit])
        return out

    def _speculative_limit(self, root_key: str, steps: int) -> int | None:
        """Most checkpoints a path of ``steps`` steps of tree ``root_key`` may save where
        no known node branches off it (see :meth:`_branch_points`); None: no limit
        before a step and a save of the tree were measured."""
        step = self.estimator.widths(root_key).get(1)
        if not step or not self._save_count:
            return None
        save = self._save_total / self._save_count
        if save <= 0:
            return None
        return max(_SPECULATIVE_MIN, int(_SPECULATIVE_SHARE * steps * step / save))

    def _checkpoint_new_branch(self, node: Node, out: list[Instruction | Notice]) -> None:
        """A node that branches off a running batch's path ahead of its worker: ask for a
        checkpoint there now, while it is cheap (see :meth:`_branch_points`)."""
        assert node.parent is not None
        key = (node.parent, node.branch_step)
        for batch in self._active():
            if key in batch.checkpoint or key in self._checkpoints:
                continue
            if key in self._branch_points(batch.segments) and node.branch_step > batch.position:
                self._promise(batch, key)
                self._touched.add(batch.batch_id)
                out.append(AddCheckpoint(batch.batch_id, batch.worker, key[0], key[1], False))

    def _check_key(self, node_id: int, step: int, count: int) -> Key:
        node = self._nodes.get(node_id)
        if node is None:
            raise SchedulerError(f"request on unknown node {node_id}")
        if not (step > node.branch_step or (node.parent is None and step == 0)):
            raise SchedulerError(
                f"request (node {node_id}, step {step}) is not canonical: the step must "
                f"exceed the node's branch step {node.branch_step} (or be 0 at the root)"
            )
        if count < 1:
            raise SchedulerError(f"request count must be >= 1, got {count}")
        return (node_id, step)

    def _on_request(self, e: RequestAdded, out: list[Instruction | Notice]) -> None:
        key = self._check_key(e.node, e.step, e.count)
        study = e.study
        claims = self._claims.setdefault(key, {})
        if study not in claims:
            if not self._held.get(study):
                self._activate(study)
            self._held[study] = self._held.get(study, 0) + 1
        claims[study] = claims.get(study, 0) + e.count
        if key not in self._requests:
            self._forest.add_request(key)
            self._unneeded.difference_update(self._evaluators.get(key, ()))
        self._requests[key] = self._requests.get(key, 0) + e.count
        self._dirty = True

    def _on_cancel(self, e: RequestCancelled, out: list[Instruction | Notice]) -> None:
        key = self._check_key(e.node, e.step, e.count)
        claims = self._claims.get(key)
        held = claims.get(e.study, 0) if claims is not None else 0
        if not held:
            # Settled meanwhile (done or failed), perhaps asked for again by another
            # study since: nothing of this study's to cancel.
            return
        if e.count > held:
            by = f" by study {e.study!r}" if e.study else ""
            raise SchedulerError(
                f"cannot cancel {e.count} references of request {key}{by}: it holds {held}"
            )
        assert claims is not None
        if e.count == held:
            del claims[e.study]
            self._unhold(e.study)
        else:
            claims[e.study] = held - e.count
        total = self._requests[key] - e.count
        if total:
            self._requests[key] = total
        else:
            del self._requests[key]
            self._forest.remove_request(key)
            self._recheck(key)
            del self._claims[key]
            self._shrink_requests()
        self._dirty = True

    def _drop(self, key: Key) -> bool:
        """Settle live request ``key`` (done or failed); False when it is not live."""
        if self._requests.pop(key, None) is None:
            return False
        self._forest.remove_request(key)
        self._recheck(key)
        for study in self._claims.pop(key, {}):
            self._unhold(study)
        self._shrink_requests()
        return True

    def _shrink_requests(self) -> None:
        # A dict keeps the table of its peak size: once no request is live (random
        # search has every trial live at once), start again from small ones.
        if not self._requests:
            self._requests, self._claims = {}, {}

    def _unhold(self, study: str) -> None:
        left = self._held[study] - 1
        if left:
            self._held[study] = left
        else:
            del self._held[study]

    def _on_weight(self, e: StudyWeight, out: list[Instruction | Notice]) -> None:
        w = e.weight
        if (
            isinstance(w, bool)
            or not isinstance(w, numbers.Real)
            or not math.isfinite(w)
            or not w > 0
        ):
            raise ValueError(f"study {e.study!r}: weight must be a finite number > 0, got {w!r}")
        self._weights[e.study] = float(w)
        self._usage.setdefault(e.study, 0.0)

    def _weight(self, study: str) -> float:
        return self._weights.get(study, 1.0)

    def _standing(self, study: str) -> float:
        """Charged steps plus the virtual-time lift, per unit of weight."""
        return (self._usage.get(study, 0.0) + self._lift.get(study, 0.0)) / self._weight(study)

    def _activate(self, study: str) -> None:
        """``study`` gets its first live request after having none: lift its standing to
        the lowest one among the active studies (fair queueing's virtual time), so a
        late or returning study does not take every worker to catch up."""
        self._usage.setdefault(study, 0.0)
        if not self._held:
            return
        floor = min(self._standing(s) for s in self._held) * self._weight(study)
        mine = self._usage[study] + self._lift.get(study, 0.0)
        if floor > mine:
            self._lift[study] = self._lift.get(study, 0.0) + floor - mine

    def _on_checkpoint(
        self, e: CheckpointAvailable | CheckpointSaved, out: list[Instruction | Notice]
    ) -> None:
        key = (e.node, e.step)
        if key not in self._checkpoints:
            self._forest.add_checkpoint(key)
        self._checkpoints[key] = e.ref
        self._store_failures.pop(key, None)
        seconds = getattr(e, "seconds", None)
        if seconds is not None and math.isfinite(seconds) and seconds > 0:
            self._save_total += seconds
            self._save_count += 1
        for batch in self._promised_at(key):
            if key in batch.checkpoint or key in batch.parked:
                batch.checkpoint.discard(key)
                self._touched.add(batch.batch_id)
            metrics = batch.parked.pop(key, None)
            if metrics is not None:
                self._unevaluate(batch, key)
                self._settle(key, metrics, out)
        self._end_saving(out)
        self._dirty = True

    def _on_checkpoint_failed(self, e: CheckpointFailed, out: list[Instruction | Notice]) -> None:
        batch = self._saving.get(e.batch_id)
        if batch is not None:
            # A request waiting on this model is not settled without it (the store
            # failed, not the trainer): it stays pending and is planned again, from the
            # model its worker still holds or the latest durable checkpoint.
            key = (e.node, e.step)
            if batch.parked.pop(key, None) is not None:
                self._store_failures[key] += 1
                tries = self._store_failures[key]
                if tries >= _MAX_STORE_FAILURES:
                    del self._store_failures[key]
                    error = f"its model could not be stored ({tries} tries): {e.error}"
                    self._fail({key}, error, "", out, _where("point", e.step))
            self._not_coming(batch, key, out)

    def _not_coming(self, batch: _Batch, key: Key, out: list[Instruction | Notice]) -> None:
        """Saving ``batch``'s checkpoint at ``key`` will not be written: plan without it."""
        self._unpromise(batch, key, out)
        self._end_saving(out)
        self._dirty = True

    def _unpromise(self, batch: _Batch, key: Key, out: list[Instruction | Notice]) -> None:
        """A saving batch's checkpoint at ``key`` will not come: a request parked on it
        settles without its model (it is recomputed if ever needed)."""
        batch.checkpoint.discard(key)
        metrics = batch.parked.pop(key, None)
        if metrics is not None:
            self._settle(key, metrics, out)

    def _end_saving(self, out: list[Instruction | Notice], worker: int | None = None) -> None:
        """Forget saving batches with nothing pending (or all of ``worker``'s: lost).

        A request parked on a lost worker's pending write is not settled: a finished
        trial must find its model, so it stays pending and is trained again from the
        latest durable checkpoint (steps lost to the worker, as for a running batch)."""
        for batch in list(self._saving.values()):
            if worker is not None and batch.worker == worker:
                self._touched.add(batch.batch_id)
                for key in list(batch.checkpoint):
                    batch.checkpoint.discard(key)
                    batch.parked.pop(key, None)
            if not batch.checkpoint:
                for key, metrics in batch.parked.items():
                    self._settle(key, metrics, out)
                del self._saving[batch.batch_id]
                self._unpromise_all(batch)
                self._saving_left += 1
                self._touched.add(batch.batch_id)
                self._dirty = True

    def _on_checkpoint_lost(self, e: CheckpointLost, out: list[Instruction | Notice]) -> None:
        if self._checkpoints.pop((e.node, e.step), None) is not None:
            self._forest.remove_checkpoint((e.node, e.step))
            self._dirty = True

    # -- worker events ---------------------------------------------------------------------

    def _on_progress(self, e: Progress, out: list[Instruction | Notice]) -> None:
        last = self._positions.get(e.batch_id)
        if last is not None and e.step > last:
            self._steps_executed += e.step - last
            self._positions[e.batch_id] = e.step
        batch = self._batches.get(e.batch_id)
        if batch is not None:
            if e.step > batch.position:
                batch.position = e.step
            self._charge(batch, e.step)
        node = self._nodes.get(e.node)
        if node is not None:
            self.estimator.observe(node, e.seconds_per_step, e.width)

    def _on_metrics(self, e: MetricsReported, out: list[Instruction | Notice]) -> None:
        key = (e.node, e.step)
        batch = self._batches.get(e.batch_id)
        if batch is not None:
            self._charge(batch, e.step)  # before the request settles
            if key in batch.checkpoint and key not in self._checkpoints:
                # Settle once the model at this point is durable too (or the batch ends):
                # a finished request must find its checkpoint.
                batch.parked[key] = dict(e.metrics)
                return
            self._unevaluate(batch, key)
        self._settle(key, e.metrics, out)

    def _settle(
        self, key: Key, metrics: Mapping[str, float], out: list[Instruction | Notice]
    ) -> None:
        if self._drop(key):
            out.append(RequestDone(key[0], key[1], dict(metrics)))

    def _on_curve(self, e: CurveReported, out: list[Instruction | Notice]) -> None:
        """Learning-curve points are for the plan; no decision depends on them."""

    def _release(self, batch_id: int) -> _Batch | None:
        batch = self._batches.pop(batch_id, None)
        self._touched.add(batch_id)
        if batch is not None:
            self._forget(batch)
            self._dirty = True
            # A worker of a fused job is free once every member ended.
            if batch.worker in self._workers and not self._on_worker[batch.worker]:
                self._idle.add(batch.worker)
                self._place(batch.worker)
        return batch

    def _on_done(self, e: BatchDone, out: list[Instruction | Notice]) -> None:
        batch = self._release(e.batch_id)
        if batch is not None:
            begin = batch.segments[0][1] if batch.segments else batch.end[1]
            position = max(batch.position, begin + e.steps)
            self._charge(batch, position)
            batch.position = position
            # Checkpoints at positions the worker passed were captured: their writes
            # end after the batch (the module docstring). Others were not kept.
            batch.checkpoint = {k for k in batch.checkpoint if k[1] <= position}
            batch.evaluate.clear()
            for key in [k for k in batch.parked if k not in batch.checkpoint]:
                self._settle(key, batch.parked.pop(key), out)
            if batch.checkpoint:
                self._saving[batch.batch_id] = batch
                self._saving_seq[batch.batch_id] = self._next_saving
                self._next_saving += 1
            else:
                self._unpromise_all(batch)
        if batch is not None and not batch.aborted and batch.position >= batch.end[1]:
            self._worker_at[batch.worker] = batch.end
            self._place(batch.worker)
        else:
            self._worker_at.pop(e.worker, None)
            self._place(e.worker)

    def _on_failed(self, e: BatchFailed, out: list[Instruction | Notice]) -> None:
        batch = self._release(e.batch_id)
        if batch is not None:  # the model at ``e.step`` was made
            self._unpromise_all(batch)
            self._charge(batch, max(batch.position, e.step))
        self._worker_at.pop(e.worker, None)
        self._place(e.worker)
        self._dirty = True
        key = (e.node, e.step)
        if getattr(e, "kind", "trainer") == "oom" and self._out_of_memory(e, batch, out):
            return
        if getattr(e, "kind", "trainer") == "checkpoint":
            # The start checkpoint is unreadable: forget it and plan from an earlier one
            # (a batch that was to continue a model in memory forgets nothing).
            if batch is None:
                if self._checkpoints.pop(key, None) is not None:
                    self._forest.remove_checkpoint(key)
            elif (
                batch.start_at is not None
                and batch.start_ref is not None
                and self._checkpoints.get(batch.start_at) == batch.start_ref
            ):
                del self._checkpoints[batch.start_at]
                self._forest.remove_checkpoint(batch.start_at)
            return
        failures = self._failures.get(key, 0) + 1
        if failures <= self.max_retries:
            self._failures[key] = failures
            return
        self._failures.pop(key, None)
        # The model that could not be made: after training step ``step`` fails, the
        # model at ``step + 1``; after a failed evaluation, checkpoint or restore, the
        # model at ``step`` itself.
        phase = getattr(e, "phase", "train")
        model = (e.node, e.step + 1 if phase == "train" else e.step)
        doomed = self._dependents(e.node, e.step) | self._behind(model)
        if not doomed and batch is not None:
            doomed = {k for k in batch.evaluate if k[1] > e.step and k in self._requests}
        self._fail(doomed, e.error, e.traceback, out, _where(phase, e.step))

    def _out_of_memory(
        self, e: BatchFailed, batch: _Batch | None, out: list[Instruction | Notice]
    ) -> bool:
        """A stage ran out of device memory: its tree needs twice the devices of that
        worker, up to the largest, and it is planned again. On the largest worker
        already, the requests that depend on it fail, naming the need. False: the node
        is unknown (a plain failure then)."""
        node = self._nodes.get(e.node)
        if node is None:
            return False
        had = self.worker_devices(e.worker)
        largest = max(self.largest_worker(), had)
        if had < largest:
            need = min(2 * had, largest)
            if need > self._need.get(node.root_key, 1):
                self._need[node.root_key] = need
                fits = self._fused_width.get(node.root_key, 0)
                out.append(DevicesLearned(node.root_key, need, fits))
            return True
        model = (e.node, e.step + 1 if getattr(e, "phase", "train") == "train" else e.step)
        doomed = self._dependents(e.node, e.step) | self._behind(model)
        if not doomed and batch is not None:
            doomed = {k for k in batch.evaluate if k[1] > e.step and k in self._requests}
        many = f"{had} device" + ("s" if had > 1 else "")
        error = (
            f"{e.error} (on a worker with {many}, the largest: the trial needs more than {many})"
        )
        self._fail(doomed, error, e.traceback, out, _where(getattr(e, "phase", "train"), e.step))
        return True

    def expect_devices(self, devices: int) -> None:
        """The executor's largest worker will own ``devices`` devices, whether it has
        announced itself yet or not (a need up to that waits for it, not fails)."""
        self._expected_devices = devices

    def largest_worker(self) -> int:
        """Devices of the largest worker, announced or expected (0: none known)."""
        announced = max((self.worker_devices(w) for w in self._workers), default=0)
        return max(announced, self._expected_devices)

    def _mixed_devices(self) -> bool:
        """Whether the known workers differ in devices (idle ones can only if they do)."""
        return len(self._kinds) > 1

    def _count_kind(self, worker: int, by: int) -> None:
        """Count known worker ``worker``'s devices in ``_kinds`` (``by`` 1) or no more (-1)."""
        devices = self.worker_devices(worker)
        left = self._kinds[devices] + by
        if left:
            self._kinds[devices] = left
        else:
            del self._kinds[devices]

    def worker_devices(self, worker: int) -> int:
        """Devices worker ``worker`` owns (as its ``WorkerReady`` said; 1 if unknown)."""
        return self._devices.get(worker, 1)

    def devices_needed(self, root_key: str) -> int:
        """Devices a stage of plan tree ``root_key`` needs (declared or learned)."""
        return self._need.get(root_key, 1)

    def _fail(
        self,
        doomed: Iterable[Key],
        error: str,
        tb: str,
        out: list[Instruction | Notice],
        where: str = "",
    ) -> None:
        for node, step in sorted(doomed, key=lambda k: (k[1], k[0])):
            if self._drop((node, step)):
                out.append(RequestFailed(node, step, error, tb, where))

    def _on_path(self, model: Key, node_id: int, step: int) -> bool:
        """Whether the path to request ``(node_id, step)`` passes the canonical model
        ``model``."""
        m_node, m_step = model
        if step < m_step:
            return False
        cur: Node | None = self._nodes.get(node_id)
        while cur is not None:
            if cur.id == m_node:
                return True
            parent = cur.parent
            if parent == m_node:
                return cur.branch_step >= m_step
            cur = self._nodes.get(parent) if parent is not None else None
        return False

    def _behind(self, model: Key) -> set[Key]:
        """Live requests whose path passes ``model`` with no durable checkpoint after it
        (they cannot be reached without making ``model``)."""
        out: set[Key] = set()
        for node_id, step in self._requests:
            if not self._on_path(model, node_id, step):
                continue
            later = any(
                c_step > model[1] and self._on_path((c_node, c_step), node_id, step)
                for c_node, c_step in self._checkpoints
            )
            if not later:
                out.add((node_id, step))
        return out

    def _dependents(self, node: int, step: int) -> set[Key]:
        """Live requests that can only be reached by training step ``step`` of ``node``
        (or by loading the model at ``(node, step)``)."""
        tree = self._tree()
        out: set[Key] = set()
        for stage in tree.stages:
            origin = stage.origin
            if stage.node == node and stage.start <= step < stage.stop:
                after = step
            elif (
                origin is not None
                and origin.kind == CHECKPOINT
                and (origin.node, origin.step) == (node, step)
            ):
                after = -1
            else:
                continue
            out.update((stage.node, t) for t in stage.evaluate_at if t > after)
            for below in stage.subtree():
                if below is not stage:
                    out.update((below.node, t) for t in below.evaluate_at)
        return out

    def _on_split_missed(self, e: SplitMissed, out: list[Instruction | Notice]) -> None:
        saving = self._saving.get(e.batch_id)
        if saving is not None:  # asked for after its end: never captured
            self._not_coming(saving, (e.node, e.step), out)
            return
        batch = self._batches.get(e.batch_id)
        if batch is None:
            return
        key = (e.node, e.step)
        if key not in batch.planned:  # what the RunBatch itself asked for stays promised
            batch.checkpoint.discard(key)
            self._unevaluate(batch, key)
        batch.position = max(batch.position, e.step + 1)
        self._dirty = True

    def _on_worker_ready(self, e: WorkerReady, out: list[Instruction | Notice]) -> None:
        if e.worker in self._workers:
            self._count_kind(e.worker, -1)
        self._workers.add(e.worker)
        self._devices[e.worker] = getattr(e, "devices", 1)
        self._count_kind(e.worker, 1)
        if not self._on_worker[e.worker]:
            self._idle.add(e.worker)
            self._place(e.worker)
        self._dirty = True

    def _on_worker_lost(self, e: WorkerLost, out: list[Instruction | Notice]) -> None:
        if e.worker in self._workers:
            self._count_kind(e.worker, -1)
            self._workers.discard(e.worker)
        self._idle.discard(e.worker)
        self._worker_at.pop(e.worker, None)
        self._place(e.worker)
        self._end_saving(out, worker=e.worker)  # its pending writes died with it
        for batch_id in [
            b.batch_id
            for b in self._batches.values()
            if b.worker == e.worker or b.batch_id == e.batch_id
        ]:
            batch = self._batches.pop(batch_id)
            self._forget(batch)
            self._unpromise_all(batch)
            self._touched.add(batch_id)
            self._charge(batch, batch.position)
            if not batch.aborted:
                self._count_death(batch, e, out)
        self._dirty = True

    def _count_death(self, batch: _Batch, e: WorkerLost, out: list[Instruction | Notice]) -> None:
        """A worker died in ``batch``: count it against the stage it was training; past
        ``max_worker_deaths`` the requests behind its last reported point fail."""
        node, start = batch.end
        for seg_node, seg_start, seg_stop in batch.segments:
            if seg_start <= batch.position < seg_stop:
                node, start = seg_node, seg_start
                break
        stage = (node, start)
        deaths = self._deaths.get(stage, 0) + 1
        if deaths <= self.max_worker_deaths:
            self._deaths[stage] = deaths
            return
        self._deaths.pop(stage, None)
        reason = e.reason or "the worker died"
        error = (
            f"WorkerLost: {reason} while training node {node} from step {batch.position}; "
            f"it died {deaths} times at this stage (max_worker_deaths={self.max_worker_deaths})"
        )
        where = f"training from step {batch.position}"
        self._fail(self._behind((node, batch.position + 1)), error, "", out, where)

    # -- fair share ------------------------------------------------------------------------

    def _served(self, batch: _Batch) -> Iterator[tuple[Key, int]]:
        """Requests a batch serves, each with the position of the batch it needs."""
        for key in batch.evaluate:
            yield key, key[1]
        yield from batch.downstream.items()

    def serving(self, batch_id: int) -> list[str]:
        """The studies with a live request that batch ``batch_id`` serves (none when
        the batch is unknown), in name order."""
        batch = self._batches.get(batch_id)
        return sorted(self._needs(batch, -1)) if batch is not None else []

    def _needs(self, batch: _Batch, after: int) -> dict[str, int]:
        """Per study with a live request the batch serves: the furthest position of the
        batch (past ``after``, up to its end) that those requests need."""
        end = batch.end[1]
        out: dict[str, int] = {}
        for key, pos in self._served(batch):
            if pos <= after:
                continue
            claims = self._claims.get(key)
            if not claims:
                continue
            pos = min(pos, end)
            for study in claims:
                if out.get(study, -1) < pos:
                    out[study] = pos
        return out

    def _charge(self, batch: _Batch, upto: int) -> None:
        """Charge the steps of ``batch`` up to position ``upto`` (see :attr:`usage`)."""
        start = batch.charged
        if upto <= start:
            return
        batch.charged = upto
        for study, pos in self._needs(batch, start).items():
            self._usage[study] = self._usage.get(study, 0.0) + (min(pos, upto) - start)

    def _study_order(self, studies: Iterable[str]) -> list[str]:
        """Studies by fair-share standing, lowest first (ties: name order): charged
        steps plus the steps running batches still owe them (so that workers freed at
        once are shared out), plus the virtual-time lift, per unit of weight."""
        owed: dict[str, float] = {}
        for batch in self._active():
            for study, pos in self._needs(batch, batch.charged).items():
                owed[study] = owed.get(study, 0.0) + (pos - batch.charged)
        return sorted(
            studies, key=lambda s: (self._standing(s) + owed.get(s, 0.0) / self._weight(s), s)
        )

    def _choose(self, tree: StageTree, ready: list[Stage]) -> list[Stage]:
        """The next chain for an idle worker: the policy's choice among the stages of
        the study with the lowest fair-share standing that has ready work."""
        if len(self._held) <= 1 and type(self.policy) is CriticalPathPolicy:
            # The policy's choice, cut included, from the kept tree's values and work
            # instead of a walk of the tree (None: the kept work cannot tell the cut).
            path = self._forest.critical_path(tree, ready, self._held_roots, self.policy)
            if path is not None:
                return path
        self._forest.ensure_costs()
        ready = self._ordered(ready)
        if ready is self._forest.ready_roots:
            ready = list(ready)  # a policy gets a list of its own
        if len(self._held) <= 1:
            return self.policy.choose(tree, ready)
        # Studies whose live requests lie in each stage or below it.
        order = [s for r in ready for s in r.subtree()]
        below: dict[int, set[str]] = {}
        for stage in reversed(order):
            studies: set[str] = set()
            for t in stage.evaluate_at:
                studies.update(self._claims.get((stage.node, t), ()))
            for child in stage.children:
                studies |= below[id(child)]
            below[id(stage)] = studies
        candidates: set[str] = set()
        for root in ready:
            candidates |= below[id(root)]
        if len(candidates) <= 1:
            return self.policy.choose(tree, ready)
        for study in self._study_order(candidates):
            copies: dict[int, Stage] = {}
            roots: list[Stage] = []
            for root in ready:
                if study not in below[id(root)]:
                    continue
                top = Stage(
                    root.node,
                    root.start,
                    root.stop,
                    None,
                    None,
                    list(root.evaluate_at),
                    root.cost,
                    root.origin,
                )
                copies[id(top)] = root
                roots.append(top)
                stack = [(root, top)]
                while stack:
                    orig, copy = stack.pop()
                    for child in orig.children:
                        if study in below[id(child)]:
                            sub = Stage(
                                child.node,
                                child.start,
                                child.stop,
                                copy,
                                None,
                                list(child.evaluate_at),
                                child.cost,
                            )
                            copy.children.append(sub)
                            copies[id(sub)] = child
                            stack.append((child, sub))
            stages = [s for r in roots for s in r.subtree()]
            view = StageTree(stages, roots, tree.covered, tree.nodes)
            path = self.policy.choose(view, roots)
            if path:
                return [copies.get(id(s), s) for s in path]
        return []

    # -- decisions -------------------------------------------------------------------------

    def _active(self) -> list[_Batch]:
        return [b for b in self._batches.values() if not b.aborted]

    def _report_batches(self) -> None:
        """Tell the forest what the batches touched since the last decision offer now
        (the others offer what they did), and work out the models in memory.

        The same inputs as listing every batch: the running batches' positions in batch
        order, then the saving batches' in ``_saving``'s order, each saving batch's
        pending checkpoints less the models in memory that it or a saving batch before
        it holds (an idle worker that holds the model of its pending checkpoint can
        start from it now: for this decision that model counts as durable)."""
        forest = self._forest
        todo: set[int] = set()
        for batch_id in self._touched:
            b = self._batches.get(batch_id)
            if b is None or b.aborted:
                forest.set_batch((0, batch_id), None)
            else:
                forest.set_batch((0, batch_id), self._running_position(b), b.evaluate)
            if batch_id in self._saving_seq:
                todo.add(batch_id)
                saving = self._saving.get(batch_id)
                self._index_saving(batch_id, None if saving is None else saving.checkpoint)
        self._touched.clear()
        # Only where an idle worker or a saving batch's checkpoints came or went: the
        # model at ``key`` is in memory on the idle workers there whose saving batch
        # holds it (the last such batch's worker has it; the first one counts it).
        memory, first = self._memory, self._first
        for key in self._moved:
            workers = self._idle_at.get(key)
            held = []
            if workers:
                for batch_id in self._holding.get(key, ()):
                    w = self._saving[batch_id].worker
                    if w in workers:
                        held.append((self._saving_seq[batch_id], w))
            old = first.get(key)
            if held:
                memory[key] = max(held)[1]
                first[key] = min(held)[0]
            else:
                memory.pop(key, None)
                first.pop(key, None)
            if first.get(key) != old:
                todo.update(self._holding.get(key, ()))
        self._moved.clear()
        for batch_id in todo:
            seq = self._saving_seq[batch_id]
            b = self._saving.get(batch_id)
            if b is None:
                forest.set_batch((1, seq), None)
                del self._saving_seq[batch_id]
                continue
            keys = tuple(k for k in b.checkpoint if first.get(k, seq + 1) > seq)
            position = RunningPosition(batch_id, (), b.position, keys) if keys else None
            forest.set_batch((1, seq), position, b.parked)

    def _index_saving(self, batch_id: int, checkpoint: set[Key] | None) -> None:
        """Saving batch ``batch_id``'s pending checkpoints are ``checkpoint`` now (None:
        it ended) in ``_holding``."""
        old = self._saving_keys.get(batch_id, frozenset())
        new = frozenset(checkpoint or ())
        if old == new:
            return
        self._moved |= old ^ new
        for key in old - new:
            holders = self._holding[key]
            holders.discard(batch_id)
            if not holders:
                del self._holding[key]
        for key in new - old:
            self._holding.setdefault(key, set()).add(batch_id)
        if new:
            self._saving_keys[batch_id] = new
        else:
            self._saving_keys.pop(batch_id, None)

    def _promise(self, batch: _Batch, key: Key) -> None:
        """``batch`` is asked for a checkpoint at ``key`` too."""
        batch.checkpoint.add(key)
        if key not in batch.indexed:
            batch.indexed.add(key)
            self._promising.setdefault(key, set()).add(batch.batch_id)

    def _unpromise_all(self, batch: _Batch) -> None:
        """``batch`` is gone (neither running nor saving): out of ``_promising``."""
        batch_id = batch.batch_id
        for key in batch.indexed:
            holders = self._promising.get(key)
            if holders is not None:
                holders.discard(batch_id)
                if not holders:
                    del self._promising[key]
        batch.indexed.clear()

    def _promised_at(self, key: Key) -> list[_Batch]:
        """The running then the saving batches that may hold ``key`` in ``checkpoint``
        or ``parked``, in the order of ``_batches`` then ``_saving`` (batch ids, then
        the order they ended in); ``key`` is let go (its checkpoint is durable now)."""
        ids = self._promising.pop(key, None)
        if not ids:
            return []
        running: list[_Batch] = []
        saving: list[tuple[int, _Batch]] = []
        for batch_id in sorted(ids):
            batch = self._batches.get(batch_id)
            if batch is not None:
                running.append(batch)
            else:
                saving.append((self._saving_seq[batch_id], self._saving[batch_id]))
            batch = running[-1] if batch is not None else saving[-1][1]
            batch.indexed.discard(key)
        saving.sort(key=lambda x: x[0])
        return running + [b for _, b in saving]

    def _evaluates(self, batch: _Batch, key: Key) -> None:
        """Running ``batch`` promises an evaluation at ``key`` too."""
        batch.evaluate.add(key)
        if self._batches.get(batch.batch_id) is not batch:
            return  # an ended batch: not indexed
        self._evaluators.setdefault(key, set()).add(batch.batch_id)
        if key in self._requests:
            self._unneeded.discard(batch.batch_id)

    def _unevaluate(self, batch: _Batch, key: Key) -> None:
        """``batch`` (running, or ended) no longer promises an evaluation at ``key``."""
        if key not in batch.evaluate:
            return
        batch.evaluate.discard(key)
        batch_id = batch.batch_id
        if self._batches.get(batch_id) is not batch:
            return  # ended: no longer indexed
        holders = self._evaluators[key]
        holders.discard(batch_id)
        if not holders:
            del self._evaluators[key]
        if key in self._requests and not any(k in self._requests for k in batch.evaluate):
            self._unneeded.add(batch_id)

    def _recheck(self, key: Key) -> None:
        """Request ``key`` was settled or cancelled: the running batches that promise
        it may promise nothing live now."""
        for batch_id in self._evaluators.get(key, ()):
            if not any(k in self._requests for k in self._batches[batch_id].evaluate):
                self._unneeded.add(batch_id)

    def _forget(self, batch: _Batch) -> None:
        """``batch`` left the running batches: out of the evaluation index."""
        batch_id = batch.batch_id
        for key in batch.evaluate:
            holders = self._evaluators[key]
            holders.discard(batch_id)
            if not holders:
                del self._evaluators[key]
        self._unneeded.discard(batch_id)
        left = self._on_worker[batch.worker] - 1
        if left:
            self._on_worker[batch.worker] = left
        else:
            del self._on_worker[batch.worker]

    def _place(self, worker: int) -> None:
        """Keep ``_idle_at`` after ``worker``'s idleness or position may have changed."""
        new = self._worker_at.get(worker) if worker in self._idle else None
        old = self._idle_key.get(worker)
        if old == new:
            return
        if old is not None:
            bucket = self._idle_at[old]
            bucket.discard(worker)
            if not bucket:
                del self._idle_at[old]
            del self._idle_key[worker]
            self._moved.add(old)
        if new is not None:
            self._idle_at.setdefault(new, set()).add(worker)
            self._idle_key[worker] = new
            self._moved.add(new)

    @staticmethod
    def _running_position(b: _Batch) -> RunningPosition:
        saving = tuple(k for k in b.checkpoint if k[1] <= b.position)
        return RunningPosition(b.batch_id, b.segments, b.position, saving)

    def _promised(self) -> set[Key]:
        """Requests evaluated by a running batch, or whose metrics wait for the write of
        a saving batch's checkpoint."""
        out: set[Key] = set()
        for batch in self._active():
            out |= batch.evaluate
        for batch in self._saving.values():
            out.update(batch.parked)
        return out

    def _tree(self, lazy: bool = False, shared: bool = False) -> StageTree:
        """The stage tree now (``lazy``: stage costs left for
        :meth:`StageForest.ensure_costs`; ``shared``: its root lists are the forest's
        own, for a decision done before the next call)."""
        # Batches' positions and promises are kept in the forest: only those of
        # batches touched since the last decision are reported.
        self._report_batches()
        # A plain CostEstimator says when its predictions may have moved; costs from
        # any other estimator are computed again at every decision.
        estimator = self.estimator
        plain = type(estimator) is CostEstimator
        return self._forest.tree(
            (),
            set(),
            self._memory.keys(),
            estimator.cost,
            estimator.version if plain else None,
            estimator.costs if plain else None,
            estimator=estimator if plain else None,
            lazy=lazy,
            shared=shared,
        )

    def _any_batch(self, batch_id: int) -> _Batch:
        """A running or saving batch."""
        batch = self._batches.get(batch_id)
        return batch if batch is not None else self._saving[batch_id]

    def _schedule(self, out: list[Instruction | Notice]) -> None:
        self.policy.workers = len(self._workers)
        while True:
            # The forest's own lists, no copy per decision: nothing changes them
            # before the next _tree.
            tree = self._tree(lazy=True, shared=True)
            self._split(tree, out)
            ready = self._forest.ready_roots
            if self._need and ready:
                ready = self._fitting(ready, out)
            if not ready or not self._idle:
                # What a round gives without an idle worker: the checkpoints and
                # evaluations `_split` asks running batches for (from the tree's
                # covered stages and waiting roots: a new request, a lost checkpoint
                # or model, a checkpoint that makes a waiting root ready can change
                # them), the requests `_fitting` fails (no worker has their devices),
                # and the aborts `_preempt` finds (a checkpoint that makes a waiting
                # root ready can leave a batch unneeded). All read the tree, so it is
                # refreshed (incrementally: a checkpoint, a progress or an ended write
                # rebuilds no plan tree unless its answers changed). Only the models
                # idle workers hold (`_held_first`) are left: they are read by the
                # assignment alone, which needs an idle worker.
                break
            ready = self._held_first(ready)
            path = self._choose(tree, ready)
            if not path:
                break
            self._assign(self._fuse(tree, ready, path), out)
        self._preempt(tree, out)

    def _split(self, tree: StageTree, out: list[Instruction | Notice]) -> None:
        """Ask running batches for the checkpoints and evaluations pending work needs
        (and note, for fair-share accounting, which pending requests wait for them)."""
        batches = self._batches
        for batch_id in self._downstream:
            running = batches.get(batch_id)
            if running is not None:
                running.downstream.clear()
        self._downstream.clear()
        for c in tree.covered:
            batch = self._any_batch(c.batch_id)
            key = (c.node, c.step)
            batch.downstream[key] = c.step
            self._downstream.add(c.batch_id)
            if c.step <= batch.position:
                # A promised checkpoint the worker already passed: the request is
                # evaluated from it once it is durable.
                continue
            if key not in batch.evaluate:
                self._evaluates(batch, key)
                self._promise(batch, key)
                self._touched.add(batch.batch_id)
                out.append(AddCheckpoint(batch.batch_id, batch.worker, c.node, c.step, True))
        for root in tree.waiting_roots():
            origin = root.origin
            assert origin is not None and origin.batch_id is not None
            batch = self._any_batch(origin.batch_id)
            key = (origin.node, origin.step)
            for stage in root.subtree():
                for t in stage.evaluate_at:
                    batch.downstream[(stage.node, t)] = origin.step
            self._downstream.add(origin.batch_id)
            if key not in batch.checkpoint:
                self._promise(batch, key)
                self._touched.add(batch.batch_id)
                out.append(AddCheckpoint(batch.batch_id, batch.worker, key[0], key[1], False))

    def _fitting(self, ready: list[Stage], out: list[Instruction | Notice]) -> list[Stage]:
        """The roots of ``ready`` that an idle worker has the devices for; those of a
        tree that needs more devices than any worker has fail their requests."""
        largest = self.largest_worker()
        roomiest = max((self.worker_devices(w) for w in self._idle), default=0)
        keep: list[Stage] = []
        for root in ready:
            root_key = self._nodes[root.node].root_key
            need = self._need.get(root_key, 1)
            if need <= 1 or (need <= roomiest and self._can_start(root, need)):
                keep.append(root)
            elif largest and need > largest:
                doomed = {(s.node, t) for s in root.subtree() for t in s.evaluate_at}
                error = (
                    f"DevicesError: the trial needs {need} devices per worker, but the "
                    f"largest worker has {largest}"
                )
                self._fail(doomed, error, "", out, "assigning a worker")
        return keep

    def _can_start(self, root: Stage, need: int) -> bool:
        """Whether a worker with ``need`` devices may start ``root`` now (a model only
        one worker holds in memory starts on that worker only)."""
        origin = root.origin
        start = None if origin is None else (origin.node, origin.step)
        holder = self._memory.get(start) if start is not None else None
        return holder is None or self.worker_devices(holder) >= need

    def _held_first(self, ready: list[Stage]) -> list[Stage]:
        """Notes the roots of ``ready`` that an idle worker holds the model of, and those
        starts for :meth:`_pick_worker`; returns ``ready`` as it is (a policy gets it
        through :meth:`_ordered`)."""
        self._held_starts, self._held_roots = self._forest.held_starts(self._idle_at.keys())
        return ready

    def _ordered(self, ready: list[Stage]) -> list[Stage]:
        """``ready`` with the roots an idle worker holds the model of first (in their
        order), so that a policy's tie goes to work that continues a model in memory
        without a load."""
        first = self._held_roots
        if not first:
            return ready
        moved = {id(r) for r in first}
        return first + [r for r in ready if id(r) not in moved]

    def _starts_at_held(self, root: Stage) -> bool:
        origin = root.origin
        assert origin is not None
        return origin.kind == CHECKPOINT and (origin.node, origin.step) in self._held_starts

    def _pick_worker(self, start: Key | None, need: int = 1) -> int:
        if start in self._memory:  # only that worker has the model
            return self._memory[start]
        if not (self._devices and self._mixed_devices()):
            # One kind of worker: the lowest idle one that stands at ``start``, else the
            # lowest whose model no other ready work continues (the walk below, from the
            # idle workers by position instead of every idle worker sorted).
            here = self._idle_at.get(start) if start is not None else None
            if here:
                return min(here)
            kept = {w for k in self._held_starts for w in self._idle_at.get(k, ())}
            if kept and len(kept) < len(self._idle):
                return min(w for w in self._idle if w not in kept)
            return min(self._idle)
        idle = sorted(self._idle)
        if len({self.worker_devices(w) for w in idle}) > 1:
            # A mixed cluster: the smallest workers that have the devices, so that the
            # larger ones stay free for the trees that need them.
            idle = [w for w in idle if self.worker_devices(w) >= need]
            idle.sort(key=self.worker_devices)
        if start is not None:
            for worker in idle:
                if self._worker_at.get(worker) == start:
                    return worker
        # Keep the workers whose model other ready work continues for that work.
        for worker in idle:
            if self._worker_at.get(worker) not in self._held_starts:
                return worker
        return idle[0]

    # -- fusion --------------------------------------------------------------------------

    def _fuse(self, tree: StageTree, ready: list[Stage], path: list[Stage]) -> list[list[Stage]]:
        """The chains to run on one worker: ``path`` alone, or, when its tree is fusible,
        ``path`` and up to ``max_fused - 1`` sibling chains that start from the same model
        and differ only in fusible sequences (one fused job), shared out evenly over the
        idle workers.

        Every chain of a fusible tree stops after its first branching stage, so that the
        stages continuing from there start together and can be fused in turn.
        """
        root = path[0]
        root_key = self._nodes[root.node].root_key
        fusible = self._fusible.get(root_key)
        if self.max_fused <= 1 or fusible is None:
            return [path]
        self._forest.ensure_costs()
        ready = self._ordered(ready)
        group = [self._cut(path)]
        origin = root.origin
        assert origin is not None
        siblings = [
            r
            for r in ready
            if r is not root
            and r.origin is not None
            and (r.origin.kind, r.origin.node, r.origin.step)
            == (origin.kind, origin.node, origin.step)
        ]
        # The costliest first, as the critical-path policy would take them; spread over
        # the idle workers (two jobs of 8 on two workers beat one of 16 and an idle one).
        siblings.sort(key=lambda r: -sum(s.cost for s in critical_path(tree, [r])))
        # Workers whose batches reached their end are about to be free too.
        ending = {b.worker for b in self._batches.values() if b.position >= b.end[1]}
        free = len(self._idle | (ending - self._busy_workers(ending)))
        widest = min(self.max_fused, self._fused_width.get(root_key, self.max_fused))
        width = min(widest, -(-(len(siblings) + 1) // max(free, 1)))
        for sibling in siblings:
            if len(group) >= width:
                break
            chain = self.policy.choose(tree, [sibling])
            if chain and chain[0] is sibling:
                chain = self._cut(chain)
                if self._compatible(group, chain, fusible):
                    group.append(chain)
        # Fuse only where it pays: a job of B members whose step was measured to take B
        # unfused steps or more (a model vmap does not speed up on this device) runs as
        # separate batches instead.
        ratio = self.estimator.fused_step(root_key, len(group))
        if len(group) > 1 and ratio is not None and ratio >= len(group):
            return [group[0]]
        return group

    def _busy_workers(self, workers: set[int]) -> set[int]:
        """Those of ``workers`` with a batch that has not reached its end."""
        return {
            b.worker
            for b in self._batches.values()
            if b.worker in workers and b.position < b.end[1]
        }

    @staticmethod
    def _cut(path: list[Stage]) -> list[Stage]:
        """``path`` up to its first stage with several children (see :meth:`_fuse`)."""
        for i, stage in enumerate(path):
            if len(stage.children) > 1:
                return path[: i + 1]
        return path

    def _compatible(
        self, group: list[list[Stage]], chain: list[Stage], fusible: frozenset[str]
    ) -> bool:
        """Whether ``chain`` may join ``group``: the same sequence names, and the same
        sequence for every name that is not fusible, on every node of every chain."""
        first = self._nodes[group[0][0].node].hp
        names = set(first)
        for stage in (s for c in (*group, chain) for s in c):
            hp = self._nodes[stage.node].hp
            if set(hp) != names:
                return False
            for name in names - fusible:
                if hp[name] != first[name]:
                    return False
        return True

    # -- assignment ------------------------------------------------------------------------

    def _assign(self, group: list[list[Stage]], out: list[Instruction | Notice]) -> None:
        """Run ``group`` (one chain, or the chains of a fused job) on one worker."""
        origin = group[0][0].origin
        if origin is None or origin.kind not in (FRESH, CHECKPOINT):
            raise SchedulerError(f"policy {self.policy!r} chose a path that is not ready")
        # Fused chains all start from this model (see _fuse).
        start = None if origin.kind == FRESH else (origin.node, origin.step)
        need = self._need.get(self._nodes[group[0][0].node].root_key, 1) if self._need else 1
        worker = self._pick_worker(start, need)
        self._idle.discard(worker)
        self._worker_at.pop(worker, None)
        self._place(worker)
        batches = [self._batch(path, worker, start) for path in group]
        out.append(batches[0] if len(batches) == 1 else RunFused(worker, tuple(batches)))

    def _batch(self, path: list[Stage], worker: int, start: Key | None) -> RunBatch:
        """The ``RunBatch`` of chain ``path`` on ``worker``, from model ``start``."""
        root = path[0]
        evaluate: set[Key] = set()
        checkpoint: set[Key] = set()
        for i, stage in enumerate(path):
            evaluate.update((stage.node, t) for t in stage.evaluate_at)
            if i == len(path) - 1 or len(stage.children) > 1:
                checkpoint.add((stage.node, stage.stop))
        checkpoint |= evaluate
        segments = tuple((s.node, s.start, s.stop) for s in path if s.stop > s.start)
        if self.branch_checkpoints:
            checkpoint |= self._branch_points(segments) | self._save_points(segments)
        every = self.periodic_interval(self._nodes[root.node].root_key, path[-1].stop)
        if every is not None:  # bound what a crash loses (see periodic_interval)
            checkpoint |= {
                (n, t) for n, a, b in segments for t in range(a + 1, b) if t % every == 0
            }
        # Not ``-= keys()``: that walks every durable checkpoint of the study per batch.
        checkpoint = {k for k in checkpoint if k not in self._checkpoints}
        # None from a fresh model, or from one in memory (see _tree): the worker has it.
        start_ref = None if start is None else self._checkpoints.get(start)
        last = path[-1]
        batch_id = self._next_batch
        self._next_batch += 1
        root_key = self._nodes[root.node].root_key
        self._trained.add(root_key)
        self._batches[batch_id] = _Batch(
            batch_id,
            worker,
            segments,
            (last.node, last.stop),
            root.start,
            set(evaluate),
            set(checkpoint),
            frozenset(evaluate | checkpoint),
            start,
            start_ref,
            charged=root.start,
            indexed=set(checkpoint),
        )
        for key in checkpoint:
            self._promising.setdefault(key, set()).add(batch_id)
        self._positions[batch_id] = root.start
        self._touched.add(batch_id)
        self._on_worker[worker] += 1
        for key in evaluate:
            self._evaluators.setdefault(key, set()).add(batch_id)
        if not any(k in self._requests for k in evaluate):
            self._unneeded.add(batch_id)
        self._steps_planned += sum(b - a for _, a, b in segments)
        return RunBatch(
            batch_id=batch_id,
            worker=worker,
            root_key=root_key,
            config=self._roots.get(root_key),
            start_step=root.start,
            start_at=start,
            start_checkpoint=start_ref,
            segments=tuple(Segment(n, a, b, self._nodes[n].hp) for n, a, b in segments),
            evaluate_at=_by_step(evaluate),
            checkpoint_at=_by_step(checkpoint),
            eval_every=self.eval_every,
        )

    def periodic_interval(self, root_key: str, end: int) -> int | None:
        """Steps between the periodic checkpoints of a batch of tree ``root_key`` that
        ends at step ``end`` (None: none), which bound the steps a crash loses.

        ``checkpoint_every`` an int: that. ``"auto"``: the cost model's choice, once a
        step of the tree and a checkpoint were measured: a crash loses at most 5% of
        the trial (``end / 20`` steps) or a minute of training, whichever is more, and
        the saves cost at most 1% of the training time (at least 100 steps' time
        between saves); none where that interval is not shorter than the batch (short
        trials lose little to a crash). ``None``: off (branch points and batch ends).
        """
        every = self.checkpoint_every
        if every is None:
            return None
        if isinstance(every, int):
            return every
        step = self.estimator.widths(root_key).get(1)
        if not step or not self._save_count:
            return None
        save = self._save_total / self._save_count
        interval = max(
            math.ceil(end / 20), math.ceil(100 * save / step), math.ceil(_CRASH_LOSS / step)
        )
        return interval if interval < end else None

    def _preempt(self, tree: StageTree, out: list[Instruction | Notice]) -> None:
        """Abort the running batches no live request needs (in batch order): none of
        their promised evaluations is live, and no pending work waits for them."""
        if not self._unneeded:
            return
        batches = self._batches
        idle = [
            b
            for b in (batches[i] for i in sorted(self._unneeded))
            if not b.aborted and b.position < b.end[1]
        ]
        if not idle:
            return
        needed = {c.batch_id for c in tree.covered}
        for root in tree.waiting_roots():
            assert root.origin is not None and root.origin.batch_id is not None
            needed.add(root.origin.batch_id)
        for batch in idle:
            if batch.batch_id in needed:
                continue
            batch.aborted = True
            self._touched.add(batch.batch_id)
            out.append(Abort(batch.batch_id, batch.worker))
