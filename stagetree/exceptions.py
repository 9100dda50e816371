"""Errors raised by stagetree.

Hierarchy::

    StagetreeError                 base of every stagetree error
    ├── InvalidSequenceError       (also ValueError) bad arguments to a sequence in stagetree.hp
    ├── InvalidSpaceError          (also ValueError) bad search space or distribution
    ├── InvalidTrialError          (also ValueError) a trial that does not fit its study / plan
    ├── StorageError               a storage URL that cannot be opened, or a failed transaction
    │   └── SchemaVersionError     database written by a newer (or unknown) schema version
    ├── CheckpointError            a checkpoint that is missing, corrupt or cannot be written
    │   └── CheckpointsInUseError  ``stagetree gc`` would remove what a running study needs
    ├── TrainerError               user trainer code raised; carries the formatted traceback
    ├── SchedulerError             an event the scheduler cannot accept (a bug or bad input)
    ├── FusionError                (stagetree.fusion) members that cannot be trained fused
    ├── ExecutorError              an executor that cannot run: Ray missing, no cluster,
    │                              resources no node has, unreachable checkpoints, versions
    ├── TrialFailedError           a request failed (its stage or an ancestor stage raised)
    ├── TrialCancelledError        a request was cancelled before it finished
    ├── StudyBusyError             the study is being tuned by another live process
    ├── TunerError                 (also ValueError) invalid tuner arguments or metric
    └── ServerError                a tuning server (``stagetree serve``) refused a request
        ├── AuthError              no token, or the wrong one (HTTP 401 / 403)
        ├── VersionMismatchError   client and server speak different protocol versions
        └── ServerUnavailableError the server could not be reached within the retry time

    StagetreeWarning               (a UserWarning) something the user should know about:
    ├── TrainerChangedWarning      (stagetree.identity) the trainer's code changed
    └── UnreadHyperparameterWarning (stagetree.names) a sequence setup() never read
                                   (also: repeated draws of a random search)
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "CheckpointError",
    "CheckpointsInUseError",
    "ExecutorError",
    "InvalidSequenceError",
    "InvalidSpaceError",
    "InvalidTrialError",
    "SchedulerError",
    "SchemaVersionError",
    "ServerError",
    "ServerUnavailableError",
    "StagetreeError",
    "StagetreeWarning",
    "StorageError",
    "StudyBusyError",
    "TrainerError",
    "TrialCancelledError",
    "TrialFailedError",
    "TunerError",
    "VersionMismatchError",
]


class StagetreeError(Exception):
    """Base class of every error stagetree raises on purpose."""


class InvalidSequenceError(StagetreeError, ValueError):
    """A hyper-parameter sequence got arguments it cannot honour."""


class InvalidSpaceError(StagetreeError, ValueError):
    """A search space or a distribution is malformed (e.g. an empty grid)."""


class InvalidTrialError(StagetreeError, ValueError):
    """A trial does not fit: wrong hyper-parameter names, bad step count, ..."""


class StorageError(StagetreeError):
    """A storage backend could not be opened or a transaction failed."""


class SchemaVersionError(StorageError):
    """The database was written by a schema version this code does not know."""


class CheckpointError(StagetreeError):
    """A checkpoint is missing, fails its checksum, or could not be written."""


class _WithTraceback(StagetreeError):
    """An error that carries the formatted traceback of user code that raised elsewhere
    (often in a worker process), shown under the message."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n{self.traceback}" if self.traceback else base


class TrainerError(_WithTraceback):
    """User trainer code raised. ``traceback`` holds the formatted original traceback."""


class SchedulerError(StagetreeError):
    """The scheduler received an event it cannot apply."""


class ExecutorError(StagetreeError):
    """An executor that cannot start or run its workers (the message says why and what to do)."""


class TrialFailedError(_WithTraceback):
    """A request failed because a stage it depends on failed; ``traceback`` holds the
    trainer's traceback."""


class TrialCancelledError(StagetreeError):
    """A request was cancelled before its result was available."""


class StudyBusyError(StagetreeError):
    """``Study.tune()`` of a study that another live process (engine) is tuning now.

    Attributes:
        study: the study's name.
        holder: ``host:pid`` of the process tuning it.
    """

    def __init__(self, message: str, study: str = "", holder: str = "") -> None:
        super().__init__(message)
        self.study = study
        self.holder = holder


class CheckpointsInUseError(CheckpointError):
    """``stagetree gc`` would remove checkpoints a running study may still need (its
    trials' final checkpoints); nothing was removed.

    Attributes:
        study: the running study's name.
        holder: ``host:pid`` of the process running it.
    """

    def __init__(self, message: str, study: str = "", holder: str = "") -> None:
        super().__init__(message)
        self.study = study
        self.holder = holder


class TunerError(StagetreeError, ValueError):
    """Invalid tuner arguments, or a metric the trainer never reports."""


class ServerError(StagetreeError):
    """A tuning server refused a request (a malformed request, a trainer it cannot load,
    a request too large) or failed; the message is the server's.

    Attributes:
        status: the HTTP status (0 when no response came).
        type: the server's error type name (``"BadRequest"``, ``"TrainerUnavailable"``...).
    """

    def __init__(self, message: str, status: int = 0, type: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.type = type


class AuthError(ServerError):
    """The server refused the token: none was sent (401) or it is wrong (403)."""


class VersionMismatchError(ServerError):
    """Client and server speak incompatible protocol versions (the message names both)."""


class ServerUnavailableError(ServerError):
    """The server could not be reached, or kept failing, for the whole retry time (the
    message names the URL and how long it tried)."""


class StagetreeWarning(UserWarning):
    """A warning stagetree gives on purpose (the run goes on)."""
