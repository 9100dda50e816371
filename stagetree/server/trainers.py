"""How a trainer class travels from a client to the server, and the server's registry
of trainer classes (one class object per trainer version).

The client sends the trainer three ways at once (:func:`trainer_payload`): its import
path ``"module:qualname"``, the class pickled by value with cloudpickle (base64; the
user's own modules travel with it, as to worker processes, see
:mod:`stagetree.executors._spec`) and its code fingerprint
(:func:`~stagetree.identity.trainer_fingerprint`). The server
(:class:`TrainerRegistry`) imports the path when it can and the imported class has the
same fingerprint, else unpickles the value. Studies with the same storage and the same
class object share one engine (one worker pool, shared stages), so the registry hands
out one class object per fingerprint: two clients with the same trainer code share.

Unpickling runs code the client sent: whoever holds the server's token can run code on
the server (as with Ray job submission). The token is the security boundary.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Mapping
from typing import Any

from stagetree.exceptions import RequestRefusedError
from stagetree.executors._spec import TrainerSpec, _dumps_by_value, _loads
from stagetree.identity import trainer_fingerprint
from stagetree.trainer import Trainer

__all__ = ["TrainerRegistry", "trainer_payload"]


def trainer_payload(trainer: type[Trainer]) -> dict[str, Any]:
    """The JSON form of ``trainer`` a study-opening request carries: ``ref``
    (``module:qualname``), ``value`` (base64 cloudpickle, or None with ``value_error``
    when it cannot be pickled) and ``fingerprint``."""
    value: str | None = None
    value_error = ""
    try:
        value = base64.b64encode(_dumps_by_value(trainer)).decode()
    except ValueError as exc:
        value_error = str(exc)
    return {
        "ref": f"{trainer.__module__}:{trainer.__qualname__}",
        "value": value,
        "value_error": value_error,
        "fingerprint": trainer_fingerprint(trainer),
    }


class TrainerRegistry:
    """Trainer classes by fingerprint, loaded from the clients' payloads (thread-safe)."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Trainer]] = {}
        self._lock = threading.Lock()

    def resolve(self, payload: Any) -> type[Trainer]:
        """The class of a payload: the registered one of its fingerprint, else the
        imported one (same fingerprint), else the unpickled value; registered.

        Raises:
            RequestRefusedError: 400 for a malformed payload, or a trainer that can be neither
                imported nor unpickled (the message says why for both).
        """
        if not isinstance(payload, Mapping):
            raise RequestRefusedError(400, "BadRequest", "'trainer' must be an object")
        unknown = set(payload) - {"ref", "value", "value_error", "fingerprint"}
        if unknown:
            raise RequestRefusedError(
                400, "BadRequest", f"unknown trainer field(s) {sorted(unknown)}"
            )
        ref, value, fingerprint = (
            payload.get("ref"),
            payload.get("value"),
            payload.get("fingerprint"),
        )
        if not isinstance(ref, str) or ":" not in ref:
            raise RequestRefusedError(
                400, "BadRequest", f"trainer 'ref' must be 'module:qualname', got {ref!r}"
            )
        if not isinstance(fingerprint, str) or not fingerprint:
            raise RequestRefusedError(
                400, "BadRequest", "trainer 'fingerprint' must be a non-empty string"
            )
        if value is not None and not isinstance(value, str):
            raise RequestRefusedError(
                400, "BadRequest", "trainer 'value' must be base64 text or null"
            )
        with self._lock:
            known = self._classes.get(fingerprint)
            if known is not None:
                return known
            problems: list[str] = []
            cls = self._import(ref, fingerprint, problems)
            if cls is None:
                cls = self._unpickle(ref, value, str(payload.get("value_error") or ""), problems)
            if cls is None:
                raise RequestRefusedError(
                    400,
                    "TrainerUnavailable",
                    f"the server cannot load trainer {ref}: " + "; ".join(problems),
                )
            self._classes[fingerprint] = cls
            return cls

    @staticmethod
    def _import(ref: str, fingerprint: str, problems: list[str]) -> type[Trainer] | None:
        module, _, qualname = ref.rpartition(":")
        if module in ("__main__", "__mp_main__") or "<locals>" in qualname:
            problems.append(f"{ref} cannot be imported by name")
            return None
        try:
            cls = TrainerSpec(module, qualname).resolve()
        except Exception as exc:  # an import runs module code: anything can fail
            problems.append(f"importing it failed ({type(exc).__name__}: {exc})")
            return None
        if not (isinstance(cls, type) and issubclass(cls, Trainer)):
            problems.append(f"{ref} imports as {cls!r}, not a Trainer subclass")
            return None
        if trainer_fingerprint(cls) != fingerprint:
            problems.append(f"the server's {ref} is other code than the client's")
            return None
        return cls

    @staticmethod
    def _unpickle(
        ref: str, value: str | None, value_error: str, problems: list[str]
    ) -> type[Trainer] | None:
        if value is None:
            problems.append(
                f"the client could not pickle it ({value_error})"
                if value_error
                else "the client sent no pickled value"
            )
            return None
        try:
            raw = base64.b64decode(value.encode(), validate=True)
        except (binascii.Error, ValueError) as exc:
            problems.append(f"its pickled value is not base64 ({exc})")
            return None
        try:
            cls = _loads(raw, ref)
        except ImportError as exc:
            problems.append(str(exc))
            return None
        if not issubclass(cls, Trainer):
            problems.append(f"its pickled value is {cls!r}, not a Trainer subclass")
            return None
        return cls
