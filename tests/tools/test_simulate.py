"""The virtual-time simulator: the executor alone, driven through the real Study and
tuners, ``simulate()`` accounting and ``stagetree simulate``."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import pytest
from tiny_script import tiny_script

from stagetree.cli import main
from stagetree.exceptions import StagetreeError
from stagetree.executors import simulated
from stagetree.executors.simulated import (
    LearningCurve,
    SimulatedExecutor,
    SimulatedTrainer,
    StepCost,
    drive,
)
from stagetree.hp import Constant, MultiStep, Piecewise
from stagetree.plan import MemoryPlanStorage
from stagetree.space import GridSpace
from stagetree.study import Study
from stagetree.tools.simulate import SimResult, simulate
from stagetree.tuners import ASHA, GridSearch
from stagetree.work import (
    Abort,
    AddCheckpoint,
    BatchDone,
    BatchFailed,
    CheckpointSaved,
    MetricsReported,
    Progress,
    RunBatch,
    Segment,
    SplitMissed,
    WorkerReady,
)

HP = {"lr": Constant(0.1), "batch_size": Constant(128)}


def space() -> GridSpace:
    """12 trials in 2 trees whose sequences share prefixes."""
    return GridSpace(
        hp={
            "lr": [MultiStep(0.1, [6], 0.1), MultiStep(0.1, [9], 0.1), Constant(0.1)],
            "batch_size": [Constant(128), Piecewise([128, 256], [4])],
        },
        fixed={"wd": [1e-4, 1e-3]},
    )


def drain(ex: SimulatedExecutor) -> list[tuple[float, Any]]:
    """Every event with the virtual time it was delivered at."""
    out: list[tuple[float, Any]] = []
    while ex.pending:
        events = ex.events(timeout=None)
        out.extend((ex.now, e) for e in events)
    return out


def batch(
    bid: int = 1,
    worker: int = 0,
    start: int = 0,
    stop: int = 4,
    node: int = 1,
    ckpt: str | None = None,
    start_at: tuple[int, int] | None = None,
    evaluate: tuple[tuple[int, int], ...] = (),
    checkpoint: tuple[tuple[int, int], ...] = (),
) -> RunBatch:
    return RunBatch(
        batch_id=bid,
        worker=worker,
        root_key="root",
        config={"wd": 0.0},
        start_step=start,
        start_at=start_at,
        start_checkpoint=ckpt,
        segments=(Segment(node, start, stop, HP),),
        evaluate_at=evaluate,
        checkpoint_at=checkpoint,
    )


def executor(**kw: Any) -> SimulatedExecutor:
    kw.setdefault("step_cost", StepCost(2.0))
    kw.setdefault("save_latency", 0.5)
    kw.setdefault("save_bandwidth", 1e9)
    kw.setdefault("load_latency", 1.0)
    kw.setdefault("load_bandwidth", 1e9)
    kw.setdefault("checkpoint_bytes", 0)
    ex = SimulatedExecutor(2, **kw)
    ex.start()
    return ex


# --------------------------------------------------------------------------- executor


def test_batch_timeline_in_virtual_time() -> None:
    ex = executor()
    assert [e for _, e in drain(ex)] == [WorkerReady(0), WorkerReady(1)]
    ex.submit(batch(evaluate=((1, 2), (1, 4)), checkpoint=((1, 2), (1, 4))))
    timed = drain(ex)
    kinds = [(t, type(e).__name__, getattr(e, "step", None)) for t, e in timed]
    # 2 s per step; saves take 0.5 s in the background; BatchDone does not wait for the
    # last (its write ends after it, off the critical path).
    assert kinds == [
        (2.0, "Progress", 1),
        (4.0, "Progress", 2),
        (4.0, "MetricsReported", 2),
        (4.5, "CheckpointSaved", 2),
        (6.0, "Progress", 3),
        (8.0, "Progress", 4),
        (8.0, "MetricsReported", 4),
        (8.0, "BatchDone", None),
        (8.5, "CheckpointSaved", 4),
    ]
    done = timed[-2][1]
    assert isinstance(done, BatchDone)
    assert (done.steps, done.busy_seconds, done.load_seconds) == (4, 8.0, 0.0)
    assert ex.busy_seconds == [8.0, 0.0] and ex.now == 8.5 and ex.steps_trained == 4


def test_metrics_are_a_function_of_the_path() -> None:
    """Resuming from a checkpoint gives the metrics of an unbroken run, bit for bit, and
    they equal the curve folded from step 0."""
    ex = executor()
    drain(ex)
    ex.submit(batch(1, 0, 0, 3, checkpoint=((1, 3),)))
    ref = next(e.ref for _, e in drain(ex) if isinstance(e, CheckpointSaved))
    ex.submit(batch(2, 1, 3, 6, ckpt=ref, start_at=(1, 3), evaluate=((1, 6),)))
    events = [e for _, e in drain(ex)]
    resumed = next(e.metrics for e in events if isinstance(e, MetricsReported))
    assert next(e for e in events if isinstance(e, BatchDone)).load_seconds == 1.0
    ex.submit(batch(3, 0, 0, 6, evaluate=((1, 6),)))
    alone = next(e.metrics for _, e in drain(ex) if isinstance(e, MetricsReported))
    assert resumed == alone == LearningCurve().metrics_of({"wd": 0.0}, HP, 6)
    assert 0.0 < alone["accuracy"] < 1.0 and alone["loss"] == 1.0 - alone["accuracy"]


def test_worker_keeps_the_model_in_memory() -> None:
    ex = executor()
    drain(ex)
    ex.submit(batch(1, 0, 0, 3, checkpoint=((1, 3),)))
    ref = next(e.ref for _, e in drain(ex) if isinstance(e, CheckpointSaved))
    ex.submit(batch(2, 0, 3, 5, ckpt=ref, start_at=(1, 3)))  # same worker: no load
    ex.submit(batch(3, 1, 3, 5, ckpt=ref, start_at=(1, 3)))  # other worker: loads
    done = {e.batch_id: e for _, e in drain(ex) if isinstance(e, BatchDone)}
    assert (done[2].load_seconds, done[2].busy_seconds) == (0.0, 4.0)
    assert (done[3].load_seconds, done[3].busy_seconds) == (1.0, 5.0)


def test_live_split_ahead_is_honoured_behind_is_missed() -> None:
    ex = executor()
    drain(ex)
    ex.submit(batch(stop=10))
    ex.events()  # t = 2: step 1 done
    ex.events()  # t = 4: step 2 done
    ex.submit(AddCheckpoint(1, 0, 1, 6, evaluate=True))
    ex.submit(AddCheckpoint(1, 0, 1, 1))
    timed = drain(ex)
    missed = [(t, e) for t, e in timed if isinstance(e, SplitMissed)]
    assert missed == [(4.0, SplitMissed(1, 0, 1, 1))]
    saved = [(t, e.step) for t, e in timed if isinstance(e, CheckpointSaved)]
    metrics = [(t, e.step) for t, e in timed if isinstance(e, MetricsReported)]
    assert saved == [(12.5, 6)] and metrics == [(12.0, 6)]
    # After the batch ended, a split is missed too.
    ex.submit(AddCheckpoint(1, 0, 1, 8))
    assert [e for _, e in drain(ex)] == [SplitMissed(1, 0, 1, 8)]


@pytest.mark.parametrize("interval", [0.2, None])
def test_abort_stops_after_the_step_in_progress(interval: float | None) -> None:
    # Worker 0 trains 2 s steps, worker 1 (another config) 3 s steps.
    ex = executor(
        step_cost=lambda config, values: 3.0 if config["wd"] else 2.0, progress_interval=interval
    )
    drain(ex)
    ex.submit(batch(stop=10, evaluate=((1, 10),)))
    other = batch(2, worker=1, stop=1)
    ex.submit(RunBatch(**{**other.__dict__, "config": {"wd": 1.0}}))
    while ex.now < 3.0:
        ex.events()  # t = 3: worker 1 ends; the engine aborts worker 0 during its 2nd step
    assert ex.now == 3.0
    ex.submit(Abort(1, 0))
    events = [e for _, e in drain(ex)]
    done = events[-1]
    # The clock stops at the aborted batch's end, not at its abandoned milestones.
    assert isinstance(done, BatchDone) and done.steps == 2 and ex.now == 4.0
    assert not any(isinstance(e, MetricsReported) for e in events)
    ex.submit(Abort(1, 0))  # no longer running: ignored
    assert not ex.pending


def test_contract_errors() -> None:
    ex = executor()
    drain(ex)
    ex.submit(batch())
    with pytest.raises(ValueError, match="still running"):
        ex.submit(batch(2))
    with pytest.raises(ValueError, match="no simulated worker"):
        ex.submit(batch(3, worker=5))
    ex.submit(batch(4, worker=1, start=3, ckpt="nope.ckpt", start_at=(1, 3)))
    failed = [e for _, e in drain(ex) if isinstance(e, BatchFailed)]
    assert len(failed) == 1 and failed[0].kind == "checkpoint" and "nope" in failed[0].error
    with pytest.raises(ValueError, match="num_workers"):
        SimulatedExecutor(0)
    with pytest.raises(ValueError, match="base_seconds"):
        StepCost(0.0)


def test_step_cost_depends_on_batch_size() -> None:
    cost = StepCost(10.0)
    assert cost({}, {"batch_size": 128}) == 10.0
    assert cost({}, {"batch_size": 256}) == pytest.approx(10.0 * 2**-0.3)
    assert cost({"batch_size": 512}, {}) == pytest.approx(10.0 * 4**-0.3)
    assert StepCost(3.0, {"seq": (128.0, 1.0)})({}, {"seq": 512}) == 12.0


# --------------------------------------------------------------------------- studies


def asha(seed: int = 0) -> ASHA:
    return ASHA(space(), "accuracy", min_steps=2, max_steps=12, eta=2, num_trials=12, seed=seed)


def test_simulation_is_deterministic() -> None:
    runs = []
    for _ in range(2):
        tuner = asha()
        result = simulate(None, tuner, workers=3)
        decisions = [(tid, r.steps, r.metrics["accuracy"]) for tid, r in tuner.results]
        runs.append((result.makespan, result.device_hours, result.steps_executed, decisions))
    assert runs[0] == runs[1]
    assert len(runs[0][3]) > 12  # promotions happened


def test_asha_runs_through_the_real_tuner() -> None:
    tuner = asha()
    result = simulate(None, tuner, workers=3)
    assert tuner.promotions and len(tuner.trials) == 12
    # Promotions follow the simulated metrics: at a rung, every promoted trial ranks
    # in the top 1/eta of the trials seen by then (checked on the final rung table).
    level0 = tuner.rungs[0][0]
    best0 = max(level0, key=lambda tid: level0[tid])
    assert (best0, 0, 0) in tuner.promotions
    best = result.best
    assert best is not None and best.steps == 12
    # Metrics come through shared stages, yet equal the trial trained alone.
    alone = LearningCurve().metrics_of(best.config, best.hp, 12)
    assert best.metrics["accuracy"] == alone["accuracy"]
    assert result.steps_executed >= result.steps_unique
    assert result.makespan >= result.lower_bound > 0


def test_grid_executes_unique_steps_only() -> None:
    tuner = GridSearch(space(), "accuracy", steps=12)
    shared = simulate(None, tuner, workers=3)
    assert shared.trials == 12 and shared.steps_requested == 144
    assert shared.steps_executed == shared.steps_unique < shared.steps_requested
    assert shared.merge_rate == pytest.approx(144 / shared.steps_unique)
    alone = simulate(None, GridSearch(space(), "accuracy", steps=12), workers=3, share=False)
    assert alone.steps_executed == alone.steps_unique == alone.steps_requested == 144
    assert alone.device_hours > shared.device_hours
    for r in (shared, alone):
        assert r.makespan >= r.lower_bound >= r.longest_path > 0
        assert r.lower_bound >= r.unique_work / 3
        assert r.device_hours * 3600 >= r.unique_work
    # Training time of every step, unshared: what trial-based execution must train.
    assert alone.unique_work == pytest.approx(shared.requested_work)
    assert shared.best is not None and alone.best is not None
    assert shared.best.metrics == alone.best.metrics


def test_several_studies_share_stages() -> None:
    def tuners() -> list[GridSearch]:
        return [GridSearch(space(), "accuracy", steps=12) for _ in range(2)]

    shared = simulate(None, tuners(), workers=3)
    alone = simulate(None, tuners(), workers=3, share=False)
    assert shared.trials == alone.trials == 24 and len(shared.bests) == 2
    one = simulate(None, GridSearch(space(), "accuracy", steps=12), workers=3)
    assert shared.steps_executed == one.steps_executed  # the second study trains nothing
    assert alone.steps_executed == 288  # nothing shared, not even between studies


def test_study_with_simulated_executor_string() -> None:
    with Study(
        "sim", SimulatedTrainer, storage=MemoryPlanStorage(), workers=2, executor="simulated"
    ) as study:
        best = study.tune(GridSearch(space(), "accuracy", steps=6))
        assert best is not None and best.steps == 6
        stats = study.stats()
    assert stats["steps_executed"] == stats["steps_unique"] < stats["steps_requested"]


def test_study_with_executor_factory_and_policy() -> None:
    ex = functools.partial(SimulatedExecutor, 2, step_cost=StepCost(5.0))
    with Study(
        "sim", SimulatedTrainer, storage=MemoryPlanStorage(), executor=ex, policy="bfs"
    ) as study:
        assert study.num_workers == 2
        assert study.tune(GridSearch(space(), "accuracy", steps=6)) is not None
        executor = study._engine.executor
        assert isinstance(executor, SimulatedExecutor)
        assert executor.done_at is not None and executor.done_at <= executor.now


def test_simulate_arguments() -> None:
    with pytest.raises(ValueError, match="needs a tuner"):
        simulate(space(), None)
    with pytest.raises(ValueError, match="workers"):
        simulate(space(), asha(), workers=0)
    made = simulate(space(), lambda s: GridSearch(s, "val_loss", "min", steps=3), workers=2)
    assert isinstance(made, SimResult) and made.best is not None
    assert made.best.metrics["val_loss"] == made.best.metrics["loss"]


def test_simulate_script_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "real.db"
    script = tiny_script(tmp_path / "tiny.py", f'storage="sqlite:///{db}"')
    assert main(["simulate", str(script), "--workers", "2", "--step-seconds", "60"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if "-based" in line}
    assert set(rows) == {"stage-based (shared)", "trial-based (no sharing)"}
    shared = [c.strip() for c in rows["stage-based (shared)"].split("|")]
    alone = [c.strip() for c in rows["trial-based (no sharing)"].split("|")]
    assert (shared[4], shared[5], alone[4], alone[5]) == ("12", "16", "16", "16")
    assert "sharing saves" in out
    assert not db.exists()  # the script's real storage was never opened
    assert main(["simulate", str(tmp_path / "missing.py")]) == 2


def test_stall_is_reported() -> None:
    """A study whose work can never run (no worker accepts it) fails instead of
    spinning forever."""

    class Stuck(SimulatedExecutor):
        def start(self) -> None:  # no WorkerReady: the scheduler knows no worker
            self._started = True

    with (
        Study(
            "stuck", SimulatedTrainer, storage=MemoryPlanStorage(), executor=lambda: Stuck(1)
        ) as study,
        pytest.raises(StagetreeError, match="stalled"),
    ):
        study.tune(GridSearch(space(), "accuracy", steps=3))


def test_a_busy_loop_is_not_a_stall() -> None:
    """A tuner that reacts for more ready rounds than one settle allows, with nothing
    for the executor meanwhile (a resumed study's replay answering thousands of trials
    at one instant), runs to its end: two settles that ran out of rounds are not a
    stall."""

    async def replaying() -> int:
        for _ in range(25_000):  # more than two settles of 10,000 rounds
            await asyncio.sleep(0)
        return 7

    async def waiting() -> None:
        await asyncio.get_running_loop().create_future()  # never answered

    assert asyncio.run(drive(replaying(), lambda _: 0, None)) == 7
    with pytest.raises(StagetreeError, match="stalled"):
        asyncio.run(drive(waiting(), lambda _: 0, None))


def test_a_loop_that_never_stops_spinning_is_a_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuner that spins without ever awaiting a result stops with an error after
    ``BUSY_SETTLES`` busy settles, instead of running forever."""

    async def spinning() -> None:
        while True:
            await asyncio.sleep(0)

    monkeypatch.setattr(simulated, "BUSY_SETTLES", 3)
    with pytest.raises(StagetreeError, match="stayed busy for 4 settles"):
        asyncio.run(drive(spinning(), lambda _: 0, None))


