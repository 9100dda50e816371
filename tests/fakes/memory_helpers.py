"""Helpers of the memory-per-trial tests: a study on simulated workers with its plan in
memory, and the bytes a group of objects reaches."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

from stagetree.executors.simulated import SimulatedExecutor, SimulatedTrainer
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.study import Study


def simulated_study(tmp: str, workers: int = 4) -> Study:
    """A study ``"mem"`` on ``workers`` simulated workers, its plan in memory and its
    checkpoints under ``tmp``."""
    executor = SimulatedExecutor(workers)
    return Study(
        "mem",
        SimulatedTrainer,
        storage=MemoryPlanStorage(),
        workers=workers,
        checkpoint_dir=str(Path(tmp) / "ckpt"),
        executor=lambda: executor,
    )


def reached_bytes(roots: list[Any], seen: set[int]) -> int:
    """Bytes of the objects ``roots`` reach that ``seen`` lacks (added to it; classes
    are not followed)."""
    size, stack = 0, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        size += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return size
