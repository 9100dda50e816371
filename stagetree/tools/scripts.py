"""Loading a user's study script: the one loader ``stagetree run``, ``check`` and
``simulate`` share.

A script runs like ``python SCRIPT.py`` would (its folder first on ``sys.path``,
``sys.argv == [SCRIPT.py]``) but under another ``__name__`` (:data:`RUN_NAME`), so its
``if __name__ == "__main__":`` block does not run. Its globals stay importable as that
module while the script is in use: worker processes receive its trainer class pickled
by value. Errors a user makes in it (no such file, a syntax error, a failed import, no
study or several) are one-line :class:`~stagetree.exceptions.CommandError`\\ s.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from stagetree.exceptions import CommandError

__all__ = ["RUN_NAME", "loaded_script", "pick", "script_path", "values_of"]

#: The ``__name__`` a script runs under (and its module's name while it is in use).
RUN_NAME = "__stagetree_run__"


def script_path(script: str | os.PathLike[str]) -> Path:
    """``script`` as a path.

    Raises:
        CommandError: there is no such file.
    """
    path = Path(script)
    if not path.is_file():
        raise CommandError(f"no such script: {script}")
    return path


@contextlib.contextmanager
def loaded_script(
    script: str | os.PathLike[str], run_name: str = RUN_NAME
) -> Iterator[dict[str, Any]]:
    """Run a script and yield its globals; restore ``sys.argv``, ``sys.path`` and
    ``sys.modules`` when the block ends.

    Args:
        script: the script's path (as the user wrote it: errors name it so).
        run_name: the ``__name__`` it runs under.

    Raises:
        CommandError: no such script, or a syntax error or a failed import in it
            (naming the script and the line).
    """
    path = script_path(script)
    saved_argv = sys.argv[:]
    saved_path = sys.path[:]
    missing = object()
    saved_module = sys.modules.get(run_name, missing)
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        namespace = _run(path, str(script), run_name)
        # runpy drops the script's module when it ends: keep its globals importable.
        module = types.ModuleType(run_name)
        module.__dict__.update(namespace)
        sys.modules[run_name] = module
        yield namespace
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        if saved_module is missing:
            sys.modules.pop(run_name, None)
        else:
            sys.modules[run_name] = saved_module  # type: ignore[assignment]


def _run(path: Path, name: str, run_name: str) -> dict[str, Any]:
    """Run the script; a syntax error or a failed import in it becomes a one-line
    :class:`CommandError` naming the script and the line."""
    try:
        return runpy.run_path(str(path), run_name=run_name)
    except SyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        raise CommandError(f"{name}: SyntaxError: {exc.msg}{where}") from None
    except ImportError as exc:
        line = None
        tb = exc.__traceback__
        target = str(path.resolve())
        while tb is not None:  # the script's own line that imported
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == target:
                line = tb.tb_lineno
            tb = tb.tb_next
        where = f" (line {line})" if line else ""
        raise CommandError(f"{name}: {type(exc).__name__}: {exc}{where}") from None


def values_of(namespace: Mapping[str, Any], cls: type) -> list[Any]:
    """The distinct ``cls`` instances among the globals, in order of first appearance."""
    return list({id(v): v for v in namespace.values() if isinstance(v, cls)}.values())


def pick(namespace: Mapping[str, Any], name: str, cls: type, what: str, script: str) -> Any:
    """``namespace[name]`` if it is a ``cls``, else the only ``cls`` among the globals.

    Raises:
        CommandError: none, or several and none named ``name``.
    """
    value = namespace.get(name)
    if isinstance(value, cls):
        return value
    found: dict[int, str] = {}
    for key, obj in namespace.items():
        if isinstance(obj, cls) and not key.startswith("__"):
            found.setdefault(id(obj), key)
    if len(found) == 1:
        return namespace[next(iter(found.values()))]
    if not found:
        raise CommandError(f"{script} defines no {what} (a {cls.__name__} named `{name}`)")
    names = ", ".join(sorted(found.values()))
    plural = what[:-1] + "ies" if what.endswith("y") else what + "s"
    raise CommandError(
        f"{script} defines {len(found)} {plural} ({names}) and none is named `{name}`"
    )
