"""A search plan held in process memory (tests, simulations, throw-away studies)."""

from __future__ import annotations

import functools
import heapq
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace
from types import MappingProxyType
from typing import Any, TypeVar, cast

from stagetree.exceptions import PlanKeyError, StorageError
from stagetree.hp import Sequence, dumps_hp
from stagetree.plan import _codec
from stagetree.plan._seqcache import SeqCache
from stagetree.plan.base import (
    ActivityRecord,
    BasePlanStorage,
    CheckpointRecord,
    MetricsItem,
    TrialEnd,
    activity_row,
    after_add,
    after_release,
    check_canonical,
    check_metrics,
    evaluated_metrics,
    merge_metrics,
    shown_metrics,
    trial_changes,
)
from stagetree.plan.leases import ClaimResult, Lease, host_pid, stage_conflicts, study_conflicts
from stagetree.plan.model import Node, Request, RequestState
from stagetree.plan.tree import (
    Insertion,
    TreeIndex,
    check_items,
    check_trial,
    insert,
    path_segments,
    walk,
)

__all__ = ["MemoryPlanStorage"]

_F = TypeVar("_F", bound=Callable[..., Any])
T = TypeVar("T")


def _writes(method: _F) -> _F:
    """Mark a method that changes the plan: it bumps :meth:`MemoryPlanStorage.revision`
    once it has succeeded."""

    @functools.wraps(method)
    def wrapper(self: MemoryPlanStorage, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            out = method(self, *args, **kwargs)
            self._revision += 1
            return out

    return cast(_F, wrapper)


#: How many decoded trial texts :meth:`MemoryPlanStorage._decoded` keeps for sharing.
_SHARED_MAX = 256


def _same_sequences(a: Mapping[str, Sequence], b: Mapping[str, Sequence]) -> bool:
    """Whether two hp mappings hold the very same sequence objects under the same names."""
    return len(a) == len(b) and all(a.get(name) is seq for name, seq in b.items())


class MemoryPlanStorage(BasePlanStorage):
    """:class:`BasePlanStorage` in dictionaries, guarded by one lock (thread-safe)."""

    #: :meth:`path_metrics` (a path read up its parent links) costs less than
    #: :meth:`metrics_along` (a path found by its sequences): the engine reads a
    #: result's curve from its submission's end.
    cheap_paths = True

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # Each root's config as its canonical JSON text: compared as it is when the
        # root is registered again (every submission does), decoded when read.
        self._roots: dict[str, str] = {}
        self._trees: dict[str, TreeIndex] = {}
        self._seqs = SeqCache()
        self._nodes: dict[int, Node] = {}
        self._next_id = 1
        self._requests: dict[tuple[int, int], Request] = {}
        self._checkpoints: dict[tuple[int, int], CheckpointRecord] = {}
        self._checkpoint_steps: dict[int, set[int]] = {}  # node -> its checkpoints' steps
        self._metrics: dict[int, dict[int, dict[str, float]]] = {}
        self._stats: dict[str, dict[str, float]] = defaultdict(dict)
        self._studies: dict[str, dict[str, Any]] = {}
        self._trials: dict[int, dict[str, Any]] = {}
        self._next_trial = 1
        self._trial_keys: dict[tuple[str, str, str, str], int] = {}
        self._logs: dict[str, list[str]] = defaultdict(list)
        self._leases: dict[int, Lease] = {}
        # Expiry without a pass over every lease at each claim (a claim per batch, one
        # lease per worker): the leases' deadlines in a heap (an entry may be older than
        # its lease's renewed deadline: looked at again when it comes up), and the
        # leases of each holder, whose process is checked once, not once per lease.
        self._deadlines: list[tuple[float, int]] = []
        self._holders: dict[tuple[str, str, int], set[int]] = {}
        self._next_lease = 1
        self._activity: list[ActivityRecord] = []
        # Decoded trial configs and attrs by their canonical text, shared between the
        # rows that store the same one (a study's trials mostly do: its fixed config,
        # its version's attrs): one kept dict, not one a trial. Never changed in place
        # (an update replaces a row's attrs; readers get copies); bounded.
        self._shared: dict[str, Any] = {}
        self._revision = 0
        self._closed = False

    def atomically(self, fn: Callable[[], T]) -> T:
        # One lock around the calls: no other thread sees them half done.
        with self._lock:
            return fn()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("memory:// plan storage is closed")

    def _tree(self, root_key: str) -> TreeIndex:
        tree = self._trees.get(root_key)
        if tree is None:
            tree = self._trees[root_key] = TreeIndex(root_key, self._seqs)
        return tree

    def _node(self, node_id: int) -> Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise PlanKeyError(f"no node {node_id} in the plan") from None

    def _canonical_node(self, node_id: int, step: int) -> Node:
        node = self._node(node_id)
        check_canonical(node, step)
        return node

    # -- roots ---------------------------------------------------------------------------

    @_writes
    def register_root(self, root_key: str, config: Mapping[str, Any]) -> None:
        text = _codec.dumps(dict(config), "root config")
        with self._lock:
            self._check_open()
            old = self._roots.get(root_key)
            if old is not None and old != text:
                raise StorageError(f"root {root_key!r} is registered with another config")
            self._roots[root_key] = text

    def root_config(self, root_key: str) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            if root_key not in self._roots:
                raise PlanKeyError(f"root {root_key!r} is not registered")
            return _codec.loads(self._roots[root_key])

    def root_keys(self) -> list[str]:
        with self._lock:
            self._check_open()
            return sorted(set(self._roots) | {k for k, t in self._trees.items() if len(t)})

    # -- trees ---------------------------------------------------------------------------

    @_writes
    def insert_trials(
        self,
        root_key: str,
        items: Seq[tuple[Mapping[str, Sequence], int]],
        *,
        request: bool = True,
    ) -> list[Insertion]:
        with self._lock:
            self._check_open()
            tree = self._tree(root_key)
            checked = check_items(tree, items)
            mark = tree.last_id
            out: list[Insertion] = []
            try:
                for hp, steps in checked:
                    out.append(insert(tree, hp, steps, self._new_id, checked=True))
            except BaseException:
                tree.discard_after(mark)  # nothing is written on failure
                raise
            for ins in out:
                for node in ins.new_nodes:
                    self._nodes[node.id] = node
                if request:
                    key = (ins.node, ins.step)
                    self._requests[key] = after_add(self._requests.get(key), *key, 1)
            return out

    def _new_id(self) -> int:
        node_id = self._next_id
        self._next_id += 1
        return node_id

    def tree_names(self, root_key: str) -> tuple[str, ...] | None:
        with self._lock:
            self._check_open()
            tree = self._trees.get(root_key)
            return None if tree is None else tree.names

    def locate(
        self, root_key: str, hp: Mapping[str, Sequence], step: int
    ) -> tuple[int, int] | None:
        with self._lock:
            self._check_open()
            result = walk(self._tree(root_key), hp, step)
            return None if result.end is None else (result.end, step)

    def node(self, node_id: int) -> Node:
        with self._lock:
            self._check_open()
            return self._node(node_id)

    def nodes(self, root_key: str | None = None) -> list[Node]:
        with self._lock:
            self._check_open()
            if root_key is None:
                return [self._nodes[i] for i in sorted(self._nodes)]
            tree = self._trees.get(root_key)
            return [] if tree is None else [tree.nodes[i] for i in sorted(tree.nodes)]

    # -- requests ------------------------------------------------------------------------

    @_writes
    def add_request(self, node: int, step: int, count: int = 1) -> Request:
        with self._lock:
            self._check_open()
            self._canonical_node(node, step)
            req = after_add(self._requests.get((node, step)), node, step, count)
            self._requests[(node, step)] = req
            return _copy_request(req)

    @_writes
    def release_request(self, node: int, step: int, count: int = 1) -> Request:
        with self._lock:
            self._check_open()
            req = after_release(self._requests.get((node, step)), node, step, count)
            self._requests[(node, step)] = req
            return _copy_request(req)

    @_writes
    def set_request_state(
        self, node: int, step: int, state: RequestState | str, error: str | None = None
    ) -> Request:
        state = RequestState(state)
        with self._lock:
            self._check_open()
            req = self._requests.get((node, step))
            if req is None:
                raise PlanKeyError(f"no request at (node {node}, step {step})")
            req = Request(req.node, req.step, req.refcount, state, error)
            self._requests[(node, step)] = req
            return _copy_request(req)

    def request(self, node: int, step: int) -> Request | None:
        with self._lock:
            self._check_open()
            req = self._requests.get((node, step))
            return None if req is None else _copy_request(req)

    def requests(
        self,
        root_key: str | None = None,
        states: Collection[RequestState | str] | None = None,
    ) -> list[Request]:
        wanted = None if states is None else {RequestState(s) for s in states}
        with self._lock:
            self._check_open()
            return [
                _copy_request(req)
                for key, req in sorted(self._requests.items())
                if (root_key is None or self._nodes[key[0]].root_key == root_key)
                and (wanted is None or req.state in wanted)
            ]

    # -- checkpoints ---------------------------------------------------------------------

    @_writes
    def put_checkpoint(self, node: int, step: int, ref: str, nbytes: int) -> CheckpointRecord:
        with self._lock:
            self._check_open()
            self._canonical_node(node, step)
            record = CheckpointRecord(str(ref), int(nbytes), time.time())
            self._checkpoints[(node, step)] = record
            self._checkpoint_steps.setdefault(node, set()).add(step)
            return record

    @_writes
    def remove_checkpoint(self, node: int, step: int) -> bool:
        with self._lock:
            self._check_open()
            steps = self._checkpoint_steps.get(node)
            if steps is not None:
                steps.discard(step)
                if not steps:
                    del self._checkpoint_steps[node]
            return self._checkpoints.pop((node, step), None) is not None

    def checkpoint(self, node: int, step: int) -> CheckpointRecord | None:
        with self._lock:
            self._check_open()
            return self._checkpoints.get((node, step))

    def checkpoints(self, root_key: str | None = None) -> dict[tuple[int, int], CheckpointRecord]:
        with self._lock:
            self._check_open()
            return {
                key: rec
                for key, rec in sorted(self._checkpoints.items())
                if root_key is None or self._nodes[key[0]].root_key == root_key
            }

    def checkpoints_on(self, nodes: Collection[int]) -> dict[tuple[int, int], CheckpointRecord]:
        with self._lock:
            self._check_open()
            found = self._checkpoint_steps
            return {
                (node, step): self._checkpoints[(node, step)]
                for node in sorted(set(nodes))
                for step in sorted(found.get(node, ()))
            }

    # -- metrics -------------------------------------------------------------------------

    def put_metrics(self, node: int, step: int, metrics: Mapping[str, float]) -> None:
        self.put_metrics_many([(node, step, metrics, True)])

    @_writes
    def put_metrics_many(self, items: Iterable[MetricsItem]) -> None:
        checked = [(node, step, check_metrics(m), bool(ev)) for node, step, m, ev in items]
        with self._lock:
            self._check_open()
            for node, step, _values, _evaluated in checked:
                self._canonical_node(node, step)
            for node, step, values, evaluated in checked:
                steps = self._metrics.setdefault(node, {})
                steps[step] = merge_metrics(steps.get(step), values, evaluated)

    def get_metrics(self, node: int, step: int) -> dict[str, float] | None:
        with self._lock:
            self._check_open()
            return evaluated_metrics(self._metrics.get(node, {}).get(step))

    def metrics_along(
        self, root_key: str, hp: Mapping[str, Sequence], steps: int
    ) -> dict[int, dict[str, float]]:
        with self._lock:
            self._check_open()
            return self._along(walk(self._tree(root_key), hp, steps).segments)

    def path_metrics(self, node: int, step: int) -> dict[int, dict[str, float]]:
        # The path up the parent links: no walk by the sequences, no copy of a node's
        # metrics off the path (a submission's curve, read when its result comes).
        with self._lock:
            self._check_open()
            self._node(node)
            return self._along(path_segments(self._nodes, node, step))

    def _along(self, segments: Iterable[tuple[int, int, int]]) -> dict[int, dict[str, float]]:
        """The metrics on a path's ``(node, first, last)`` segments, by step in order."""
        out: dict[int, dict[str, float]] = {}
        for node, first, last in segments:
            for step, values in self._metrics.get(node, {}).items():
                if first <= step <= last:
                    out[step] = shown_metrics(values)
        return dict(sorted(out.items()))

    def metrics(
        self, root_key: str, nodes: Collection[int] | None = None
    ) -> dict[int, dict[int, dict[str, float]]]:
        with self._lock:
            self._check_open()
            tree = self._trees.get(root_key)
            ids = [] if tree is None else sorted(tree.nodes if nodes is None else nodes)
            return {
                node: {step: shown_metrics(v) for step, v in sorted(self._metrics[node].items())}
                for node in ids
                if self._metrics.get(node) and tree is not None and node in tree.nodes
            }

    def metrics_at(
        self, keys: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], dict[str, float]]:
        with self._lock:
            self._check_open()
            out: dict[tuple[int, int], dict[str, float]] = {}
            for node, step in sorted(set(keys)):
                stored = self._metrics.get(node, {}).get(step)
                if stored is not None:
                    out[(node, step)] = shown_metrics(stored)
            return out

    def metric_steps(self, root_key: str) -> dict[int, int]:
        with self._lock:
            self._check_open()
            tree = self._trees.get(root_key)
            nodes = () if tree is None else tree.nodes
            return {n: max(self._metrics[n]) for n in sorted(nodes) if self._metrics.get(n)}

    # -- accounting ----------------------------------------------------------------------

    @_writes
    def add_stats(self, scope: str, **deltas: float) -> None:
        self._add_stats({scope: deltas})

    @_writes
    def add_stats_many(self, deltas: Mapping[str, Mapping[str, float]]) -> None:
        self._add_stats(deltas)

    def _add_stats(self, deltas: Mapping[str, Mapping[str, float]]) -> None:
        with self._lock:
            self._check_open()
            for scope, values in deltas.items():
                counters = self._stats[scope]
                for key, delta in values.items():
                    counters[key] = counters.get(key, 0.0) + float(delta)

    def stats(self, scope: str | None = None) -> dict[str, float]:
        with self._lock:
            self._check_open()
            if scope is not None:
                return dict(sorted(self._stats.get(scope, {}).items()))
            total: dict[str, float] = {}
            for counters in self._stats.values():
                for key, value in counters.items():
                    total[key] = total.get(key, 0.0) + value
            return dict(sorted(total.items()))

    # -- studies -------------------------------------------------------------------------

    @_writes
    def create_study(self, name: str, meta: Mapping[str, Any]) -> bool:
        meta_copy = _codec.copy(dict(meta), "study meta")
        with self._lock:
            self._check_open()
            if name in self._studies:
                return False
            self._studies[name] = {"name": name, "meta": meta_copy, "created": time.time()}
            return True

    @_writes
    def update_study_meta(self, name: str, meta: Mapping[str, Any]) -> dict[str, Any]:
        meta_copy = _codec.copy(dict(meta), "study meta")
        with self._lock:
            self._check_open()
            self._study(name)
            merged = {**self._studies[name]["meta"], **meta_copy}
            self._studies[name]["meta"] = merged
            return _codec.copy(merged)

    def studies(self) -> list[dict[str, Any]]:
        with self._lock:
            self._check_open()
            return [_codec.copy(s) for s in self._studies.values()]

    def _study(self, name: str) -> None:
        if name not in self._studies:
            raise PlanKeyError(f"no study {name!r}")

    @_writes
    def add_trial(
        self,
        study: str,
        root_key: str,
        config: Mapping[str, Any],
        hp: Mapping[str, Sequence],
        steps: int,
        node: int | None,
        step: int | None,
        *,
        state: str = "pending",
        attrs: Mapping[str, Any] | None = None,
        unique: bool = False,
        encoded: tuple[str, str] | None = None,
    ) -> int:
        hp = check_trial(TreeIndex(root_key), hp, steps)  # a fresh dict: stored as is
        # The caller's canonical text, where given, is the stored config (what SQL
        # stores): decoded, not encoded again.
        if encoded is None:
            config_text = _codec.dumps(_codec.copy(dict(config), "trial config"))
            encoded = (config_text, dumps_hp(hp))
        attrs_text = _codec.dumps(dict(attrs or {}), "trial attrs")
        with self._lock:
            self._check_open()
            self._study(study)
            record = {
                "study": study,
                "root_key": root_key,
                "config": self._decoded(encoded[0]),
                "hp": hp,
                "steps": steps,
                "node": node,
                "step": step,
                "state": str(state),
                "attrs": self._decoded(attrs_text),
                "created": time.time(),
            }
            at = None if node is None else self._nodes.get(node)
            if at is not None and _same_sequences(at.hp, hp):
                record["hp"] = at.hp  # the node's own mapping: one kept dict, not two
            ident = (study, root_key, *encoded)
            if unique and ident in self._trial_keys:  # one row per (study, root, config, hp)
                return self._trial_keys[ident]
            trial_id = self._next_trial
            self._trial_keys.setdefault(ident, trial_id)
            self._next_trial += 1
            self._trials[trial_id] = {"id": trial_id, **record}
            return trial_id

    def _decoded(self, text: str) -> Any:
        """The stored value of a trial's JSON ``text``: one object for rows that store
        the same text (lock held)."""
        value = self._shared.get(text)
        if value is None:
            if len(self._shared) >= _SHARED_MAX:
                self._shared.clear()
            value = self._shared[text] = _codec.loads(text)
        return value

    @_writes
    def update_trial(
        self,
        trial_id: int,
        *,
        steps: int | None = None,
        node: int | None = None,
        step: int | None = None,
        state: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        seen: Mapping[str, Any] | None = None,
        only_from: str | None = None,
    ) -> dict[str, Any]:
        changes = trial_changes(steps, node, step, state)
        if attrs is not None:
            changes["attrs"] = _codec.copy(dict(attrs), "trial attrs")
        with self._lock:
            self._check_open()
            trial = self._trials.get(trial_id)
            if trial is None:
                raise PlanKeyError(f"no trial {trial_id}")
            if only_from is None or trial["state"] == only_from:
                trial.update(changes)
            return _copy_trial(trial)

    def trial(self, trial_id: int) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            trial = self._trials.get(trial_id)
            if trial is None:
                raise PlanKeyError(f"no trial {trial_id}")
            return _copy_trial(trial)

    def trials(self, study: str, *, light: bool = False) -> list[dict[str, Any]]:
        with self._lock:
            self._check_open()
            return [_copy_trial(t, light) for t in self._trials.values() if t["study"] == study]

    def final_metrics(self, study: str) -> dict[int, dict[str, float]]:
        with self._lock:
            self._check_open()
            out: dict[int, dict[str, float]] = {}
            for t in self._trials.values():
                if t["study"] != study or t["node"] is None or t["step"] != t["steps"]:
                    continue
                stored = self._metrics.get(t["node"], {}).get(t["steps"])
                if stored is not None:
                    out[t["id"]] = shown_metrics(stored)
            return out

    def trial_ends(self, study: str) -> list[TrialEnd]:
        with self._lock:
            self._check_open()
            out = []
            for t in self._trials.values():
                if t["study"] != study:
                    continue
                node, steps = t["node"], t["steps"]
                stored = None if node is None or t["step"] != steps else self._metrics.get(node)
                final = None if stored is None else stored.get(steps)
                attrs = MappingProxyType(t["attrs"])  # the stored dict, read-only
                shown = None if final is None else shown_metrics(final)
                out.append(TrialEnd(t["id"], steps, node, t["step"], attrs, shown))
            return out

    @_writes
    def append_log(self, study: str, record: Mapping[str, Any]) -> int:
        text = _codec.dumps(dict(record), "log record")
        with self._lock:
            self._check_open()
            self._study(study)
            log = self._logs[study]
            log.append(text)
            return len(log) - 1

    def read_log(self, study: str) -> list[dict[str, Any]]:
        with self._lock:
            self._check_open()
            return [_codec.loads(text) for text in self._logs.get(study, [])]

    def last_log(self, study: str, event: str | None = None) -> dict[str, Any] | None:
        needle = None if event is None else _codec.event_needle(event)
        with self._lock:
            self._check_open()
            for text in reversed(self._logs.get(study, [])):
                if needle is not None and needle not in text:
                    continue  # canonical JSON: a record of the event holds the needle
                record: dict[str, Any] = _codec.loads(text)
                if event is None or record.get("event") == event:
                    return record
            return None

    # -- leases --------------------------------------------------------------------------

    def _grant(self, owner: str, scope: str, node: int | None, a: int, b: int, ttl: float) -> Lease:
        host, pid = host_pid()
        now = time.time()
        lease = Lease(self._next_lease, owner, scope, node, a, b, host, pid, now, now + ttl)
        self._next_lease += 1
        self._leases[lease.id] = lease
        self._holders.setdefault((owner, host, pid), set()).add(lease.id)
        self._deadline(lease)
        return lease

    def _deadline(self, lease: Lease) -> None:
        """Keep ``lease``'s deadline in the heap (rebuilt from the live leases when
        released ones fill it)."""
        heapq.heappush(self._deadlines, (lease.expires, lease.id))
        if len(self._deadlines) > 2 * len(self._leases) + 64:
            self._deadlines = [(v.expires, k) for k, v in self._leases.items()]
            heapq.heapify(self._deadlines)

    def _drop(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        key = (lease.owner, lease.host, lease.pid)
        ids = self._holders[key]
        ids.discard(lease_id)
        if not ids:
            del self._holders[key]

    def _expire(self, now: float) -> None:
        """Drop the leases that are not live at ``now`` (:meth:`Lease.live`): those whose
        deadline passed, and those of a holder that is a dead process of this machine."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(deadlines)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue  # released
            if lease.expires > now:  # renewed since: its new deadline
                heapq.heappush(deadlines, (lease.expires, lease_id))
            else:
                self._drop(lease_id)
        # Whether a holder is dead depends on its owner, host and pid only.
        for ids in list(self._holders.values()):
            if self._leases[next(iter(ids))].holder_dead():
                for lease_id in list(ids):
                    self._drop(lease_id)

    @_writes
    def claim(
        self, owner: str, root_key: str, segments: Seq[tuple[int, int, int]], ttl: float
    ) -> ClaimResult:
        with self._lock:
            self._check_open()
            now = time.time()
            self._expire(now)
            conflicts = stage_conflicts(self._leases.values(), owner, segments, now)
            if conflicts:
                return ClaimResult(conflicts=tuple(conflicts))
            granted = [self._grant(owner, root_key, n, a, b, ttl) for n, a, b in segments if b > a]
            return ClaimResult(granted=tuple(granted))

    @_writes
    def claim_study(self, owner: str, study: str, ttl: float) -> ClaimResult:
        with self._lock:
            self._check_open()
            now = time.time()
            self._expire(now)
            conflicts = study_conflicts(self._leases.values(), owner, study, now)
            if conflicts:
                return ClaimResult(conflicts=tuple(conflicts))
            for lease in self._leases.values():
                if lease.node is None and lease.scope == study and lease.owner == owner:
                    lease = self._leases[lease.id] = replace(lease, expires=now + ttl)
                    self._deadline(lease)
                    return ClaimResult(granted=(lease,))
            return ClaimResult(granted=(self._grant(owner, study, None, 0, 0, ttl),))

    def renew(self, owner: str, ttl: float) -> int:
        with self._lock:
            self._check_open()
            expires = time.time() + ttl
            mine = [k for k, v in self._leases.items() if v.owner == owner]
            for k in mine:
                before = self._leases[k]
                self._leases[k] = replace(before, expires=expires)
                if expires < before.expires:  # sooner: the heap's entry would be late
                    self._deadline(self._leases[k])
            return len(mine)

    @_writes
    def release(self, owner: str, lease_ids: Collection[int] | None = None) -> int:
        with self._lock:
            self._check_open()
            ids = set(lease_ids) if lease_ids is not None else None
            gone = [
                k for k, v in self._leases.items() if v.owner == owner and (ids is None or k in ids)
            ]
            for k in gone:
                self._drop(k)
            return len(gone)

    def leases(self, scope: str | None = None, live_only: bool = True) -> list[Lease]:
        with self._lock:
            self._check_open()
            now = time.time()
            return [
                v
                for _k, v in sorted(self._leases.items())
                if (scope is None or v.scope == scope) and (not live_only or v.live(now))
            ]

    # -- change feed ---------------------------------------------------------------------

    def revision(self) -> int:
        with self._lock:
            self._check_open()
            return self._revision

    @_writes
    def record_activity(self, items: Iterable[Mapping[str, Any]]) -> None:
        rows = [activity_row(item) for item in items]
        with self._lock:
            self._check_open()
            for row in rows:
                self._activity.append(ActivityRecord(seq=len(self._activity) + 1, **row))

    def activity(
        self, after: int = 0, root_keys: Collection[str] | None = None
    ) -> list[ActivityRecord]:
        keys = None if root_keys is None else set(root_keys)
        with self._lock:
            self._check_open()
            return [
                r for r in self._activity[max(0, after) :] if keys is None or r.root_key in keys
            ]

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def __repr__(self) -> str:
        return f"MemoryPlanStorage(nodes={len(self._nodes)})"


def _copy_request(req: Request) -> Request:
    """A copy of a stored request (what ``dataclasses.replace`` gives, without its walk
    over the fields: a request is read and written several times a trial)."""
    return Request(req.node, req.step, req.refcount, req.state, req.error)


def _copy_trial(trial: dict[str, Any], light: bool = False) -> dict[str, Any]:
    out = dict(trial)
    out["attrs"] = _codec.detach(trial["attrs"])  # stored as copied: JSON types only
    if light:
        del out["config"], out["hp"]
    else:
        out["config"] = _codec.detach(trial["config"])
        out["hp"] = dict(trial["hp"])
    return out
