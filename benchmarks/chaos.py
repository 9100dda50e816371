"""Chaos driver: a study tuned while faults are injected at random points, checked
against a clean reference run.

For each of ``--schedules`` seeded fault schedules, a driver process
(``chaos.py --drive``) tunes one study (a grid of trials that share prefixes and
branch, two local worker processes) on a fresh SQLite plan; while it runs, the chaos
loop injects faults at random moments and starts the driver again each time it ends
before the study is finished. Fault kinds:

* ``worker``: SIGKILL of one worker process (the driver replaces it; the steps it
  trained since its last checkpoint are trained again);
* ``kill``: SIGKILL of the driver (its workers exit with it; the next driver resumes
  from the plan);
* ``int``: SIGINT of the driver, a clean stop (Ctrl-C): the running stages checkpoint
  where they stand, and the next driver must train none of the steps trained before
  it again;
* ``db`` (``--db-restart CMD``): run ``CMD`` (e.g. a PostgreSQL restart) while the
  driver runs against ``--storage URL``;
* ``store`` (``--store-cut CMD --store-restore CMD``): cut the checkpoint store
  (``--checkpoints URL``) for ``--cut-seconds`` seconds.

The ``db`` and ``store`` kinds exercise the storage layer's retries; they run only when
their commands are given.

Checked at the end of every schedule: every trial finished with metrics equal to the
clean reference run's (exact), no driver hung (``--hang-seconds``), and no step trained
before a clean stop was trained again after it. Printed: faults injected and survived
per kind, steps recomputed (``train()`` calls past the unique steps), and the verdict.

Usage: ``python benchmarks/chaos.py --schedules 20`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stagetree import Study, Trainer
from stagetree.exceptions import StudyBusyError
from stagetree.hp import Piecewise
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

STEPS = 48
LOG_ENV = "STAGETREE_CHAOS_LOG"
SLEEP_ENV = "STAGETREE_CHAOS_STEP_SECONDS"


class ChaosTrainer(Trainer):
    """SGD on a generated linear regression; ``lr`` is its sequence. Every ``train()``
    call appends ``<path>:<step>`` to the file ``$STAGETREE_CHAOS_LOG`` (an atomic
    append), where ``<path>`` identifies the sequence values trained so far: steps that
    trials share have one key, and a step trained twice appears twice."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        rng = np.random.default_rng(int(config.get("seed", 0)))
        self.x = rng.normal(size=(64, 4))
        self.y = self.x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=64)
        self.w = np.zeros(4)
        self.lr = 0.01
        self.t = 0
        self.path = 0  # a hash of the lr values trained so far

    def setup(self, hp: Mapping[str, Any]) -> None:
        if "lr" in hp:
            self.lr = float(hp["lr"])

    def train(self) -> None:
        seconds = float(os.environ.get(SLEEP_ENV, "0") or 0)
        if seconds:
            time.sleep(seconds)
        self.path = hash((self.path, self.lr)) & 0xFFFFFFFF
        log = os.environ.get(LOG_ENV)
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{self.path}:{self.t}\n".encode())
            finally:
                os.close(fd)
        grad = 2 * self.x.T @ (self.x @ self.w - self.y) / len(self.y)
        self.w = self.w - self.lr * grad
        self.t += 1

    def evaluate(self) -> dict[str, float]:
        return {"loss": float(np.mean((self.x @ self.w - self.y) ** 2))}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy(), "t": self.t, "lr": self.lr, "path": self.path}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = np.array(state["w"], dtype=float)
        self.t = int(state["t"])
        self.lr = float(state["lr"])
        self.path = int(state["path"])


def tuner() -> GridSearch:
    """Six trials that share a warm-up and branch at steps 12 and 24."""
    lrs = [Piecewise([0.05, v], [m]) for m in (12, 24) for v in (0.01, 0.02, 0.03)]
    return GridSearch(GridSpace({"lr": lrs}, fixed={"seed": [0]}), "loss", mode="min", steps=STEPS)


