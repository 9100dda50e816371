"""Population based training without checkpoint copying.

An exploit step does not copy the donor's checkpoint: it creates a new trial whose
sequences equal the donor's before step ``t`` and are perturbed from ``t`` on
(``Then(donor_seq, Constant(value * factor), at=t)``), with the donor's fixed config.
The search plan sees that the new trial shares steps ``< t`` with the donor and starts
it from the donor's model at ``t`` by itself.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

from stagetree.exceptions import TunerError
from stagetree.tuners.base import JobQueue, ReplayingRunner, Trial, Tuner, check_int, draw_specs

__all__ = ["PBT"]


class PBT(Tuner):
    """Population based training in synchronous generations.

    ``population`` trials train to ``interval`` steps; then, every ``interval`` steps
    until ``steps``: members are ranked by value; the bottom ``quantile`` (at least one,
    at most half the population; plus every member that failed or reported a
    non-finite value) is replaced by an exploit of a donor drawn uniformly from the top
    ``quantile`` (finite values only). The new trial copies the donor's config and
    sequences and, for each name in ``hp_to_mutate`` (default: every sequence whose
    value at ``t`` is a number), continues from step ``t`` with the constant
    ``donor_seq(t) * factor``, ``factor`` drawn from ``(1 - perturb, 1 + perturb)``
    (int values are rounded). Non-numeric sequences are copied unchanged. All members
    then train to the next multiple of ``interval`` (or ``steps``).

    Members that failed are dropped when there is no donor. Generations are
    synchronous, so decisions do not depend on completion order. On a grid, the
    population is taken in an order shuffled by ``seed``. After ``run``,
    :attr:`exploits` lists ``{"trial", "donor", "replaces", "step", "factors"}`` dicts.
    """

    def __init__(
        self,
        space: Any,
        metric: str,
        mode: str = "max",
        *,
        population: int,
        interval: int,
        steps: int,
        perturb: float = 0.2,
        quantile: float = 0.25,
        seed: int = 0,
        hp_to_mutate: Iterable[str] | None = None,
        max_concurrent: int | None = None,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        self.space = space
        self.population = check_int("population", population, 2)
        self.interval = check_int("interval", interval, 1)
        self.steps = check_int("steps", steps, 1)
        if (
            isinstance(perturb, bool)
            or not isinstance(perturb, (int, float))
            or not 0 < perturb < 1
        ):
            raise TunerError(f"perturb must be a number in (0, 1), got {perturb!r}")
        if (
            isinstance(quantile, bool)
            or not isinstance(quantile, (int, float))
            or not 0 < quantile <= 0.5
        ):
            raise TunerError(f"quantile must be a number in (0, 0.5], got {quantile!r}")
        self.perturb = float(perturb)
        self.quantile = float(quantile)
        if isinstance(hp_to_mutate, str):
            hp_to_mutate = [hp_to_mutate]
        self.hp_to_mutate = None if hp_to_mutate is None else sorted(set(hp_to_mutate))
        self.exploits: list[dict[str, Any]] = []

    @property
    def horizon(self) -> int:
        return self.steps

    def _explore(
        self, hp: Mapping[str, Any], t: int, rng: random.Random
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """The donor's sequences, perturbed from step ``t`` on; also the factors drawn."""
        from stagetree.hp import Constant, Then

        out = dict(hp)
        factors: dict[str, float] = {}
        for name in self.hp_to_mutate if self.hp_to_mutate is not None else sorted(hp):
            if name not in hp:
                raise TunerError(
                    f"hp_to_mutate names {name!r}, not a sequence of the trial: {sorted(hp)}"
                )
            value = hp[name](t)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                if self.hp_to_mutate is not None:
                    raise TunerError(
                        f"hp_to_mutate names {name!r}, whose value {value!r} is not a number"
                    )
                continue
            factor = rng.choice((1.0 - self.perturb, 1.0 + self.perturb))
            new: int | float = round(value * factor) if isinstance(value, int) else value * factor
            out[name] = Then(hp[name], Constant(new), t)
            factors[name] = factor
        return out, factors

    async def _search(self, ctx: ReplayingRunner) -> None:
        rng = random.Random(self.seed)
        specs = draw_specs(self.space, self.population, self.seed, shuffle_grid=True)
        if len(specs) < 2:
            raise TunerError(f"population needs at least 2 trials, the space gave {len(specs)}")
        members: list[Trial] = [self._new_trial(s.config, s.hp) for s in specs]
        self.exploits = []
        started: set[int] = set()
        t = 0
        while members:
            target = min(t + self.interval, self.steps)
            queue = JobQueue(ctx, self.max_concurrent)
            for i, member in enumerate(members):
                event = "continue" if member.id in started else "submit"
                queue.push(member, target, event, i)
                started.add(member.id)
            values = [-math.inf] * len(members)
            failed: set[int] = set()
            while queue:
                job, i = await queue.next()
                values[i] = self._observe(job)
                if job.status != "ok":
                    failed.add(i)
            t = target
            if t >= self.steps:
                return
            members = self._exploit(ctx, members, values, failed, t, rng)

    def _exploit(
        self,
        ctx: ReplayingRunner,
        members: list[Trial],
        values: list[float],
        failed: set[int],
        t: int,
        rng: random.Random,
    ) -> list[Trial]:
        n = len(members)
        order = sorted(range(n), key=lambda i: (-values[i], members[i].id))
        nq = max(1, min(n // 2, math.ceil(n * self.quantile)))
        donors = [i for i in order[:nq] if values[i] > -math.inf]
        bottom = set(order[n - nq :]) | {i for i in range(n) if values[i] == -math.inf}
        out: list[Trial | None] = list(members)
        for i in sorted(bottom, key=order.index):
            if i in donors:
                continue
            if not donors:
                if i in failed:
                    out[i] = None
                continue
            donor = members[donors[rng.randrange(len(donors))]]
            hp, factors = self._explore(donor.hp, t, rng)
            new = self._new_trial(donor.config, hp)
            info = {"trial": new.id, "donor": donor.id, "replaces": members[i].id, "step": t}
            ctx.record("exploit", **info)
            self.exploits.append({**info, "factors": factors})
            out[i] = new
        return [m for m in out if m is not None]
