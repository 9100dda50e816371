"""What a worker spends to restore a model from a checkpoint and to evaluate it, next to
what reading the checkpoint's bytes costs (issue 22, item 3).

Trainers: the peer race's ``EpochConvTrainer`` (``vs_peers.py --study race-*``: a
32-channel CNN, about 20,000 parameters, SGD with momentum) and the digits example's
``DigitsTrainer`` (an MLP), each after one training step, its state saved to a local
checkpoint directory. Per trainer, medians over ``--repeats`` interleaved rounds, in
milliseconds:

* ``store.save``: ``CheckpointStore.save`` of the state (encode, write, fsync, rename;
  a worker does it in the background while training goes on);
* ``read``: the checkpoint file's bytes (the page cache holds them, as on a worker that
  loads what was just written);
* ``read + sha256``: the bytes and their checksum (every load verifies it);
* ``store.load``: ``CheckpointStore.load``: read, verify, decode (the state);
* ``build``: a fresh trainer (``Trainer(config)``), which a load restores into;
* ``load_state_dict``: restoring the decoded state into it;
* ``load path``: the three together, what a worker's batch start waits for;
* ``evaluate``: ``evaluate()``'s own body (under ``torch.no_grad()``, modules in eval
  mode, nothing kept or restored);
* ``evaluate, worker``: ``evaluate()`` as a worker calls it (``evaluate_metrics``),
  TorchTrainer's RNG and mode keeping included; in a worker process (the caller's
  random generators are nobody's, where this stagetree knows that) and in a user's
  process (they are put back).

And, once, in a fresh Python process (a cold worker): the first ``build`` of the race's
trainer after ``warmup()`` (what a worker does before its first batch), against the
second one.

Run: ``.venv/bin/python benchmarks/load_bench.py [--repeats 200]`` (about 20 s); run it
on two checkouts to compare them (it uses only what both have).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _common import EpochConvTrainer, machine_info, markdown_table, median

from stagetree import trainer as core_trainer
from stagetree.checkpoints import CheckpointStore
from stagetree.executors.worker import evaluate_metrics, snapshot_state
from stagetree.torch.examples import DigitsTrainer

TRAINERS: dict[str, tuple[type[Any], dict[str, Any], dict[str, Any]]] = {
    "race CNN (EpochConvTrainer)": (
        EpochConvTrainer,
        {"optimizer": "momentum", "channels": 32, "seed": 0},
        {"lr": 0.1, "batch_size": 64, "momentum": 0.9},
    ),
    "digits MLP (DigitsTrainer)": (
        DigitsTrainer,
        {"optimizer": "momentum", "seed": 0},
        {"lr": 0.1, "batch_size": 64, "momentum": 0.9},
    ),
}


def timed(fn: Callable[[], Any]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


@contextlib.contextmanager
def worker_process(kept: bool) -> Iterator[bool]:
    """The caller's generators kept (a user's process) or not (a worker process), where
    this stagetree can say so; yields whether the setting applies."""
    keep = getattr(core_trainer, "keep_caller_rng", None)
    if keep is None:
        yield kept
        return
    keep(kept)
    try:
        yield True
    finally:
        keep(True)


def raw_evaluate(trainer: Any) -> Callable[[], Any]:
    """``evaluate()``'s own body, without what TorchTrainer wraps around it (``trainer``'s
    modules are put in eval mode once, here)."""
    body = getattr(type(trainer).evaluate, "__wrapped__", type(trainer).evaluate)
    for module in vars(trainer).values():
        if isinstance(module, torch.nn.Module):
            module.eval()

    def run() -> Any:
        with torch.no_grad():
            return body(trainer)

    return run


def measure(label: str, repeats: int, tmp: Path) -> list[Any]:
    cls, config, hp = TRAINERS[label]
    trainer = cls(config)
    trainer.setup(hp)
    trainer.train()
    store = CheckpointStore(tmp / label.split()[0])
    info = store.save("bench", snapshot_state(trainer.state_dict()))
    path = tmp / label.split()[0] / info.ref
    state = store.load(info.ref)
    fresh = cls(config)
    evaluating, bare = cls(config), cls(config)
    for t in (evaluating, bare):
        t.setup(hp)
        t.train()

    def load_path() -> None:
        restored = cls(config)
        restored.load_state_dict(store.load(info.ref))

    def worker_eval(kept: bool) -> Callable[[], Any]:
        def run() -> None:
            with worker_process(kept):
                evaluate_metrics(evaluating)

        return run

    ops: dict[str, Callable[[], Any]] = {
        "store.save": lambda: store.save("again", state),
        "read": path.read_bytes,
        "read + sha256": lambda: hashlib.sha256(path.read_bytes()).digest(),
        "store.load": lambda: store.load(info.ref),
        "build": lambda: cls(config),
        "load_state_dict": lambda: fresh.load_state_dict(state),
        "load path": load_path,
        "evaluate": raw_evaluate(bare),
        "evaluate, worker process": worker_eval(False),
        "evaluate, user process": worker_eval(True),
    }
    times: dict[str, list[float]] = {op: [] for op in ops}
    for _ in range(repeats + 1):
        for op, fn in ops.items():
            times[op].append(timed(fn))
    ms = {op: 1000 * (median(t[1:]) or 0.0) for op, t in times.items()}
    return [label, info.nbytes / 1024, *ms.values()]


COLD = """
import sys, time
sys.path.insert(0, {here!r})
import torch
torch.set_num_threads(1)
from _common import EpochConvTrainer
EpochConvTrainer.warmup()
config = {{"optimizer": "momentum", "channels": 32, "seed": 0}}
times = []
for _ in range(2):
    begin = time.perf_counter()
    EpochConvTrainer(config)
    times.append(time.perf_counter() - begin)
print(*times)
"""


def cold_builds() -> tuple[float, float]:
    """Seconds of the first and the second build of the race's trainer in a fresh
    process, after ``warmup()``."""
    code = COLD.format(here=str(Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = (float(x) for x in out.stdout.split())
    return first, second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = machine_info()
    print(
        f"{info['date']}; {info['nproc']} cores, {info['cpu']}; torch {info.get('torch')}; "
        f"load {info['load']}; 1 torch thread; medians of {args.repeats}, in ms\n"
    )
    with tempfile.TemporaryDirectory(prefix="load-bench-") as tmp:
        rows = [measure(label, args.repeats, Path(tmp)) for label in TRAINERS]
    headers = [
        "trainer",
        "KiB",
        "store.save",
        "read",
        "read + sha256",
        "store.load",
        "build",
        "load_state_dict",
        "load path",
        "evaluate",
        "evaluate, worker process",
        "evaluate, user process",
    ]
    print(markdown_table(headers, rows))
    first, second = cold_builds()
    print(
        f"\nA cold worker (a fresh process, after warmup()): the race trainer's first build "
        f"{1000 * first:.1f} ms, its second {1000 * second:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
