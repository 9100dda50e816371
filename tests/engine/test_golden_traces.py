"""Golden decision traces: what the scheduler decides in a few whole simulated studies.

Each case runs ``simulate`` (the real study, engine, scheduler and tuner over the
virtual-time executor) and records every instruction the executor receives: the batch,
its worker, the virtual time, its segments, evaluation and checkpoint points, and the
live splits and aborts. The trace must equal the committed file under ``golden/``
exactly, so a change meant to make scheduling cheaper (not different) shows at once
which decision moved.

Regenerate (only for a change meant to alter decisions, with its reason in the commit):
``STAGETREE_UPDATE_GOLDEN=1 pytest tests/engine/test_golden_traces.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stagetree.distributions import Choice, LogUniform
from stagetree.executors.simulated import SimulatedExecutor
from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.space import GridSpace, RandomSpace
from stagetree.tools.simulate import simulate
from stagetree.tuners import ASHA, GridSearch, Hyperband, RandomSearch, Tuner
from stagetree.work import Abort, AddCheckpoint, RunBatch, RunFused

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("STAGETREE_UPDATE_GOLDEN") == "1"


def grid_space() -> GridSpace:
    """36 trials in 3 trees whose learning rates and batch sizes share prefixes."""
    return GridSpace(
        hp={
            "lr": [
                MultiStep(0.1, [6], 0.1),
                MultiStep(0.1, [9], 0.1),
                MultiStep(0.1, [6, 12], 0.1),
                Constant(0.1),
            ],
            "batch_size": [Constant(128), Piecewise([128, 256], [4]), Piecewise([128, 256], [10])],
        },
        fixed={"wd": [1e-4, 1e-3, 1e-2]},
    )


def random_space() -> RandomSpace:
    """Drawn learning rates with milestones from a short list (so that trials share)."""
    return RandomSpace(
        hp={
            "lr": MultiStep(init=Choice([0.1, 0.05]), milestones=Choice([[6], [10], [6, 12]])),
            "batch_size": Choice([Constant(128), Piecewise([128, 256], [8])]),
        },
        fixed={"wd": LogUniform(1e-5, 1e-2)},
    )


def _grid() -> Tuner:
    return GridSearch(grid_space(), "acc", steps=16)


def _random() -> Tuner:
    return RandomSearch(random_space(), "acc", steps=16, num_trials=60, seed=3)


def _asha() -> Tuner:
    return ASHA(grid_space(), "acc", min_steps=2, max_steps=16, num_trials=36, eta=2, seed=1)


def _hyperband() -> Tuner:
    return Hyperband(grid_space(), "acc", min_steps=2, max_steps=16, num_trials=36, seed=2)


def _asha_random() -> Tuner:
    return ASHA(random_space(), "acc", min_steps=1, max_steps=16, num_trials=80, eta=2, seed=4)


CASES: dict[str, tuple[Callable[[], Any], int, str]] = {
    "grid_cp_w3": (_grid, 3, "critical_path"),
    "grid_bfs_w4": (_grid, 4, "bfs"),
    "grid_thr_w4": (_grid, 4, "thr"),
    "random_cp_w4": (_random, 4, "critical_path"),
    "random_bfs_w7": (_random, 7, "bfs"),
    "asha_cp_w3": (_asha, 3, "critical_path"),
    "asha_thr_w5": (_asha, 5, "thr"),
    "asha_cp_w8": (_asha, 8, "critical_path"),
    "asha_random_cp_w6": (_asha_random, 6, "critical_path"),
    "hyperband_cp_w4": (_hyperband, 4, "critical_path"),
    "hyperband_bfs_w2": (_hyperband, 2, "bfs"),
    # Two studies on one pool: fair share picks the study, the policy its chain.
    "two_studies_cp_w3": (lambda: [_grid(), _asha()], 3, "critical_path"),
}


def _record(ex: SimulatedExecutor, ins: Any) -> dict[str, Any]:
    at = ex.now
    if isinstance(ins, RunFused):
        return {"t": at, "fused": [_record(ex, m) for m in ins.members]}
    if isinstance(ins, RunBatch):
        return {
            "t": at,
            "run": ins.batch_id,
            "worker": ins.worker,
            "start": list(ins.start_at) if ins.start_at is not None else None,
            "segments": [[s.node, s.start, s.stop] for s in ins.segments],
            "evaluate": [list(k) for k in ins.evaluate_at],
            "checkpoint": [list(k) for k in ins.checkpoint_at],
        }
    if isinstance(ins, AddCheckpoint):
        return {
            "t": at,
            "split": ins.batch_id,
            "worker": ins.worker,
            "at": [ins.node, ins.step],
            "evaluate": ins.evaluate,
        }
    assert isinstance(ins, Abort)
    return {"t": at, "abort": ins.batch_id, "worker": ins.worker}


def trace(case: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run ``case`` and return its decisions and outcome."""
    make, workers, policy = CASES[case]
    # Slow checkpoint writes: batches stay saving, work waits for their checkpoints.
    options = {"save_latency": 1.5} if case.startswith("asha_random") else {}
    decisions: list[dict[str, Any]] = []
    submit = SimulatedExecutor.submit

    def recording(self: SimulatedExecutor, instruction: Any) -> None:
        decisions.append(_record(self, instruction))
        submit(self, instruction)

    monkeypatch.setattr(SimulatedExecutor, "submit", recording)
    result = simulate(None, make(), workers=workers, policy=policy, **options)
    return {
        "makespan": result.makespan,
        "steps_executed": result.steps_executed,
        "bests": [None if b is None else [b.steps, b.metrics] for b in result.bests],
        "decisions": decisions,
    }


def _dump(got: dict[str, Any]) -> str:
    """The trace as JSON, one decision per line (diffs show the decision that moved)."""
    head = {k: v for k, v in got.items() if k != "decisions"}
    lines = [json.dumps(d, sort_keys=True) for d in got["decisions"]]
    body = ",\n  ".join(lines)
    return f'{json.dumps(head, sort_keys=True)[:-1]}, "decisions": [\n  {body}\n]}}\n'


@pytest.mark.parametrize("case", sorted(CASES))
def test_decisions_match_golden_trace(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    got = json.loads(json.dumps(trace(case, monkeypatch)))
    path = GOLDEN / f"{case}.json"
    if UPDATE:
        path.write_text(_dump(got))
    want = json.loads(path.read_text())
    assert len(got["decisions"]) == len(want["decisions"])
    for i, (g, w) in enumerate(zip(got["decisions"], want["decisions"])):
        assert g == w, f"decision {i} differs"
    assert got == want
