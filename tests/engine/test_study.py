"""The Study facade end to end: submissions, failures, sharing across studies and
processes, root keys, tuners on real studies."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.exceptions import (
    InvalidTrialError,
    TrialCancelledError,
    TrialFailedError,
    TunerError,
)
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace
from stagetree.study import trainer_fingerprint
from stagetree.tuners import (
    ASHA,
    PBT,
    SHA,
    AsyncHyperband,
    EarlyStop,
    GridSearch,
    Hyperband,
    MedianStopping,
    RandomSearch,
)

LRS = [Constant(0.05), MultiStep(0.05, [5], 0.5), MultiStep(0.05, [10], 0.5), Constant(0.02)]


def make(tmp_path: Path, name: str = "s", **kw: Any) -> Study:
    kw.setdefault("executor", "inline")
    return Study(name, LinearTrainer, storage=f"sqlite:///{tmp_path}/plan.db", **kw)


def test_submit_shares_prefixes_and_answers_known_results(tmp_path: Path) -> None:
    with make(tmp_path) as study:

        async def main() -> list[Any]:
            return await asyncio.gather(*[study.submit({"seed": 1}, {"lr": lr}, 20) for lr in LRS])

        results = asyncio.run(main())
        stats = study.stats()
        # Constant(0.05) shares 5 steps with MultiStep(.., [5]) and 10 with [10].
        assert stats["steps_requested"] == 80
        assert stats["steps_unique"] == 20 + 15 + 10 + 20
        assert stats["steps_executed"] == stats["steps_unique"]
        assert results[0].metrics != results[3].metrics
        # Known metrics come from the plan without training.
        again = study.run({"seed": 1}, {"lr": LRS[1]}, 20)
        assert again.metrics == results[1].metrics
        assert study.stats()["steps_executed"] == stats["steps_executed"]
        assert study.eval({"seed": 1}, {"lr": LRS[1]}, 20) == results[1].metrics
        assert study.eval({"seed": 1}, {"lr": Constant(0.3)}, 20) is None
        # A promotion resumes the trial: only the new steps are trained.
        longer = study.run({"seed": 1}, {"lr": LRS[0]}, 25)
        assert study.stats()["steps_executed"] == stats["steps_executed"] + 5
        assert set(longer.history) >= {20, 25}


def test_results_equal_a_plain_loop(tmp_path: Path) -> None:
    def alone(lr: Any, steps: int) -> dict[str, float]:
        t = LinearTrainer({"seed": 3})
        for s in range(steps):
            t.setup({"lr": lr(s)})
            t.train()
        return t.evaluate()

    with make(tmp_path) as study:

        async def main() -> list[Any]:
            return await asyncio.gather(*[study.submit({"seed": 3}, {"lr": lr}, 12) for lr in LRS])

        for lr, res in zip(LRS, asyncio.run(main())):
            assert res.metrics == alone(lr, 12)


def test_bad_submissions_raise_before_anything_is_written(tmp_path: Path) -> None:
    with make(tmp_path) as study:
        study.run({"seed": 0}, {"lr": LRS[0]}, 2)
        with pytest.raises(InvalidTrialError, match="momentum"):
            study.run({"seed": 0}, {"lr": LRS[0], "momentum": 0.9}, 2)
        with pytest.raises(InvalidTrialError, match="steps"):
            study.run({"seed": 0}, {"lr": LRS[0]}, -1)
        with pytest.raises(InvalidTrialError, match="steps"):
            study.run({"seed": 0}, {"lr": LRS[0]}, 2.5)  # type: ignore[arg-type]
        assert len(study.trials()) == 1


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ({"fail_init": True}, "__init__"),
        ({"fail_train_at": 3}, "train"),
        ({"fail_eval": True}, "evaluate"),
    ],
)
def test_trainer_errors_fail_the_trial_with_traceback(
    tmp_path: Path, config: dict[str, Any], where: str
) -> None:
    with make(tmp_path) as study:
        with pytest.raises(TrialFailedError) as info:
            study.run({"seed": 0, **config}, {"lr": LRS[0]}, 6)
        assert f"boom in {where}" in str(info.value)
        assert "Traceback" in info.value.traceback
        assert study.trials()[0].state == "failed"


def test_failure_fails_dependents_only(tmp_path: Path) -> None:
    with make(tmp_path) as study:

        async def main() -> list[Any]:
            # Both share steps 0-4; the second diverges (the trainer raises) at step 5.
            ok = study.submit({"seed": 0}, {"lr": Constant(0.05)}, 8)
            bad = study.submit({"seed": 0}, {"lr": MultiStep(0.05, [5], 100.0)}, 8)
            early = study.submit({"seed": 0}, {"lr": MultiStep(0.05, [5], 100.0)}, 5)
            return await asyncio.gather(ok, bad, early, return_exceptions=True)

        ok, bad, early = asyncio.run(main())
        assert isinstance(bad, TrialFailedError) and "diverges at step 5" in str(bad)
        assert not isinstance(ok, BaseException)
        assert not isinstance(early, BaseException)  # its steps lie before the failure


def test_studies_share_stages_on_one_storage(tmp_path: Path) -> None:
    a = make(tmp_path, "a")
    b = make(tmp_path, "b")
    try:
        ra = a.run({"seed": 0}, {"lr": LRS[1]}, 10)
        executed = a.stats()["steps_executed"]
        assert executed == 10
        # The same trial in another study: answered from the plan, it costs b nothing.
        assert b.run({"seed": 0}, {"lr": LRS[1]}, 10).metrics == ra.metrics
        assert b.stats()["steps_executed"] == 0
        # Longer: resumes from a's checkpoint at step 10; b is charged its 5 steps.
        rb = b.run({"seed": 0}, {"lr": LRS[1]}, 15)
        assert b.stats()["steps_executed"] == 5
        assert a.stats()["steps_executed"] == executed
        assert rb.history[10] == ra.metrics
    finally:
        a.close()
        b.close()


def test_root_key_follows_trainer_source_and_version(tmp_path: Path) -> None:
    with make(tmp_path, version=None) as s1, make(tmp_path, "v", version="v1") as s2:
        assert s1.version == trainer_fingerprint(LinearTrainer)
        assert s2.version == "v1"
        assert s1.root_key({"seed": 0}) != s2.root_key({"seed": 0})
    ns: dict[str, Any] = {}
    src = (
        "from stagetree import Trainer\n"
        "class T(Trainer):\n    def train(self):\n        return None\n"
    )
    p1, p2 = tmp_path / "t1.py", tmp_path / "t2.py"
    p1.write_text(src)
    p2.write_text(src.replace("return None", "return {}"))
    import runpy

    ns1, ns2 = runpy.run_path(str(p1)), runpy.run_path(str(p2))
    assert trainer_fingerprint(ns1["T"]) != trainer_fingerprint(ns2["T"])
    del ns


SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from study_trainers import LinearTrainer
    from stagetree import Study
    from stagetree.hp import Constant, MultiStep
    from stagetree.space import GridSpace
    from stagetree.tuners import ASHA

    space = GridSpace({{"lr": [Constant(0.05), MultiStep(0.05, [3], 0.5), MultiStep(0.05, [6], 0.5),
                               Constant(0.02), Constant(0.01), MultiStep(0.02, [2], 2.0)]}},
                      fixed={{"seed": [0, 1]}})
    tuner = ASHA(space, "score", "max", min_steps=1, max_steps=16, eta=2, num_trials=len(space))
    if __name__ == "__main__":
        with Study("asha", LinearTrainer, storage={url!r}, workers=2) as study:
            best = study.tune(tuner)
            s = study.stats()
            print("BEST", best.config, best.metrics["score"])
            keys = ("steps_executed", "steps_unique", "steps_requested")
            print("STATS", *(int(s[k]) for k in keys))
    """
)


