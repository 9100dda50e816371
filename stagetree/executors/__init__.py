"""Executors carry out the scheduler's instructions on workers and report events.

* :class:`BaseExecutor`: the contract every executor follows.
* :class:`LocalExecutor`: worker processes on this machine, one per device.
* :class:`InlineExecutor`: batches run synchronously in the calling thread.
* :class:`RayExecutor`: Ray actors, one per worker slot, on a cluster
  (``pip install 'stagetree[ray]'``; Ray itself is imported when it starts).
* :class:`SimulatedExecutor`: virtual time, a cost model and synthetic learning curves
  (``stagetree simulate``; no training at all).
* :func:`register_executor`: executors by name (``Study(executor="local")``).
* :func:`worker_devices`: the devices a worker owns (``devices_per_worker``; see
  :mod:`stagetree.executors.devices`).

Every executor serves several trainers with one pool of workers: its own trainer, and
those added with :meth:`BaseExecutor.add_trainer`, chosen per batch by
``RunBatch.trainer``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagetree.executors.base import BaseExecutor, ExecutorOptions
    from stagetree.executors.devices import worker_devices
    from stagetree.executors.inline import InlineExecutor
    from stagetree.executors.local import LocalExecutor, TrainerSpec
    from stagetree.executors.ray import RayExecutor
    from stagetree.executors.registry import executor_names, make_executor, register_executor
    from stagetree.executors.simulated import SimulatedExecutor

# Loaded on first use: a worker process imports only the modules it runs
# (stagetree.executors._process and the worker), not every executor.
_WHERE = {
    "BaseExecutor": "base",
    "ExecutorOptions": "base",
    "InlineExecutor": "inline",
    "LocalExecutor": "local",
    "RayExecutor": "ray",
    "SimulatedExecutor": "simulated",
    "TrainerSpec": "local",
    "executor_names": "registry",
    "make_executor": "registry",
    "register_executor": "registry",
    "worker_devices": "devices",
}

__all__ = [
    "BaseExecutor",
    "ExecutorOptions",
    "InlineExecutor",
    "LocalExecutor",
    "RayExecutor",
    "SimulatedExecutor",
    "TrainerSpec",
    "executor_names",
    "make_executor",
    "register_executor",
    "worker_devices",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
