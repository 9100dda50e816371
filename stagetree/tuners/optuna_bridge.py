"""Optuna samplers as stagetree's proposal generators (``Tuner(..., sampler=...)``).

A tuner given an ``optuna.samplers.BaseSampler`` asks Optuna for each new trial's
configuration (ask-and-tell API) instead of drawing it from ``space.sample``, and tells
Optuna what became of it:

* every result the tuner observes is reported as an intermediate value at its step;
* a trial trained to the tuner's horizon (its last rung) is told ``COMPLETE`` with the
  metric there; a trial whose job failed is told ``FAIL``;
* a trial a rung stops (SHA, Hyperband, ASHA, median stopping) is told ``PRUNED``, so
  the sampler ranks it by how far it got and its last value (Optuna's TPE does), and
  ASHA + TPE works like BOHB. Trials still open when the search ends are told
  ``PRUNED`` too.

The space's distributions map to Optuna's (:func:`suggest_trial`): ``Uniform`` and
``LogUniform`` to ``FloatDistribution`` (``log=True``), ``IntUniform`` to
``IntDistribution``, ``Choice`` to ``CategoricalDistribution``; those inside sequence
templates get dotted names (``lr.init``, ``lr.milestones``), those inside option ``k``
of a choice ``name.k.arg``.

Resume: the Optuna study lives in the plan's database when the plan is SQL (Optuna's
``RDBStorage`` on the same URL), else in an in-memory storage that lives as long as the
plan. Its name is derived from the stagetree study, the trainer version, the tuner
class and the space (:func:`optuna_study_name`). Tuner trial ``i`` is Optuna trial
number ``i``: a resumed tuner (replaying its log) re-reads the configuration of the
trials Optuna already holds instead of asking again, and a trial already finished in
Optuna is never told again.

Opening an ``RDBStorage`` (importing SQLAlchemy's ORM and Alembic, creating and
stamping Optuna's tables) costs seconds, more than a small task's first step. When the
database holds no trial of the study yet (a first run: one SQL query says so), the
bridge works on an in-memory Optuna study and writes it behind into the database
(:class:`_WriteBehind`): from the first result on, a copy process (forked from the
local executor's fork server, where one runs; else a thread of the driver, whose
ORM imports happen before it starts, with the driver held off) opens the storage and
writes what each bridge call changed, as the direct storage would have written it.
The search's end (or its interruption) waits for the copy.
Decisions are those of the direct storage (the sampler reads the same trials); a run
killed before the copy began leaves the database without its trials, and its resume
asks a fresh copy of the sampler again: the same configurations for a seeded sampler.
In a process, the copy runs beside the tuner instead of in its thread (SQLAlchemy's
ORM and Alembic in the driver cost a small ASHA + TPE run about half of its time after
the first result, ``benchmarks/RESULTS.md``); a run killed mid-search may then miss the
changes its last hand-over had not taken, and its resume asks again from there.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import inspect
import multiprocessing
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagetree.distributions import Choice, Distribution, IntUniform, LogUniform, Uniform
from stagetree.exceptions import InvalidSequenceError, InvalidSpaceError, TunerError
from stagetree.executors._driverfork import start_helper
from stagetree.extras import install_hint
from stagetree.space import RandomSpace, TrialSpec, _check_fixed_value, _to_sequence

if TYPE_CHECKING:
    from stagetree.space import TrialSpec

__all__ = [
    "SampledSpecs",
    "SamplerBridge",
    "check_sampler",
    "check_sampler_space",
    "optuna_study_name",
    "suggest_trial",
]

_PLAIN = (str, int, float, bool, type(None))
# In-memory Optuna storages by plan storage: a memory:// plan keeps its sampler history
# as long as it lives (a second tune() in the same process resumes it).
_MEMORY: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise TunerError(f"sampler= needs Optuna: {install_hint('optuna')}") from None
    return optuna


def check_sampler(sampler: Any) -> Any:
    """``sampler`` if it is None or an ``optuna.samplers.BaseSampler``.

    Raises:
        TunerError: anything else (naming its type), or Optuna is not installed.
    """
    if sampler is None:
        return None
    optuna = _optuna()
    if not isinstance(sampler, optuna.samplers.BaseSampler):
        raise TunerError(
            f"sampler must be an optuna.samplers.BaseSampler (e.g. "
            f"optuna.samplers.TPESampler(seed=0)), got {type(sampler).__name__} {sampler!r}"
        )
    return sampler


# --------------------------------------------------------------------------- the space


def _entries(space: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fixed, hp)`` entries of a random space, in the order the space draws them."""

    if not isinstance(space, RandomSpace):
        raise TunerError(
            f"sampler= needs a stagetree.space.RandomSpace (its distributions become "
            f"Optuna's), got {type(space).__name__}: a grid or a list of trials has "
            "nothing to sample; drop sampler= or describe the space with distributions"
        )
    if space._where is not None:
        raise TunerError(
            "sampler= cannot honour RandomSpace(where=...): Optuna proposes each "
            "configuration once and a rejected one cannot be redrawn; express the "
            "constraint in the distributions (e.g. a Choice of valid combinations)"
        )
    return dict(space._fixed), dict(space._hp)


