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
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "check_devices_per_worker",
    "check_parallel_efficiency",
    "data_parallel_speedup",
    "device_groups",
    "worker_devices",
]


def check_devices_per_worker(devices_per_worker: Any) -> int:
    """``devices_per_worker`` if it is an int >= 1.

    Raises:
        ValueError: otherwise.
    """
    k = devices_per_worker
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"devices_per_worker must be a positive int, got {k!r}")
    return k


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
    device_ids: Sequence[str], devices_per_worker: int, num_workers: int | None
) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each worker (None: not pinned).

    With one device per worker, workers take the devices round-robin (several workers
    may share one when there are more workers than devices; none is pinned without
    devices). With ``k > 1``, worker ``w`` owns devices ``w*k .. w*k+k-1`` alone, and
    the default worker count is ``len(device_ids) // k``.

    Raises:
        ValueError: ``k > 1`` and fewer than ``k`` devices, or ``num_workers * k``
            more than the devices.
    """
    k = check_devices_per_worker(devices_per_worker)
    ids = [str(d) for d in device_ids]
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


def worker_devices() -> list[str]:
    """The devices this worker owns, as physical ids (``CUDA_VISIBLE_DEVICES``, which
    the local executor sets for each worker and Ray for each actor); ``[]`` when the
    process is not pinned. In torch, the worker's devices are ``cuda:0`` ..
    ``cuda:{len(worker_devices()) - 1}``. An empty ``CUDA_VISIBLE_DEVICES`` (no device
    at all) gives ``[]`` as well."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [d.strip() for d in visible.split(",") if d.strip()]