def _run_script(path: Path) -> tuple[str, tuple[int, int, int]]:
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    best = next(line for line in out.splitlines() if line.startswith("BEST"))
    stats = next(line for line in out.splitlines() if line.startswith("STATS"))
    a, b, c = (int(x) for x in stats.split()[1:])
    return best, (a, b, c)


@pytest.mark.slow
def test_rerunning_a_finished_study_in_a_new_process_trains_nothing(tmp_path: Path) -> None:
    script = tmp_path / "study.py"
    url = f"sqlite:///{tmp_path}/plan.db"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1] / "fakes"), url=url))
    best1, (executed1, unique1, requested1) = _run_script(script)
    # Steps here take microseconds, so a promotion may branch off a point a worker has
    # already passed (a missed live split, recomputed): executed >= unique.
    assert unique1 <= executed1 < requested1
    best2, (executed2, _, _) = _run_script(script)
    assert best2 == best1
    assert executed2 == executed1  # cumulative: the second run trained nothing


INTERRUPTED = textwrap.dedent(
    """
    import pathlib
    import sys
    import time
    sys.path.insert(0, {fakes!r})
    from study_trainers import LinearTrainer
    from stagetree import Study
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.tuners import GridSearch

    class Slow(LinearTrainer):
        def train(self):
            pathlib.Path({marker!r}).touch()  # training has started: Ctrl-C may come
            time.sleep(0.05)
            return super().train()

    # About 3 s of training, in one batch that closing the study waits for (inline).
    tuner = GridSearch(GridSpace({{"lr": [Constant(0.05)]}}), "score", steps=60)
    with Study("ctrl-c", Slow, storage={url!r}, executor="inline") as study:
        study.tune(tuner)
    """
)


