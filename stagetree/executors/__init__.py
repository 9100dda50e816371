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

from stagetree.executors.base import BaseExecutor, ExecutorOptions
from stagetree.executors.devices import worker_devices
from stagetree.executors.local import InlineExecutor, LocalExecutor, TrainerSpec
from stagetree.executors.ray import RayExecutor
from stagetree.executors.registry import executor_names, make_executor, register_executor
from stagetree.executors.simulated import SimulatedExecutor

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
