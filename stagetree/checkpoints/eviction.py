"""Which checkpoints the plan still needs, and the checkpoint budget's eviction.

One rule decides what is *needed* (:func:`needed_checkpoints`), for both the checkpoint
budget's eviction (:func:`eviction_candidates`, :func:`evict_to_budget`, which the
engine calls) and ``stagetree gc`` (:func:`stagetree.tools.gc.collect_garbage`): the
latest checkpoint on the path of every live (pending or scheduled) request at or
before its step, which is where its training starts, and the same for every live
stage lease (a batch another engine is training). A needed checkpoint is never
removed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from stagetree.checkpoints.store import CheckpointStore, EvictionInfo, eviction_order
from stagetree.exceptions import CheckpointError
from stagetree.plan.model import Node, RequestState

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage, CheckpointRecord

__all__ = [
    "Key",
    "evict_to_budget",
    "eviction_candidates",
    "latest_checkpoint",
    "needed_checkpoints",
]

logger = logging.getLogger("stagetree")

#: A canonical ``(node, step)``: where a checkpoint's model is.
Key = tuple[int, int]


def latest_checkpoint(
    path: Sequence[Node], steps_by_node: Mapping[int, Iterable[int]], step: int
) -> Key | None:
    """The checkpoint training to ``step`` along ``path`` starts from: the canonical
    ``(node, step)`` with a checkpoint (``steps_by_node``: node -> its checkpointed
    steps) at the largest step ``<= step`` on the path; None when there is none."""
    best: Key | None = None
    for i, node in enumerate(path):
        hi = min(path[i + 1].branch_step if i + 1 < len(path) else step, step)
        for s in steps_by_node.get(node.id, ()):
            if s <= hi and (best is None or s >= best[1]):
                best = (node.id, s)
    return best


def _steps_by_node(records: Iterable[Key]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for node, step in records:
        out.setdefault(node, []).append(step)
    return out


class _Paths:
    """``storage.path`` with a cache (one plan read per node)."""

    def __init__(self, storage: BasePlanStorage) -> None:
        self.storage = storage
        self._cache: dict[int, list[Node]] = {}

    def __call__(self, node: int) -> list[Node]:
        path = self._cache.get(node)
        if path is None:
            path = self._cache[node] = list(self.storage.path(node))
        return path


def needed_checkpoints(
    storage: BasePlanStorage,
    records: Mapping[Key, CheckpointRecord] | None = None,
    now: float | None = None,
) -> dict[str, int]:
    """The checkpoints live work starts from: ref -> how many references of live
    requests start there (0 for one only a live stage lease needs).

    Live work is every pending or scheduled request (its start: the latest checkpoint
    on its path at or before its step) and every live stage lease, a batch some engine
    is training (the latest checkpoint at or before the lease's first step).

    Args:
        records: the plan's checkpoint records, when the caller has read them.
        now: ``time.time()`` that decides which leases are live.
    """
    records = storage.checkpoints() if records is None else records
    if not records:
        return {}
    by_node = _steps_by_node(records)
    paths = _Paths(storage)
    needed: dict[str, int] = {}
    live = storage.requests(states=[RequestState.PENDING, RequestState.SCHEDULED])
    for req in live:
        at = latest_checkpoint(paths(req.node), by_node, req.step)
        if at is not None:
            ref = records[at].ref
            needed[ref] = needed.get(ref, 0) + req.refcount
    now = time.time() if now is None else now
    for lease in storage.leases(live_only=True):
        if lease.node is None or not lease.live(now):
            continue
        at = latest_checkpoint(paths(lease.node), by_node, lease.start)
        if at is not None:
            needed.setdefault(records[at].ref, 0)
    return needed


def eviction_candidates(
    storage: BasePlanStorage, records: Mapping[Key, CheckpointRecord] | None = None
) -> tuple[dict[str, EvictionInfo], set[str]]:
    """What the checkpoint budget weighs, for :func:`eviction_order` (or
    :meth:`CheckpointStore.evict`): ``(candidates, needed)``, every recorded checkpoint
    with its recompute cost (its step) and pending references, and the refs of
    :func:`needed_checkpoints`."""
    records = storage.checkpoints() if records is None else records
    needed = needed_checkpoints(storage, records)
    candidates = {
        rec.ref: EvictionInfo(recompute_cost=float(step), pending_refs=needed.get(rec.ref, 0))
        for (_node, step), rec in records.items()
    }
    return candidates, set(needed)


def evict_to_budget(storage: BasePlanStorage, store: CheckpointStore) -> list[Key]:
    """Keep ``store`` within its budget (:meth:`CheckpointStore.evict`'s cost-benefit
    rule, never a needed checkpoint), removing each plan record before its file.

    Returns:
        The canonical keys whose checkpoints were removed (an engine tells its
        scheduler they are lost), in removal order; empty without a budget.

    Raises:
        CheckpointError: the store cannot be listed (nothing removed). A file that
            cannot be deleted is logged and left (its record is gone: an orphan that
            the next ``gc`` takes).
    """
    if store.budget_bytes is None:
        return []
    sizes = store.sizes()
    if sum(sizes.values()) <= store.budget_bytes:
        return []
    records = storage.checkpoints()
    candidates, needed = eviction_candidates(storage, records)
    keys = {rec.ref: key for key, rec in records.items()}
    removed: list[Key] = []
    for ref in eviction_order(candidates, sizes, needed, store.budget_bytes):
        key = keys[ref]
        storage.remove_checkpoint(*key)
        removed.append(key)  # gone for the plan, whatever happens to the file
        try:
            store.delete(ref)
        except CheckpointError as exc:  # an orphan now: the next ``gc`` takes it
            logger.warning("checkpoint %s left in the store: %s", ref, exc)
    return removed