def test_ctrl_c_in_tune_says_interrupted_in_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "training"
    script = tmp_path / "interrupted.py"
    fakes = str(Path(__file__).parents[1] / "fakes")
    url = f"sqlite:///{tmp_path}/plan.db"
    script.write_text(INTERRUPTED.format(fakes=fakes, marker=str(marker), url=url))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # A shell that starts jobs in the background leaves SIGINT ignored, and a child
        # inherits that: give the script the default handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate()[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGINT  # ended by an uncaught KeyboardInterrupt
    assert err.rstrip().endswith(
        "KeyboardInterrupt: study 'ctrl-c': interrupted; run again to resume"
    ), err
    assert "During handling" not in err and "CancelledError" not in err, err
    assert len(err.splitlines()) <= 8, err


def test_tuners_run_real_studies(tmp_path: Path) -> None:
    space = GridSpace({"lr": LRS}, fixed={"seed": [0, 1]})
    tuners = [
        GridSearch(space, "score", steps=8),
        RandomSearch(space, "score", steps=8, num_trials=5),
        AsyncHyperband(space, "score", min_steps=1, max_steps=16, eta=4, num_trials=8),
        SHA(space, "score", min_steps=2, max_steps=8, eta=2, num_trials=8),
        ASHA(space, "score", min_steps=1, max_steps=16, eta=4, num_trials=8),
        Hyperband(space, "score", min_steps=1, max_steps=9, eta=3, num_trials=8),
        MedianStopping(space, "score", steps=8, num_trials=8, eval_every=2),
        PBT(space, "score", population=4, interval=3, steps=9),
        EarlyStop(space, "score", schedule=[(3, 8), (6, 4)]),
    ]
    for i, tuner in enumerate(tuners):
        with make(tmp_path, f"t{i}") as study:
            best = study.tune(tuner)
            assert best is not None and math.isfinite(best.metrics["score"])
            finite = [t.metrics[t.steps]["score"] for t in study.trials() if t.steps == best.steps]
            assert best.metrics["score"] == max(finite), type(tuner).__name__
            stats = study.stats()
            assert stats["steps_requested"] >= stats["steps_unique"]


def test_missing_metric_is_a_tuner_error(tmp_path: Path) -> None:
    space = GridSpace({"lr": LRS[:2]}, fixed={"seed": [0]})
    with make(tmp_path) as study, pytest.raises(TunerError, match="accuracy"):
        study.tune(GridSearch(space, "accuracy", steps=2))


def test_nan_metrics_rank_worst(tmp_path: Path) -> None:
    space = GridSpace({"lr": [Constant(0.05), Constant(0.001)]}, fixed={"nan_at": [1000, 1]})
    with make(tmp_path) as study:
        best = study.tune(GridSearch(space, "score", steps=4))
        assert best is not None and best.config["nan_at"] == 1000
        assert study.best("score").config["nan_at"] == 1000  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_dead_worker_is_replaced_and_its_stages_rerun(tmp_path: Path) -> None:
    from study_trainers import CrashOnceTrainer

    marker = tmp_path / "crashed"
    config = {"seed": 2, "marker": str(marker), "crash_at": 6}
    with Study(
        "crash", CrashOnceTrainer, storage=f"sqlite:///{tmp_path}/plan.db", workers=1
    ) as study:

        async def main() -> list[Any]:
            return await asyncio.gather(*[study.submit(config, {"lr": lr}, 12) for lr in LRS])

        results = asyncio.run(main())
        assert marker.exists(), "the worker never crashed: the test tests nothing"
    reference = Study("ref", LinearTrainer, storage="memory://", executor="inline")
    with reference:
        clean = {k: v for k, v in config.items() if k not in ("marker", "crash_at")}
        for lr, res in zip(LRS, results):
            assert res.metrics == reference.run(clean, {"lr": lr}, 12).metrics


