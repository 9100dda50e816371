"""Where a study's checkpoints go when it does not say."""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["default_checkpoint_dir"]


def default_checkpoint_dir(url: str) -> tuple[Path, bool]:
    """Where checkpoints go when the study does not say, and whether that directory is
    temporary (removed when the engine closes): beside a SQLite file; a temporary
    directory for an in-memory plan (nothing outlives it); ``./stagetree_checkpoints``
    otherwise (a server database: pass a directory every process can reach)."""
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///") :].split("?", 1)[0])  # without the URL's options
        return db.with_name(db.name + ".checkpoints"), False
    if url.startswith(("memory", ":memory:")):
        return Path(tempfile.mkdtemp(prefix="stagetree-ckpt-")), True
    return Path("stagetree_checkpoints"), False
