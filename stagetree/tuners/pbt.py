"""Population based training without checkpoint copying, over the search space.

An exploit step does not copy the donor's checkpoint: it creates a new trial whose
sequences equal the donor's before step ``t`` and follow a mutated schedule from ``t``
on (``Then(donor_seq, Shifted(new_schedule, t), at=t)``), with the donor's fixed
config. The search plan sees that the new trial shares steps ``< t`` with the donor and
starts it from the donor's model at ``t`` by itself. Mutations follow the space's
distributions (:mod:`stagetree.tuners._mutations`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

from stagetree.distributions import Choice
from stagetree.exceptions import TunerError
from stagetree.hp import Constant, Shifted, Then
from stagetree.tuners._mutations import (
    Mutation,
    as_distribution,
    check_within,
    mutation_of,
    space_entries,
)
from stagetree.tuners.base import JobQueue, ReplayingRunner, Trial, Tuner, check_int, draw_specs

__all__ = ["PBT"]

# An exploit that drew the donor's own schedules again is drawn again, this many times.
_REDRAWS = 10


def _number_in(name: str, value: Any, interval: str) -> float:
    """``value`` as a float in ``interval`` (``"(0, 1)"``, ``"[0, 1]"``, ``"(0, 0.5]"``),
    else :class:`TunerError` naming the argument."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        ok = (lo <= value if interval[0] == "[" else lo < value) and (
            value <= hi if interval[-1] == "]" else value < hi
        )
    if not ok:
        raise TunerError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


