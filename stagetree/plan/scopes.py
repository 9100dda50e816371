"""Accounting scopes: the keys under which the plan keeps counters
(``BasePlanStorage.add_stats``) for one plan tree or one study."""

from __future__ import annotations

__all__ = ["devices_learned", "devices_scope", "learned_devices", "root_scope", "study_scope"]


def root_scope(root_key: str) -> str:
    """The accounting scope of one plan tree (see ``BasePlanStorage.add_stats``)."""
    return f"root:{root_key}"


def study_scope(name: str, version: str) -> str:
    """The accounting scope of one study (at one trainer version): ``steps_executed``
    and ``device_seconds`` trained for its requests, as fair share charges them (a step
    several studies needed counts for each; see ``Scheduler.usage``)."""
    return f"study:{name}@{version}"


def devices_scope(root_key: str) -> str:
    """The scope that keeps what one plan tree learned of its device need (a CUDA
    out-of-memory error on fewer devices): a counter ``need_<n>`` per need ``n``
    learned, so that engines sharing the storage only ever add (the need is the
    largest ``n``)."""
    return f"devices:{root_key}"


def devices_learned(devices: int) -> dict[str, float]:
    """The counters to add to :func:`devices_scope` when a tree learned it needs
    ``devices`` devices."""
    return {f"need_{devices}": 1.0}


def learned_devices(counters: dict[str, float]) -> int:
    """The device need kept in :func:`devices_scope`'s ``counters`` (1: none learned)."""
    needs = [int(k[5:]) for k, v in counters.items() if k.startswith("need_") and v > 0]
    return max(needs, default=1)
