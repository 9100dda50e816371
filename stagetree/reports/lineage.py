"""The lineage of a study's trials: which trial population based training made from
which donor, at which step.

PBT logs each exploit in the study's decision log, which lives in the plan storage
(``{"event": "exploit", "trial": new, "donor": donor, "step": t, ...}``), with the
tuner's own trial ids (0, 1, ... per run). The submissions in the same log carry each
tuner trial's fingerprint (``fp``: a hash of its config and sequences), so the exploits
map to the storage's trial rows through the fingerprints of their config and hp: the
lineage survives the process and needs no extra write.

The whole log is read, not only the records a resumed tuner replays: a decision that a
later run dropped (a ``diverged`` replay) still made the trial it names. An exploit
whose new trial was never submitted (the run was killed in between) is left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from stagetree.records import trial_fingerprint

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage

__all__ = ["exploit_parents", "lineages", "study_lineage"]

# A log record that starts another trainer version's decisions (see stagetree._versions).
_VERSION_EVENT = "trainer"


def exploit_parents(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[str, int]]:
    """``{fingerprint of an exploit's trial: (fingerprint of its donor, step)}`` from a
    decision log, in log order (the first exploit that made a trial wins)."""
    out: dict[str, tuple[str, int]] = {}
    fps: dict[int, str] = {}  # tuner trial id -> fingerprint, latest submission wins
    pending: dict[int, tuple[str, int, int]] = {}  # new trial -> (donor fp, step, position)
    position = 0  # in the effective log of the current run (what ``diverged`` counts)
    for rec in records:
        event = rec.get("event")
        if event == _VERSION_EVENT:  # another run: its tuner numbers trials afresh
            fps.clear()
            pending.clear()
            position = 0
            continue
        if event == "diverged":  # records after ``keep`` were dropped, undecided
            keep = int(rec.get("keep", 0))
            pending = {k: v for k, v in pending.items() if v[2] < keep}
            position = keep
            continue
        if event == "exploit":
            donor = fps.get(_int(rec.get("donor")))
            if donor is not None and rec.get("trial") is not None:
                pending[_int(rec["trial"])] = (donor, _int(rec.get("step")), position)
        elif rec.get("fp") is not None and rec.get("trial") is not None:
            tid = _int(rec["trial"])
            fps[tid] = str(rec["fp"])
            made = pending.pop(tid, None)
            if made is not None:
                out.setdefault(fps[tid], (made[0], made[1]))
        position += 1
    return out


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def fingerprint(config: Mapping[str, Any], hp: Mapping[str, Any]) -> str:
    """The fingerprint a tuner logs for the trial ``(config, hp)``."""
    return trial_fingerprint(dict(config), dict(hp))


def lineages(
    records: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]]
) -> dict[int, list[dict[str, int]]]:
    """``{trial id: lineage}`` of the trial ``rows`` (with ``id``, ``config``, ``hp``)
    that exploits in the log ``records`` made: one ``{"donor": trial id, "step": t}``
    per exploit, oldest first (the donor's own lineage, then the exploit that made the
    trial). Trials no exploit made are left out."""
    made = exploit_parents(records)
    if not made:
        return {}
    ids = {fingerprint(r.get("config") or {}, r.get("hp") or {}): int(r["id"]) for r in rows}
    parent: dict[int, tuple[int, int]] = {}
    for new_fp, (donor_fp, made_at) in made.items():
        if new_fp in ids and donor_fp in ids and ids[new_fp] != ids[donor_fp]:
            parent[ids[new_fp]] = (ids[donor_fp], made_at)
    out: dict[int, list[dict[str, int]]] = {}
    for tid in sorted(parent):
        chain: list[dict[str, int]] = []
        seen = {tid}
        node = tid
        while node in parent:
            donor, step = parent[node]
            chain.append({"donor": donor, "step": step})
            if donor in seen:  # cannot happen with a sane log; never loop
                break
            seen.add(donor)
            node = donor
        out[tid] = chain[::-1]
    return out


def study_lineage(
    storage: BasePlanStorage, study: str, rows: Iterable[Mapping[str, Any]]
) -> dict[int, list[dict[str, int]]]:
    """:func:`lineages` of ``study``'s trial ``rows`` from its log in ``storage``.

    Cheap when the study has no exploit (a query for one, not a read of the log);
    ``rows`` may be light (without config and hp): they are then read in full, only
    when there are exploits.
    """
    if storage.last_log(study, "exploit") is None:  # not the whole log of a large study
        return {}
    records = storage.read_log(study)
    rows = list(rows)
    if any("hp" not in r or r.get("hp") is None for r in rows):
        wanted = {int(r["id"]) for r in rows}
        rows = [r for r in storage.trials(study) if int(r["id"]) in wanted]
    return lineages(records, rows)
