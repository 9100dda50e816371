"""How a :class:`~stagetree.Study` keeps trainer versions apart in one storage.

Every trial records the trainer version that trained it (``attrs["version"]``, see
:mod:`stagetree.identity`). A Study sees only the trials of its own version: a changed
trainer starts over (announced once with :class:`~stagetree.identity.TrainerChangedWarning`)
and the trials of the old version stay in the storage, hidden, until a Study of that
version opens again (``version=`` pins it). The tuner's decision log is split the same
way: a ``{"event": "trainer", "version": ...}`` record starts the decisions of a
version, and a tuner replays only the decisions of its own version's latest run.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from stagetree.hp import dumps_hp
from stagetree.identity import announce_change, current_version, trial_version
from stagetree.space import canonical_json

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage


class StudyLike(Protocol):
    """What this module needs of a study: its name, trainer version and whether the
    log's latest run was found to be this version's (``log_checked``)."""

    name: str
    version: str
    log_checked: bool


__all__ = ["append_log", "has_log", "open_trials", "read_log", "study_meta"]

LOG_EVENT = "trainer"
_ANNOUNCED: set[tuple[str, str, str]] = set()
_ANNOUNCED_LOCK = threading.Lock()


def study_meta(storage: BasePlanStorage, name: str) -> dict[str, Any]:
    """The stored meta of study ``name`` (empty when it has none or no row)."""
    for record in storage.studies():
        if record["name"] == name:
            return dict(record.get("meta") or {})
    return {}


def open_trials(
    study: StudyLike, trainer_name: str, storage: BasePlanStorage, url: str
) -> list[dict[str, Any]]:
    """The trials of ``study``'s trainer version, when a Study opens its storage.

    When the study's latest run used another version, say once per process how many
    trials will train again, and mark this version's own trials (if it ran before) as
    the latest run, so that ``stagetree status`` and ``export`` show them.
    """
    meta = study_meta(storage, study.name)
    trials = storage.trials(study.name)
    own = [t for t in trials if trial_version(t, meta) == study.version]
    latest = current_version(trials, meta)
    if trials and latest != study.version:
        # Trials of the latest run that this version has no trial for train again.
        have = {_ident(t) for t in own}
        count = len({_ident(t) for t in trials if trial_version(t, meta) == latest} - have)
        key = (url, study.name, str(study.version))
        with _ANNOUNCED_LOCK:
            first = key not in _ANNOUNCED
            _ANNOUNCED.add(key)
        if first and count:
            announce_change(trainer_name, latest, study.version, count, 5)
        now = time.time()
        for t in own if not getattr(storage, "readonly", False) else ():
            storage.update_trial(t["id"], attrs={**(t.get("attrs") or {}), "opened": now})
    return own


def _ident(trial: dict[str, Any]) -> tuple[str, str]:
    return canonical_json(trial["config"]), dumps_hp(trial["hp"])


def _segment(records: list[dict[str, Any]], meta: dict[str, Any]) -> tuple[Any, list[Any]]:
    """``(version, records)`` of the log's last run of one version (a log written
    before versions were recorded belongs to the version the study was created with)."""
    version = meta.get("version")
    segment: list[dict[str, Any]] = []
    for rec in records:
        if rec.get("event") == LOG_EVENT:
            version, segment = rec.get("version"), []
        else:
            segment.append(rec)
    return version, segment


def read_log(study: StudyLike, storage: BasePlanStorage) -> list[dict[str, Any]]:
    """The decisions logged by the latest run if it used the study's trainer version;
    none otherwise (decisions taken on another version's results are not replayed)."""
    version, segment = _segment(storage.read_log(study.name), study_meta(storage, study.name))
    study.log_checked = version == study.version
    return segment if study.log_checked else []


def has_log(study: StudyLike, storage: BasePlanStorage) -> bool:
    """Whether :func:`read_log` would return any decision (a run to replay, not a first
    run), from the log's last record and its last version record
    (:meth:`~stagetree.plan.BasePlanStorage.last_log`) instead of the whole log."""
    last = storage.last_log(study.name)
    if last is None or last.get("event") == LOG_EVENT:
        return False  # no log, or the latest run logged no decision
    return bool(_log_version(study.name, storage) == study.version)


def _log_version(name: str, storage: BasePlanStorage) -> Any:
    """The version of the log's latest run (:func:`_segment`'s), from its last version
    record."""
    mark = storage.last_log(name, LOG_EVENT)
    return study_meta(storage, name).get("version") if mark is None else mark.get("version")


def append_log(study: StudyLike, storage: BasePlanStorage, record: dict[str, Any]) -> None:
    """Append ``record``, after a record that starts this version's decisions when the
    log's latest run used another version."""
    if not study.log_checked:
        if _log_version(study.name, storage) != study.version:
            storage.append_log(study.name, {"event": LOG_EVENT, "version": study.version})
        study.log_checked = True
    storage.append_log(study.name, record)
