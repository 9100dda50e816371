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
* ``db``: the plan's PostgreSQL goes down for a random time up to ``--db-down-seconds``
  (stopped, then started again with ``pg_ctl``) while the driver runs;
* ``store``: the checkpoint store (S3) is cut for ``--cut-seconds`` seconds: a TCP
  proxy in front of it drops every connection and refuses new ones, then comes back.

The ``db`` and ``store`` kinds exercise the storage layer's retries. With
``--services`` the chaos loop starts what they need for itself: a private PostgreSQL
(its own data folder and port, as ``.ci/start_postgres.sh`` starts one; a database per
schedule) and moto's S3 in server mode behind a proxy (``tests/fakes/tcp_proxy.py``),
all stopped at the end. Against services of one's own, ``--storage URL`` and
``--checkpoints URL`` with ``--db-restart CMD`` and ``--store-cut CMD --store-restore
CMD`` (shell commands) do the same.

Checked at the end of every schedule: every trial finished with metrics equal to the
clean reference run's (exact), no driver hung (``--hang-seconds``), and no step trained
before a clean stop was trained again after it, and every finished trial's final
checkpoint loads (its weights were not lost to a store cut). Printed: faults injected and survived
per kind, steps recomputed (``train()`` calls past the unique steps), and the verdict.

Usage: ``python benchmarks/chaos.py --schedules 20`` (a few minutes on 2 cores);
``python benchmarks/chaos.py --services --schedules 20`` adds database restarts and
store cuts (needs PostgreSQL's server binaries, moto and s3fs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The trainer's base class and the proxy are the tests' (worker processes that import
# this file by its path run this line too).
sys.path.insert(0, str(ROOT / "tests" / "fakes"))

from study_trainers import LinearTrainer  # noqa: E402

from stagetree import Study  # noqa: E402
from stagetree.exceptions import StudyBusyError  # noqa: E402
from stagetree.hp import Piecewise  # noqa: E402
from stagetree.space import GridSpace  # noqa: E402
from stagetree.tuners import GridSearch  # noqa: E402

STEPS = 48
LOG_ENV = "STAGETREE_CHAOS_LOG"
SLEEP_ENV = "STAGETREE_CHAOS_STEP_SECONDS"


class ChaosTrainer(LinearTrainer):
    """The tests' ``LinearTrainer`` (SGD on a generated linear regression; ``lr`` is its
    sequence), reporting only ``loss``. Every ``train()`` call appends
    ``<path>:<step>`` to the file ``$STAGETREE_CHAOS_LOG`` (an atomic append), where
    ``<path>`` identifies the sequence values trained so far: steps that trials share
    have one key, and a step trained twice appears twice."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.path = 0  # a hash of the lr values trained so far

    def train(self) -> dict[str, float]:
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
        return super().train()

    def evaluate(self) -> dict[str, float]:
        return {"loss": super().evaluate()["loss"]}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "path": self.path}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
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


def weights_lost(study: Study) -> int:
    """How many finished trials' final checkpoints cannot be loaded (their weights were
    lost: the trial was reported finished before its model was stored)."""
    return sum(
        study.state(t.config, t.hp, t.steps) is None for t in study.trials() if t.state == "done"
    )


# --------------------------------------------------------------------------- private services

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "chaos",
    "AWS_SECRET_ACCESS_KEY": "chaos",
    "AWS_SESSION_TOKEN": "chaos",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries off: the store's window rides through
}
BUCKET = "stagetree-chaos"


def _as_postgres(command: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as the ``postgres`` user when this process is root (the server
    refuses to run as root), else as this user."""
    argv = ["su", "postgres", "-s", "/bin/bash", "-c", command] if os.getuid() == 0 else None
    return subprocess.run(
        argv or ["bash", "-c", command], check=True, capture_output=True, text=True
    )


