"""Runs a batch of stages (:class:`~stagetree.work.RunBatch`) against a user Trainer.

A :class:`Worker` lives as long as its executor slot (a process, an actor, a thread) and
keeps its trainer in memory between batches: a batch that starts where the previous one
stopped (same trainer key, root key and config, same canonical ``(node, step)``) skips
the checkpoint load. Otherwise it builds a fresh trainer and loads the batch's start
checkpoint.

One worker serves several trainer classes: it builds a batch's trainer with the factory
registered under the batch's :attr:`~stagetree.work.RunBatch.trainer` key (``""``: the
default trainer). A key it has no factory for fails the batch at its start.

It holds the :class:`~stagetree.trainer.Trainer` contract exactly: before the t-th call
of ``train()`` the trainer has been given the value at step t of every sequence, all of
them after construction or restore, only the changed ones otherwise.

Checkpoints are captured synchronously (a deep copy of ``state_dict()``: tensors cloned,
arrays copied) and written by a background thread while training goes on. The worker
keeps the copies it wrote in memory (bounded, host memory only, see
:mod:`stagetree.executors.kept`): a later batch that starts from one of them restores it
from there instead of reading the file back.

Events of a batch, in order: ``Progress`` (throttled, always at segment ends and at
evaluation/checkpoint points), ``CurveReported`` (the learning curve since the previous
one, right after a ``Progress`` and before the ``MetricsReported`` of a point),
``MetricsReported``, ``CheckpointSaved`` (from the writer thread, when durable),
``SplitMissed`` (answers to live splits it cannot honour), and exactly one terminal
event, ``BatchDone`` or ``BatchFailed`` (after the last ``CurveReported``).
With ``emit_many`` (a process worker's pipe), the events a point gives after its
``Progress`` (its ``CurveReported`` and ``MetricsReported``, those of the batch's last
step with its ``BatchDone``) go out together, in one message: one write and one
wake-up of the driver instead of one per event, and the driver reads a batch's end
whole. The order of all events stays the same (held events are sent before a
checkpoint write starts, so a ``CheckpointSaved`` never overtakes them), and a
``Progress`` is never held (the scheduler times live splits by it).
``BatchDone`` is sent as soon as training is done: the writes of the batch's last
checkpoints go on in the background, and their ``CheckpointSaved`` (or
``CheckpointFailed``) may follow it, so checkpoint I/O is off the critical path (the
next batch may start meanwhile, continuing the model in memory). ``BatchFailed`` waits
for the batch's writes. ``emit`` must be thread-safe. ``Progress.seconds_per_step`` is
wall time per step since the previous ``Progress``, excluding evaluation and checkpoint
capture.

Learning curves: every step's ``train()`` metrics, merged with ``evaluate()``'s at the
steps where the model is evaluated (requested points, and every ``RunBatch.eval_every``
steps), evaluate's winning a name clash. A planned point is checkpointed before it
is evaluated, and the model is evaluated at most once per step (a live split at the
step just evaluated is checkpointed after that evaluation, which the Trainer contract
makes harmless).

Failures: an exception from the trainer (``__init__``, ``load_state_dict``, ``setup``,
``train``, ``evaluate``, ``state_dict``) ends the batch with ``BatchFailed`` at the
``(node, step)`` being trained or evaluated, with the formatted traceback, and the
trainer is dropped; ``BatchFailed.phase`` says whether a training step, a point
(evaluation, checkpoint) or the trainer's construction/restore failed. A start
checkpoint that is missing or corrupt fails the batch the same way with an ``error``
starting with ``"CheckpointError:"``: the model has to be recomputed. A state that
cannot be checkpointed (``state_dict()`` not implemented or not a dict, a value the
checkpoint format cannot hold: the error names its key) fails the batch at that
point, before anything is written. A background write that fails (the store retries
for its ride-through window first) is reported as ``CheckpointFailed``, after the
batch's ``BatchDone`` when it failed while the batch ran: the store failed, not the
trainer, so the work is planned again, never failed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stagetree.checkpoints import CheckpointStore, check_state
from stagetree.exceptions import CheckpointError, FusionError, StagetreeError, TrainerError
from stagetree.executors.devices import is_out_of_memory
from stagetree.executors.kept import DEFAULT_KEEP_BYTES, KeptStates
from stagetree.hp import step_values
from stagetree.names import HpReadWatch
from stagetree.trainer import Trainer, built_to_restore
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
    MetricsReported,
    Progress,
    RunBatch,
    RunFused,
    Segment,
    SplitMissed,
    WorkerEvent,
)

__all__ = ["TrainerFactory", "Worker", "WorkerStats", "evaluate_metrics", "snapshot_state"]

TrainerFactory = Callable[[Mapping[str, Any]], Trainer]
"""Builds a trainer from a batch's fixed config (usually the Trainer subclass itself)."""

logger = logging.getLogger(__name__)

_perf = time.perf_counter
# Sequence values are looked up per chunk of steps, not per step.
_CHUNK = 1024


def _no_instructions() -> list[AddCheckpoint | Abort]:
    return []


@dataclass
class WorkerStats:
    """Counters a worker keeps over its life (read them for reports and tuning).

    Attributes:
        batches: batches run (finished, aborted or failed).
        steps: ``train()`` calls.
        loads: checkpoint loads (fresh trainer restored from a checkpoint).
        kept_loads: those of ``loads`` restored from the state the worker kept in memory
            when it wrote or first read that checkpoint (no file read).
        reuses: batches that continued the in-memory trainer without loading.
        load_seconds: total seconds spent building trainers and loading checkpoints.
        last_load_seconds: the same for the latest batch (0 when it reused the trainer).
        saves: checkpoints written; save_seconds: their total capture + write time.
    """

    batches: int = 0
    steps: int = 0
    loads: int = 0
    kept_loads: int = 0
    reuses: int = 0
    load_seconds: float = 0.0
    last_load_seconds: float = 0.0
    saves: int = 0
    save_seconds: float = 0.0


class _Point:
    """Work due when the model reaches one step: evaluate and/or checkpoint."""

    __slots__ = ("ckpt_done", "ckpt_node", "eval_done", "eval_node")

    def __init__(self) -> None:
        self.eval_node: int | None = None
        self.ckpt_node: int | None = None
        self.eval_done = False
        self.ckpt_done = False


