"""Accounting scopes: the keys under which the plan keeps counters
(``BasePlanStorage.add_stats``) for one plan tree or one study."""

from __future__ import annotations

__all__ = [
    "devices_learned",
    "devices_scope",
    "learned_devices",
    "learned_fused_width",
    "root_scope",
    "study_scope",
]


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
    out-of-memory error): a counter ``need_<n>`` per need ``n`` learned and
    ``fused_width_<w>`` per fused width ``w`` found to fit, so that engines sharing the
    storage only ever add (the need is the largest ``n``, the width the smallest
    ``w``)."""
    return f"devices:{root_key}"


def devices_learned(devices: int, fused_width: int = 0) -> dict[str, float]:
    """The counters to add to :func:`devices_scope` when a tree learned it needs
    ``devices`` devices (and that its fused jobs fit at ``fused_width``, when > 0)."""
    out = {f"need_{devices}": 1.0}
    if fused_width > 0:
        out[f"fused_width_{fused_width}"] = 1.0
    return out


def learned_devices(counters: dict[str, float]) -> int:
    """The device need kept in :func:`devices_scope`'s ``counters`` (1: none learned)."""
    needs = [int(k[5:]) for k, v in counters.items() if k.startswith("need_") and v > 0]
    return max(needs, default=1)


def learned_fused_width(counters: dict[str, float]) -> int:
    """The widest fused job known to fit, kept in :func:`devices_scope`'s ``counters``
    (0: none learned)."""
    prefix = "fused_width_"
    widths = [int(k[len(prefix) :]) for k, v in counters.items() if k.startswith(prefix) and v > 0]
    return min(widths, default=0)
