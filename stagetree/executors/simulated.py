"""A virtual-time executor: the real scheduler and tuners, simulated workers.

:class:`SimulatedExecutor` carries out :class:`~stagetree.work.RunBatch` instructions
on ``num_workers`` simulated workers against a virtual clock. Nothing is trained and
nothing sleeps: a batch's timeline (checkpoint load, training steps, evaluations,
background checkpoint saves) is computed from a step-cost model, and
:meth:`SimulatedExecutor.events` jumps the clock to the next instant at which
something happens and returns what happens then. The study engine feeds those
events to the real scheduler and the real tuners react (see :func:`drive`), so a
448-trial, 40-worker study runs in seconds and its decisions are those the real
system would take given the same durations and metrics.

Models (all deterministic; see :mod:`stagetree.tools.simulate` for more):

* :class:`StepCost`: seconds of one training step as a function of the fixed config
  and the sequence values at that step (batch size by default).
* :class:`LearningCurve`: metrics as a function of the *path* of sequence values
  from step 0 (an incremental fold ``initial -> update per step -> metrics``), so
  that trials sharing a prefix get identical metrics there, however the path was
  split into stages, resumed or shared.
* Checkpoints: ``checkpoint_bytes`` per config; a save costs ``save_latency +
  nbytes / save_bandwidth`` seconds in the background (training goes on, and the
  batch's ``BatchDone`` does not wait for it: ``CheckpointSaved`` may come after, as
  with the real worker), a load ``load_latency + nbytes / load_bandwidth``
  seconds before training, skipped when the worker still holds the model in memory
  (it just finished where the new batch starts, with the same trainer key), as the
  real worker does.
* Devices: each worker owns ``devices_per_worker`` devices (``k``) and trains a batch
  data-parallel over all of them (gang-scheduled by construction: a batch gets the
  whole worker). A training step takes ``step_cost / (1 + (k - 1) * e)`` seconds for a
  parallel efficiency ``e`` in (0, 1] (loads, saves and evaluations are not scaled);
  :attr:`SimulatedExecutor.device_seconds` counts a worker's busy seconds ``k`` times.
  A mixed cluster gives each worker its own ``k`` (``devices_per_worker=[1, 2, 4]``).
* Device memory: ``memory_devices`` (an int or ``config -> int``) is the devices a
  trial's model really needs; a batch on a worker with fewer fails at its start with a
  simulated CUDA out-of-memory error (``BatchFailed(kind="oom")``), and the scheduler
  learns the need as it would from a real one (see :mod:`stagetree.executors.devices`).
* Trainers: nothing is built, so :meth:`SimulatedExecutor.add_trainer` only records
  keys (the contract's checks hold: a key taken by another class is refused, a batch of
  an unknown key fails at its start); every key follows the same models.

Timeline of a batch started at ``t0`` on a worker: load, then the steps; at each
*milestone* (a segment end, an evaluation or checkpoint point, the end, and every
``progress_interval`` virtual seconds like the real worker) it reports ``Progress``;
at a checkpoint point the save starts (``CheckpointSaved`` when done); at an
evaluation point it evaluates for ``eval_seconds`` (blocking) and reports
``MetricsReported``. ``AddCheckpoint`` for a point the worker has not passed adds a
point (``SplitMissed`` otherwise); ``Abort`` stops the batch after the step in
progress. The worker is busy from ``t0`` until its ``BatchDone``.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import heapq
import itertools
import json
import math
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stagetree.exceptions import StagetreeError
from stagetree.executors._events import new_trainer
from stagetree.executors.base import BaseExecutor, VirtualClock, settle_loop
from stagetree.executors.devices import (
    check_devices_per_worker,
    check_parallel_efficiency,
    check_worker_devices,
    data_parallel_speedup,
)
from stagetree.hp import step_values
from stagetree.trainer import Trainer
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    CheckpointSaved,
    Instruction,
    MetricsReported,
    Progress,
    RunBatch,
    SplitMissed,
    WorkerEvent,
    WorkerReady,
)

__all__ = [
    "LearningCurve",
    "SimulatedExecutor",
    "SimulatedTrainer",
    "StepCost",
    "drive",
]

Values = Mapping[str, Any]
StepCostFn = Callable[[Mapping[str, Any], Values], float]


def _unit_hash(*parts: Any) -> float:
    """A deterministic number in [0, 1) from ``parts`` (stable across processes)."""
    text = json.dumps(parts, sort_keys=True, default=repr)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


# --------------------------------------------------------------------------- models


class StepCost:
    """Seconds per training step: ``base_seconds * prod((value / ref) ** exponent)``.

    Args:
        base_seconds: seconds of one step at the reference values.
        factors: ``name -> (ref, exponent)``; ``name`` is looked up among the sequence
            values at the step first, then in the fixed config. Missing or
            non-numeric values contribute a factor 1. The default makes a step (an
            epoch) faster with a larger batch: ``{"batch_size": (128, -0.3)}``.

    Any callable ``(config, values) -> seconds`` can stand in for a ``StepCost``.
    """

    def __init__(
        self,
        base_seconds: float = 1.0,
        factors: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        if not (math.isfinite(base_seconds) and base_seconds > 0):
            raise ValueError(f"base_seconds must be > 0, got {base_seconds!r}")
        self.base_seconds = float(base_seconds)
        self.factors = dict({"batch_size": (128.0, -0.3)} if factors is None else factors)
        for name, (ref, _exp) in self.factors.items():
            if not ref > 0:
                raise ValueError(f"factor {name!r}: reference value must be > 0, got {ref!r}")

    def __call__(self, config: Mapping[str, Any], values: Values) -> float:
        seconds = self.base_seconds
        for name, (ref, exponent) in self.factors.items():
            x = _number(values.get(name, config.get(name)))
            if x is not None and x > 0:
                seconds *= (x / ref) ** exponent
        return seconds

    def __repr__(self) -> str:
        return f"StepCost(base_seconds={self.base_seconds}, factors={self.factors})"


class LearningCurve:
    """A synthetic, deterministic learning curve driven by the sequence values.

    The state after ``S`` steps is a fold over the path's values: ``initial(config)``,
    then ``update(state, config, values_at_t)`` for ``t = 0 .. S-1``; metrics are
    ``metrics(state, config)``. Any function of the path can be written this way, and
    a fold makes a checkpoint's state (and so a resumed or shared path) give exactly
    the same floats as an unbroken run.

    The default model, per step: an effective learning rate ``lr_eff = lr * (1 -
    0.9) / (1 - momentum)`` (1 without a momentum value) makes progress ``P`` grow by
    ``lr_eff / (lr_eff + lr_half)``, scaled by ``(ref_batch / batch_size) ** 0.5``
    (fewer updates per step with bigger batches), damped above ``lr_max``
    (instability) and perturbed by ``+-spread`` per value of every other
    hyper-parameter (a stable hash of name and value); a "temperature" ``E``, an
    exponential average of ``lr_eff * ref_batch / batch_size``, costs accuracy, so
    annealing the learning rate pays off late, as in real training. Then::

        accuracy = ceiling(config) * (1 - exp(-P / tau)) - temperature_cost * E + noise

    where ``ceiling`` is a stable hash of the config in ``ceiling_range`` and
    ``noise`` a stable hash of the state in ``+-noise``. ``loss = 1 - accuracy``.

    Args:
        tau: progress needed for ``1 - 1/e`` of the ceiling (in steps at ``lr_eff``
            far above ``lr_half``).
        lr_key, momentum_key, batch_key: names of those hyper-parameters (looked up in
            the values, then in the config); missing: lr 0.1, no momentum, batch
            ``ref_batch``.
        aliases: extra metric names, ``name -> "accuracy" | "loss"`` (e.g. the
            metric a tuner optimises).
    """

    def __init__(
        self,
        *,
        tau: float = 10.0,
        lr_key: str = "lr",
        momentum_key: str = "momentum",
        batch_key: str = "batch_size",
        ref_batch: float = 128.0,
        lr_half: float = 0.02,
        lr_max: float = 1.0,
        temperature_cost: float = 0.4,
        ceiling_range: tuple[float, float] = (0.88, 0.96),
        spread: float = 0.15,
        noise: float = 0.002,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau!r}")
        for name, target in (aliases or {}).items():
            if target not in ("accuracy", "loss"):
                raise ValueError(f"alias {name!r} must map to 'accuracy' or 'loss', got {target!r}")
        self.tau = float(tau)
        self.lr_key, self.momentum_key, self.batch_key = lr_key, momentum_key, batch_key
        self.ref_batch = float(ref_batch)
        self.lr_half, self.lr_max = float(lr_half), float(lr_max)
        self.temperature_cost = float(temperature_cost)
        self.ceiling_range = ceiling_range
        self.spread, self.noise = float(spread), float(noise)
        self.aliases = dict(aliases or {})
        self._factor_cache: dict[tuple[str, str], float] = {}
        self._ceiling_cache: dict[str, float] = {}

    def _value(self, name: str, config: Mapping[str, Any], values: Values) -> float | None:
        return _number(values.get(name, config.get(name)))

    def _factor(self, name: str, value: Any) -> float:
        key = (name, repr(value))
        f = self._factor_cache.get(key)
        if f is None:
            f = self._factor_cache[key] = 1.0 + self.spread * (2.0 * _unit_hash(*key) - 1.0)
        return f

    def initial(self, config: Mapping[str, Any]) -> tuple[float, float]:
        """State before step 0: ``(progress, temperature)``."""
        return (0.0, 0.0)

    def update(
        self, state: tuple[float, float], config: Mapping[str, Any], values: Values
    ) -> tuple[float, float]:
        """State after one more step trained under ``values`` (the sequence values at
        that step by name, in sorted name order as the simulator passes them)."""
        progress, temp = state
        lr = self._value(self.lr_key, config, values)
        lr = 0.1 if lr is None else max(lr, 0.0)
        mom = self._value(self.momentum_key, config, values)
        eff = lr * 0.1 / (1.0 - mom) if mom is not None and 0.0 <= mom < 1.0 else lr
        bs = self._value(self.batch_key, config, values)
        ratio = self.ref_batch / bs if bs is not None and bs > 0 else 1.0
        gain = eff / (eff + self.lr_half) * math.sqrt(ratio)
        if eff > self.lr_max:
            gain *= math.exp(-4.0 * (eff - self.lr_max))
        for name, value in values.items():
            if name not in (self.lr_key, self.momentum_key, self.batch_key):
                gain *= self._factor(name, value)
        return (progress + gain, 0.7 * temp + 0.3 * eff * ratio)

    def ceiling(self, config: Mapping[str, Any]) -> float:
        """The accuracy a config tends to (a stable hash of it in ``ceiling_range``)."""
        key = json.dumps(dict(config), sort_keys=True, default=repr)
        c = self._ceiling_cache.get(key)
        if c is None:
            lo, hi = self.ceiling_range
            c = self._ceiling_cache[key] = lo + (hi - lo) * _unit_hash("ceiling", key)
        return c

    def metrics(self, state: tuple[float, float], config: Mapping[str, Any]) -> dict[str, float]:
        """Metrics of the model in ``state``."""
        progress, temp = state
        acc = self.ceiling(config) * (1.0 - math.exp(-progress / self.tau))
        acc -= self.temperature_cost * temp
        if self.noise:
            acc += self.noise * (2.0 * _unit_hash("noise", progress, temp) - 1.0)
        acc = min(max(acc, 0.0), 1.0)
        out = {"accuracy": acc, "loss": 1.0 - acc}
        for name, target in self.aliases.items():
            out[name] = out[target]
        return out

    def metrics_of(
        self, config: Mapping[str, Any], hp: Mapping[str, Any], steps: int
    ) -> dict[str, float]:
        """Metrics of the trial ``(config, hp)`` trained alone for ``steps`` steps."""
        state = self.initial(config)
        for t in range(steps):
            values = {k: (hp[k](t) if callable(hp[k]) else hp[k]) for k in sorted(hp)}
            state = self.update(state, config, values)
        return self.metrics(state, config)


class SimulatedTrainer(Trainer):
    """Stand-in trainer class for simulated studies (a :class:`~stagetree.Study` needs
    one). A simulated executor never builds it; building it raises."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        raise StagetreeError("SimulatedTrainer is never trained; use a SimulatedExecutor")