class _Job:
    """What a worker keeps of one batch while it runs (a ``RunFused`` has one per member):
    its non-empty segments, its end step, the node it starts on and its points."""

    def __init__(self, batch: RunBatch) -> None:
        self.batch = batch
        self.segments = [s for s in batch.segments if s.stop > s.start]
        self.end_step = self.segments[-1].stop if self.segments else batch.start_step
        self.start_node = (
            batch.start_at[0]
            if batch.start_at is not None
            else (batch.segments[0].node if batch.segments else 0)
        )
        self.points = Worker._points(batch, self.end_step)
        # Learning-curve points not sent yet; the latest evaluation (step, metrics).
        self.curve: list[tuple[int, int, dict[str, float], bool]] = []
        self.evaluated: tuple[int, dict[str, float]] | None = None
        # The first background write of the batch that failed while it ran: (node,
        # step, error); ``ended``: BatchDone was decided (later failures are reported
        # as CheckpointFailed). Both under the worker's lock (the writer thread).
        self.write_error: tuple[int, int, BaseException] | None = None
        self.ended = False
        # An Abort asked to keep the model where the batch stops (Abort.save).
        self.keep = False


class _Failed(Exception):
    """Internal: trainer code (or the start checkpoint) failed at ``(node, step)``."""

    def __init__(
        self,
        node: int,
        step: int,
        error: BaseException,
        checkpoint: bool = False,
        phase: str = "train",
    ) -> None:
        super().__init__(str(error))
        self.checkpoint = checkpoint
        self.phase = phase
        self.node = node
        self.step = step
        self.error = error
        self.tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))


