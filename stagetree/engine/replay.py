"""What a resumed run's replay asks of the plan, read at once.

A study run again replays its tuner's log: every trial it submitted is submitted again,
and the storage answers each from what it holds (its metrics at its final step, its
learning curve, its checkpoint), one query per question and trial: minutes for a study
of 100,000 trials. :class:`ReplayAnswers` reads the study's finished trials once (their
final metrics with them, :meth:`~stagetree.plan.BasePlanStorage.trial_finals`) and, on
the first question about a plan tree, where its nodes hang (not their sequences:
:meth:`~stagetree.plan.BasePlanStorage.node_links`), its metrics and its checkpoints,
and answers the replay's questions about finished trials from them: the same answers,
since a finished trial's final metrics and its path never change.

The answers hold while this process writes nothing to the plan
(:meth:`~stagetree.plan.BasePlanStorage.writes_here`): once it trains (a trial the log
left unfinished), the engine asks the storage again, question by question.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stagetree._versions import study_meta
from stagetree.hp import Constant, Sequence, dumps_hp
from stagetree.plan.tree import curve_along, path_segments
from stagetree.records import TrialState
from stagetree.space import canonical_json

if TYPE_CHECKING:
    from stagetree.plan.base import BasePlanStorage, CheckpointRecord, TrialFinal
    from stagetree.plan.model import NodeLink

__all__ = ["ReplayAnswers", "trial_key"]


class ReplayAnswers:
    """The finished trials of one study version, for the questions of its replay.

    Args:
        storage: the plan.
        study: the study's name.
        version: its trainer version (trials of other versions are not answered).
    """

    def __init__(self, storage: BasePlanStorage, study: str, version: str) -> None:
        self.storage = storage
        self._mark = storage.writes_here()
        default = study_meta(storage, study).get("version")  # trial_version's rule
        self._done: dict[tuple[str, Any], TrialFinal] = {}
        for f in storage.trial_finals(study):
            if (
                f.state == TrialState.DONE
                and f.final is not None
                and f.node is not None
                and f.step == f.steps
                and f.attrs.get("version", default) == version
            ):
                self._done.setdefault(trial_key(f.config, f.hp), f)
        self._trees: dict[
            str, tuple[dict[int, NodeLink], dict[int, dict[int, dict[str, float]]]]
        ] = {}
        self._steps: dict[int, list[int]] = {}
        self._checkpoints: dict[str, dict[tuple[int, int], CheckpointRecord]] = {}

    @property
    def valid(self) -> bool:
        """Whether the plan is as read: nothing was written through this storage
        handle since (what another process writes meanwhile is not seen, as a run
        that read it a moment earlier would not have)."""
        return self.storage.writes_here() == self._mark

    def finished(
        self, config: dict[str, Any], hp: dict[str, Sequence], steps: int
    ) -> TrialFinal | None:
        """The finished trial ``(config, hp)`` whose final step is ``steps``, or None
        (not finished, other steps, unknown)."""
        found = self._done.get(trial_key(config, hp))
        return found if found is not None and found.steps == steps else None

    def curve(self, tree: str, trial: TrialFinal) -> dict[int, dict[str, float]] | None:
        """Every metric on a finished ``trial``'s path in ``tree`` up to its steps, by
        step (``metrics_along``'s answer), from one read of the tree; None when its
        path is not in what was read."""
        read = self._trees.get(tree)
        if read is None:
            links = self.storage.node_links(tree)  # no node's sequences decoded
            read = self._trees[tree] = (links, self.storage.metrics(tree))
        nodes, metrics = read
        assert trial.node is not None
        try:
            segments = path_segments(nodes, trial.node, trial.steps)
        except KeyError:
            return None
        return curve_along(segments, metrics, self._steps)

    def checkpoint(self, tree: str, node: int, step: int) -> CheckpointRecord | None:
        """The checkpoint at ``(node, step)`` of ``tree``, from one read of the tree's."""
        found = self._checkpoints.get(tree)
        if found is None:
            found = self._checkpoints[tree] = self.storage.checkpoints(tree)
        return found.get((node, step))


def trial_key(config: Mapping[str, Any], hp: Mapping[str, Sequence]) -> tuple[str, Any]:
    """A key of a trial that two trials share exactly when their identities in a study,
    ``(canonical config JSON, dumps_hp(hp))`` (the engine's ``trial_ids``), are equal:
    constants (what random and grid searches make) by their names, their values' types
    and their values, without writing their JSON (a replay asks about each of its
    trials three times); other sequences by ``dumps_hp``."""
    seqs = []
    for name in sorted(hp):
        seq = hp[name]
        if seq.__class__ is not Constant:
            return canonical_json(config), dumps_hp(hp)
        value = seq.value
        if value == 0 and value.__class__ is float:  # JSON tells -0.0 from 0.0
            value = repr(value)
        seqs.append((name, value.__class__, value))
    return canonical_json(config), tuple(seqs)
