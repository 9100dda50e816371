"""The contract every search-plan storage fulfils, and the records it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from stagetree.exceptions import PlanKeyError, RequestError
from stagetree.hp import Sequence
from stagetree.plan.leases import ClaimResult, Lease
from stagetree.plan.model import (
    ACTIVITY_KINDS,
    ActivityRecord,
    Node,
    NodeLink,
    Request,
    RequestState,
)
from stagetree.plan.tree import Insertion, is_canonical, names_key

T = TypeVar("T")

__all__ = [
    "ActivityRecord",
    "BasePlanStorage",
    "CheckpointRecord",
    "Insertion",
    "MetricsItem",
    "PlanKeyError",
    "RequestError",
    "TrialEnd",
    "TrialFinal",
    "activity_row",
    "after_add",
    "after_release",
    "check_canonical",
]


class TrialEnd(NamedTuple):
    """What ranking a trial reads (:meth:`BasePlanStorage.trial_ends`): its ``id``,
    ``steps``, the end of its row (``node``, ``step``: see
    :meth:`BasePlanStorage.trials`), its ``attrs`` (read-only: rows with the same
    attributes may share one dict) and its stored metrics at its final step (None
    when it has none there, or its row's end lags its steps)."""

    id: int
    steps: int
    node: int | None
    step: int | None
    attrs: Mapping[str, Any]
    final: dict[str, float] | None


class TrialFinal(NamedTuple):
    """A trial as ``Study.trials(history=False)`` lists it
    (:meth:`BasePlanStorage.trial_finals`): the fields of a :meth:`BasePlanStorage.trials`
    row that it reads (``config`` and ``hp`` the trial's own; ``attrs`` read-only: rows
    with the same attributes may share one dict) and ``final``, its stored metrics at
    its final step (None when it has none there, or its row's end lags its steps), as
    :class:`TrialEnd` gives them."""

    id: int
    config: dict[str, Any]
    hp: dict[str, Sequence]
    steps: int
    node: int | None
    step: int | None
    state: str
    attrs: Mapping[str, Any]
    final: dict[str, float] | None


@dataclass(frozen=True)
class CheckpointRecord:
    """A durable checkpoint of the model at some canonical ``(node, step)``.

    Attributes:
        ref: where the checkpoint store keeps it (opaque to the plan).
        nbytes: its size in bytes.
        created: wall-clock time (``time.time()``) it was recorded.
    """

    ref: str
    nbytes: int
    created: float


def after_add(request: Request | None, node: int, step: int, count: int) -> Request:
    """The request after ``count`` new references (shared rule of every backend).

    A cancelled or failed request becomes pending again (its error is cleared); a done
    one stays done.
    """
    if count < 1:
        raise RequestError(f"count must be >= 1, got {count}")
    if request is None:
        return Request(node, step, count, RequestState.PENDING, None)
    state, error = request.state, request.error
    if state in (RequestState.CANCELLED, RequestState.FAILED):
        state, error = RequestState.PENDING, None
    return Request(node, step, request.refcount + count, state, error)


def after_release(request: Request | None, node: int, step: int, count: int) -> Request:
    """The request after ``count`` references are dropped.

    At zero references a request that is not final (pending, scheduled) becomes
    cancelled; done and failed requests keep their state.

    Raises:
        PlanKeyError: no such request.
        RequestError: ``count`` exceeds the reference count.
    """
    if request is None:
        raise PlanKeyError(f"no request at (node {node}, step {step})")
    if count < 1:
        raise RequestError(f"count must be >= 1, got {count}")
    if count > request.refcount:
        raise RequestError(
            f"cannot release {count} references of request (node {node}, step {step}): "
            f"it holds {request.refcount}"
        )
    refcount = request.refcount - count
    state = request.state
    if refcount == 0 and state in (RequestState.PENDING, RequestState.SCHEDULED):
        state = RequestState.CANCELLED
    return Request(node, step, refcount, state, request.error)


def check_canonical(node: Node, step: int) -> None:
    """Raise :class:`ValueError` unless ``(node, step)`` is a canonical model key."""
    if isinstance(step, bool) or not isinstance(step, int) or not is_canonical(node, step):
        raise ValueError(
            f"(node {node.id}, step {step!r}) is not canonical: the step must exceed the "
            f"node's branch step {node.branch_step} (or be 0 at the root)"
        )


def activity_row(item: Mapping[str, Any]) -> dict[str, Any]:
    """The checked fields of one activity record (shared rule of every backend).

    Raises:
        ValueError: an unknown ``kind``.
    """
    kind = str(item["kind"])
    if kind not in ACTIVITY_KINDS:
        raise ValueError(f"unknown activity kind {kind!r} (one of {', '.join(ACTIVITY_KINDS)})")
    node, step = item.get("node"), item.get("step")
    return {
        "owner": str(item["owner"]),
        "batch": int(item["batch"]),
        "kind": kind,
        "worker": int(item["worker"]),
        "root_key": str(item["root_key"]),
        "node": None if node is None else int(node),
        "step": None if step is None else int(step),
        "time": float(item["time"]),
        "seconds": float(item.get("seconds") or 0.0),
        "data": dict(item.get("data") or {}),
    }


def trial_changes(
    steps: int | None, node: int | None, step: int | None, state: str | None
) -> dict[str, Any]:
    """The plain fields an ``update_trial`` call changes (None: unchanged)."""
    changes: dict[str, Any] = {
        k: v for k, v in (("steps", steps), ("node", node), ("step", step)) if v is not None
    }
    if state is not None:
        changes["state"] = str(state)
    return changes


#: ``(node, step, metrics, evaluated)``: one point of a learning curve for
#: :meth:`BasePlanStorage.put_metrics_many`; ``evaluated`` is False for a step that has
#: ``train()`` metrics only.
MetricsItem = tuple[int, int, Mapping[str, float], bool]

#: Stored with the metrics of a step that was not evaluated (``train()`` metrics only):
#: such a step is not an answer to a request. Never returned to callers; a metric may
#: not use this name.
PARTIAL_KEY = "stagetree:partial"


def check_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metrics as ``{str: float}``; NaN and infinities are kept as they are."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric names must be str, got {key!r}")
        if key == PARTIAL_KEY:
            raise ValueError(f"{PARTIAL_KEY!r} is reserved, not a metric name")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)  # numpy / torch scalars
            except (TypeError, ValueError):
                raise ValueError(f"metric {key!r} must be a number, got {value!r}") from None
        out[key] = float(value)
    return out


