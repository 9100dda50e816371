"""A fake :class:`~stagetree.tuners.TrialRunner` for tuner tests.

Metrics follow a deterministic synthetic learning curve of (config, hp values, steps):
``acc(s) = s / (s + 5) * mean_{i < s} q_i`` with per-step quality
``q_i = 1 - (x(i) - 0.7)**2 - config.get("penalty", 0)``; ``loss = 1 - acc``. With
constant sequences, trials rank the same at every step (the "easy" case).

Completion order is random (seeded by ``order_seed``): each submission waits a random
number of ``asyncio.sleep(0)`` rounds plus one per newly trained step. Resumption and
prefix sharing are modelled like the plan does: a submission trains only the steps
that no earlier submission with the same config and the same hp values already
covered (``trained_steps`` counts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
from collections.abc import Callable
from typing import Any

from stagetree.exceptions import TrialFailedError
from stagetree.hp import dumps_hp
from stagetree.tuners import TrialResult, Tuner

Predicate = Callable[[dict[str, Any], dict[str, Any]], bool]


def quality(config: dict[str, Any], values: dict[str, Any]) -> float:
    """Per-step quality of a trial whose sequences have ``values`` at that step."""
    x = float(values.get("x", 0.7))
    return 1.0 - (x - 0.7) ** 2 - float(config.get("penalty", 0.0))


def curve(config: dict[str, Any], hp: dict[str, Any], steps: int) -> float:
    """Synthetic accuracy after ``steps`` steps."""
    if steps == 0:
        return 0.0
    names = sorted(hp)
    cols = [hp[n].values(0, steps) for n in names]
    rows = [dict(zip(names, row)) for row in zip(*cols)] if names else [{}] * steps
    return steps / (steps + 5) * sum(quality(config, r) for r in rows) / steps


class FakeRunner:
    """Fake study: see the module doc.

    Args:
        workers: what ``num_workers()`` answers.
        order_seed: seeds the random delays, hence the completion order.
        jitter: the largest random delay, in event-loop rounds.
        log: durable log storage shared between "runs"; ``read_log`` returns what it
            held when this runner was created.
        nan_if: trials for which every metric is NaN.
        fail_if: trials whose submissions raise ``TrialFailedError``.
        metric_names: names of the two metrics reported (accuracy, loss).
    """

    def __init__(
        self,
        *,
        workers: int = 4,
        order_seed: int = 0,
        jitter: int = 20,
        log: list[dict[str, Any]] | None = None,
        nan_if: Predicate | None = None,
        fail_if: Predicate | None = None,
        metric_names: tuple[str, str] = ("acc", "loss"),
    ) -> None:
        self.workers = workers
        self.rng = random.Random(order_seed)
        self.jitter = jitter
        self.log: list[dict[str, Any]] = [] if log is None else log
        self._previous = [dict(r) for r in self.log]
        self.nan_if = nan_if
        self.fail_if = fail_if
        self.metric_names = metric_names
        self.calls: list[tuple[dict[str, Any], dict[str, Any], int]] = []
        self.trained_steps = 0
        self.completed = 0
        self.cancelled = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._paths: dict[str, list[list[tuple[Any, ...]]]] = {}
        self._evaluated: dict[tuple[str, str], set[int]] = {}

    # -- TrialRunner

    def num_workers(self) -> int:
        return self.workers

    def append_log(self, record: dict[str, Any]) -> None:
        self.log.append(json.loads(json.dumps(record)))

    def read_log(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._previous]

    def check(self, config: dict[str, Any], hp: dict[str, Any]) -> None:
        pass  # every trial fits a fake study

    def declare(self, trials: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        self.declared = len(trials)

    async def submit(self, config: dict[str, Any], hp: dict[str, Any], steps: int) -> TrialResult:
        self.calls.append((dict(config), dict(hp), steps))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            new = self._claim(config, hp, steps)
            for _ in range(self.rng.randint(0, self.jitter) + new):
                await asyncio.sleep(0)
            if self.fail_if is not None and self.fail_if(config, hp):
                raise TrialFailedError(f"fake failure of {config} {hp}")
            key = (json.dumps(config, sort_keys=True), dumps_hp(hp))
            seen = self._evaluated.setdefault(key, set())
            seen.add(steps)
            history = {s: self._metrics(config, hp, s) for s in sorted(seen) if s <= steps}
            self.completed += 1
            return TrialResult(dict(config), dict(hp), steps, history[steps], history)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    # -- helpers

    def _metrics(self, config: dict[str, Any], hp: dict[str, Any], steps: int) -> dict[str, float]:
        acc = curve(config, hp, steps)
        if self.nan_if is not None and self.nan_if(config, hp):
            acc = math.nan
        return {self.metric_names[0]: acc, self.metric_names[1]: 1.0 - acc}

    def _claim(self, config: dict[str, Any], hp: dict[str, Any], steps: int) -> int:
        """Steps this submission trains that no earlier one covered (plan sharing)."""
        names = sorted(hp)
        cols = [hp[n].values(0, steps) for n in names]
        path = list(zip(*cols)) if names else [()] * steps
        paths = self._paths.setdefault(json.dumps(config, sort_keys=True), [])
        shared = 0
        for other in paths:
            n = 0
            for a, b in zip(path, other):
                if a != b:
                    break
                n += 1
            shared = max(shared, n)
        paths.append(path)
        self.trained_steps += steps - shared
        return steps - shared


def decisions(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decision records of a log (everything but completions)."""
    return [r for r in log if r["event"] != "done"]


def kill_after(tuner: Tuner, runner: FakeRunner, completions: int) -> None:
    """Run ``tuner`` against ``runner`` and kill it (cancel its task) after
    ``completions`` results, as a study killed mid-run: the next run replays
    ``runner.log``."""

    async def run_until() -> None:
        task = asyncio.ensure_future(tuner.run(runner))
        while runner.completed < completions and not task.done():
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run_until())
