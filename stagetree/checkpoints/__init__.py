"""Checkpoints: a safe file format (:mod:`~stagetree.checkpoints.format`) on a byte store
chosen by URL (:mod:`~stagetree.checkpoints.stores`: a local or shared directory, or
any fsspec URL such as ``s3://bucket/prefix``), with a byte budget, cost-benefit
eviction and a local read cache (:mod:`~stagetree.checkpoints.store`), and what live
work still needs, which the budget never evicts (:mod:`~stagetree.checkpoints.eviction`;
``stagetree gc`` removes the rest: :mod:`stagetree.tools.gc`)."""

from __future__ import annotations

from stagetree.checkpoints.eviction import needed_checkpoints
from stagetree.checkpoints.format import check_state
from stagetree.checkpoints.store import CheckpointInfo, CheckpointStore, EvictionInfo, ReadCache
from stagetree.checkpoints.stores import (
    BaseByteStore,
    FsspecByteStore,
    LocalByteStore,
    byte_store_schemes,
    check_location,
    open_byte_store,
    register_byte_store,
)

__all__ = [
    "BaseByteStore",
    "CheckpointInfo",
    "CheckpointStore",
    "EvictionInfo",
    "FsspecByteStore",
    "LocalByteStore",
    "ReadCache",
    "byte_store_schemes",
    "check_location",
    "check_state",
    "needed_checkpoints",
    "open_byte_store",
    "register_byte_store",
]