def _template_args(template: Any) -> list[tuple[str, Any]]:
    """``(argument name, value)`` of a sequence template, positional ones named."""
    bound = inspect.signature(template.family.__init__).bind(
        None, *template.args, **template.kwargs
    )
    return list(bound.arguments.items())[1:]  # without self


def _option_label(option: Any) -> Any:
    return option if isinstance(option, _PLAIN) else repr(option)


def _walk(name: str, entry: Any, trial: Any) -> Any:
    """Resolve ``entry`` like the space does, asking ``trial`` (an Optuna trial or
    ``FixedTrial``) for every distribution, named ``name`` and dotted sub-names."""
    if isinstance(entry, Uniform):
        return trial.suggest_float(name, entry.low, entry.high)
    if isinstance(entry, LogUniform):
        return trial.suggest_float(name, entry.low, entry.high, log=True)
    if isinstance(entry, IntUniform):
        return trial.suggest_int(name, entry.low, entry.high)
    if isinstance(entry, Choice):
        labels = [_option_label(o) for o in entry.options]
        label = trial.suggest_categorical(name, labels)
        k = labels.index(label)
        return _walk(f"{name}.{k}", entry.options[k], trial)
    if isinstance(entry, Distribution):
        raise InvalidSpaceError(_unsupported(name, entry))
    if getattr(entry, "is_template", False):
        kwargs = {arg: _walk(f"{name}.{arg}", v, trial) for arg, v in _template_args(entry)}
        return entry.family(**kwargs)
    if isinstance(entry, list):
        return [_walk(f"{name}.{i}", v, trial) for i, v in enumerate(entry)]
    if isinstance(entry, tuple):
        return tuple(_walk(f"{name}.{i}", v, trial) for i, v in enumerate(entry))
    return entry


def _unsupported(name: str, entry: Any) -> str:
    return (
        f"hyper-parameter {name!r}: Optuna cannot represent the distribution "
        f"{type(entry).__name__} {entry!r}; samplers support Uniform, LogUniform, "
        "IntUniform and Choice (use one of those, or drop sampler=)"
    )


def _check_entry(name: str, entry: Any) -> None:
    """Refuse what :func:`_walk` cannot map, before anything is asked or written."""
    if isinstance(entry, Choice):
        labels = [_option_label(o) for o in entry.options]
        if len(set(map(repr, labels))) < len(labels):
            raise InvalidSpaceError(
                f"hyper-parameter {name!r}: Choice options {list(entry.options)!r} are not "
                "distinct for Optuna (two options print the same)"
            )
        for k, option in enumerate(entry.options):
            _check_entry(f"{name}.{k}", option)
    elif isinstance(entry, (Uniform, LogUniform, IntUniform)):
        return
    elif isinstance(entry, Distribution):
        raise InvalidSpaceError(_unsupported(name, entry))
    elif getattr(entry, "is_template", False):
        for arg, value in _template_args(entry):
            _check_entry(f"{name}.{arg}", value)
    elif isinstance(entry, (list, tuple)):
        for i, value in enumerate(entry):
            _check_entry(f"{name}.{i}", value)