def test_an_instant_that_wakes_nothing_costs_no_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an instant that answered nothing the tuner awaits (its loop has nothing
    ready), the next instant is delivered without a settle of the loop; after one that
    woke it, the tuner reacts before the next instant, as ever."""
    log: list[tuple[str, Any]] = []
    settle = simulated.settle_loop

    async def counted(*args: Any) -> bool:
        log.append(("settle", None))
        return await settle(*args)

    monkeypatch.setattr(simulated, "settle_loop", counted)
    waiting: list[asyncio.Future[None]] = []

    async def tuner() -> str:
        for i in range(3):
            waiting.append(asyncio.get_running_loop().create_future())
            await waiting[-1]
            log.append(("tuner", i))
        return "done"

    wakes = [False, False, True, False, True, False, False, True]  # per instant

    def pump(_: float) -> int:
        if not wakes:
            return 0
        wake = wakes.pop(0)
        log.append(("pump", wake))
        if wake:
            waiting[-1].set_result(None)
        return 1

    assert asyncio.run(drive(tuner(), pump, None)) == "done"
    instant = [("pump", False)]
    woke = [("pump", True), ("settle", None)]
    assert log == [
        ("settle", None),
        *instant * 2, *woke, ("tuner", 0),
        *instant, *woke, ("tuner", 1),
        *instant * 2, *woke, ("tuner", 2),
        ("settle", None),  # the work left after the tuner's end
    ]  # fmt: skip


def test_progress_lets_the_scheduler_learn_costs() -> None:
    ex = executor(step_cost=StepCost(2.0), progress_interval=None)
    drain(ex)
    ex.submit(batch(stop=6, evaluate=((1, 6),)))
    progress = [e for _, e in drain(ex) if isinstance(e, Progress)]
    assert [(p.step, p.seconds_per_step) for p in progress] == [(6, 2.0)]


# --------------------------------------------------------------------------- devices


def test_devices_per_worker_speeds_steps_and_counts_every_device() -> None:
    """4 devices at efficiency 0.5: a step is 1 + 3 * 0.5 = 2.5 times as fast; the
    worker's busy seconds count 4 times as device-seconds."""
    one = executor(progress_interval=None)
    four = executor(progress_interval=None, devices_per_worker=4, parallel_efficiency=0.5)
    assert (one.speedup, four.speedup) == (1.0, 2.5)
    for ex in (one, four):
        drain(ex)
        ex.submit(batch(stop=5, evaluate=((1, 5),)))
    (t1, m1), (t4, m4) = [
        next((t, e) for t, e in drain(ex) if isinstance(e, MetricsReported)) for ex in (one, four)
    ]
    assert t1 == 10.0 and t4 == pytest.approx(10.0 / 2.5)  # 5 steps of 2 s / 2.5
    assert m1.metrics == m4.metrics  # the same model, trained faster
    assert one.busy_seconds[0] == 10.0 and four.busy_seconds[0] == pytest.approx(4.0)
    assert one.device_seconds == 10.0 and four.device_seconds == pytest.approx(16.0)