def test_checkpoint_budget_evicts_but_results_stay_exact(tmp_path: Path) -> None:
    budget = 1500  # bytes: a few of LinearTrainer's checkpoints (about 470 bytes each)
    with make(tmp_path, checkpoint_budget=budget) as study:

        async def main() -> list[Any]:
            return await asyncio.gather(*[study.submit({"seed": 4}, {"lr": lr}, 15) for lr in LRS])

        results = asyncio.run(main())
        study.stats()  # settles the engine: every checkpoint reported
        store = study._engine.store
        assert store.total_bytes() <= budget
        saves = study._engine.storage.stats("engine")["ckpt_saves"]
        assert saves > len(store.refs()), "nothing was evicted: the test tests nothing"
        assert len(study._engine.storage.checkpoints()) == len(store.refs())
        # Promotions still work (resuming, or recomputing what was evicted), exactly.
        longer = [study.run({"seed": 4}, {"lr": lr}, 20) for lr in LRS]
        assert study._engine.store.total_bytes() <= budget
    (tmp_path / "ref").mkdir()
    with make(tmp_path / "ref", name="ref") as ref:
        for lr, short, long in zip(LRS, results, longer):
            assert short.metrics == ref.run({"seed": 4}, {"lr": lr}, 15).metrics
            assert long.metrics == ref.run({"seed": 4}, {"lr": lr}, 20).metrics


def test_cancel_releases_the_request_and_spares_shared_work(tmp_path: Path) -> None:
    from study_trainers import SlowLinearTrainer

    # A worker process: the in-process executor cannot be interrupted mid-batch.
    with Study("cancel", SlowLinearTrainer, storage=f"sqlite:///{tmp_path}/plan.db") as study:

        async def main() -> tuple[Any, Any]:
            keep = asyncio.ensure_future(study.submit({"seed": 0}, {"lr": LRS[0]}, 8))
            drop = asyncio.ensure_future(study.submit({"seed": 0}, {"lr": LRS[0]}, 60))
            while not keep.done():
                await asyncio.sleep(0.01)
            study.cancel(drop)
            done = await asyncio.gather(keep, drop, return_exceptions=True)
            return done[0], done[1]

        keep, drop = asyncio.run(main())
        assert isinstance(drop, asyncio.CancelledError)
        assert keep.metrics == study.eval({"seed": 0}, {"lr": LRS[0]}, 8)
        assert study.eval({"seed": 0}, {"lr": LRS[0]}, 60) is None
        # The cancelled request stopped its batch early: far fewer than 60 steps ran.
        assert study.stats()["steps_executed"] < 40


