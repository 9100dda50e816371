"""stagetree against Ray Tune and Optuna on the digits study of ``examples/digits.py``.

The search space, tuner settings and trainer are taken from the example itself (it is
loaded with ``STAGETREE_STORAGE=memory://`` so that loading it touches no file): its grid
of learning-rate, batch-size and momentum sequences (``num_trials = len(space)``, 16
trials today), ASHA with ``eta=4``, ``min_steps=1``, ``max_steps=16`` (rungs 1, 4, 16),
on ``DigitsTrainer`` (one step = 8 minibatches of 64).
Runners:

* ``stagetree``: ``Study(share=True)``, the example's ``ASHA`` (Algorithm 2 of the ASHA
  paper: promotions resume the trial from its checkpoint), 2 worker processes x 1 torch
  thread, a fresh SQLite storage.
* ``stagetree-noshare``: the same with ``share=False`` (every trial trained alone from
  step 0; promotions still resume).
* ``ray``: Ray Tune, ``ASHAScheduler(time_attr="training_iteration", grace_period=1,
  reduction_factor=4, max_t=16, brackets=1)`` (Ray's stop-only ASHA), ``reuse_actors=True``,
  ``ray.init(num_cpus=2)`` (2 trials at a time, 1 CPU and 1 torch thread each), results
  in a temporary directory, no checkpoints. A class trainable builds the same trainer,
  and each step calls ``setup`` with every sequence's value at that step, ``train()``
  and ``evaluate()``, and reports the accuracy. The trials are the example's grid in
  the order stagetree's ASHA draws them (shuffled by the tuner's seed).
* ``optuna``: ``SuccessiveHalvingPruner(min_resource=1, reduction_factor=4,
  min_early_stopping_rate=0)``, ``GridSampler`` over the same options (one categorical per
  sequence name, seeded), the same number of trials, sequential (one process, 1 torch
  thread: 2 threads were slower for this small model on the 2-core machine), in-memory
  storage; the objective reports the accuracy after every step and stops when pruned.

``--study race-grid`` / ``--study race-sha``: a race where training dominates. 36 trials
of a small CNN (``DigitsConvTrainer``, 32 channels, BatchNorm, SGD with momentum) on the
digits, with Hippo-style schedules (:func:`race_space`: 6 learning-rate schedules with
step decays at different epochs, warm-ups, cosine and exponential tails, x 3 batch-size
schedules 64 -> 128 at different epochs, x 2 momentum schedules), 32 epochs each (quick:
16). One step is one epoch: ``_common.EpochConvTrainer`` trains one pass over the 1348
training samples at the step's batch size (22 minibatches at 64, 11 at 128). The trials
share long prefixes (merge rate of the grid 2.72; quick 2.76). ``race-grid``:
``GridSearch`` to 32 epochs (Ray: no scheduler; Optuna: ``GridSampler``, no pruner).
``race-sha``: ``SHA(eta=3, min_steps=epochs/8)`` (rungs 4, 12, 32; Ray: ``ASHAScheduler``
with the same grace period, factor and ``max_t``; Optuna: ``SuccessiveHalvingPruner``).
Optuna runs 2 trials at a time in 2 processes of this script sharing one journal-file
storage (1 torch thread each; ``--optuna-jobs`` changes the count): with ``n_jobs=2``
threads, trials share torch's global RNG, and 21 of 432 compared accuracies differed
from the other systems' (by up to 0.29) in a trial run. Every runner's accuracy is
compared with stagetree's at the check steps (the rungs, or a quarter, half, three
quarters and all of the epochs). For stagetree the run also reports its efficiency:
unique steps x the median seconds of one step (setup + train + evaluate) trained alone
in the child just before the run (per batch size), / 2 workers, / the wall-clock; and,
from the activity log, the seconds to the first batch, the batches' busy seconds and the
seconds after the last batch; and a breakdown of its wall-clock (start-up, loads, saves,
training, evaluation, idle, scheduling: :func:`breakdown`) with how its batches started
(fresh, from a loaded checkpoint, continuing the worker's model: :func:`load_counts`),
and what its workers were forked from (:func:`fork_server`: a fresh fork server imports
torch before the first worker starts).

Measured per run: wall-clock from before the framework starts (``Study(...)``,
``ray.init``, ``optuna.create_study``) until it has shut down (imports excluded, the same
for all), training steps executed (``train()`` calls counted by a subclass of the trainer
in every process, see ``_common.CountingDigitsTrainer``), and the best validation accuracy
among trials trained to ``max_steps``. Each (runner, repeat) runs in its own Python
process with a time limit, so a failing or hanging peer cannot stop the others; a peer
that cannot be imported is skipped with a message. Medians over ``--repeats`` are
reported; the runners' order rotates between repeats.

Run::

    .venv/bin/python benchmarks/vs_peers.py --repeats 3 --plot vs_peers.png   # ~4 min
    .venv/bin/python benchmarks/vs_peers.py --quick                          # ~1 min
    .venv/bin/python benchmarks/vs_peers.py --runners stagetree,optuna
    .venv/bin/python benchmarks/vs_peers.py --study race-grid --repeats 3     # ~11 min
    .venv/bin/python benchmarks/vs_peers.py --study race-sha --repeats 3      # ~7 min
    .venv/bin/python benchmarks/vs_peers.py --study race-grid --quick         # ~2.5 min
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import (
    COUNTER_ENV,
    bar_plot,
    count_steps,
    fmt,
    load_average,
    machine_info,
    markdown_table,
    median,
    write_plot,
)

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "digits.py"
RUNNERS = ("stagetree", "stagetree-noshare", "ray", "optuna")
STUDIES = ("digits-asha", "race-grid", "race-sha")
_perf = time.perf_counter


# ---------------------------------------------------------------------- the example


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def load_example() -> ModuleType:
    """``examples/digits.py`` loaded as a module, its own study closed (in memory)."""
    spec = importlib.util.spec_from_file_location("_digits_example", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    with _env("STAGETREE_STORAGE", "memory://"):
        spec.loader.exec_module(module)
    module.study.close()
    return module


def settings(quick: bool, study: str = "digits-asha") -> dict[str, Any]:
    """The study's search space, tuner and trainer settings (see :data:`STUDIES`)."""
    if study != "digits-asha":
        return race_settings(quick, study)
    ex = load_example()
    tuner = ex.tuner
    return {
        "study": study,
        "tuner": "asha",
        "trainer": "CountingDigitsTrainer",
        "space": ex.space,
        "min_steps": tuner.min_steps,
        "max_steps": tuner.max_steps,
        "eta": tuner.eta,
        "num_trials": min(8, tuner.num_trials) if quick else tuner.num_trials,
        "seed": tuner.seed,
        "max_rungs": tuner.max_rungs,
        "levels": list(tuner.levels),
    }


