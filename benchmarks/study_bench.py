"""Sharing on real training, and how much checkpoint-save time lands on the critical path.

**(b) Sharing.** A digits study (``DigitsTrainer``: an MLP, 2 hidden layers of 512, SGD with
momentum; one step = 21 minibatches of 64, about one epoch) over a grid of 24
learning-rate sequences with shared prefixes, ``Piecewise([0.1, a, a*f], [m, m+4])`` for
``m`` in 6/8/10, ``a`` in 0.03/0.01 and ``f`` in 1/0.5/0.2/0.1, trained by ``GridSearch``
to 16 steps (merge rate 2.95). It runs with ``share=True`` and ``share=False`` side by
side (alternating, ``--repeats`` times), each on a fresh SQLite storage with the same
workers (2 processes, 1 torch thread each). Every run first trains two one-step warm-up
trials of other seeds on the same engine, so the measured study starts with warm workers
(process spawn, ``import torch`` and the first trainer build -- importing scikit-learn --
are reported apart as "start-up"). The measured study's counters are summed from the
executor's events of that study alone (``BatchDone``, ``CheckpointSaved``) and checked
against ``study.stats()``. Reported: wall-clock of ``study.tune``, device-seconds (the
workers' busy time: trainer builds, checkpoint loads, training, evaluation and the
synchronous part of checkpoint saves; a batch no longer waits for its last save), steps
executed, the CPU-seconds of the worker processes (from ``/proc``: unlike busy wall time
they do not grow when other programs take the cores) and of this process (the engine:
scheduler, storage, tuner) during ``study.tune``, merge rate, and the device-seconds
ratio no-share / share against the goal 0.97 x merge rate (issue 13; 0.9 before;
medians over repeats). And per run, the study's efficiency as ``study.stats()`` gives it
(:func:`stagetree.reports.costs.efficiency`: unique steps x the median seconds per step trained
alone / workers / the wall-clock of the run, from the workers' own timings) and where the
rest of the wall-clock went: start-up (from ``study.tune`` until its first step trained:
the workers are warm here), checkpoint loads and end-of-batch save waits, idle workers,
and scheduling (the remainder).

**(c) Checkpoint saves on the critical path.** A worker captures a checkpoint
synchronously (``state_dict()`` and a clone of every tensor) and writes it from a
background thread while training goes on; a batch reports done when its training is done,
and its last writes end after it. What training loses to saves is therefore the capture,
any wait for the writer (at most two saves pending), and the CPU the writer thread takes
from training. None of these can be read off one run, so the method is a paired
replay: the ``RunBatch`` instructions that the scheduler issued in the (last)
``share=True`` run are recorded, then replayed on a fresh pair of warm worker processes,
each batch on the worker that ran it in the study, three times back to back: A exactly as
issued, M without the save at the batch's last step, B with no ``checkpoint_at`` at all
(variant order rotated from batch to batch). Every replayed batch loads its start
checkpoint from the study's store (``start_at=None``), so the variants differ in their
saves only, and pairing batch by batch keeps the noise of a shared machine (other
programs' load changes over seconds) out of the differences. With ``busy`` the sum of
``BatchDone.busy_seconds`` and ``save`` the sum of ``CheckpointSaved.seconds`` (capture +
write) of a variant, the critical-path fraction of save time is ``(busy_A - busy_B) /
save_A`` (0: saves fully hidden, 1: every save second delays training), split into the
saves inside batches ``(busy_M - busy_B) / save_M`` and the batch-final saves
``(busy_A - busy_M) / (save_A - save_M)``. Load bursts of other programs only add time,
so ``busy`` of a batch and variant is the fastest of its ``--rounds`` runs (the fractions
from the mean over rounds are printed too). The fraction is applied to the study's own
``ckpt_save_seconds``.

**(d) Start-checkpoint loads** (``--loads N``). A worker keeps the checkpoints it wrote in
memory (:mod:`stagetree.executors.kept`) and starts a batch from one of them without
reading the file back. In this process, two workers (``Worker``, no subprocess) start
the same one-step batch from the same checkpoint of the grid's model, alternately, N
times each: the one that wrote it (kept) and one that keeps nothing (it reads the file:
read, sha256, decode). Reported: the medians of the load (trainer build + restore) and of
the batch's one training step after it, each side, and of a file load's parts: reading
the file's bytes alone, ``CheckpointStore.load`` (read, verify, decode) and the trainer's
build as a worker does it before a load.

Per study run, also the gap per batch between a worker's batches, from the driver's side
(the times the executor sent each batch and received its end): the decision (an end
received -> that worker's next batch sent) and the round trip (a batch sent -> its end
received, less the worker's busy time).

**(e) The timeline of a run** (``--timeline``): per worker, each batch of the last share
run (when it was sent and ended, its busy time and its start-checkpoint load, where its
start checkpoint came from) and each idle interval, with what it waited for: the run's
start (``tune()`` -> the run's first batch started), a start checkpoint another batch
was still writing (from the worker's previous end until that ``CheckpointSaved`` reached
the driver), the decision and dispatch (the rest of a gap before a batch: the end's way
to the driver, the decision, the instruction's way back), the last batches' imbalance
(a worker's last batch ended -> the run's last one did) and the close (-> ``tune()``
returned). Times are the driver's; a batch ran on its worker during the ``busy``
seconds before its end was received. Then the hand-offs: each batch that waited for a
checkpoint another worker was writing (the root's), from that step's ``Progress``
received to the ``CheckpointSaved`` received (and the capture + write the writer timed),
the batch sent, started on its worker and its load; and the driver's reads: how many
events came in how many reads, and how many batch ends it read whole (the last
step's ``MetricsReported`` in the same read as the ``BatchDone``).

Run::

    .venv/bin/python benchmarks/study_bench.py                 # full: ~4 minutes
    .venv/bin/python benchmarks/study_bench.py --quick         # 12 trials, ~1.5 minutes
    .venv/bin/python benchmarks/study_bench.py --plot study_bench.png
    .venv/bin/python benchmarks/study_bench.py --no-replay --repeats 0 --loads 40
    .venv/bin/python benchmarks/study_bench.py --no-replay --repeats 1 --timeline
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from _common import bar_plot, fmt, load_average, machine_info, markdown_table, median, write_plot

import stagetree.trainer
from stagetree import Study
from stagetree.checkpoints import CheckpointStore
from stagetree.cli import efficiency_line
from stagetree.executors import LocalExecutor
from stagetree.executors.worker import Worker
from stagetree.hp import Constant, Piecewise
from stagetree.space import GridSpace
from stagetree.torch.examples import DigitsTrainer
from stagetree.tuners import GridSearch
from stagetree.work import (
    BatchDone,
    BatchFailed,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    Segment,
    WorkerLost,
    WorkerReady,
)

_perf = time.perf_counter

#: Fixed hyper-parameters: the digits example's model, one step = about one epoch.
FIXED: dict[str, Any] = {
    "optimizer": "momentum",
    "hidden": 512,
    "layers": 2,
    "batches_per_step": 21,
    "dropout": 0.1,
    "seed": 0,
}


def lr_space(quick: bool, batches_per_step: int) -> tuple[GridSpace, int]:
    """The grid of learning-rate sequences and the number of steps to train.

    Full: 24 trials, 16 steps, merge rate 2.95. Quick: 12 trials, 12 steps.
    """
    drops: tuple[int, ...] = (4, 6) if quick else (6, 8, 10)
    factors: tuple[float, ...] = (1.0, 0.5, 0.2) if quick else (1.0, 0.5, 0.2, 0.1)
    firsts, steps = (0.03, 0.01), 12 if quick else 16
    lrs = [
        Piecewise([0.1, a, round(a * f, 6)], [m, m + 4])
        for m in drops
        for a in firsts
        for f in factors
    ]
    fixed = {k: [v] for k, v in FIXED.items()}
    fixed["batches_per_step"] = [batches_per_step]
    return GridSpace(hp={"lr": lrs}, fixed=fixed), steps


# ---------------------------------------------------------------------- (b) a study run

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(ex: LocalExecutor) -> float:
    """User + system CPU seconds of ``ex``'s worker processes (all their threads) so far.

    Unlike busy wall time, this does not grow when other programs take the cores."""
    total = 0.0
    for w in range(ex.num_workers):
        pid = ex.pid(w)
        if pid is None:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


class _RecordingExecutor(LocalExecutor):
    """A LocalExecutor that keeps the RunBatch instructions and the checkpoint saves,
    and when it sent each batch and received its end (``perf_counter``)."""

    def __init__(self, log: dict[str, list[Any]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log
        log["executor"].append(self)

    def submit(self, instruction: Any) -> None:
        if isinstance(instruction, RunBatch):
            self.log["batches"].append(instruction)
            self.log["sent"].append((instruction.batch_id, instruction.worker, _perf()))
        super().submit(instruction)

    def events(self, timeout: float | None = None) -> list[Any]:
        out = super().events(timeout)
        now = _perf()
        if out:
            read = len(self.log["reads"])  # which read of the driver brought them
            self.log["reads"].append((len(out), now))
            for e in out:
                if isinstance(e, Progress):
                    self.log["progress"].append(((e.batch_id, e.step), now))
                elif isinstance(e, (MetricsReported, BatchDone)):
                    self.log["ends"].append((e, read))
        saves = [e for e in out if isinstance(e, CheckpointSaved)]
        self.log["saves"].extend(saves)
        self.log["saved"].extend((e.ref, now) for e in saves)
        done = [e for e in out if isinstance(e, BatchDone)]
        self.log["done"].extend(done)
        self.log["received"].extend((e.batch_id, now) for e in done)
        return out


def batch_gaps(log: Mapping[str, list[Any]]) -> dict[str, float]:
    """Per batch, in ms, what a worker spent between batches, from the driver's side:
    ``decision`` (a batch's end received -> the worker's next batch sent) and ``round
    trip`` (a batch sent -> its end received, less the worker's ``busy_seconds``: the
    instruction's and the end's way through the pipes, and the worker's own work
    outside the batch); ``gap`` is their sum, over the batches that follow another on
    the same worker."""
    received = dict(log["received"])
    busy = {e.batch_id: e.busy_seconds for e in log["done"]}
    by_worker: dict[int, list[tuple[float, int]]] = {}
    for bid, worker, at in log["sent"]:
        if bid in received:
            by_worker.setdefault(worker, []).append((at, bid))
    decision = trip = 0.0
    count = 0
    for sent in by_worker.values():
        sent.sort()
        for (began, prev), (at, _) in itertools.pairwise(sent):
            decision += at - received[prev]
            trip += received[prev] - began - busy[prev]
            count += 1
    if not count:
        return {"gap_ms": 0.0, "decision_ms": 0.0, "round_trip_ms": 0.0}
    return {
        "gap_ms": (decision + trip) / count * 1e3,
        "decision_ms": decision / count * 1e3,
        "round_trip_ms": trip / count * 1e3,
    }


#: Causes of a worker's idle time in a run's timeline (see the module docstring, (e)).
IDLE_CAUSES = ("start", "checkpoint", "decision", "imbalance", "close")


def timeline(
    log: Mapping[str, list[Any]], start: float, end: float
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """(e): per worker, its batches in order with the idle interval before each split
    by cause; returns the rows (times in ms from ``start``) and the idle worker-seconds
    by cause (:data:`IDLE_CAUSES`)."""
    received = dict(log["received"])
    done = {e.batch_id: e for e in log["done"]}
    batches = {b.batch_id: b for b in log["batches"]}
    writer = {e.ref: e for e in log["saves"]}
    saved_at = dict(log["saved"])
    idle = dict.fromkeys(IDLE_CAUSES, 0.0)
    rows: list[dict[str, Any]] = []
    by_worker: dict[int, list[tuple[float, int]]] = {}
    for bid, worker, at in log["sent"]:
        if bid in received and bid in done:
            by_worker.setdefault(worker, []).append((at, bid))
    if not by_worker:
        return rows, idle
    # A batch ran on its worker during the busy seconds before its end was received.
    began = {b: received[b] - done[b].busy_seconds for s in by_worker.values() for _, b in s}
    first = min(began.values())  # the run's first batch started: start-up until then
    last = max(received[b] for b in began)
    for worker, sent in sorted(by_worker.items()):
        idle["start"] += first - start
        free = first  # when the worker last became free
        read: set[str] = set()  # the start checkpoints this worker loaded so far
        for at, bid in sorted(sent):
            batch, ev = batches[bid], done[bid]
            gap = max(0.0, began[bid] - free)
            ref = batch.start_checkpoint
            source = "in memory" if batch.start_at is not None else "fresh"
            kind = source
            wait = 0.0
            if ref is not None and ref in writer:
                w = writer[ref]
                source = f"w{w.worker} b{w.batch_id} ({w.node}, {w.step})"
                wait = min(gap, max(0.0, saved_at[ref] - free))
                kind = "its own" if w.worker == worker else "read before" if ref in read else "new"
            elif ref is not None:
                source = kind = "an earlier run's"
            if ref is not None:
                read.add(ref)
            idle["checkpoint"] += wait
            idle["decision"] += gap - wait
            rows.append({
                "worker": worker, "batch": bid, "idle_ms": gap * 1e3, "ckpt_wait_ms": wait * 1e3,
                "sent_ms": (at - start) * 1e3, "end_ms": (received[bid] - start) * 1e3,
                "busy_ms": ev.busy_seconds * 1e3, "load_ms": ev.load_seconds * 1e3,
                "steps": ev.steps, "from": source, "kind": kind,
            })  # fmt: skip
            free = received[bid]
        idle["imbalance"] += last - free
        idle["close"] += max(0.0, end - last)
    return rows, idle


def handoffs(log: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    """(e): each batch that started from a checkpoint another worker wrote, after waiting
    for it (the root's hand-off): in ms, the checkpoint's step reported
    (``Progress`` received) -> its ``CheckpointSaved`` received (``write``; of which
    ``worker``: the capture and write the worker timed) -> the batch sent (``decision``)
    -> the batch started on its worker (``dispatch``: the instruction's way there) ->
    its load done (``load``)."""
    progress = dict(log["progress"])
    saved_at = dict(log["saved"])
    writer = {e.ref: e for e in log["saves"]}
    received = dict(log["received"])
    done = {e.batch_id: e for e in log["done"]}
    out: list[dict[str, Any]] = []
    for bid, worker, sent in log["sent"]:
        batch = next((b for b in log["batches"] if b.batch_id == bid), None)
        ref = batch.start_checkpoint if batch is not None else None
        w = writer.get(ref) if ref is not None else None
        if w is None or w.worker == worker or bid not in done or ref not in saved_at:
            continue
        if sent - saved_at[ref] > 0.5:  # not waited for: sent long after it was saved
            continue
        began = received[bid] - done[bid].busy_seconds
        reported = progress.get((w.batch_id, w.step))
        out.append({
            "batch": bid, "from": f"w{w.worker} b{w.batch_id} ({w.node}, {w.step})",
            "write_ms": (saved_at[ref] - reported) * 1e3 if reported is not None else None,
            "worker_ms": w.seconds * 1e3,
            "decision_ms": (sent - saved_at[ref]) * 1e3,
            "dispatch_ms": (began - sent) * 1e3,
            "load_ms": done[bid].load_seconds * 1e3,
        })  # fmt: skip
    return out


def ends_read_whole(log: Mapping[str, list[Any]]) -> tuple[int, int]:
    """(e): of the batches whose last step reported metrics, how many ends the driver
    read whole (that ``MetricsReported`` and the ``BatchDone`` in one read), and how
    many there were."""
    last = {b.batch_id: b.segments[-1].stop for b in log["batches"] if b.segments}
    metrics = {
        e.batch_id: read
        for e, read in log["ends"]
        if isinstance(e, MetricsReported) and last.get(e.batch_id) == e.step
    }
    ends = [(e.batch_id, read) for e, read in log["ends"] if isinstance(e, BatchDone)]
    pairs = [(metrics[bid], read) for bid, read in ends if bid in metrics]
    return sum(1 for m, d in pairs if m == d), len(pairs)


_TIMELINE_HEADERS = [
    "worker", "batch", "sent", "ended", "idle before", "of which: its checkpoint", "busy",
    "load", "steps", "start checkpoint from",
]  # fmt: skip


def timeline_report(row: Mapping[str, Any]) -> str:
    """The table of (e) for one run."""
    table = [
        [
            f"w{r['worker']}", r["batch"], r["sent_ms"], r["end_ms"], r["idle_ms"],
            r["ckpt_wait_ms"], r["busy_ms"], r["load_ms"], r["steps"], r["from"],
        ]
        for r in row["timeline"]
    ]  # fmt: skip
    idle = row["idle"]
    total = sum(idle.values())
    kinds: dict[str, list[float]] = {}
    for r in row["timeline"]:
        kinds.setdefault(r["kind"], []).append(r["load_ms"])
    loads = "; ".join(
        f"{kind}: {len(ms)}, median {median(ms) or 0.0:.2f} ms"
        for kind, ms in sorted(kinds.items())
    )
    return (
        f"\nTimeline of the last {row['mode']} run (ms from tune(); wall {row['wall']:.2f} s, "
        f"load {row['load']}):\n\n"
        + markdown_table(_TIMELINE_HEADERS, table)
        + f"\n\nidle worker-seconds by cause: total {total:.3f} = "
        + ", ".join(f"{k} {idle[k]:.3f}" for k in IDLE_CAUSES)
        + " (start: tune() -> the run's first batch; checkpoint: a batch's start "
        "checkpoint was still being written; decision: the rest of a gap before a batch; "
        "imbalance: a worker's last batch ended -> the run's last did; close: -> tune() "
        "returned)" + f"\n\nstart loads by the start checkpoint's writer: {loads} (its own: this "
        "worker wrote it; new: another worker did, read here first; read before: another "
        "worker did, read here by an earlier batch)" + _messages_report(row)
    )


_HANDOFF_HEADERS = [
    "batch", "start checkpoint", "write", "of which worker", "decision", "dispatch", "load",
]  # fmt: skip


def _messages_report(row: Mapping[str, Any]) -> str:
    """The hand-offs and the driver's reads of (e)."""
    table = [
        [h["batch"], h["from"], h["write_ms"], h["worker_ms"], h["decision_ms"],
         h["dispatch_ms"], h["load_ms"]]
        for h in row["handoffs"]
    ]  # fmt: skip
    whole, ends = row["ends_whole"]
    reads, events = row["reads"]
    return (
        "\n\nHand-offs (a batch that waited for another worker's checkpoint; ms: its "
        "step's Progress received -> CheckpointSaved received, of which the worker's "
        "capture + write; -> the batch sent; -> it started; its load):\n\n"
        + markdown_table(_HANDOFF_HEADERS, table)
        + f"\n\ndriver reads: {events} events in {reads} reads; batch ends read whole "
        f"(the last MetricsReported with its BatchDone): {whole} of {ends}"
    )


def run_study(
    share: bool, space: GridSpace, steps: int, workers: int, threads: int, root: Path
) -> tuple[dict[str, Any], list[RunBatch]]:
    """One measured study on a fresh storage under ``root``; returns its figures and the
    RunBatch instructions it issued."""
    url = f"sqlite:///{root / 'plan.db'}"
    ckdir = root / "checkpoints"
    log: dict[str, list[Any]] = {
        "batches": [], "saves": [], "done": [], "executor": [], "sent": [], "received": [],
        "saved": [], "progress": [], "reads": [], "ends": [],
    }  # fmt: skip

    def factory() -> LocalExecutor:
        return _RecordingExecutor(
            log, DigitsTrainer, num_workers=workers, checkpoint_dir=ckdir,
            threads_per_worker=threads,
        )  # fmt: skip

    opts: dict[str, Any] = {
        "storage": url, "workers": workers, "share": share, "checkpoint_dir": ckdir,
        "executor": factory, "threads_per_worker": threads,
    }  # fmt: skip
    begin = _perf()
    warm = Study("warm-up", DigitsTrainer, **opts)
    study: Study | None = None
    try:
        base = dict(space.trials()[0].config)

        async def warm_up() -> None:
            await asyncio.gather(
                *(warm.submit({**base, "seed": 1000 + i}, {"lr": 0.1}, 1) for i in range(workers))
            )

        asyncio.run(warm_up())
        startup = _perf() - begin
        warm.stats()  # waits for the warm-up batches to report their end
        for key in log:
            if key != "executor":
                log[key].clear()
        [executor] = log["executor"]
        cpu_before = cpu_seconds(executor)
        study = Study("share" if share else "no-share", DigitsTrainer, **opts)
        load = load_average()
        start, cpu_start = _perf(), time.process_time()
        best = study.tune(GridSearch(space, "accuracy", "max", steps=steps))
        wall = _perf() - start
        engine_cpu = time.process_time() - cpu_start
        stats = study.stats()
        cpu = cpu_seconds(executor) - cpu_before
    finally:
        if study is not None:
            study.close()
        warm.close()
    row: dict[str, Any] = {
        "mode": "share" if share else "no-share",
        "wall": wall,
        "startup": startup,
        "load": load,
        "steps_requested": stats["steps_requested"],
        "steps_unique": stats["steps_unique"],
        "merge_rate": stats["merge_rate"],
        "best_accuracy": best.metrics["accuracy"] if best is not None else None,
        "batches": len(log["batches"]),
        # The study's own accounting, from the executor's events (warm-up excluded).
        "steps_executed": sum(e.steps for e in log["done"]),
        "device_seconds": sum(e.busy_seconds for e in log["done"]),
        "ckpt_load_seconds": sum(e.load_seconds for e in log["done"]),
        "ckpt_saves": len(log["saves"]),
        "ckpt_save_seconds": sum(e.seconds for e in log["saves"]),
        "cpu_seconds": cpu,
        "engine_cpu": engine_cpu,
        # stagetree.reports.costs.efficiency of the run (None: none recorded)
        "efficiency": stats.get("efficiency"),
        "efficiency_line": efficiency_line(stats) or "not recorded",
        **batch_gaps(log),
    }
    row["timeline"], row["idle"] = timeline(log, start, start + wall)
    row["handoffs"] = handoffs(log)
    row["ends_whole"] = ends_read_whole(log)
    row["reads"] = (len(log["reads"]), sum(n for n, _ in log["reads"]))
    if stats["steps_executed"] != row["steps_executed"]:
        print(
            f"note: study.stats() says {stats['steps_executed']:.0f} steps executed, the "
            f"executor's events {row['steps_executed']}",
            file=sys.stderr,
        )
    return row, list(log["batches"])


# ---------------------------------------------------------------------- (c) A/B replay


def _wait_ready(ex: LocalExecutor, n: int, timeout: float = 300.0) -> None:
    ready: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(ready) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(ready)} of {n} workers started")
        for ev in ex.events(timeout=1.0):
            if isinstance(ev, WorkerReady):
                ready.add(ev.worker)


#: Replay variants: A as issued, M without the save at the batch's last step, B no saves.
VARIANTS = ("A", "M", "B")


def _variant(batch: RunBatch, variant: str) -> tuple[tuple[int, int], ...]:
    if variant == "A":
        return tuple(batch.checkpoint_at)
    if variant == "M":
        end = batch.segments[-1].stop
        return tuple(p for p in batch.checkpoint_at if p[1] != end)
    return ()


def _replay(
    ex: LocalExecutor,
    queues: Mapping[int, list[RunBatch]],
    rounds: int,
    ids: Iterator[int],
    store: CheckpointStore,
) -> list[dict[str, Any]]:
    """Run every batch of every worker's queue in each variant, back to back on the worker
    that ran it in the study (variant order rotated per batch and round), ``rounds`` times.

    Every job loads its start checkpoint (``start_at=None``: no reuse of the in-memory
    model), so the variants differ only in ``checkpoint_at``. Returns one record per job:
    ``index`` (the batch), ``round``, ``variant``, ``busy``, ``save_s``, ``saves``."""
    jobs: dict[int, list[tuple[int, int, str, RunBatch]]] = {}
    index = 0
    for w, queue in queues.items():
        for r in range(rounds):
            for i, b in enumerate(queue):
                k = (i + r) % len(VARIANTS)
                for v in VARIANTS[k:] + VARIANTS[:k]:
                    jobs.setdefault(w, []).append((index + i, r, v, b))
        index += len(queue)
    records: dict[int, dict[str, Any]] = {}
    refs: list[str] = []

    def send(w: int) -> None:
        i, r, v, b = jobs[w].pop(0)
        bid = next(ids)
        records[bid] = {"index": i, "round": r, "variant": v, "busy": 0.0, "save_s": 0.0,
                        "saves": 0}  # fmt: skip
        ex.submit(dataclasses.replace(b, batch_id=bid, start_at=None, checkpoint_at=_variant(b, v)))

    running = 0
    for w in jobs:
        send(w)
        running += 1
    last = _perf()
    while running:
        events = ex.events(timeout=60.0)
        if events:
            last = _perf()
        elif _perf() - last > 600:
            raise TimeoutError("replay made no progress for 10 minutes")
        for ev in events:
            if isinstance(ev, BatchDone):
                records[ev.batch_id]["busy"] = ev.busy_seconds
                if jobs[ev.worker]:
                    send(ev.worker)
                else:
                    running -= 1
            elif isinstance(ev, CheckpointSaved):
                records[ev.batch_id]["save_s"] += ev.seconds
                records[ev.batch_id]["saves"] += 1
                refs.append(ev.ref)
                if len(refs) > 64:  # keep the disk use small
                    for ref in refs:
                        store.delete(ref)
                    refs.clear()
            elif isinstance(ev, (BatchFailed, WorkerLost)):
                raise RuntimeError(f"replay failed: {ev!r}")
    for ref in refs:
        store.delete(ref)
    return list(records.values())


def checkpoint_critical_path(
    batches: list[RunBatch], ckdir: Path, workers: int, threads: int, rounds: int
) -> dict[str, Any]:
    """The paired replay of (c); see the module docstring."""
    queues: dict[int, list[RunBatch]] = {}
    for b in batches:
        queues.setdefault(b.worker, []).append(b)
    ids = itertools.count(10**6)
    store = CheckpointStore(ckdir)
    ex = LocalExecutor(
        DigitsTrainer, num_workers=workers, checkpoint_dir=ckdir, threads_per_worker=threads
    )
    ex.start()
    try:
        _wait_ready(ex, workers)
        first = {w: q[:1] for w, q in queues.items()}
        _replay(ex, first, 1, ids, store)  # warm-up: imports, first trainer build
        records = _replay(ex, queues, rounds, ids, store)
    finally:
        ex.close()
    by: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for rec in records:
        by.setdefault((rec["index"], rec["round"]), {})[rec["variant"]] = rec

    def total(variant: str, key: str, rnd: int | None = None) -> float:
        return sum(float(v[variant][key]) for (_, r), v in by.items() if rnd is None or r == rnd)

    def ratio(num: float, den: float) -> float | None:
        return num / den if den > 0 else None

    busy = {v: total(v, "busy") for v in VARIANTS}
    save = {v: total(v, "save_s") for v in VARIANTS}
    per_round = [
        ratio(total("A", "busy", r) - total("B", "busy", r), total("A", "save_s", r))
        for r in range(rounds)
    ]
    # Robust to load bursts of other programs (they only add time): per batch and variant
    # the fastest of the rounds, then the same sums.
    fastest: dict[str, float] = {v: 0.0 for v in VARIANTS}
    for i in {i for i, _ in by}:
        for v in VARIANTS:
            fastest[v] += min(float(by[(i, r)][v]["busy"]) for r in range(rounds))
    return {
        "rounds": rounds,
        "batches": len(batches),
        "saves": {v: total(v, "saves") / rounds for v in VARIANTS},
        "busy": {v: busy[v] / rounds for v in VARIANTS},
        "busy_fastest": fastest,
        "save_s": {v: save[v] / rounds for v in VARIANTS},
        "fraction": ratio(fastest["A"] - fastest["B"], save["A"] / rounds),
        "fraction_mid": ratio(fastest["M"] - fastest["B"], save["M"] / rounds),
        "fraction_last": ratio(fastest["A"] - fastest["M"], (save["A"] - save["M"]) / rounds),
        "fraction_mean": ratio(busy["A"] - busy["B"], save["A"]),
        "fraction_rounds": per_round,
    }


# ---------------------------------------------------------------------- (d) loads


def start_loads(rounds: int, threads: int, batches_per_step: int) -> dict[str, Any]:
    """(d): the paired start-checkpoint loads; see the module docstring."""
    import torch

    torch.set_num_threads(threads)
    space, _ = lr_space(False, batches_per_step)
    config = dict(space.trials()[0].config)
    hp = {"lr": Constant(0.1)}
    events: list[Any] = []
    out: dict[str, list[tuple[float, float]]] = {"kept": [], "file": []}
    # What a file load costs beside reading its bytes: read alone, read + verify +
    # decode (CheckpointStore.load), and the trainer's build (built to be restored).
    parts: dict[str, list[float]] = {"read": [], "store_load": [], "build": []}
    with tempfile.TemporaryDirectory(prefix="stagetree-loads-") as tmp:
        store = CheckpointStore(tmp)
        kept = Worker(0, DigitsTrainer, store, events.append)
        bare = Worker(1, DigitsTrainer, store, events.append, keep_bytes=0)
        first = RunBatch(1, 0, "r", config, 0, None, None, (Segment(1, 0, 1, hp),), (), ((1, 1),))
        kept.run(first)
        kept.flush()
        ref = next(e.ref for e in events if isinstance(e, CheckpointSaved))
        batch = RunBatch(2, 0, "r", config, 1, (1, 1), ref, (Segment(2, 1, 2, hp),), (), ())
        for i in range(rounds + 1):  # the first round warms both up
            pair = [("kept", kept), ("file", bare)]
            for name, worker in pair if i % 2 else pair[::-1]:
                events.clear()
                worker.run(batch)
                done = next(e for e in events if isinstance(e, BatchDone))
                if i:
                    out[name].append((done.load_seconds, done.busy_seconds - done.load_seconds))
            if i:
                for part, call in (
                    ("read", lambda: store.bytes.get(ref)),
                    ("store_load", lambda: store.load(ref)),
                    ("build", lambda: _build_to_restore(config)),
                ):
                    began = _perf()
                    call()
                    parts[part].append(_perf() - began)
        kept_loads = kept.stats.kept_loads
        kept.close()
        bare.close()
    return {
        "rounds": rounds,
        "kept_loads": kept_loads,
        **{f"{k}_load": median(x[0] for x in v) for k, v in out.items()},
        **{f"{k}_step": median(x[1] for x in v) for k, v in out.items()},
        **{f"{k}_ms": (median(v) or 0.0) * 1e3 for k, v in parts.items()},
    }


def _build_to_restore(config: Mapping[str, Any]) -> None:
    """Build the trainer as a worker does before a load (in full where this checkout of
    stagetree has no ``built_to_restore``)."""
    with getattr(stagetree.trainer, "built_to_restore", contextlib.nullcontext)():
        DigitsTrainer(config)


def loads_report(loads: dict[str, Any]) -> str:
    """The table of (d)."""
    rows = [
        [side, loads[f"{key}_load"] * 1e3, loads[f"{key}_step"] * 1e3]
        for side, key in (("kept in the worker's memory", "kept"), ("read from the file", "file"))
    ]
    ratio = loads["file_load"] / loads["kept_load"] if loads["kept_load"] else None
    return (
        f"\nStart-checkpoint loads, {loads['rounds']} paired rounds (medians; "
        f"{loads['kept_loads']} kept loads):\n\n"
        + markdown_table(["start from", "load ms", "first step ms"], rows)
        + f"\n\nload from the file / from the kept copy: {fmt(ratio)}"
        + f"\n\nparts of a file load (medians, ms): reading its bytes {loads['read_ms']:.2f}, "
        f"read + verify + decode (CheckpointStore.load) {loads['store_load_ms']:.2f}, "
        f"the trainer's build before a load {loads['build_ms']:.2f}"
    )


# ---------------------------------------------------------------------- report


def _goal_line(ratio: float | None, merge: float | None) -> str:
    if ratio is None or merge is None:
        return "goal: not measured"
    target = 0.97 * merge
    verdict = "met" if ratio >= target else f"missed by {(1 - ratio / target) * 100:.0f}%"
    return (
        f"device-seconds ratio no-share/share = {ratio:.2f}; goal >= 0.97 x merge rate "
        f"= {target:.2f}: {verdict}"
    )


def report(rows: list[dict[str, Any]], ckpt: dict[str, Any] | None, args: Any) -> str:
    out: list[str] = []
    info = machine_info()
    out.append(
        f"Machine: {info['nproc']} cores, {info['cpu']}; torch {info.get('torch')}, "
        f"python {info['python']}; {info['date']}; load at the end {info['load']}"
    )
    out.append(
        f"Setup: {args.workers} worker processes x {args.threads} torch thread, "
        f"batches_per_step={args.batches_per_step}, fresh SQLite storage per run, "
        f"{args.repeats} repeat(s)\n"
    )
    headers = [
        "run", "mode", "wall s", "start-up s", "device-s", "worker CPU-s", "engine CPU-s",
        "steps executed", "steps requested", "unique", "merge rate", "batches", "ckpt saves",
        "ckpt save s", "ckpt load s", "gap ms/batch (decision + round trip)", "best acc",
        "load 1m",
    ]  # fmt: skip
    table = []
    for i, r in enumerate(rows):
        table.append([
            i // 2 + 1, r["mode"], r["wall"], r["startup"], r["device_seconds"],
            r["cpu_seconds"], r["engine_cpu"], int(r["steps_executed"]),
            int(r["steps_requested"]),
            int(r["steps_unique"]), r["merge_rate"], r["batches"], r["ckpt_saves"],
            r["ckpt_save_seconds"], r["ckpt_load_seconds"],
            f"{r['gap_ms']:.1f} ({r['decision_ms']:.1f} + {r['round_trip_ms']:.1f})",
            fmt(r["best_accuracy"], 4), r["load"],
        ])  # fmt: skip
    out.append("Per run:\n")
    out.append(markdown_table(headers, table))
    out.append(
        "\nEfficiency per run (study.stats(): unique steps x median s per step trained "
        "alone / workers / wall-clock; the rest of the wall-clock):\n"
    )
    for i, r in enumerate(rows):
        out.append(f"- run {i // 2 + 1} {r['mode']}: {r['efficiency_line']}")
    out.append("")
    for mode in ("share", "no-share"):
        eff = median(r["efficiency"] for r in rows if r["mode"] == mode)
        out.append(f"median efficiency {mode}: {fmt(eff)}")
    summary = []
    med: dict[str, dict[str, float | None]] = {}
    keys = ("wall", "startup", "device_seconds", "cpu_seconds", "steps_executed", "merge_rate")
    for mode in ("share", "no-share"):
        rs = [r for r in rows if r["mode"] == mode]
        med[mode] = {k: median(r[k] for r in rs) for k in keys}
        summary.append([mode, *(med[mode][k] for k in keys)])
    out.append("\nMedians:\n")
    out.append(
        markdown_table(
            [
                "mode",
                "wall s",
                "start-up s",
                "device-s",
                "worker CPU-s",
                "steps executed",
                "merge rate",
            ],
            summary,
        )
    )
    pairs = list(zip(rows[0::2], rows[1::2]))

    def ratios(key: str) -> list[float]:
        return [n[key] / s[key] for s, n in pairs if s[key] > 0]

    out.append("")
    for label, key in (
        ("device-seconds", "device_seconds"),
        ("worker CPU-seconds", "cpu_seconds"),
        ("wall-clock", "wall"),
    ):
        rr = ratios(key)
        out.append(
            f"{label} ratio no-share/share: median {fmt(median(rr))} "
            f"(per repeat: {', '.join(f'{x:.2f}' for x in rr)})"
        )
    out.append(_goal_line(median(ratios("device_seconds")), med["share"]["merge_rate"]))
    if ckpt is not None:
        share_rows = [r for r in rows if r["mode"] == "share"]
        study_save = share_rows[-1]["ckpt_save_seconds"]
        study_dev = share_rows[-1]["device_seconds"]
        frac = ckpt["fraction"]
        crit = (frac or 0.0) * study_save
        out.append(
            f"\nCheckpoint saves on the critical path: paired replay of the last share run's "
            f"{ckpt['batches']} batches, {ckpt['rounds']} rounds (figures per round):\n"
        )
        labels = {
            "A": "A: as issued",
            "M": "M: no save at a batch's last step",
            "B": "B: no saves",
        }
        out.append(
            markdown_table(
                ["variant", "busy s (mean)", "busy s (fastest)", "saves", "save s (capture+write)"],
                [
                    [
                        labels[v],
                        ckpt["busy"][v],
                        ckpt["busy_fastest"][v],
                        int(ckpt["saves"][v]),
                        ckpt["save_s"][v],
                    ]
                    for v in VARIANTS
                ],
            )
        )
        rounds = ", ".join(fmt(f) for f in ckpt["fraction_rounds"])
        out.append(
            f"\ncritical-path fraction of save time (fastest of the rounds per batch): all "
            f"saves (A-B)/save_A = {fmt(frac)}; saves inside a batch (M-B)/save_M = "
            f"{fmt(ckpt['fraction_mid'])}; the save at a batch's last step, which the worker "
            f"waits for before BatchDone, (A-M)/(save_A-save_M) = "
            f"{fmt(ckpt['fraction_last'])}. From the means instead: (A-B)/save_A = "
            f"{fmt(ckpt['fraction_mean'])} (per round: {rounds})."
        )
        out.append(
            f"In the study: ckpt_save_seconds = {study_save:.2f} s of {study_dev:.2f} "
            f"device-s ({(study_save / study_dev * 100) if study_dev else 0:.1f}%); on the "
            f"critical path about {crit:.2f} s "
            f"({(crit / study_dev * 100) if study_dev else 0:.1f}% of device-seconds)."
        )
    return "\n".join(out)


def plot(path: str, rows: list[dict[str, Any]], ckpt: dict[str, Any] | None) -> None:
    modes = ["share", "no-share"]

    def med(mode: str, key: str) -> float:
        return median(r[key] for r in rows if r["mode"] == mode) or 0.0

    panels: list[tuple[str, list[str], list[float], str]] = [
        ("wall-clock (warm workers)", modes, [med(m, "wall") for m in modes], "s"),
        ("device-seconds", modes, [med(m, "device_seconds") for m in modes], "s"),
        ("worker CPU-seconds", modes, [med(m, "cpu_seconds") for m in modes], "s"),
        ("steps executed", modes, [med(m, "steps_executed") for m in modes], "steps"),
    ]
    if ckpt is not None:
        share_save = [r for r in rows if r["mode"] == "share"][-1]["ckpt_save_seconds"]
        panels.append((
            "checkpoint saves (share run)",
            ["save s", "on critical path"],
            [share_save, max(0.0, ckpt["fraction"] or 0.0) * share_save],
            "s",
        ))  # fmt: skip
    merge = med("share", "merge_rate")
    bar_plot(path, panels, f"digits, 2 workers: sharing on/off (merge rate {merge:.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 trials, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="replay rounds (default 3, quick 1)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--batches-per-step", type=int, default=21)
    parser.add_argument("--no-replay", action="store_true", help="skip the (c) replay")
    parser.add_argument(
        "--loads", type=int, default=0, help="(d): paired start-checkpoint loads, N rounds"
    )
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument(
        "--timeline", action="store_true", help="(e): the last share run's timeline"
    )
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    rounds = args.rounds or (1 if args.quick else 3)
    space, steps = lr_space(args.quick, args.batches_per_step)
    print(f"{len(space)} trials x {steps} steps, {args.repeats} repeat(s)", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    ckpt: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="stagetree-study-bench-") as tmp:
        last_share: tuple[list[RunBatch], Path] | None = None
        for rep in range(args.repeats):
            for share in (True, False):
                root = Path(tmp) / f"r{rep}-{'share' if share else 'noshare'}"
                root.mkdir()
                row, batches = run_study(share, space, steps, args.workers, args.threads, root)
                rows.append(row)
                print(
                    f"repeat {rep + 1} {row['mode']}: wall {row['wall']:.1f} s, "
                    f"device {row['device_seconds']:.1f} s, efficiency {row['efficiency_line']}, "
                    f"gap {row['gap_ms']:.1f} ms/batch (decision {row['decision_ms']:.1f} + "
                    f"round trip {row['round_trip_ms']:.1f})",
                    file=sys.stderr,
                )
                if share:
                    last_share = (batches, root / "checkpoints")
        if not args.no_replay and last_share is not None:
            ckpt = checkpoint_critical_path(
                last_share[0], last_share[1], args.workers, args.threads, rounds
            )
    if rows:
        print(report(rows, ckpt, args))
        if args.timeline:
            print(timeline_report([r for r in rows if r["mode"] == "share"][-1]))
        if args.plot:
            write_plot(args.plot, plot, rows, ckpt)
    if args.loads:
        print(loads_report(start_loads(args.loads, args.threads, args.batches_per_step)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
