"""stagetree: hyper-parameter optimization that never trains the same thing twice."""

from __future__ import annotations

from stagetree.exceptions import (
    CheckpointError,
    InvalidSequenceError,
    InvalidSpaceError,
    InvalidTrialError,
    SchedulerError,
    SchemaVersionError,
    StagetreeError,
    StorageError,
    TrainerError,
    TrialCancelledError,
    TrialFailedError,
    TunerError,
)
from stagetree.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "InvalidSequenceError",
    "InvalidSpaceError",
    "InvalidTrialError",
    "SchedulerError",
    "SchemaVersionError",
    "StagetreeError",
    "StorageError",
    "Trainer",
    "TrainerError",
    "TrialCancelledError",
    "TrialFailedError",
    "TunerError",
    "__version__",
]
