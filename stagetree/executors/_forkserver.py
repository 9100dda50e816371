"""What multiprocessing's fork server of a :class:`~stagetree.executors.local.LocalExecutor`
imports for itself (the last of its preloaded modules; never imported elsewhere).

- Its objects so far (torch's: hundreds of thousands), imported with the garbage
  collector off (:mod:`stagetree.executors._forkserver_begin`, its first preloaded
  module), go to the collector's permanent generation (:func:`gc.freeze`), and the
  collector is on again: the collections in every worker forked from it no longer
  traverse them, and do not write to the pages a worker shares with the server.
- When the program that started it exits, the server ends at once (:func:`os._exit`)
  instead of tearing down its interpreter with torch loaded (seconds on a busy machine,
  which a caller reading the program's output pipes waits for). It has nothing to flush:
  it only forks workers, which end on their own.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys

__all__: list[str] = []

_SERVER_PID = os.getpid()


def _exit_now() -> None:
    """The fork server's exit (run first of its exit hooks): skip the teardown. Forked
    children never run it (they end with ``os._exit``), nor would it end one of them."""
    if os.getpid() != _SERVER_PID:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


gc.freeze()
gc.enable()
atexit.register(_exit_now)
