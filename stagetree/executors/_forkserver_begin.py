"""What multiprocessing's fork server of a :class:`~stagetree.executors.local.LocalExecutor`
imports first (one of its preloaded modules; never imported elsewhere): it turns the
garbage collector off while the server imports the rest (torch, stagetree's modules, the
trainer's ``warmup_imports``), until :mod:`stagetree.executors._forkserver`, imported
last, freezes what they made and turns it on again.

Those imports make objects that live as long as the server (and its workers), which the
collections triggered by the imports would traverse again and again: about a tenth of
the CPU time of a fresh server's imports (torch, ``torch._dynamo``, scikit-learn),
which the first worker waits for when the driver may not fork the server itself
(:mod:`stagetree.executors._driverfork`).
"""

from __future__ import annotations

import gc

__all__: list[str] = []

gc.disable()
