"""The tuning server's costs, side by side with an in-process study in one run.

A ``stagetree serve`` process on a free loopback port (fresh SQLite plan, local workers)
and, next to it, the same study in this process:

1. **Submit overhead**: ``await study.submit(...)`` of a trial whose metrics the plan
   already holds (nothing trains: the call is pure front-end cost), ``--repeats`` times
   one after another, local vs remote; median and p99 in milliseconds.
2. **Results delivered per second** to 1, 10 and 100 concurrent clients (each a
   RemoteStudy in its own thread, each submitting ``--per-client`` known trials at once
   and awaiting them).
3. **The digits study end to end** (``examples/digits.py``: ASHA over 16 trials of an
   MLP on scikit-learn's digits, 2 workers) through the server vs in-process, each on a
   fresh storage (and, on the server, a trainer version of its own, so that nothing is
   answered from an earlier run), alternating (``--digits-repeats`` runs each). An
   in-process study starts its own workers every time; the server's pool is started
   once, so its first run pays for loading the trainer on its workers and later runs do
   not: the table shows the first run and the median of the later ones separately.

Run: ``.venv/bin/python benchmarks/server_bench.py [--repeats 300] [--skip-digits]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import machine_info, markdown_table

from stagetree import Study
from stagetree.hp import Constant
from stagetree.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


class TinyTrainer(Trainer):
    """One multiply-add per step: the trainer costs nothing next to the front end."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.w = float(config.get("seed", 0))
        self.lr = 0.0

    def setup(self, hp: Any) -> None:
        self.lr = float(hp["lr"])

    def train(self) -> dict[str, float]:
        self.w = self.w * (1 - self.lr) + self.lr
        return {}

    def evaluate(self) -> dict[str, float]:
        return {"score": self.w}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: Any) -> None:
        self.w = float(state["w"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``stagetree serve`` in a subprocess."""

    def __init__(self, tmp: Path, workers: int = 2) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        token_file = tmp / "token"
        self.token = secrets.token_urlsafe(24)
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        exe = Path(sys.executable).with_name("stagetree")
        cmd = [str(exe), "serve", "--storage", f"sqlite:///{tmp}/server.db"]
        cmd += ["--workers", str(workers), "--port", str(self.port)]
        cmd += ["--token-file", str(token_file), "--checkpoints", str(tmp / "server-ckpt")]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(ROOT)])
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("the server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _ms(values: list[float]) -> tuple[str, str]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.median(ordered) * 1e3:.2f}", f"{p99 * 1e3:.2f}"


async def _timed_submits(study: Study, repeats: int) -> list[float]:
    out = []
    for i in range(repeats):
        seed = i % 8
        t0 = time.perf_counter()
        await study.submit({"seed": seed}, {"lr": Constant(0.1)}, 2)
        out.append(time.perf_counter() - t0)
    return out


def submit_overhead(local: Study, remote: Study, repeats: int) -> list[list[str]]:
    for study in (local, remote):  # train the 8 trials once: later submits are known
        asyncio.run(_timed_submits(study, 8))
    rows = []
    for label, study in (("in-process", local), ("remote (loopback)", remote)):
        times = asyncio.run(_timed_submits(study, repeats))
        rows.append([label, *_ms(times)])
    return rows


def delivery(server: Server, clients: int, per_client: int) -> float:
    """Results per second delivered to ``clients`` concurrent remote studies."""
    studies = [
        Study(f"deliver-{clients}-{i}", TinyTrainer, url=server.url, token=server.token)
        for i in range(clients)
    ]

    async def one(study: Study) -> None:
        await asyncio.gather(
            *(study.submit({"seed": s % 8}, {"lr": Constant(0.1)}, 2) for s in range(per_client))
        )

    for study in studies:  # connect first: sessions are not what is measured
        study.open()
    barrier = threading.Barrier(clients + 1)

    def run(study: Study) -> None:
        barrier.wait()
        asyncio.run(one(study))

    threads = [threading.Thread(target=run, args=(s,)) for s in studies]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for study in studies:
        study.close()
    return clients * per_client / elapsed


def digits(server: Server | None, tmp: Path) -> float:
    """Seconds of examples/digits.py's study, in-process (``server`` None) or remote."""
    sys.path.insert(0, str(ROOT / "examples"))
    os.environ["STAGETREE_STORAGE"] = f"sqlite:///{tmp}/digits-{secrets.token_hex(4)}.db"
    import importlib

    module = importlib.import_module("digits")
    module.study.close()  # the script's own study (never opened): build ours
    kwargs: dict[str, Any] = {"storage": os.environ["STAGETREE_STORAGE"], "workers": 2}
    if server is not None:
        kwargs = {"url": server.url, "token": server.token}
    name = f"digits-{secrets.token_hex(4)}"
    # A version of its own: the server's storage would otherwise answer a repeated run
    # from the plan (studies of one trainer version share every stage).
    kwargs["version"] = name
    with Study(name, module.DigitsTrainer, **kwargs) as study:
        t0 = time.perf_counter()
        study.tune(module.tuner)
        return time.perf_counter() - t0


def _runs(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--per-client", type=int, default=20)
    parser.add_argument("--skip-digits", action="store_true")
    parser.add_argument("--digits-repeats", type=int, default=3)
    args = parser.parse_args()
    print(markdown_table(["fact", "value"], [[k, v] for k, v in machine_info().items()]))
    with tempfile.TemporaryDirectory(prefix="stagetree-server-bench-") as d:
        tmp = Path(d)
        server = Server(tmp)
        try:
            local = Study(
                "submit-local", TinyTrainer, storage=f"sqlite:///{tmp}/local.db", workers=1
            )
            remote = Study("submit-remote", TinyTrainer, url=server.url, token=server.token)
            rows = submit_overhead(local, remote, args.repeats)
            local.close()
            remote.close()
            print("\n### Submit of a known trial (ms)\n")
            print(markdown_table(["front end", "median", "p99"], rows))
            rows = []
            for clients in (1, 10, 100):
                rate = delivery(server, clients, args.per_client)
                rows.append([str(clients), str(clients * args.per_client), f"{rate:.0f}"])
            print("\n### Results delivered per second\n")
            print(markdown_table(["clients", "results", "results/s"], rows))
            if not args.skip_digits:
                # Alternate the two, each on a fresh storage, so that neither is always
                # the cold (first) one; medians of --digits-repeats runs each.
                here, there = [], []
                for _ in range(args.digits_repeats):
                    here.append(digits(None, tmp))
                    there.append(digits(server, tmp))
                h, t = statistics.median(here), statistics.median(there[1:] or there)
                print(
                    f"\n### The digits study (examples/digits.py, 2 workers; in-process: "
                    f"median of {args.digits_repeats})\n"
                )
                rows = [
                    ["in-process (new workers each run)", f"{h:.1f}", _runs(here), "1.00"],
                    [
                        "through the server, first run (trainer new to its workers)",
                        f"{there[0]:.1f}",
                        _runs(there[:1]),
                        f"{there[0] / h:.2f}",
                    ],
                ]
                if len(there) > 1:
                    rows.append(
                        [
                            "through the server, later runs (median)",
                            f"{t:.1f}",
                            _runs(there[1:]),
                            f"{t / h:.2f}",
                        ]
                    )
                print(markdown_table(["run", "seconds", "each run", "ratio"], rows))
        finally:
            server.close()


if __name__ == "__main__":
    main()
