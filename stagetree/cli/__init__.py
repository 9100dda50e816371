"""The ``stagetree`` command: :mod:`.main` builds the parser and dispatches to one module
per subcommand (:mod:`.explain`, :mod:`.run`, :mod:`.status`, :mod:`.export`,
:mod:`.simulate`, :mod:`.check`, :mod:`.serve`, :mod:`.dashboard`, :mod:`.gc`);
:mod:`.format` prints what several of them share, :mod:`.options` holds their shared
argument types and exit statuses, and :mod:`stagetree.reports.open` opens the storage a
command reads. Each command module has ``add_parser(sub)``, which adds its subparser and
sets ``handler`` to a function ``(args) -> int``.
"""

from __future__ import annotations

__all__: list[str] = []
