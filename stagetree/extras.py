"""The optional extras (``pyproject.toml``'s ``[project.optional-dependencies]``) and
how to install one *here*.

``pip install 'stagetree[pandas]'`` works for a copy installed from a package index;
from a checkout (an editable install, or the source on ``sys.path``) it asks the index
for a package that is not this one. :func:`install_hint` says what works for how this
copy of stagetree was installed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EXTRAS", "Installation", "install_hint", "installation"]

#: Extra -> the packages it installs (pip requirement names, without versions).
EXTRAS: dict[str, tuple[str, ...]] = {
    "torch": ("torch", "scikit-learn"),
    "ray": ("ray[default]",),
    "postgres": ("psycopg[binary]",),
    "s3": ("s3fs",),
    "gcs": ("gcsfs",),
    "azure": ("adlfs",),
    "server": ("starlette", "uvicorn[standard]", "httpx"),
    "dashboard": ("starlette", "uvicorn[standard]"),
    "pandas": ("pandas",),
    "parquet": ("pyarrow",),
    "tensorboard": ("tensorboardX", "tensorboard"),
    "mlflow": ("mlflow-skinny",),
    "optuna": ("optuna",),
}

_PACKAGE = Path(__file__).resolve().parent  # this copy's stagetree/


@dataclass(frozen=True)
class Installation:
    """How the stagetree that runs was installed.

    Attributes:
        kind: ``"index"`` (a wheel from a package index: the extra's name works),
            ``"directory"`` (``pip install DIR``, not editable), ``"checkout"`` (an
            editable install, or the source on ``sys.path``), ``"other"`` (a VCS URL,
            an archive, or unknown: the plain packages work).
        project: the project directory of a ``directory`` or ``checkout`` kind.
    """

    kind: str
    project: Path | None = None


@functools.lru_cache(maxsize=1)
def installation() -> Installation:
    """How the running stagetree was installed (from its distribution's metadata and
    where this module's file lies; cached)."""
    project = _PACKAGE.parent
    if (project / "pyproject.toml").is_file() and "site-packages" not in _PACKAGE.parts:
        # The code runs from a source tree (editable install, or on the path); whatever
        # metadata is found (a build's stagetree.egg-info beside it) says nothing more.
        return Installation("checkout", project)
    try:
        dist: importlib.metadata.Distribution | None = importlib.metadata.distribution("stagetree")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    installed = False
    if dist is not None:
        own = Path(str(dist.locate_file("stagetree/__init__.py")))
        installed = own.is_file() and own.resolve() == _PACKAGE / "__init__.py"
    if dist is None or not installed:  # editable, or the source on sys.path
        project = _PACKAGE.parent
        if (project / "pyproject.toml").is_file():
            return Installation("checkout", project)
        return Installation("other")
    direct = dist.read_text("direct_url.json")
    if direct is None:  # PEP 610: no direct URL, so from an index
        return Installation("index")
    try:
        info = json.loads(direct)
    except ValueError:
        return Installation("other")
    url = str(info.get("url", ""))
    if "dir_info" in info and url.startswith("file:"):
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        editable = bool(info["dir_info"].get("editable"))
        return Installation("checkout" if editable else "directory", path)
    return Installation("other")


def _quoted(requirement: str) -> str:
    return requirement if re.fullmatch(r"[A-Za-z0-9._-]+", requirement) else f"'{requirement}'"


def install_hint(extra: str, where: Installation | None = None) -> str:
    """The command that installs ``extra``'s packages for this installation.

    Args:
        extra: an extra of :data:`EXTRAS` (another name is taken as one package).
        where: the installation (default: :func:`installation`).

    Returns:
        ``pip install 'stagetree[extra]'`` for a copy from an index; otherwise the
        plain packages, and the extra as it installs from the project directory.
    """
    where = installation() if where is None else where
    name = f"stagetree[{extra}]"
    if where.kind == "index":
        return f"pip install '{name}'"
    plain = "pip install " + " ".join(_quoted(p) for p in EXTRAS.get(extra, (extra,)))
    if where.kind == "checkout" and where.project is not None:
        return f"{plain} ({name}; or, in {where.project}: pip install -e '.[{extra}]')"
    if where.kind == "directory" and where.project is not None:
        return f"{plain} ({name}; or pip install '{where.project}[{extra}]')"
    return f"{plain} (the packages of {name})"
