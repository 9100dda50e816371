"""A module of ``benchmarks/`` (not a package), loaded by path for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (registered in ``sys.modules``
    first, so its dataclasses and pickles find it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
