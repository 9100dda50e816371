"""``stagetree gc``: removing the checkpoints that nothing needs.

What the plan still *needs* is one rule
(:func:`~stagetree.checkpoints.eviction.needed_checkpoints`), shared with the checkpoint
budget's eviction (:mod:`stagetree.checkpoints.eviction`): the latest checkpoint on
the path of every live request at or before its step, and the same for every live
stage lease. A needed checkpoint is never removed.

``collect_garbage`` also removes what no kept trial needs, by ``keep``:

* ``"all"``: only checkpoints of plan trees that no study's current trainer version
  uses (*old version*; *no trial* for a tree no trial at all uses), and *orphans*:
  files of this plan's trees that no plan record references (left by killed workers),
  once older than a grace period, so that a file a worker has just written and its
  engine is about to record is never taken;
* ``"leaves"`` (the default): also every checkpoint that is not some trial's final one
  (*intermediate*); a trial's final checkpoint is the latest on its path at or before
  its steps, where resuming or extending it starts;
* ``"best"``: also the final checkpoints of all but each study's best trial (*not
  best*), by the metric and mode the study records (``stagetree status``'s rule).

Removal order: the plan's record first, then the file. A reader never finds a record
whose file is gone because of ``gc``; a crash between the two leaves an unreferenced
file, which the next ``gc`` collects as an orphan. (Readers tolerate a missing file
anyway: the engine recomputes from an earlier checkpoint.)

A study that is running (a live study lease, or live stage leases on its trees) may
still need its trials' final checkpoints: an ASHA promotion or a PBT exploit starts
from one. ``gc`` refuses (:class:`~stagetree.exceptions.CheckpointsInUseError`, nothing
removed) when ``keep`` would remove any of them; ``"leaves"`` and ``"all"`` never do.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagetree.checkpoints.eviction import (
    Key,
    _Paths,
    _steps_by_node,
    latest_checkpoint,
    needed_checkpoints,
)
from stagetree.checkpoints.store import CheckpointStore
from stagetree.checkpoints.stores import open_byte_store
from stagetree.exceptions import CheckpointError, CheckpointsInUseError, PlanKeyError, StorageError
from stagetree.identity import split_trials
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.registry import open_storage
from stagetree.reports.trials import best_trial, final_records, ranked_metric

if TYPE_CHECKING:
    from stagetree.plan.base import CheckpointRecord

__all__ = [
    "DEFAULT_GRACE",
    "KEEP_MODES",
    "GcItem",
    "GcReport",
    "collect_garbage",
    "parse_duration",
]

logger = logging.getLogger("stagetree")

#: What ``keep`` may be (see the module docstring).
KEEP_MODES = ("best", "leaves", "all")

#: Seconds an unreferenced file must have existed before ``gc`` removes it.
DEFAULT_GRACE = 3600.0

#: Reasons a checkpoint is removed, in report order.
REASONS = ("old version", "no trial", "intermediate", "not best", "orphan")

# The names workers give checkpoints (``stagetree.executors.worker._checkpoint_name``): the first
# 8 hex digits of the sha1 of the tree's root key, the node, the step, a random suffix,
# and the content tag the store adds (absent from checkpoints written before it).
_WORKER_REF = re.compile(r"r([0-9a-f]{8})-n\d+-s\d+-[0-9a-f]+(?:-h[0-9a-f]{32})?\.ckpt")


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class GcItem:
    """One checkpoint ``gc`` removes (or would remove).

    Attributes:
        ref: its name in the checkpoint store.
        nbytes: its size.
        reason: ``"old version"`` (a tree only other trainer versions' trials use),
            ``"no trial"`` (a tree no trial uses), ``"intermediate"``, ``"not best"``
            or ``"orphan"`` (see the module docstring).
        node, step: its canonical plan key; None for an orphan.
    """

    ref: str
    nbytes: int
    reason: str
    node: int | None = None
    step: int | None = None


@dataclass
class GcReport:
    """What :func:`collect_garbage` did.

    Attributes:
        removed: what was removed (with ``dry_run``: what would be), in removal order.
        kept: checkpoints left in place, by why: ``"needed"`` (live work starts there),
            ``"kept trial"`` (a kept trial's final checkpoint), ``"in use"`` (a tree a
            kept study uses, ``keep="all"`` or another study than ``study``),
            ``"recent"`` (unreferenced but younger than the grace period, or of
            unknown age).
        kept_bytes: their sizes, by the same keys.
        skipped: files of the location ``gc`` leaves alone because they are not
            this plan's checkpoints (other names, or trees the plan does not hold).
        missing: plan records whose file the location does not hold (left alone).
        notes: anything else the user should know (a study ``keep="best"`` could not
            rank, whose trials' final checkpoints were all kept).
        dry_run: nothing was removed.
        keep: the keep mode.
        location: the checkpoint location.
    """

    removed: list[GcItem] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=dict)
    kept_bytes: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    missing: int = 0
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False
    keep: str = "leaves"
    location: str = ""

    @property
    def freed_bytes(self) -> int:
        """Bytes removed (or that would be)."""
        return sum(item.nbytes for item in self.removed)

    def by_reason(self) -> dict[str, tuple[int, int]]:
        """reason -> ``(count, bytes)`` of what was removed, in :data:`REASONS` order."""
        out: dict[str, tuple[int, int]] = {}
        for reason in REASONS:
            items = [i for i in self.removed if i.reason == reason]
            if items:
                out[reason] = (len(items), sum(i.nbytes for i in items))
        return out

    def lines(self) -> list[str]:
        """The report in words (what ``stagetree gc`` prints)."""
        verb = "would free" if self.dry_run else "freed"
        head = f"{verb} {_count(len(self.removed))}, {format_bytes(self.freed_bytes)}"
        out = [f"{head} in {self.location} (keep={self.keep}{', dry run' if self.dry_run else ''})"]
        for reason, (n, nbytes) in self.by_reason().items():
            out.append(f"  {reason:<13} {n:>6}  {format_bytes(nbytes):>10}")
        kept_n = sum(self.kept.values())
        if kept_n:
            parts = ", ".join(f"{n} {_KEPT_WORDS.get(why, why)}" for why, n in self.kept.items())
            out.append(
                f"kept {_count(kept_n)}, {format_bytes(sum(self.kept_bytes.values()))} ({parts})"
            )
        if self.skipped:
            out.append(f"left alone {self.skipped} file(s) that are not this plan's checkpoints")
        if self.missing:
            out.append(f"{self.missing} plan record(s) point at files the location lacks")
        out.extend(self.notes)
        return out


_KEPT_WORDS = {
    "needed": "needed by live work",
    "kept trial": "final of a kept trial",
    "in use": "in trees kept whole",
    "recent": "unreferenced but recent",
}


def _count(n: int) -> str:
    return f"{n} checkpoint{'' if n == 1 else 's'}"


def format_bytes(n: float) -> str:
    """``n`` bytes in words: ``512 B``, ``1.5 KiB``, ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- gc


def parse_duration(value: float | int | str, what: str = "grace") -> float:
    """Seconds from a number or a string ``"90"``, ``"90s"``, ``"10m"``, ``"2h"``, ``"1d"``.

    Raises:
        ValueError: not a non-negative duration (naming ``what``).
    """
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        scale = units.get(text[-1:])
        number = text[:-1] if scale is not None else text
        try:
            seconds = float(number) * (scale or 1.0)
        except ValueError:
            seconds = None
    if seconds is None or not seconds >= 0 or seconds == float("inf"):
        raise ValueError(
            f"{what} must be a non-negative duration such as 3600, '30m' or '2h', got {value!r}"
        )
    return seconds


@dataclass
class _Plan:
    """A snapshot of what the plan says about checkpoints."""

    records: dict[Key, CheckpointRecord]
    root_of: dict[int, str]  # node -> root key, for the recorded checkpoints' nodes
    current: dict[str, list[dict[str, Any]]]  # study -> its current version's trials
    metas: dict[str, dict[str, Any]]
    trees: dict[str, set[str]]  # study -> root keys of its trials (every version)


def _snapshot(storage: BasePlanStorage) -> _Plan:
    records = storage.checkpoints()
    root_of: dict[int, str] = {}
    for node, _step in records:
        if node not in root_of:
            root_of[node] = storage.node(node).root_key
    current: dict[str, list[dict[str, Any]]] = {}
    metas: dict[str, dict[str, Any]] = {}
    trees: dict[str, set[str]] = {}
    for record in storage.studies():
        name, meta = record["name"], dict(record.get("meta") or {})
        rows = storage.trials(name, light=True)
        metas[name] = meta
        current[name] = split_trials(rows, meta)[0]
        trees[name] = {str(t["root_key"]) for t in rows}
    return _Plan(records, root_of, current, metas, trees)


def _final(trial: Mapping[str, Any], paths: _Paths, by_node: Mapping[int, list[int]]) -> Key | None:
    """The checkpoint a trial's resumption starts from (its final one)."""
    if trial.get("node") is None:
        return None
    return latest_checkpoint(paths(int(trial["node"])), by_node, int(trial["steps"]))


def _best_trials(storage: BasePlanStorage, plan: _Plan) -> dict[str, int | None]:
    """Each study's best trial id (``stagetree status``'s rule), None when none ranks."""
    out: dict[str, int | None] = {}
    for name, trials in plan.current.items():
        records = final_records(storage, trials)
        metric, mode, _ = ranked_metric(plan.metas[name], records)
        best = best_trial(records, metric, mode) if metric is not None else None
        out[name] = None if best is None else best.id
    return out


def _running_studies(
    storage: BasePlanStorage, plan: _Plan, now: float
) -> dict[str, tuple[str, str]]:
    """Studies some live engine is working for: name -> (``host:pid``, what it does in
    words). A live study lease (a tuner runs) or a live stage lease on a tree of
    its current trials (a batch trains it, maybe for another study sharing the tree)."""
    out: dict[str, tuple[str, str]] = {}
    leases = [lease for lease in storage.leases(live_only=True) if lease.live(now)]
    busy_trees = {
        lease.scope: (lease.describe(), "trains its plan trees")
        for lease in leases
        if lease.node is not None
    }
    for lease in leases:
        if lease.node is None and lease.scope in plan.current:
            out[lease.scope] = (lease.describe(), "tunes it")
    for name, trials in plan.current.items():
        for trial in trials:
            who = busy_trees.get(str(trial["root_key"]))
            if who is not None and name not in out:
                out[name] = who
    return out


def _open_location(
    checkpoints: str | os.PathLike[str] | CheckpointStore | None, url: str | None
) -> CheckpointStore | None:
    """The checkpoint store, without creating a local directory; None when the default
    directory beside a SQLite plan does not exist (nothing to collect)."""
    if isinstance(checkpoints, CheckpointStore):
        return checkpoints
    default = checkpoints is None
    if checkpoints is None:
        if url is None or not url.startswith("sqlite:///"):
            raise CheckpointError(
                "no checkpoint location: pass checkpoints= (stagetree gc --checkpoints URL); "
                "only a SQLite plan has a default one (beside its file)"
            )
        db = Path(url[len("sqlite:///") :])
        checkpoints = db.with_name(db.name + ".checkpoints")
    text = os.fspath(checkpoints)
    local = "://" not in text or text.startswith("file://")
    if local:
        directory = Path(text[len("file://") :] if text.startswith("file://") else text)
        if not directory.is_dir():
            if default:
                return None
            raise CheckpointError(f"checkpoint location {directory} does not exist")
    return CheckpointStore(open_byte_store(text), cache_bytes=0)


def _open_plan(
    storage: str | BasePlanStorage, readonly: bool
) -> tuple[BasePlanStorage, str | None, bool]:
    """``(plan, its URL or None, whether this call opened it)``. A SQLite file must
    exist and a URL must hold a plan: both are checked read-only, so a wrong URL gets
    nothing written to it (``gc`` never creates a file or stagetree's tables)."""
    if isinstance(storage, BasePlanStorage):
        return storage, None, False
    if not isinstance(storage, str):
        raise ValueError(f"storage must be a URL or an open plan storage, got {storage!r}")
    if storage.startswith("sqlite:///"):
        path = Path(storage[len("sqlite:///") :])
        if not path.is_file():
            raise StorageError(f"cannot open plan storage {storage!r}: {path} does not exist")
    probe = open_storage(storage, readonly=True)
    try:
        probe.studies()  # a database that is not a plan fails here
    except StorageError:
        probe.close()
        raise
    except Exception as exc:
        probe.close()
        raise StorageError(f"cannot open plan storage {storage!r}: {exc}") from exc
    if readonly:
        return probe, storage, True
    probe.close()
    return open_storage(storage, readonly=False), storage, True


def collect_garbage(
    storage: str | BasePlanStorage,
    checkpoints: str | os.PathLike[str] | CheckpointStore | None = None,
    *,
    keep: str = "leaves",
    study: str | None = None,
    dry_run: bool = False,
    grace: float | str = DEFAULT_GRACE,
    now: float | None = None,
) -> GcReport:
    """Remove the checkpoints that no live request and no kept trial needs.

    See the module docstring for the rules; a checkpoint live work starts from
    (:func:`needed_checkpoints`) is never removed. Safe while studies run on the
    storage: the needed set is read again just before anything is removed.

    Args:
        storage: the plan storage (a URL, or an open storage).
        checkpoints: the checkpoint location (a directory, a URL, or a store); None:
            beside a SQLite plan (``plan.db.checkpoints``), like a Study's default.
        keep: ``"best"``, ``"leaves"`` or ``"all"``.
        study: only the checkpoints of this study's plan trees (any version) and its
            orphans; trees other studies use now are left as they are.
        dry_run: report what would go; remove nothing.
        grace: seconds (or ``"30m"``, ``"2h"``) an unreferenced file must have existed
            before it is removed.
        now: ``time.time()`` for the grace period and lease liveness (tests).

    Returns:
        A :class:`GcReport`.

    Raises:
        ValueError: an unknown ``keep``, a bad ``grace`` or ``study``.
        PlanKeyError: ``study`` is not in the storage.
        StorageError: the storage cannot be opened (a missing SQLite file is never
            created).
        CheckpointError: no ``checkpoints`` for a plan that is not SQLite; a checkpoint
            location that does not exist or cannot be listed, or one that holds none
            of the plan's checkpoints (the wrong location, most likely; nothing is
            removed).
        CheckpointsInUseError: ``keep`` would remove a final checkpoint of a study that
            is running (nothing is removed).
    """
    if keep not in KEEP_MODES:
        raise ValueError(f"keep must be one of {', '.join(KEEP_MODES)}, got {keep!r}")
    grace_s = parse_duration(grace)
    if study is not None and (not isinstance(study, str) or not study):
        raise ValueError(f"study must be a non-empty string, got {study!r}")
    plan_storage, url, opened = _open_plan(storage, readonly=dry_run)
    try:
        return _collect(plan_storage, url, checkpoints, keep, study, dry_run, grace_s, now)
    finally:
        if opened:
            plan_storage.close()


def _collect(
    storage: BasePlanStorage,
    url: str | None,
    checkpoints: str | os.PathLike[str] | CheckpointStore | None,
    keep: str,
    study: str | None,
    dry_run: bool,
    grace: float,
    now: float | None,
) -> GcReport:
    plan = _snapshot(storage)
    if study is not None and study not in plan.current:
        known = ", ".join(sorted(plan.current)) or "none"
        raise PlanKeyError(f"no study {study!r} in the storage (studies: {known})")
    store = _open_location(checkpoints, url)
    location = "" if store is None else store.location
    report = GcReport(dry_run=dry_run, keep=keep, location=location)
    now = time.time() if now is None else now
    sizes = {} if store is None else store.sizes()
    if (
        store is not None
        and plan.records
        and not any(r.ref in sizes for r in plan.records.values())
    ):
        raise CheckpointError(
            f"checkpoint location {location} holds none of the {len(plan.records)} "
            "checkpoints the plan records: is it this plan's location? (nothing removed)"
        )

    needed = needed_checkpoints(storage, plan.records, now)
    by_node = _steps_by_node(plan.records)
    paths = _Paths(storage)
    current_trees = {str(t["root_key"]) for ts in plan.current.values() for t in ts}
    used_trees = {root for trees in plan.trees.values() for root in trees}
    scope = plan.trees[study] if study is not None else None
    # Trees other studies use now stay whole under --study (their own keep is theirs).
    frozen = (
        {str(t["root_key"]) for name, ts in plan.current.items() if name != study for t in ts}
        if study is not None
        else set()
    )
    ruled = [study] if study is not None else list(plan.current)
    finals: dict[Key, set[str]] = {}  # final checkpoint -> studies whose kept trial ends there
    leaf_of: dict[Key, set[str]] = {}  # final checkpoint of any current trial -> studies
    best = _best_trials(storage, plan) if keep == "best" else {}
    for name in ruled:
        if keep == "best" and best.get(name) is None and plan.current[name]:
            report.notes.append(
                f"study {name!r} has no trial with a finite final metric to rank: "
                "kept every trial's final checkpoint (as --keep leaves)"
            )
    for name in ruled:
        for trial in plan.current[name]:
            at = _final(trial, paths, by_node)
            if at is None:
                continue
            leaf_of.setdefault(at, set()).add(name)
            if keep != "best" or best.get(name) in (None, int(trial["id"])):
                finals.setdefault(at, set()).add(name)

    removed: list[GcItem] = []
    kept: dict[str, list[int]] = {}
    for key, rec in sorted(plan.records.items()):
        root = plan.root_of[key[0]]
        if scope is not None and root not in scope:
            continue
        nbytes = sizes.get(rec.ref, rec.nbytes)
        if store is not None and rec.ref not in sizes:
            report.missing += 1
            continue
        why = None
        if rec.ref in needed:
            why = "needed"
        elif root in frozen:
            why = "in use"
        elif root not in current_trees:
            reason = "old version" if root in used_trees else "no trial"
            removed.append(GcItem(rec.ref, nbytes, reason, *key))
            continue
        elif keep == "all":
            why = "in use"
        elif key in finals:
            why = "kept trial"
        if why is not None:
            kept.setdefault(why, []).append(nbytes)
            continue
        reason = "not best" if key in leaf_of else "intermediate"
        removed.append(GcItem(rec.ref, nbytes, reason, *key))

    # A running study may still start from any of its trials' final checkpoints.
    running = _running_studies(storage, plan, now)
    lost: dict[str, int] = {}
    for item in removed:
        if item.node is None or item.step is None:
            continue
        for name in leaf_of.get((item.node, item.step), set()) & set(running):
            lost[name] = lost.get(name, 0) + 1
    if lost:
        name = sorted(lost)[0]
        holder, doing = running[name]
        raise CheckpointsInUseError(
            f"study {name!r} is running ({holder} {doing}) and keep={keep!r} would remove "
            f"{lost[name]} final checkpoint(s) of its trials, which it may still resume "
            "from; nothing was removed: use --keep leaves (or all), or run gc when it ends",
            study=name,
            holder=holder,
        )

    # Orphans: files of this plan's trees that no record references, old enough.
    if store is not None:
        referenced = {rec.ref for rec in plan.records.values()}
        ours = _digests(storage.root_keys()) | _digests(plan.root_of.values())
        digests = ours if scope is None else _digests(scope - frozen)
        modified = store.modified()
        for ref in sorted(set(sizes) - referenced):
            match = _WORKER_REF.fullmatch(ref)
            if match is None or match.group(1) not in ours:
                report.skipped += 1  # not this plan's: another plan's, or a user's file
                continue
            if match.group(1) not in digests:
                continue  # another study's tree (--study)
            age = now - modified[ref] if ref in modified else None
            if age is None or age < grace:
                kept.setdefault("recent", []).append(sizes[ref])
                continue
            removed.append(GcItem(ref, sizes[ref], "orphan"))

    report.kept = {why: len(v) for why, v in kept.items()}
    report.kept_bytes = {why: sum(v) for why, v in kept.items()}
    if dry_run or store is None or not removed:
        report.removed = removed
        return report
    report.removed = _remove(storage, store, removed)
    return report


def _digests(roots: Iterable[str]) -> set[str]:
    import hashlib

    return {hashlib.sha1(root.encode()).hexdigest()[:8] for root in roots}


def _remove(storage: BasePlanStorage, store: CheckpointStore, items: list[GcItem]) -> list[GcItem]:
    """Remove ``items``, record before file, skipping any that live work started to
    need since the snapshot (or that the plan references again); returns the removed."""
    records = storage.checkpoints()
    needed = needed_checkpoints(storage, records)
    referenced = {rec.ref: key for key, rec in records.items()}
    done: list[GcItem] = []
    for item in items:
        if item.ref in needed:
            continue
        if item.node is None or item.step is None:  # an orphan: unless recorded since
            if item.ref in referenced:
                continue
        else:
            if referenced.get(item.ref) != (item.node, item.step):
                continue  # removed (or replaced) by someone else meanwhile
            storage.remove_checkpoint(item.node, item.step)
        store.delete(item.ref)
        done.append(item)
    return done
