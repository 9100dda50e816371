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
    """

    name: str = ""

    @abstractmethod
    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        """The chain of stages to run next (see the class contract)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CriticalPathPolicy(BasePolicy):
    """Hippo's policy: the longest remaining root-to-leaf path by estimated cost, whole.

    Consecutive stages on one worker need no checkpoint load, and starting the longest
    chain first shortens the end-to-end time of the study.
    """

    name = "critical_path"

    def choose(self, tree: StageTree, roots: Sequence[Stage]) -> list[Stage]:
        return critical_path(tree, roots)


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