# --------------------------------------------------------------------------- executor


class _Point:
    __slots__ = ("ckpt", "ckpt_done", "eval", "eval_done")

    def __init__(self) -> None:
        self.eval: int | None = None
        self.ckpt: int | None = None
        self.eval_done = False
        self.ckpt_done = False


@dataclass
class _Run:
    """A batch on a simulated worker. Positions are absolute steps; index ``s - start``
    into ``cum`` (training seconds from ``start``) and ``states`` (curve states)."""

    batch: RunBatch
    config: dict[str, Any]
    t0: float
    load_seconds: float
    start: int
    end: int
    cum: list[float]
    states: list[Any]
    nodes: dict[int, int]  # step -> canonical node of the model at that step
    seg_ends: list[int]
    points: dict[int, _Point]
    anchor: int = 0  # last milestone reached
    anchor_time: float = 0.0  # when training resumes from ``anchor``
    next_step: int = -1  # milestone scheduled
    version: int = 0
    stop_at: int | None = None  # abort: stop at this step
    finished: bool = False

    def time_at(self, step: int) -> float:
        return self.anchor_time + self.cum[step - self.start] - self.cum[self.anchor - self.start]


@dataclass(order=True)
class _Item:
    time: float
    seq: int
    kind: str = field(compare=False)  # "event" | "milestone"
    payload: Any = field(compare=False)
    version: int = field(compare=False, default=0)