class Worker:
    """Runs batches one at a time against a trainer it keeps in memory.

    Args:
        worker_id: id reported in every event.
        trainer_factory: builds a trainer from a batch's fixed config (usually the
            Trainer subclass itself), for batches of the default trainer (``""``); or
            factories by trainer key (``""`` the default), looked up when a batch
            starts: the mapping may gain keys while the worker lives, and a lookup that
            raises (a trainer that cannot be loaded) fails that batch at its start,
            like a key it does not have.
        store: where checkpoints are loaded from and written to.
        emit: receives every event; called from the calling thread and from the
            checkpoint writer thread, so it must be thread-safe.
        progress_interval: seconds between throttled ``Progress`` events.
        max_pending_saves: captured checkpoints waiting for the writer before training
            blocks (bounds the memory held by snapshots).
        keep_bytes: bound of the checkpoints it wrote or read that it keeps in memory
            to start later batches from (0: none).
        emit_many: sends several events at once, in order (one message); None: each
            goes through ``emit`` (see the module docstring). Called from the
            calling thread only.
    """

    def __init__(
        self,
        worker_id: int,
        trainer_factory: TrainerFactory | Mapping[str, TrainerFactory],
        store: CheckpointStore,
        emit: Callable[[WorkerEvent], None],
        *,
        progress_interval: float = 0.2,
        max_pending_saves: int = 2,
        keep_bytes: int = DEFAULT_KEEP_BYTES,
        emit_many: Callable[[list[WorkerEvent]], None] | None = None,
    ) -> None:
        if max_pending_saves < 1:
            raise ValueError(f"max_pending_saves must be >= 1, got {max_pending_saves}")
        self.worker_id = worker_id
        self.trainer_factory = trainer_factory
        self._factories: Mapping[str, TrainerFactory] = (
            trainer_factory if isinstance(trainer_factory, Mapping) else {"": trainer_factory}
        )
        self.store = store
        self.emit = emit
        self.emit_many = emit_many
        # Events of the calling thread held to go out together (None: none are held);
        # see _gather.
        self._outgoing: list[WorkerEvent] | None = None
        self.progress_interval = progress_interval
        self.max_pending_saves = max_pending_saves
        self.stats = WorkerStats()
        self._trainer: Trainer | None = None
        # Where the in-memory trainer is: (trainer key, root_key, config, canonical
        # (node, step) | None).
        self._trainer_key: str | None = None
        self._root_key: str | None = None
        self._config: dict[str, Any] | None = None
        self._at: tuple[int, int] | None = None
        # Sequence values the trainer was last given, by name.
        self._given: dict[str, Any] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._kept = KeptStates(keep_bytes)  # the checkpoints it wrote, by ref
        self._lock = threading.Lock()  # a job's write_error/ended, shared with the writer
        self._reads = HpReadWatch()  # names a fresh trainer's first setup() never reads
        # Trainer keys whose fused jobs failed to fuse: their members run one by one.
        self._unfusible: set[str] = set()
        # Fused width by plan tree after a fused step ran out of device memory: half the
        # width that did (see _FusedRun.narrower).
        self._oom_width: dict[str, int] = {}
        # A fused job that started from the in-memory model keeps its state here while
        # it runs: members that must start again unfused restore it (it may not be
        # durable anywhere yet). (batch's trainer, root key, config, start_at), state.
        self._held: tuple[tuple[Any, ...], Any] | None = None
        # The step under way: (batch id, node, step, perf_counter() at its start); None
        # between batches. Read by a step-timeout watchdog (:meth:`expire`).
        self._step_at: tuple[int, int, int, float] | None = None

    # ------------------------------------------------------------------ public

    @property
    def position(self) -> tuple[str, tuple[int, int] | None] | None:
        """``(root_key, (node, step))`` of the trainer held in memory, None when none is.

        ``(node, step)`` is None for a trainer that has not trained a step yet."""
        if self._trainer is None or self._root_key is None:
            return None
        return (self._root_key, self._at)

    @property
    def trainer_key(self) -> str | None:
        """Key of the trainer held in memory (``""``: the default), None when none is."""
        return self._trainer_key if self._trainer is not None else None

    def drop_trainer(self) -> None:
        """Forget the in-memory trainer (the next batch builds a fresh one)."""
        self._trainer = None
        self._trainer_key = None
        self._root_key = None
        self._config = None
        self._at = None
        self._given = {}

    def flush(self) -> None:
        """Wait until every background checkpoint write has ended (and its
        ``CheckpointSaved``/``CheckpointFailed`` was emitted)."""
        self._wait_saves()

    def _send(self, event: WorkerEvent) -> None:
        """Emit ``event`` from the calling thread: now, or with the events gathered."""
        out = self._outgoing
        if out is None:
            self.emit(event)
        else:
            out.append(event)

    def _gather(self) -> None:
        """Hold the calling thread's next events until :meth:`_release` sends them in
        one message (only with ``emit_many``)."""
        if self.emit_many is not None and self._outgoing is None:
            self._outgoing = []

    def _send_held(self) -> None:
        """Send the events held so far (and go on gathering): before anything that
        another thread may report (a checkpoint write), so that the order stays."""
        out = self._outgoing
        if out:
            self._outgoing = []
            if len(out) == 1:
                self.emit(out[0])
            else:
                assert self.emit_many is not None
                self.emit_many(out)

    def _release(self) -> None:
        """Send the events held and stop gathering."""
        self._send_held()
        self._outgoing = None

    def close(self) -> None:
        """Wait for background writes, stop the writer thread and drop the trainer."""
        self._wait_saves()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._kept.clear()
        self.drop_trainer()

    def run(
        self,
        batch: RunBatch,
        poll: Callable[[], list[AddCheckpoint | Abort]] | None = None,
    ) -> None:
        """Run ``batch`` to its end (or abort/failure), emitting events as it goes.

        Args:
            batch: the instruction.
            poll: called between steps without blocking; returns live instructions
                (``AddCheckpoint``/``Abort``) that arrived for this worker.
        """
        try:
            self._run(batch, poll or _no_instructions)
        finally:
            self._release()  # what the batch's end gathered goes out together

    def _run(self, batch: RunBatch, poll: Callable[[], list[AddCheckpoint | Abort]]) -> None:
        begin = _perf()
        emit = self._send
        wid = self.worker_id
        bid = batch.batch_id
        self.stats.batches += 1
        job = _Job(batch)
        segments, points, node = job.segments, job.points, job.start_node
        step = batch.start_step
        steps_done = 0
        eval_every = batch.eval_every
        try:
            trainer = self._prepare(batch, node)
            aborted = False
            point = points.get(step)
            if point is not None:
                self._do_point(trainer, job, step, point)
            instructions = poll()
            if instructions:
                aborted = self._apply(instructions, trainer, job, step)
            interval = self.progress_interval
            for seg in segments:
                if aborted:
                    break
                node = seg.node
                seg_stop = seg.stop
                mark = _perf()
                since = 0
                for lo in range(seg.start, seg_stop, _CHUNK):
                    hi = min(lo + _CHUNK, seg_stop)
                    changes = self._changes(seg, lo, hi)
                    for t in range(lo, hi):
                        self._step_at = (bid, node, t, _perf())
                        change = changes.get(t)
                        if change is not None:
                            self._given.update(change)
                            trainer.setup(self._reads.wrap(trainer, change))
                        trained = _train_metrics(trainer.train())
                        self._reads.after_step()
                        step = t + 1
                        steps_done += 1
                        since += 1
                        now = _perf()
                        point = points.get(step)
                        if point is not None or step == seg_stop or now - mark >= interval:
                            emit(Progress(bid, wid, node, step, (now - mark) / since))
                            # The point's curve and metrics go out together (with the
                            # batch's BatchDone at its last step).
                            self._gather()
                            self._curve_point(trainer, job, node, step, trained, point)
                            self._flush_curve(job)
                            mark = _perf()
                            since = 0
                        elif trained or (eval_every and step % eval_every == 0):
                            # Not counted in seconds_per_step: evaluation time.
                            mark += self._curve_point(trainer, job, node, step, trained, None)
                        instructions = poll()
                        if instructions:
                            aborted = self._apply(instructions, trainer, job, step)
                            if aborted:
                                break
                        if step < job.end_step:
                            self._release()
                    if aborted:
                        break
            self._step_at = None
            kept = aborted and job.keep and steps_done > 0 and self._keep(trainer, job, node, step)
            if steps_done:
                self._at = (node, step)
            self._flush_curve(job)
            unsaved = self._end_job(job)
            if kept:
                self._wait_saves()  # its CheckpointSaved goes before its BatchDone
        except _Failed as failed:
            self._step_at = None
            self._flush_curve(job)  # the steps before the failure stand
            self._finish_failed(job, failed, steps_done)
            return
        except Exception as exc:
            # Trainer code raised in setup/train (the only unwrapped calls above).
            self._step_at = None
            self._flush_curve(job)
            self._finish_failed(job, _Failed(node, step, exc), steps_done)
            return
        self.stats.steps += steps_done
        load = self.stats.last_load_seconds
        emit(BatchDone(bid, wid, _perf() - begin, steps_done, load))
        if unsaved is not None:
            emit(unsaved)

    # ------------------------------------------------------------------ fused jobs

    def run_fused(
        self,
        job: RunFused,
        poll: Callable[[], list[AddCheckpoint | Abort]] | None = None,
    ) -> None:
        """Run the members of ``job`` as one fused job (see :mod:`stagetree.fusion`):
        every member emits the events of an ordinary batch, and a member leaves when
        its segments end (or it is aborted or fails). Members that cannot be fused (the
        trainer class is not fusible, or :class:`~stagetree.exceptions.FusionError` on
        building the group or on its first step) run one after another instead, after a
        ``FusionFailed`` event.

        Args:
            job: the instruction.
            poll: as for :meth:`run`; instructions for any member.
        """
        mail = _Mailbox(poll or _no_instructions, self._missed)
        first = job.members[0]
        try:
            factory = self._factory(first.trainer)
        except Exception:
            factory = None  # run() fails each member at its start, with the reason
        fusible = getattr(factory, "fusible", None) and callable(getattr(factory, "fuse", None))
        if len(job.members) > 1 and self._reusable(first):
            self._hold(first)
        try:
            if len(job.members) > 1 and (not fusible or first.trainer in self._unfusible):
                # The engine counted the job as fused: say it is not.
                self._fusion_failed(first, None, len(job.members), whole=True)
            if len(job.members) == 1 or not fusible or first.trainer in self._unfusible:
                self._run_each(job.members, mail)
            else:
                assert factory is not None
                self._run_fused(job, mail, factory)
        finally:
            self._held = None

    def _hold(self, batch: RunBatch) -> None:
        """Keep a copy of the in-memory model ``batch`` starts from, for the members of
        its job that cannot continue the trainer itself (see ``_held``)."""
        assert self._trainer is not None
        try:
            self._held = (self._where(batch), snapshot_state(self._trainer.state_dict()))
        except Exception:  # the members report it at their start
            self._held = None

    def _run_fused(self, job: RunFused, mail: _Mailbox, factory: TrainerFactory) -> None:
        first = job.members[0]
        begin = _perf()
        jobs = [_Job(batch) for batch in job.members]
        try:
            trainers = self._members(first, jobs[0].start_node, factory, len(jobs))
        except _Failed as failed:
            for j in jobs:
                self._finish_failed(j, failed, 0)
                mail.done(j.batch.batch_id)
            return
        load = _perf() - begin
        # The device may hold fewer members than the scheduler sent (a memory estimate on
        # accelerators; Trainer.fused_width_limit): then the job runs in narrower chunks.
        fits = _width_limit(trainers[0], len(trainers))
        lo = 0
        while lo < len(jobs):
            # Narrower after a chunk ran out of device memory (see _FusedRun.narrower).
            limit = min(fits, self._oom_width.get(first.root_key, fits))
            chunk, members = jobs[lo : lo + limit], trainers[lo : lo + limit]
            trainers[lo : lo + limit] = [None] * len(members)  # the group owns them now
            try:
                group = factory.fuse(members)  # type: ignore[attr-defined]
            except Exception as exc:
                self._fusion_failed(first, exc, len(jobs) - lo, whole=lo == 0)
                self._run_each(tuple(j.batch for j in jobs[lo:]), mail)
                return
            rest = len(jobs) - lo - len(chunk)
            _FusedRun(self, group, chunk, mail, load if lo == 0 else 0.0, rest, lo == 0).run()
            del group, members
            if first.trainer in self._unfusible:  # it fell back: the rest go one by one
                self._run_each(tuple(j.batch for j in jobs[lo + limit :]), mail)
                return
            lo += limit

    def _members(self, batch: RunBatch, node: int, factory: TrainerFactory, n: int) -> list[Any]:
        """``n`` trainers at the batch's start (built fresh, or restored from the start
        checkpoint, or from the in-memory trainer when it stands there)."""
        if self._reusable(batch):
            assert self._trainer is not None
            try:
                state = self._trainer.state_dict()
            except Exception as exc:
                raise _Failed(node, batch.start_step, exc, phase="start") from exc
        else:
            state = self._start_state(batch, node)
        self.drop_trainer()
        trainers = []
        try:
            for _ in range(n):
                trainers.append(_built(factory, batch.config, state))
        except Exception as exc:
            raise _Failed(node, batch.start_step, exc, phase="start") from exc
        if state is not None:
            self.stats.loads += 1
        return trainers

    @staticmethod
    def _where(batch: RunBatch) -> tuple[Any, ...]:
        return (batch.trainer, batch.root_key, dict(batch.config), batch.start_at)

    def _reusable(self, batch: RunBatch) -> bool:
        """Whether the in-memory trainer stands exactly where ``batch`` starts."""
        return (
            self._trainer is not None
            and self._trainer_key == batch.trainer
            and self._root_key == batch.root_key
            and self._at == batch.start_at
            and self._config == dict(batch.config)
        )

    def _fusion_failed(
        self, batch: RunBatch, exc: BaseException | None, members: int, whole: bool
    ) -> None:
        """``members`` members of ``batch``'s job (all of them: ``whole``) cannot be
        fused: say so (``exc``: why; None: it was said before), and run them (and later
        jobs of that trainer) one after another."""
        if exc is None:
            error = (
                "it could not be fused before on this worker"
                if batch.trainer in self._unfusible
                else "its trainer is not fusible on this worker"
            )
        else:
            self._unfusible.add(batch.trainer)
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("worker %s: training unfused: %s", self.worker_id, error)
        event = FusionFailed(self.worker_id, batch.root_key, batch.trainer, error, members, whole)
        self._send(event)

    def _run_each(self, members: tuple[RunBatch, ...], mail: _Mailbox) -> None:
        for batch in members:
            bid = batch.batch_id
            self.run(batch, lambda bid=bid: mail.poll_for(bid))  # type: ignore[misc]
            mail.done(bid)

    # ------------------------------------------------------------------ batch start

    def _prepare(self, batch: RunBatch, node: int) -> Trainer:
        config = dict(batch.config)
        if self._reusable(batch):
            assert self._trainer is not None
            self.stats.reuses += 1
            self.stats.last_load_seconds = 0.0
            return self._trainer
        self.drop_trainer()
        begin = _perf()
        try:
            factory = self._factory(batch.trainer)
        except Exception as exc:
            raise _Failed(node, batch.start_step, exc, phase="start") from exc
        state = self._start_state(batch, node)
        try:
            trainer = _built(factory, batch.config, state)
        except Exception as exc:
            raise _Failed(node, batch.start_step, exc, phase="start") from exc
        if state is not None:
            self.stats.loads += 1
        seconds = _perf() - begin
        self.stats.load_seconds += seconds
        self.stats.last_load_seconds = seconds
        self._trainer = trainer
        self._trainer_key = batch.trainer
        self._root_key = batch.root_key
        self._config = config
        self._at = batch.start_at
        self._given = {}
        self._reads.arm()
        return trainer

    def _start_state(self, batch: RunBatch, node: int) -> Any:
        """The state ``batch`` starts from: its start checkpoint's, None for a fresh
        model (a missing or corrupt checkpoint fails the batch as ``checkpoint``)."""
        try:
            if batch.start_checkpoint is not None:
                # Node ids are unique in a storage: the node and step name the point
                # (its ref names the content, see CheckpointStore.load).
                ref = batch.start_checkpoint
                kept = self._kept.get(ref, batch.start_at)
                # Kept while its file exists: a missing checkpoint still fails the batch.
                if kept is not None and self.store.exists(ref):
                    self.stats.kept_loads += 1
                    return snapshot_state(kept)  # the trainer may change what it gets
                if batch.start_at is None:
                    return self.store.load(ref)
                at = tuple(batch.start_at)
                state = self.store.load(ref, of={"node": at[0], "step": at[1]})
                if self._kept.would_keep(state):
                    # A copy of what the verified file holds: the next sibling batch
                    # this worker starts from it reads nothing.
                    self._kept.put(ref, (at[0], at[1]), snapshot_state(state))
                return state
            if self._held is not None and self._held[0] == self._where(batch):
                return snapshot_state(self._held[1])  # a fused job's in-memory start
            if batch.start_step != 0:
                raise CheckpointError(
                    f"batch {batch.batch_id} starts at step {batch.start_step} "
                    "without a start checkpoint, and this worker does not hold that model"
                )
            return None
        except CheckpointError as exc:
            raise _Failed(node, batch.start_step, exc, checkpoint=True, phase="start") from exc

    def _factory(self, key: str) -> TrainerFactory:
        """The factory of trainer ``key``.

        Raises:
            StagetreeError: no trainer is registered under ``key``.
            Exception: whatever loading it raised (it cannot be unpickled, imported...).
        """
        factory = self._factories.get(key)
        if factory is None:
            if key == "":
                raise StagetreeError("this worker has no default trainer (key '')")
            raise StagetreeError(
                f"unknown trainer key {key!r}: no trainer class is registered under it "
                "(register it with the executor's add_trainer() before submitting its batches)"
            )
        return factory

    @staticmethod
    def _points(batch: RunBatch, end_step: int) -> dict[int, _Point]:
        points: dict[int, _Point] = {}
        for node, step in batch.evaluate_at:
            if batch.start_step <= step <= end_step:
                points.setdefault(step, _Point()).eval_node = node
        for node, step in batch.checkpoint_at:
            if batch.start_step <= step <= end_step:
                points.setdefault(step, _Point()).ckpt_node = node
        return points

    # ------------------------------------------------------------------ sequences

    def _changes(
        self, seg: Segment, lo: int, hi: int, given: dict[str, Any] | None = None
    ) -> dict[int, dict[str, Any]]:
        """Values to give before each step in ``[lo, hi)``: only steps where some
        sequence differs from what the trainer holds (all of them after a restore).
        ``given``: what it holds (default: the in-memory trainer's)."""
        given = self._given if given is None else given
        out: dict[int, dict[str, Any]] = {}
        for name, seq in seg.hp.items():
            column = step_values(seq, lo, hi)
            last = given.get(name, _MISSING)
            first = column[0]
            # Constant over the chunk (the common case), checked at C speed.
            if column.count(first) == len(column) and len(set(map(type, column))) == 1:
                if not _same(last, first):
                    out.setdefault(lo, {})[name] = first
                continue
            for i, value in enumerate(column):
                if not _same(last, value):
                    out.setdefault(lo + i, {})[name] = value
                    last = value
        return out

    # ------------------------------------------------------------------ learning curves

    def _curve_point(
        self,
        trainer: Trainer,
        job: _Job,
        node: int,
        step: int,
        trained: dict[str, float],
        point: _Point | None,
    ) -> float:
        """Record the curve at ``step`` (canonical ``(node, step)``): ``train()``'s
        metrics, and ``evaluate()``'s when the step is due (``eval_every``) or a point
        evaluates there; then do the point. Returns the seconds it took."""
        begin = _perf()
        if self._evaluates(job, step, point):
            if point is not None and point.ckpt_node is not None:
                # Checkpoint first: the saved state must not depend on whether we evaluated.
                self._do_point(trainer, job, step, point, evaluate=False)
            metrics: dict[str, float] | None = self._evaluate(trainer, job, node, step)
        else:
            metrics = None
        if trained or metrics is not None:
            values = {**trained, **metrics} if metrics is not None else trained
            job.curve.append((node, step, values, metrics is not None))
        if point is not None:
            self._do_point(trainer, job, step, point)
        return _perf() - begin

    @staticmethod
    def _evaluates(job: _Job, step: int, point: _Point | None) -> bool:
        """Whether the curve point at ``step`` evaluates the model."""
        every = job.batch.eval_every
        return bool(every and step % every == 0) or (
            point is not None and point.eval_node is not None and not point.eval_done
        )

    def _flush_curve(self, job: _Job) -> None:
        if job.curve:
            curve, job.curve = job.curve, []
            self._send(CurveReported(job.batch.batch_id, self.worker_id, tuple(curve)))

    def _evaluate(self, trainer: Trainer, job: _Job, node: int, step: int) -> dict[str, float]:
        """``evaluate()`` of the model at ``step``, at most once per step of a batch."""
        if job.evaluated is not None and job.evaluated[0] == step:
            return job.evaluated[1]
        try:
            metrics = evaluate_metrics(trainer)
        except Exception as exc:
            raise _Failed(node, step, exc, phase="point") from exc
        job.evaluated = (step, metrics)
        return metrics

    # ------------------------------------------------------------------ points, splits

    def _do_point(
        self, trainer: Trainer, job: _Job, step: int, point: _Point, evaluate: bool = True
    ) -> None:
        batch = job.batch
        # Checkpoint first: the saved state must not depend on whether we evaluated.
        if point.ckpt_node is not None and not point.ckpt_done:
            point.ckpt_done = True
            self._checkpoint(trainer, job, point.ckpt_node, step)
        if evaluate and point.eval_node is not None and not point.eval_done:
            point.eval_done = True
            metrics = self._evaluate(trainer, job, point.eval_node, step)
            self._flush_curve(job)  # the curve reaches the plan first
            self._send(
                MetricsReported(batch.batch_id, self.worker_id, point.eval_node, step, metrics)
            )

    def _apply(
        self,
        instructions: list[AddCheckpoint | Abort],
        trainer: Trainer,
        job: _Job,
        step: int,
    ) -> bool:
        """Apply live instructions at ``step``; returns True when the batch must stop."""
        aborted = False
        for ins in instructions:
            if isinstance(ins, Abort):
                if ins.batch_id == job.batch.batch_id:
                    aborted = True
                    job.keep = job.keep or ins.save
                continue
            if ins.batch_id != job.batch.batch_id or aborted:
                self._missed(ins)
                continue
            point = self._add_point(ins, job, step)
            if point is not None and ins.step == step:
                self._do_point(trainer, job, step, point)
        return aborted

    def _missed(self, ins: AddCheckpoint | Abort) -> None:
        if not isinstance(ins, (AddCheckpoint, Abort)):
            raise TypeError(f"poll() returned {type(ins).__name__}, not AddCheckpoint/Abort")
        if isinstance(ins, AddCheckpoint):
            self._send(SplitMissed(ins.batch_id, self.worker_id, ins.node, ins.step))

    def _add_point(self, ins: AddCheckpoint, job: _Job, step: int) -> _Point | None:
        """The point of a live split of ``job`` at ``step`` (None, answered with
        ``SplitMissed``, when the batch is past it or will not reach it)."""
        if not isinstance(ins, AddCheckpoint):
            raise TypeError(f"poll() returned {type(ins).__name__}, not AddCheckpoint/Abort")
        if not step <= ins.step <= job.end_step:
            self._missed(ins)
            return None
        point = job.points.setdefault(ins.step, _Point())
        if point.ckpt_node is None:
            point.ckpt_node = ins.node
        if ins.evaluate and point.eval_node is None:
            point.eval_node = ins.node
        return point

    # ------------------------------------------------------------------ checkpoints

    def _keep(self, trainer: Trainer, job: _Job, node: int, step: int) -> bool:
        """Checkpoint an aborted batch's model where it stopped (``Abort.save``), unless
        the batch checkpointed it there already. Returns whether a write was started. A
        model that cannot be captured loses only the steps since the batch's last
        checkpoint (a warning), never the batch: its work was no longer needed."""
        point = job.points.get(step)
        if point is not None and point.ckpt_done:
            return False
        try:
            self._checkpoint(trainer, job, node, step)
        except _Failed as failed:
            logger.warning(
                "worker %s: the model of node %s at step %s, where batch %s stopped, "
                "cannot be kept: %s",
                self.worker_id,
                node,
                step,
                job.batch.batch_id,
                failed,
            )
            return False
        return True

    def expire(self, timeout: float) -> bool:
        """When the step under way has run longer than ``timeout`` seconds, end its
        batch with ``BatchFailed`` naming the reason and return True: the caller (a
        step-timeout watchdog in the worker's process) then stops the process, since a
        ``train()`` that never returns cannot be interrupted. Checkpoint writes still
        under way get a few seconds to end first (none is reported after the failure).
        Returns False while the step is within its time (or none runs)."""
        at = self._step_at
        if at is None or _perf() - at[3] <= timeout:
            return False
        batch_id, node, step, _ = at
        for future in list(self._pending):
            with contextlib.suppress(Exception):
                future.result(timeout=5.0)
        error = f"StepTimeout: step {step} took longer than step_timeout={timeout:g}s"
        self.emit(BatchFailed(batch_id, self.worker_id, node, step, error, "", "trainer"))
        return True

    def _checkpoint(self, trainer: Trainer, job: _Job, node: int, step: int) -> None:
        begin = _perf()
        try:
            state = trainer.state_dict()
            check_state(state, f"{type(trainer).__name__}.state_dict()")
            snapshot = snapshot_state(state)
        except Exception as exc:
            raise _Failed(node, step, exc, phase="point") from exc
        capture = _perf() - begin
        pending = [f for f in self._pending if not f.done()]
        while len(pending) >= self.max_pending_saves:
            pending.pop(0).result()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(
                1, thread_name_prefix=f"stagetree-ckpt-{self.worker_id}"
            )
        name = _checkpoint_name(job.batch.root_key, node, step)
        self._send_held()  # its CheckpointSaved must not overtake them
        try:
            future = self._writer.submit(self._write, job, node, step, name, snapshot, capture)
        except RuntimeError:
            # The interpreter is exiting (an in-process worker stopping at exit): no
            # new thread may start, so this write is done here.
            self._write(job, node, step, name, snapshot, capture)
            return
        pending.append(future)
        self._pending = pending

    def _write(
        self, job: _Job, node: int, step: int, name: str, state: dict[str, Any], capture: float
    ) -> None:
        batch_id = job.batch.batch_id
        try:
            of = {"root": job.batch.root_key, "node": node, "step": step}
            info = self.store.save(name, state, of)
        except Exception as exc:
            # While the batch runs, training goes on (it may still be needed) and the
            # batch fails when it ends; after its end, the scheduler is told.
            with self._lock:
                ended = job.ended
                if not ended and job.write_error is None:
                    job.write_error = (node, step, exc)
            if ended:
                error = f"{type(exc).__name__}: {exc}"
                logger.warning("worker %s: checkpoint write failed: %s", self.worker_id, error)
                self.emit(CheckpointFailed(batch_id, self.worker_id, node, step, error))
            return
        self._kept.put(info.ref, (node, step), state)
        seconds = capture + info.seconds
        self.stats.saves += 1
        self.stats.save_seconds += seconds
        self.emit(
            CheckpointSaved(batch_id, self.worker_id, node, step, info.ref, info.nbytes, seconds)
        )

    def _wait_saves(self) -> None:
        self._send_held()  # before the CheckpointSaved of the writes waited for
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _end_job(self, job: _Job) -> CheckpointFailed | None:
        """The batch's training is done: mark it ended without waiting for the writes
        still going on. Returns the ``CheckpointFailed`` of a write that already failed
        (the store out of reach), sent after the batch's ``BatchDone``: the store
        failed, not the trainer, so the work is planned again rather than failed."""
        with self._lock:
            failed = job.write_error
            job.write_error = None
            job.ended = True
        if failed is None:
            return None
        node, step, exc = failed
        error = f"{type(exc).__name__}: {exc}"
        logger.warning("worker %s: checkpoint write failed: %s", self.worker_id, error)
        return CheckpointFailed(job.batch.batch_id, self.worker_id, node, step, error)

    def _finish_failed(self, job: _Job, failed: _Failed, steps_done: int) -> None:
        batch = job.batch
        self._wait_saves()
        self.stats.steps += steps_done
        self.drop_trainer()
        error = f"{type(failed.error).__name__}: {failed.error}"
        # Only the store's own error on the start checkpoint means "checkpoint lost";
        # a CheckpointError raised by trainer code is the trainer's failure.
        kind = "checkpoint" if failed.checkpoint else "trainer"
        if not failed.checkpoint and is_out_of_memory(failed.error):
            kind = "oom"  # a worker with more devices may train it (the scheduler's call)
        self._send(
            BatchFailed(
                batch.batch_id,
                self.worker_id,
                failed.node,
                failed.step,
                error,
                failed.tb,
                kind,
                failed.phase,
            )
        )


