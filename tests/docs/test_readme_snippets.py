"""The README's Python snippets run exactly as printed.

Convention: the ```python blocks are concatenated in the order they appear (a later
snippet may use what an earlier one defined, as a reader typing them into one file
would) and run as one script, which has no ``if __name__ == "__main__":`` guard: once with
``python`` and once with ``stagetree run``, on one storage.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stagetree.plan import open_storage

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_snippets() -> None:
    blocks = snippets()
    assert len(blocks) >= 4
    assert not any("__main__" in b for b in blocks)


def test_readme_snippets_run_as_printed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join(snippets()))
    first = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr
    assert "accuracy" in first.stdout
    assert "died" not in first.stderr
    url = f"sqlite:///{tmp_path / 'stagetree-readme.db'}"
    with open_storage(url) as plan:
        executed = plan.stats("engine")["steps_executed"]
    assert executed > 0
    cli = Path(sys.executable).with_name("stagetree")
    again = subprocess.run(
        [str(cli), "run", str(script), "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert "best accuracy" in again.stdout
    with open_storage(url) as plan:
        assert plan.stats("engine")["steps_executed"] == executed  # nothing trained twice


def test_readme_script_simulates_without_training(tmp_path: Path) -> None:
    """``stagetree simulate`` loads a script without a guard: the study the script tunes
    while it loads runs in virtual time on a throw-away storage, never for real."""
    pytest.importorskip("torch")
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join(snippets()))
    cli = Path(sys.executable).with_name("stagetree")
    done = subprocess.run(
        [str(cli), "simulate", str(script), "--workers", "4"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "stage-based (shared)" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["readme.py"]  # no storage made
