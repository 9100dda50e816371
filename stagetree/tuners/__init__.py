"""Tuners: search algorithms that drive a study through :class:`TrialRunner`.

Every tuner is a :class:`Tuner`; ``await tuner.run(runner)`` returns the best
:class:`TrialResult`. See :mod:`stagetree.tuners.base` for the contract and the replay
log that lets a resumed study take the same decisions.
"""

from __future__ import annotations

from stagetree.exceptions import ReplayDivergedWarning
from stagetree.tuners.asha import ASHA, AsyncHyperband
from stagetree.tuners.base import (
    Job,
    JobQueue,
    ReplayingRunner,
    Trial,
    TrialResult,
    TrialRunner,
    Tuner,
    draw_specs,
    rung_levels,
)
from stagetree.tuners.basic import GridSearch, RandomSearch
from stagetree.tuners.median import MedianStopping
from stagetree.tuners.pbt import PBT
from stagetree.tuners.sha import SHA, EarlyStop, Hyperband, hyperband_split

__all__ = [
    "ASHA",
    "PBT",
    "SHA",
    "AsyncHyperband",
    "EarlyStop",
    "GridSearch",
    "Hyperband",
    "Job",
    "JobQueue",
    "MedianStopping",
    "RandomSearch",
    "ReplayDivergedWarning",
    "ReplayingRunner",
    "Trial",
    "TrialResult",
    "TrialRunner",
    "Tuner",
    "draw_specs",
    "hyperband_split",
    "rung_levels",
]
