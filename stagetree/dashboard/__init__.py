"""The web dashboard: a read-only view of a plan storage in the browser (the stage tree
live, learning curves, the trials, the workers timeline, what sharing saved).

``stagetree dashboard STORAGE_URL`` serves it (:func:`serve_dashboard`), ``stagetree
run --dashboard`` beside a running study (:func:`start_dashboard`), and ``stagetree
serve`` at ``/``. Its queries are :mod:`stagetree.views`; :mod:`.app` is the web layer
(:func:`create_dashboard_app`), ``static/`` the pages. Needs ``pip install
'stagetree[dashboard]'`` (starlette, uvicorn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagetree.dashboard.serve import (
    DEFAULT_PORT,
    DashboardServer,
    check_web,
    serve_dashboard,
    start_dashboard,
)

if TYPE_CHECKING:
    from stagetree.dashboard.app import create_dashboard_app

__all__ = [
    "DEFAULT_PORT",
    "DashboardServer",
    "check_web",
    "create_dashboard_app",
    "serve_dashboard",
    "start_dashboard",
]


def __getattr__(name: str) -> Any:
    # The web layer imports starlette: only when asked for, with a clear error without it.
    if name == "create_dashboard_app":
        check_web()
        from stagetree.dashboard.app import create_dashboard_app

        return create_dashboard_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
