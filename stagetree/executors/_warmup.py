"""Imported by the fork server of ``LocalExecutor(start_method="forkserver")``: warms up
the trainer class named by ``$STAGETREE_FORKSERVER_WARMUP`` (``module:qualname``, a
library class) once, so that every worker forked from the server inherits its imports
and caches (:meth:`stagetree.trainer.Trainer.warmup`). Only an optimisation: a failure is
logged and each worker warms up again anyway."""

from __future__ import annotations

import logging
import os


def _warm() -> None:
    target = os.environ.pop("STAGETREE_FORKSERVER_WARMUP", "")
    if not target:
        return
    try:
        from stagetree.executors._spec import TrainerSpec

        TrainerSpec.of(target).resolve().warmup()
    except Exception:
        logging.getLogger(__name__).exception("fork server: warm-up of %s failed", target)


_warm()