def test_simulate_with_multi_device_workers() -> None:
    """Same decisions and metrics; makespan and the lower bound shrink by the speedup,
    device-hours grow by k / speedup (free checkpoints: only training takes time)."""

    def run(**kw: Any) -> tuple[SimResult, list[Any]]:
        tuner = asha()
        free = {"checkpoint_bytes": 0, "save_latency": 0.0, "load_latency": 0.0}
        result = simulate(None, tuner, workers=3, progress_interval=None, **free, **kw)
        return result, [(tid, r.steps, r.metrics) for tid, r in tuner.results]

    base, decisions = run()
    for k, e in ((2, 1.0), (4, 0.5)):
        speedup = 1 + (k - 1) * e
        r, seen = run(devices_per_worker=k, parallel_efficiency=e)
        assert (r.devices_per_worker, r.parallel_efficiency, r.devices) == (k, e, 3 * k)
        assert seen == decisions and r.best == base.best
        assert r.steps_executed == base.steps_executed
        assert r.makespan == pytest.approx(base.makespan / speedup)
        assert r.lower_bound == pytest.approx(base.lower_bound / speedup)
        assert r.device_hours == pytest.approx(base.device_hours * k / speedup)
        assert r.work_merge_rate == pytest.approx(base.work_merge_rate)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"devices_per_worker": 0}, "devices_per_worker must be a positive int"),
        ({"devices_per_worker": 2.0}, "devices_per_worker must be a positive int"),
        ({"devices_per_worker": True}, "devices_per_worker must be a positive int"),
        ({"parallel_efficiency": 0.0}, r"parallel_efficiency must be a number in \(0, 1\]"),
        ({"parallel_efficiency": 1.5}, r"parallel_efficiency must be a number in \(0, 1\]"),
        ({"parallel_efficiency": float("nan")}, "parallel_efficiency"),
        ({"parallel_efficiency": "1"}, "parallel_efficiency"),
    ],
)
def test_devices_arguments_are_checked(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SimulatedExecutor(2, **kw)
    with pytest.raises(ValueError, match=match):
        simulate(space(), asha(), workers=2, **kw)


def test_simulate_cli_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tiny_script(tmp_path / "tiny.py")
    args = ["simulate", str(script), "--workers", "2", "--step-seconds", "3600"]
    assert main([*args, "--devices-per-worker", "4", "--parallel-efficiency", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "2 workers x 4 devices (8 devices, data-parallel efficiency 0.5)" in out
    shared = next(line for line in out.splitlines() if "stage-based" in line)
    # 12 unique steps of 1 h / 2.5 on 4 devices; 8 steps in a row on the longest path.
    cells = [c.strip() for c in shared.split("|")]
    assert float(cells[2]) == pytest.approx(12 / 2.5 * 4, rel=1e-2)
    assert float(cells[3]) == pytest.approx(8 / 2.5, rel=1e-2)
    # Without the option, the study's own devices_per_worker counts.
    script.write_text(
        script.read_text().replace('"memory://"', '"memory://", devices_per_worker=2')
    )
    assert main(args) == 0
    assert (
        "2 workers x 2 devices (4 devices, data-parallel efficiency 1)" in capsys.readouterr().out
    )
    for bad in (["--devices-per-worker", "0"], ["--parallel-efficiency", "1.2"]):
        assert main([*args, *bad]) == 2
    err = capsys.readouterr().err
    assert "--devices-per-worker: expected an int >= 1" in err
    assert "--parallel-efficiency: expected a number in (0, 1]" in err
