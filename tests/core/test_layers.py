"""The package's architecture, checked from its source: imports go down the layers only.

The import graph counts the imports made inside functions (only ``if TYPE_CHECKING:``
blocks are left out), so a loop cannot hide behind a deferred import. A worker process
that imports the trainer contract must not load the study, the server or SQLAlchemy.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import stagetree

PACKAGE = Path(stagetree.__file__).resolve().parent

# Lazy facades (PEP 562): users import from them; modules inside stagetree import the
# defining module instead, so the graph below sees every real dependency.
FACADES = ("stagetree", "stagetree.plan", "stagetree.reports", "stagetree.executors")

# Floors, bottom first. A module may import its own floor or a lower one, never a higher.
LAYERS: list[tuple[str, ...]] = [
    (
        "stagetree.exceptions",
        "stagetree.extras",
        "stagetree.hp",
        "stagetree.distributions",
        "stagetree.space",
        "stagetree.names",
        "stagetree.identity",
        "stagetree.trainer",
        "stagetree.fusion",
        "stagetree.work",
        "stagetree.records",
        "stagetree.ranking",
        "stagetree._versions",
        "stagetree.progress",
        "stagetree.retry",
        "stagetree.torch",
    ),
    ("stagetree.plan",),
    ("stagetree.stages", "stagetree.scheduler", "stagetree.checkpoints"),
    ("stagetree.executors", "stagetree.tuners"),
    ("stagetree.engine", "stagetree.budget"),
    ("stagetree.reports",),
    # The study contract and both of its implementations; the wire format and the web
    # helpers the remote client shares with the server.
    (
        "stagetree.study_api",
        "stagetree.study",
        "stagetree.server.client",
        "stagetree.server.protocol",
        "stagetree.server._http",
        "stagetree.server.trainers",
        "stagetree.web",
    ),
    ("stagetree.tools",),
    ("stagetree.server", "stagetree.dashboard"),
    ("stagetree.cli",),
]

# The intended public names of ``import stagetree`` (exceptions: stagetree.exceptions).
PUBLIC = {
    "Budget",
    "CheckReport",
    "Choice",
    "Distribution",
    "GridSpace",
    "IntUniform",
    "LogUniform",
    "RandomSpace",
    "Shared",
    "Study",
    "Trainer",
    "TrialError",
    "TrialRecord",
    "TrialResult",
    "TrialSpec",
    "Uniform",
    "__version__",
    "check_trainer",
    "kwise_merge_rate",
    "load_space_file",
    "merge_rate",
    "open_storage",
    "simulate",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement outside ``if TYPE_CHECKING:``, with whether it runs
    inside a function."""

    def walk(
        node: ast.AST, in_function: bool
    ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    yield from walk(other, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
                continue
            inner = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            yield from walk(child, inner)

    yield from walk(tree, False)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """(imported stagetree module, name imported from it or '') of one statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, "") for alias in node.names if alias.name.startswith("stagetree")]
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not source.startswith("stagetree"):
        return []
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append((sub, "") if sub in MODULES else (source, alias.name))
    return out


def _owner(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _graph() -> tuple[dict[str, set[str]], list[str], list[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    deferred, through_facade = [], []
    for module, path in MODULES.items():
        for node, in_function in _imports(ast.parse(path.read_text())):
            for target, name in _targets(module, node):
                owner = _owner(target)
                where = f"{module}:{node.lineno} imports {target}{'.' + name if name else ''}"
                if in_function:
                    deferred.append(where)
                if name == "__version__" and owner == "stagetree":
                    continue  # defined in the facade itself: no import behind it
                if name and owner in FACADES and module != owner:
                    through_facade.append(where)
                if owner != module:
                    edges[module].add(owner)
    return edges, deferred, through_facade


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            groups.append(sorted(group))

    for v in edges:
        if v not in index:
            visit(v)
    return [g for g in groups if len(g) > 1]


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or module.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[1]):
                best = (level, len(prefix))
    return None if best is None else best[0]


EDGES, DEFERRED, THROUGH_FACADE = _graph()


def test_no_import_loop_counting_deferred_imports() -> None:
    assert _strongly_connected(EDGES) == []


def test_no_stagetree_import_is_deferred() -> None:
    # Deferred imports are for optional third-party extras only (torch, ray, ...).
    assert DEFERRED == []


def test_modules_import_the_defining_module_not_a_facade() -> None:
    assert THROUGH_FACADE == []


def test_every_module_has_a_floor() -> None:
    assert [m for m in MODULES if m not in FACADES and _layer(m) is None] == []


def test_imports_go_down_the_floors_only() -> None:
    upward = [
        f"{m} (floor {_layer(m)}) imports {t} (floor {_layer(t)})"
        for m, targets in sorted(EDGES.items())
        for t in sorted(targets)
        if m not in FACADES and t not in FACADES and (_layer(t) or 0) > (_layer(m) or 0)
    ]
    assert upward == []


def test_nothing_inside_imports_the_top_level_facade() -> None:
    assert sorted(m for m, targets in EDGES.items() if "stagetree" in targets) == []


def test_top_level_names_are_the_intended_ones() -> None:
    assert set(stagetree.__all__) == PUBLIC
    for name in stagetree.__all__:
        assert getattr(stagetree, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = stagetree.Nope  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "imported", ["stagetree.trainer", "stagetree.hp", "stagetree.executors.worker"]
)
def test_a_worker_import_stays_light(imported: str) -> None:
    heavy = ("sqlalchemy", "stagetree.study", "stagetree.server", "stagetree.engine")
    code = (
        f"import sys, importlib; importlib.import_module({imported!r}); "
        f"print(' '.join(m for m in {heavy!r} + ('stagetree.reports', 'starlette') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""