@pytest.mark.slow
def test_asha_on_real_torch_training(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from stagetree.torch.examples import DigitsTrainer

    space = GridSpace(
        {"lr": [Constant(0.1), MultiStep(0.1, [2], 0.1), MultiStep(0.1, [4], 0.1)]},
        fixed={"hidden": [16], "batches_per_step": [2], "seed": [0, 1]},
    )
    tuner = ASHA(space, "accuracy", min_steps=1, max_steps=8, eta=2, num_trials=len(space))
    with Study("asha-torch", DigitsTrainer, storage=f"sqlite:///{tmp_path}/p.db", workers=2) as s:
        best = s.tune(tuner)
        assert best is not None and best.steps >= 4  # rungs 1, 2, 4, 8 over 6 configs
        assert 0.1 < best.metrics["accuracy"] <= 1.0
        stats = s.stats()
        assert stats["steps_unique"] <= stats["steps_executed"] < stats["steps_requested"]


def test_simulated_study_answers_single_submissions_and_cleans_up() -> None:
    import glob
    import tempfile

    from stagetree.executors.simulated import SimulatedTrainer

    pattern = tempfile.gettempdir() + "/stagetree-ckpt-*"
    before = set(glob.glob(pattern))
    with Study("sim", SimulatedTrainer, storage="memory://", executor="simulated") as study:
        a = study.run({}, {"lr": MultiStep(0.1, [5], 0.1)}, 10)
        b = study.run({}, {"lr": MultiStep(0.1, [5], 0.1)}, 15)  # resumes a at step 10
        assert b.history[10] == a.metrics
        assert study.stats()["steps_executed"] == 15
    assert set(glob.glob(pattern)) == before  # the in-memory study's checkpoints are gone


def test_a_corrupt_checkpoint_counts_as_missing_and_is_recomputed(tmp_path: Path) -> None:
    with make(tmp_path) as study:
        study.run({"seed": 5}, {"lr": LRS[1]}, 10)
        executed = study.stats()["steps_executed"]
        store = study._engine.store
        for ref in store.refs():  # flip a byte in the middle of every checkpoint
            path = store.directory / ref
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    # A new process (no trainer in memory) must load the resume point: it is unreadable,
    # so the trial is recomputed from step 0, and the result is still exact.
    with make(tmp_path) as study:
        longer = study.run({"seed": 5}, {"lr": LRS[1]}, 15)
        assert study.stats()["steps_executed"] == executed + 15
    (tmp_path / "ref").mkdir()
    with make(tmp_path / "ref", "r") as ref:
        assert longer.metrics == ref.run({"seed": 5}, {"lr": LRS[1]}, 15).metrics


def test_close_releases_only_this_process_references(tmp_path: Path) -> None:
    from study_trainers import SlowLinearTrainer

    from stagetree import open_storage

    url = f"sqlite:///{tmp_path}/plan.db"
    study = Study("mine", SlowLinearTrainer, storage=url)
    slot = study._study_slot
    future = study._engine.submit(slot, {"seed": 0}, {"lr": LRS[0]}, 500).future  # not awaited
    (req,) = study._engine.storage.requests()
    other = open_storage(url)  # another process wanting the same model
    other.add_request(req.node, req.step)
    other.close()
    study.close()
    assert isinstance(future.exception(timeout=5), TrialCancelledError)
    with open_storage(url) as storage:
        (req,) = storage.requests()
        assert req.refcount == 1 and req.state.value == "pending"


@pytest.mark.parametrize("executor", ["inline", "local"])
def test_engine_records_what_each_worker_did(tmp_path: Path, executor: str) -> None:
    """Every batch leaves a start, its checkpoint saves and its end in the storage's
    activity log (the dashboard's timeline), written by the engine that ran it."""
    from stagetree.plan import open_storage

    url = f"sqlite:///{tmp_path}/plan.db"
    with Study("acts", LinearTrainer, storage=url, executor=executor, workers=2) as study:
        study.run({}, {"lr": MultiStep(0.05, [10], 0.5)}, 20)
        study.run({}, {"lr": MultiStep(0.05, [10], 0.1)}, 20)
    storage = open_storage(url, readonly=True)
    log = storage.activity()
    batches: dict[tuple[str, int], list[Any]] = {}
    for rec in log:
        batches.setdefault((rec.owner, rec.batch), []).append(rec)
    assert batches
    trained = set()
    for recs in batches.values():
        kinds = [r.kind for r in recs]
        # Every batch's end is recorded (the engine lets in-flight batches report it
        # before it closes); a background checkpoint may be reported after it.
        assert kinds[0] == "start" and kinds.count("done") == 1
        assert set(kinds[1:]) <= {"save", "done"}
        start = recs[0]
        for node, first, stop in start.data["segments"]:
            trained.add(node)
            assert first < stop
        (done,) = [r for r in recs if r.kind == "done"]
        assert start.time <= done.time and done.seconds > 0
        assert done.data["steps"] == start.data["stop_step"] - start.data["start_step"]
        for save in (r for r in recs if r.kind == "save"):  # a checkpoint the plan knows
            assert storage.checkpoint(save.node, save.step) is not None
    assert trained == {n.id for n in storage.nodes()}  # every stage was trained by someone
    executed = storage.stats("engine")["steps_executed"]  # counted at BatchDone too
    assert sum(r.data["steps"] for r in log if r.kind == "done") == executed
