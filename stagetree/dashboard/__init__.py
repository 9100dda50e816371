"""The web dashboard: a read-only view of a plan storage in the browser (the stage tree
live, learning curves, the trials, the workers timeline, what sharing saved).

``stagetree dashboard STORAGE_URL`` serves it (:func:`serve_dashboard`), ``stagetree
run --dashboard`` beside a running study (:func:`start_dashboard`), and ``stagetree
serve`` at ``/``. Its queries are :mod:`stagetree.reports.views`; :mod:`.app` is the web layer
(:func:`create_dashboard_app`), ``static/`` the pages. Needs ``pip install
'stagetree[dashboard]'`` (starlette, uvicorn).
"""

from __future__ import annotations

from stagetree.dashboard.serve import (
    DEFAULT_PORT,
    DashboardServer,
    check_web,
    create_dashboard_app,
    serve_dashboard,
    start_dashboard,
)

__all__ = [
    "DEFAULT_PORT",
    "DashboardServer",
    "check_web",
    "create_dashboard_app",
    "serve_dashboard",
    "start_dashboard",
]