def results(study: Study) -> dict[str, float]:
    """Final loss by trial (its sequences, as JSON)."""
    out = {}
    for t in study.trials():
        if t.state == "done":
            key = json.dumps({k: repr(v) for k, v in sorted(t.hp.items())})
            out[key] = t.metrics[t.steps]["loss"]
    return out


# --------------------------------------------------------------------------- the driver


def _study(storage: str, version: str, checkpoints: str | None = None, **kw: Any) -> Study:
    """The chaos study of one schedule: its own ``version``, so that schedules sharing a
    storage (``--storage``) share no training."""
    return Study(
        "chaos", ChaosTrainer, storage=storage, checkpoint_dir=checkpoints, version=version, **kw
    )


def drive(storage: str, version: str, checkpoints: str | None) -> int:
    """One driver process: tune the study to its end (resuming from the plan)."""
    deadline = time.monotonic() + 60
    while True:
        study = _study(storage, version, checkpoints, workers=2)
        try:
            study.tune(tuner(), progress=False)
            study.close()
            return 0
        except StudyBusyError:  # a killed driver's lease, until it expires
            study.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# --------------------------------------------------------------------------- the chaos loop


@dataclass
class Schedule:
    seed: int
    injected: Counter[str] = field(default_factory=Counter)
    recomputed: int = 0
    after_clean_stop: int = 0
    exact: bool = False
    hung: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.exact and not self.hung and not self.after_clean_stop and not self.error


