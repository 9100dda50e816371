"""What the tuning server (:mod:`stagetree.server`) and the dashboard
(:mod:`stagetree.dashboard`) share: tokens and their checks (:mod:`.auth`), listening
sockets and how addresses are shown (:mod:`.listen`). Neither module imports starlette
or uvicorn."""

from __future__ import annotations

__all__: list[str] = []
