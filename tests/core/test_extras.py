"""Install hints say what works for how stagetree was installed (stagetree.extras)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import stagetree
from stagetree.extras import EXTRAS, Installation, install_hint, installation

ROOT = Path(__file__).resolve().parents[2]


def test_extras_are_those_of_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]
    declared.pop("dev", None)
    # Requirement names with their own extras, without versions.
    names = {
        extra: tuple(re.split(r"[<>=!~;\s]", req, maxsplit=1)[0] for req in reqs)
        for extra, reqs in declared.items()
    }
    assert names == EXTRAS


def test_hint_from_an_index_names_the_extra() -> None:
    assert install_hint("pandas", Installation("index")) == "pip install 'stagetree[pandas]'"


def test_hint_from_a_checkout_gives_the_packages_and_the_editable_extra() -> None:
    where = Installation("checkout", Path("/src/stagetree"))
    assert install_hint("pandas", where) == (
        "pip install pandas (stagetree[pandas]; or, in /src/stagetree: pip install -e '.[pandas]')"
    )
    # Requirements with extras are quoted for the shell.
    assert install_hint("server", where).startswith(
        "pip install starlette 'uvicorn[standard]' httpx (stagetree[server]; "
    )


def test_hint_from_a_directory_or_elsewhere() -> None:
    where = Installation("directory", Path("/src/stagetree"))
    assert (
        install_hint("s3", where)
        == "pip install s3fs (stagetree[s3]; or pip install '/src/stagetree[s3]')"
    )
    assert install_hint("optuna", Installation("other")) == (
        "pip install optuna (the packages of stagetree[optuna])"
    )


def test_this_checkout_is_seen_as_one() -> None:
    package = Path(stagetree.__file__).resolve().parent
    if package.parent != ROOT or "site-packages" in package.parts:
        pytest.skip("stagetree runs from an installed copy, not from this checkout")
    assert installation() == Installation("checkout", ROOT)
    assert f"in {ROOT}: pip install -e '.[pandas]'" in install_hint("pandas")
