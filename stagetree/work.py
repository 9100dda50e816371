"""Messages between the scheduler, executors and workers.

The scheduler turns events into instructions and performs no I/O; executors carry the
instructions out on workers and feed what happens back as events. Every message is a
frozen, picklable dataclass so that it crosses process (and Ray) boundaries as is.

Steps: a segment ``[start, stop)`` trains the steps ``start .. stop-1`` (``train()``
calls number ``start`` to ``stop-1``); "the model at step s" is the model after ``s``
calls of ``train()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Abort",
    "AddCheckpoint",
    "BatchDone",
    "BatchFailed",
    "CheckpointFailed",
    "CheckpointSaved",
    "CurveReported",
    "FusedOutOfMemory",
    "FusionFailed",
    "Instruction",
    "MetricsReported",
    "Progress",
    "RunBatch",
    "RunFused",
    "Segment",
    "SplitMissed",
    "WorkerEvent",
    "WorkerLost",
    "WorkerReady",
]


@dataclass(frozen=True)
class Segment:
    """Steps ``[start, stop)`` trained under ``hp`` (node ``node`` of the plan)."""

    node: int
    start: int
    stop: int
    hp: Mapping[str, Any] = field(hash=False)


@dataclass(frozen=True)
class RunBatch:
    """Instruction: train consecutive segments of one root-to-leaf path on one worker.

    Attributes:
        batch_id: unique id of this batch.
        worker: worker id that must run it.
        root_key: the plan tree.
        config: fixed hyper-parameters, passed to ``Trainer(config)``.
        start_step: step the batch starts at (== ``segments[0].start``).
        start_at: canonical ``(node, step)`` of the model the batch starts from, None for
            a fresh model at step 0. A worker whose in-memory trainer is exactly at
            ``start_at`` (it just finished there) may skip loading ``start_checkpoint``.
        start_checkpoint: checkpoint ref to load before training, None to start fresh at 0.
        segments: consecutive segments; ``segments[i].stop == segments[i+1].start``.
        evaluate_at: ``(node, step)`` points to evaluate and report metrics at.
        checkpoint_at: ``(node, step)`` points to save a checkpoint at (in background).
        eval_every: also evaluate at every step ``s > start_step`` with
            ``s % eval_every == 0`` for the learning curve (:class:`CurveReported`);
            0 evaluates at ``evaluate_at`` only. ``train()`` metrics are reported at
            every step either way.
        trainer: key of the trainer class that trains the batch, as registered with
            :meth:`~stagetree.executors.base.BaseExecutor.add_trainer`; ``""`` (the
            default) is the executor's own trainer (``ExecutorOptions.trainer``). One
            executor serves batches of several trainers; a worker continues its
            in-memory trainer only for a batch of the same key.
    """

    batch_id: int
    worker: int
    root_key: str
    config: Mapping[str, Any] = field(hash=False)
    start_step: int
    start_at: tuple[int, int] | None
    start_checkpoint: str | None
    segments: tuple[Segment, ...]
    evaluate_at: tuple[tuple[int, int], ...] = ()
    checkpoint_at: tuple[tuple[int, int], ...] = ()
    eval_every: int = 0
    trainer: str = ""


@dataclass(frozen=True)
class RunFused:
    """Instruction: train ``members`` as one fused job on worker ``worker`` (horizontal
    fusion, :mod:`stagetree.fusion`).

    The members are ordinary batches of one plan tree that start from the same model
    (same ``root_key``, ``config``, ``trainer``, ``start_at``, ``start_checkpoint`` and
    ``start_step``) and whose sequences differ only in the trainer's fusible names. The
    worker trains them step by step together, and every member behaves as its own batch
    towards the scheduler: its own ``Progress`` (with ``width``), metrics, checkpoints,
    live splits, ``Abort`` and terminal event. A member leaves the job when its segments
    end; the job ends when the last member does. A worker that cannot fuse them (see
    :class:`FusionFailed`) trains them one after another instead.
    """

    worker: int
    members: tuple[RunBatch, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("RunFused needs at least one member")
        first = self.members[0]
        for m in self.members[1:]:
            if (m.root_key, m.trainer, m.start_at, m.start_checkpoint, m.start_step) != (
                first.root_key,
                first.trainer,
                first.start_at,
                first.start_checkpoint,
                first.start_step,
            ) or dict(m.config) != dict(first.config):
                raise ValueError(
                    f"batch {m.batch_id} does not start from the model batch "
                    f"{first.batch_id} starts from: they cannot be fused"
                )
            if m.worker != self.worker:
                raise ValueError(f"batch {m.batch_id} is for worker {m.worker}, not {self.worker}")

    @property
    def batch_ids(self) -> tuple[int, ...]:
        return tuple(m.batch_id for m in self.members)


@dataclass(frozen=True)
class AddCheckpoint:
    """Instruction (live split): the running batch must also checkpoint at ``(node, step)``,
    and evaluate there when ``evaluate`` is set. Ignored by the worker if already past
    it, in which case it answers with :class:`SplitMissed` so the scheduler can plan a
    recomputation instead."""

    batch_id: int
    worker: int
    node: int
    step: int
    evaluate: bool = False


@dataclass(frozen=True)
class Abort:
    """Instruction: stop the batch after the current step (its work is no longer needed).

    With ``save``, the worker first checkpoints the model where the batch stops (unless
    it trained no step or has a checkpoint there already) and reports its
    ``CheckpointSaved`` (or ``CheckpointFailed``) before the batch's ``BatchDone``: the
    steps it trained stay in the plan and a later run resumes from them (a run that
    stops: Ctrl-C, a budget, closing the study)."""

    batch_id: int
    worker: int
    save: bool = False


Instruction = RunBatch | RunFused | AddCheckpoint | Abort


@dataclass(frozen=True)
class Progress:
    """The worker finished training up to ``step`` (model at ``step``) on ``node``.

    ``width``: how many batches the worker trained at once (``RunFused`` members);
    ``seconds_per_step`` is the wall time of one step of all of them."""

    batch_id: int
    worker: int
    node: int
    step: int
    seconds_per_step: float
    width: int = 1


@dataclass(frozen=True)
class MetricsReported:
    batch_id: int
    worker: int
    node: int
    step: int
    metrics: Mapping[str, float] = field(hash=False)


@dataclass(frozen=True)
class CurveReported:
    """Learning-curve points of a batch since its previous ``CurveReported``:
    ``(node, step, metrics, evaluated)`` in step order, at canonical keys. ``metrics``
    are ``train()``'s metrics of that step merged with ``evaluate()``'s when
    ``evaluated``. Sent with the throttled ``Progress`` events and before the batch's
    terminal event; never resolves a request (``MetricsReported`` does)."""

    batch_id: int
    worker: int
    points: tuple[tuple[int, int, Mapping[str, float], bool], ...] = field(hash=False)


@dataclass(frozen=True)
class CheckpointSaved:
    """A checkpoint of ``(node, step)`` is durable under ``ref``."""

    batch_id: int
    worker: int
    node: int
    step: int
    ref: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class CheckpointFailed:
    """The background write of the checkpoint of ``(node, step)``, promised by batch
    ``batch_id``, failed after that batch had ended (``error``: the exception, one
    line). Nothing was stored: work that needs this model is planned from an earlier
    one. (A write that fails while its batch still runs fails the batch instead.)"""

    batch_id: int
    worker: int
    node: int
    step: int
    error: str


@dataclass(frozen=True)
class BatchDone:
    """The batch ended (finished or aborted): ``steps`` trained in ``busy_seconds``,
    of which ``load_seconds`` went to loading its start checkpoint and
    ``save_wait_seconds`` to waiting, at its end, for its background checkpoint writes.
    Workers no longer wait (0): a batch ends when its training does, and the writes of
    its last checkpoints follow as ``CheckpointSaved``/``CheckpointFailed`` (see
    :func:`stagetree.reports.costs.efficiency`)."""

    batch_id: int
    worker: int
    busy_seconds: float
    steps: int
    load_seconds: float = 0.0
    save_wait_seconds: float = 0.0


@dataclass(frozen=True)
class BatchFailed:
    """A trainer raised (``kind="trainer"``), or the start checkpoint could not be loaded
    (``kind="checkpoint"``: the checkpoint is lost; the work should be planned again
    from an earlier one, not failed).

    ``phase`` says what ``(node, step)`` means: ``"train"``: training step ``step``
    (``setup``/``train`` of the model at ``step``) raised; ``"point"``: evaluating or
    checkpointing the model at ``step`` failed (``evaluate``, ``state_dict``, a state
    the checkpoint format cannot hold); ``"start"``: building or restoring the trainer
    at ``step`` failed (``__init__``, ``load_state_dict``).

    ``kind="oom"``: the trainer ran out of device memory (a CUDA out-of-memory error):
    not a plain failure, the stage needs a worker with more devices.
    """

    batch_id: int
    worker: int
    node: int
    step: int
    error: str
    traceback: str
    kind: str = "trainer"
    phase: str = "train"


@dataclass(frozen=True)
class SplitMissed:
    """Answer to :class:`AddCheckpoint`: the worker was already past ``step``."""

    batch_id: int
    worker: int
    node: int
    step: int


@dataclass(frozen=True)
class FusionFailed:
    """Worker event: the members of a ``RunFused`` could not be trained fused (the
    trainer's model cannot be vmapped, an optimizer without a fused form...); the worker
    trains them one after another instead. Sent once per job, before its members'
    events; ``trainer`` is their ``RunBatch.trainer`` key. ``members``: how many of the
    job's members train one by one instead (the engine no longer counts them as fused);
    ``whole``: none of the job's members trained fused (the job is not counted either)."""

    worker: int
    root_key: str
    trainer: str
    error: str
    members: int = 0
    whole: bool = False


@dataclass(frozen=True)
class FusedOutOfMemory:
    """Worker event: a fused job of ``width`` members of plan tree ``root_key`` ran out of
    device memory; the worker trains them again at half the width (fused jobs of that
    tree should be no wider from now on). Sent before the members' events."""

    worker: int
    root_key: str
    width: int


@dataclass(frozen=True)
class WorkerReady:
    """Executor event: worker ``worker`` is up and idle (also sent for a replacement);
    it owns ``devices`` devices (a stage that needs more never goes to it)."""

    worker: int
    devices: int = 1


@dataclass(frozen=True)
class WorkerLost:
    """Executor event: the worker died; ``batch_id`` is the batch it was running, if any.
    Checkpoints it reported as saved stay valid."""

    worker: int
    batch_id: int | None
    reason: str = ""


WorkerEvent = (
    Progress
    | MetricsReported
    | CurveReported
    | CheckpointSaved
    | CheckpointFailed
    | BatchDone
    | BatchFailed
    | SplitMissed
    | FusionFailed
    | FusedOutOfMemory
    | WorkerReady
    | WorkerLost
)