class PBT(Tuner):
    """Population based training in synchronous generations, mutating within the space.

    ``population`` trials train to ``interval`` steps; then, every ``interval`` steps
    until ``steps``: members are ranked by value; the bottom ``quantile`` (at least one,
    at most half the population; plus every member that failed or reported a
    non-finite value) is replaced by an exploit of a donor drawn uniformly from the top
    ``quantile`` (finite values only). All members then train to the next multiple of
    ``interval`` (or ``steps``).

    An exploit is a new trial with the donor's config and sequences before step ``t``;
    from ``t`` on, each mutated sequence continues with a new draw, as Ray Tune's
    ``hyperparam_mutations`` do: with probability ``resample_probability`` drawn afresh
    from its distribution, otherwise perturbed within it: ``Uniform`` by ``±perturb``
    of its width, ``LogUniform`` by the factor ``1 ± perturb``, ``IntUniform`` by
    ``±max(1, round(perturb * width))`` (ints stay ints), clipped to the bounds; a
    ``Choice`` moves to a neighbouring option. A sequence template
    (``MultiStep(init=LogUniform(1e-3, 0.1), milestones=Choice(...))``) has its drawn
    arguments perturbed (or is drawn again) and the schedule built from them continues
    in the trial's step numbering (``Then(donor, Shifted(schedule, t), t)``): the
    donor's ``MultiStep(0.1, [30, 60])`` exploited at 40 with ``init * 1.2`` continues
    as ``MultiStep(0.12, [30, 60])`` from 40 on, its decay at 60 included.

    The distribution of each sequence comes from the space: a ``RandomSpace`` entry
    (distribution or template; plain sequences are not mutated), a ``GridSpace`` entry
    (a choice among its options). ``mutations={name: distribution}`` overrides it (a
    list means a ``Choice``); it must stay within the space's entry. With a list of
    ``TrialSpec`` as the space, ``mutations`` is the only source. ``hp_to_mutate``
    restricts mutation to those names (default: every sequence with a distribution).

    ``sampler``: an Optuna sampler that proposes the initial population instead of
    ``space.sample`` (:mod:`stagetree.tuners.optuna_bridge`); it is told each member's
    result (``PRUNED`` when an exploit replaces it, ``COMPLETE`` at ``steps``).
    Exploited trials come from mutation, not from the sampler.

    Members that failed are dropped when there is no donor. Generations are
    synchronous, so decisions do not depend on completion order.

    ``synchronous=False``: asynchronous exploitation, per member as in the PBT paper
    and Ray Tune's ``PopulationBasedTraining``: each member, as soon as it finishes an
    interval, is ranked by its latest value among the members that have reported one;
    in the bottom ``quantile`` (or failed, or non-finite), it is replaced by an exploit
    of a donor drawn from the top ``quantile`` *at the donor's latest reported step*
    (the new trial shares the donor's steps up to there); otherwise it trains on. No
    member waits for the slowest one, and decisions depend on completion order. On a grid, the
    population is taken in an order shuffled by ``seed``. After ``run``,
    :attr:`exploits` lists ``{"trial", "donor", "replaces", "step", "mutations"}``
    dicts (tuner trial ids; ``mutations``: name -> ``"perturb"`` | ``"resample"``); a
    study's trials carry the same lineage with storage ids (``TrialRecord.lineage``).

    Raises:
        TunerError: in the constructor, for bad arguments; for ``mutations`` or
            ``hp_to_mutate`` naming a fixed hyper-parameter (config), a name not in the
            space, or a distribution that reaches outside the space's entry; when
            nothing can be mutated.
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
        resample_probability: float = 0.25,
        mutations: Mapping[str, Any] | None = None,
        seed: int = 0,
        hp_to_mutate: Iterable[str] | None = None,
        max_concurrent: int | None = None,
        sampler: Any = None,
        synchronous: bool = True,
    ) -> None:
        super().__init__(metric, mode, seed, max_concurrent)
        if not isinstance(synchronous, bool):
            raise TunerError(f"synchronous must be a bool, got {synchronous!r}")
        self.synchronous = synchronous
        self.space = space
        self._use_sampler(sampler, space)
        self.population = check_int("population", population, 2)
        self.interval = check_int("interval", interval, 1)
        self.steps = check_int("steps", steps, 1)
        self.perturb = _number_in("perturb", perturb, "(0, 1)")
        self.quantile = _number_in("quantile", quantile, "(0, 0.5]")
        self.resample_probability = _number_in(
            "resample_probability", resample_probability, "[0, 1]"
        )
        if isinstance(hp_to_mutate, str):
            hp_to_mutate = [hp_to_mutate]
        self.hp_to_mutate = None if hp_to_mutate is None else sorted(set(hp_to_mutate))
        self.mutations = self._plan_mutations(space, mutations, self.hp_to_mutate)
        self.exploits: list[dict[str, Any]] = []
        self._sources: dict[int, dict[str, Any]] = {}

    @staticmethod
    def _plan_mutations(
        space: Any, mutations: Mapping[str, Any] | None, only: list[str] | None
    ) -> dict[str, Mutation]:
        """The mutation of each sequence to mutate, checked against the space."""
        entries, fixed = space_entries(space)
        known = "" if entries is None else f" (the space's sequences: {sorted(entries)})"

        def check_name(arg: str, name: Any) -> None:
            if not isinstance(name, str):
                raise TunerError(f"{arg} names must be str, got {name!r}")
            if name in fixed:
                raise TunerError(
                    f"{arg} names {name!r}, a fixed hyper-parameter (config): an exploit "
                    "continues the donor's model, so PBT mutates only sequences (hp)"
                )
            if entries is not None and name not in entries:
                raise TunerError(f"{arg} names {name!r}, not a sequence of the space{known}")

        plan: dict[str, Mutation] = {}
        for name, entry in (entries or {}).items():
            found = mutation_of(name, entry)
            if found is not None:
                plan[name] = found
        if mutations is not None:
            if not isinstance(mutations, Mapping):
                raise TunerError(
                    f"mutations must be a dict of name -> distribution, got {mutations!r}"
                )
            for name, value in mutations.items():
                check_name("mutations", name)
                dist = as_distribution(name, value)
                if entries is not None:
                    entry = entries[name]
                    check_within(name, dist, Choice(entry) if isinstance(entry, list) else entry)
                plan[name] = Mutation(name, dist)
        if only is not None:
            for name in only:
                check_name("hp_to_mutate", name)
                if name not in plan:
                    what = "" if entries is None else f": the space fixes it to {entries[name]!r}"
                    raise TunerError(
                        f"hp_to_mutate names {name!r}, which has no distribution to mutate "
                        f"within{what}; give one with mutations={{{name!r}: ...}}"
                    )
            plan = {name: plan[name] for name in only}
        if not plan:
            raise TunerError(
                "PBT has nothing to mutate: no sequence of the space has a distribution"
                f"{known}; give mutations={{name: distribution}}"
            )
        return dict(sorted(plan.items()))

    @property
    def horizon(self) -> int:
        return self.steps

    def _explore(
        self, donor: Trial, t: int, rng: random.Random
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
        """The donor's sequences continued from step ``t`` with mutated schedules; also
        the schedules the new trial follows from ``t`` (by name) and how each was
        mutated (``"perturb"`` or ``"resample"``)."""

        for _ in range(_REDRAWS):
            hp = dict(donor.hp)
            sources = dict(self._sources[donor.id])
            how: dict[str, str] = {}
            for name, mutation in self.mutations.items():
                resample = rng.random() < self.resample_probability
                new = mutation.move(sources[name], t, resample, self.perturb, rng)
                how[name] = "resample" if resample else "perturb"
                if new == sources[name]:
                    continue  # the same schedule (a clipped move): the donor's sequence
                sources[name] = new
                tail = new if isinstance(new, Constant) else Shifted(new, t)
                hp[name] = Then(donor.hp[name], tail, t)
            if hp != donor.hp:
                break
        return hp, sources, how

    async def _search(self, ctx: ReplayingRunner) -> None:
        rng = random.Random(self.seed)
        specs = draw_specs(
            self.space, self.population, self.seed, shuffle_grid=True, sampler=self._bridge
        )
        if len(specs) < 2:
            raise TunerError(f"population needs at least 2 trials, the space gave {len(specs)}")
        missing = sorted(set(self.mutations) - set(specs[0].hp))
        if missing:
            raise TunerError(
                f"mutations name {missing}, not sequences of the trials: {sorted(specs[0].hp)}"
            )
        members: list[Trial] = [self._new_trial(s.config, s.hp) for s in specs]
        # the schedule each member follows for each mutated name (since its last exploit)
        self._sources = {m.id: {n: m.hp[n] for n in self.mutations} for m in members}
        self.exploits = []
        if not self.synchronous:
            await self._search_async(ctx, members, rng)
            return
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

    async def _search_async(
        self, ctx: ReplayingRunner, members: list[Trial], rng: random.Random
    ) -> None:
        """Per-member exploitation (see the class doc): slot ``i`` holds a member and,
        once it reported, its latest ``(value, step)``."""
        slots = dict(enumerate(members))
        latest: dict[int, tuple[float, int]] = {}
        queue = JobQueue(ctx, self.max_concurrent)
        for i, member in slots.items():
            queue.push(member, min(self.interval, self.steps), "submit", i)
        while queue:
            job, i = await queue.next()
            value = self._observe(job)
            t = job.steps
            latest[i] = (value, t)
            if t >= self.steps and job.status == "ok":
                continue  # finished: it still ranks among the others
            n = len(latest)
            order = sorted(latest, key=lambda j: (-latest[j][0], slots[j].id))
            nq = max(1, min(n // 2, math.ceil(n * self.quantile)))
            # a finished donor would give a trial with nothing left to train
            donors = [
                j
                for j in order[:nq]
                if j != i and latest[j][0] > -math.inf and latest[j][1] < self.steps
            ]
            bottom = value == -math.inf or (n > 1 and i in order[n - nq :])
            if not bottom:
                queue.push(slots[i], min(t + self.interval, self.steps), "continue", i)
                continue
            if not donors:
                if job.status != "ok":  # failed, nothing to take over: dropped
                    del latest[i]
                    self._prune(slots[i].id)
                else:
                    queue.push(slots[i], min(t + self.interval, self.steps), "continue", i)
                continue
            d = donors[rng.randrange(len(donors))]
            at = latest[d][1]
            new = slots[i] = self._replace(ctx, slots[d], slots[i], at, rng)
            del latest[i]  # the new member ranks once it reports
            queue.push(new, min(at + self.interval, self.steps), "submit", i)

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
        is_donor = set(donors)
        rank = {i: r for r, i in enumerate(order)}
        bottom = set(order[n - nq :]) | {i for i in range(n) if values[i] == -math.inf}
        out: list[Trial | None] = list(members)
        for i in sorted(bottom, key=rank.__getitem__):
            if i in is_donor:
                continue
            if not donors:
                if i in failed:
                    out[i] = None
                    self._prune(members[i].id)
                continue
            donor = members[donors[rng.randrange(len(donors))]]
            out[i] = self._replace(ctx, donor, members[i], t, rng)
        return [m for m in out if m is not None]

    def _replace(
        self, ctx: ReplayingRunner, donor: Trial, old: Trial, t: int, rng: random.Random
    ) -> Trial:
        """An exploit of ``donor`` at step ``t`` that replaces ``old`` (recorded; ``old``
        is stopped before the end and the sampler told)."""
        hp, sources, how = self._explore(donor, t, rng)
        new = self._new_trial(donor.config, hp)
        self._sources[new.id] = sources
        info = {"trial": new.id, "donor": donor.id, "replaces": old.id, "step": t}
        ctx.record("exploit", **info)
        self.exploits.append({**info, "mutations": how})
        self._prune(old.id)
        return new