class PrivatePostgres:
    """A PostgreSQL server of the chaos loop's own, started by the project's
    ``.ci/start_postgres.sh`` (its own data folder and port), restarted with ``pg_ctl``
    and stopped and removed by :meth:`close`."""

    def __init__(self) -> None:
        out = subprocess.run(
            ["bash", str(ROOT / ".ci" / "start_postgres.sh")],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        self.url, self.data = out[0], out[1]
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        # As the script finds them: Debian's newest server, else the PATH's.
        debian = sorted(
            Path("/usr/lib/postgresql").glob("*/bin"),
            key=lambda p: (len(p.parent.name), p.parent.name),
        )
        on_path = shutil.which("pg_ctl")
        self.bindir = str(debian[-1]) if debian else str(Path(on_path or "pg_ctl").parent)
        self._options = f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off"

    def _ctl(self, *args: str) -> None:
        _as_postgres(f"{self.bindir}/pg_ctl -D {self.data} -l {self.data}/log -w " + " ".join(args))

    def database(self, name: str) -> str:
        """A new database ``name``; returns its URL."""
        _as_postgres(f"{self.bindir}/createdb -h 127.0.0.1 -p {self.port} -U postgres {name}")
        return self.url.rsplit("/", 1)[0] + "/" + name

    def outage(self, seconds: float) -> None:
        """Down for ``seconds`` (a fast shutdown: open sessions are ended), then up."""
        self._ctl("-m fast stop")
        time.sleep(seconds)
        self._ctl(f"-o '{self._options}' start")

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ctl("-m immediate stop")
        shutil.rmtree(self.data, ignore_errors=True)


class PrivateS3:
    """moto's S3 in server mode on a free port, reached through a TCP proxy that
    :meth:`outage` takes down (``tests/fakes/tcp_proxy.py``)."""

    def __init__(self) -> None:
        import boto3
        from moto.server import ThreadedMotoServer
        from tcp_proxy import TCPProxy

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        os.environ.update(AWS_ENV)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        self.server.start()
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        self.proxy = TCPProxy(("127.0.0.1", port))
        self.endpoint = f"http://127.0.0.1:{self.proxy.port}"
        os.environ["AWS_ENDPOINT_URL"] = self.endpoint  # the drivers and their workers

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def outage(self, seconds: float) -> None:
        self.proxy.cut()
        time.sleep(seconds)
        self.proxy.restore()

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()


@dataclass
class Services:
    """Where a schedule's plan and checkpoints live, and how its ``db`` and ``store``
    faults are injected (private services, or the user's shell commands)."""

    args: argparse.Namespace
    postgres: PrivatePostgres | None = None
    s3: PrivateS3 | None = None

    def kinds(self) -> list[str]:
        kinds = list(self.args.kinds)
        if self.postgres or self.args.db_restart:
            kinds.append("db")
        if self.s3 or (self.args.store_cut and self.args.store_restore):
            kinds.append("store")
        return kinds

    def storage(self, seed: int, work: Path) -> str:
        if self.postgres:
            return self.postgres.database(f"chaos_{seed}")
        return self.args.storage or f"sqlite:///{work / 'plan.db'}"

    def checkpoints(self, seed: int) -> str | None:
        return self.s3.url(f"chaos-{seed}") if self.s3 else self.args.checkpoints

    def db_fault(self, rng: random.Random) -> None:
        if self.postgres:
            self.postgres.outage(rng.uniform(0.0, self.args.db_down_seconds))
        else:
            subprocess.run(self.args.db_restart, shell=True, check=False)

    def store_fault(self) -> None:
        if self.s3:
            self.s3.outage(self.args.cut_seconds)
        else:
            subprocess.run(self.args.store_cut, shell=True, check=False)
            time.sleep(self.args.cut_seconds)
            subprocess.run(self.args.store_restore, shell=True, check=False)


@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[Services]:
    """The schedules' services: with ``--services`` a private PostgreSQL and S3, stopped
    at the end."""
    out = Services(args)
    try:
        if args.services:
            out.postgres = PrivatePostgres()
            out.s3 = PrivateS3()
        yield out
    finally:
        if out.s3:
            out.s3.close()
        if out.postgres:
            out.postgres.close()


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


def run_schedule(
    seed: int, args: argparse.Namespace, reference: Mapping[str, float], svc: Services
) -> Schedule:
    rng = random.Random(seed)
    sched = Schedule(seed)
    kinds = svc.kinds()
    with tempfile.TemporaryDirectory(prefix="stagetree-chaos-") as tmp:
        work = Path(tmp)
        log = work / "trained.log"
        storage = svc.storage(seed, work)
        checkpoints = svc.checkpoints(seed)
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
        if checkpoints:
            command += ["--checkpoints", checkpoints]
        # The schedule: random kinds, each infrastructure kind at least once.
        faults = [rng.choice(kinds) for _ in range(args.faults)]
        for i, kind in enumerate(k for k in ("db", "store") if k in kinds):
            if kind not in faults and i < len(faults):
                faults[i] = kind
        rng.shuffle(faults)
        clean_before: set[str] | None = None  # what the driver a clean stop ended trained
        proc: subprocess.Popen[str] | None = None
        last_err = ""
        try:
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
                    kind = faults[0]
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
                        svc.db_fault(rng)
                    else:
                        svc.store_fault()
                    sched.injected[kind] += 1
                    faults.pop(0)
                    if args.verbose:
                        print(
                            f"  {time.monotonic():.1f} {kind} after {len(_log_lines(log))} steps",
                            flush=True,
                        )
                    if kind in ("kill", "int"):
                        ended_by = kind
                        break
                try:
                    _, err = proc.communicate(timeout=args.hang_seconds)
                    last_err = err
                except subprocess.TimeoutExpired:
                    proc.kill()
                    sched.hung = True
                    sched.error = f"a driver hung past {args.hang_seconds} s"
                    break
                if args.verbose:
                    steps = len(_log_lines(log))
                    print(f"  {time.monotonic():.1f} driver exit {proc.returncode}, {steps} steps")
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
        finally:  # interrupted (SIGTERM, Ctrl-C): no driver is left behind
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = _log_lines(log)
        sched.recomputed = len(lines) - len(set(lines))
        if not sched.error:
            with _study(storage, version, checkpoints, executor="inline") as study:
                got = results(study)
                lost = weights_lost(study)
                states = Counter(t.state for t in study.trials())
                why = {e.message.splitlines()[0][:300] for _, e in study.failures()}
            sched.exact = got == dict(reference)
            if not sched.exact:
                shown = ", ".join(f"{n} {k}" for k, n in sorted(states.items()))
                sched.error = f"trials {shown}; metrics differ from the reference {sorted(why)}"
            if lost:
                sched.error += f"; {lost} finished trials have no final checkpoint"
        if sched.error and args.logs:  # the last driver's log, to see what happened
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            (Path(args.logs) / f"driver-{seed}.log").write_text(last_err)
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
    p.add_argument("--minutes", type=float, default=0, help="start no schedule after (0: none)")
    p.add_argument("--step-seconds", type=float, default=0.03, help="one step's time")
    p.add_argument("--hang-seconds", type=float, default=120.0, help="a driver's limit")
    p.add_argument(
        "--services",
        action="store_true",
        help="start a private PostgreSQL and S3 (moto behind a TCP proxy) for the plan and "
        "the checkpoints, and add the db and store fault kinds",
    )
    p.add_argument("--db-down-seconds", type=float, default=5.0, help="longest DB outage")
    p.add_argument("--storage", help="plan storage URL (default: a fresh SQLite file)")
    p.add_argument("--checkpoints", help="checkpoint location (default: beside the plan)")
    p.add_argument("--db-restart", metavar="CMD", help="shell command restarting the DB")
    p.add_argument("--store-cut", metavar="CMD", help="shell command cutting the store")
    p.add_argument("--store-restore", metavar="CMD", help="shell command restoring it")
    p.add_argument("--cut-seconds", type=float, default=8.0, help="how long a cut lasts")
    p.add_argument("--verbose", action="store_true", help="print each fault and driver exit")
    p.add_argument(
        "--logs", metavar="DIR", help="keep the last driver's stderr of failed schedules"
    )
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
    # A SIGTERM ends the run through the clean-up below (private services stopped).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with services(args) as svc:
        done = _run_schedules(args, reference, svc, total)
    failed, survived, recomputed, ran = done
    injected = sum(total.values())
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(total.items()))
    print(
        f"{ran} schedules, {failed} failed; faults injected {injected} ({kinds}), "
        f"survived {survived}; steps recomputed {recomputed}"
    )
    return 1 if failed else 0


def _run_schedules(
    args: argparse.Namespace, reference: Mapping[str, float], svc: Services, total: Counter[str]
) -> tuple[int, int, int, int]:
    """Run the schedules (until ``--minutes`` are spent); returns failed, survived,
    recomputed and how many ran."""
    failed = survived = recomputed = ran = 0
    end = time.monotonic() + 60 * args.minutes if args.minutes else None
    for i in range(args.schedules):
        if end is not None and time.monotonic() > end:
            break
        ran += 1
        begin = time.monotonic()
        sched = run_schedule(args.seed + i, args, reference, svc)
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
    return failed, survived, recomputed, ran


if __name__ == "__main__":
    sys.exit(main())
