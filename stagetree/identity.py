"""Trainer identity: the fingerprint that goes into a plan tree's root key, and which
trials of a study belong to which trainer version.

:func:`trainer_fingerprint` hashes a canonical description of the trainer's own code,
never of how or where it was launched:

* every class of the trainer (its MRO up to the first class of an installed library)
  by its qualified name (never its module name: ``__main__``, ``__stagetree_run__``,
  ``study`` and a notebook's ``__main__`` are the same trainer) and its members;
* each function or method by its code object without positions: bytecode, constants
  (nested code objects recursively), names, argument counts and defaults. Line numbers,
  file names and comments are not part of a code object's content, so a comment or a
  grid entry added above the trainer changes nothing, and a class typed into a notebook,
  ``python -c`` or stdin hashes like the same class in a file;
* module-level functions, classes and constants the code reads by global name
  (``LOAD_GLOBAL``), followed recursively when they live in the user's own modules;
  simple constants (numbers, strings, tuples, lists, dicts and sets of them) by value,
  other objects by their type;
* anything from an installed library (a module that belongs to an installed
  distribution, the standard library, builtins) by its name and the library's version.

Bytecode is specific to the Python minor version, which is part of the fingerprint:
a new Python version retrains (pass ``version=`` to a Study to pin it by hand).

Trials record the version that trained them in their ``attrs`` (``{"version": ...}``);
:func:`split_trials` keeps the current version's and counts the others, so that no
report mixes two trainer versions.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import hashlib
import importlib.metadata
import inspect
import os
import re
import sys
import sysconfig
import types
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from stagetree.exceptions import TrainerChangedWarning

__all__ = [
    "TrainerChangedWarning",
    "current_version",
    "describe_trainer",
    "is_library_module",
    "split_trials",
    "trainer_fingerprint",
    "trial_version",
]


_SKIP_ATTRS = frozenset(
    {
        "__module__",
        "__qualname__",
        "__dict__",
        "__weakref__",
        "__doc__",
        "__annotations__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
        "__abstractmethods__",
        "_abc_impl",
    }
)
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)
_FLAG_MASK = 0x3FF  # CO_OPTIMIZED..CO_ASYNC_GENERATOR; not the __future__ compiler flags
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p))
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots if r))


# How the standard library finds a distribution's top-level names: ``top_level.txt``,
# else (Python 3.11+) names inferred from its file list.
_INFERRED = getattr(importlib.metadata, "_top_level_inferred", None)
_FILE_LISTS = ("RECORD", "installed-files.txt", "SOURCES.txt")


@functools.lru_cache(maxsize=1)
def _installed_distributions() -> tuple[tuple[Any, tuple[str, ...], str], ...]:
    """Every installed distribution (in the order :func:`importlib.metadata.distributions`
    finds them) with its declared top-level names and, where it declares none, the raw
    text of its file list."""
    out = []
    for dist in importlib.metadata.distributions():
        declared = tuple((dist.read_text("top_level.txt") or "").split())
        listed = "" if declared else "\n".join(dist.read_text(n) or "" for n in _FILE_LISTS)
        out.append((dist, declared, listed))
    return tuple(out)


def _lists_top(listed: str, top: str) -> bool:
    """Whether a file list names a path whose first part is ``top`` (a directory, or a
    file ``top.<suffix>`` or ``top``): a cheap superset of the names inferred from it."""
    pattern = rf'^"?(?:\./)*{re.escape(top)}(?:[/.,"]|$)'
    return top in listed and re.search(pattern, listed, re.MULTILINE) is not None


@functools.lru_cache(maxsize=512)
def _distributions_of(top: str) -> tuple[str, ...]:
    """The names of the distributions that provide the top-level module ``top``:
    ``importlib.metadata.packages_distributions().get(top)``, without that function's
    cost (it parses every distribution's metadata and builds a path object for every
    file it lists, 0.2-2 s with a few hundred distributions installed). Only the
    distributions that may provide ``top`` are looked at closely: those that declare it,
    and those that declare nothing and whose file list contains the name (a name
    inferred from a file list is part of a path in it)."""
    names = []
    try:
        for dist, declared, listed in _installed_distributions():
            if declared:
                provides = top in declared
            else:
                provides = (
                    _INFERRED is not None and _lists_top(listed, top) and top in _INFERRED(dist)
                )
            if provides:
                names.append(dist.metadata["Name"])
    except Exception:  # a broken metadata entry must not break the fingerprint
        return ()
    return tuple(names)


def _top(module_name: str) -> str:
    return module_name.split(".", 1)[0]


@functools.lru_cache(maxsize=512)
def _library_version(module_name: str) -> str | None:
    """``"dist==version"`` when ``module_name`` belongs to an installed library, else
    None (the user's own code).

    Libraries: the standard library and builtins, stagetree itself, and modules whose
    files lie under an installation directory (``site-packages``, ``dist-packages``,
    the interpreter's library paths). Code anywhere else is the user's, also when it
    is a package installed in editable (development) mode: its version does not change
    when it is edited.
    """
    if module_name in ("__main__", "__mp_main__"):  # a script, notebook, -c, stdin
        return None
    top = _top(module_name)
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "builtins":
        return f"python=={sys.version_info[0]}.{sys.version_info[1]}"
    module = sys.modules.get(module_name) or sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if top != "stagetree" and path is not None and not _installed(path):
        return None
    dists = _distributions_of(top)
    if not dists:  # not imported (then unknown: the user's), or found without metadata
        return None if path is None else f"{top}=={getattr(module, '__version__', '?')}"
    name = sorted(dists)[0]
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def _installed(path: str) -> bool:
    return os.path.realpath(path).startswith(_library_roots())


def is_library_module(module_name: str | None) -> bool:
    """Whether ``module_name`` is an installed library's (followed by version only), not
    the user's own code (followed into its source)."""
    return bool(module_name) and _library_version(str(module_name)) is not None


class _Describer:
    """Builds a canonical, position-free description (nested tuples of strings)."""

    def __init__(self) -> None:
        self.seen: dict[int, str] = {}
        self.keep: list[Any] = []  # keeps described objects alive: ids stay unique

    def ref(self, obj: Any, label: str) -> str | None:
        """The back-reference of an object already described (cycles, sharing)."""
        key = id(obj)
        if key in self.seen:
            return self.seen[key]
        self.seen[key] = f"@{len(self.seen)}:{label}"
        self.keep.append(obj)
        return None

    # -- values ----------------------------------------------------------------------

    def value(self, obj: Any, names: Iterable[str] = ()) -> Any:
        if isinstance(obj, _SIMPLE):
            return ("=", type(obj).__name__, repr(obj))
        if isinstance(obj, (tuple, list)) and len(obj) <= 1000:
            return (type(obj).__name__, *(self.value(v) for v in obj))
        if isinstance(obj, (set, frozenset)) and len(obj) <= 1000:
            return (type(obj).__name__, *sorted(repr(self.value(v)) for v in obj))
        if isinstance(obj, dict) and len(obj) <= 1000:
            items = sorted((repr(self.value(k)), self.value(v)) for k, v in obj.items())
            return ("dict", *items)
        if isinstance(obj, types.CodeType):
            return self.code(obj)
        if isinstance(obj, (staticmethod, classmethod)):
            return (type(obj).__name__, self.value(obj.__func__))
        if isinstance(obj, property):
            return ("property", *(self.value(f) for f in (obj.fget, obj.fset, obj.fdel)))
        if isinstance(obj, functools.partial):
            return ("partial", self.value(obj.func), self.value(obj.args), self.value(obj.keywords))
        if isinstance(obj, types.ModuleType):
            return self.module(obj, names)
        if isinstance(obj, type):
            return self.cls(obj)
        if isinstance(obj, (types.FunctionType, types.MethodType)) or hasattr(obj, "__wrapped__"):
            return self.function(obj)
        if callable(obj) and hasattr(obj, "__qualname__"):  # builtins, C functions
            return self.library(obj)
        return self.instance(obj)

    def instance(self, obj: Any) -> Any:
        """Other objects: numpy arrays up to 1 MiB by content, instances of the user's
        classes by their class and attributes, anything else by its type."""
        cls = type(obj)
        nbytes = getattr(obj, "nbytes", None)
        if cls.__module__ == "numpy" and isinstance(nbytes, int) and nbytes <= 1 << 20:
            data = hashlib.sha256(obj.tobytes()).hexdigest()
            return ("array", str(obj.dtype), str(obj.shape), data)
        state = getattr(obj, "__dict__", None)
        if _library_version(cls.__module__) is None and isinstance(state, dict):
            back = self.ref(obj, cls.__qualname__)
            if back is not None:
                return ("ref", back)
            return ("instance", self.cls(cls), self.value(state))
        return ("object", self.type_name(cls))

    def type_name(self, cls: type) -> str:
        version = _library_version(cls.__module__)
        return f"{cls.__module__}.{cls.__qualname__} {version}" if version else cls.__qualname__

    def library(self, obj: Any) -> tuple[str, ...]:
        module = getattr(obj, "__module__", None) or "builtins"
        qualname = getattr(obj, "__qualname__", type(obj).__qualname__)
        return ("lib", module, qualname, str(_library_version(module)))

    # -- modules, classes, functions ---------------------------------------------------

    def module(self, module: types.ModuleType, names: Iterable[str]) -> Any:
        version = _library_version(module.__name__)
        if version is not None:
            return ("module", module.__name__, version)
        back = self.ref(module, "module")
        out: list[Any] = ["user-module"]
        if back is None:
            # A user module used as ``helpers.f``: every name the code uses that it has.
            for name in sorted(set(names)):
                if name in vars(module):
                    out.append((name, self.value(vars(module)[name], names)))
        else:
            out.append(back)
        return tuple(out)

    def cls(self, cls: type) -> Any:
        if _library_version(cls.__module__) is not None:
            return self.library(cls)
        back = self.ref(cls, cls.__qualname__)
        if back is not None:
            return ("ref", back)
        members = []
        for name in sorted(vars(cls)):
            if name in _SKIP_ATTRS:
                continue
            members.append((name, self.value(vars(cls)[name])))
        bases = tuple(self.value(b) for b in cls.__bases__ if b is not object)
        return ("class", cls.__qualname__, bases, tuple(members))

    def function(self, fn: Any) -> Any:
        fn = inspect.unwrap(fn) if hasattr(fn, "__wrapped__") else fn
        if isinstance(fn, types.MethodType):
            fn = fn.__func__
        if not isinstance(fn, types.FunctionType):
            return self.library(fn)
        if _library_version(fn.__module__) is not None:
            return self.library(fn)
        back = self.ref(fn, fn.__qualname__)
        if back is not None:
            return ("ref", back)
        code = fn.__code__
        globals_ = fn.__globals__
        used = []
        builtins = globals_.get("__builtins__")
        for name in sorted(_global_names(code)):
            if name in globals_:
                used.append((name, self.value(globals_[name], _all_names(code))))
            elif name in builtins if isinstance(builtins, dict) else hasattr(builtins, name):
                used.append((name, "builtin"))
            else:
                used.append((name, "undefined"))
        closure = tuple(
            self.value(cell.cell_contents) if _cell_full(cell) else "empty"
            for cell in fn.__closure__ or ()
        )
        return (
            "function",
            fn.__qualname__,
            self.code(code),
            self.value(fn.__defaults__),
            self.value(fn.__kwdefaults__),
            closure,
            tuple(used),
        )

    def code(self, code: types.CodeType) -> Any:
        return (
            "code",
            code.co_name,
            code.co_argcount,
            code.co_posonlyargcount,
            code.co_kwonlyargcount,
            code.co_flags & _FLAG_MASK,
            _instructions(code),
            tuple(self.value(c) for c in code.co_consts),
            code.co_names,
            code.co_varnames,
            code.co_freevars,
            code.co_cellvars,
        )


def _instructions(code: types.CodeType) -> tuple[Any, ...]:
    """The code's instructions without positions or inline caches: names by name, jump
    targets and exception handlers by instruction index. The compiler picks between
    equivalent forms by context (``LOAD_METHOD`` or ``LOAD_ATTR`` for ``math.sqrt(x)``,
    depending on whether ``import math`` is in the same compilation unit: a notebook
    compiles each statement alone), so those forms are written alike."""
    instructions = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
    index = {ins.offset: n for n, ins in enumerate(instructions)}
    out: list[Any] = []
    for ins in instructions:
        name = _SAME_OP.get(ins.opname, ins.opname)
        if ins.opcode in _JUMPS:
            out.append((name, index.get(ins.argval, -1)))
        elif ins.opcode in dis.hasconst:  # by index: co_consts are described in order
            out.append((name, "const", ins.arg))
        elif isinstance(ins.argval, str):
            out.append((name, ins.argval))
        else:
            out.append((name, ins.arg))
    parse = getattr(dis, "_parse_exception_table", None)
    if parse is not None:
        with contextlib.suppress(Exception):
            for entry in parse(code):
                out.append(
                    (
                        "handler",
                        index.get(entry.start, -1),
                        index.get(entry.end, -1),
                        index.get(entry.target, -1),
                        entry.depth,
                        entry.lasti,
                    )
                )
    return tuple(out)


def _cell_full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _global_names(code: types.CodeType) -> set[str]:
    """Names the code (and the code nested in it) reads or writes as globals."""
    out: set[str] = set()
    for c in _codes(code):
        for ins in dis.get_instructions(c):
            if ins.opname in _GLOBAL_OPS and isinstance(ins.argval, str):
                out.add(ins.argval)
    return out


def _all_names(code: types.CodeType) -> set[str]:
    return {name for c in _codes(code) for name in c.co_names}


def describe_trainer(trainer: type) -> Any:
    """The canonical description :func:`trainer_fingerprint` hashes (for debugging:
    compare two descriptions to see what changed)."""
    return (
        "stagetree-trainer/1",
        f"python{sys.version_info[0]}.{sys.version_info[1]}",
        _Describer().cls(trainer),
    )


def trainer_fingerprint(trainer: type) -> str:
    """A short hash of the trainer's own code (see the module docstring): the same for
    every way of launching it, changed by any edit of the code it is made of."""
    text = repr(describe_trainer(trainer))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------- versions of trials


def trial_version(trial: Mapping[str, Any], study_meta: Mapping[str, Any] | None = None) -> Any:
    """The trainer version that a trial record belongs to: ``attrs["version"]``, else
    (trials recorded before versions were) the version the study was created with."""
    attrs = trial.get("attrs") or {}
    if "version" in attrs:
        return attrs["version"]
    return (study_meta or {}).get("version")


def _recency(trial: Mapping[str, Any]) -> tuple[float, int]:
    attrs = trial.get("attrs") or {}
    return (float(attrs.get("opened", trial.get("created") or 0.0)), int(trial.get("id", 0)))


def current_version(
    trials: Iterable[Mapping[str, Any]], study_meta: Mapping[str, Any] | None = None
) -> Any:
    """The version of the study's latest run: that of the trial most recently added
    (or re-opened by a Study of its version); the study's recorded version when it has
    no trials."""
    latest = max(trials, key=_recency, default=None)
    if latest is None:
        return (study_meta or {}).get("version")
    return trial_version(latest, study_meta)


def split_trials(
    trials: Iterable[Mapping[str, Any]],
    study_meta: Mapping[str, Any] | None = None,
    version: Any = None,
) -> tuple[list[dict[str, Any]], int]:
    """``(trials of version, number of trials of other versions)``; ``version``
    defaults to :func:`current_version`."""
    records = [dict(t) for t in trials]
    if version is None:
        version = current_version(records, study_meta)
    own = [t for t in records if trial_version(t, study_meta) == version]
    return own, len(records) - len(own)


def announce_change(trainer_name: str, old: Any, new: Any, count: int, stacklevel: int) -> None:
    """Warn once that ``count`` trials of version ``old`` will train again."""
    noun = "trial" if count == 1 else "trials"
    warnings.warn(
        f"trainer {trainer_name} changed since the last run on this storage: {count} "
        f"{noun} will train again; pass version={old!r} to keep the old results",
        TrainerChangedWarning,
        stacklevel=stacklevel,
    )