def race_space(epochs: int) -> Any:
    """The race's Hippo-style grid: 6 learning-rate schedules (step decays at different
    epochs, warm-ups, cosine, exponential) x 3 batch-size schedules (64; 64 then 128 from
    half-way; 64 then 128 from three quarters) x 2 momentum schedules (0.9; 0.9 then 0.8
    from three quarters): 36 trials of ``epochs`` epochs sharing long prefixes."""
    from stagetree.hp import Constant, Cosine, Exponential, MultiStep, Piecewise, Warmup
    from stagetree.space import GridSpace

    t = epochs
    half, late, w = t // 2, 3 * t // 4, max(1, t // 8)
    return GridSpace(
        hp={
            "lr": [
                MultiStep(0.1, [half, late], 0.1),  # x0.1 at 1/2 and 3/4
                MultiStep(0.1, [5 * t // 8, 7 * t // 8], 0.1),  # x0.1 at 5/8 and 7/8
                Constant(0.1).then(Cosine(0.1, t - half), at=half),  # flat, then cosine
                Constant(0.1).then(Exponential(0.1, 0.85), at=half),  # flat, then x0.85
                # a warm-up from 0.02, then x0.1 at 3/8 and 5/8
                Warmup(w, 0.1, 0.02).then(MultiStep(0.1, [3 * t // 8, 5 * t // 8], 0.1), at=w),
                Warmup(w, 0.1, 0.02).then(Cosine(0.1, t - w), at=w),  # a warm-up, then cosine
            ],
            "batch_size": [64, Piecewise([64, 128], [half]), Piecewise([64, 128], [late])],
            "momentum": [0.9, Piecewise([0.9, 0.8], [late])],
        },
        fixed={"optimizer": ["momentum"], "channels": [32], "seed": [0]},
    )


def race_settings(quick: bool, study: str) -> dict[str, Any]:
    """The race (``race-grid``: GridSearch; ``race-sha``: SHA, eta=3, from epoch
    ``epochs/8``): 36 trials of :class:`_common.EpochConvTrainer` (one step = one epoch),
    32 epochs each (quick: 16)."""
    from stagetree.tuners.base import rung_levels

    epochs = 16 if quick else 32
    space = race_space(epochs)
    grid = study == "race-grid"
    min_steps = epochs if grid else epochs // 8
    eta = 3
    return {
        "study": study,
        "tuner": "grid" if grid else "sha",
        "trainer": "EpochConvTrainer",
        "space": space,
        "min_steps": min_steps,
        "max_steps": epochs,
        "eta": eta,
        "num_trials": len(space),
        "seed": 0,
        "max_rungs": None,
        "levels": [epochs] if grid else rung_levels(min_steps, epochs, eta),
        "checks": sorted({epochs // 4, epochs // 2, 3 * epochs // 4, epochs})
        if grid
        else rung_levels(min_steps, epochs, eta),
    }


def trainer_class(s: dict[str, Any]) -> Any:
    """The (counting) trainer class the study trains, from ``_common``."""
    import _common

    return getattr(_common, s["trainer"])


def trial_specs(s: dict[str, Any]) -> list[Any]:
    """The trials in the order stagetree's tuner starts them (ASHA and SHA: shuffled by
    the seed; GridSearch: the grid's order)."""
    from stagetree.tuners.base import draw_specs

    if s["tuner"] == "grid":
        return draw_specs(s["space"], None, s["seed"])
    return draw_specs(s["space"], s["num_trials"], s["seed"], shuffle_grid=True)


def trial_key(config: dict[str, Any], hp: dict[str, Any]) -> str:
    """A trial's identity across runners: canonical JSON of config and sequences."""
    from stagetree.hp import dumps_hp
    from stagetree.space import canonical_json

    return canonical_json(config) + "|" + dumps_hp(hp)


def hp_at(hp: dict[str, Any], t: int) -> dict[str, Any]:
    """Every sequence's value at step ``t``."""
    return {name: seq(t) for name, seq in hp.items()}


# ---------------------------------------------------------------------- runners (child)


def make_tuner(s: dict[str, Any]) -> Any:
    """stagetree's tuner for the study: the example's ASHA, GridSearch or SHA."""
    from stagetree.tuners import ASHA, SHA, GridSearch

    common = {"metric": "accuracy", "mode": "max", "seed": s["seed"]}
    if s["tuner"] == "grid":
        return GridSearch(s["space"], steps=s["max_steps"], **common)
    halving = {k: s[k] for k in ("min_steps", "max_steps", "eta", "num_trials")}
    if s["tuner"] == "sha":
        return SHA(s["space"], **halving, **common)
    return ASHA(s["space"], **halving, max_rungs=s["max_rungs"], **common)


def checks(s: dict[str, Any]) -> list[int]:
    """Steps at which every runner's accuracies are compared (the rungs, or for the grid
    race a quarter, half, three quarters and all of the epochs)."""
    return list(s.get("checks", s["levels"]))


def step_seconds_alone(s: dict[str, Any], threads: int, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one step (``setup`` + ``train`` + ``evaluate``) of the study's
    trainer trained alone in this process, per batch size the space uses (after one
    warm-up step each); call it before the step counter is set."""
    import torch

    torch.set_num_threads(threads)
    spec = next(iter(s["space"].trials()))
    sizes = sorted(
        {
            int(sp.hp["batch_size"](t))
            for sp in s["space"].trials()
            if "batch_size" in sp.hp
            for t in range(s["max_steps"])
        }
    )
    trainer = trainer_class(s)(spec.config)
    out: dict[int, float] = {}
    for size in sizes or [0]:
        hp = hp_at(spec.hp, 0)
        if size:
            hp["batch_size"] = size
        times = []
        for _ in range(repeats + 1):
            begin = _perf()
            trainer.setup(hp)
            trainer.train()
            trainer.evaluate()
            times.append(_perf() - begin)
        out[size] = float(median(times[1:]) or 0.0)
    return out


def eval_seconds_alone(s: dict[str, Any], threads: int, repeats: int = 20) -> float:
    """Median seconds of one evaluation of the study's trainer as a worker makes it
    (``evaluate_metrics``: ``evaluate()`` with what a trainer wraps around it, e.g.
    TorchTrainer's RNG and mode keeping), after a warm-up; before the step counter is set."""
    import torch

    from stagetree.executors.worker import evaluate_metrics

    torch.set_num_threads(threads)
    spec = next(iter(s["space"].trials()))
    trainer = trainer_class(s)(spec.config)
    trainer.setup(hp_at(spec.hp, 0))
    trainer.train()
    times = []
    for _ in range(repeats + 1):
        begin = _perf()
        evaluate_metrics(trainer)
        times.append(_perf() - begin)
    return float(median(times[1:]) or 0.0)


def unique_steps(paths: list[tuple[dict[str, Any], dict[str, Any], int]]) -> dict[int, int]:
    """Steps of the union of the trials' paths (``(config, hp, steps trained)``), counted
    per batch size (0 when the space has none): what sharing leaves to train."""
    from stagetree.space import canonical_json

    seen: set[tuple[Any, ...]] = set()
    counts: dict[int, int] = {}
    for config, hp, steps in paths:
        prefix: tuple[Any, ...] = (canonical_json(config),)
        for t in range(steps):
            values = hp_at(hp, t)
            prefix = (prefix, repr(sorted(values.items())))
            if prefix not in seen:
                seen.add(prefix)
                size = int(values.get("batch_size", 0))
                counts[size] = counts.get(size, 0) + 1
    return counts


def run_stagetree(s: dict[str, Any], tmp: Path, share: bool, threads: int) -> dict[str, Any]:
    from stagetree import Study

    alone = step_seconds_alone(s, threads)
    evaluation = eval_seconds_alone(s, threads)
    os.environ[COUNTER_ENV] = str(tmp / "train_calls")
    tuner = make_tuner(s)
    begin, begin_clock = _perf(), time.time()
    study = Study(
        s["study"],
        trainer_class(s),
        storage=f"sqlite:///{tmp / 'plan.db'}",
        workers=2,
        share=share,
        threads_per_worker=threads,
    )
    try:
        study.tune(tuner)
        tuned = _perf() - begin
        server = fork_server()
        stats = study.stats()
        trials = study.trials()
    finally:
        study.close()
    wall = _perf() - begin
    phases = {"tune": tuned, "close": wall - tuned, **activity_phases(tmp, begin_clock, wall)}
    parts = breakdown(stats, evaluation, wall) if share else {}
    parts.update(load_counts(tmp) if share else {})
    top = s["max_steps"]
    finals = {
        trial_key(t.config, t.hp): t.metrics[top]["accuracy"] for t in trials if top in t.metrics
    }
    curves = {
        trial_key(t.config, t.hp): {
            str(c): t.metrics[c]["accuracy"] for c in checks(s) if c in t.metrics
        }
        for t in trials
    }
    # Efficiency limit: the unique steps at their trained-alone time, on 2 workers.
    paths = [(t.config, t.hp, max(t.metrics, default=0)) for t in trials]
    unique = unique_steps(paths) if share else {}
    busy = sum(n * alone.get(size, alone.get(0, 0.0)) for size, n in unique.items())
    return {
        "wall": wall,
        "phases": phases,
        "finals": finals,
        "curves": curves,
        "best_accuracy": max(finals.values(), default=None),
        "trials": len(trials),
        "trials_full": len(finals),
        "steps_reported": stats["steps_executed"],
        "steps_unique": sum(unique.values()) if share else None,
        "steps_requested": stats.get("steps_requested"),
        "step_alone": {str(k): v for k, v in alone.items()},
        "efficiency": (busy / 2 / wall) if share and wall else None,
        "device_seconds": stats["device_seconds"],
        "merge_rate": stats["merge_rate"],
        "breakdown": parts,
        "eval_alone": evaluation,
        "server": server,
    }


def fork_server() -> str:
    """What this process's workers were forked from: a fork of this process (no import
    of torch before the first worker), or a fresh interpreter and why (seconds of
    start-up: a thread this process started, e.g. torch's pool)."""
    from stagetree.executors import _driverfork

    if _driverfork.server_pid() is not None:
        return "a fork of the driver"
    return f"a fresh interpreter ({_driverfork.refusal() or 'not asked to fork'})"


def breakdown(stats: dict[str, Any], evaluation: float, wall: float) -> dict[str, float]:
    """Where the run's wall-clock went, in seconds that add up to it (each part over the
    2 workers, from :meth:`Study.stats`' efficiency figures): ``start-up`` (until the
    first step trained), ``loads`` (start-checkpoint loads and trainer builds that
    training waited for after that), ``saves`` (waits for checkpoint writes),
    ``training`` and ``evaluation`` (the unique steps at the median step rate, split by
    one evaluation's time alone, every step evaluated), ``idle``, ``scheduling`` (the
    rest: dispatch, steps slower than the median...), ``close`` (the bench's wall-clock
    beyond the run's: building the study, closing it); and two totals over both
    workers: ``load+build worker-s`` (every batch's start: checkpoint loads, and the
    trainer builds of batches that start a fresh model, a cold worker's first one
    included) and ``save worker-s`` (background checkpoint writes)."""
    if "limit_seconds" not in stats:
        return {}
    workers = max(float(stats.get("workers") or 2), 1.0)
    unique = float(stats.get("steps_unique_trained") or 0)
    evals = min(unique * evaluation / workers, float(stats["limit_seconds"]))
    return {
        "start-up": stats["startup_seconds"],
        "loads": stats["ckpt_load_wait_seconds"],
        "saves": stats["ckpt_save_wait_seconds"],
        "training": stats["limit_seconds"] - evals,
        "evaluation": evals,
        "idle": stats["idle_seconds"],
        "scheduling": stats["scheduling_seconds"],
        "close": wall - stats["wall_seconds"],
        "load+build worker-s": stats.get("ckpt_load_seconds", 0.0),
        "save worker-s": stats.get("ckpt_save_seconds", 0.0),
    }


def activity_records(tmp: Path) -> list[Any] | None:
    """The run's activity records, None when the log cannot be read."""
    from stagetree.plan import open_storage

    try:
        storage = open_storage(f"sqlite:///{tmp / 'plan.db'}")
        try:
            return list(storage.activity())
        finally:
            storage.close()
    except Exception:  # informative only
        return None


def load_counts(tmp: Path) -> dict[str, float]:
    """How the run's batches started, from the activity log: ``fresh`` (a new model,
    step 0), ``loaded`` (from a start checkpoint), ``continued`` (the worker's model in
    memory, no load), and the load seconds of the loaded ones (empty when the log
    cannot be read)."""
    records = activity_records(tmp)
    if records is None:
        return {}
    starts = {(r.owner, r.batch): r for r in records if r.kind == "start"}
    fresh = loaded = continued = 0
    seconds = 0.0
    for r in records:
        if r.kind != "done" or (r.owner, r.batch) not in starts:
            continue
        load = float((r.data or {}).get("load_seconds") or 0.0)
        if int((starts[(r.owner, r.batch)].data or {}).get("start_step") or 0) == 0:
            fresh += 1
        elif load > 0:
            loaded += 1
            seconds += load
        else:
            continued += 1
    return {
        "batches fresh": float(fresh),
        "batches loaded": float(loaded),
        "batches continued": float(continued),
        "load s (loaded batches)": seconds,
    }


def activity_phases(tmp: Path, begin: float, wall: float) -> dict[str, float]:
    """Where stagetree's wall-clock went, from the workers' activity log: seconds until
    the first batch started, the batches' busy seconds over both workers, and seconds
    after the last batch ended (empty when the log cannot be read)."""
    records = activity_records(tmp)
    if records is None:
        return {}
    starts = [r.time for r in records if r.kind == "start"]
    ends = [r for r in records if r.kind == "done"]
    if not starts or not ends:
        return {}
    return {
        "to first batch": min(starts) - begin,
        "batches": float(len(ends)),
        "batch busy (2 workers)": sum(r.seconds for r in ends),
        "after last batch": begin + wall - max(r.time for r in ends),
    }


def run_ray(s: dict[str, Any], tmp: Path, threads: int) -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report: no network
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    specs = trial_specs(s)
    bench_dir = str(HERE)
    trainer_name = s["trainer"]
    check_steps = set(checks(s))
    log = str(tmp / "ray_curves.jsonl")  # the accuracy at each check step, appended

    class DigitsTrainable(tune.Trainable):
        def setup(self, config: dict[str, Any]) -> None:
            self._build(config)

        def _build(self, config: dict[str, Any]) -> None:
            import torch

            if bench_dir not in sys.path:
                sys.path.insert(0, bench_dir)
            import _common

            torch.set_num_threads(threads)
            self.trial = config["trial"]
            spec = specs[self.trial]
            self.hp = dict(spec.hp)
            self.trainer = getattr(_common, trainer_name)(spec.config)
            self.t = 0

        def step(self) -> dict[str, float]:
            self.trainer.setup(hp_at(self.hp, self.t))
            self.trainer.train()
            self.t += 1
            acc = self.trainer.evaluate()["accuracy"]
            if self.t in check_steps:
                line = json.dumps({"trial": self.trial, "step": self.t, "accuracy": acc})
                fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, (line + "\n").encode())
                finally:
                    os.close(fd)
            return {"accuracy": acc}

        def reset_config(self, new_config: dict[str, Any]) -> bool:
            self._build(new_config)
            return True

    phases: dict[str, float] = {}
    begin = _perf()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(tmp / "ray"),
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    phases["ray.init"] = _perf() - begin
    try:
        tuner = tune.Tuner(
            DigitsTrainable,
            param_space={"trial": tune.grid_search(list(range(len(specs))))},
            tune_config=tune.TuneConfig(
                metric="accuracy",
                mode="max",
                scheduler=None
                if s["tuner"] == "grid"  # FIFO: every trial to max_steps
                else ASHAScheduler(
                    time_attr="training_iteration",
                    max_t=s["max_steps"],
                    grace_period=s["min_steps"],
                    reduction_factor=s["eta"],
                    brackets=1,
                ),
                reuse_actors=True,
                max_concurrent_trials=2,
            ),
            run_config=tune.RunConfig(
                name="digits",
                storage_path=str(tmp / "ray_results"),
                verbose=0,
                stop={"training_iteration": s["max_steps"]},
                checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),
            ),
        )
        mark = _perf()
        grid = tuner.fit()
        phases["fit"] = _perf() - mark
    finally:
        mark = _perf()
        ray.shutdown()
        phases["ray.shutdown"] = _perf() - mark
    wall = _perf() - begin
    top = s["max_steps"]
    finals: dict[str, float] = {}
    iters, trainable_s = 0, 0.0
    for i in range(len(grid)):
        result = grid[i]
        m = result.metrics or {}
        iters += int(m.get("training_iteration", 0))
        trainable_s += float(m.get("time_total_s", 0.0))
        if m.get("training_iteration") == top and "accuracy" in m:
            spec = specs[int((result.config or {})["trial"])]
            finals[trial_key(spec.config, spec.hp)] = float(m["accuracy"])
    curves: dict[str, dict[str, float]] = {}
    if os.path.exists(log):
        for line in Path(log).read_text().splitlines():
            rec = json.loads(line)
            spec = specs[int(rec["trial"])]
            key = trial_key(spec.config, spec.hp)
            curves.setdefault(key, {})[str(rec["step"])] = float(rec["accuracy"])
    return {
        "wall": wall,
        "phases": phases,
        "finals": finals,
        "curves": curves,
        "best_accuracy": max(finals.values(), default=None),
        "trials": len(grid),
        "trials_full": len(finals),
        "steps_reported": iters,
        "device_seconds": trainable_s,
        "errors": grid.num_errors,
    }


def _optuna_setup(s: dict[str, Any], threads: int) -> tuple[Any, Any, Any]:
    """``(objective, sampler, pruner)`` of the Optuna runner, and the objective's
    ``finals`` / ``curves`` dicts in ``objective.results``."""
    import optuna
    import torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(threads)
    specs = list(s["space"].trials())
    names = sorted({*specs[0].config, *specs[0].hp})

    def value(spec: Any, name: str) -> Any:
        return spec.hp[name] if name in spec.hp else json.dumps(spec.config[name])

    options: dict[str, list[Any]] = {}
    for spec in specs:
        for name in names:
            opts = options.setdefault(name, [])
            if value(spec, name) not in opts:
                opts.append(value(spec, name))
    varying = [n for n in names if len(options[n]) > 1]
    lookup = {tuple(options[n].index(value(sp, n)) for n in varying): sp for sp in specs}
    top = s["max_steps"]
    trainer_cls = trainer_class(s)
    check_steps = set(checks(s))

    finals: dict[str, float] = {}
    curves: dict[str, dict[str, float]] = {}

    def objective(trial: optuna.Trial) -> float:
        if trial.number >= s["num_trials"]:
            # Processes on one storage can start one trial past the grid (a grid point
            # another process had just taken): drop it untrained, and stop.
            trial.study.stop()
            raise optuna.TrialPruned()
        key = tuple(trial.suggest_categorical(n, list(range(len(options[n])))) for n in varying)
        spec = lookup[key]
        trainer = trainer_cls(spec.config)
        curve = curves.setdefault(trial_key(spec.config, spec.hp), {})
        acc = math.nan
        for t in range(top):
            trainer.setup(hp_at(spec.hp, t))
            trainer.train()
            acc = trainer.evaluate()["accuracy"]
            if t + 1 in check_steps:
                curve[str(t + 1)] = acc
            trial.report(acc, t + 1)
            if trial.should_prune():
                raise optuna.TrialPruned()
        finals[trial_key(spec.config, spec.hp)] = acc
        return acc

    objective.results = {"finals": finals, "curves": curves}  # type: ignore[attr-defined]
    # Optuna 5's GridSampler gives trial number k grid point k (k < grid size), so
    # processes sharing a storage never train the same point twice.
    sampler = optuna.samplers.GridSampler(
        {n: list(range(len(options[n]))) for n in varying}, seed=s["seed"]
    )
    pruner = (
        optuna.pruners.NopPruner()
        if s["tuner"] == "grid"
        else optuna.pruners.SuccessiveHalvingPruner(
            min_resource=s["min_steps"], reduction_factor=s["eta"], min_early_stopping_rate=0
        )
    )
    return objective, sampler, pruner


def _optuna_storage(tmp: Path) -> Any:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(tmp / "optuna.journal")))


def optuna_worker(args: argparse.Namespace) -> int:
    """One of the Optuna runner's processes: trials of the shared study until the grid
    is done; writes its trials' accuracies to ``args.out``."""
    import optuna

    s = settings(args.quick, args.study)
    objective, sampler, pruner = _optuna_setup(s, args.optuna_threads)
    study = optuna.load_study(
        study_name="race", storage=_optuna_storage(Path(args.workdir)), sampler=sampler,
        pruner=pruner,
    )  # fmt: skip
    study.optimize(objective, n_trials=s["num_trials"])
    Path(args.out).write_text(json.dumps(objective.results))
    return 0


def run_optuna(s: dict[str, Any], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Optuna: in this process (``--optuna-jobs 1``), or in ``jobs`` processes of this
    script on one journal-file storage (each 1 torch thread; they inherit the step
    counter)."""
    import optuna

    jobs = optuna_jobs(args)
    objective, sampler, pruner = _optuna_setup(s, args.optuna_threads)
    begin = _perf()
    storage = _optuna_storage(tmp) if jobs > 1 else None
    study = optuna.create_study(
        study_name="race", storage=storage, direction="maximize", sampler=sampler,
        pruner=pruner,
    )  # fmt: skip
    results = objective.results
    if jobs == 1:
        study.optimize(objective, n_trials=s["num_trials"])
    else:
        outs = [tmp / f"optuna-worker-{i}.json" for i in range(jobs)]
        procs = []
        for out in outs:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "optuna-worker"]
            cmd += ["--out", str(out), "--workdir", str(tmp), "--study", args.study]
            cmd += ["--optuna-threads", str(args.optuna_threads)]
            cmd += ["--quick"] if args.quick else []
            procs.append(subprocess.Popen(cmd))
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError("an Optuna worker process failed")
        for out in outs:
            part = json.loads(out.read_text())
            results["finals"].update(part["finals"])
            for key, curve in part["curves"].items():
                results["curves"].setdefault(key, {}).update(curve)
        study = optuna.load_study(study_name="race", storage=storage)
    wall = _perf() - begin
    trials = [t for t in study.trials if t.number < s["num_trials"]]
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    steps = sum(max(t.intermediate_values, default=0) for t in trials)
    return {
        "wall": wall,
        "phases": (
            {"extra trials dropped": float(len(study.trials) - len(trials))} if jobs > 1 else {}
        ),
        "finals": results["finals"],
        "curves": results["curves"],
        "best_accuracy": max((t.value for t in done if t.value is not None), default=None),
        "trials": len(trials),
        "trials_full": len(done),
        "steps_reported": steps,
        "device_seconds": None,
    }


def child(args: argparse.Namespace) -> int:
    """Run one runner once and write its figures as JSON to ``args.out``."""
    # A time limit sends SIGTERM: exit through SystemExit so that clean-up code (such as
    # ray.shutdown) runs; the parent removes the work directory in any case.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = settings(args.quick, args.study)
    tmp = Path(args.workdir)
    counter = tmp / "train_calls"
    if not args.child.startswith("stagetree"):  # stagetree's runner sets it after timing
        os.environ[COUNTER_ENV] = str(counter)
    load = load_average()
    if args.child == "stagetree":
        out = run_stagetree(s, tmp, True, 1)
    elif args.child == "stagetree-noshare":
        out = run_stagetree(s, tmp, False, 1)
    elif args.child == "ray":
        out = run_ray(s, tmp, 1)
    elif args.child == "optuna":
        out = run_optuna(s, tmp, args)
    elif args.child == "optuna-worker":
        return optuna_worker(args)
    else:
        raise ValueError(f"unknown runner {args.child!r}")
    out["steps_executed"] = count_steps(counter)
    out["load"] = load
    Path(args.out).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------- parent


def available(runner: str) -> str | None:
    """None when ``runner`` can run here, else why not."""
    module = {"ray": "ray.tune", "optuna": "optuna"}.get(runner)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"{module.split('.')[0]} is not installed (pip install -r requirements-bench.txt)"
    return None


def optuna_jobs(args: argparse.Namespace) -> int:
    """Optuna's parallel trials: ``--optuna-jobs``, else 1 (digits study) or 2 (races)."""
    if args.optuna_jobs:
        return int(args.optuna_jobs)
    return 1 if args.study == "digits-asha" else 2


def run_child(runner: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One run in a fresh process (own session, so a timeout ends all it started)."""
    workdir = tempfile.mkdtemp(prefix=f"stagetree-vs-{runner}-")
    out = os.path.join(workdir, "result.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", runner, "--out", out]
    cmd += ["--workdir", workdir]
    cmd += ["--optuna-threads", str(args.optuna_threads), "--study", args.study]
    cmd += ["--optuna-jobs", str(optuna_jobs(args))]
    if args.quick:
        cmd.append("--quick")
    log = Path(tempfile.gettempdir()) / f"stagetree-vs-peers-{runner}.log"
    begin = _perf()
    try:
        with open(log, "w") as logf:
            proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return {"error": f"time limit ({timeout:.0f} s) reached; log: {log}"}
        elapsed = _perf() - begin
        if rc != 0:
            tail = log.read_text()[-600:]
            return {"error": f"exit status {rc}; log: {log}; tail: {tail!r}"}
        result: dict[str, Any] = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["process_wall"] = elapsed
    return result


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """End the runner's process group (the child and what it started), TERM then KILL."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def summarise(results: dict[str, list[dict[str, Any]]], skipped: dict[str, str]) -> list[Any]:
    rows = []
    base = median(r["wall"] for r in results.get("stagetree", []) if "error" not in r)
    for runner, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        wall = median(r["wall"] for r in ok)
        rows.append({
            "runner": runner,
            "runs": f"{len(ok)}/{len(runs)}",
            "wall": wall,
            "wall_min": min((r["wall"] for r in ok), default=None),
            "steps": median(r["steps_executed"] for r in ok),
            "best": median(r["best_accuracy"] for r in ok),
            "trials_full": median(r["trials_full"] for r in ok),
            "vs": (wall / base) if wall and base else None,
            "merge_rate": median(r.get("merge_rate") for r in ok),
            "efficiency": median(r.get("efficiency") for r in ok),
        })  # fmt: skip
    for runner, why in skipped.items():
        rows.append({"runner": runner, "runs": "skipped", "why": why})
    return rows


def report(
    rows: list[dict[str, Any]],
    results: dict[str, list[dict[str, Any]]],
    s: dict[str, Any],
    args: argparse.Namespace,
) -> str:
    info = machine_info()
    jobs = optuna_jobs(args)
    optuna_how = "sequential" if jobs == 1 else f"{jobs} processes on one journal storage"
    out = [
        f"Machine: {info['nproc']} cores, {info['cpu']}; torch {info.get('torch')}, python "
        f"{info['python']}; {info['date']}; load at the end {info['load']}",
        f"Study: {study_line(s)}; "
        f"{args.repeats} repeat(s), medians. stagetree: 2 workers x 1 thread; Ray: "
        f"num_cpus=2, 1 CPU per trial, 1 thread; Optuna: {optuna_how}, "
        f"{args.optuna_threads} torch thread(s) each.\n",
    ]
    race = s["study"] != "digits-asha"
    table = []
    for r in rows:
        if r["runs"] == "skipped":
            table.append([r["runner"], "skipped", None, None, None, None, None, r["why"]]
                         + ([None, None] if race else []))  # fmt: skip
            continue
        table.append([
            r["runner"], r["runs"], r["wall"], r["wall_min"], r["vs"],
            None if r["steps"] is None else int(r["steps"]), fmt(r["best"], 4),
            None if r["trials_full"] is None else int(r["trials_full"]),
        ] + ([r["merge_rate"], fmt(r["efficiency"], 3)] if race else []))  # fmt: skip
    out.append(
        markdown_table(
            [
                "runner",
                "runs ok",
                "wall s (median)",
                "wall s (min)",
                "x stagetree wall",
                "steps executed",
                "best acc @max_steps",
                "trials to max_steps",
            ]
            + (["merge rate", "efficiency"] if race else []),
            table,
        )
    )
    out.append("\nPer run (wall s / steps / phases / 1-min load at start):\n")
    for runner, runs in results.items():
        for i, r in enumerate(runs):
            if "error" in r:
                out.append(f"- {runner} #{i + 1}: FAILED: {r['error']}")
                continue
            phases = ", ".join(f"{k} {v:.1f}" for k, v in r.get("phases", {}).items())
            extra = ""
            if r.get("device_seconds") is not None:
                extra = f", busy {r['device_seconds']:.1f} s"
            if r.get("merge_rate") is not None:
                extra += f", merge rate {r['merge_rate']:.2f}"
            if r.get("efficiency") is not None:
                alone = ", ".join(
                    f"{'bs ' + k + ' ' if k != '0' else ''}{1000 * v:.1f} ms"
                    for k, v in r["step_alone"].items()
                )
                extra += (
                    f", unique steps {r['steps_unique']}, a step alone {alone}, "
                    f"efficiency {r['efficiency']:.3f} (busy / 2 / wall: "
                    f"{r['device_seconds'] / 2 / r['wall']:.3f})"
                )
            if r.get("server"):
                extra += f", workers forked from {r['server']}"
            out.append(
                f"- {runner} #{i + 1}: {r['wall']:.1f} s, {r['steps_executed']} steps "
                f"(runner's own count {r['steps_reported']:.0f}), best "
                f"{fmt(r['best_accuracy'], 4)}; {phases}{extra}; load {r['load']}"
            )
    parts = [
        (runner, i, r["breakdown"])
        for runner, runs in results.items()
        for i, r in enumerate(runs)
        if r.get("breakdown")
    ]
    if parts:
        out.append("\nBreakdown of stagetree's wall-clock (s; seconds over 2 workers add up "
                   "to the wall; worker-s are totals over both workers):\n")  # fmt: skip
        keys = list(parts[0][2])
        out.append(markdown_table(["run", "wall", *keys], [
            [f"{runner} #{i + 1}", results[runner][i]["wall"], *(b.get(k) for k in keys)]
            for runner, i, b in parts
        ]))  # fmt: skip
    out.append("\n" + _agreement(results))
    out.append("\n" + "\n".join(goals(rows, s)))
    return "\n".join(out)


def study_line(s: dict[str, Any]) -> str:
    """One line that says what the study is."""
    if s["study"] == "digits-asha":
        return (
            f"examples/digits.py, {s['num_trials']} trials, ASHA eta={s['eta']}, "
            f"min_steps={s['min_steps']}, max_steps={s['max_steps']} (rungs {s['levels']})"
        )
    tuner = (
        f"GridSearch, every trial to {s['max_steps']} epochs"
        if s["tuner"] == "grid"
        else f"SHA eta={s['eta']}, rungs {s['levels']} epochs (Ray: ASHAScheduler, "
        f"Optuna: SuccessiveHalvingPruner, same rungs)"
    )
    return (
        f"{s['study']}: {s['num_trials']} trials of DigitsConvTrainer (channels 32, "
        f"BatchNorm; one step = one epoch over the 1348 training samples at the step's "
        f"batch size) on Hippo-style lr / batch-size / momentum schedules, {tuner}; "
        f"the whole grid: {s['max_steps']} epochs x {s['num_trials']} trials = "
        f"{s['max_steps'] * s['num_trials']} trial steps, {ideal_unique(s)} unique "
        f"(ideal merge rate {s['max_steps'] * s['num_trials'] / ideal_unique(s):.2f})"
    )


def ideal_unique(s: dict[str, Any]) -> int:
    """Unique steps of the whole grid trained to max_steps."""
    paths = [(sp.config, sp.hp, s["max_steps"]) for sp in s["space"].trials()]
    return sum(unique_steps(paths).values())


def goals(rows: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    """The issue's goals, met or missed, from the medians."""
    by = {r["runner"]: r for r in rows if r.get("runs") != "skipped"}
    st = by.get("stagetree")
    out: list[str] = []
    if not st or not st.get("wall"):
        return ["Goals: no stagetree run finished."]
    peer = by.get("optuna") if s["tuner"] == "grid" else by.get("ray")
    if s["tuner"] == "grid" and peer and peer.get("wall") and st.get("merge_rate"):
        speed, need = peer["wall"] / st["wall"], 0.95 * st["merge_rate"]
        verdict = "met" if speed >= need else f"missed by {need - speed:.2f}x"
        out.append(
            f"Goal stagetree faster than Optuna by >= 0.95 x merge rate "
            f"({st['merge_rate']:.2f}) = {need:.2f}x: {speed:.2f}x, {verdict}."
        )
    elif peer and peer.get("wall"):
        speed = peer["wall"] / st["wall"]
        verdict = "met" if speed >= 3 else f"missed: {speed:.2f}x is {3 - speed:.2f}x short"
        out.append(
            f"Goal stagetree >= 3x faster end to end than Ray Tune: {speed:.2f}x, {verdict}."
        )
    if s["study"] != "digits-asha" and st.get("efficiency") is not None:
        eff = st["efficiency"]
        verdict = "met" if eff >= 0.90 else f"missed by {0.90 - eff:.3f}"
        out.append(
            f"Goal stagetree efficiency (unique steps x a step's time alone / 2 workers / "
            f"wall) >= 0.90: {eff:.3f}, {verdict}."
        )
    return out


def _agreement(results: dict[str, list[dict[str, Any]]]) -> str:
    """How the runners agree on trials that several of them trained to max_steps."""
    seen: dict[str, list[float]] = {}
    for runs in results.values():
        for r in runs:
            for key, acc in r.get("finals", {}).items():
                seen.setdefault(key, []).append(acc)
    shared = {k: v for k, v in seen.items() if len(v) > 1}
    if not shared:
        none = "Same-trial check: no trial was trained to max_steps twice."
        return "\n".join([none, *_curve_agreement(results)])
    worst = max(max(v) - min(v) for v in shared.values())
    count = sum(len(v) for v in shared.values())
    lines = [
        f"Same-trial check: {len(shared)} trials were trained to max_steps by several runs "
        f"({count} results across runners and repeats); largest accuracy difference for "
        f"the same trial: {worst:.2g}."
    ]
    return "\n".join(lines + _curve_agreement(results))


def _curve_agreement(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each runner against stagetree's first run: the accuracy of every trial both
    trained to a check step (a rung, or a quarter of the epochs), compared."""
    base = next((r for r in results.get("stagetree", []) if "curves" in r), None)
    if base is None:
        return []
    out = []
    for runner, runs in results.items():
        pairs = worst = differ = 0.0
        for r in runs:
            if r is base or "curves" not in r:
                continue
            for key, curve in r["curves"].items():
                for step, acc in curve.items():
                    ref = base["curves"].get(key, {}).get(step)
                    if ref is None:
                        continue
                    pairs += 1
                    worst = max(worst, abs(acc - ref))
                    differ += abs(acc - ref) > 1e-6
        if pairs:
            who = "stagetree's other runs" if runner == "stagetree" else runner
            out.append(
                f"- {who} vs stagetree run 1, at the check steps: {int(pairs)} "
                f"(trial, step) pairs, {int(differ)} differ by more than 1e-6, largest "
                f"difference {worst:.2g}"
            )
    return out


def plot(path: str, rows: list[dict[str, Any]], s: dict[str, Any]) -> None:
    ran = [r for r in rows if r["runs"] != "skipped" and r.get("wall") is not None]
    labels = [r["runner"] for r in ran]
    bar_plot(
        path,
        [
            ("wall-clock, end to end (median)", labels, [r["wall"] for r in ran], "s"),
            ("training steps executed", labels, [r["steps"] or 0 for r in ran], "steps"),
            ("best accuracy at max_steps", labels, [r["best"] or 0 for r in ran], "accuracy"),
        ],
        (
            f"digits ASHA study ({s['num_trials']} trials, eta={s['eta']}, "
            f"max_steps={s['max_steps']}), 2 cores"
            if s["study"] == "digits-asha"
            else f"{s['study']} ({s['num_trials']} CNN trials, {s['max_steps']} epochs), 2 cores"
        ),
        notes={2: [fmt(r["best"], 4) for r in ran]},
        ylims={2: (0.8, 1.0)},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="at most 8 trials, 1 repeat: a smoke test"
    )
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument(
        "--study",
        choices=STUDIES,
        default="digits-asha",
        help="digits-asha (examples/digits.py, ASHA), or a race where training dominates: "
        "race-grid (GridSearch) or race-sha (SHA)",
    )
    parser.add_argument(
        "--runners", default=None, help="comma-separated (default: all; races: no noshare)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="s per run (600; quick 240)")
    parser.add_argument("--optuna-threads", type=int, default=1, help="torch threads")
    parser.add_argument("--optuna-jobs", type=int, default=None, help="Optuna n_jobs (1; races: 2)")
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    args.repeats = args.repeats or (1 if args.quick else 3)
    timeout = args.timeout or (240.0 if args.quick else 600.0)
    if args.runners is None:
        default = [r for r in RUNNERS if args.study == "digits-asha" or "noshare" not in r]
        args.runners = ",".join(default)
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    unknown = sorted(set(runners) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown runners {unknown}; choose from {list(RUNNERS)}")
    skipped = {r: why for r in runners if (why := available(r)) is not None}
    for r, why in skipped.items():
        print(f"skipping {r}: {why}", file=sys.stderr)
    active = [r for r in runners if r not in skipped]
    s = settings(args.quick, args.study)
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in active}
    for rep in range(args.repeats):
        order = active[rep % len(active) :] + active[: rep % len(active)] if active else []
        for runner in order:
            res = run_child(runner, args, timeout)
            results[runner].append(res)
            status = res.get("error") or f"{res['wall']:.1f} s, {res['steps_executed']} steps"
            print(f"repeat {rep + 1} {runner}: {status}", file=sys.stderr)
    rows = summarise(results, skipped)
    print(report(rows, results, s, args))
    if args.plot:
        write_plot(args.plot, plot, rows, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
