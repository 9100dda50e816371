"""Synchronous brackets: the engine behind grid, random, SHA, Hyperband and EarlyStop.

A bracket trains all its trials to its first rung's steps, waits for all of them,
keeps the best ``counts[k]`` (finite values only) and trains those to rung ``k``'s
steps, and so on. Several brackets run side by side in one coroutine, so a bracket
never waits for another one.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass, field

from stagetree.tuners.base import JobQueue, ReplayingRunner, Trial, Tuner

__all__ = ["BracketSpec", "SyncBracketTuner"]


@dataclass
class BracketSpec:
    """One synchronous bracket.

    Attributes:
        steps: steps of each rung, strictly increasing.
        counts: how many trials train at each rung (``counts[0] == len(trials)``;
            a later count larger than the survivors available keeps them all).
        trials: the trials of the bracket's first rung.
    """

    steps: list[int]
    counts: list[int]
    trials: list[Trial]


@dataclass
class _State:
    index: int
    spec: BracketSpec
    rung: int = 0
    outstanding: int = 0
    values: dict[int, float] = field(default_factory=dict)


class SyncBracketTuner(Tuner):
    """A tuner made of synchronous brackets (see the module doc).

    After ``run``, :attr:`rung_trials` holds, per bracket, the trial ids trained at
    each rung (in submission order).
    """

    rung_trials: list[list[list[int]]]

    @abstractmethod
    def _brackets(self) -> list[BracketSpec]:
        """Build the brackets (creating trials with ``_new_trial``)."""

    async def _search(self, ctx: ReplayingRunner) -> None:
        brackets = [_State(i, spec) for i, spec in enumerate(self._brackets())]
        self.rung_trials = [[[] for _ in b.spec.steps] for b in brackets]
        queue = JobQueue(ctx, self.max_concurrent)

        def launch(b: _State, trials: list[Trial]) -> None:
            b.values = {}
            b.outstanding = len(trials)
            event = "submit" if b.rung == 0 else "promote"
            for trial in trials:
                self.rung_trials[b.index][b.rung].append(trial.id)
                queue.push(trial, b.spec.steps[b.rung], event, b, bracket=b.index, rung=b.rung)

        for b in brackets:
            launch(b, b.spec.trials)
        while queue:
            job, b = await queue.next()
            b.values[job.trial.id] = self._observe(job)
            b.outstanding -= 1
            if b.outstanding == 0 and b.rung + 1 < len(b.spec.steps):
                ranked = [t for t in self._ranked(b.values) if b.values[t] > -math.inf]
                b.rung += 1
                survivors = ranked[: b.spec.counts[b.rung]]
                kept = set(survivors)
                for tid in b.values:
                    if tid not in kept:
                        self._prune(tid)  # the rung stopped it: tell the sampler
                launch(b, [self.trials[t] for t in survivors])
