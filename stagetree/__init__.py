"""stagetree: hyper-parameter optimization that never trains the same thing twice.

The names below are the public API. Sequences live in :mod:`stagetree.hp`, tuners in
:mod:`stagetree.tuners`, errors and warnings in :mod:`stagetree.exceptions`, PyTorch
helpers in :mod:`stagetree.torch` (needs torch).

The names load on first use (PEP 562): a worker process that imports
``stagetree.trainer`` or ``stagetree.hp`` loads neither the study nor its storage
(SQLAlchemy), and no module inside the package imports this one (a test checks both).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it (imported when the name is first used).
_EXPORTS = {
    "Budget": "stagetree.budget",
    "CheckReport": "stagetree.tools.check",
    "Choice": "stagetree.distributions",
    "Distribution": "stagetree.distributions",
    "GridSpace": "stagetree.space",
    "IntUniform": "stagetree.distributions",
    "LogUniform": "stagetree.distributions",
    "RandomSpace": "stagetree.space",
    "Shared": "stagetree.distributions",
    "Study": "stagetree.study",
    "Trainer": "stagetree.trainer",
    "TrialError": "stagetree.records",
    "TrialRecord": "stagetree.records",
    "TrialResult": "stagetree.tuners.base",
    "TrialSpec": "stagetree.space",
    "Uniform": "stagetree.distributions",
    "check_trainer": "stagetree.tools.check",
    "kwise_merge_rate": "stagetree.stages",
    "load_space_file": "stagetree.space",
    "merge_rate": "stagetree.stages",
    "open_storage": "stagetree.plan.registry",
    "simulate": "stagetree.tools.simulate",
}

__all__ = [
    "Budget",
    "CheckReport",
    "Choice",
    "Distribution",
    "GridSpace",
    "IntUniform",
    "LogUniform",
    "RandomSpace",
    "Shared",
    "Study",
    "Trainer",
    "TrialError",
    "TrialRecord",
    "TrialResult",
    "TrialSpec",
    "Uniform",
    "__version__",
    "check_trainer",
    "kwise_merge_rate",
    "load_space_file",
    "merge_rate",
    "open_storage",
    "simulate",
]

if TYPE_CHECKING:
    from stagetree.budget import Budget
    from stagetree.distributions import (
        Choice,
        Distribution,
        IntUniform,
        LogUniform,
        Shared,
        Uniform,
    )
    from stagetree.plan.registry import open_storage
    from stagetree.records import TrialError, TrialRecord
    from stagetree.space import GridSpace, RandomSpace, TrialSpec, load_space_file
    from stagetree.stages import kwise_merge_rate, merge_rate
    from stagetree.study import Study
    from stagetree.tools.check import CheckReport, check_trainer
    from stagetree.tools.simulate import simulate
    from stagetree.trainer import Trainer
    from stagetree.tuners.base import TrialResult


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stagetree' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
