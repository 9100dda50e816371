"""Executors by name: ``Study(executor="local")`` looks its factory up here.

A factory takes what a study knows about its workers and returns a
:class:`~stagetree.executors.base.BaseExecutor`; :func:`register_executor` adds one
(a plugin, e.g. a cluster executor). Names are checked when the study is built, before
anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagetree.executors.base import BaseExecutor, ExecutorOptions
from stagetree.executors.inline import InlineExecutor
from stagetree.executors.local import LocalExecutor
from stagetree.executors.ray import RayExecutor
from stagetree.executors.simulated import SimulatedExecutor

__all__ = ["check_executor", "executor_names", "make_executor", "register_executor"]


ExecutorFactory = Callable[[ExecutorOptions], BaseExecutor]


def _local(o: ExecutorOptions) -> BaseExecutor:
    return LocalExecutor(
        o.trainer,
        num_workers=o.workers,
        checkpoint_dir=o.checkpoint_dir,
        threads_per_worker=o.threads_per_worker,
        devices_per_worker=o.devices_per_worker,
        step_timeout=o.step_timeout,
    )


def _inline(o: ExecutorOptions) -> BaseExecutor:
    if o.devices_per_worker != 1:
        raise ValueError(
            f"the inline executor trains in this process, on its devices: "
            f"devices_per_worker={o.devices_per_worker} needs executor='local' or 'ray'"
        )
    return InlineExecutor(o.trainer, checkpoint_dir=o.checkpoint_dir)


def _simulated(o: ExecutorOptions) -> BaseExecutor:
    return SimulatedExecutor(num_workers=o.workers or 1, devices_per_worker=o.devices_per_worker)


def _ray(o: ExecutorOptions) -> BaseExecutor:
    return RayExecutor(address=o.address).bind(o)


_REGISTRY: dict[str, ExecutorFactory] = {
    "local": _local,
    "inline": _inline,
    "simulated": _simulated,
    "ray": _ray,
}


def register_executor(name: str, factory: ExecutorFactory) -> None:
    """Make ``Study(executor=name)`` build its executor with ``factory(options)``.

    Raises:
        ValueError: ``name`` is not a non-empty string or is taken.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an executor name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"executor {name!r} is already registered")
    _REGISTRY[name] = factory


def executor_names() -> list[str]:
    """Registered executor names, sorted."""
    return sorted(_REGISTRY)


def check_executor(executor: Any) -> None:
    """Raise ``ValueError`` unless ``executor`` is a registered name, an executor object
    or a factory."""
    if isinstance(executor, BaseExecutor):
        return
    if isinstance(executor, str):
        if executor not in _REGISTRY:
            names = ", ".join(repr(n) for n in executor_names())
            raise ValueError(f"unknown executor {executor!r}: use one of {names} or a factory")
    elif not callable(executor):
        raise ValueError(
            f"executor must be a name ({', '.join(executor_names())}) or a factory "
            f"returning a BaseExecutor, got {executor!r}"
        )


def make_executor(executor: Any, options: ExecutorOptions) -> BaseExecutor:
    """Build the executor named ``executor``, bind an executor object to the study's
    options (:meth:`BaseExecutor.bind`), or call a factory taking no argument."""
    check_executor(executor)
    if isinstance(executor, BaseExecutor):
        return executor.bind(options)
    if isinstance(executor, str):
        return _REGISTRY[executor](options)
    return executor()
