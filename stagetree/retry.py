"""Riding through outages: a call that fails with a transient error (a database that
restarts, an object store out of reach) is tried again with bounded exponential
backoff for a ride-through window, then the last error is raised.

The windows come from the environment, in seconds: ``STAGETREE_DB_RETRY_SECONDS`` for
the plan storage (:mod:`stagetree.plan.sql`) and ``STAGETREE_STORE_RETRY_SECONDS`` for
the checkpoint store (:mod:`stagetree.checkpoints.store`); 30 by default, 0 turns
retrying off.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "DB_RETRY_ENV",
    "DEFAULT_WINDOW",
    "STORE_RETRY_ENV",
    "Outage",
    "RideThrough",
    "window_from_env",
]

T = TypeVar("T")

DB_RETRY_ENV = "STAGETREE_DB_RETRY_SECONDS"
STORE_RETRY_ENV = "STAGETREE_STORE_RETRY_SECONDS"
DEFAULT_WINDOW = 30.0
_FIRST_DELAY = 0.05
_MAX_DELAY = 2.0

logger = logging.getLogger("stagetree")


def window_from_env(name: str, default: float = DEFAULT_WINDOW) -> float:
    """Seconds of the ride-through window set by environment variable ``name``
    (``default`` when unset, unreadable or negative)."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        return default
    return value if value >= 0 else default


class Outage(Exception):
    """A call failed with a transient error (``__cause__``) and may be tried again.

    Args:
        cause: the transient error, in words.
        final: makes the error raised once the window is spent, given a note that says
            how long the outage lasted and which setting bounds it.
    """

    def __init__(self, cause: str, final: Callable[[str], BaseException]) -> None:
        super().__init__(cause)
        self.final = final


@dataclass
class RideThrough:
    """Calls retried while they raise :class:`Outage`, for at most ``window`` seconds
    from the start of the first failed try, waiting 0.05 s, 0.1 s, ... (at most 2 s) between tries.

    Attributes:
        window: the ride-through window in seconds (0: no retry).
        what: the resource, for the log (``plan storage 'postgresql://...'``).
        env: the environment variable that sets the window (named in the error).
    """

    window: float
    what: str
    env: str

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``; an :class:`Outage` it raises is retried until the window is spent,
        then its ``final`` error is raised (naming the outage and its length)."""
        first: float | None = None
        delay = _FIRST_DELAY
        tries = 0
        while True:
            began = time.monotonic()
            try:
                result = fn()
            except Outage as exc:
                now = time.monotonic()
                if first is None:
                    first = began  # a failing call may itself take long (its own retries)
                    if self.window > 0:
                        logger.warning(
                            "%s unreachable (%s); retrying for up to %g s",
                            self.what,
                            _first_line(exc),
                            self.window,
                        )
                tries += 1
                deadline = first + self.window
                if now >= deadline:
                    note = (
                        f"unreachable for {now - first:.1f} s, past the ride-through window "
                        f"of {self.window:g} s (set by {self.env})"
                    )
                    raise exc.final(note) from exc.__cause__
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, _MAX_DELAY)
                continue
            if tries:
                logger.warning("%s reachable again after %d retries", self.what, tries)
            return result


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
