"""Learning curves: ``train()`` metrics at every step and ``evaluate()`` every
``eval_every`` steps, in the plan, on ``TrialRecord.metrics``, ``TrialResult.history``,
``export`` and the median stopping rule; exactness unchanged."""

from __future__ import annotations

import asyncio
import csv
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from stagetree import Study, Trainer
from stagetree.cli import export
from stagetree.exceptions import TrialFailedError
from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch, MedianStopping
from stagetree.tuners.base import TrialResult, draw_specs


class CurveTrainer(Trainer):
    """A counter with a known curve: ``train_loss = 1 / t`` after the t-th step, score
    ``lr``, and ``t`` (how many steps the evaluated model was trained)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.t = 0
        self.lr = 0.0

    def setup(self, hp: Mapping[str, Any]) -> None:
        self.lr = float(hp.get("lr", self.lr))

    def train(self) -> Any:
        self.t += 1
        bad = self.config.get("train_returns")
        if bad is not None:
            return [1.0] if bad == "list" else {"train_loss": "high"}
        return {"train_loss": 1.0 / self.t}

    def evaluate(self) -> dict[str, float]:
        return {"score": self.lr, "t": float(self.t)}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "lr": self.lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t, self.lr = int(state["t"]), float(state["lr"])


LRS = [Constant(1.0), MultiStep(1.0, [5], 0.5)]


def make(tmp_path: Path, eval_every: int | None, name: str = "curves", **kw: Any) -> Study:
    return Study(
        name,
        CurveTrainer,
        storage=f"sqlite:///{tmp_path}/plan-{eval_every}.db",
        executor="inline",
        eval_every=eval_every,
        **kw,
    )


@pytest.mark.parametrize(
    ("eval_every", "evaluated"),
    [(1, set(range(1, 10))), (3, {3, 6, 9}), (0, {9}), (None, {9})],
)
def test_grid_records_train_metrics_every_step_and_evaluates_every_eval_every(
    tmp_path: Path, eval_every: int | None, evaluated: set[int]
) -> None:
    steps = 9
    space = GridSpace({"lr": LRS})
    with make(tmp_path, eval_every) as study:
        best = study.tune(GridSearch(space, "score", steps=steps))
        assert best is not None
        records = study.trials()
        stats = study.stats()
        result = study.run({}, {"lr": LRS[1]}, steps)  # known: answered from the plan
    assert stats["steps_unique"] == 9 + 4
    assert len(records) == 2
    for rec in records:
        assert sorted(rec.metrics) == list(range(1, steps + 1))
        for s, m in rec.metrics.items():
            assert m["train_loss"] == 1.0 / s
            assert ("score" in m) == (s in evaluated), (s, m)
            if "t" in m:
                assert m["t"] == s  # evaluated after exactly s train() calls
        lr = rec.hp["lr"]
        assert rec.metrics[steps]["score"] == lr(steps - 1)
    for history in (best.history, result.history):
        assert sorted(history) == list(range(1, steps + 1))
        assert {s for s, m in history.items() if "score" in m} == evaluated
    # The result at the requested step holds train() metrics too, as the plan does.
    assert result.metrics == {"train_loss": 1.0 / steps, "score": 0.5, "t": 9.0}
    assert best.metrics == {"train_loss": 1.0 / steps, "score": 1.0, "t": 9.0}

    # export --history: one CSV row per (trial, step, metric).
    out = io.StringIO()
    export(f"sqlite:///{tmp_path}/plan-{eval_every}.db", "curves", "csv", out, history=True)
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    loss = [r for r in rows if r["metric"] == "train_loss"]
    assert len(loss) == 2 * steps
    for row in loss:
        assert float(row["value"]) == 1.0 / int(row["step"])
    for trial in {r["trial"] for r in rows}:
        scored = {int(r["step"]) for r in rows if r["trial"] == trial and r["metric"] == "score"}
        assert scored == evaluated


def test_only_evaluated_steps_answer_requests(tmp_path: Path) -> None:
    """A step with train() metrics only is on the curve but is no result: asking for it
    trains (from a checkpoint) and evaluates; an evaluated step answers at once."""
    with make(tmp_path, 3) as study:
        study.run({}, {"lr": LRS[0]}, 9)
        executed = study.stats()["steps_executed"]
        assert study.eval({}, {"lr": LRS[0]}, 4) is None
        assert study.eval({}, {"lr": LRS[0]}, 6) == {"train_loss": 1 / 6, "score": 1.0, "t": 6.0}
        six = study.run({}, {"lr": LRS[0]}, 6)
        assert study.stats()["steps_executed"] == executed  # answered from the curve
        assert six.metrics["t"] == 6.0
        four = study.run({}, {"lr": LRS[0]}, 4)
        assert four.metrics == {"train_loss": 0.25, "score": 1.0, "t": 4.0}


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        ("list", "train() must return None or a dict of numbers, got list"),
        ("text", "train() must return None or a dict of numbers; 'train_loss' is str"),
    ],
)
def test_train_returning_a_non_dict_fails_the_trial(
    tmp_path: Path, returns: str, message: str
) -> None:
    with make(tmp_path, 1) as study, pytest.raises(TrialFailedError) as info:
        study.run({"train_returns": returns}, {"lr": LRS[0]}, 3)
    assert "TypeError" in str(info.value) and message in str(info.value)


def test_train_returning_none_records_nothing(tmp_path: Path) -> None:
    class Quiet(CurveTrainer):
        def train(self) -> None:
            super().train()

    with Study("quiet", Quiet, storage="memory://", executor="inline", eval_every=0) as study:
        study.run({}, {"lr": LRS[0]}, 4)
        (rec,) = study.trials()
    assert sorted(rec.metrics) == [4]


def test_eval_every_is_checked(tmp_path: Path) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="eval_every"):
            Study("x", CurveTrainer, storage="memory://", eval_every=bad)  # type: ignore[arg-type]


class NoisyTrainer(CurveTrainer):
    """Trials ``k < 4`` score 0.9 with a dip to 0.3 at every 10th step; ``k == 4``
    scores 0.5 at every step (clearly worse on average)."""

    def evaluate(self) -> dict[str, float]:
        good = self.config["k"] < 4
        score = (0.3 if self.t % 10 == 0 else 0.9) if good else 0.5
        return {"score": score}


def _median_run(tmp_path: Path, eval_every: int) -> tuple[MedianStopping, list[int]]:
    space = GridSpace({"lr": [Constant(1.0)]}, fixed={"k": [0, 1, 2, 3, 4]})
    # One trial at a time; pick an order where the worse trial comes after the others.
    seed = next(
        s for s in range(100) if draw_specs(space, 5, s, shuffle_grid=True)[-1].config["k"] == 4
    )
    tuner = MedianStopping(
        space,
        "score",
        steps=20,
        num_trials=5,
        eval_every=10,
        min_samples=3,
        seed=seed,
        max_concurrent=1,
    )
    with Study(
        "median",
        NoisyTrainer,
        storage=f"sqlite:///{tmp_path}/median-{eval_every}.db",
        executor="inline",
        eval_every=eval_every,
    ) as study:
        study.tune(tuner)
        worse = [t.id for t in tuner.trials.values() if t.config["k"] == 4]
    return tuner, worse


def test_median_stopping_uses_the_per_step_curves(tmp_path: Path) -> None:
    # With curves, the good trials' running averages (0.9 at 9 of 10 steps) beat the
    # worse trial's 0.5: it stops at its first check, step 10 of 20.
    tuner, worse = _median_run(tmp_path, eval_every=1)
    assert tuner.stopped == [(worse[0], 10)]
    # Evaluated at chunk ends only, the good trials look like 0.3 there (their dip):
    # the worse trial is not found out.
    tuner, worse = _median_run(tmp_path, eval_every=0)
    assert tuner.stopped == []


@pytest.mark.slow
@pytest.mark.torch
def test_evaluating_every_step_changes_nothing_bit_for_bit(tmp_path: Path) -> None:
    """Real PyTorch (dropout, momentum, a mid-run batch-size change): the same trials
    with eval_every=1 and eval_every=0 end with identical weights, optimizer and RNG
    states, and identical metrics at the requested steps."""
    pytest.importorskip("torch")
    from test_exactness import assert_same_state

    from stagetree.torch.examples import DigitsTrainer

    config = {"hidden": 16, "dropout": 0.3, "optimizer": "momentum", "batches_per_step": 2}
    trials = [
        {"lr": Constant(0.05), "batch_size": Constant(32)},
        {"lr": MultiStep(0.05, [3], 0.1), "batch_size": Constant(32)},
        {"lr": MultiStep(0.05, [3], 0.1), "batch_size": Piecewise([32, 48], [4])},
    ]
    steps = 6
    runs = []
    for eval_every in (1, 0):
        with Study(
            f"exact-{eval_every}",
            DigitsTrainer,
            storage=f"sqlite:///{tmp_path}/torch-{eval_every}.db",
            workers=1,
            threads_per_worker=1,
            eval_every=eval_every,
        ) as study:

            async def main(study: Study = study) -> list[TrialResult]:
                return await asyncio.gather(*(study.submit(config, hp, steps) for hp in trials))

            results = asyncio.run(main())
            # stats() first: it waits for the batches' background checkpoint writes.
            assert study.stats()["steps_executed"] == 6 + 3 + 2  # shared as always
            states = [study.state(config, hp, steps) for hp in trials]
        runs.append((results, states))
    (every, every_states), (ends, end_states) = runs
    for i, (a, b) in enumerate(zip(every, ends)):
        assert a.metrics == b.metrics, f"trial {i}"
        assert set(a.history) == set(b.history) == set(range(1, steps + 1))
        for s in a.history:  # train() metrics agree at every step
            assert a.history[s]["train_loss"] == b.history[s]["train_loss"]
        assert all("accuracy" in m for m in a.history.values())
        assert [s for s, m in b.history.items() if "accuracy" in m] == [steps]
        assert every_states[i] is not None and end_states[i] is not None
        assert_same_state(every_states[i], end_states[i], f"trial{i}")


def _worker_events(tmp_path: Path, batch: Any, trainer: type[Trainer] = CurveTrainer) -> list[Any]:
    from stagetree.checkpoints import CheckpointStore
    from stagetree.executors.worker import Worker

    events: list[Any] = []
    worker = Worker(0, trainer, CheckpointStore(tmp_path / trainer.__name__), events.append)
    try:
        worker.run(batch)
    finally:
        worker.close()
    return events


def test_worker_sends_the_curve_before_the_metrics_and_the_terminal_event(
    tmp_path: Path,
) -> None:
    from stagetree.work import (
        BatchDone,
        BatchFailed,
        CheckpointSaved,
        CurveReported,
        MetricsReported,
        RunBatch,
        Segment,
    )

    def batch(config: Mapping[str, Any]) -> RunBatch:
        return RunBatch(
            1,
            0,
            "root",
            config,
            0,
            None,
            None,
            (Segment(1, 0, 3, {"lr": Constant(1.0)}), Segment(2, 3, 6, {"lr": Constant(0.5)})),
            evaluate_at=((1, 3), (2, 5)),
            checkpoint_at=((1, 3),),
            eval_every=2,
        )

    events = _worker_events(tmp_path, batch({}))
    kinds = [type(e) for e in events if not isinstance(e, CheckpointSaved)]
    assert kinds[-1] is BatchDone
    points = [p for e in events if isinstance(e, CurveReported) for p in e.points]
    # Canonical keys: steps 1..3 on node 1, 4..6 on node 2; evaluated at 2, 4, 6
    # (eval_every) and 3, 5 (requested).
    assert [(n, s, ev) for n, s, _m, ev in points] == [
        (1, 1, False),
        (1, 2, True),
        (1, 3, True),
        (2, 4, True),
        (2, 5, True),
        (2, 6, True),
    ]
    assert points[0][2] == {"train_loss": 1.0}
    assert points[4][2] == {"train_loss": 0.2, "score": 0.5, "t": 5.0}
    # Each requested point's curve reaches the plan before its MetricsReported.
    for key in ((1, 3), (2, 5)):
        (metrics_at,) = [
            i
            for i, e in enumerate(events)
            if isinstance(e, MetricsReported) and (e.node, e.step) == key
        ]
        curve_at = [
            i
            for i, e in enumerate(events)
            if isinstance(e, CurveReported) and any((n, s) == key for n, s, _m, _e in e.points)
        ]
        assert curve_at and curve_at[0] < metrics_at
        assert events[metrics_at].metrics == {"score": 1.0 if key[0] == 1 else 0.5, "t": key[1]}

    # A trainer failing after step 2: the curve up to there is sent before BatchFailed.
    class FailsAtThree(CurveTrainer):
        def train(self) -> Any:
            if self.t == 3:
                raise RuntimeError("boom")
            return super().train()

    events = _worker_events(tmp_path, batch({}), FailsAtThree)
    assert isinstance(events[-1], BatchFailed)
    points = [p[:2] for e in events if isinstance(e, CurveReported) for p in e.points]
    assert points == [(1, 1), (1, 2), (1, 3)]


def test_scheduler_passes_eval_every_and_never_resolves_a_request_from_a_curve() -> None:
    # The scheduler's test harness, from its own test folder.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
    from test_scheduler import CONST, Harness

    from stagetree.scheduler import RequestDone
    from stagetree.work import CheckpointSaved, CurveReported, MetricsReported, RunBatch

    with pytest.raises(ValueError, match="eval_every"):
        Harness(eval_every=-1)
    h = Harness(eval_every=3)
    (key, out) = h.trial(CONST, 10)
    (batch,) = [x for x in out if isinstance(x, RunBatch)]
    assert batch.eval_every == 3 and key in batch.evaluate_at
    # Even a curve point evaluated at the request's own key resolves nothing ...
    point = (key[0], key[1], {"score": 1.0}, True)
    assert h(CurveReported(batch.batch_id, 0, (point,))) == []
    # ... MetricsReported does, once the checkpoint promised there is durable.
    assert h(MetricsReported(batch.batch_id, 0, key[0], key[1], {"score": 1.0})) == []
    done = h(CheckpointSaved(batch.batch_id, 0, key[0], key[1], "ck", 1, 0.0))
    assert [x for x in done if isinstance(x, RequestDone)] == [
        RequestDone(key[0], key[1], {"score": 1.0})
    ]
