"""Accounting scopes: the keys under which the plan keeps counters
(``BasePlanStorage.add_stats``) for one plan tree or one study."""

from __future__ import annotations

__all__ = ["root_scope", "study_scope"]


def root_scope(root_key: str) -> str:
    """The accounting scope of one plan tree (see ``BasePlanStorage.add_stats``)."""
    return f"root:{root_key}"


def study_scope(name: str, version: str) -> str:
    """The accounting scope of one study (at one trainer version): ``steps_executed``
    and ``device_seconds`` trained for its requests, as fair share charges them (a step
    several studies needed counts for each; see ``Scheduler.usage``)."""
    return f"study:{name}@{version}"
