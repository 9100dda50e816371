"""stagetree: hyper-parameter optimization that never trains the same thing twice.

The public API is re-exported here; sequences live in :mod:`stagetree.hp`, tuners in
:mod:`stagetree.tuners`, PyTorch helpers in :mod:`stagetree.torch` (needs torch).
"""

from __future__ import annotations

# Before the imports: modules below read it while this package is being imported.
__version__ = "0.1.0"

from stagetree.budget import Budget
from stagetree.check import CheckReport, check_trainer
from stagetree.distributions import Choice, Distribution, IntUniform, LogUniform, Shared, Uniform
from stagetree.exceptions import (
    AuthError,
    CheckpointError,
    InvalidBudgetError,
    InvalidSequenceError,
    InvalidSpaceError,
    InvalidTrialError,
    SchedulerError,
    SchemaVersionError,
    ServerError,
    ServerUnavailableError,
    StagetreeError,
    StagetreeWarning,
    StorageError,
    StudyBusyError,
    TrainerError,
    TrialCancelledError,
    TrialFailedError,
    TunerError,
    VersionMismatchError,
)
from stagetree.plan import open_storage
from stagetree.space import GridSpace, RandomSpace, TrialSpec, load_space_file
from stagetree.stages import kwise_merge_rate, merge_rate
from stagetree.study import Study, TrialError, TrialRecord
from stagetree.trainer import Trainer
from stagetree.tuners.base import TrialResult

__all__ = [
    "AuthError",
    "Budget",
    "CheckReport",
    "CheckpointError",
    "Choice",
    "Distribution",
    "GridSpace",
    "IntUniform",
    "InvalidBudgetError",
    "InvalidSequenceError",
    "InvalidSpaceError",
    "InvalidTrialError",
    "LogUniform",
    "RandomSpace",
    "SchedulerError",
    "SchemaVersionError",
    "ServerError",
    "ServerUnavailableError",
    "Shared",
    "StagetreeError",
    "StagetreeWarning",
    "StorageError",
    "Study",
    "StudyBusyError",
    "Trainer",
    "TrainerError",
    "TrialCancelledError",
    "TrialError",
    "TrialFailedError",
    "TrialRecord",
    "TrialResult",
    "TrialSpec",
    "TunerError",
    "Uniform",
    "VersionMismatchError",
    "__version__",
    "check_trainer",
    "kwise_merge_rate",
    "load_space_file",
    "merge_rate",
    "open_storage",
]