def check_sampler_space(space: Any) -> None:
    """Raise when ``space`` cannot be searched by an Optuna sampler (not a random
    space, a ``where`` filter, or a distribution Optuna cannot represent: named)."""
    fixed, hp = _entries(space)
    for name, entry in {**fixed, **hp}.items():
        _check_entry(name, entry)


def suggest_trial(space: Any, trial: Any) -> TrialSpec:
    """The trial spec ``trial`` (an ``optuna.Trial`` or ``optuna.trial.FixedTrial``)
    proposes in ``space``: fixed entries first, then hp, in sorted name order (the
    order the space draws them)."""

    fixed, hp = _entries(space)
    config: dict[str, Any] = {}
    for name, entry in fixed.items():
        value = _walk(name, entry, trial)
        if isinstance(value, list):
            value = tuple(value)
        _check_fixed_value(name, value)
        config[name] = value
    seqs = {}
    for name, entry in hp.items():
        try:
            value = _walk(name, entry, trial)
        except InvalidSequenceError as exc:
            raise InvalidSpaceError(f"hyper-parameter {name!r}: {exc}") from exc
        seqs[name] = _to_sequence(name, value)
    return TrialSpec(config, seqs)


def optuna_study_name(study: str, version: str, tuner: str, space: Any) -> str:
    """``stagetree:<study>:<tuner>:<digest>``; the digest covers the trainer version and
    the space, so a changed trainer or space starts a fresh sampler history."""
    fixed, hp = _entries(space)
    text = "\n".join([version, repr(sorted(fixed.items())), repr(sorted(hp.items()))])
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"stagetree:{study}:{tuner}:{digest}"


