"""How a trainer class travels to worker processes (:class:`TrainerSpec`), and how
those processes are started without re-running the user's script.

A class from an installed library (a module of an installed distribution, see
:func:`stagetree.identity.is_library_module`) travels by reference
(``module:qualname``) and the worker imports it. Every other class (the user's own:
defined in a script's ``__main__``, under ``stagetree run``, in a notebook, ``python
-c``, stdin, inside a function, or in a user module next to the script) travels by
value, pickled with ``cloudpickle`` together with the functions and constants of its
own modules it uses. A worker never imports the user's script or study module, so its
top-level code (a study without an ``if __name__ == "__main__":`` guard) never runs
there. Names from other modules that the class uses travel by reference, as pickle
does; the worker has the parent's ``sys.path``.

Worker processes are started with ``spawn``, whose children normally run the parent's
main script again (as ``__mp_main__``) to find what was defined there: that is what
made a guard-less study start its own study in every worker. :func:`no_main_rerun`
leaves the main script out of what a child prepares; by-value trainers do not need it.

Several trainers, one pool: an executor sends each trainer registered with
``add_trainer`` to a worker the first time that worker gets a batch of its key, with
the same by-reference / by-value rule; the worker holds them in
:class:`TrainerClasses` and loads each (unpickles, imports) when a batch first needs it.

Strings name a class explicitly: ``"pkg.module:Class"`` is imported by name,
``"path/file.py:Class"`` loads that file under a stable module name (its ``if
__name__ == "__main__":`` block does not run, the rest of the file does).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import io
import logging
import multiprocessing.spawn
import os
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.identity import is_library_module
from stagetree.trainer import Trainer

__all__ = ["TrainerClasses", "TrainerSpec", "no_main_rerun"]

_PICKLE_LOCK = threading.Lock()


@dataclass(frozen=True)
class TrainerSpec:
    """A Trainer subclass as it travels to a worker.

    Attributes:
        module: module name the class was defined in (``"__main__"`` for a script;
            empty for a ``file.py:Class`` string).
        qualname: the class's qualified name (dotted for nested classes).
        path: the file to load the class from (``file.py:Class`` strings only).
        payload: the class pickled by value with ``cloudpickle`` (the user's own
            classes), or None when it is imported by name.
    """

    module: str
    qualname: str
    path: str | None = None
    payload: bytes | None = field(default=None, repr=False)

    @classmethod
    def of(cls, trainer: type[Trainer] | str | TrainerSpec) -> TrainerSpec:
        """Build a spec from a class, a ``"module:Class"`` / ``"path/file.py:Class"``
        string, or a spec.

        Raises:
            ValueError: not a class nor a ``module:Class`` string, or a class that
                cannot be pickled (its error says which object).
        """
        if isinstance(trainer, TrainerSpec):
            return trainer
        if isinstance(trainer, str):
            target, sep, qualname = trainer.rpartition(":")
            if not sep or not target or not qualname:
                raise ValueError(f"trainer reference {trainer!r} is not 'module:Class'")
            if target.endswith(".py") or os.sep in target or "/" in target:
                return cls("", qualname, os.path.abspath(target))
            return cls(target, qualname, None)
        if not isinstance(trainer, type):
            raise ValueError(f"trainer must be a Trainer subclass, got {trainer!r}")
        if _by_reference(trainer):
            return cls(trainer.__module__, trainer.__qualname__)
        return cls(trainer.__module__, trainer.__qualname__, payload=_dumps_by_value(trainer))

    @property
    def by_value(self) -> bool:
        """Whether the class travels pickled by value."""
        return self.payload is not None

    def resolve(self) -> type[Trainer]:
        """The class: unpickled, imported by name, or loaded from its file.

        Raises:
            ImportError: it cannot be unpickled, imported or loaded.
        """
        if self.payload is not None:
            return _loads(self.payload, str(self))
        errors: list[str] = []
        if self.module:
            try:
                return _attr(importlib.import_module(self.module), self.qualname)
            except (ImportError, AttributeError) as exc:
                errors.append(f"import {self.module}: {exc}")
        if self.path:
            try:
                return _attr(_load_file(self.path), self.qualname)
            except (ImportError, AttributeError, OSError) as exc:
                errors.append(f"load {self.path}: {exc}")
        raise ImportError(f"cannot import trainer {self}: " + "; ".join(errors))

    def check(self) -> None:
        """Fail now, in the process that made the spec, when a worker could not load it:
        a class by reference is imported (or loaded from its file). A class by value
        was pickled already and is not unpickled here: cloudpickle would rebind the
        user's own class to copies of its methods whose module globals are a copy
        (what the trainer then writes to a global, the user's module never sees).

        Raises:
            ImportError: a class by reference that cannot be imported or loaded.
        """
        if self.payload is None:
            self.resolve()

    def __str__(self) -> str:
        return f"{self.module or self.path}:{self.qualname}"


class TrainerClasses(Mapping[str, "type[Trainer]"]):
    """Trainer classes by key, as a worker process or actor holds them (a
    :class:`~stagetree.executors.worker.Worker`'s factories).

    The default trainer (key ``""``) is loaded when the worker starts; the spec of any
    other key arrives with the first batch of that key (:meth:`add`) and is loaded (and
    warmed up) the first time a batch looks it up. A spec that cannot be loaded raises
    ``ImportError`` on each lookup, so each of its batches fails at its start; a key
    with no spec is missing (``get`` returns None).
    """

    def __init__(self, default: type[Trainer]) -> None:
        self._classes: dict[str, type[Trainer]] = {"": default}
        self._specs: dict[str, TrainerSpec] = {}

    def add(self, key: str, spec: TrainerSpec) -> None:
        """Hold ``spec`` under ``key`` (the executor never sends another spec for it)."""
        if key not in self._classes:
            self._specs[key] = spec

    def __getitem__(self, key: str) -> type[Trainer]:
        cls = self._classes.get(key)
        if cls is not None:
            return cls
        spec = self._specs[key]  # KeyError: an unknown key
        try:
            cls = spec.resolve()
        except Exception as exc:  # a KeyError here is the loaded code's: not "unknown key"
            raise ImportError(
                f"cannot load trainer {key!r} on this worker: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            cls.warmup()
        except Exception:  # only an optimisation: construction reports real problems
            logging.getLogger(__name__).exception("%s.warmup failed", spec)
        self._classes[key] = cls
        del self._specs[key]
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter([*self._classes, *self._specs])

    def __len__(self) -> int:
        return len(self._classes) + len(self._specs)


def _by_reference(trainer: type) -> bool:
    """Library classes that a fresh interpreter imports by name as this very class."""
    if "<locals>" in trainer.__qualname__ or not is_library_module(trainer.__module__):
        return False
    module = sys.modules.get(trainer.__module__)
    if module is None or getattr(module, "__spec__", None) is None:
        return False
    try:
        return _attr(module, trainer.__qualname__) is trainer
    except AttributeError:
        return False


def _user_modules(trainer: type) -> list[Any]:
    """Modules of the user's classes the trainer is made of, to pickle by value."""
    out = []
    for klass in trainer.__mro__:
        module = sys.modules.get(klass.__module__)
        if (
            module is not None
            and klass.__module__ != "__main__"  # cloudpickle pickles it by value anyway
            and not is_library_module(klass.__module__)
            and module not in out
        ):
            out.append(module)
    return out


def _dumps_by_value(trainer: type) -> bytes:
    import cloudpickle

    with _PICKLE_LOCK:
        registered = set(cloudpickle.list_registry_pickle_by_value())
        added = []
        for module in _user_modules(trainer):
            if module.__name__ not in registered:
                cloudpickle.register_pickle_by_value(module)
                added.append(module)
        try:
            buffer = io.BytesIO()
            _pickler(cloudpickle)(buffer).dump(trainer)
            return buffer.getvalue()
        except Exception as exc:
            culprit = _culprit(trainer, cloudpickle)
            what = culprit or "a class-level or global object it uses"
            raise ValueError(
                f"trainer {trainer.__qualname__} cannot be sent to worker processes: "
                f"{type(exc).__name__}: {exc} ({what} cannot be pickled; create it in "
                "__init__ instead)"
            ) from exc
        finally:
            for module in added:
                cloudpickle.unregister_pickle_by_value(module)


def _culprit(trainer: type, cloudpickle: Any) -> str | None:
    """Name the attribute (``Class.attr``) or global (``module.name``) of the trainer's
    own classes that cannot be pickled, when one can be found."""

    def fails(obj: Any) -> bool:
        try:
            _pickler(cloudpickle)(io.BytesIO()).dump(obj)
        except Exception:
            return True
        return False

    own = [k for k in trainer.__mro__ if not is_library_module(k.__module__)]
    for klass in own:
        for name, value in vars(klass).items():
            if name.startswith("__") or isinstance(value, (types.FunctionType, property)):
                continue
            if fails(value):
                return f"attribute {klass.__qualname__}.{name}"
    for klass in own:
        for value in vars(klass).values():
            func = getattr(value, "__func__", value)
            code = getattr(func, "__code__", None)
            if code is None:
                continue
            for name in code.co_names:
                value = func.__globals__.get(name, types)
                skip = isinstance(value, (types.ModuleType, type, types.FunctionType))
                if not skip and fails(value):
                    return f"global {func.__globals__.get('__name__', '?')}.{name}"
    return None


def _pickler(cloudpickle: Any) -> Any:
    """cloudpickle's pickler, also for decorators it cannot pickle by value in 3.11
    (``functools.cached_property`` holds a lock, an ``lru_cache`` wrapper is looked
    up by name): they are rebuilt around their function in the worker."""

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is types.CodeType:
                return _code_reduce(cloudpickle, obj)
            if type(obj) is functools.cached_property:
                return _cached_property, (obj.func, obj.attrname)
            if isinstance(obj, _LRU_WRAPPER) and isinstance(obj.__wrapped__, types.FunctionType):
                params = obj.cache_parameters()
                return _lru_cached, (obj.__wrapped__, params["maxsize"], params["typed"])
            return super().reducer_override(obj)

    return Pickler


_LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(lambda: None))
_DYNAMIC_FILENAME = "<dynamic-code>"


def _code_reduce(cloudpickle: Any, code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with its real file name kept: since
    cloudpickle 3.1.3 it writes ``<dynamic-code>`` instead, and a trainer's traceback
    from a worker would no longer say which file of the user's failed."""
    reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
    if reduce is None:
        return NotImplemented
    constructor, args = reduce(code)
    args = tuple(code.co_filename if arg == _DYNAMIC_FILENAME else arg for arg in args)
    return constructor, args


def _cached_property(func: Any, attrname: str | None) -> Any:
    prop = functools.cached_property(func)
    prop.attrname = attrname
    return prop


def _lru_cached(func: Any, maxsize: int | None, typed: bool) -> Any:
    return functools.lru_cache(maxsize=maxsize, typed=typed)(func)


_LOADED: dict[bytes, type[Trainer]] = {}


def _loads(payload: bytes, label: str) -> type[Trainer]:
    import cloudpickle

    digest = hashlib.sha256(payload).digest()
    cached = _LOADED.get(digest)
    if cached is not None:
        return cached
    try:
        obj = cloudpickle.loads(payload)
    except Exception as exc:
        raise ImportError(f"cannot unpickle trainer {label}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, type):
        raise ImportError(f"trainer {label} unpickled to {obj!r}, not a class")
    _LOADED[digest] = obj
    return obj


def _attr(module: Any, qualname: str) -> type[Trainer]:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise AttributeError(f"{qualname} is not a class")
    return obj


def _load_file(path: str) -> Any:
    name = "_stagetree_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ---------------------------------------------------------------------- starting children

_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_STATE = threading.local()
_INSTALL_LOCK = threading.Lock()


def _install() -> None:
    """Wrap ``multiprocessing.spawn.get_preparation_data`` (once) so that, inside
    :func:`no_main_rerun` on this thread, it leaves out the main module."""
    with _INSTALL_LOCK:
        original = multiprocessing.spawn.get_preparation_data
        if getattr(original, "_stagetree_wrapped", False):
            return

        def get_preparation_data(name: str) -> dict[str, Any]:
            data = original(name)
            if getattr(_STATE, "active", False):
                for key in _MAIN_KEYS:
                    data.pop(key, None)
            return data

        get_preparation_data._stagetree_wrapped = True  # type: ignore[attr-defined]
        multiprocessing.spawn.get_preparation_data = get_preparation_data


@contextlib.contextmanager
def no_main_rerun() -> Iterator[None]:
    """Processes started by this thread inside the block (``spawn`` or
    ``forkserver``) do not run the parent's ``__main__`` script or module again.
    Other threads' processes are not affected."""
    _install()
    before = getattr(_STATE, "active", False)
    _STATE.active = True
    try:
        yield
    finally:
        _STATE.active = before
