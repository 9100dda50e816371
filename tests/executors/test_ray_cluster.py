"""The Ray executor on a real multi-node cluster on one machine (``ray.cluster_utils``):
a head without CPUs and worker nodes with one CPU each, workers pinned to nodes by
custom resources. One cluster for the module (Ray starts slowly).

(a) trials branching at several steps, workers on two nodes: bit-identical to the same
    trials trained alone, exactly the unique steps executed;
(b) a node removed mid-study: the study finishes, still bit-identical, nothing finished
    is lost, the lost and recomputed steps are counted, and the lost worker is replaced
    once a node with room joins;
(c) a second study on the same PostgreSQL plan and cluster reuses the first's stages.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from ray.cluster_utils import Cluster  # noqa: E402

# The exactness harness, from its own test folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_exactness import CONFIG, STEPS, TRIALS, assert_same_state, train_alone  # noqa: E402

from stagetree import Study  # noqa: E402
from stagetree.executors.ray import RayExecutor  # noqa: E402
from stagetree.plan import SQLPlanStorage  # noqa: E402
from stagetree.reports.status import storage_status  # noqa: E402
from stagetree.torch.examples import DigitsTrainer  # noqa: E402

PG_URL = os.environ.get("STAGETREE_TEST_DB_URL")


class SlowDigits(DigitsTrainer):
    """Steps long enough for a node to be removed while the study runs (the sleep does
    not touch training). While the file ``HOLD`` exists every worker waits before its
    next step (at most a minute), so a test can freeze the study where it wants the
    node gone (the class travels by value: the path with it)."""

    HOLD = Path(tempfile.gettempdir()) / f"stagetree-ray-hold-{os.getpid()}-{uuid.uuid4().hex}"

    def train(self) -> dict[str, float]:
        time.sleep(0.1)
        deadline = time.monotonic() + 60
        while self.HOLD.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().train()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    c.nodes_by_name = {
        "a": c.add_node(num_cpus=1, resources={"node_a": 1}),
        "b": c.add_node(num_cpus=1, resources={"node_b": 1}),
    }
    c.wait_for_nodes()
    ray.init(address=c.address)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def references() -> list[tuple[dict[str, float], dict[str, Any]]]:
    return [train_alone(CONFIG, hp, STEPS) for hp in TRIALS]


def _pinned(*nodes: str) -> RayExecutor:
    return RayExecutor(
        worker_resources=[{"CPU": 1, f"node_{n}": 1} for n in nodes],
        threads_per_worker=1,
    )


def _run_all(study: Study, during: Any = None) -> list[Any]:
    async def main() -> list[Any]:
        tasks = [asyncio.ensure_future(study.submit(CONFIG, hp, STEPS)) for hp in TRIALS]
        if during is not None:
            await during()
        return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def _check_exact(study: Study, results: list[Any], references: Any) -> None:
    for i, (hp, result) in enumerate(zip(TRIALS, results)):
        ref_metrics, ref_state = references[i]
        assert result.metrics == ref_metrics, f"trial {i} metrics differ"
        state = study.state(CONFIG, hp, STEPS)
        assert state is not None, f"trial {i} has no checkpoint at its last step"
        assert_same_state(ref_state, state, f"trial{i}")


def test_branching_trials_on_two_nodes_are_exact(
    cluster: Any, references: Any, tmp_path: Path
) -> None:
    study = Study(
        "ray-a",
        DigitsTrainer,
        storage=f"sqlite:///{tmp_path}/plan.db",
        executor=_pinned("a", "b"),
    )
    try:
        results = _run_all(study)
        _check_exact(study, results, references)
        executor = study._engine.executor
        assert isinstance(executor, RayExecutor)
        nodes = executor.worker_nodes()
        assert len(set(nodes.values())) == 2, f"workers share a node: {nodes}"
        stats = study.stats()
        assert stats["steps_executed"] == stats["steps_unique"] < stats["steps_requested"]
        assert stats["workers_lost"] == 0
    finally:
        study.close()


@pytest.mark.skipif(not PG_URL, reason="set STAGETREE_TEST_DB_URL to run PostgreSQL tests")
def test_second_study_on_postgres_reuses_the_first_ones_stages(
    cluster: Any, references: Any, tmp_path: Path
) -> None:
    assert PG_URL is not None
    fresh = SQLPlanStorage(PG_URL)
    fresh.drop_all()
    fresh.close()
    version = f"ray-c-{uuid.uuid4().hex[:8]}"
    common = {"storage": PG_URL, "checkpoint_dir": tmp_path / "ckpt", "version": version}
    first = Study("ray-c1", DigitsTrainer, executor=_pinned("a", "b"), **common)
    try:
        _run_all(first)
        executed = first.stats()["steps_executed"]
    finally:
        first.close()
    second = Study("ray-c2", DigitsTrainer, executor=_pinned("b", "a"), **common)
    try:
        results = _run_all(second)
        _check_exact(second, results, references)
        # Nothing was trained for the second study (its own accounting), and nothing
        # more on the storage as a whole.
        assert second.stats()["steps_executed"] == 0, "the second study trained again"
        # (A study's progress() counts its own steps; the storage's totals count all.)
        with second.reading() as storage:
            assert storage_status(storage, PG_URL).totals["steps_executed"] == executed
    finally:
        second.close()


def test_node_removed_mid_study(cluster: Any, references: Any, tmp_path: Path) -> None:
    # A node of its own, removed while its worker trains (the others stay for later tests).
    doomed = cluster.add_node(num_cpus=1, resources={"node_c": 1})
    cluster.wait_for_nodes()
    study = Study(
        "ray-b",
        SlowDigits,
        storage=f"sqlite:///{tmp_path}/plan.db",
        executor=_pinned("a", "c"),
    )
    finished_before: dict[int, Any] = {}

    async def remove_node() -> None:
        deadline = time.monotonic() + 120
        # Wait until the doomed worker has trained and reported a few steps.
        while time.monotonic() < deadline:
            engine = study._engine
            executor = engine.executor
            running = executor._slots[1].running if isinstance(executor, RayExecutor) else set()
            batch = min(running, default=None)
            if batch is not None and study.progress()["steps_executed"] >= 6:
                # Freeze the workers (the batch must not end before the node is gone),
                # then check that the doomed worker's batch has steps past its last
                # durable checkpoint; else let it go on and try again.
                SlowDigits.HOLD.touch()
                await asyncio.sleep(0.5)
                with engine.lock:
                    rec = engine._batches.get(batch)
                    start, last = (rec.start_step, rec.last_step) if rec else (0, 0)
                    durable = rec.durable if rec and rec.durable is not None else start
                still = rec is not None and batch in executor._slots[1].running
                if still and last - max(start, durable) >= 2:  # steps that will be lost
                    break
                SlowDigits.HOLD.unlink()
            await asyncio.sleep(0.05)
        finished_before.update(_known_metrics(study))
        cluster.remove_node(doomed)
        SlowDigits.HOLD.unlink(missing_ok=True)

    try:
        results = _run_all(study, remove_node)
        _check_exact(study, results, references)
        stats = study.stats()
        assert stats["workers_lost"] >= 1
        assert stats["steps_lost"] >= 1, stats
        # Every lost step is recomputed, nothing else (live splits aside: none here).
        assert stats["splits_missed"] == 0
        assert stats["steps_executed"] == stats["steps_unique"] + stats["steps_lost"]
        after = _known_metrics(study)
        assert finished_before, "nothing had finished before the node was removed"
        for key, metrics in finished_before.items():
            assert after.get(key) == metrics, f"metrics at {key} were lost or changed"
        # The lost worker's replacement waits for room: a node with its resources.
        executor = study._engine.executor
        assert isinstance(executor, RayExecutor)
        assert 1 not in executor.worker_nodes()
        cluster.add_node(num_cpus=1, resources={"node_c": 1})
        deadline = time.monotonic() + 60
        while 1 not in executor.worker_nodes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 1 in executor.worker_nodes(), "no replacement once the cluster had room"
        assert executor.worker_nodes()[1] != executor.worker_nodes()[0]
    finally:
        study.close()


def _known_metrics(study: Study) -> dict[tuple[int, int], Any]:
    """Every stored metric on the trials' paths: ``(trial, step) -> metrics``."""
    out = {}
    with study._engine.lock:
        storage = study._engine.storage
        for i, hp in enumerate(TRIALS):
            history = storage.metrics_along(study.root_key(CONFIG), hp, STEPS)
            out.update({(i, step): m for step, m in history.items()})
    return out
