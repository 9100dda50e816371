"""What client and server agree on: versions, headers, limits, and the JSON forms of
trials, results and errors. Imports neither starlette nor httpx.

Every response body is JSON (``allow_nan``: metrics may be NaN or infinite), except a
checkpoint (``application/octet-stream``, the checkpoint format of
:mod:`stagetree.checkpoints.format`). An error is ``{"error": {"type": ..., "message":
...}}`` with a 4xx/5xx status; errors of a study carry their attributes too
(``traceback`` of a :class:`~stagetree.exceptions.TrialFailedError`, ``study`` and
``holder`` of a :class:`~stagetree.exceptions.StudyBusyError`), so the client raises
the same exception a local study raises.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from stagetree import exceptions as _exc
from stagetree.exceptions import RequestRefusedError
from stagetree.hp import Sequence, as_sequence, from_json

__all__ = [
    "BODY_LIMIT",
    "DEFAULT_PORT",
    "MAX_POLL",
    "PROTOCOL_HEADER",
    "PROTOCOL_VERSION",
    "STUDY_BODY_LIMIT",
    "VERSION_HEADER",
    "RequestRefusedError",
    "dumps",
    "error_from_json",
    "error_to_json",
    "hp_from_json",
    "hp_to_json",
    "record_from_json",
    "record_to_json",
    "result_from_json",
    "result_to_json",
]

PROTOCOL_VERSION = 1
"""Bumped on every incompatible change of the API; client and server must agree."""
PROTOCOL_HEADER = "X-Stagetree-Protocol"
VERSION_HEADER = "X-Stagetree-Version"
DEFAULT_PORT = 8642
BODY_LIMIT = 1 << 20
"""Bytes of an ordinary request body (a trial, a log record, a list of trials)."""
STUDY_BODY_LIMIT = 64 << 20
"""Bytes of a study-opening request, which carries the trainer pickled by value."""
MAX_POLL = 25.0
"""Longest wait of one long-poll for results (the server also keeps it under the
session lease, so that a poll renews the session in time)."""


def dumps(obj: Any) -> bytes:
    """JSON bytes of a response (NaN and infinities allowed: metrics can be NaN)."""
    return json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()


# -------------------------------------------------------------------- trials and results


def hp_to_json(hp: Mapping[str, Any]) -> dict[str, Any]:
    """Sequences by name as JSON (plain values become constants, as a study does)."""
    return {str(name): as_sequence(value).to_json() for name, value in hp.items()}


def hp_from_json(raw: Any) -> dict[str, Sequence]:
    """Inverse of :func:`hp_to_json`.

    Raises:
        InvalidSequenceError: not a mapping of sequence descriptions.
    """
    if not isinstance(raw, Mapping):
        raise _exc.InvalidSequenceError(f"hp must be an object of sequences, got {raw!r}")
    return {str(name): from_json(value) for name, value in raw.items()}


def _metrics_by_step(history: Mapping[int, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    return {str(step): dict(values) for step, values in history.items()}


def _steps_back(raw: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    return {
        int(step): {str(k): float(v) for k, v in values.items()} for step, values in raw.items()
    }


def result_to_json(result: Any) -> dict[str, Any]:
    """A :class:`~stagetree.tuners.base.TrialResult` as JSON."""
    return {
        "config": result.config,
        "hp": hp_to_json(result.hp),
        "steps": result.steps,
        "metrics": dict(result.metrics),
        "history": _metrics_by_step(result.history),
    }


def result_from_json(raw: Mapping[str, Any]) -> Any:
    """Inverse of :func:`result_to_json`."""
    from stagetree.tuners.base import TrialResult

    return TrialResult(
        config=dict(raw["config"]),
        hp=hp_from_json(raw["hp"]),
        steps=int(raw["steps"]),
        metrics={str(k): float(v) for k, v in raw["metrics"].items()},
        history=_steps_back(raw["history"]),
    )


def record_to_json(record: Any) -> dict[str, Any]:
    """A :class:`~stagetree.study.TrialRecord` as JSON."""
    error = record.error
    return {
        "id": record.id,
        "config": record.config,
        "hp": hp_to_json(record.hp),
        "steps": record.steps,
        "state": record.state,
        "metrics": _metrics_by_step(record.metrics),
        "error": None
        if error is None
        else {
            "type": error.type,
            "message": error.message,
            "traceback": error.traceback,
            "where": error.where,
        },
        "lineage": [dict(e) for e in record.lineage],
    }


def record_from_json(raw: Mapping[str, Any]) -> Any:
    """Inverse of :func:`record_to_json`."""
    from stagetree.reports import TrialError, TrialRecord

    error = raw.get("error")
    return TrialRecord(
        id=int(raw["id"]),
        config=dict(raw["config"]),
        hp=hp_from_json(raw["hp"]),
        steps=int(raw["steps"]),
        state=str(raw["state"]),
        metrics=_steps_back(raw["metrics"]),
        error=None if not error else TrialError.from_attrs({"error": error}),
        lineage=[{str(k): int(v) for k, v in e.items()} for e in raw.get("lineage") or []],
    )


# ------------------------------------------------------------------------------ errors

# Exceptions of a study that travel by name and are raised again on the client.
_STUDY_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        _exc.InvalidTrialError,
        _exc.InvalidSequenceError,
        _exc.InvalidSpaceError,
        _exc.TrialFailedError,
        _exc.TrialCancelledError,
        _exc.StudyBusyError,
        _exc.StorageError,
        _exc.SchemaVersionError,
        _exc.CheckpointError,
        _exc.TrainerError,
        _exc.ExecutorError,
        _exc.SchedulerError,
        _exc.TunerError,
        _exc.StagetreeError,
        ValueError,
        TypeError,
    )
}
_STATUS = {"StudyBusyError": 409, "TrialCancelledError": 409, "StorageError": 500}


def error_to_json(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """``(HTTP status, {"error": {...}})`` for an exception a study method raised (or a
    :class:`RequestRefusedError`); unexpected exceptions are 500s named by type."""
    if isinstance(exc, RequestRefusedError):
        return exc.status, {"error": {"type": exc.type, "message": exc.message}}
    name = type(exc).__name__
    if isinstance(exc, _exc._WithTraceback):
        body: dict[str, Any] = {"type": name, "message": str(exc.args[0]) if exc.args else ""}
        body["traceback"] = exc.traceback
    else:
        body = {"type": name, "message": str(exc)}
    if isinstance(exc, _exc.StudyBusyError):
        body.update(study=exc.study, holder=exc.holder)
    if name not in _STUDY_ERRORS:
        if isinstance(exc, _exc.StagetreeError):
            return 500, {"error": body}
        return 500, {"error": {"type": "InternalError", "message": f"{name}: {exc}"}}
    status = _STATUS.get(name, 500 if name in ("SchedulerError", "StagetreeError") else 400)
    return status, {"error": body}


def error_from_json(status: int, payload: Any) -> Exception:
    """The exception to raise on the client for an error response: the study's own
    exception type when it is one, else a :class:`~stagetree.exceptions.ServerError`
    (:class:`~stagetree.exceptions.AuthError` for 401/403,
    :class:`~stagetree.exceptions.VersionMismatchError`)."""
    error = payload.get("error") if isinstance(payload, Mapping) else None
    if not isinstance(error, Mapping):
        return _exc.ServerError(f"the server answered HTTP {status}: {payload!r:.200}", status)
    kind = str(error.get("type", ""))
    message = str(error.get("message", ""))
    if status in (401, 403):
        return _exc.AuthError(message, status, kind)
    if kind == "VersionMismatchError":
        return _exc.VersionMismatchError(message, status, kind)
    cls = _STUDY_ERRORS.get(kind)
    if cls is None:
        return _exc.ServerError(message, status, kind)
    if issubclass(cls, _exc._WithTraceback):
        return cls(message, str(error.get("traceback", "")))
    if cls is _exc.StudyBusyError:
        return _exc.StudyBusyError(
            message, str(error.get("study", "")), str(error.get("holder", ""))
        )
    return cls(message)