# ---------------------------------------------------------------------- fused jobs


def _width_limit(trainer: Any, width: int) -> int:
    """How many members of ``trainer``'s kind one fused job may hold (at most
    ``width``): the trainer's ``fused_width_limit()`` when it has one, else ``width``."""
    limit = getattr(trainer, "fused_width_limit", None)
    try:
        value = limit() if callable(limit) else None
    except Exception:
        logger.exception("fused_width_limit() failed; fusing %s members", width)
        value = None
    return width if value is None else max(1, min(width, int(value)))


class _Mailbox:
    """Live instructions of a fused job's members, sorted by batch id as they are
    polled; an ``AddCheckpoint`` for a member that has ended is answered ``missed``."""

    def __init__(
        self,
        poll: Callable[[], list[AddCheckpoint | Abort]],
        missed: Callable[[AddCheckpoint | Abort], None],
    ) -> None:
        self._poll = poll
        self._missed = missed
        self._boxes: dict[int, list[AddCheckpoint | Abort]] = {}
        self._ended: set[int] = set()

    def fetch(self) -> None:
        for ins in self._poll():
            if ins.batch_id in self._ended:
                self._missed(ins)
            else:
                self._boxes.setdefault(ins.batch_id, []).append(ins)

    def take(self, batch_id: int) -> list[AddCheckpoint | Abort]:
        """What arrived for ``batch_id`` until the last :meth:`fetch`."""
        return self._boxes.pop(batch_id, [])

    def poll_for(self, batch_id: int) -> list[AddCheckpoint | Abort]:
        """A ``poll`` for one member run on its own."""
        self.fetch()
        return self.take(batch_id)

    def done(self, batch_id: int) -> None:
        self._ended.add(batch_id)
        for ins in self._boxes.pop(batch_id, []):
            self._missed(ins)