def _rdb_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine arguments for the plan's database: SQLite waits for the plan's
    writers instead of failing at once."""
    return {"connect_args": {"timeout": 60.0}} if url.startswith("sqlite") else {}


def _open_rdb(url: str) -> Any:
    return _optuna().storages.RDBStorage(url, engine_kwargs=_rdb_kwargs(url))


def _holds_trials(url: str, study_name: str) -> bool | None:
    """Whether the database at ``url`` holds trials of the Optuna study ``study_name``
    (False: no Optuna tables, no such study, or no trial in it), read with one query
    through SQLAlchemy Core instead of opening an ``RDBStorage``; None when it cannot
    tell (the caller then opens the storage)."""
    try:
        import sqlalchemy as sa

        engine = sa.create_engine(url, **_rdb_kwargs(url))
        try:
            with engine.connect() as conn:
                tables = sa.inspect(conn)
                if not (tables.has_table("studies") and tables.has_table("trials")):
                    return False
                count = conn.execute(
                    sa.text(
                        "SELECT COUNT(*) FROM trials JOIN studies "
                        "ON trials.study_id = studies.study_id "
                        "WHERE studies.study_name = :name"
                    ),
                    {"name": study_name},
                ).scalar()
                return bool(count)
        finally:
            engine.dispose()
    except Exception:  # an unexpected schema or driver: open the storage as before
        return None


def _storage_for(runner: Any) -> tuple[Any, str | None, str, str]:
    """``(Optuna storage or None, SQL URL or None, study name, version)`` for ``runner``:
    the plan's SQL database when the runner says where it is (``sampler_storage()``;
    the storage is None there, opened by the caller), else an in-memory storage."""
    optuna = _optuna()
    where = getattr(runner, "sampler_storage", None)
    if where is None:  # a runner that keeps nothing (test fakes, remote clients)
        return optuna.storages.InMemoryStorage(), None, "study", ""
    url, plan, name, version = where()
    if url is None:
        storage = _MEMORY.get(plan)
        if storage is None:
            storage = _MEMORY[plan] = optuna.storages.InMemoryStorage()
        return storage, None, name, version
    return None, url, name, version


def _open_study(url: str, name: str, direction: str) -> Any:
    """The Optuna study ``name`` in the database at ``url`` (created if need be)."""
    return _optuna().create_study(
        storage=_open_rdb(url), study_name=name, direction=direction, load_if_exists=True
    )


class _Copy:
    """Writes what changed in an in-memory Optuna study to its study in the database,
    as the database storage would have written it (in the copy process, or in the
    driver where there is none)."""

    def __init__(self, study: Any, name: str) -> None:
        self._storage, self._study_id = study._storage, study._study_id
        self._name = name
        # By number: what was written of each trial (a copy: an optuna.Trial updates
        # its first object in place), and its id in the database.
        self._written: list[_Written] = []
        self._ids: list[int] = []
        self._attrs: tuple[dict[str, Any], dict[str, Any]] = ({}, {})

    def apply(self, user: dict[str, Any], system: dict[str, Any], trials: list[Any]) -> None:
        """Write the study's attributes and ``trials`` (those that changed, in number
        order; the new ones numbered on from the last written, so numbers agree).

        Raises:
            TunerError: someone else added trials to the study in the database.
        """
        storage, study_id = self._storage, self._study_id
        if not self._ids and storage.get_all_trials(study_id, deepcopy=False):
            raise TunerError(
                f"Optuna study {self._name!r} received trials from elsewhere while "
                "stagetree opened it: another process adds trials to it; give this "
                "study its own name"
            )
        for key, value in user.items():
            if self._attrs[0].get(key, _MISSING) != value:
                storage.set_study_user_attr(study_id, key, value)
        for key, value in system.items():
            if self._attrs[1].get(key, _MISSING) != value:
                storage.set_study_system_attr(study_id, key, value)
        self._attrs = (dict(user), dict(system))
        for trial in trials:
            n = trial.number
            if n == len(self._ids):
                self._ids.append(storage.create_new_trial(study_id, template_trial=trial))
                self._written.append(_Written.of(trial))
            else:
                self._written[n] = _write_changes(storage, self._ids[n], self._written[n], trial)


def _copier_main(url: str, name: str, direction: str, inbox: Any, outbox: Any) -> None:
    """The copy process: open the database study, then write each change the bridge
    sends (``("copy", user attrs, system attrs, trials, last)``), answering ``("ok",)``
    after each, until the last; ``("error", text, is a TunerError)`` ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's interruption waits for it
    try:
        copier = _Copy(_open_study(url, name, direction), name)
        while True:
            _, user, system, trials, last = inbox.recv()
            copier.apply(user, system, trials)
            outbox.send(("ok",))
            if last:
                return
    except EOFError:
        return  # the driver ended without its last copy: nothing to wait for
    except BaseException as exc:
        with contextlib.suppress(Exception):
            outbox.send(("error", f"{exc}", isinstance(exc, TunerError)))
        raise SystemExit(1) from None


# What opening an RDBStorage imports (Optuna imports them lazily).
_ORM_MODULES = (
    "sqlalchemy.orm",
    "optuna.storages._rdb.models",
    "alembic.command",
    "alembic.config",
    "alembic.migration",
    "alembic.script",
)