class SimulatedExecutor(BaseExecutor):
    """Runs batches on simulated workers in virtual time (see the module docstring).

    Args:
        num_workers: simulated workers.
        step_cost: seconds per step, ``(config, values) -> float`` (default
            :class:`StepCost`).
        curve: the learning-curve model (default :class:`LearningCurve`).
        checkpoint_bytes: checkpoint size, an int or ``config -> int``.
        save_latency, save_bandwidth: a save costs ``save_latency + nbytes /
            save_bandwidth`` seconds (bytes per second), in the background.
        load_latency, load_bandwidth: the same for a load, before training.
        eval_seconds: seconds of one evaluation (blocking training).
        progress_interval: virtual seconds between ``Progress`` reports within a
            segment, as the real worker's (None: only at segment ends and points).
        devices_per_worker: devices each worker owns and trains every batch on,
            data-parallel (an int >= 1), or one int per worker (a mixed cluster; then
            ``num_workers`` is its length).
        parallel_efficiency: ``e`` in (0, 1]: ``k`` devices train a step
            ``1 + (k - 1) * e`` times as fast as one (1.0: linear scaling).
        memory_devices: the devices a trial needs to fit in device memory, an int or
            ``config -> int`` (None: one is enough); fewer fail with out of memory.

    After (or during) a run: :attr:`now` is the virtual time in seconds,
    :attr:`done_at` the virtual time the driven tuner returned (see :func:`drive`),
    :attr:`busy_seconds` the busy time per worker (wall seconds; :attr:`device_seconds`
    multiplies them by the devices per worker), :attr:`steps_trained` the steps
    trained, :attr:`batches` the batches run. The executor never blocks:
    :meth:`events` with nothing scheduled returns ``[]`` at once.
    """

    @property
    def clock(self) -> VirtualClock:
        """Its virtual clock: the study engine pumps this executor itself instead of
        running a driver thread (see :func:`drive`)."""
        return self._clock

    @property
    def now(self) -> float:
        """The virtual time in seconds (:attr:`clock`'s)."""
        return self._clock.time

    def __init__(
        self,
        num_workers: int = 1,
        *,
        step_cost: StepCostFn | None = None,
        curve: LearningCurve | None = None,
        checkpoint_bytes: int | Callable[[Mapping[str, Any]], int] = 10_000_000,
        save_latency: float = 0.1,
        save_bandwidth: float = 500e6,
        load_latency: float = 0.1,
        load_bandwidth: float = 1e9,
        eval_seconds: float = 0.0,
        progress_interval: float | None = 0.2,
        devices_per_worker: int | Sequence[int] = 1,
        parallel_efficiency: float = 1.0,
        memory_devices: int | Callable[[Mapping[str, Any]], int] | None = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        mixed = check_worker_devices(devices_per_worker)
        if mixed is not None:
            if num_workers not in (1, len(mixed)):
                raise ValueError(
                    f"devices_per_worker lists {len(mixed)} workers, but num_workers={num_workers}"
                )
            num_workers = len(mixed)
        if mixed is None:
            k = check_devices_per_worker(devices_per_worker)
            self.devices_per_worker: int | list[int] = k
            self.worker_devices = [k] * num_workers  # devices of each worker
        else:
            self.devices_per_worker = self.worker_devices = mixed
        self.memory_devices = memory_devices
        self.parallel_efficiency = check_parallel_efficiency(parallel_efficiency)
        for name, value in (
            ("save_latency", save_latency),
            ("load_latency", load_latency),
            ("eval_seconds", eval_seconds),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        for name, value in (("save_bandwidth", save_bandwidth), ("load_bandwidth", load_bandwidth)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self._num_workers = num_workers
        self.step_cost: StepCostFn = step_cost if step_cost is not None else StepCost()
        self.curve = curve if curve is not None else LearningCurve()
        self.checkpoint_bytes = checkpoint_bytes
        self.save_latency, self.save_bandwidth = float(save_latency), float(save_bandwidth)
        self.load_latency, self.load_bandwidth = float(load_latency), float(load_bandwidth)
        self.eval_seconds = float(eval_seconds)
        if progress_interval is not None and not progress_interval >= 0:
            raise ValueError(f"progress_interval must be >= 0 or None, got {progress_interval!r}")
        self.progress_interval = progress_interval
        self._clock = VirtualClock()
        self.done_at: float | None = None
        self.busy_seconds = [0.0] * num_workers
        self.steps_trained = 0
        self.batches = 0
        self.loads = 0
        self.saves = 0
        self.splits_missed = 0
        self._heap: list[_Item] = []
        self._seq = itertools.count()
        self._runs: dict[int, _Run] = {}  # batch id -> running batch (until BatchDone)
        self._busy: dict[int, int] = {}  # worker -> batch id until BatchDone
        # worker -> (trainer key, root_key, config json, (node, step)) of the model it holds
        self._held: dict[int, tuple[str, str, str, tuple[int, int] | None]] = {}
        self._trainers: dict[str, Any] = {}  # key -> class, as added (never built)
        self._held_state: dict[int, Any] = {}
        self._ckpts: dict[str, tuple[Any, int]] = {}  # ref -> (curve state, nbytes)
        self._started = False
        self._closed = False

    # -- contract ------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self._num_workers

    def add_trainer(self, key: str, trainer: type[Trainer]) -> None:
        """Record trainer key ``key`` (see :meth:`BaseExecutor.add_trainer`); nothing is
        built or loaded in virtual time."""
        if new_trainer(self._trainers, key, trainer):
            self._trainers[key] = trainer

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for w in range(self._num_workers):
            self._push(self.now, "event", WorkerReady(w, self.worker_devices[w]))

    def close(self) -> None:
        self._closed = True
        self._heap.clear()

    def submit(self, instruction: Instruction) -> None:
        if self._closed:
            raise StagetreeError("the simulated executor is closed")
        if isinstance(instruction, RunBatch):
            self._run_batch(instruction)
        elif isinstance(instruction, AddCheckpoint):
            self._add_checkpoint(instruction)
        elif isinstance(instruction, Abort):
            self._abort(instruction)
        else:
            raise TypeError(f"cannot submit {type(instruction).__name__}")

    def events(self, timeout: float | None = None) -> list[WorkerEvent]:
        """Advance the clock to the next instant with events and return them all
        (``[]`` when nothing is scheduled). ``timeout`` is ignored: virtual time
        never waits."""
        out: list[WorkerEvent] = []
        heap = self._heap
        self._drop_stale()
        if not heap:
            return out
        instant = heap[0].time
        self._clock.advance(instant)
        while heap and heap[0].time <= instant:
            item = heapq.heappop(heap)
            if item.kind == "event":
                event = item.payload
                if isinstance(event, (BatchDone, BatchFailed)):
                    # The worker is busy until its batch's terminal event.
                    self._busy.pop(event.worker, None)
                    self._runs.pop(event.batch_id, None)
                out.append(event)
            else:
                run = self._runs.get(item.payload)
                if run is not None and run.version == item.version and not run.finished:
                    self._milestone(run, item.time, out)
        return out

    # -- queries -------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether anything is scheduled (a batch runs or an event waits)."""
        self._drop_stale()
        return bool(self._heap)

    def _drop_stale(self) -> None:
        """Pop rescheduled milestones off the top of the heap, so that the clock never
        jumps to an instant at which nothing happens."""
        heap = self._heap
        while heap and heap[0].kind == "milestone":
            item = heap[0]
            run = self._runs.get(item.payload)
            if run is not None and run.version == item.version and not run.finished:
                return
            heapq.heappop(heap)

    @property
    def device_seconds(self) -> float:
        """Busy seconds of all devices together: the workers' busy seconds times
        its devices (a worker's devices are busy together)."""
        return sum(b * k for b, k in zip(self.busy_seconds, self.worker_devices))

    @property
    def speedup(self) -> float:
        """How many times faster a worker trains a step than one device:
        ``1 + (devices_per_worker - 1) * parallel_efficiency`` (the largest worker's in
        a mixed cluster; see :meth:`speedup_of`)."""
        return self.speedup_of(max(range(self._num_workers), key=self.worker_devices.__getitem__))

    @property
    def worker_device_counts(self) -> list[int]:
        """Devices each worker owns."""
        return list(self.worker_devices)

    def speedup_of(self, worker: int) -> float:
        """How many times faster worker ``worker`` trains a step than one device."""
        return data_parallel_speedup(self.worker_devices[worker], self.parallel_efficiency)

    def checkpoint_cost(self, config: Mapping[str, Any]) -> tuple[int, float, float]:
        """``(nbytes, save seconds, load seconds)`` of a checkpoint of ``config``."""
        nbytes = self._nbytes(config)
        return (
            nbytes,
            self.save_latency + nbytes / self.save_bandwidth,
            self.load_latency + nbytes / self.load_bandwidth,
        )

    # -- internals -----------------------------------------------------------------------

    def _push(self, time: float, kind: str, payload: Any, version: int = 0) -> None:
        heapq.heappush(self._heap, _Item(time, next(self._seq), kind, payload, version))

    def _memory_need(self, config: Mapping[str, Any]) -> int:
        need = self.memory_devices
        return 1 if need is None else int(need(config) if callable(need) else need)

    def _nbytes(self, config: Mapping[str, Any]) -> int:
        n = self.checkpoint_bytes
        return int(n(config) if callable(n) else n)

    def _run_batch(self, batch: RunBatch) -> None:
        w = batch.worker
        if not 0 <= w < self._num_workers:
            raise ValueError(f"no simulated worker {w}")
        if w in self._busy:
            raise ValueError(f"worker {w} is still running batch {self._busy[w]}")
        self._busy[w] = batch.batch_id
        self.batches += 1
        config = dict(batch.config)
        config_key = json.dumps(config, sort_keys=True, default=repr)
        now = self.now
        segments = [s for s in batch.segments if s.stop > s.start]
        start = batch.start_step
        end = segments[-1].stop if segments else start
        if batch.trainer and batch.trainer not in self._trainers:
            self._fail(
                batch,
                now,
                f"StagetreeError: unknown trainer key {batch.trainer!r}: no trainer class "
                "is registered under it (register it with the executor's add_trainer() "
                "before submitting its batches)",
                kind="trainer",
            )
            return
        need = self._memory_need(config)
        if need > self.worker_devices[w]:
            self._fail(
                batch,
                now,
                f"OutOfMemoryError: CUDA out of memory (simulated: the model needs {need} "
                f"devices, worker {w} has {self.worker_devices[w]})",
                kind="oom",
            )
            return
        # The model to start from: in memory, from a checkpoint, or fresh.
        held = self._held.get(w)
        load = 0.0
        state: Any
        if held is not None and held == (
            batch.trainer,
            batch.root_key,
            config_key,
            batch.start_at,
        ):
            state = self._held_state[w]
        elif batch.start_checkpoint is not None:
            hit = self._ckpts.get(batch.start_checkpoint)
            if hit is None:
                self._fail(
                    batch,
                    now,
                    f"CheckpointError: unknown checkpoint {batch.start_checkpoint!r}",
                    kind="checkpoint",
                )
                return
            state, nbytes = hit
            load = self.load_latency + nbytes / self.load_bandwidth
            self.loads += 1
        elif start == 0:
            state = self.curve.initial(config)
        else:
            self._fail(
                batch,
                now,
                f"CheckpointError: batch {batch.batch_id} starts at step "
                f"{start} without a checkpoint",
                kind="checkpoint",
            )
            return
        self._held.pop(w, None)
        # Timeline of the steps: training seconds and curve states.
        cum = [0.0]
        states = [state]
        start_node = (
            batch.start_at[0] if batch.start_at is not None
            else (batch.segments[0].node if batch.segments else 0)
        )  # fmt: skip
        nodes = {start: start_node}
        seg_ends: list[int] = []
        cost = self.step_cost
        update = self.curve.update
        cost_cache: dict[tuple[Any, ...], float] = {}
        speedup = self.speedup_of(w)
        names = sorted({name for seg in segments for name in seg.hp})
        for seg in segments:
            columns = [step_values(seg.hp.get(name), seg.start, seg.stop) for name in names]
            for i in range(seg.stop - seg.start):
                row = tuple(col[i] for col in columns)
                values = dict(zip(names, row))
                key = tuple((type(v).__name__, v) for v in row)
                c = cost_cache.get(key)
                if c is None:
                    c = float(cost(config, values))
                    if not (math.isfinite(c) and c > 0):
                        raise ValueError(f"step cost must be > 0, got {c!r} for {values}")
                    c = cost_cache[key] = c / speedup  # data-parallel over the worker
                cum.append(cum[-1] + c)
                state = update(state, config, values)
                states.append(state)
                nodes[seg.start + i + 1] = seg.node
            seg_ends.append(seg.stop)
        points: dict[int, _Point] = {}
        for node, step in batch.evaluate_at:
            if start <= step <= end:
                points.setdefault(step, _Point()).eval = node
        for node, step in batch.checkpoint_at:
            if start <= step <= end:
                points.setdefault(step, _Point()).ckpt = node
        run = _Run(
            batch, config, now, load, start, end, cum, states, nodes, seg_ends, points,
            anchor=start, anchor_time=now + load,
        )  # fmt: skip
        self._runs[batch.batch_id] = run
        self._schedule_next(run)

    def _next_milestone(self, run: _Run) -> int:
        after = run.anchor
        best = run.end if run.stop_at is None else run.stop_at
        if self.progress_interval is not None:
            # Throttled Progress, as the real worker: the first step at least
            # ``progress_interval`` seconds after the previous report.
            i = after - run.start
            i = bisect.bisect_left(run.cum, run.cum[i] + self.progress_interval, lo=i + 1)
            best = min(best, run.start + i)
        for s in run.seg_ends:
            if after < s < best:
                best = s
                break
        for s in run.points:
            if after < s < best:
                best = s
        return best

    def _schedule_next(self, run: _Run) -> None:
        """(Re)schedule the next milestone; a point due at the anchor runs now."""
        run.version += 1
        if run.anchor in run.points and not _point_done(run.points[run.anchor]):
            step = run.anchor
        else:
            step = self._next_milestone(run)
        run.next_step = step
        self._push(run.time_at(step), "milestone", run.batch.batch_id, run.version)

    def _milestone(self, run: _Run, time: float, out: list[WorkerEvent]) -> None:
        batch = run.batch
        w, bid = batch.worker, batch.batch_id
        step = run.next_step
        if step > run.anchor:
            sps = (run.cum[step - run.start] - run.cum[run.anchor - run.start]) / (
                step - run.anchor
            )
            out.append(Progress(bid, w, run.nodes[step], step, sps))
            run.anchor, run.anchor_time = step, time
        point = run.points.get(step)
        if point is not None:
            self._do_point(run, step, point, out)
        if step >= run.end or (run.stop_at is not None and step >= run.stop_at):
            self._finish(run)
        else:
            self._schedule_next(run)

    def _do_point(self, run: _Run, step: int, point: _Point, out: list[WorkerEvent]) -> None:
        """Checkpoint (in the background), then evaluate (blocking), at ``anchor``."""
        batch = run.batch
        w, bid = batch.worker, batch.batch_id
        at = run.anchor_time
        if point.ckpt is not None and not point.ckpt_done:
            point.ckpt_done = True
            nbytes, save, _ = self.checkpoint_cost(run.config)
            ref = f"sim-{batch.root_key[:8]}-n{point.ckpt}-s{step}-b{bid}.ckpt"  # store-valid name
            self._ckpts[ref] = (run.states[step - run.start], nbytes)
            done = at + save
            self.saves += 1
            self._push(done, "event", CheckpointSaved(bid, w, point.ckpt, step, ref, nbytes, save))
        if point.eval is not None and not point.eval_done:
            point.eval_done = True
            metrics = self.curve.metrics(run.states[step - run.start], run.config)
            at += self.eval_seconds
            self._push(at, "event", MetricsReported(bid, w, point.eval, step, metrics))
        run.anchor_time = at

    def _finish(self, run: _Run) -> None:
        run.finished = True
        run.version += 1
        batch = run.batch
        w = batch.worker
        done = run.anchor_time  # its writes go on after it (see the module docstring)
        steps = run.anchor - run.start
        busy = done - run.t0
        self.busy_seconds[w] += busy
        self.steps_trained += steps
        self._push(done, "event", BatchDone(batch.batch_id, w, busy, steps, run.load_seconds))
        # The worker keeps the model in memory, like the real worker.
        at = (run.nodes[run.anchor], run.anchor) if steps else batch.start_at
        config_key = json.dumps(run.config, sort_keys=True, default=repr)
        self._held[w] = (batch.trainer, batch.root_key, config_key, at)
        self._held_state[w] = run.states[run.anchor - run.start]

    def _fail(self, batch: RunBatch, now: float, error: str, kind: str) -> None:
        """The batch fails at its start (``phase="start"``, as the real worker's start
        checkpoint and trainer failures)."""
        node = (
            batch.start_at[0]
            if batch.start_at is not None
            else (batch.segments[0].node if batch.segments else 0)
        )
        self._held.pop(batch.worker, None)
        event = BatchFailed(
            batch.batch_id, batch.worker, node, batch.start_step, error, "", kind, "start"
        )
        self._push(now, "event", event)

    def _add_checkpoint(self, ins: AddCheckpoint) -> None:
        run = self._runs.get(ins.batch_id)
        limit = None if run is None else (run.end if run.stop_at is None else run.stop_at)
        ok = (
            run is not None
            and not run.finished
            and limit is not None
            and run.anchor <= ins.step <= limit
            and (
                (ins.step > run.anchor and run.time_at(ins.step) >= self.now)
                or (ins.step == run.anchor and self.now <= run.anchor_time)
            )
        )
        if not ok:
            self.splits_missed += 1
            self._push(self.now, "event", SplitMissed(ins.batch_id, ins.worker, ins.node, ins.step))
            return
        assert run is not None
        point = run.points.setdefault(ins.step, _Point())
        if point.ckpt is None:
            point.ckpt = ins.node
        if ins.evaluate and point.eval is None:
            point.eval = ins.node
        if ins.step < run.next_step or ins.step == run.anchor:
            self._schedule_next(run)

    def _abort(self, ins: Abort) -> None:
        run = self._runs.get(ins.batch_id)
        if run is None or run.finished:
            return
        # Stop after the step in progress: the first step boundary not yet passed.
        stop = run.anchor
        if self.now > run.anchor_time:
            while stop < run.end and run.time_at(stop) < self.now:
                stop += 1
        if run.stop_at is None or stop < run.stop_at:
            run.stop_at = stop
        if run.stop_at < run.next_step or run.stop_at == run.anchor:
            self._schedule_next(run)


def _point_done(point: _Point) -> bool:
    return (point.ckpt is None or point.ckpt_done) and (point.eval is None or point.eval_done)


# --------------------------------------------------------------------------- driving


# Settles (of settle_loop's 10,000 rounds each) in a row that may end busy before drive
# calls it a stall: far more than a 100,000-trial replay needs, and a bound on a tuner
# that spins forever.
BUSY_SETTLES = 5_000


async def drive(
    main: Coroutine[Any, Any, Any],
    pump: Callable[[float], int],
    executor: BaseExecutor | None,
) -> Any:
    """Run ``main`` (a tuner) while delivering the executor's virtual instants.

    Loop: let ``main`` settle (every ready callback runs, so the tuner's reactions to
    one instant's results are submitted at that instant), then ``pump(0)`` (the study
    engine's :meth:`pump`) plans what was submitted and delivers the next instant; after
    an instant that woke nothing in the loop (no result for the tuner), the next one is
    delivered at once, as a settle would run nothing.
    When ``main`` returns, :attr:`SimulatedExecutor.done_at` records the virtual time
    and the work still in flight (cancelled batches, background saves) is pumped to
    its end so that accounting is complete. A settle that ends with callbacks still
    ready (:func:`settle_loop` ran out of rounds: a resumed study's replay answers
    thousands of trials at one instant) goes on settling: a busy loop is not a stall.

    Raises:
        StagetreeError: ``main`` waits while nothing is scheduled (a stall: the loop
            settled twice with nothing new to deliver).
    """

    def pending() -> bool:
        return bool(getattr(executor, "pending", False))

    task = asyncio.ensure_future(main)
    # CPython's queue of ready callbacks: empty after a pump, the instant woke nothing
    # (no result reached the tuner), so a settle would run nothing and the next instant
    # is delivered at once (the same events, decisions and clock; instants a few ulps
    # apart, which grow common as the clock grows, cost no settle each).
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    idle = busy = 0
    quiet = False
    try:
        while not task.done():
            if not quiet:
                if not await settle_loop():
                    # Still busy (a replay answers many trials at once): not a stall,
                    # unless it never ends (a tuner that spins without ever waiting for
                    # a result).
                    busy += 1
                    if busy > BUSY_SETTLES:
                        raise StagetreeError(
                            f"simulation stalled: the event loop stayed busy for {busy} "
                            "settles without waiting for any result (a tuner that never "
                            "awaits one?)"
                        )
                    continue
                busy = 0
                if task.done():
                    break
            if pump(0):
                idle = 0
                quiet = ready is not None and not ready
                continue
            quiet = False
            idle += 1
            if idle >= 2 and not pending():
                raise StagetreeError(
                    "simulation stalled: the study waits for results but no work is scheduled"
                )
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    result = task.result()
    if isinstance(executor, SimulatedExecutor):
        executor.done_at = executor.now
    # Cancelled submissions release their requests (aborts follow); run what is left.
    while True:
        if not await settle_loop():
            continue
        if not pump(0) and not pending():
            break
    return result
