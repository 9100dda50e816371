"""An engine that holds stage leases adopts other engines' requests inside them by one
read a poll (the requests on the leased nodes), not by reading the requests of every
leased tree (one read a tree a poll made a study's driver cost grow with its size on
SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagetree.engine.coordination import Coordinator
from stagetree.hp import MultiStep
from stagetree.plan.sql import SQLPlanStorage
from stagetree.scheduler import RequestAdded, RequestCancelled


class CountingStorage(SQLPlanStorage):
    """An SQL plan that counts its reads of requests."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.reads = 0

    def request(self, node: int, step: int) -> Any:
        self.reads += 1
        return super().request(node, step)

    def requests(self, root_key: str | None = None, states: Any = None) -> Any:
        self.reads += 1
        return super().requests(root_key, states)

    def requests_on(self, nodes: Any) -> Any:
        self.reads += 1
        return super().requests_on(nodes)


class FakeScheduler:
    def __init__(self) -> None:
        self.live_requests: dict[tuple[int, int], int] = {}
        self.live_claims: dict[tuple[int, int], dict[str, int]] = {}


class FakeEngine:
    """What a Coordinator reads of its engine when it adopts requests."""

    def __init__(self, storage: SQLPlanStorage) -> None:
        self.storage = storage
        self.scheduler = FakeScheduler()
        self.nodes: set[int] = set()

    def has_waiters(self, node: int, step: int) -> bool:
        return False

    def knows_node(self, node: int) -> bool:
        return node in self.nodes


def test_adoption_reads_the_leased_nodes_requests_once_a_poll(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    mine, other = CountingStorage(url), SQLPlanStorage(url)
    try:
        engine = FakeEngine(mine)
        coord = Coordinator(engine)  # type: ignore[arg-type]
        leaves = []
        for i in range(20):  # 20 trees, each trained by this engine (a lease on 0-20)
            root = f"tree-{i}"
            ins = other.insert_trial(root, {"lr": MultiStep(0.1 * (i + 1), [30], 0.1)}, 20)
            node = ins.node
            engine.nodes.add(node)
            granted = mine.claim(coord.owner, root, [(node, 0, 20)], 60.0).granted
            coord._batch_leases[i] = granted
            leaves.append(node)
        # Another engine's request outside every lease (another step of a leased node
        # beyond the lease) is not adopted.
        other.add_request(leaves[0], 25)
        reads = mine.reads
        events = coord._adopt()
        assert sorted((type(e), e.node, e.step) for e in events) == [
            (RequestAdded, node, 20) for node in sorted(leaves)
        ]
        assert mine.reads == reads + 1  # one read, not one a leased tree
        for node in leaves:  # the scheduler took them
            engine.scheduler.live_requests[(node, 20)] = 1
            engine.scheduler.live_claims[(node, 20)] = {"": 1}
        for _ in range(3):
            reads = mine.reads
            assert coord._adopt() == []
            assert mine.reads == reads + 1
        # The other engine no longer wants one of them: it is dropped.
        other.release_request(leaves[5], 20)
        reads = mine.reads
        assert coord._adopt() == [RequestCancelled(leaves[5], 20, 1, study="")]
        assert mine.reads == reads + 1
    finally:
        mine.close()
        other.close()
