"""An engine polls a shared plan for other processes' nodes by what was appended since
its last poll, not by reading every tree it knows again (that made a study's driver
cost grow with the square of its trials on SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagetree.engine.coordination import Coordinator
from stagetree.hp import Constant, MultiStep
from stagetree.plan.sql import SQLPlanStorage
from stagetree.scheduler import NodeAdded


class CountingStorage(SQLPlanStorage):
    """An SQL plan that counts whole-tree reads."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.tree_reads = 0

    def nodes(self, root_key: str | None = None) -> list[Any]:
        self.tree_reads += 1
        return super().nodes(root_key)


class FakeEngine:
    """What a Coordinator reads of its engine: the storage and the known trees."""

    def __init__(self, storage: SQLPlanStorage) -> None:
        self.storage = storage
        self.roots: set[str] = set()
        self.nodes: set[int] = set()

    def known_roots(self) -> list[str]:
        return sorted(self.roots)

    def learn_node(self, node: int) -> bool:
        if node in self.nodes:
            return False
        self.nodes.add(node)
        return True

    def knows_node(self, node: int) -> bool:
        return node in self.nodes


def _lr(x: Any) -> dict[str, Any]:
    return {"lr": x}


def test_polls_read_what_was_appended_not_every_tree(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    mine, other = CountingStorage(url), SQLPlanStorage(url)
    try:
        roots = [f"tree-{i}" for i in range(20)]
        for i, root in enumerate(roots):
            other.insert_trial(root, _lr(MultiStep(0.1 * (i + 1), [10], 0.1)), 20)
        engine = FakeEngine(mine)
        coord = Coordinator(engine)  # type: ignore[arg-type]
        engine.roots.update(roots)
        first = coord._new_nodes()
        assert sorted(e.node.root_key for e in first) == sorted(roots)
        reads = mine.tree_reads
        for _ in range(5):
            assert coord._new_nodes() == []
        assert mine.tree_reads == reads  # no tree read again while nothing changed
        # Another process branches off one tree and grows one this engine does not know.
        child = other.insert_trial(roots[3], _lr(Constant(0.4)), 20).new_nodes[0]
        other.insert_trial("unknown", _lr(Constant(0.1)), 20)
        events = coord._new_nodes()
        assert [(type(e), e.node.id) for e in events] == [(NodeAdded, child.id)]
        assert mine.tree_reads == reads
        # A tree the engine learns of later is read whole once, then by the cursor.
        engine.roots.add("unknown")
        assert [e.node.root_key for e in coord._new_nodes()] == ["unknown"]
        assert mine.tree_reads == reads + 1
    finally:
        mine.close()
        other.close()
