"""Workers that own several devices: argument checks, device groups, what a trainer sees.

A worker with ``devices_per_worker = k`` owns ``k`` devices and trains every batch on
all of them (data-parallel: ``torch.nn.DataParallel``, or DDP over the worker's
devices). It is gang-scheduled by construction: a batch gets the whole worker, never
part of it.

* :class:`~stagetree.executors.local.LocalExecutor` pins worker ``w`` to ``k`` devices
  of its own (``CUDA_VISIBLE_DEVICES`` lists their physical ids), so that
  ``torch.cuda.device_count() == k`` in the worker and its devices are ``cuda:0`` ..
  ``cuda:{k-1}``.
* :class:`~stagetree.executors.ray.RayExecutor` asks Ray for ``{"GPU": k}`` per actor;
  Ray sets ``CUDA_VISIBLE_DEVICES`` of each actor to the GPUs it assigned.
* :class:`~stagetree.executors.simulated.SimulatedExecutor` divides a step's cost by
  :func:`data_parallel_speedup` and counts a busy worker ``k`` times in device-seconds.

Inside a trainer, :func:`worker_devices` returns the ids the worker owns, whichever
executor started it.

Mixed clusters and device needs (TreeML §5.2): workers may own different numbers of
devices (``devices_per_worker=[1, 1, 2, 4]`` on the local and simulated executors), and
a trainer may declare the devices one of its trials needs (``Trainer.devices_needed``,
an int or a function of the fixed config; :func:`trainer_devices`). The scheduler gives
a stage only to a worker with at least that many devices. A CUDA out-of-memory error
(:func:`is_out_of_memory`) is no plain failure: the worker reports it as
``BatchFailed(kind="oom")`` and the scheduler plans the stage again on a worker with
twice the devices, up to the largest worker; the learned need is kept in the plan for
that plan tree. A fused job that runs out of memory is trained again at half its width
first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "check_devices_per_worker",
    "check_parallel_efficiency",
    "check_worker_devices",
    "data_parallel_speedup",
    "device_count",
    "device_groups",
    "is_out_of_memory",
    "trainer_devices",
    "worker_devices",
]

# What a CUDA out-of-memory error says when it is a plain RuntimeError (torch < 2.0,
# and errors re-raised by libraries without their class).
_OOM_TEXT = "CUDA out of memory"


def check_devices_per_worker(devices_per_worker: Any) -> int:
    """``devices_per_worker`` if it is an int >= 1.

    Raises:
        ValueError: otherwise.
    """
    k = devices_per_worker
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"devices_per_worker must be a positive int, got {k!r}")
    return k


def check_worker_devices(devices_per_worker: Any) -> list[int] | None:
    """The device count of every worker of a mixed cluster (``devices_per_worker`` a
    sequence of ints >= 1), or None for an int (every worker the same).

    Raises:
        ValueError: neither an int >= 1 nor a non-empty sequence of them.
    """
    if isinstance(devices_per_worker, (list, tuple)):
        if not devices_per_worker:
            raise ValueError("devices_per_worker must not be an empty list")
        return [check_devices_per_worker(k) for k in devices_per_worker]
    check_devices_per_worker(devices_per_worker)
    return None


def trainer_devices(trainer: Any, config: Mapping[str, Any]) -> int:
    """The devices one trial of ``trainer`` with fixed ``config`` needs: the trainer's
    ``devices_needed``, an int or a function ``config -> int`` (a classmethod or
    staticmethod); 1 when it declares none.

    Raises:
        ValueError: the declared need is not an int >= 1.
    """
    need = getattr(trainer, "devices_needed", None)
    if need is None:
        return 1
    if callable(need):
        need = need(dict(config))
    if isinstance(need, bool) or not isinstance(need, int) or need < 1:
        name = getattr(trainer, "__qualname__", repr(trainer))
        raise ValueError(f"{name}.devices_needed must be a positive int, got {need!r}")
    return need


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` (or an exception it was raised from) is a CUDA out-of-memory
    error: ``torch.cuda.OutOfMemoryError`` (found by name, so that no torch import is
    needed), or a ``RuntimeError`` saying "CUDA out of memory"."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        kind = type(error)
        if any(c.__name__ == "OutOfMemoryError" for c in kind.__mro__):
            return True
        if isinstance(error, RuntimeError) and _OOM_TEXT in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def check_parallel_efficiency(parallel_efficiency: Any) -> float:
    """``parallel_efficiency`` as a float if it is a number in (0, 1].

    Raises:
        ValueError: otherwise.
    """
    e = parallel_efficiency
    ok = not isinstance(e, bool) and isinstance(e, (int, float)) and math.isfinite(e)
    if not ok or not 0.0 < e <= 1.0:
        raise ValueError(
            f"parallel_efficiency must be a number in (0, 1], got {parallel_efficiency!r}"
        )
    return float(e)


def data_parallel_speedup(devices: int, efficiency: float) -> float:
    """``1 + (devices - 1) * efficiency``: how many times faster ``devices`` devices
    train a step data-parallel than one, each added device contributing ``efficiency``
    of one (1.0: linear scaling)."""
    return 1.0 + (devices - 1) * efficiency


def device_groups(
    device_ids: Sequence[str], devices_per_worker: int | Sequence[int], num_workers: int | None
) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each worker (None: not pinned).

    With one device per worker, workers take the devices round-robin (several workers
    may share one when there are more workers than devices; none is pinned without
    devices). With ``k > 1``, worker ``w`` owns devices ``w*k .. w*k+k-1`` alone, and
    the default worker count is ``len(device_ids) // k``. A mixed cluster
    (``devices_per_worker`` a list ``[k0, k1, ...]``, one entry a worker) gives worker
    ``w`` the next ``k_w`` devices, alone.

    Raises:
        ValueError: ``k > 1`` and fewer than ``k`` devices, or ``num_workers * k``
            more than the devices; a list that needs more devices than there are, or
            whose length is not ``num_workers``.
    """
    mixed = check_worker_devices(devices_per_worker)
    ids = [str(d) for d in device_ids]
    if mixed is not None:
        if num_workers is not None and num_workers != len(mixed):
            raise ValueError(
                f"devices_per_worker lists {len(mixed)} workers, but num_workers={num_workers}"
            )
        if sum(mixed) > len(ids):
            raise ValueError(
                f"devices_per_worker={mixed} needs {sum(mixed)} devices, but {len(ids)} "
                f"are visible ({', '.join(ids) or 'none'}; CUDA_VISIBLE_DEVICES or the "
                "executor's devices=)"
            )
        bounds = [sum(mixed[:w]) for w in range(len(mixed) + 1)]
        return [",".join(ids[bounds[w] : bounds[w + 1]]) for w in range(len(mixed))]
    k = check_devices_per_worker(devices_per_worker)
    if k == 1:
        count = max(1, len(ids)) if num_workers is None else num_workers
        return [ids[w % len(ids)] if ids else None for w in range(count)]
    seen = ", ".join(ids) if ids else "none"
    if len(ids) < k:
        raise ValueError(
            f"devices_per_worker={k} needs at least {k} devices, but {len(ids)} are "
            f"visible ({seen}; CUDA_VISIBLE_DEVICES or the executor's devices=)"
        )
    if num_workers is None:
        num_workers = len(ids) // k
    elif num_workers * k > len(ids):
        raise ValueError(
            f"{num_workers} workers x devices_per_worker={k} need {num_workers * k} "
            f"devices, but {len(ids)} are visible ({seen}): ask for at most "
            f"{len(ids) // k} workers or fewer devices per worker"
        )
    return [",".join(ids[w * k : (w + 1) * k]) for w in range(num_workers)]


def device_count(visible: str | None) -> int:
    """Devices of a worker pinned to ``visible`` (its ``CUDA_VISIBLE_DEVICES``; None or
    empty: not pinned, counted as one)."""
    return max(1, len([d for d in (visible or "").split(",") if d.strip()]))


def worker_devices() -> list[str]:
    """The devices this worker owns, as physical ids (``CUDA_VISIBLE_DEVICES``, which
    the local executor sets for each worker and Ray for each actor); ``[]`` when the
    process is not pinned. In torch, the worker's devices are ``cuda:0`` ..
    ``cuda:{len(worker_devices()) - 1}``. An empty ``CUDA_VISIBLE_DEVICES`` (no device
    at all) gives ``[]`` as well."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [d.strip() for d in visible.split(",") if d.strip()]
