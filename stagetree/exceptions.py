"""Every error and warning stagetree raises or gives on purpose (and nothing else).

Hierarchy::

    StagetreeError                 base of every stagetree error
    ├── InvalidSequenceError       (also ValueError) bad arguments to a sequence in stagetree.hp
    ├── InvalidSpaceError          (also ValueError) bad search space or distribution
    ├── InvalidTrialError          (also ValueError) a trial that does not fit its study / plan
    ├── StorageError               a storage URL that cannot be opened, or a failed transaction
    │   ├── SchemaVersionError     database written by a newer (or unknown) schema version
    │   ├── PlanKeyError           (also KeyError) a node, request, study or trial the plan
    │   │                          does not hold
    │   └── RequestError           (also ValueError) a request operation against the rules
    ├── CheckpointError            a checkpoint that is missing, corrupt or cannot be written
    │   ├── CheckpointsInUseError  ``stagetree gc`` would remove what a running study needs
    │   └── CheckpointUnreachableError  the store could not be reached (the object may exist)
    ├── TrainerError               user trainer code raised; carries the formatted traceback
    ├── FusionError                members that cannot be trained fused
    ├── SchedulerError             an event the scheduler cannot accept (a bug or bad input)
    ├── ExecutorError              an executor that cannot run: Ray missing, no cluster,
    │                              resources no node has, unreachable checkpoints, versions
    ├── TrialFailedError           a request failed (its stage or an ancestor stage raised)
    ├── TrialCancelledError        a request was cancelled before it finished
    ├── StudyBusyError             the study is being tuned by another live process
    ├── TunerError                 (also ValueError) invalid tuner arguments or metric
    ├── InvalidBudgetError         (also ValueError) a budget that is not a positive amount
    ├── CommandError               (also ValueError) a command-line input that cannot be used
    ├── MissingExtraError          (also ImportError) an optional extra is not installed
    └── ServerError                a tuning server (``stagetree serve``) refused a request
        ├── AuthError              no token, or the wrong one (HTTP 401 / 403)
        ├── VersionMismatchError   client and server speak different protocol versions
        ├── ServerUnavailableError the server could not be reached within the retry time
        └── RequestRefusedError    raised inside the server: the refusal it answers with

    StagetreeWarning               (a UserWarning) something the user should know about:
    ├── TrainerChangedWarning      the trainer's code changed since a study's trials ran
    ├── UnreadHyperparameterWarning a sequence setup() never read (also: repeated draws
    │                              of a random search)
    ├── RemoteArgumentWarning      a remote study was given a server-side argument
    ├── SharedEngineWarning        a study joins an engine made with other settings
    ├── LargeGridWarning           a grid search over so many points (its size named)
    │                              that it cannot finish in a usual run
    └── ReplayDivergedWarning      (also RuntimeWarning) a resumed tuner left its log
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "CheckpointError",
    "CheckpointUnreachableError",
    "CheckpointsInUseError",
    "CommandError",
    "ExecutorError",
    "FusionError",
    "InvalidBudgetError",
    "InvalidSequenceError",
    "InvalidSpaceError",
    "InvalidTrialError",
    "LargeGridWarning",
    "MissingExtraError",
    "PlanKeyError",
    "RemoteArgumentWarning",
    "ReplayDivergedWarning",
    "RequestError",
    "RequestRefusedError",
    "SchedulerError",
    "SchemaVersionError",
    "ServerError",
    "ServerUnavailableError",
    "SharedEngineWarning",
    "StagetreeError",
    "StagetreeWarning",
    "StorageError",
    "StudyBusyError",
    "TrainerChangedWarning",
    "TrainerError",
    "TrialCancelledError",
    "TrialFailedError",
    "TunerError",
    "UnreadHyperparameterWarning",
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


class PlanKeyError(StorageError, KeyError):
    """A node, request, study or trial that the plan does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RequestError(StorageError, ValueError):
    """A request operation that breaks the request rules (e.g. releasing more than held)."""


class SchemaVersionError(StorageError):
    """The database was written by a schema version this code does not know."""


class CheckpointError(StagetreeError):
    """A checkpoint is missing, fails its checksum, or could not be written."""


class CheckpointUnreachableError(CheckpointError):
    """The checkpoint store could not be reached for longer than its ride-through window
    (``STAGETREE_STORE_RETRY_SECONDS``): the checkpoint may still exist, so nothing is
    concluded about it (its plan record stays; only a missing or corrupt object is
    dropped)."""


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


class FusionError(StagetreeError):
    """Members cannot be trained fused (a model that cannot be vmapped, an optimizer
    without a fused form, ``.item()`` inside the loss...). The worker reports it once per
    trainer class and trains those members unfused instead."""


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


class InvalidBudgetError(StagetreeError, ValueError):
    """A budget that is not positive, has an unknown unit, or is not a budget at all."""


class CommandError(StagetreeError, ValueError):
    """A command-line input stagetree cannot use: a missing script, a script without a
    study or tuner. (An unknown study name is a :class:`PlanKeyError`.)"""


class MissingExtraError(StagetreeError, ImportError):
    """An export format needs a package that is not installed; the message says what
    installs it here (:func:`stagetree.extras.install_hint`)."""


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


class RequestRefusedError(ServerError):
    """Raised inside the server: a request it refuses, with the HTTP ``status``, an error
    ``type`` and a ``message`` that names the problem (never a token). The server sends
    it to the client, which raises it as a :class:`ServerError` (or a subclass)."""

    def __init__(self, status: int, type: str, message: str) -> None:
        super().__init__(message, status=status, type=type)
        self.message = message


class StagetreeWarning(UserWarning):
    """A warning stagetree gives on purpose (the run goes on)."""


class TrainerChangedWarning(StagetreeWarning):
    """The trainer's code differs from the version that trained a study's trials: they
    train again (once per process and study)."""


class UnreadHyperparameterWarning(StagetreeWarning):
    """A sequential hyper-parameter was given to ``Trainer.setup`` and never read."""


class RemoteArgumentWarning(StagetreeWarning):
    """A remote study was given a server-side argument (storage, workers...): the
    server's own setting is used instead."""


class SharedEngineWarning(StagetreeWarning):
    """A study joins the engine of its storage in this process (one worker pool for
    every study there), which another study made with other engine settings: the
    engine's settings are used, the study's differing ones are not."""


class LargeGridWarning(StagetreeWarning):
    """A grid search over a grid so large (the message names its size) that training
    every point is rarely what was meant; it is enumerated lazily and submitted a
    window at a time, so a budget stops it as any run."""


class ReplayDivergedWarning(StagetreeWarning, RuntimeWarning):
    """A resumed tuner did not take the logged decisions; it goes on live."""
