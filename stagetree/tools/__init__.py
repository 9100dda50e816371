"""Tools that load a user's study script or plan and report on it without training
for real: script loading, the exactness check, the simulator, checkpoint collection."""

from __future__ import annotations

__all__: list[str] = []
