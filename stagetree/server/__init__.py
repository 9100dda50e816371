"""A shared tuning server (``stagetree serve``) and the client a remote Study uses.

One server process owns the engines, executors and plan of every study its clients
tune; a client tunes against it over HTTP with the same :class:`~stagetree.Study` API
(``Study(..., url=..., token=...)`` returns a :class:`RemoteStudy`); its tuner runs
in the client's process.

Modules: :mod:`~stagetree.server.protocol` (versions, limits, JSON forms shared by
both sides), :mod:`~stagetree.server.trainers` (how trainers travel; the registry of
trainer classes), :mod:`~stagetree.server.hub` (studies, sessions, submissions),
:mod:`~stagetree.server.app` (the HTTP routes), :mod:`~stagetree.server.serve` (the
command: :func:`stagetree.server.serve.serve`), :mod:`~stagetree.server.client`; tokens
are :mod:`stagetree.web.auth`.

Importing this package imports the client side only, and neither starlette, uvicorn nor
httpx (the ``server`` extra): the client imports httpx when it first connects.
"""

from __future__ import annotations

from stagetree.exceptions import RemoteArgumentWarning
from stagetree.server.client import RemoteStudy
from stagetree.server.protocol import DEFAULT_PORT, PROTOCOL_VERSION

__all__ = ["DEFAULT_PORT", "PROTOCOL_VERSION", "RemoteArgumentWarning", "RemoteStudy"]