class _Member:
    """One member of a fused job as the loop sees it: its batch state, the sequence
    values it was given, where it is in its segments."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.segments = job.segments
        self.index = 0  # current segment
        self.given: dict[str, Any] = {}
        self.chunk: dict[int, dict[str, Any]] = {}
        self.chunk_hi = -1
        self.steps = 0
        self.aborted = False
        self.seconds = 0.0  # training time since its last Progress, and steps in it
        self.since = 0
        self.busy = 0.0  # its share of the job's time so far

    @property
    def node(self) -> int:
        if self.segments:
            return self.segments[min(self.index, len(self.segments) - 1)].node
        return self.job.start_node

    def change(self, worker: Worker, t: int) -> dict[str, Any] | None:
        """Sequence values to give before training step ``t`` (None: no change)."""
        while self.segments[self.index].stop <= t:
            self.index += 1
        seg = self.segments[self.index]
        if t >= self.chunk_hi:
            hi = min(t + _CHUNK, seg.stop)
            self.chunk = worker._changes(seg, t, hi, self.given)
            self.chunk_hi = hi
        change = self.chunk.get(t)
        if change is not None:
            self.given.update(change)
        return change

    @property
    def seg_stop(self) -> int:
        return self.segments[self.index].stop


class _FusedRun:
    """The loop of one fused job (see :meth:`Worker.run_fused`)."""

    def __init__(
        self,
        worker: Worker,
        group: Any,
        jobs: list[_Job],
        mail: _Mailbox,
        load: float,
        rest: int = 0,
        whole: bool = True,
    ) -> None:
        self.w = worker
        self.rest = rest  # the job's members after these (narrower chunks, see run_fused)
        self.whole = whole  # these are the job's first members
        self.group = group
        self.members = [_Member(j) for j in jobs]  # index i is the group's member i
        self.width = len(jobs)
        for m in self.members:
            m.busy = load / self.width
        self.loaded = {jobs[0].batch.batch_id} if jobs else set()  # one load, reported once
        self.mail = mail
        self.load = load
        self.synced: set[int] = set()  # members whose trainer object holds their state

    def trainer(self, i: int, full: bool = True) -> Trainer:
        """Member ``i``'s trainer holding its state: all of it (``full``: it may be
        checkpointed), or what ``evaluate()`` sees (the optimizer state is left out)."""
        if i not in self.synced:
            self.group.sync(i, optimizer=full)
            if full:
                self.synced.add(i)
        return self.group.members[i]

    def run(self) -> None:
        w, members = self.w, self.members
        step = members[0].job.batch.start_step
        for i in reversed(range(len(members))):
            m = members[i]
            point = m.job.points.get(step)
            try:
                if point is not None:
                    w._do_point(self.trainer(i), m.job, step, point)
            except _Failed as failed:
                self.fail(i, failed)
        self.instructions(step)
        self.finish_ended(step)
        first = True
        interval = w.progress_interval
        mark = _perf()
        while self.members:
            t = step
            members = self.members
            begin = _perf()
            w._step_at = (members[0].job.batch.batch_id, members[0].node, t, begin)
            oom = ""
            try:
                for i, m in enumerate(members):
                    change = m.change(w, t)
                    if change is not None:
                        self.group.setup(i, change)
                metrics = self.group.step()
            except Exception as exc:
                if first and isinstance(exc, FusionError):
                    self.fall_back(exc)
                    return
                if len(members) > 1 and is_out_of_memory(exc):
                    oom = f"{type(exc).__name__}: {exc}"  # handled below, its frames gone
                else:
                    self.rerun(exc, t)
                    return
            finally:
                w._step_at = None
            if oom:
                self.narrower(oom, t)
                return
            first = False
            seconds = _perf() - begin
            self.synced.clear()
            step = t + 1
            width = len(members)
            now = _perf()
            due = now - mark >= interval
            if due:
                mark = now
            for i in reversed(range(len(members))):
                m = members[i]
                m.steps += 1
                m.seconds += seconds
                m.since += 1
                m.busy += seconds / width  # its share of the device
                own = _perf()
                node = m.node
                point = m.job.points.get(step)
                try:
                    if point is not None or w._evaluates(m.job, step, point):
                        # Synced: its evaluate() (and state_dict() at a checkpoint).
                        full = point is not None and point.ckpt_node is not None
                        trainer = self.trainer(i, full)
                    else:
                        trainer = self.group.members[i]  # only train() metrics recorded
                    trained = _train_metrics(metrics[i])
                    if point is not None or step == m.seg_stop or due:
                        sps = m.seconds / m.since
                        batch_id = m.job.batch.batch_id
                        w.emit(Progress(batch_id, w.worker_id, node, step, sps, width))
                        m.seconds, m.since = 0.0, 0
                        w._curve_point(trainer, m.job, node, step, trained, point)
                        w._flush_curve(m.job)
                    else:
                        w._curve_point(trainer, m.job, node, step, trained, None)
                    m.busy += _perf() - own
                except _Failed as failed:
                    self.fail(i, failed)
            self.instructions(step)
            self.finish_ended(step)

    def instructions(self, step: int) -> None:
        """Apply live instructions that arrived for the members, at ``step``."""
        self.mail.fetch()
        for i in reversed(range(len(self.members))):
            m = self.members[i]
            for ins in self.mail.take(m.job.batch.batch_id):
                if isinstance(ins, Abort):
                    m.aborted = True
                    m.job.keep = m.job.keep or ins.save
                    continue
                if m.aborted:
                    self.w._missed(ins)
                    continue
                point = self.w._add_point(ins, m.job, step)
                if point is not None and ins.step == step:
                    try:
                        self.w._do_point(self.trainer(i), m.job, step, point)
                    except _Failed as failed:
                        self.fail(i, failed)
                        break

    def finish_ended(self, step: int) -> None:
        """Members whose segments end at ``step`` (or aborted) leave with ``BatchDone``."""
        w = self.w
        for i in reversed(range(len(self.members))):
            m = self.members[i]
            if not (m.aborted or step >= m.job.end_step):
                continue
            kept = False
            unsaved = None
            try:
                if m.aborted and m.job.keep and m.steps:
                    kept = w._keep(self.trainer(i), m.job, m.node, step)
                w._flush_curve(m.job)
                unsaved = w._end_job(m.job)
            except _Failed as failed:
                self.fail(i, failed)
                continue
            if kept:
                w._wait_saves()  # its CheckpointSaved goes before its BatchDone
            trainer = self.remove(i)
            w.stats.steps += m.steps
            batch = m.job.batch
            if m.steps:  # the worker keeps the last member that leaves, where it stands
                w._trainer, w._trainer_key, w._root_key = trainer, batch.trainer, batch.root_key
                w._config, w._at, w._given = dict(batch.config), (m.node, step), dict(m.given)
            # busy_seconds: its share of the job (the device time of a step is divided
            # among the members that trained it), so the members' sum is the job's time.
            load = self.load if batch.batch_id in self.loaded else 0.0
            w.emit(BatchDone(batch.batch_id, w.worker_id, m.busy, m.steps, load))
            if unsaved is not None:
                w.emit(unsaved)
            self.mail.done(batch.batch_id)

    def remove(self, i: int) -> Trainer:
        trainer: Trainer = self.group.remove(i)
        self.forget(i)
        return trainer

    def forget(self, i: int) -> None:
        """Member ``i`` is out of the loop: later members' indices shift down."""
        del self.members[i]
        self.synced = {k if k < i else k - 1 for k in self.synced if k != i}

    def fail(self, i: int, failed: _Failed) -> None:
        m = self.members[i]
        self.w._flush_curve(m.job)  # the steps before the failure stand
        try:
            self.remove(i)
        except Exception:  # the group cannot hand it back: it is dropped anyway
            self.forget(i)
        self.w._finish_failed(m.job, failed, m.steps)
        self.mail.done(m.job.batch.batch_id)

    def rerun(self, exc: BaseException, step: int) -> None:
        """A fused step raised: which member's trainer code failed is unknown (and every
        member's state is undefined), so the members still in the job train again, one
        after another and unfused, from their batches' start: the failing one fails on
        its own and the others finish. What they reported before stands (a
        recomputation reports the same points again)."""
        w = self.w
        logger.warning(
            "worker %s: a fused step at step %s raised %s: %s; training its %s members "
            "again unfused to find the failing one",
            w.worker_id,
            step,
            type(exc).__name__,
            exc,
            len(self.members),
        )
        for m in self.members:
            w._flush_curve(m.job)
        w._wait_saves()
        self.unfused()

    def narrower(self, error: str, step: int) -> None:
        """A fused step ran out of device memory: the members still in the job train
        again from their batches' start, fused at half the width (this worker keeps that
        width for the tree); a single member that still does not fit fails with
        ``kind="oom"``, and the scheduler gives it a worker with more devices."""
        w = self.w
        width = len(self.members)
        root_key = self.members[0].job.batch.root_key
        w._oom_width[root_key] = min(w._oom_width.get(root_key, width), max(1, width // 2))
        w.emit(FusedOutOfMemory(w.worker_id, root_key, width))  # the scheduler learns it
        logger.warning(
            "worker %s: a fused step of %s members at step %s ran out of device memory "
            "(%s); training them again at width %s",
            w.worker_id,
            width,
            step,
            error,
            w._oom_width[root_key],
        )
        for m in self.members:
            w._flush_curve(m.job)
        w._wait_saves()
        batches = tuple(m.job.batch for m in self.members)
        self.group = None  # its device memory goes before the narrower jobs start
        self.members = []
        w.drop_trainer()
        w._run_fused(RunFused(w.worker_id, batches), self.mail, w._factory(batches[0].trainer))

    def fall_back(self, exc: BaseException) -> None:
        """The first fused step failed: train the members one after another, from the
        start (the group's state is undefined)."""
        count = len(self.members) + self.rest
        self.w._fusion_failed(self.members[0].job.batch, exc, count, self.whole)
        self.unfused()

    def unfused(self) -> None:
        """The members still in the job train one after another from their start."""
        self.w.drop_trainer()
        self.w._run_each(tuple(m.job.batch for m in self.members), self.mail)


# ---------------------------------------------------------------------- helpers


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def _built(factory: TrainerFactory, config: Mapping[str, Any], state: Any) -> Trainer:
    """A trainer built from ``config`` and restored from ``state`` (None: fresh). One
    to be restored is built under :func:`~stagetree.trainer.built_to_restore`, so that
    a trainer class that says so skips what the restore overwrites."""
    if state is None:
        return factory(config)
    with built_to_restore():
        trainer = factory(config)
    trainer.load_state_dict(state)
    return trainer


def _train_metrics(raw: Any) -> dict[str, float]:
    """``train()``'s return value as metrics (None: none)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"train() must return None or a dict of numbers, got {type(raw).__name__}")
    out: dict[str, float] = {}
    for key, value in raw.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"train() must return None or a dict of numbers; {key!r} is {type(value).__name__}"
            ) from None
    return out


def _same(a: Any, b: Any) -> bool:
    """Typed equality of sequence values (``1 != 1.0 != True``)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _checkpoint_name(root_key: str, node: int, step: int) -> str:
    # Node ids are unique per storage; the root-key digest and a random suffix keep
    # names unique across stores sharing a directory and across recomputations.
    digest = hashlib.sha1(root_key.encode()).hexdigest()[:8]
    return f"r{digest}-n{node}-s{step}-{secrets.token_hex(4)}"


def evaluate_metrics(trainer: Trainer) -> dict[str, float]:
    """``trainer.evaluate()`` as a dict of floats.

    Raises:
        TrainerError: ``evaluate()`` returned something other than a mapping of numbers.
    """
    raw = trainer.evaluate()
    name = f"{type(trainer).__name__}.evaluate()"
    if not isinstance(raw, Mapping):
        raise TrainerError(
            f"{name} must return a dict of numbers (metric name -> value), "
            f"got {type(raw).__module__}.{type(raw).__qualname__}: {_short(raw)}"
        )
    metrics: dict[str, float] = {}
    for key, value in raw.items():
        try:
            metrics[str(key)] = float(value)
        except (TypeError, ValueError):
            raise TrainerError(
                f"{name} must return a dict of numbers, but metric {key!r} is "
                f"{type(value).__qualname__}: {_short(value)}"
            ) from None
    return metrics


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def snapshot_state(state: Any) -> Any:
    """An independent deep copy of a state dict, taken before training continues.

    Tensors are detached and cloned (on their device), numpy arrays copied, containers
    rebuilt; immutable scalars are shared. Anything else goes through ``copy.deepcopy``.
    """
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    return _snapshot(state, torch.Tensor if torch is not None else None, numpy)


def _snapshot(obj: Any, tensor_type: Any, numpy: Any) -> Any:
    kind = type(obj)
    if obj is None or kind in (bool, int, float, str, bytes):
        return obj
    if tensor_type is not None and isinstance(obj, tensor_type):
        return obj.detach().clone()
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return obj.copy()
    if kind is dict:
        return {k: _snapshot(v, tensor_type, numpy) for k, v in obj.items()}
    if kind is list:
        return [_snapshot(v, tensor_type, numpy) for v in obj]
    if kind is tuple:
        return tuple(_snapshot(v, tensor_type, numpy) for v in obj)
    if isinstance(obj, Mapping):
        try:
            return kind((k, _snapshot(v, tensor_type, numpy)) for k, v in obj.items())
        except TypeError:
            return {k: _snapshot(v, tensor_type, numpy) for k, v in obj.items()}
    return copy.deepcopy(obj)
