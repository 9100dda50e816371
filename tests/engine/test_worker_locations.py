"""Where the workers run is written into the meta of every study the engine serves
(``stagetree status`` shows it), once the workers report ready."""

from __future__ import annotations

import functools

from stagetree.executors.simulated import SimulatedExecutor, SimulatedTrainer
from stagetree.hp import Constant, MultiStep
from stagetree.plan import MemoryPlanStorage
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.tuners import GridSearch

WHERE = {0: "a (node 1)", 1: "b (node 2)"}


class PlacedExecutor(SimulatedExecutor):
    """Simulated workers that say they run on two cluster nodes."""

    def worker_locations(self) -> dict[int, str]:
        return dict(WHERE)


def test_every_study_served_records_where_the_workers_run() -> None:
    space = GridSpace(hp={"lr": [MultiStep(0.1, [3], 0.1), Constant(0.1)]}, fixed={})
    executor = functools.partial(PlacedExecutor, 2)
    storage = MemoryPlanStorage()
    with Study("sim", SimulatedTrainer, storage=storage, executor=executor) as study:
        assert study.tune(GridSearch(space, "accuracy", steps=6)) is not None
        metas = {s["name"]: s["meta"] for s in storage.studies()}
    assert metas["sim"]["workers"] == {str(w): where for w, where in WHERE.items()}