def merge_metrics(
    old: Mapping[str, float] | None, values: Mapping[str, float], evaluated: bool
) -> dict[str, float]:
    """The stored metrics of a step after merging ``values`` into ``old`` (as stored,
    None when the step has none yet): shared rule of every backend. A step is evaluated
    once any evaluated item reached it; ``train()`` metrics alone leave it partial."""
    merged = {**(old or {}), **values}
    if evaluated:
        merged.pop(PARTIAL_KEY, None)
    elif old is None:
        merged[PARTIAL_KEY] = 1.0
    return merged


def shown_metrics(stored: Mapping[str, float]) -> dict[str, float]:
    """Stored metrics of a step as callers see them (without the partial mark)."""
    return {k: v for k, v in stored.items() if k != PARTIAL_KEY}


def evaluated_metrics(stored: Mapping[str, float] | None) -> dict[str, float] | None:
    """What :meth:`BasePlanStorage.get_metrics` returns for stored metrics."""
    if stored is None or PARTIAL_KEY in stored:
        return None
    return dict(stored)


class BasePlanStorage(ABC):
    """A search plan: one append-only tree per root key, plus what hangs off its nodes.

    Contract (every backend; the shared suite ``tests/test_plan_storage.py`` checks it):

    * **Trees** are append-only. :meth:`insert_trials` walks each trial through its tree
      by value (:mod:`stagetree.plan.tree`, the one implementation of the walk) and
      creates at most one node per trial. Nodes are never changed or removed; node ids
      are unique across the storage and grow with insertion order. Siblings branching at
      the same step differ at that step. Identical trials end at the same
      ``(node, step)``.
    * **Keys**: the model after ``S`` steps of a path is keyed by its canonical
      ``(node, S)``: the deepest node of the path with ``branch_step < S`` (the root for
      ``S == 0``). Requests, checkpoints and metrics only accept canonical keys
      (``ValueError`` otherwise) of existing nodes (:class:`PlanKeyError` otherwise).
    * **Atomicity**: every method is one transaction; :meth:`atomically` makes one of
      several calls (the engine's writes of one trial's submission, or of its end).
      ``insert_trials`` validates every item before writing: a trial whose
      hyper-parameter names differ from its tree's raises
      :class:`~stagetree.exceptions.InvalidTrialError` and nothing is written.
      Backends shared between processes (SQL) serialise write transactions, and read
      the tree inside the write transaction that extends it, so concurrent inserts never
      duplicate nodes or lose references.
    * **Requests** are reference counted: inserting a trial (with ``request=True``)
      or :meth:`add_request` adds references; a cancelled or failed request becomes
      pending again, a done one stays done. :meth:`release_request` drops references;
      at zero a pending or scheduled request becomes cancelled.
    * **Values** round-trip exactly: hp sequences (via ``stagetree.hp.dumps_hp``),
      configs, metrics including NaN and infinities, log records.
    * **Trials**: :meth:`add_trial` with ``unique=True`` of a trial ``(study, root_key,
      config, hp)`` the study holds returns the (first) existing id, in the same write
      transaction, so two processes submitting the same trial at once get one row.
    * **Leases** (:mod:`stagetree.plan.leases`): :meth:`claim` grants all segments or
      none, atomically with respect to other claims; live leases of other owners that
      overlap stop it. Time is the writer's ``time.time()``; expired leases count as gone.
    * Returned records are copies: mutating them does not change the plan.

    Capabilities (class attributes or properties a backend overrides):

    * :attr:`shared`: other processes (and machines) may open the same plan, so leases
      and cooperation matter; False for a plan held in this process.
    * :meth:`database_url`: a URL another library can open to keep its own tables in
      the same database (the Optuna bridge), or None.
    * :attr:`retry_seconds`: the ride-through window of its outages (0: none).
    """

    #: Whether other processes can open this same plan (see the class docstring).
    shared: bool = False

    @property
    def retry_seconds(self) -> float:
        """Seconds a call rides through an outage of the plan before it fails
        (:mod:`stagetree.retry`); 0 for a plan that has no outages."""
        return 0.0

    def database_url(self) -> str | None:
        """The full database URL (password included) another library may connect to,
        or None when the plan lives in this process only."""
        return None

    def atomically(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (calls of this storage's methods only) as one transaction: its
        writes are durable together or not at all, and cost one commit. On a transient
        failure a backend may run ``fn`` again from the start (its writes rolled back),
        so ``fn`` must not change anything but the plan. This default runs ``fn`` as it
        is (each call its own transaction): for a plan held in this process only."""
        return fn()

    # -- roots ---------------------------------------------------------------------------

    @abstractmethod
    def register_root(self, root_key: str, config: Mapping[str, Any]) -> None:
        """Store the fixed config (JSON-able) of ``root_key``; idempotent.

        Raises:
            StorageError: ``root_key`` is registered with a different config.
        """

    @abstractmethod
    def root_config(self, root_key: str) -> dict[str, Any]:
        """The config registered for ``root_key``.

        Raises:
            PlanKeyError: ``root_key`` was never registered.
        """

    @abstractmethod
    def root_keys(self) -> list[str]:
        """Registered root keys and keys of non-empty trees, sorted."""

    # -- trees ---------------------------------------------------------------------------

    @abstractmethod
    def insert_trials(
        self,
        root_key: str,
        items: Seq[tuple[Mapping[str, Sequence], int]],
        *,
        request: bool = True,
    ) -> list[Insertion]:
        """Insert trials ``(hp, steps)`` into ``root_key``'s tree in one transaction.

        Args:
            root_key: the tree (the first trial of an empty tree becomes its root).
            items: ``(hp, steps)`` pairs, inserted in order.
            request: also add one reference to each trial's request ``(node, steps)``.

        Returns:
            One :class:`Insertion` per item.

        Raises:
            InvalidTrialError: an item does not fit the tree (nothing is written).
        """

    def tree_names(self, root_key: str) -> tuple[str, ...] | None:
        """The sorted hyper-parameter names of ``root_key``'s tree (its root's); None
        while the tree is empty. Backends answer without loading the whole tree."""
        for node in self.nodes(root_key):
            if node.parent is None:
                return tuple(sorted(node.hp))
        return None

    def tree_key(self, root_key: str, names: Iterable[str]) -> str:
        """The tree that trials with hyper-parameter ``names`` go to under ``root_key``
        (a trainer version and fixed config): ``root_key`` itself while its tree is
        empty or has these names, else a key of their own
        (:func:`~stagetree.plan.tree.names_key`). A study that renames or adds a
        hyper-parameter is another configuration: it gets its own tree, and a plan
        written before keeps its trees where they are."""
        have = self.tree_names(root_key)
        if have is None or have == tuple(sorted(names)):
            return root_key
        return names_key(root_key, names)

    def insert_trial(
        self, root_key: str, hp: Mapping[str, Sequence], steps: int, *, request: bool = True
    ) -> Insertion:
        """Insert one trial; see :meth:`insert_trials`."""
        return self.insert_trials(root_key, [(hp, steps)], request=request)[0]

    @abstractmethod
    def locate(
        self, root_key: str, hp: Mapping[str, Sequence], step: int
    ) -> tuple[int, int] | None:
        """Canonical ``(node, step)`` of the trial after ``step`` steps, without inserting.

        Returns None when the tree does not hold that path (yet).

        Raises:
            InvalidTrialError: the names differ from the tree's.
        """

    @abstractmethod
    def node(self, node_id: int) -> Node:
        """The node ``node_id``.

        Raises:
            PlanKeyError: no such node.
        """

    @abstractmethod
    def nodes(self, root_key: str | None = None) -> list[Node]:
        """Nodes of one tree (or of all trees) in id order."""

    def node_links(self, root_key: str) -> dict[int, NodeLink]:
        """Where each node of one tree hangs, by id (:class:`NodeLink`: id, parent,
        branch step), without the nodes' sequences: what cutting learning curves from a
        tree's metrics walks (:func:`~stagetree.plan.tree.path_segments`; a replay of a
        study's 100,000 trials). A backend reads those columns only."""
        return {n.id: NodeLink(n.id, n.parent, n.branch_step) for n in self.nodes(root_key)}

    def last_node_id(self) -> int:
        """The largest node id in the storage (0 when it holds none)."""
        return max((n.id for n in self.nodes()), default=0)

    def nodes_after(self, after_id: int, also: Collection[int] = ()) -> list[Node]:
        """Nodes of every tree with an id above ``after_id`` or in ``also``, in id order:
        what other processes appended since a reader last looked (ids grow with
        insertion). A storage should answer from an index, not by reading every tree."""
        wanted = set(also)
        return [n for n in self.nodes() if n.id > after_id or n.id in wanted]

    def path(self, node_id: int) -> list[Node]:
        """Nodes from the root of ``node_id``'s tree down to it."""
        out = [self.node(node_id)]
        while out[-1].parent is not None:
            parent = out[-1].parent
            assert parent is not None
            out.append(self.node(parent))
        out.reverse()
        return out

    # -- requests ------------------------------------------------------------------------

    @abstractmethod
    def add_request(self, node: int, step: int, count: int = 1) -> Request:
        """Add ``count`` references to request ``(node, step)`` (created pending)."""

    @abstractmethod
    def release_request(self, node: int, step: int, count: int = 1) -> Request:
        """Drop ``count`` references; see :func:`after_release`.

        Raises:
            PlanKeyError: no such request.
            RequestError: more references released than held.
        """

    @abstractmethod
    def set_request_state(
        self, node: int, step: int, state: RequestState | str, error: str | None = None
    ) -> Request:
        """Set the state (and error text, cleared when None) of an existing request.

        Raises:
            PlanKeyError: no such request.
        """

    @abstractmethod
    def request(self, node: int, step: int) -> Request | None:
        """Request ``(node, step)`` or None."""

    @abstractmethod
    def requests(
        self,
        root_key: str | None = None,
        states: Collection[RequestState | str] | None = None,
    ) -> list[Request]:
        """Requests of one tree (or all), optionally only in ``states``, by (node, step)."""

    def requests_on(self, nodes: Collection[int]) -> list[Request]:
        """Every request on the given ``nodes`` (of any tree), by (node, step): what an
        engine polls for the stages it leases (another engine's requests it may answer
        on its way). A storage should answer from the requests' primary key, in one
        read, not by reading the nodes' trees."""
        wanted = set(nodes)
        return [req for req in self.requests() if req.node in wanted] if wanted else []

    # -- checkpoints ---------------------------------------------------------------------

    @abstractmethod
    def put_checkpoint(self, node: int, step: int, ref: str, nbytes: int) -> CheckpointRecord:
        """Record (or replace) the checkpoint of ``(node, step)``."""

    @abstractmethod
    def remove_checkpoint(self, node: int, step: int) -> bool:
        """Forget the checkpoint of ``(node, step)``; False if there was none."""

    @abstractmethod
    def checkpoint(self, node: int, step: int) -> CheckpointRecord | None:
        """The checkpoint of ``(node, step)`` or None."""

    @abstractmethod
    def checkpoints(self, root_key: str | None = None) -> dict[tuple[int, int], CheckpointRecord]:
        """Checkpoints of one tree (or all) by ``(node, step)``."""

    def checkpoints_on(self, nodes: Collection[int]) -> dict[tuple[int, int], CheckpointRecord]:
        """Checkpoints of the nodes ``nodes`` (any steps) by ``(node, step)``: what a
        path or a batch's segments need, read by the checkpoints' key, whatever the size
        of their tree (the backends here answer in the number of those checkpoints; this
        default filters :meth:`checkpoints`)."""
        wanted = set(nodes)
        if not wanted:
            return {}
        return {key: rec for key, rec in self.checkpoints().items() if key[0] in wanted}

    # -- metrics -------------------------------------------------------------------------

    @abstractmethod
    def put_metrics(self, node: int, step: int, metrics: Mapping[str, float]) -> None:
        """Merge ``metrics`` into those of ``(node, step)`` (NaN and inf are kept) and
        mark the step *evaluated*: its metrics answer requests for ``(node, step)``."""

    @abstractmethod
    def put_metrics_many(self, items: Iterable[MetricsItem]) -> None:
        """Merge learning-curve points ``(node, step, metrics, evaluated)`` in one
        transaction. ``evaluated=True`` is :meth:`put_metrics`; ``evaluated=False``
        (``train()`` metrics only) merges the values without marking the step
        evaluated, and never unmarks an evaluated one. Every item is checked before
        anything is written."""

    @abstractmethod
    def get_metrics(self, node: int, step: int) -> dict[str, float] | None:
        """Metrics of ``(node, step)`` if the model was evaluated there, else None (a
        step with ``train()`` metrics only shows in :meth:`metrics_along`)."""

    @abstractmethod
    def metrics_along(
        self, root_key: str, hp: Mapping[str, Sequence], steps: int
    ) -> dict[int, dict[str, float]]:
        """Every known metric on the trial's path at steps ``<= steps``, by step: the
        learning curve, evaluated steps and steps with ``train()`` metrics alike.

        The part of the path that is not in the tree has no metrics; an empty tree
        gives ``{}``.
        """

    @abstractmethod
    def metrics(
        self, root_key: str, nodes: Collection[int] | None = None
    ) -> dict[int, dict[int, dict[str, float]]]:
        """Every stored metric of ``root_key``'s tree (or of its ``nodes``) in one read:
        ``{node: {step: metrics}}``, evaluated steps and ``train()``-only steps alike
        (the bulk form of :meth:`metrics_along`, for readers of whole trees)."""

    def path_metrics(self, node: int, step: int) -> dict[int, dict[str, float]]:
        """Every stored metric on the path from the root of ``node``'s tree to the
        canonical ``(node, step)``, by step in order: what :meth:`metrics_along` gives
        the trial that ends there, reading the path's nodes (:meth:`path`) and their
        metrics only, never the whole tree (a study's best trial among 100,000 in one
        tree)."""
        path = self.path(node)
        ranges: dict[int, tuple[int, int]] = {}
        for i, n in enumerate(path):
            first = 0 if n.parent is None else n.branch_step + 1
            last = path[i + 1].branch_step if i + 1 < len(path) else step
            if last >= first:
                ranges[n.id] = (first, last)
        metrics = self.metrics(path[0].root_key, ranges)
        out: dict[int, dict[str, float]] = {}
        for n_id, (first, last) in ranges.items():
            for at, values in metrics.get(n_id, {}).items():
                if first <= at <= last:
                    out[at] = values
        return dict(sorted(out.items()))

    @abstractmethod
    def metrics_at(
        self, keys: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], dict[str, float]]:
        """The stored metrics at each canonical ``(node, step)`` of ``keys`` that has any,
        in one read (of any trees): ``{(node, step): metrics}`` in key order, evaluated
        steps and ``train()``-only steps alike, as :meth:`metrics` returns them. Keys
        without metrics, or of unknown nodes, are left out. For readers that need one
        point per trial (its final metrics: a study's best trial and status) without
        the whole learning curves."""

    @abstractmethod
    def metric_steps(self, root_key: str) -> dict[int, int]:
        """The largest step with stored metrics of each node of ``root_key``'s tree that
        has any: how far training got on it (cheap: no metric values are read)."""

    # -- accounting ----------------------------------------------------------------------

    @abstractmethod
    def add_stats(self, scope: str, **deltas: float) -> None:
        """Atomically add ``deltas`` to the counters of ``scope`` (created at 0)."""

    def add_stats_many(self, deltas: Mapping[str, Mapping[str, float]]) -> None:
        """:meth:`add_stats` of several scopes (``{scope: {key: delta}}``) at once, in one
        transaction on a database: what the engine counts when a batch ends (the
        storage's, the tree's and each study's counters) costs one commit, not one a
        scope. A backend without transactions adds them one scope after another."""
        for scope, values in deltas.items():
            self.add_stats(scope, **values)

    @abstractmethod
    def stats(self, scope: str | None = None) -> dict[str, float]:
        """Counters of ``scope``, or their sums over all scopes when None."""

    # -- studies -------------------------------------------------------------------------

    @abstractmethod
    def create_study(self, name: str, meta: Mapping[str, Any]) -> bool:
        """Create study ``name``; idempotent (the first ``meta`` stays). True if created."""

    @abstractmethod
    def update_study_meta(self, name: str, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``meta`` into study ``name``'s meta (the latest value of a key wins);
        returns the merged meta.

        Raises:
            PlanKeyError: the study does not exist.
        """

    @abstractmethod
    def studies(self) -> list[dict[str, Any]]:
        """``{"name", "meta", "created"}`` per study, in creation order."""

    @abstractmethod
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
        """Record a trial of ``study``; returns its id (unique across the storage). With
        ``unique``, a trial of the study with the same root key, config and hp is not
        recorded again: its id is returned. ``encoded``: the caller's texts of
        ``config`` (canonical JSON) and ``hp`` (:func:`~stagetree.hp.dumps_hp`), when it
        has them (the engine computed them for the trial's identity): not encoded again.

        Raises:
            PlanKeyError: the study does not exist.
        """

    @abstractmethod
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
        """Change the given fields of a trial (``attrs`` replaces); returns the trial.

        ``seen``: the trial as the caller just read it (:meth:`trial`); a storage that
        reads the row to write nothing when nothing changes may decide on it instead.
        ``only_from``: change nothing unless the trial's state is this one (checked
        and changed at once: no read of the row before); the trial is returned as it
        is then.

        Raises:
            PlanKeyError: no such trial.
        """

    @abstractmethod
    def trial(self, trial_id: int) -> dict[str, Any]:
        """One trial record (the keys of :meth:`trials`).

        Raises:
            PlanKeyError: no such trial.
        """

    @abstractmethod
    def trials(self, study: str, *, light: bool = False) -> list[dict[str, Any]]:
        """Trials of ``study`` in id order: ``{"id", "study", "root_key", "config", "hp",
        "steps", "node", "step", "state", "attrs", "created"}``.

        Args:
            light: leave out each row's ``config`` and ``hp`` (decoding them is most of
                the cost of reading many rows): for readers of the trials' states and
                ends (a dashboard following a large study).
        """

    def final_metrics(self, study: str) -> dict[int, dict[str, float]]:
        """The stored metrics of each trial of ``study`` at its final step, by trial id,
        for the trials whose row ends at its steps (``node`` set and ``step == steps``)
        and that have metrics there: :meth:`metrics_at` of every such trial's
        ``(node, steps)``, in one read (a backend answers it with one query)."""
        keys = {
            int(t["id"]): (int(t["node"]), int(t["steps"]))
            for t in self.trials(study, light=True)
            if t.get("node") is not None and t.get("step") == t["steps"]
        }
        points = self.metrics_at(keys.values())
        return {tid: points[key] for tid, key in keys.items() if key in points}

    def trial_ends(self, study: str) -> list[TrialEnd]:
        """:class:`TrialEnd` of each trial of ``study``, in id order: the light rows of
        :meth:`trials` joined to :meth:`final_metrics`, as a backend reads them at once
        (one query on SQL, no row dicts): what ``Study.best()`` ranks a large study
        by."""
        finals = self.final_metrics(study)
        return [
            TrialEnd(t["id"], t["steps"], t["node"], t["step"], t["attrs"], finals.get(t["id"]))
            for t in self.trials(study, light=True)
        ]

    def trial_finals(self, study: str) -> list[TrialFinal]:
        """:class:`TrialFinal` of each trial of ``study``, in id order: the rows of
        :meth:`trials` joined to :meth:`final_metrics`, as a backend reads them at once
        (one query on SQL, no row dicts): what ``Study.trials(history=False)`` lists."""
        finals = self.final_metrics(study)
        return [
            TrialFinal(
                t["id"],
                t["config"],
                t["hp"],
                t["steps"],
                t["node"],
                t["step"],
                t["state"],
                t["attrs"],
                finals.get(t["id"]),
            )
            for t in self.trials(study)
        ]

    @abstractmethod
    def append_log(self, study: str, record: Mapping[str, Any]) -> int:
        """Append a JSON-able record to the study's decision log; returns its sequence
        number (0, 1, 2, ... per study)."""

    @abstractmethod
    def read_log(self, study: str) -> list[dict[str, Any]]:
        """The study's log records in order."""

    def last_log(self, study: str, event: str | None = None) -> dict[str, Any] | None:
        """The study's last log record, or with ``event`` the last whose ``"event"``
        field is ``event``; None when there is none. What a reader asks of a long log
        (whether a study logged any decision, an exploit, where its latest run's
        decisions start) without reading it whole: backends answer it from the end,
        decoding only the records that may match."""
        for record in reversed(self.read_log(study)):
            if event is None or record.get("event") == event:
                return record
        return None

    # -- leases --------------------------------------------------------------------------

    @abstractmethod
    def claim(
        self, owner: str, root_key: str, segments: Seq[tuple[int, int, int]], ttl: float
    ) -> ClaimResult:
        """Lease ``(node, start, stop)`` segments of ``root_key``'s tree to ``owner`` for
        ``ttl`` seconds, all or none (empty segments are skipped).

        Returns:
            The granted leases, or (nothing granted) the live leases of other owners
            that overlap a segment. Expired leases are deleted on the way.
        """

    @abstractmethod
    def claim_study(self, owner: str, study: str, ttl: float) -> ClaimResult:
        """Lease study ``study`` to ``owner`` (renewed when it already holds it), unless
        another owner holds a live lease on it (returned as the conflict)."""

    @abstractmethod
    def renew(self, owner: str, ttl: float) -> int:
        """Extend every lease of ``owner`` to expire ``ttl`` seconds from now; returns
        how many it holds."""

    @abstractmethod
    def release(self, owner: str, lease_ids: Collection[int] | None = None) -> int:
        """Drop leases of ``owner`` (the given ids, or all); returns how many."""

    @abstractmethod
    def leases(self, scope: str | None = None, live_only: bool = True) -> list[Lease]:
        """Leases (of one root key or study name, or all), by id; only unexpired ones
        with ``live_only``."""

    # -- change feed ---------------------------------------------------------------------

    @abstractmethod
    def revision(self) -> int:
        """A counter that every change of the plan increases (every write transaction
        but a lease renewal), for readers that poll for changes (the dashboard). 0 on a
        storage that has never been written by a stagetree that keeps it."""

    def writes_here(self) -> int:
        """A counter that every change of the plan made through this handle increases
        (as :meth:`revision` counts them), read without I/O: whether what a reader of
        this process read is still what it wrote on (a resumed run's replay, answered
        from one read of its trials, until the run writes)."""
        return self.revision()

    @abstractmethod
    def record_activity(self, items: Iterable[Mapping[str, Any]]) -> None:
        """Append activity records (the fields of :class:`ActivityRecord` but ``seq``;
        ``node``, ``step``, ``seconds`` and ``data`` optional) in one transaction.

        Raises:
            ValueError: an unknown ``kind``.
        """

    @abstractmethod
    def activity(
        self, after: int = 0, root_keys: Collection[str] | None = None
    ) -> list[ActivityRecord]:
        """Activity records with ``seq > after`` (of the given trees), in order."""

    # -- life cycle ----------------------------------------------------------------------

    @abstractmethod
    def close(self) -> None:
        """Release connections; the storage must not be used afterwards."""

    def __enter__(self) -> BasePlanStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