class _WriteBehind:
    """The database copy of a bridge's in-memory Optuna study (see the module doc).

    :meth:`start` starts the copy: where a fork server runs (a local executor's), in a
    process forked from it (the copy process opens the
    ``RDBStorage`` and does every write: the driver's threads never wait for SQLAlchemy's
    ORM, nor for the interpreter lock it holds); elsewhere in a thread of the driver
    that opens the storage. :meth:`write` hands the copy the trials that changed since
    the last hand-over (to a busy process: at the next call), or nothing while the
    storage opens in the thread; with ``wait`` it returns once the database holds
    everything.
    """

    def __init__(
        self,
        url: str,
        study_name: str,
        direction: str,
        quiet: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self._url = url
        self._name = study_name
        self._direction = direction
        self._quiet = quiet  # a block in which the driver makes no storage call
        self._thread: threading.Thread | None = None
        self._copy: _Copy | None = None  # the thread's, once the storage opened
        self._error: BaseException | None = None
        self._process: Any = None  # the copy process, its pipes, and whether it is busy
        self._to: Any = None
        self._from: Any = None
        self._busy = False
        self._last = False  # the copy process wrote its last copy and ended
        # By number: the in-memory trial object last handed to the copy (an unchanged
        # trial is the same object: the in-memory storage replaces a trial on every write).
        self._seen: list[Any] = []
        self._attrs: tuple[dict[str, Any], dict[str, Any]] | None = None

    def start(self) -> None:
        """Start the copy (once): its process, else its thread opening the storage."""
        if self._thread is not None or self._process is not None or self._last:
            return
        recv_in, self._to = multiprocessing.Pipe(duplex=False)
        self._from, send_out = multiprocessing.Pipe(duplex=False)
        args = (self._url, self._name, self._direction, recv_in, send_out)
        self._process = start_helper(_copier_main, args, "stagetree-optuna-copy")
        recv_in.close()  # the process's ends: its exit reads as EOF here
        send_out.close()
        if self._process is None:
            self._to.close()
            self._from.close()
            # SQLAlchemy's ORM, imported in one thread while another builds a Core
            # statement, fails the latter ("partially initialized module
            # 'sqlalchemy.orm.exc'": the ORM registers its inspection of any object
            # before that module is complete): the driver's thread stopped on it. What
            # the copy thread would import is imported here, the driver held off.
            with self._quiet() if self._quiet is not None else contextlib.nullcontext():
                for module in _ORM_MODULES:
                    with contextlib.suppress(ImportError):  # the thread says what is missing
                        importlib.import_module(module)
            self._thread = threading.Thread(
                target=self._open, name="stagetree-optuna-storage", daemon=True
            )
            self._thread.start()

    def _open(self) -> None:
        try:
            self._copy = _Copy(_open_study(self._url, self._name, self._direction), self._name)
        except BaseException as exc:  # raised in the tuner's thread by write()
            self._error = exc

    def write(self, memory: Any, wait: bool = False) -> None:
        """Copy what changed in ``memory`` (the in-memory Optuna study) to the database;
        with ``wait``, start the copy first if need be and return once the database
        holds everything, else skip while the copy is busy or the storage opens.

        Raises:
            TunerError: the storage could not be opened or written, or someone else
                added trials to the study in the database.
        """
        if wait:
            self.start()
        if self._process is not None or self._last:
            self._write_process(memory, wait)
            return
        if self._thread is None or (self._thread.is_alive() and not wait):
            return
        self._thread.join()
        if self._error is not None:
            raise TunerError(
                f"the Optuna study {self._name!r} could not be opened in the plan's "
                f"database: {self._error}"
            ) from self._error
        assert self._copy is not None
        self._copy.apply(*self._changes(memory))

    def _changes(self, memory: Any) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        """The study's attributes and the trials changed since the last hand-over."""
        user = memory._storage.get_study_user_attrs(memory._study_id)
        system = memory._storage.get_study_system_attrs(memory._study_id)
        changed = []
        for trial in memory.get_trials(deepcopy=False):
            n = trial.number
            if n == len(self._seen):
                self._seen.append(trial)
            elif self._seen[n] is trial:
                continue
            self._seen[n] = trial
            changed.append(trial)
        return user, system, changed

    def _write_process(self, memory: Any, wait: bool) -> None:
        if self._last:
            raise TunerError(
                f"the Optuna study {self._name!r} was copied already: the search ended"
            )
        self._receive(block=False)
        if self._busy and not wait:
            return  # the changes go with the next hand-over
        while self._busy:
            self._receive(block=True)
        user, system, changed = self._changes(memory)
        if changed or wait or (user, system) != self._attrs:
            self._attrs = (dict(user), dict(system))
            with contextlib.suppress(OSError):  # it ended: its answer (or EOF) says why
                self._to.send(("copy", user, system, changed, wait))
            self._busy = True
        if wait:
            while self._busy:
                self._receive(block=True)
            self._end_process()
            self._last = True

    def _receive(self, block: bool) -> None:
        """Take the copy process's answer, if any (``block``: wait for it)."""
        if not self._busy or not (block or self._from.poll()):
            return
        try:
            answer = self._from.recv()
        except (EOFError, OSError):
            answer = ("error", "the copy process ended", False)
        if answer[0] == "ok":
            self._busy = False
            return
        self._end_process()
        self._last = True
        if answer[2]:
            raise TunerError(answer[1])
        raise TunerError(
            f"the Optuna study {self._name!r} could not be copied to the plan's "
            f"database: {answer[1]}"
        )

    def _end_process(self) -> None:
        """Wait for the copy process to end (it ends after its last copy or an error)."""
        process, self._process = self._process, None
        self._busy = False
        self._to.close()
        self._from.close()
        process.join(5.0)
        if process.exitcode is None:
            process.kill()
            process.join()
        process.close()


_MISSING = object()


@dataclass(frozen=True)
class _Written:
    """What was written of one trial to the database."""

    state: Any
    params: frozenset[str]
    intermediate_values: dict[int, float]
    user_attrs: dict[str, Any]
    system_attrs: dict[str, Any]

    @classmethod
    def of(cls, trial: Any) -> _Written:
        return cls(
            trial.state,
            frozenset(trial.params),
            dict(trial.intermediate_values),
            dict(trial.user_attrs),
            dict(trial.system_attrs),
        )


def _write_changes(storage: Any, trial_id: int, old: _Written, new: Any) -> _Written:
    """Write to ``storage``'s trial ``trial_id`` what changed in ``new`` (the in-memory
    trial) since ``old``: parameters, reported values and attributes first, then the
    state (a finished trial takes no more writes). Returns what is written now."""
    for name, value in new.params.items():
        if name not in old.params:
            dist = new.distributions[name]
            storage.set_trial_param(trial_id, name, dist.to_internal_repr(value), dist)
    for step, value in new.intermediate_values.items():
        if old.intermediate_values.get(step, _MISSING) != value:
            storage.set_trial_intermediate_value(trial_id, step, value)
    for key, value in new.user_attrs.items():
        if old.user_attrs.get(key, _MISSING) != value:
            storage.set_trial_user_attr(trial_id, key, value)
    for key, value in new.system_attrs.items():
        if old.system_attrs.get(key, _MISSING) != value:
            storage.set_trial_system_attr(trial_id, key, value)
    if new.state != old.state:
        storage.set_trial_state_values(trial_id, new.state, new.values)
    return _Written.of(new)


# --------------------------------------------------------------------------- the bridge


class SamplerBridge:
    """One tuner run's Optuna study: asks configurations, tells results.

    Tuner trial ``i`` is Optuna trial number ``i`` (see the module doc). All methods
    are idempotent for trials Optuna already finished: a replayed run tells nothing
    twice.
    """

    def __init__(
        self,
        sampler: Any,
        space: Any,
        mode: str,
        storage: Any,
        study_name: str,
        horizon: int,
        behind: _WriteBehind | None = None,
    ) -> None:
        optuna = _optuna()
        self._optuna = optuna
        self.space = space
        self.horizon = horizon
        self._behind = behind  # the database copy of an in-memory ``storage``
        self.study = optuna.create_study(
            storage=storage,
            sampler=sampler,
            study_name=study_name,
            direction="maximize" if mode == "max" else "minimize",
            load_if_exists=True,
        )
        self._known = sorted(self.study.get_trials(deepcopy=False), key=lambda t: t.number)
        self._open: dict[int, Any] = {}  # tuner trial id -> optuna.Trial still running
        self._reported: dict[int, set[int]] = {}  # steps already reported, by trial id
        if self._known:
            # A seeded sampler restarted on a study that holds trials would propose its
            # first run's configurations again (the trials it re-reads are not asked):
            # reseed it, as Optuna does for parallel workers.
            sampler.reseed_rng()

    @classmethod
    def open(cls, tuner: Any, runner: Any) -> SamplerBridge:
        """The bridge of ``tuner`` (with ``sampler``, ``space``, ``mode``, ``horizon``)
        running on ``runner``."""
        storage, url, name, version = _storage_for(runner)
        study_name = optuna_study_name(name, version, type(tuner).__name__, tuner.space)
        behind = None
        if url is not None:
            if _holds_trials(url, study_name) is False:  # a first run: write behind
                storage = _optuna().storages.InMemoryStorage()
                direction = "maximize" if tuner.mode == "max" else "minimize"
                quiet = getattr(runner, "quiet_driver", None)
                behind = _WriteBehind(url, study_name, direction, quiet)
            else:  # trials to re-read (or no telling): the database itself
                storage = _open_rdb(url)
        # Each run starts from the sampler as given (a seeded tuner run twice, as
        # ``stagetree simulate`` does with and without sharing, proposes the same trials).
        sampler = copy.deepcopy(tuner.sampler)
        return cls(sampler, tuner.space, tuner.mode, storage, study_name, tuner.horizon, behind)

    def ask(self, tid: int) -> TrialSpec:
        """Configuration of tuner trial ``tid`` (Optuna trial number ``tid``): the one
        Optuna already holds, else a new proposal of the sampler."""
        if tid < len(self._known):
            frozen = self._known[tid]
            if frozen.state.is_finished():
                return suggest_trial(self.space, self._optuna.trial.FixedTrial(frozen.params))
            trial = self._optuna.trial.Trial(self.study, frozen._trial_id)
            self._reported[tid] = set(frozen.intermediate_values)  # a replay reports again
        else:
            trial = self.study.ask()
            if trial.number != tid:
                raise TunerError(
                    f"Optuna study {self.study.study_name!r} numbered the new trial "
                    f"{trial.number}, stagetree expected {tid}: another process adds "
                    "trials to it; give this study its own name"
                )
            trial.set_user_attr("stagetree_trial", tid)
        self._open[tid] = trial
        spec = suggest_trial(self.space, trial)
        self._write_behind()
        return spec

    def result(self, tid: int, steps: int, value: float | None, failed: bool) -> None:
        """A result of trial ``tid`` at ``steps`` (``value``: the raw metric, None when
        it is missing or not finite); ``failed``: its job failed."""
        self._result(tid, steps, value, failed)
        self._write_behind(start=True)

    def _result(self, tid: int, steps: int, value: float | None, failed: bool) -> None:
        trial = self._open.get(tid)
        if trial is None:
            return
        state = self._optuna.trial.TrialState
        if failed:
            self._tell(tid, state=state.FAIL)
            return
        reported = self._reported.setdefault(tid, set())
        if value is not None and steps not in reported:
            trial.report(value, steps)
            reported.add(steps)
        if steps >= self.horizon > 0:
            if value is None:
                self._tell(tid, state=state.FAIL)
            else:
                self._tell(tid, values=value, state=state.COMPLETE)

    def prune(self, tid: int) -> None:
        """Trial ``tid`` was stopped by a rung: ``PRUNED`` with its last reported value."""
        if tid in self._open:
            self._tell(tid, state=self._optuna.trial.TrialState.PRUNED)
        self._write_behind(start=True)

    def close(self) -> None:
        """The search ended: every trial still open is ``PRUNED``, and the study is in
        its storage."""
        for tid in list(self._open):
            self.prune(tid)
        self.flush()

    def flush(self) -> None:
        """Wait until the database holds what the sampler was asked and told (a search
        that ends or is interrupted): see :class:`_WriteBehind`."""
        if self._behind is not None:
            self._behind.write(self.study, wait=True)

    def _write_behind(self, start: bool = False) -> None:
        """Copy what changed to the database once its storage is open; ``start``: a
        result came in, the first submissions are out, so start opening it."""
        if self._behind is not None:
            if start:
                self._behind.start()
            self._behind.write(self.study)

    def _tell(self, tid: int, **kwargs: Any) -> None:
        trial = self._open.pop(tid)
        self.study.tell(trial, skip_if_finished=True, **kwargs)


class SampledSpecs(SequenceABC[Any]):
    """``n`` trial specs asked from a :class:`SamplerBridge` on first access, in index
    order (so a sampler sees the results of the trials before each proposal)."""

    lazy = True

    def __init__(self, bridge: SamplerBridge, n: int) -> None:
        self._bridge = bridge
        self._n = n
        self._specs: list[TrialSpec] = []

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not 0 <= i < self._n:
            raise IndexError(i)
        while len(self._specs) <= i:
            self._specs.append(self._bridge.ask(len(self._specs)))
        return self._specs[i]

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(self._n))