def _log_lines(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except FileNotFoundError:
        return []


def _workers(pid: int) -> list[int]:
    """The worker processes of driver ``pid`` (spawned children running the worker)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            out.append(int(entry.name))
    return out


def run_schedule(seed: int, args: argparse.Namespace, reference: Mapping[str, float]) -> Schedule:
    rng = random.Random(seed)
    sched = Schedule(seed)
    kinds = list(args.kinds)
    if args.db_restart:
        kinds.append("db")
    if args.store_cut and args.store_restore:
        kinds.append("store")
    with tempfile.TemporaryDirectory(prefix="stagetree-chaos-") as tmp:
        work = Path(tmp)
        log = work / "trained.log"
        storage = args.storage or f"sqlite:///{work / 'plan.db'}"
        env = {
            **os.environ,
            LOG_ENV: str(log),
            SLEEP_ENV: str(args.step_seconds),
            "STAGETREE_START_METHOD": "spawn",  # workers are the driver's children
            "STAGETREE_LEASE_TTL": "3",  # a killed driver's leases expire soon
            "STAGETREE_WORKER_IDLE": "0",
        }
        version = f"chaos-{seed}"
        command = [sys.executable, __file__, "--drive", storage, "--version", version]
        if args.checkpoints:
            command += ["--checkpoints", args.checkpoints]
        faults = args.faults
        clean_before: set[str] | None = None  # what the driver a clean stop ended trained
        while True:
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            started = len(_log_lines(log))
            ended_by = ""
            while faults and proc.poll() is None:
                # Strike while it trains: after its next step, at a random moment.
                seen = len(_log_lines(log))
                while len(_log_lines(log)) == seen and proc.poll() is None:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.05, 1.5))
                if proc.poll() is not None:
                    break
                kind = rng.choice(kinds)
                if kind == "worker":
                    pids = _workers(proc.pid)
                    if not pids:
                        continue
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    time.sleep(0.05)
                    # What it trained since its last checkpoint is lost (a crash): the
                    # clean-stop check starts after it.
                    started = len(_log_lines(log))
                elif kind == "kill":
                    proc.kill()
                elif kind == "int":
                    proc.send_signal(signal.SIGINT)
                elif kind == "db":
                    subprocess.run(args.db_restart, shell=True, check=False)
                else:
                    subprocess.run(args.store_cut, shell=True, check=False)
                    time.sleep(args.cut_seconds)
                    subprocess.run(args.store_restore, shell=True, check=False)
                sched.injected[kind] += 1
                faults -= 1
                if kind in ("kill", "int"):
                    ended_by = kind
                    break
            try:
                _, err = proc.communicate(timeout=args.hang_seconds)
            except subprocess.TimeoutExpired:
                proc.kill()
                sched.hung = True
                sched.error = f"a driver hung past {args.hang_seconds} s"
                break
            if clean_before is not None:
                again = set(_log_lines(log)[started:]) & clean_before
                sched.after_clean_stop += len(again)
            # What this driver trained (since its last lost worker): a clean stop keeps
            # all of it.
            clean_before = set(_log_lines(log)[started:]) if ended_by == "int" else None
            if not ended_by and proc.returncode != 0:
                sched.error = f"the driver failed (exit {proc.returncode}): {err[-2000:]}"
                break
            if not ended_by:
                break  # the study is finished
        lines = _log_lines(log)
        sched.recomputed = len(lines) - len(set(lines))
        if not sched.error:
            with _study(storage, version, args.checkpoints, executor="inline") as study:
                got = results(study)
            sched.exact = got == dict(reference)
            if not sched.exact:
                sched.error = f"{len(got)} trials done, metrics differ from the reference"
    return sched


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", type=int, default=20, help="random fault schedules")
    p.add_argument("--faults", type=int, default=4, help="faults per schedule")
    p.add_argument(
        "--kinds",
        type=lambda text: text.split(","),
        default=["worker", "kill", "int"],
        help="process fault kinds, comma-separated (default: worker,kill,int)",
    )
    p.add_argument("--seed", type=int, default=0, help="the first schedule's seed")
    p.add_argument("--step-seconds", type=float, default=0.03, help="one step's time")
    p.add_argument("--hang-seconds", type=float, default=120.0, help="a driver's limit")
    p.add_argument("--storage", help="plan storage URL (default: a fresh SQLite file)")
    p.add_argument("--checkpoints", help="checkpoint location (default: beside the plan)")
    p.add_argument("--db-restart", metavar="CMD", help="shell command restarting the DB")
    p.add_argument("--store-cut", metavar="CMD", help="shell command cutting the store")
    p.add_argument("--store-restore", metavar="CMD", help="shell command restoring it")
    p.add_argument("--cut-seconds", type=float, default=8.0, help="how long a cut lasts")
    p.add_argument("--drive", metavar="STORAGE", help=argparse.SUPPRESS)
    p.add_argument("--version", default="chaos", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.drive:
        return drive(args.drive, args.version, args.checkpoints)
    with tempfile.TemporaryDirectory(prefix="stagetree-chaos-ref-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'ref.db'}"
        with Study("chaos", ChaosTrainer, storage=url, executor="inline") as study:
            study.tune(tuner(), progress=False)
            reference = results(study)
    print(f"reference: {len(reference)} trials; load {os.getloadavg()[0]:.1f}")
    total: Counter[str] = Counter()
    failed = survived = recomputed = 0
    for i in range(args.schedules):
        begin = time.monotonic()
        sched = run_schedule(args.seed + i, args, reference)
        total.update(sched.injected)
        recomputed += sched.recomputed
        failed += not sched.ok
        survived += sum(sched.injected.values()) if sched.ok else 0
        faults = ", ".join(f"{k} {n}" for k, n in sorted(sched.injected.items())) or "none"
        verdict = "ok" if sched.ok else f"FAILED: {sched.error or 'steps lost'}"
        print(
            f"schedule {sched.seed}: faults {faults}; steps recomputed {sched.recomputed}, "
            f"after clean stops {sched.after_clean_stop}; {time.monotonic() - begin:.0f} s; "
            f"{verdict}",
            flush=True,
        )
    injected = sum(total.values())
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(total.items()))
    print(
        f"{args.schedules} schedules, {failed} failed; faults injected {injected} ({kinds}), "
        f"survived {survived}; steps recomputed {recomputed}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
