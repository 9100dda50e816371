"""Checkpoint save and load time: a local directory against S3 (moto in server mode on
127.0.0.1, reached through s3fs), side by side in one run.

States: the digits demo's trainer (``examples/digits.py``: DigitsTrainer after one step,
model + optimizer + RNGs + loader position) and a synthetic state of ``--mb`` MiB of
float32 (a mid-sized model), each saved and loaded ``--repeats`` times per backend,
backends interleaved; the table gives medians in milliseconds.

* ``save``: ``CheckpointStore.save`` (encode, write, fsync + rename / one PUT);
* ``load``: ``CheckpointStore.load`` from a reader without a read cache (a download);
* ``load cached``: a reader whose local read cache holds the checkpoint (S3 only: a
  ranged GET of the header, then local disk).

moto keeps objects in memory in this process, so S3 here measures the protocol and
s3fs's overhead on loopback, not a real network: a lower bound for a real bucket.

Run: ``.venv/bin/python benchmarks/checkpoint_bench.py [--repeats 15] [--mb 16]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import machine_info, markdown_table, median

from stagetree.checkpoints import CheckpointStore

ROOT = Path(__file__).resolve().parent.parent


def digits_state() -> dict[str, Any]:
    """The demo trainer's state after one step."""
    from stagetree.torch.examples import DigitsTrainer

    spec = importlib.util.spec_from_file_location("digits_demo", ROOT / "examples" / "digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trial = next(iter(module.space))
    trainer = DigitsTrainer(trial.config)
    trainer.setup({name: seq(0) for name, seq in trial.hp.items()})
    trainer.train()
    return dict(trainer.state_dict())


def synthetic_state(mib: float) -> dict[str, Any]:
    n = int(mib * 1024 * 1024 / 4)
    rng = np.random.default_rng(0)
    return {"weights": rng.standard_normal(n, dtype=np.float32), "step": 1}


def timed(fn: Callable[[], Any]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--mb", type=float, default=16.0)
    args = parser.parse_args()

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    options = {"client_kwargs": {"endpoint_url": endpoint}}

    states = {
        "digits (DigitsTrainer)": digits_state(),
        f"{args.mb:g} MiB": synthetic_state(args.mb),
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        writers = {
            "local disk": CheckpointStore(Path(tmp) / "local"),
            "S3 (moto)": CheckpointStore(
                "s3://bench/run", storage_options=options, cache_dir=Path(tmp) / "wcache"
            ),
        }
        readers = {
            "local disk": CheckpointStore(Path(tmp) / "local"),
            "S3 (moto)": CheckpointStore("s3://bench/run", storage_options=options, cache_bytes=0),
        }
        cached = CheckpointStore(
            "s3://bench/run", storage_options=options, cache_dir=Path(tmp) / "rcache"
        )
        for label, state in states.items():
            times: dict[tuple[str, str], list[float]] = {}
            nbytes = 0
            for i in range(args.repeats):
                for backend, store in writers.items():
                    name = f"b{i}"
                    times.setdefault((backend, "save"), []).append(
                        timed(lambda s=store, n=name, st=state: s.save(n, st))
                    )
                    ref = f"{name}.ckpt"
                    nbytes = store.size(ref)
                    times.setdefault((backend, "load"), []).append(
                        timed(lambda r=readers[backend], f=ref: r.load(f))
                    )
                    if backend == "S3 (moto)":
                        cached.load(ref)  # fills the cache
                        times.setdefault((backend, "cached"), []).append(
                            timed(lambda f=ref: cached.load(f))
                        )
                    store.delete(ref)
            for backend in writers:
                ms = {op: median(times.get((backend, op), [])) for op in ("save", "load", "cached")}
                rows.append(
                    [
                        label,
                        f"{nbytes / 1024 / 1024:.2f}",
                        backend,
                        None if ms["save"] is None else 1000 * ms["save"],
                        None if ms["load"] is None else 1000 * ms["load"],
                        None if ms["cached"] is None else 1000 * ms["cached"],
                    ]
                )
    server.stop()
    info = machine_info()
    print(", ".join(f"{k}: {v}" for k, v in info.items()))
    print(f"median of {args.repeats}, milliseconds\n")
    print(
        markdown_table(
            ["state", "MiB", "backend", "save ms", "load ms", "load cached ms"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
