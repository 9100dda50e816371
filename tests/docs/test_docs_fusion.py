"""The complete script of ``docs/fusion.md`` runs as printed: with ``python`` (it has a
main guard), without its guard, and again with ``stagetree run`` on the same storage
(answered from the plan: nothing trained twice)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stagetree.plan import open_storage

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parents[2] / "docs" / "fusion.md"
#: One worker: the 8 continuations as one fused job, or 7 when the last request reached
#: the plan after the warm-up's batch was cut (on a loaded machine), and the worker
#: continued that one child itself.
ONE_JOB = re.compile(r"fused: 1 job\(s\) training [78] trials")


def script() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1
    return str(blocks[0])


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_fusion_script_runs_fused_as_printed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = tmp_path / "fused_grid.py"
    path.write_text(script())
    first = run([sys.executable, str(path)], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "best lr: Piecewise" in first.stdout
    assert ONE_JOB.search(first.stdout), first.stdout
    url = f"sqlite:///{tmp_path / 'fused.db'}"
    with open_storage(url) as plan:
        executed = plan.stats("engine")["steps_executed"]
    assert executed == 10 + 8 * 30  # the shared warm-up once
    cli = Path(sys.executable).with_name("stagetree")
    again = run([str(cli), "run", str(path), "--no-progress"], tmp_path)
    assert again.returncode == 0, again.stderr
    with open_storage(url) as plan:
        assert plan.stats("engine")["steps_executed"] == executed


def test_the_fusion_script_runs_without_its_main_guard(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    text = script()
    head, guarded = re.split(r'if __name__ == "__main__":[^\n]*\n', text)
    path = tmp_path / "unguarded.py"
    path.write_text(head + textwrap.dedent(guarded))
    done = run([sys.executable, str(path)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert ONE_JOB.search(done.stdout), done.stdout
