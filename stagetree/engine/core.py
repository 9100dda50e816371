"""The engine behind every :class:`~stagetree.Study`: the plan storage, the checkpoint
store, the I/O-free scheduler and an executor, driven by one thread.

The driver thread feeds executor events to the scheduler and carries out its
instructions; everything it learns (metrics, checkpoints, accounting) goes to the plan,
so a later process answers from it without training.

Every front end (the in-process :class:`~stagetree.Study`, the tuning server) goes
through the same few methods: :meth:`Engine.open_study`, :meth:`Engine.submit`,
:meth:`Engine.declare`, :meth:`Engine.cancel`, the tuner-log and lease methods, and
:meth:`Engine.reading` for the read side (:mod:`stagetree.reports`). Nothing outside
the engine takes its lock or writes its storage. A submission only queues scheduler
events: the driver thread plans a burst of submissions at once.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagetree import _versions, work
from stagetree.checkpoints.eviction import evict_to_budget
from stagetree.engine.coordination import Coordinator
from stagetree.engine.ledger import COUNTS_EVERY, Ledger
from stagetree.engine.replay import ReplayAnswers
from stagetree.exceptions import (
    CheckpointUnreachableError,
    InvalidTrialError,
    StagetreeError,
    StagetreeWarning,
    TrialCancelledError,
    TrialFailedError,
)
from stagetree.executors.base import WALL_CLOCK, BaseExecutor, Clock
from stagetree.executors.devices import trainer_devices
from stagetree.hp import Sequence, dumps_hp
from stagetree.plan.base import BasePlanStorage, CheckpointRecord, TrialFinal
from stagetree.plan.leases import host_pid
from stagetree.plan.model import Node, RequestState
from stagetree.plan.scopes import (
    devices_learned,
    devices_scope,
    learned_devices,
    learned_fused_width,
    root_scope,
    study_scope,
)
from stagetree.plan.tree import Insertion
from stagetree.records import failure_record
from stagetree.scheduler import (
    CheckpointAvailable,
    CheckpointLost,
    NodeAdded,
    RequestAdded,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RootAdded,
    Scheduler,
    StudyWeight,
)
from stagetree.scheduler.events import DevicesLearned, SaveSteps
from stagetree.space import canonical_json
from stagetree.work import WorkerEvent

if TYPE_CHECKING:
    from stagetree.checkpoints import CheckpointStore

__all__ = [
    "Engine",
    "EngineStoppedError",
    "RunningBatch",
    "StudySlot",
    "Waiter",
    "failure_record",
]

logger = logging.getLogger("stagetree")


class EngineStoppedError(StagetreeError):
    """The engine stopped on an error (:attr:`Engine.error`) before it took a
    submission: nothing of it was written; the study gives it to the engine that
    replaces this one (:mod:`stagetree.engine.pool`)."""


class Waiter:
    """One submission: a future of its metrics and the request it waits on.

    ``future`` is already resolved when the plan knew the metrics (nothing to train);
    ``answered`` says so (the future of a trial to train may resolve at any time later,
    on the driver's thread).
    """

    __slots__ = ("answered", "future", "node", "root_key", "step", "study", "trial_id")

    def __init__(self, study: str, trial_id: int, root_key: str, node: int, step: int) -> None:
        self.future: concurrent.futures.Future[dict[str, float]] = concurrent.futures.Future()
        self.study = study
        self.trial_id = trial_id
        self.root_key = root_key
        self.node = node
        self.step = step
        self.answered = False


@dataclass(eq=False)
class StudySlot:
    """What an engine keeps of one study it serves (one per name and trainer version;
    every front end of that study in the process shares it).

    Attributes:
        name: the study.
        version: the trainer version (its trials' root keys include it).
        share: False: every trial gets its own plan tree (the trial-based baseline).
        weight: its fair share of the workers against other studies.
        names: the config and hp names of its trials (set by the first one).
        trial_ids: ``trial_digest((config json, hp json)) -> trial id`` of its known
            trials (a digest of the pair, not the pair, in a :class:`DigestIds` table:
            memory per trial).
        meta: the running tuner's metric, mode and name, recorded with the next write.
        row_ready: whether its row in the plan exists with ``meta``.
        log_checked: whether the tuner log's latest run is this version's.
        trainer_key: the key its trainer class has in the executor ("" for the
            executor's default trainer; see :meth:`Engine.open_study`).
        fusible: the names its trainer may fuse over when the study fuses (empty: the
            study does not fuse). A fusing study's trials live in plan trees of their own
            (``"fused"`` is part of the root key): fused results, equal to unfused ones
            only up to floating-point rounding, are never handed to an exact study.
        save_steps: steps its tuner asks for results at (its rungs, see
            :meth:`Engine.save_at`): batches of its plan trees checkpoint there.
        unlogged: its tuner's log records not written yet (see :meth:`Engine.append_log`).
    """

    name: str
    version: str
    share: bool = True
    weight: float = 1.0
    names: tuple[frozenset[str], frozenset[str]] | None = None
    trial_ids: DigestIds = field(default_factory=lambda: DigestIds())
    meta: dict[str, Any] = field(default_factory=dict)
    row_ready: bool = False
    log_checked: bool = False
    trainer_key: str = ""
    fusible: frozenset[str] = frozenset()
    save_steps: frozenset[int] = frozenset()
    unlogged: list[dict[str, Any]] = field(default_factory=list)
    # The last root key computed, by its identity text: a trial's key is computed by
    # each call about it (known, submit, history) and the plan keeps the string the
    # first one gave; one string per tree, not one per call.
    _last_key: tuple[str, str] = field(default=("", ""), repr=False)

    def root_key(self, config: Mapping[str, Any], hp: Mapping[str, Sequence]) -> str:
        """The plan tree of a trial: trainer version + fixed config (+ the trial's own
        sequences when ``share=False``, so that nothing is shared; + ``"fused"`` when the
        study fuses, so that fused and exact results never mix)."""
        config = config if type(config) is dict else dict(config)  # no copy to drop
        ident: dict[str, Any] = {"version": self.version, "config": config}
        if self.fusible:
            ident["fused"] = True
        text = canonical_json(ident)
        if not self.share:
            text += "|trial|" + dumps_hp(hp)
        if self._last_key[0] == text:
            return self._last_key[1]
        key = hashlib.sha256(text.encode()).hexdigest()[:20]
        self._last_key = (text, key)
        return key


class NodeIds:
    """A set of plan node ids as bits (ids are small ints counted up by the plan): the
    engine's nodes known to the scheduler, an eighth of a byte each instead of a set
    entry (memory per trial). Ids outside ``0 .. 2**32`` go to a plain set."""

    __slots__ = ("_bits", "_other")

    _LIMIT = 1 << 32

    def __init__(self) -> None:
        self._bits = bytearray()
        self._other: set[int] = set()

    def __contains__(self, node: object) -> bool:
        if type(node) is int and 0 <= node < self._LIMIT:
            byte = node >> 3
            return byte < len(self._bits) and bool(self._bits[byte] >> (node & 7) & 1)
        return node in self._other

    def add(self, node: int) -> None:
        """Add ``node``."""
        if type(node) is int and 0 <= node < self._LIMIT:
            byte = node >> 3
            if byte >= len(self._bits):  # grow by half again: amortised O(1)
                self._bits.extend(bytes(max(byte + 1, len(self._bits) * 3 // 2) - len(self._bits)))
            self._bits[byte] |= 1 << (node & 7)
        else:
            self._other.add(node)


class DigestIds:
    """:attr:`StudySlot.trial_ids`: trial digest (16 bytes, :func:`trial_digest`) ->
    trial id (an int from 0 to 2**63 - 1), as one table of 24-byte slots (the digest,
    then the id plus one: a zero there is a free slot), found by linear probing from
    the digest's first 8 bytes and at most two thirds full: about 50 bytes a trial
    instead of a bytes object and a dict entry (about 100)."""

    __slots__ = ("_size", "_table")

    _SLOT = 24
    _FREE = bytes(8)

    def __init__(self) -> None:
        self._table = bytearray(8 * self._SLOT)
        self._size = 0

    def _find(self, key: bytes) -> int:
        """The offset of ``key``'s slot, or of the free slot where it would go."""
        if type(key) is not bytes or len(key) != 16:
            raise TypeError(f"a trial digest is 16 bytes, got {key!r}")
        table, slot = self._table, self._SLOT
        mask = len(table) // slot - 1
        i = int.from_bytes(key[:8], "little") & mask
        while True:
            at = i * slot
            if table[at + 16 : at + 24] == self._FREE or table[at : at + 16] == key:
                return at
            i = (i + 1) & mask

    def __setitem__(self, key: bytes, tid: int) -> None:
        if type(tid) is not int or not 0 <= tid < 2**63:
            raise ValueError(f"a trial id is an int from 0 to 2**63 - 1, got {tid!r}")
        at = self._find(key)
        if self._table[at + 16 : at + 24] == self._FREE:
            self._size += 1
            if 3 * self._size > 2 * (len(self._table) // self._SLOT):
                self._grow()
                at = self._find(key)
        self._table[at : at + 16] = key
        self._table[at + 16 : at + 24] = (tid + 1).to_bytes(8, "little")

    def _grow(self) -> None:
        old, slot = self._table, self._SLOT
        self._table = bytearray(2 * len(old))
        for at in range(0, len(old), slot):
            if old[at + 16 : at + 24] != self._FREE:
                new = self._find(bytes(old[at : at + 16]))
                self._table[new : new + slot] = old[at : at + slot]

    def get(self, key: bytes, default: int | None = None) -> int | None:
        """The trial id of digest ``key``, else ``default``."""
        at = self._find(key)
        found = self._table[at + 16 : at + 24]
        return default if found == self._FREE else int.from_bytes(found, "little") - 1

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[bytes]:
        table, slot = self._table, self._SLOT
        for at in range(0, len(table), slot):
            if table[at + 16 : at + 24] != self._FREE:
                yield bytes(table[at : at + 16])


class TreeKeys(MutableMapping[tuple[str, frozenset[str]], str]):
    """The engine's ``(root key, hp names) -> plan tree`` index, kept as
    ``{names: {root key: tree}}``: one entry per tree and no ``(root key, names)``
    tuple (memory per trial: a study has one set of names, and a tree per config)."""

    __slots__ = ("_by_names",)

    def __init__(self) -> None:
        self._by_names: dict[frozenset[str], dict[str, str]] = {}

    def __getitem__(self, key: tuple[str, frozenset[str]]) -> str:
        base, names = key
        return self._by_names[names][base]

    def __setitem__(self, key: tuple[str, frozenset[str]], tree: str) -> None:
        base, names = key
        self._by_names.setdefault(names, {})[base] = tree

    def __delitem__(self, key: tuple[str, frozenset[str]]) -> None:
        base, names = key
        trees = self._by_names[names]
        del trees[base]
        if not trees:
            del self._by_names[names]

    def __iter__(self) -> Iterator[tuple[str, frozenset[str]]]:
        for names, trees in self._by_names.items():
            for base in trees:
                yield base, names

    def __len__(self) -> int:
        return sum(map(len, self._by_names.values()))


def trial_digest(ident: tuple[str, str]) -> bytes:
    """A trial's key in :attr:`StudySlot.trial_ids`: a 128-bit digest of its identity
    ``(canonical config JSON, dumps_hp(hp))`` (16 bytes a trial instead of both texts)."""
    config, hp = ident
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{len(config)}:".encode())
    digest.update(config.encode())
    digest.update(hp.encode())
    return digest.digest()


@dataclass(eq=False)
class RunningBatch:
    """What the engine keeps of a batch it handed to the executor, from its start to its
    terminal event (``BatchDone``, ``BatchFailed`` or ``WorkerLost``).

    Attributes:
        root_key: its plan tree.
        start_step: the step it starts training from.
        last_step: the last step it reported training (``Progress``).
        start_ref: the checkpoint it starts from (None: from scratch).
        durable: the last step it checkpointed durably (None: none yet).
        rate: device-seconds per step, for the studies' accounting (0.0: not measured).
        charged: ``study -> [steps, device-seconds]`` charged to each study for this
            batch so far (settled at its end, see :meth:`Engine._settle_charges`).
        serving: the studies with a live request it served when it started.
    """

    root_key: str
    start_step: int
    last_step: int
    start_ref: str | None
    durable: int | None = None
    rate: float = 0.0
    charged: dict[str, list[float]] = field(default_factory=dict)
    serving: list[str] = field(default_factory=list)


# Submissions closer together than _QUIET seconds are planned together (waiting at most
# _MAX_DELAY seconds): cheap next to a training step, and it spares the workers from
# racing past branch points of trials that were submitted at the same moment. The
# window is only the fallback for submitters the engine cannot see wait: a tuner run by
# tune() ends its bursts once it waits (begin_burst(watched=True)), planned then.
_QUIET = 0.02
_MAX_DELAY = 0.25
# Seconds the driver waits for the executor's events in one round.
_POLL = 0.01
# A burst a front end announces (begin_burst/end_burst: Study.submit, the submissions of
# one pass of its event loop) is planned once all of it arrived, however long each
# insertion took on a loaded machine; an end never announced stops counting after
# _BURST_MAX seconds without a submission.
_BURST_MAX = 5.0
# Events that end nothing: what they charge may be written after them (the others find
# the studies' counts written before they are handled).
_STEADY = (work.CurveReported, work.Progress, work.CheckpointSaved)
# Events whose handling reads the plan only through a trial end's transaction, which
# writes what the ledger kept first (Engine.resolve): nothing is written before them.
_KEPT_THROUGH = (*_STEADY, work.MetricsReported, work.BatchDone)


_FINAL = (RequestState.DONE, RequestState.FAILED, RequestState.CANCELLED)

# What a path's scheduler events are made of (Engine._path_reads): the root's config and
# counters, the path, the tree's checkpoints (None: not read, not needed).
_PathReads = tuple[
    tuple[dict[str, Any], dict[str, float]] | None,
    list[Node],
    dict[tuple[int, int], CheckpointRecord] | None,
]


class Engine:
    """Plan + checkpoint store + scheduler + executor, driven by one thread.

    Every access to the storage and the scheduler holds ``lock``; the driver thread
    takes it while it applies a batch of events, user threads take it to submit.
    """

    def __init__(
        self,
        storage: BasePlanStorage,
        store: CheckpointStore,
        executor_factory: Callable[[], BaseExecutor],
        policy: str,
        max_retries: int,
        checkpoint_budget: int | None,
        eval_every: int = 0,
        max_fused: int = 1,
        checkpoint_every: int | str | None = "auto",
        stop_timeout: float = 5.0,
    ) -> None:
        self.storage = storage
        # A result's curve read from its path's end where that is the cheaper read (the
        # memory plan: up the parent links; SQL finds a path by a cached walk and reads
        # its metrics in one statement, less than reading the path first).
        self._reads_paths = bool(getattr(storage, "cheap_paths", False))
        # Seconds a stop (closing, Ctrl-C, a budget) waits for the running batches to
        # checkpoint where they stand and end; workers still busy then are stopped.
        self.stop_timeout = stop_timeout
        self._overdue: set[int] = set()  # batches a stop's wait gave up on (stuck)
        self.store = store
        self.lock = threading.RLock()
        self._executor_factory = executor_factory
        self.executor: BaseExecutor | None = None  # once started
        self._unstarted: BaseExecutor | None = None
        self.scheduler = Scheduler(
            policy=policy,
            max_retries=max_retries,
            eval_every=eval_every,
            max_fused=max_fused,
            checkpoint_every=checkpoint_every,
        )
        self.checkpoint_budget = checkpoint_budget
        self._waiters: dict[tuple[int, int], list[Waiter]] = {}
        # The steps of _waiters' keys by node, in _waiters' order (a batch marks its
        # nodes' trials running without a scan of every waiter).
        self._waiting_steps: dict[int, dict[int, None]] = {}
        self._known_roots: set[str] = set()
        self._known_nodes = NodeIds()
        self._root_saves: dict[str, frozenset[int]] = {}  # SaveSteps sent, by tree
        self._save_sets: dict[frozenset[int], frozenset[int]] = {}  # one of each set
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self._closed = False
        self._pid = os.getpid()  # the process whose exit closes this engine
        self.users = 0
        self.temporary_checkpoints = False  # remove the store's directory on close
        # The batches handed to the executor that have not ended yet, by batch id.
        self._batches: dict[int, RunningBatch] = {}
        # Ended batches whose stage leases wait for their checkpoint writes (a batch's
        # checkpoints may be written after its end: this outlives its record).
        self._unreleased: set[int] = set()
        self._released = (0, 0)  # _unreleased's size and saving_left at the last look
        # Metrics held back until the checkpoint promised at their point is durable.
        self._unstored: dict[tuple[int, int], dict[str, float]] = {}
        self._queued: list[Any] = []
        # Devices a worker's busy second occupies (``devices_per_worker``): device
        # seconds count each of them.
        self._devices_per_worker = 1
        self._first_queued = self._last_queued = 0.0
        self._bursts = 0  # bursts announced and not ended (begin_burst)
        self._burst_at = 0.0  # when the last one began
        # Threads whose open bursts a tuner ends once it waits (begin_burst(watched=True)),
        # and whether anything queued since the last plan came from elsewhere (a user
        # thread, a cancellation): only that falls back on the quiet window.
        self._watched: dict[int, int] = {}
        self._blind = False
        self._burst_ended = threading.Event()  # ends the driver's wait in _coalesce
        self._idle = threading.Condition(self.lock)
        # Leases and the requests waiting on other engines (processes) sharing the storage.
        self.coord = Coordinator(self)
        # Activity records, curve points and per-study accounting, written once per round.
        self.ledger = Ledger(storage, self.coord.owner, self.clock)
        self._reported_corrupt: set[str] = set()  # start checkpoints reported unreadable
        self._studies: set[str] = set()  # studies served (their meta records the workers)
        self._slots: dict[tuple[str, str], StudySlot] = {}
        # One worker pool for every trainer: the executor's default trainer (key "") and
        # the others by key; each plan tree is trained by its study's trainer.
        self.default_trainer: type | None = None
        self.settings: dict[str, Any] = {}  # the front end's arguments it was made with
        self._trainers: dict[str, type] = {}
        # Trees trained by another trainer than the executor's default (key ""): one
        # entry per tree only where it is not the default (memory per trial).
        self._root_trainers: dict[str, str] = {}
        # (root key, hp names) -> the tree of those names (see BasePlanStorage.tree_key).
        self._tree_keys = TreeKeys()
        # study name -> its finished trials read at once, while its run replays its log
        self._replays: dict[str, ReplayAnswers] = {}
        self._unlogged: set[StudySlot] = set()  # studies with tuner records to write
        # One copy of each set of hp names: a study's trials share it in _tree_keys.
        self._name_sets: dict[frozenset[str], frozenset[str]] = {}
        # Fusion: fusible names of the trees of fusing studies; trainer keys whose
        # workers could not fuse them (said once, never fused again).
        self._root_fusible: dict[str, frozenset[str]] = {}
        self._unfusible: set[str] = set()
        self._workers_changed = False
        # The location of this process's workers (in its activity records).
        self._here = "{}:{}".format(*host_pid())
        self._handlers = self._event_handlers()

    # -- life cycle ----------------------------------------------------------------------

    def ensure_started(self, workers: bool = True) -> None:
        """Start the driver thread and, with ``workers``, the executor's workers.

        A run answered from the storage needs no worker: :meth:`begin_tuning` starts the
        driver only (its heartbeat keeps the study's lease), and :meth:`submit` starts
        the workers for the first request the plan cannot answer. A virtual-time
        executor starts with the driver (it costs nothing, and its caller pumps it).
        """
        with self.lock:
            self._check_open()
            virtual = self._make_executor().clock.virtual
            if (workers or virtual) and self.executor is None:
                self._start_executor()
            if virtual or self._thread is not None:
                return  # virtual time: Study.tune pumps it from the tuner's loop, no thread
            self._thread = threading.Thread(target=self._run, name="stagetree-engine", daemon=True)
            self._thread.start()
            # At interpreter exit (a study never closed), stop this engine before its
            # executor's own exit hook stops the workers under the running driver.
            atexit.register(self._close_at_exit)

    def _check_open(self) -> None:
        """Refuse what needs the engine running (lock held): after its driver stopped
        on an error (:class:`EngineStoppedError`: a submission refused so has recorded
        neither its trial nor its request), or after :meth:`close` (its storage
        closes, its workers stop: a submission is cancelled, as those waiting were)."""
        if self.error is not None:
            raise EngineStoppedError(f"the study engine stopped: {self.error!r}") from self.error
        if self._closed:
            raise TrialCancelledError("the study was closed")

    def _start_executor(self) -> None:
        """Start the executor's workers (lock held).

        The engine counts as started only once ``start()`` returned: a start that fails
        (a cluster with no room, a timeout) closes that executor and leaves none, so the
        next call makes a new one and tries again instead of driving a dead one.
        """
        executor = self._make_executor()
        try:
            executor.start()
        except BaseException:
            self._unstarted = None
            with contextlib.suppress(Exception):
                executor.close()  # what a half-done start left running
            raise
        self.executor, self._unstarted = executor, None
        k = getattr(executor, "devices_per_worker", 1)
        ok = isinstance(k, int) and not isinstance(k, bool) and k >= 1
        self._devices_per_worker = k if ok else 1
        counts = getattr(executor, "worker_device_counts", None)
        if counts:  # a need up to the largest worker waits for it while it starts
            self.scheduler.expect_devices(max(counts))
        if not executor.supports_fusion and self.scheduler.max_fused > 1:
            if self._root_fusible:
                logger.warning(
                    "executor %s cannot fuse jobs: fusing studies train unfused",
                    type(executor).__name__,
                )
            self.scheduler.max_fused = 1
        for key, trainer in self._trainers.items():
            self._add_trainer(key, trainer)

    def prepare_workers(self) -> None:
        """Let an executor not started yet get ready to start (a hint, see
        :meth:`BaseExecutor.prepare`): a run that will train calls it before its tuner
        is built."""
        with self.lock:
            if self.executor is None and self.error is None:
                self._make_executor().prepare()

    def _close_at_exit(self) -> None:
        """Close the engine at interpreter exit when no study closed it (atexit runs the
        hooks registered last first: this one runs before the executor's)."""
        if os.getpid() != self._pid:
            return  # a forked child's exit: the workers and the storage are the parent's
        with contextlib.suppress(Exception):
            self.close()

    def _make_executor(self) -> BaseExecutor:
        """The executor: the started one, else one made (not started) the first time
        (:meth:`begin_tuning` reads its clock before the workers start)."""
        with self.lock:
            if self.executor is not None:
                return self.executor
            if self._unstarted is None:
                self._unstarted = self._executor_factory()
            return self._unstarted

    @property
    def num_workers(self) -> int:
        """The executor's workers (made if need be, not started)."""
        return self._make_executor().num_workers

    @property
    def run_clock(self) -> Clock:
        """The executor's clock (virtual when simulated), made if need be, not started."""
        return self._make_executor().clock

    def settle(self, timeout: float = 30.0) -> None:
        """When no submission is waiting any more, wait (at most ``timeout`` s) for the
        batches still in flight to report their end (background checkpoint writes,
        accounting), so that statistics are complete; then store the activity records
        not written yet."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while (
                (self._batches or self.scheduler.saving)
                and not self._waiters
                and self.error is None
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            self.ledger.flush()  # the ends just learnt of, not at the next round

    def close(self) -> None:
        """Stop: withdraw the submissions still waiting, let the running batches
        checkpoint where they stand and end (at most :attr:`stop_timeout` seconds: a
        later run resumes from those checkpoints, training no step twice), stop the
        workers (at once those still busy then) and close the storage."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        busy = False
        if self._thread is not None and self.error is None:
            self._stop_batches()
            busy = not self.wait_stopped()
        self._stop.set()
        self._wake_driver()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.executor is not None:
            if busy:  # a trainer stuck in a step: its worker is not waited for
                self.executor.close_now()
            else:
                self.executor.close()
        with self.lock:
            try:
                self._flush_logs()
            except StagetreeError as exc:  # records no act followed: as if never taken
                logger.warning("tuner log records not written: %s", exc)
            try:
                self.ledger.flush()  # before the leases go: the checkpoints' records first
            except StagetreeError as exc:  # what no trial's answer needed: recomputed later
                if self.error is None:
                    raise
                logger.warning("the engine's last records not written: %s", exc)
            self.coord.close()
            for (node, step), waiters in self._waiters.items():
                held = 0
                for w in waiters:
                    if not w.future.done():
                        held += 1  # each waiter holds one reference to its request
                        w.future.set_exception(TrialCancelledError("the study was closed"))
                        self._set_trial_state(w, "cancelled")
                # Release only this process's references: other processes sharing the
                # storage may still want the same request. A later run asks again.
                req = self.storage.request(node, step)
                if held and req is not None and req.state not in _FINAL:
                    self.storage.release_request(node, step, min(held, req.refcount))
            self._waiters.clear()
            self._waiting_steps.clear()
        self.storage.close()
        if self.temporary_checkpoints:
            shutil.rmtree(self.store.directory, ignore_errors=True)

    def wait_stopped(self) -> bool:
        """After a stop (its batches were aborted): let the batches in flight report
        their end and their last checkpoints (aborted ones stop within a step), so that
        the plan holds what they trained and their activity and counters are complete;
        at most :attr:`stop_timeout` seconds, and not again for batches an earlier wait
        gave up on (a trainer stuck in a step). Returns whether every batch ended."""
        with self.lock:
            stuck = bool(self._batches) and set(self._batches) <= self._overdue
        if not stuck:
            self.settle(timeout=self.stop_timeout)
        with self.lock:
            self._overdue |= set(self._batches)
            return not self._batches

    def _stop_batches(self) -> None:
        """Withdraw every waiting submission (its trial is cancelled) and abort every
        running batch with a checkpoint where it stops (``Abort.save``): what a closing
        engine does before it waits for its batches (:meth:`close`)."""
        with self.lock:
            for waiters in list(self._waiters.values()):
                for w in list(waiters):
                    self.cancel(w, TrialCancelledError("the study was closed"))
            self._flush()  # the scheduler aborts what no live request needs any more
            if self.executor is not None:
                for batch_id, info in self.scheduler.running.items():
                    if not info.aborted:  # what other processes still need, too
                        self.executor.submit(work.Abort(batch_id, info.worker, save=True))

    # -- the front ends' way in ------------------------------------------------------------

    def open_study(
        self,
        name: str,
        version: str,
        share: bool = True,
        weight: float = 1.0,
        trainer: type | None = None,
        url: str = "",
        fusible: frozenset[str] = frozenset(),
    ) -> StudySlot:
        """The engine's slot of study ``name`` at trainer ``version``, loading its stored
        trials the first time (a changed trainer is announced once; see
        :mod:`stagetree._versions`). Writes nothing but the trials' ``opened`` mark: the
        study row is created with its first trial or log record.

        Studies of several trainer classes share the engine's one worker pool: the
        first trainer is the executor's default, the others are added to the executor
        (:meth:`~stagetree.executors.base.BaseExecutor.add_trainer`), and every batch
        is trained by the trainer of its plan tree's study.
        """
        with self.lock:
            slot = self._slots.get((name, version))
            if slot is None:
                slot = StudySlot(name, version, share, weight, fusible=fusible)
                slot.trainer_key = self._trainer_key(trainer)
                trainer_name = getattr(trainer, "__qualname__", "")
                for t in _versions.open_trials(slot, trainer_name, self.storage, url):
                    ident = (canonical_json(t["config"]), dumps_hp(t["hp"]))
                    slot.trial_ids[trial_digest(ident)] = t["id"]
                    if slot.names is None:
                        slot.names = (frozenset(t["config"]), frozenset(t["hp"]))
                self._slots[(name, version)] = slot
            slot.share, slot.weight = share, weight
            self.ledger.study_versions[name] = version
            self._enqueue([StudyWeight(name, weight)])
            return slot

    def _trainer_key(self, trainer: type | None) -> str:
        """The executor's key of ``trainer``, registering it the first time."""
        if trainer is None or trainer is self.default_trainer:
            return ""
        if self.default_trainer is None:
            self.default_trainer = trainer
            return ""
        key = f"{trainer.__module__}:{trainer.__qualname__}:{id(trainer)}"
        if key not in self._trainers:
            self._trainers[key] = trainer
            if self.executor is not None:
                self._add_trainer(key, trainer)
        return key

    def _add_trainer(self, key: str, trainer: type) -> None:
        assert self.executor is not None
        try:
            self.executor.add_trainer(key, trainer)
        except NotImplementedError:
            raise StagetreeError(
                f"executor {type(self.executor).__name__} trains one trainer class, but "
                f"studies of {getattr(self.default_trainer, '__qualname__', '?')} and "
                f"{trainer.__qualname__} share this storage in this process: give them "
                "separate storages, or implement BaseExecutor.add_trainer"
            ) from None

    def _ensure_row(self, slot: StudySlot) -> None:
        """Create the study row (or record the tuner's metric and mode in it) just before
        the first write that needs it. Called with the lock held."""
        if slot.row_ready:
            return
        meta = {"version": slot.version, "share": slot.share, **slot.meta}
        if not self.storage.create_study(slot.name, meta) and slot.meta:
            self.storage.update_study_meta(slot.name, slot.meta)
        # The study's own counters exist from now on (0 until something is trained for
        # it): reports tell them from a storage written before studies were counted.
        self.storage.add_stats(
            study_scope(slot.name, slot.version), steps_executed=0.0, device_seconds=0.0
        )
        slot.row_ready = True

    def begin_tuning(self, slot: StudySlot, meta: Mapping[str, Any]) -> Any:
        """Take the study's tuning lease (one tuner per study at a time, across
        processes). Returns the holder's lease when another process holds it, else None:
        then the driver is started (the workers start with the first request the plan
        cannot answer, see :meth:`ensure_started`), and ``meta``, the tuner's metric and
        mode, is recorded with the next write, with the run's record ``meta["run"]``:
        ``started`` (this call's time, on the clock of the activity records: before the
        workers start, so that their start-up counts), ``workers``, ``owner`` (this
        engine's lease owner, which the activity records of its batches carry) and
        ``version``. :meth:`end_tuning` adds ``ended``;
        :func:`stagetree.reports.costs.efficiency` reads them."""
        with self.lock:
            holder = self.coord.claim_study(slot.name)
            if holder is not None:
                return holder
        try:
            started = self._make_executor().clock.now()
            self.ensure_started(workers=False)
        except BaseException:
            with self.lock:
                self.coord.release_study(slot.name)
            raise
        with self.lock:
            run = {
                "started": started,
                "workers": self.num_workers,
                "owner": self.coord.owner,
                "version": slot.version,
            }
            slot.meta = {**meta, "run": run}
            slot.row_ready = False
            slot.log_checked = False
            return None

    def end_tuning(self, slot: StudySlot) -> None:
        """Release the study's tuning lease; record when the run ended (``meta["run"]
        ["ended"]``) when the run wrote its study's row."""
        with self.lock:
            self._flush_logs()  # before the lease goes: the next run reads the log
            self._replays.pop(slot.name, None)
            self.coord.release_study(slot.name)
            run = slot.meta.get("run")
            if not isinstance(run, dict) or "ended" in run or not slot.row_ready:
                return
            run = {**run, "ended": self.clock(), "workers": self.num_workers}
            slot.meta = {**slot.meta, "run": run}
            try:
                self.storage.update_study_meta(slot.name, {"run": run})
            except StagetreeError as exc:  # informative only
                logger.warning("the end of study %s's run not recorded: %s", slot.name, exc)

    def record_run(self, slot: StudySlot, fields: Mapping[str, Any]) -> None:
        """Add ``fields`` (say, the budget that stopped it) to the record of the study's
        current run (``meta["run"]``); :meth:`end_tuning` writes it with ``ended``."""
        with self.lock:
            run = slot.meta.get("run")
            if isinstance(run, dict):
                slot.meta = {**slot.meta, "run": {**run, **fields}}

    def clock(self) -> float:
        """Now, on the clock of the activity records: the executor's
        (:attr:`BaseExecutor.clock <stagetree.executors.base.BaseExecutor.clock>`; the
        wall clock before it exists)."""
        executor = self.executor if self.executor is not None else self._unstarted
        return (executor.clock if executor is not None else WALL_CLOCK).now()

    def read_log(self, slot: StudySlot) -> list[dict[str, Any]]:
        """The tuner decisions of the study's latest run, when it used this version."""
        with self.lock:
            self._flush_logs()
            return _versions.read_log(slot, self.storage)

    def has_log(self, slot: StudySlot) -> bool:
        """Whether :meth:`read_log` would return any decision (a run to replay), without
        reading the whole log."""
        with self.lock:
            self._flush_logs()
            return _versions.has_log(slot, self.storage)

    def prepare_replay(self, slot: StudySlot) -> None:
        """A run that replays its log starts: read the study's finished trials at once
        (:class:`~stagetree.engine.replay.ReplayAnswers`), so that :meth:`submit`,
        :meth:`known` and :meth:`history` answer the replayed ones without a query each
        (until this engine writes to the plan)."""
        with self.lock:
            self._ensure_row(slot)  # the run's first write, before the read
            self._replays[slot.name] = ReplayAnswers(self.storage, slot.name, slot.version)

    def _replayed(
        self, slot: StudySlot, config: dict[str, Any], hp: dict[str, Sequence], steps: int
    ) -> tuple[str, TrialFinal] | None:
        """``(tree, trial)`` of a finished trial ``(config, hp)`` at ``steps`` from the
        replay's read (lock held); None when there is none (or it no longer holds)."""
        answers = self._replays.get(slot.name)
        if answers is None:
            return None
        if not answers.valid:  # this engine wrote: the storage answers from now on
            self._replays.clear()
            return None
        found = answers.finished(config, hp, steps)
        if found is None:
            return None
        base, names = slot.root_key(config, hp), frozenset(hp)
        tree = self._tree_key(base, names)
        self._settle_tree(base, names, tree)  # a finished trial is in it
        return tree, found

    def append_log(self, slot: StudySlot, record: Mapping[str, Any]) -> None:
        """Log a tuner record. It is written with the study's next submission, in its
        transaction (a tuner logs a decision, then acts on it: its two records of a
        trial, the submission and the completion seen before it, cost no transaction of
        their own), and before anything else its tuner does that acts or reads the log
        (:meth:`cancel`, :meth:`declare`, :meth:`read_log`, :meth:`end_tuning`,
        :meth:`close`): a decision is durable before it acts. A crash loses at most
        records no act followed, as if it had come before them."""
        with self.lock:
            slot.unlogged.append(dict(record))
            self._unlogged.add(slot)

    def _flush_logs(self) -> None:
        """Write every study's unwritten tuner records, a transaction a study (lock
        held)."""
        for slot in list(self._unlogged):
            self._ensure_row(slot)
            self._check_log(slot)
            if slot.unlogged:
                self.storage.atomically(lambda slot=slot: self._write_log(slot))  # type: ignore[misc]
                self._logged(slot)

    def _check_log(self, slot: StudySlot) -> None:
        """Before a study's first record of a run joins another transaction: its row,
        and the record that starts its version's decisions when needed (once a run, in
        transactions of their own, so that a transaction run again writes the same)."""
        if slot.unlogged and not slot.log_checked:
            self._ensure_row(slot)
            _versions.append_log(slot, self.storage, slot.unlogged.pop(0))
            if not slot.unlogged:
                self._unlogged.discard(slot)

    def _write_log(self, slot: StudySlot) -> None:
        """Append the study's unwritten records (inside a transaction; :meth:`_check_log`
        came first). They are dropped from ``slot`` by :meth:`_logged` once committed."""
        for record in slot.unlogged:
            _versions.append_log(slot, self.storage, record)

    def _logged(self, slot: StudySlot) -> None:
        slot.unlogged = []
        self._unlogged.discard(slot)

    @contextlib.contextmanager
    def reading(self) -> Iterator[BasePlanStorage]:
        """The plan storage, for read-only queries (:mod:`stagetree.reports`), with the
        engine's lock held."""
        with self.lock:
            yield self.storage

    def submit(
        self,
        slot: StudySlot,
        config: dict[str, Any],
        hp: dict[str, Sequence],
        steps: int,
        horizon: int = 0,
    ) -> Waiter:
        """Submit the trial ``(config, hp)`` of study ``slot`` to ``steps`` steps: record
        the trial, insert its path (up to ``horizon``, the most steps its tuner may ask
        for, so that the scheduler knows where it branches off later) and ask for its
        metrics at ``steps``. The waiter's future resolves with them (at once when the
        plan knows them). ``config`` and ``hp`` are checked by the caller."""
        storage = self.storage
        # The trial's identity, encoded once: its key here and its row's texts.
        texts = (canonical_json(config), dumps_hp(hp))
        ident = trial_digest(texts)
        with self.lock:
            self._check_open()
            replayed = self._replayed(slot, config, hp, steps)
            if replayed is not None:  # a finished trial of the log: what the plan holds
                tree, done = replayed
                assert done.node is not None and done.step is not None and done.final is not None
                self._flush_logs()  # no transaction of its own to join
                self._own_root(slot, tree)
                slot.trial_ids[ident] = done.id
                waiter = Waiter(slot.name, done.id, tree, done.node, done.step)
                waiter.future.set_result(dict(done.final))
                waiter.answered = True
                return waiter
            self._ensure_row(slot)
            self._check_log(slot)

            def plan() -> tuple[str, int, int, int, dict[str, float] | None]:
                root_key, ins = self._insert_path(slot, config, hp, max(steps, horizon))
                if horizon > steps:
                    where = storage.locate(root_key, hp, steps)
                    assert where is not None
                    return (root_key, ins.node, *where, storage.get_metrics(*where))
                return (
                    root_key,
                    ins.node,
                    ins.node,
                    ins.step,
                    storage.get_metrics(ins.node, ins.step),
                )

            def record(root_key: str, node: int, step: int, known: Any) -> int:
                # The tuner's records of this decision (and the completions it saw
                # before) go with its trial: durable before it acts, no commit of their own.
                self._write_log(slot)
                return self._record_trial(
                    slot, ident, texts, root_key, config, hp, steps, node, step, known
                )

            reads: _PathReads | None = None
            if self._serving():
                # Workers up: the trial's path, row and request in one transaction, with
                # what the scheduler's events of the path read.
                def whole() -> tuple[
                    str, int, int, int, dict[str, float] | None, int, _PathReads | None
                ]:
                    root_key, leaf, node, step, known = plan()
                    tid = record(root_key, node, step, known)
                    reads = self._path_reads(root_key, leaf) if known is None else None
                    return root_key, leaf, node, step, known, tid, reads

                root_key, leaf, node, step, known, tid, reads = storage.atomically(whole)
                slot.trial_ids[ident] = tid  # once committed: a rerun whole() adds it again
                self._logged(slot)
                recorded: int | None = tid
            else:
                root_key, leaf, node, step, known = plan()
                if known is not None:
                    tid = storage.atomically(lambda: record(root_key, node, step, known))
                    slot.trial_ids[ident] = tid
                    self._logged(slot)
                    recorded = tid
                else:
                    recorded = None
            if known is not None:
                waiter = Waiter(slot.name, tid, root_key, node, step)
                waiter.future.set_result(known)
                waiter.answered = True
                return waiter
            if recorded is not None:  # the driver runs: it waits from now on, lock held
                return self._wait(slot, tid, root_key, node, step, leaf, reads)
        self.ensure_started()
        with self.lock:
            # Closed, or stopped on an error, since the lock was let go: a waiter added
            # now would never be answered (the close or the stop withdrew them all).
            self._check_open()
            self._check_log(slot)  # records another thread logged meanwhile
            tid = storage.atomically(lambda: record(root_key, node, step, None))
            slot.trial_ids[ident] = tid
            self._logged(slot)
            return self._wait(slot, tid, root_key, node, step, leaf, reads)

    def _wait(
        self,
        slot: StudySlot,
        tid: int,
        root_key: str,
        node: int,
        step: int,
        leaf: int,
        reads: _PathReads | None,
    ) -> Waiter:
        """The waiter of a submission recorded with its request, handed to the driver
        (lock held)."""
        waiter = Waiter(slot.name, tid, root_key, node, step)
        self._waiters.setdefault((node, step), []).append(waiter)
        self._waiting_steps.setdefault(node, {})[step] = None
        self._studies.add(slot.name)  # a study served: its meta records the workers
        events = self._path_events(root_key, leaf, reads) + self._save_events(slot, root_key)
        events.append(RequestAdded(node, step, study=slot.name))
        self._enqueue(events)
        return waiter

    def _record_trial(
        self,
        slot: StudySlot,
        ident: bytes,
        texts: tuple[str, str],
        root_key: str,
        cfg: dict[str, Any],
        seqs: dict[str, Sequence],
        steps: int,
        node: int,
        step: int,
        known: dict[str, float] | None,
    ) -> int:
        """Record a submitted trial and, unless the plan ``known`` its metrics (then it
        is done), its request; returns its id. The caller makes it one transaction, so
        that a crash leaves neither a trial without its request nor a request without
        its trial, and caches the id once committed (lock held)."""
        tid = slot.trial_ids.get(ident)
        if tid is None:
            # unique: another process may have recorded the same trial meanwhile
            attrs = {"version": slot.version}
            tid = self.storage.add_trial(
                slot.name,
                root_key,
                cfg,
                seqs,
                steps,
                node,
                step,
                attrs=attrs,
                unique=True,
                encoded=texts,
            )
        rec = self.storage.trial(tid)
        if steps > rec["steps"]:
            self.storage.update_trial(tid, steps=steps, node=node, step=step, state="pending")
        if known is not None:
            self.storage.update_trial(tid, state="done")
        else:
            self.storage.add_request(node, step)
        return tid

    def _serving(self) -> bool:
        """Whether the workers and the driver run (lock held): a submission then needs
        nothing started between its path's insertion and its request."""
        executor = self.executor
        if self.error is not None or executor is None:
            return False
        return executor.clock.virtual or self._thread is not None

    def declare(
        self,
        slot: StudySlot,
        trials: Iterable[tuple[dict[str, Any], dict[str, Sequence]]],
        horizon: int,
    ) -> None:
        """Insert the paths of trials a tuner will submit later, up to ``horizon`` steps,
        without requests, and tell the scheduler, so that running batches checkpoint
        where they branch off. ``trials`` are checked by the caller."""
        with self.lock:
            self._flush_logs()
            for cfg, seqs in trials:
                root_key, ins = self._insert_path(slot, cfg, seqs, horizon)
                events = self._path_events(root_key, ins.node)
                self._enqueue(events + self._save_events(slot, root_key))

    def save_at(self, slot: StudySlot, steps: Iterable[int]) -> None:
        """From now on, batches of the plan trees of study ``slot``'s trials checkpoint at
        ``steps`` as they pass them (its tuner's rungs: a request at a rung may come after
        a shared path was trained past it; see
        :class:`~stagetree.scheduler.events.SaveSteps`). Sent with the next submission
        or declaration into each tree."""
        with self.lock:
            slot.save_steps |= frozenset(int(s) for s in steps)

    def _save_events(self, slot: StudySlot, root_key: str) -> list[Any]:
        """A ``SaveSteps`` for the steps of ``slot`` the scheduler does not save tree
        ``root_key`` at yet (lock held)."""
        sent = self._root_saves.get(root_key, frozenset())
        new = slot.save_steps - sent
        if not new:
            return []
        steps = sent | new
        self._root_saves[root_key] = self._save_sets.setdefault(steps, steps)
        return [SaveSteps(root_key, new)]

    def _insert_path(
        self, slot: StudySlot, config: dict[str, Any], hp: dict[str, Sequence], steps: int
    ) -> tuple[str, Insertion]:
        """Insert a trial's path up to ``steps`` without a request (lock held); returns
        its tree's root key and the insertion (the path's end, canonical). The tree is
        trained by the study's trainer."""
        base, names = slot.root_key(config, hp), frozenset(hp)
        root_key = self._tree_key(base, names)
        try:
            ins = self._insert_into(slot, root_key, config, hp, steps)
        except InvalidTrialError:
            # Another process planted the (then empty) tree with other names meanwhile.
            self._tree_keys.pop((base, names), None)
            again = self._tree_key(base, names)
            if again == root_key:
                raise
            root_key, ins = again, self._insert_into(slot, again, config, hp, steps)
        self._settle_tree(base, names, root_key)
        return root_key, ins

    def _settle_tree(self, base: str, names: frozenset[str], root_key: str) -> None:
        """Remember that trials with hp ``names`` under ``base`` live in tree ``root_key``
        (lock held): settled, a tree's root never changes. One copy of each name set,
        and ``base`` itself when it is the tree (memory per trial)."""
        names = self._name_sets.setdefault(names, names)
        if root_key == base:  # the tree's own string, the one the plan holds
            base = root_key
        self._tree_keys[(base, names)] = root_key

    def _insert_into(
        self,
        slot: StudySlot,
        root_key: str,
        config: dict[str, Any],
        hp: dict[str, Sequence],
        steps: int,
    ) -> Insertion:
        self._own_root(slot, root_key)
        self.storage.register_root(root_key, config)
        return self.storage.insert_trial(root_key, hp, steps, request=False)

    def _own_root(self, slot: StudySlot, root_key: str) -> None:
        """The tree ``root_key`` is trained by the study's trainer (lock held)."""
        if slot.trainer_key:
            self._root_trainers[root_key] = slot.trainer_key
        else:
            self._root_trainers.pop(root_key, None)
        if slot.fusible and slot.trainer_key not in self._unfusible:
            self._root_fusible[root_key] = slot.fusible

    def _tree_key(self, base: str, names: frozenset[str]) -> str:
        """The plan tree of trials with hyper-parameter ``names`` under the root key
        ``base`` (their study's, for their config): ``base``, or the tree of their own
        names when ``base``'s holds other names (lock held)."""
        key = self._tree_keys.get((base, names))
        if key is None:
            key = self.storage.tree_key(base, names)
            if key != base:
                self._tree_keys[(base, names)] = key
        return key

    def known(
        self, slot: StudySlot, config: dict[str, Any], hp: dict[str, Sequence], step: int
    ) -> tuple[dict[str, float] | None, str | None]:
        """What the plan holds of a trial at ``step``, without training: its metrics and
        its checkpoint's ref (each None when unknown)."""
        with self.lock:
            replayed = self._replayed(slot, config, hp, step)
            if replayed is not None:  # a finished trial of the log, at its end
                tree, done = replayed
                assert done.node is not None and done.step is not None and done.final is not None
                ckpt = self._replays[slot.name].checkpoint(tree, done.node, done.step)
                return dict(done.final), (ckpt.ref if ckpt is not None else None)
            tree = self._tree_key(slot.root_key(config, hp), frozenset(hp))
            where = self.storage.locate(tree, hp, step)
            if where is None:
                return None, None
            rec = self.storage.checkpoint(*where)
            return self.storage.get_metrics(*where), (rec.ref if rec is not None else None)

    def history(
        self,
        slot: StudySlot,
        config: dict[str, Any],
        hp: dict[str, Sequence],
        steps: int,
        at: Waiter | None = None,
    ) -> dict[int, dict[str, float]]:
        """Every known metric on the trial's path up to ``steps``, by step; ``at``: its
        submission's waiter, whose ``(node, step)`` is the path's end (canonical keys
        never move: the path is read from there, not found again by the sequences)."""
        with self.lock:
            replayed = self._replayed(slot, config, hp, steps)
            if replayed is not None:
                curve = self._replays[slot.name].curve(*replayed)
                if curve is not None:
                    return curve
            if at is not None and at.step == steps and self._reads_paths:
                return self.storage.path_metrics(at.node, at.step)
            tree = self._tree_key(slot.root_key(config, hp), frozenset(hp))
            return self.storage.metrics_along(tree, hp, steps)

    @property
    def lease_ttl(self) -> float:
        """Seconds a lease of this engine outlives its last renewal (see
        :mod:`stagetree.engine.coordination`)."""
        return self.coord.ttl

    def add_stats(self, scope: str, **deltas: float) -> None:
        """Add to the plan's counters of ``scope`` (see ``BasePlanStorage.add_stats``)."""
        with self.lock:
            self.storage.add_stats(scope, **deltas)

    def _path_reads(self, root_key: str, leaf: int) -> _PathReads:
        """What :meth:`_path_events` reads of the plan: the root's config and counters
        (the scheduler does not know the root yet), the path, and the checkpoints of the
        path's nodes (it does not know a node of the path yet; by their key, not the
        whole tree's: constant per submission in a shared tree). Reads only, so that a
        submission's transaction makes them (and makes them again when it runs again)."""
        root = None
        if root_key not in self._known_roots:
            root = (self.storage.root_config(root_key), self.storage.stats(devices_scope(root_key)))
        path = self.storage.path(leaf)
        ckpts = None
        if any(n.id not in self._known_nodes for n in path):
            ckpts = self.storage.checkpoints_on([n.id for n in path])
        return root, path, ckpts

    def _path_events(self, root_key: str, leaf: int, reads: _PathReads | None = None) -> list[Any]:
        """Scheduler events for the root, the nodes and the durable checkpoints of the
        path to ``leaf`` that the scheduler has not seen yet (from ``reads``, made by
        :meth:`_path_reads` earlier with the lock held since or not: the scheduler only
        learns more meanwhile)."""
        root, path, ckpts = reads if reads is not None else self._path_reads(root_key, leaf)
        events: list[Any] = []
        if root_key not in self._known_roots:
            self._known_roots.add(root_key)
            assert root is not None
            config, learned = root
            fusible = self._root_fusible.get(root_key, frozenset())
            devices = self._devices_needed(root_key, config, learned)
            width = learned_fused_width(learned)
            events.append(RootAdded(root_key, config, fusible, devices, width))
        new = [n for n in path if n.id not in self._known_nodes]
        for n in new:
            self._known_nodes.add(n.id)
            events.append(NodeAdded(n))
        if new:
            assert ckpts is not None
            ids = {n.id for n in path}
            for (cnode, cstep), rec in ckpts.items():
                if cnode in ids and self.store.exists(rec.ref):
                    events.append(CheckpointAvailable(cnode, cstep, rec.ref))
        return events

    def _devices_needed(
        self, root_key: str, config: Mapping[str, Any], learned: dict[str, float]
    ) -> int:
        """Devices a stage of tree ``root_key`` needs: its trainer's declared need
        (``devices_needed``), or what an out-of-memory error taught an earlier run
        (``learned``: the counters kept in the plan), whichever is more."""
        trainer = self._trainers.get(self._root_trainers.get(root_key, ""), self.default_trainer)
        return max(trainer_devices(trainer, config), learned_devices(learned))

    def _enqueue(self, events: list[Any]) -> None:
        """Queue scheduler events from user threads; the driver applies them together
        (see :meth:`pump`), so trials submitted at once are planned at once."""
        now = time.monotonic()
        if not self._queued:
            self._first_queued = now
        self._last_queued = now
        # A study's weight waits for no more (it shapes no plan): the rest does, unless
        # from a thread whose submitter tells when it waits (begin_burst(watched=True)).
        if not self._watched.get(threading.get_ident()) and not all(
            isinstance(e, StudyWeight) for e in events
        ):
            self._blind = True
        self._queued.extend(events)
        self._wake_driver()

    def _wake_driver(self) -> None:
        """Wake the driver thread where it sleeps or waits on the executor's events:
        a submission, a cancellation or a stop is handled without waiting a poll out."""
        self._wake.set()
        self._burst_ended.set()
        executor = self.executor
        if executor is not None:
            executor.wake()

    def _flush(self, coalesce: bool = False) -> None:
        with self.lock:  # _enqueue runs under the lock: the queue and its times agree
            if coalesce and not self._settled():
                return
            events, self._queued = self._queued, []
            self._blind = False
            if events:
                events += self.coord.foreign_nodes(events)  # other processes' branch points
                self._apply(self.scheduler.handle_all(events))

    def cancel(self, waiter: Waiter, error: TrialCancelledError | None = None) -> None:
        """Withdraw a submission: its reference to the request is released (work another
        live request still needs goes on) and its trial is marked cancelled (its future
        fails with ``error``, default one naming the request). Batches no live request
        needs any more stop with a checkpoint where they stand."""
        node, step = waiter.node, waiter.step
        with self.lock:
            if self._closed:
                return  # the close withdrew every submission (its storage may be closed)
            self._flush_logs()  # the decision to cancel first
            waiters = self._waiters.get((node, step), [])
            if waiter not in waiters:
                return
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[(node, step)]
                self._unwait(node, step)
            req = self.storage.request(node, step)
            if req is not None and req.state not in (RequestState.DONE, RequestState.FAILED):
                self.storage.release_request(node, step)
                self._enqueue([RequestCancelled(node, step, study=waiter.study)])
            if not waiter.future.done():
                if error is None:
                    error = TrialCancelledError(f"request ({node}, {step})")
                waiter.future.set_exception(error)
            self._set_trial_state(waiter, "cancelled")

    # -- driver thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._coalesce()
                began = time.monotonic()
                if not self.pump(timeout=_POLL, coalesce=True) and not self._queued:
                    # Nothing happened: sleep until a submission or the next poll, unless
                    # the executor already waited the poll out watching its workers (a
                    # sleep here would not see a worker's event until it ends).
                    rest = _POLL - (time.monotonic() - began)
                    executor = self.executor
                    if rest > 0 and (executor is None or not executor.waits_in_events):
                        self._wake.wait(rest)
                        self._wake.clear()
        except BaseException as exc:  # keep the error for every waiter and later calls
            self.error = exc
            tb = traceback.format_exc()
            logger.error("the study engine stopped on an error: %r\n%s", exc, tb)
            with self.lock:
                for waiters in self._waiters.values():
                    for w in waiters:
                        if not w.future.done():
                            w.future.set_exception(TrialFailedError(f"engine failed: {exc!r}", tb))
                self._waiters.clear()
                self._waiting_steps.clear()

    def _coalesce(self) -> None:
        """Let a burst of submissions (a tuner submitting a rung, ``asyncio.gather`` of
        several trials) finish arriving before planning: wait until no request came for
        ``_QUIET`` s, at most ``_MAX_DELAY`` s after the first one, and until the end of
        a burst announced with :meth:`begin_burst`; at once when all of it came from
        watched bursts, now ended (a tune()'s tuner waiting for results)."""
        while self._queued and not self._stop.is_set() and not self._settled():
            # woken early by end_burst: a tuner that waits is not kept waiting (its own
            # event: _wake stays set for the round that follows)
            self._burst_ended.wait(max(0.001, _QUIET - (time.monotonic() - self._last_queued)))
            self._burst_ended.clear()

    def begin_burst(self, watched: bool = False) -> None:
        """More submissions follow in this burst: plan none of it before
        :meth:`end_burst` (the planning of trials submitted together then does not
        depend on how fast each was inserted). ``watched``: the caller ends the burst
        only once its submitter waits for a result (a tuner whose every task waits), so
        what this thread submits meanwhile is planned at the end, without the quiet
        window."""
        with self.lock:
            if time.monotonic() - max(self._burst_at, self._last_queued) > _BURST_MAX:
                self._bursts = 0  # ends never announced: forgotten
                self._watched.clear()
            self._bursts += 1
            self._burst_at = time.monotonic()
            if watched:
                ident = threading.get_ident()
                self._watched[ident] = self._watched.get(ident, 0) + 1

    def end_burst(self, watched: bool = False) -> None:
        """The end of a burst :meth:`begin_burst` announced (from the same thread)."""
        with self.lock:
            self._bursts = max(0, self._bursts - 1)
            if watched:
                ident = threading.get_ident()
                left = self._watched.get(ident, 0) - 1
                if left > 0:
                    self._watched[ident] = left
                else:
                    self._watched.pop(ident, None)
            self._wake_driver()

    def _settled(self) -> bool:
        now = time.monotonic()
        if self._bursts and now - max(self._burst_at, self._last_queued) <= _BURST_MAX:
            return False
        if not self._blind:
            return True  # all of it came from submitters now waiting for results
        return now - self._last_queued >= _QUIET or now - self._first_queued >= _MAX_DELAY

    def pump(self, timeout: float | None, coalesce: bool = False) -> int:
        """One round of the driver: plan the queued submissions (with ``coalesce``, only
        once a burst of them has settled), take the executor's next events (waiting at
        most ``timeout`` s) and apply them. Returns how many events were applied. The driver
        thread calls it in a loop; a virtual-time executor may be pumped by its caller."""
        self._flush(coalesce)
        executor = self.executor
        # No workers yet (nothing needed training): the scheduler has no worker to assign
        # work to, so nothing reaches the executor; the driver only renews its leases.
        events = [] if executor is None else executor.events(0 if self._queued else timeout)
        if events:
            with self.lock:
                try:
                    for ev in events:
                        self._on_event(ev)
                finally:
                    # What the round kept, in one transaction (counts throttled while
                    # only progress came).
                    steady = all(isinstance(ev, _STEADY) for ev in events)
                    self.ledger.flush(COUNTS_EVERY if steady else 0.0)
                self._record_workers(events)
        with self.lock:
            self.ledger.flush(COUNTS_EVERY)  # an idle round: kept counts in time
            self.coord.tick()
        return len(events)

    def _on_event(self, ev: WorkerEvent) -> None:
        """Apply one executor event: the engine's own bookkeeping (its kind's handler in
        :attr:`_handlers`), then the scheduler's decisions, then the studies' accounting
        of the steps the scheduler charged for it."""
        if not isinstance(ev, _KEPT_THROUGH):
            # What the ledger kept is written before anything that could read it.
            self.ledger.flush()
        batch_id = getattr(ev, "batch_id", None)
        batch = self._batches.get(batch_id) if batch_id is not None else None
        handler = self._handlers.get(type(ev))
        if handler is not None:
            handler(ev, batch)
        charged = self.scheduler.usage
        self._apply(self.scheduler.handle(ev))
        # Only when a batch ended or a saving batch's writes did (not per event).
        if self._unreleased and self._released != (
            len(self._unreleased),
            self.scheduler.saving_left,
        ):
            is_saving = self.scheduler.is_saving
            for ended in [b for b in self._unreleased if not is_saving(b)]:
                self._unreleased.discard(ended)
                self.coord.batch_ended(ended, self.ledger.defer)
            self._released = (len(self._unreleased), self.scheduler.saving_left)
        rate = batch.rate if batch is not None else 0.0
        steps = self.ledger.count_studies(charged, self.scheduler.usage, rate)
        if batch is not None:
            for name, delta in steps.items():
                mine = batch.charged.setdefault(name, [0.0, 0.0])
                mine[0] += delta
                mine[1] += delta * rate
            if isinstance(ev, work.BatchDone):
                self._settle_charges(batch, ev.busy_seconds * self._devices(ev.worker))
        if isinstance(ev, work.CheckpointSaved) and self.checkpoint_budget is not None:
            self.ledger.flush()  # the eviction reads the checkpoints' records
            self._evict()

    def _event_handlers(self) -> dict[type[Any], Callable[[Any, RunningBatch | None], None]]:
        """The engine's handler of each kind of executor event; each gets the event and
        the record of the running batch it names (None: none)."""
        return {
            work.CurveReported: self._on_curve,
            work.MetricsReported: self._on_metrics,
            work.CheckpointSaved: self._on_checkpoint_saved,
            work.CheckpointFailed: self._on_checkpoint_failed,
            work.FusionFailed: self._on_fusion_failed,
            work.Progress: self._on_progress,
            work.SplitMissed: self._on_split_missed,
            work.BatchDone: self._on_batch_done,
            work.BatchFailed: self._on_batch_failed,
            work.WorkerLost: self._on_worker_lost,
        }

    def _on_curve(self, ev: work.CurveReported, batch: RunningBatch | None) -> None:
        # Written together with the round's other curves (a fused job sends one per
        # member), before anything that could read them. A point whose request awaits
        # its checkpoint is stored as a curve point only (not an answer) until then.
        awaits = self.scheduler.awaits_checkpoint
        self.ledger.add_curves(
            (n, s, m, evaluated and not awaits(ev.batch_id, n, s))
            for n, s, m, evaluated in ev.points
        )

    def _on_metrics(self, ev: work.MetricsReported, batch: RunningBatch | None) -> None:
        if self.scheduler.awaits_checkpoint(ev.batch_id, ev.node, ev.step):
            # Metrics in the plan answer a later run at once: they are stored when the
            # request settles (its model durable), not before, so that a run that ends
            # while the store is down never leaves a trial finished without its model.
            self._unstored[(ev.node, ev.step)] = dict(ev.metrics)
            return
        self.ledger.defer(functools.partial(self.storage.put_metrics, ev.node, ev.step, ev.metrics))

    def _on_checkpoint_saved(self, ev: work.CheckpointSaved, batch: RunningBatch | None) -> None:
        # Written with the round's other kept writes, or with the end of the trial it
        # settles (Engine.resolve): before its lease is released, in any case.
        put = self.storage.put_checkpoint
        self.ledger.defer(functools.partial(put, ev.node, ev.step, ev.ref, ev.nbytes))
        self._note_event(
            "save",
            ev,
            batch,
            node=ev.node,
            step=ev.step,
            seconds=ev.seconds,
            data={"nbytes": ev.nbytes},
        )
        if batch is not None:
            batch.durable = max(batch.durable or 0, ev.step)
        self.ledger.count(
            "engine", ckpt_saves=1, ckpt_save_seconds=ev.seconds, ckpt_bytes=ev.nbytes
        )
        self._idle.notify_all()  # settle() also waits for the writes of ended batches

    def _on_checkpoint_failed(self, ev: work.CheckpointFailed, batch: RunningBatch | None) -> None:
        logger.warning(
            "checkpoint of node %s at step %s not stored (%s); work that needs it "
            "recomputes it, and a trial that ends there stays pending until it is stored",
            ev.node,
            ev.step,
            ev.error,
        )
        self.storage.add_stats("engine", ckpt_failures=1)
        self._idle.notify_all()  # settle() also waits for the writes of ended batches

    def _on_fusion_failed(self, ev: work.FusionFailed, batch: RunningBatch | None) -> None:
        """A worker could not fuse the trainer's jobs: say it once, and fuse no tree of
        that trainer again (the worker trains the members one by one)."""
        if ev.members:  # counted as fused when submitted; they train one by one
            jobs = -1 if ev.whole else 0
            self.storage.add_stats(
                root_scope(ev.root_key), fused_jobs=jobs, fused_members=-ev.members
            )
        if ev.trainer in self._unfusible:
            return
        self._unfusible.add(ev.trainer)
        # Only the trees with fusible names can fuse (the others have none to take).
        trees = [r for r in self._root_fusible if self._root_trainers.get(r, "") == ev.trainer]
        for root in trees:
            self._root_fusible.pop(root, None)
            self.scheduler.disable_fusion(root)
        trainer = self._trainers.get(ev.trainer, self.default_trainer)
        name = getattr(trainer, "__qualname__", "the trainer")
        warnings.warn(
            f"{name} cannot be trained fused, so its trials train unfused (same results, "
            f"no fusion speed-up): {ev.error}",
            StagetreeWarning,
            stacklevel=2,
        )
        self.storage.add_stats("engine", fusion_failures=1)

    def _on_progress(self, ev: work.Progress, batch: RunningBatch | None) -> None:
        if batch is None:
            return
        batch.last_step = ev.step
        if ev.seconds_per_step > 0:
            # A member of a fused job costs its share of the job's step.
            rate = ev.seconds_per_step / max(ev.width, 1)
            batch.rate = rate * self._devices(ev.worker)

    def _on_split_missed(self, ev: work.SplitMissed, batch: RunningBatch | None) -> None:
        self.storage.add_stats("engine", splits_missed=1)

    def _on_batch_done(self, ev: work.BatchDone, batch: RunningBatch | None) -> None:
        self._end(ev.batch_id)
        self._note_event(
            "done",
            ev,
            batch,
            seconds=ev.busy_seconds,
            data={
                "steps": ev.steps,
                "load_seconds": ev.load_seconds,
                "save_wait_seconds": ev.save_wait_seconds,
            },
        )
        device = ev.busy_seconds * self._devices(ev.worker)
        counted: dict[str, dict[str, float]] = {
            "engine": {"device_seconds": device, "steps_executed": ev.steps}
        }
        if batch is not None:  # per tree too, so each study can count its own
            counted[root_scope(batch.root_key)] = dict(counted["engine"])
        if ev.load_seconds:
            counted["engine"].update(ckpt_loads=1, ckpt_load_seconds=ev.load_seconds)
        for scope, deltas in counted.items():  # written with the round's counts
            self.ledger.count(scope, **deltas)
        if batch is not None and ev.steps:
            batch.rate = ev.busy_seconds * self._devices(ev.worker) / ev.steps

    def _devices(self, worker: int) -> int:
        """Devices a busy second of ``worker`` occupies: those it announced
        (``WorkerReady.devices``; workers of a mixed cluster differ), at least the
        executor's ``devices_per_worker``."""
        return max(self._devices_per_worker, self.scheduler.worker_devices(worker))

    def _settle_charges(self, batch: RunningBatch, device: float) -> None:
        """A batch ended after ``device`` device-seconds of work (what the storage-wide
        counters count): charge them to the studies it trained for, less what was
        charged as its steps were reported (at the training-only rate of ``Progress``),
        so that a study's device-seconds and the storage's add up. The study that
        needed the most of its steps pays all of it, another its share of the steps
        (a step several studies needed counts for each, as in ``steps_executed``); a
        batch that trained no step for anyone (an evaluation, a load, work cancelled
        before it began) is paid by the studies it served when it started."""
        most = max((steps for steps, _ in batch.charged.values()), default=0.0)
        if most > 0:
            owed = {n: steps / most * device - paid for n, (steps, paid) in batch.charged.items()}
        else:
            owed = {n: device for n in batch.serving}
        for name, delta in owed.items():
            version = self.ledger.study_versions.get(name)
            if version is not None and delta:
                self.ledger.count(study_scope(name, version), device_seconds=delta)
        batch.charged.clear()

    def _on_batch_failed(self, ev: work.BatchFailed, batch: RunningBatch | None) -> None:
        self._end(ev.batch_id)
        self._note_event("failed", ev, batch, node=ev.node, step=ev.step, data={"error": ev.error})
        if ev.kind != "checkpoint":
            return
        # The start checkpoint is unreadable: the scheduler replans the work from an
        # earlier checkpoint. Its plan record goes only when the object was found missing
        # or corrupt, not when the store could not be reached (it may still be whole).
        ref = batch.start_ref if batch is not None else None
        if ev.error.startswith(CheckpointUnreachableError.__name__):
            logger.warning(
                "checkpoint %s could not be loaded (%s); its steps are recomputed, "
                "and it stays recorded",
                ref,
                ev.error,
            )
            return
        for (node, step), rec in self.storage.checkpoints().items():
            if rec.ref == ref:
                self.storage.remove_checkpoint(node, step)
        if ref is not None and ref not in self._reported_corrupt:
            self._reported_corrupt.add(ref)  # said once, not at every retry
            logger.warning(
                "checkpoint %s (step %s) cannot be loaded (%s); its steps are "
                "recomputed from an earlier checkpoint",
                ref,
                ev.step,
                ev.error,
            )

    def _on_worker_lost(self, ev: work.WorkerLost, batch: RunningBatch | None) -> None:
        """Accounting of a lost worker: ``workers_lost``; the steps its batch had
        reported training count as executed (they were), and those past its last
        durable checkpoint as ``steps_lost`` (they are trained again: recomputed)."""
        trained = lost = 0
        if batch is not None:
            start, last = batch.start_step, batch.last_step
            trained = last - start
            durable = batch.durable if batch.durable is not None else start
            lost = last - max(start, durable)
        deltas = {"workers_lost": 1, "steps_lost": lost, "steps_executed": trained}
        self.storage.add_stats("engine", **deltas)
        if batch is not None:
            self.storage.add_stats(root_scope(batch.root_key), **deltas)
        if ev.batch_id is not None:
            self._end(ev.batch_id)
            self._note_event("lost", ev, batch, data={"reason": ev.reason})

    def _end(self, batch_id: int) -> None:
        """A batch ended: drop its record. Its stage leases go once its checkpoints are
        durable (:meth:`_on_event`): another engine waiting for the stage must find them
        in the plan."""
        self._unreleased.add(batch_id)
        self._batches.pop(batch_id, None)
        self._idle.notify_all()

    def _note_event(self, kind: str, ev: Any, batch: RunningBatch | None, **fields: Any) -> None:
        if batch is not None:  # a batch this engine started (not an undone one)
            self.ledger.note(kind, ev.batch_id, ev.worker, batch.root_key, **fields)

    def _record_workers(self, events: list[Any]) -> None:
        """Keep where the workers run (cluster executors) in the meta of the studies this
        engine serves, for ``stagetree status``; written when workers come and go."""
        if any(isinstance(e, (work.WorkerReady, work.WorkerLost)) for e in events):
            self._workers_changed = True
        # Every study with a waiter is in _studies (see submit): no scan of the waiters.
        if not self._workers_changed or not self._studies or self.executor is None:
            return
        locations = self.executor.worker_locations()
        if not locations:
            return
        self._workers_changed = False
        for name in sorted(self._studies):
            try:
                self.storage.update_study_meta(
                    name, {"workers": {str(w): where for w, where in sorted(locations.items())}}
                )
            except StagetreeError:
                self._workers_changed = True  # its row is written with its first trial

    def _apply(self, out: Iterable[Any]) -> None:
        todo, refused = deque(out), set()
        while todo:
            item = todo.popleft()
            if isinstance(item, (work.RunBatch, work.RunFused)):
                members = item.members if isinstance(item, work.RunFused) else (item,)
                started = []
                for member in members:
                    # Another engine holds a lease on some of its stages: the batch is
                    # undone and its requests wait for that engine (stagetree.engine.coordination).
                    # Its trials are marked running in the lease's transaction.
                    undo = self.coord.claim(member, functools.partial(self._mark_batch, member))
                    if undo:
                        refused.add(member.batch_id)
                        todo.extend(self.scheduler.handle_all(undo))
                    else:
                        started.append(self._started(member, width=len(members)))
                if not started:
                    continue
                assert self.executor is not None
                if len(started) == 1:
                    self.executor.submit(started[0])
                else:
                    self.executor.submit(work.RunFused(started[0].worker, tuple(started)))
                    self.storage.add_stats(
                        root_scope(started[0].root_key), fused_jobs=1, fused_members=len(started)
                    )
            elif isinstance(item, (work.AddCheckpoint, work.Abort)) and item.batch_id in refused:
                continue
            elif isinstance(item, (work.AddCheckpoint, work.Abort)):
                assert self.executor is not None
                if isinstance(item, work.AddCheckpoint):
                    self.storage.add_stats("engine", live_splits=1)
                else:  # what it trained is kept: a later request resumes from there
                    item = dataclasses.replace(item, save=True)
                self.executor.submit(item)
            elif isinstance(item, RequestDone):
                self.resolve(item.node, item.step, metrics=dict(item.metrics))
            elif isinstance(item, RequestFailed):
                where = getattr(item, "where", "")
                self.resolve(item.node, item.step, error=(item.error, item.traceback, where))
            elif isinstance(item, DevicesLearned):  # kept: a later run starts with it
                scope = devices_scope(item.root_key)
                self.storage.add_stats(scope, **devices_learned(item.devices, item.fused_width))

    def _started(self, item: Any, width: int = 1) -> Any:
        """Book a batch that goes to the executor (lock held); returns it, trained by
        the trainer of its tree's study."""
        assert self.executor is not None
        key = self._root_trainers.get(item.root_key, "")
        if key != item.trainer:  # the trainer of the tree's study trains it
            item = dataclasses.replace(item, trainer=key)
        self._batches[item.batch_id] = RunningBatch(
            item.root_key,
            item.start_step,
            item.start_step,
            item.start_checkpoint,
            serving=self.scheduler.serving(item.batch_id),
        )
        where = self.executor.worker_locations().get(item.worker, self._here)
        data = {
            "segments": [[g.node, g.start, g.stop] for g in item.segments],
            "start_step": item.start_step,
            "stop_step": max((g.stop for g in item.segments), default=0),
            "location": where,
        }
        if width > 1:
            data["fused"] = width
        self.ledger.note("start", item.batch_id, item.worker, item.root_key, data=data)
        return item

    def _mark_batch(self, item: Any) -> None:
        """Mark the trials a starting batch trains running (lock held)."""
        for seg in item.segments:
            self._mark_running(seg.node)

    # -- the coordinator's port (stagetree.engine.coordination.CoordinationPort) ---------

    def apply_events(self, events: list[Any]) -> None:
        """Feed scheduler events to the scheduler and carry out its instructions."""
        self._apply(self.scheduler.handle_all(events))

    def has_queued_events(self) -> bool:
        """Whether submissions wait to be planned."""
        return bool(self._queued)

    def known_roots(self) -> list[str]:
        """The plan trees the scheduler knows, sorted."""
        return sorted(self._known_roots)

    def knows_node(self, node: int) -> bool:
        """Whether the scheduler knows plan node ``node``."""
        return node in self._known_nodes

    def learn_node(self, node: int) -> bool:
        """Mark ``node`` known to the scheduler; False when it already was."""
        if node in self._known_nodes:
            return False
        self._known_nodes.add(node)
        return True

    def has_waiters(self, node: int, step: int) -> bool:
        """Whether this process has submissions of request ``(node, step)``."""
        return (node, step) in self._waiters

    def waiting_studies(self, node: int, step: int) -> list[str]:
        """The study of each unanswered submission of request ``(node, step)``."""
        return [w.study for w in self._waiters.get((node, step), []) if not w.future.done()]

    def _unwait(self, node: int, step: int) -> None:
        """Forget request ``(node, step)``'s submissions (lock held). Emptied, both
        tables are made again: a dict keeps the table of its largest size (random
        search's trials all wait at once), a new one is small."""
        self._waiters.pop((node, step), None)
        steps = self._waiting_steps[node]
        del steps[step]
        if not steps:
            del self._waiting_steps[node]
            if not self._waiting_steps:
                self._waiters, self._waiting_steps = {}, {}

    def _mark_running(self, node: int) -> None:
        for step in list(self._waiting_steps.get(node, ())):
            for w in self._waiters[(node, step)]:
                self._set_trial_state(w, "running", only_from="pending")

    def resolve(
        self,
        node: int,
        step: int,
        metrics: dict[str, float] | None = None,
        error: tuple[str, str, str] | None = None,
    ) -> None:
        held = self._unstored.pop((node, step), None)
        waiters = [w for w in self._waiters.get((node, step), []) if not w.future.done()]
        failure = None
        if error is not None:
            text, tb, where = error
            failure = failure_record(text, tb, where)

        kept = self.ledger.kept()

        def write() -> dict[str, float] | None:
            # The request's metrics and state and its trials' states in one transaction,
            # durable before any trial is answered: a trial reported finished survives a
            # crash, and none is stored half finished. First what the ledger kept: the
            # curve points, metrics and checkpoint records this reads or relies on, and
            # the counts a trial's answer finds written.
            self.ledger.write(kept)
            req = self.storage.request(node, step)
            if error is None and held is not None:
                self.storage.put_metrics(node, step, held)
            if error is not None:
                if req is not None:
                    self.storage.set_request_state(node, step, RequestState.FAILED, error=error[0])
            elif req is not None:
                self.storage.set_request_state(node, step, RequestState.DONE)
            for w in waiters:
                self._set_trial_state(w, "failed" if failure else "done", error=failure)
            if error is None and metrics is None:
                return self.storage.get_metrics(node, step) or {}
            return metrics

        try:
            metrics = self.storage.atomically(write)
        except BaseException:
            if held is not None:  # kept for the next try
                self._unstored[(node, step)] = held
            raise
        self.ledger.written(kept)
        if (node, step) in self._waiters:
            self._unwait(node, step)
        self._waiters.pop((node, step), None)
        for w in waiters:
            if error is not None:
                text, tb, where = error
                message = f"trial {w.trial_id} failed {where}: {text}" if where else text
                w.future.set_exception(TrialFailedError(message, tb))
            else:
                assert metrics is not None
                w.future.set_result(metrics)

    def _set_trial_state(
        self,
        w: Waiter,
        state: str,
        only_from: str | None = None,
        error: dict[str, str] | None = None,
    ) -> None:
        """Record a trial's state; a failure keeps its error in ``attrs["error"]``, and any
        other final state drops an error left by an earlier run."""
        try:
            needs_attrs = error is not None or state in ("done", "cancelled")
            if only_from is not None and not needs_attrs:  # checked and set at once
                self.storage.update_trial(w.trial_id, state=state, only_from=only_from)
                return
            # one read of the row serves both questions
            row = self.storage.trial(w.trial_id) if only_from is not None or needs_attrs else {}
            if only_from is not None and row["state"] != only_from:
                return
            attrs = None
            if needs_attrs:
                attrs = dict(row.get("attrs") or {})
                if error is not None:
                    attrs["error"] = error
                elif attrs.pop("error", None) is None:
                    attrs = None  # nothing to change
            self.storage.update_trial(w.trial_id, state=state, attrs=attrs, seen=row or None)
        except StagetreeError:
            pass  # the trial record is informative only

    def _evict(self) -> None:
        """Keep the checkpoint store within its budget (cost-benefit, see
        :func:`stagetree.checkpoints.eviction.evict_to_budget`: the rule ``stagetree gc``
        follows); never drop a checkpoint live work needs."""
        assert self.checkpoint_budget is not None
        try:
            removed = evict_to_budget(self.storage, self.store)
        except StagetreeError as exc:  # a remote store out of reach: evict next time
            logger.warning("checkpoint eviction skipped: %s", exc)
            return
        for node, step in removed:
            self._apply(self.scheduler.handle(CheckpointLost(node, step)))
