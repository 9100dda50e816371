"""A submission's result carries its learning curve (``TrialResult.history``): on the
memory plan it is read from the submission's end up the path's parent links, not found
again by the trial's sequences, and it is what ``metrics_along`` gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.hp import MultiStep
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.space import GridSpace
from stagetree.tuners import ASHA

# Trials that share their first steps: each curve runs over two plan nodes.
SPACE = GridSpace(
    {"lr": [MultiStep(0.05, [3], g) for g in (0.1, 0.5)] + [0.01]}, fixed={"seed": [0, 1]}
)


def _tune(storage: str) -> list[tuple[Any, ...]]:
    """ASHA over the grid (results at steps 1, 2, 4, 8); each result with the plan's
    ``metrics_along`` read afterwards for it."""
    tuner = ASHA(SPACE, "loss", mode="min", min_steps=1, max_steps=8, eta=2, seed=0, num_trials=6)
    with Study("curves", LinearTrainer, storage=storage, executor="simulated") as study:
        study.tune(tuner)
        rows = []
        with study.reading() as plan:
            for _tid, result in tuner.results:
                root = study.root_key(result.config, result.hp)
                along = plan.metrics_along(root, result.hp, result.steps)
                rows.append((result.history, along))
    return rows


def test_a_results_curve_is_read_from_its_end_on_the_memory_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    walks: list[int] = []
    along = MemoryPlanStorage.metrics_along

    def counted(self: MemoryPlanStorage, *args: Any) -> Any:
        walks.append(1)
        return along(self, *args)

    monkeypatch.setattr(MemoryPlanStorage, "metrics_along", counted)
    rows = _tune("memory://")
    assert len(walks) == len(rows)  # only this test's own reads afterwards
    for history, expected in rows:
        assert history == expected
        assert list(history) == sorted(history)
    assert max(len(history) for history, _ in rows) >= 3  # results at 1, 2 and 4 steps


def test_the_curve_is_the_same_on_sqlite(tmp_path: Path) -> None:
    memory = _tune("memory://")
    sqlite = _tune(f"sqlite:///{tmp_path}/plan.db")
    assert [h for h, _ in sqlite] == [h for h, _ in memory]
    for history, expected in sqlite:
        assert history == expected
