"""Which part of the stage tree an idle worker runs next."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from stagetree.stages import Stage, StageTree, critical_path

__all__ = [
    "BFSPolicy",
    "BasePolicy",
    "CriticalPathPolicy",
    "ThroughputPolicy",
    "make_policy",
]


class BasePolicy(ABC):
    """Chooses the next batch for an idle worker.

    Contract:

    * :meth:`choose` gets the freshly built stage tree and its *ready* roots (those that
      start fresh or from a durable checkpoint; never empty) and returns a chain of
      stages: the first is one of ``roots``, each next one a child of the previous.
      The scheduler runs the chain as one ``RunBatch`` on one worker, evaluating at
      every request point on it and checkpointing at its end, at branch points where
      other stages continue, and at request points.
    * It must not mutate the tree, and must keep no state about stage trees between
      calls (a policy may keep configuration, e.g. a tie-breaking seed): the scheduler
      keeps the stages of plan trees whose inputs did not change from one decision to
      the next, so the same stage objects come back with their costs updated.
    * It must be deterministic given the tree.

    When several studies have ready work, ``tree`` and ``roots`` are a view of one
    study's part of the tree (the stages its requests need; see
    :class:`~stagetree.scheduler.Scheduler`); the scheduler maps the chain back.

    ``workers``: the number of workers the scheduler knows, set by it before its
    decisions (None outside a scheduler); a policy may read it and must not set it.
    """

    name: str = ""
    workers: int | None = None

    @abstractmethod
    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        """The chain of stages to run next (see the class contract)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# The remaining work is bound by the tree's depth rather than by the workers (see
# CriticalPathPolicy) once the longest remaining path times the workers exceeds this
# share of the remaining work.
_DEPTH_BOUND_SHARE = 0.5


class CriticalPathPolicy(BasePolicy):
    """Hippo's policy: the longest remaining root-to-leaf path by estimated cost, whole
    while the study is bound by its work, up to its first branch point once it is bound
    by the tree's depth.

    Consecutive stages on one worker need no checkpoint load, and starting the longest
    chain first shortens the end-to-end time of the study. With few workers for the
    work left (the longest remaining path times the workers is below half the remaining
    work), the whole path is one batch: the workers are busy anyway, and every stage
    that stays on its worker saves a checkpoint load. With many (deep trees, the end of
    a study), the path stops at its first branch point and the worker chooses again
    there: a worker committed to a long path through several branch points can no
    longer take a branch that became critical elsewhere, and such a branch then waits
    for a worker to finish its whole path (measured in ``benchmarks/scheduler_compare.py
    --matrix``; the worker usually goes on from the model it holds, without a load).
    """

    name = "critical_path"

    def may_cut(self, path: Sequence[Stage]) -> bool:
        """Whether :meth:`choose` may stop ``path`` (the longest path) short of its end:
        it passes a branch point and more than one worker could take what it leaves."""
        workers = self.workers
        # One worker gains nothing from choosing again: no other takes what it leaves.
        if workers is None or workers < 2:
            return False
        return any(len(s.children) > 1 for s in path[:-1])

    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        path = critical_path(tree, roots)
        if not self.may_cut(path):
            return path
        longest, other, work = self._paths(tree, path[0])
        got = self.cut(path, longest, other, work)
        assert got is not None  # exact inputs: the rule always tells
        return got

    def cut(
        self, path: list[Stage], longest: float, other: float, work: float, slack: float = 0.0
    ) -> list[Stage] | None:
        """``path`` (the longest path, whose stages :meth:`may_cut`) as this policy runs
        it: whole, or up to the branch point where the depth-bound rule stops it.

        Args:
            path: the longest path, with its stages' costs current.
            longest: the longest remaining path of the tree by cost (ready and waiting
                roots), as :meth:`_paths` computes it.
            other: the longest from another root than ``path[0]`` (0.0: none).
            work: the tree's remaining work (the sum of every stage's cost).
            slack: a bound on how far ``work`` may be from that sum as :meth:`_paths`
                adds it up (a sum kept another way rounds differently).

        Returns:
            The chain to run; None when ``work`` is within ``slack`` of the point where
            the rule changes its answer (the caller then asks :meth:`choose` on the
            whole tree).
        """
        workers = self.workers or 1
        bound = longest * workers
        half = _DEPTH_BOUND_SHARE * work
        if slack and abs(bound - half) <= _DEPTH_BOUND_SHARE * slack:
            return None
        if bound <= half:
            return path  # bound by the work: keep the model on the worker
        # Stop at the first branch point after which another root's path is longer than
        # what is left of this one: that root may still wait for a worker by then.
        left = sum(s.cost for s in path)
        for i, stage in enumerate(path[:-1]):
            left -= stage.cost
            if len(stage.children) > 1 and left < other:
                return path[: i + 1]
        return path

    @staticmethod
    def _paths(tree: StageTree, root: Stage) -> tuple[float, float, float]:
        """The longest remaining path of ``tree`` (ready and waiting work), the longest
        from another root than ``root``, and the remaining work."""
        below: dict[int, float] = {}  # the longest path from each stage down
        work = longest = other = 0.0
        for stage in reversed(tree.stages):  # children before parents
            length = stage.cost + max((below[id(c)] for c in stage.children), default=0.0)
            below[id(stage)] = length
            work += stage.cost
            if stage.parent is None:
                longest = max(longest, length)
                if stage is not root:
                    other = max(other, length)
        return longest, other, work


class BFSPolicy(BasePolicy):
    """Breadth first: one stage at a time, the ready root that starts earliest (then the
    tree's root order). A baseline for comparison."""

    name = "bfs"

    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        best = min(range(len(roots)), key=lambda i: (roots[i].start, i))
        return [roots[best]]


class ThroughputPolicy(BasePolicy):
    """Most children first (THR): one stage at a time, the ready root whose end unlocks
    the most stages (then the most requests below it). A baseline for comparison."""

    name = "thr"

    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        best = max(
            range(len(roots)),
            key=lambda i: (len(roots[i].children), roots[i].requests_below(), -i),
        )
        return [roots[best]]


_POLICIES: dict[str, type[BasePolicy]] = {
    p.name: p for p in (CriticalPathPolicy, BFSPolicy, ThroughputPolicy)
}


def make_policy(policy: str | BasePolicy) -> BasePolicy:
    """A policy instance from a name (``critical_path``, ``bfs``, ``thr``) or as is.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(policy, BasePolicy):
        return policy
    try:
        return _POLICIES[policy]()
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {policy!r}; expected one of {sorted(_POLICIES)}"
        ) from None
