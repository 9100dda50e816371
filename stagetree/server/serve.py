"""``stagetree serve``: one process that owns the engines, executors and plan of every
study its clients tune (see :mod:`stagetree.server.app` for the API)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from stagetree.engine.coordination import lease_ttl as default_ttl
from stagetree.exceptions import StagetreeError
from stagetree.executors.base import BaseExecutor
from stagetree.executors.ray import RayExecutor
from stagetree.executors.registry import check_executor
from stagetree.extras import install_hint
from stagetree.plan.registry import open_storage
from stagetree.server.hub import Hub, HubConfig
from stagetree.server.protocol import DEFAULT_PORT
from stagetree.web.auth import server_token
from stagetree.web.hosts import allowed_hosts as hosts_allowed
from stagetree.web.listen import listen, quiet_server, shown_host

try:  # the routes need starlette (the server extra): serve() says what to install
    from stagetree.server.app import create_app
except ImportError:  # pragma: no cover - without the extra
    create_app = None  # type: ignore[assignment]

__all__ = ["DEFAULT_IDLE_RELEASE", "serve"]

#: Seconds an idle ``serve --executor ray`` keeps its actors before it gives their
#: resources back to the cluster (``--idle-release``).
DEFAULT_IDLE_RELEASE = 60.0


def serve(
    storage: str,
    *,
    executor: str = "local",
    workers: int | None = None,
    checkpoints: str | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token_file: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    lease_ttl: float | None = None,
    allowed_hosts: Iterable[str] = (),
    address: str | None = None,
    idle_release: float | None = DEFAULT_IDLE_RELEASE,
    out: TextIO | None = None,
) -> int:
    """Run a tuning server until SIGINT/SIGTERM; returns the exit status.

    Checks everything before listening: the token (a host other than loopback needs
    ``token_file``; on loopback a token is generated into a file of mode 0600, whose
    path, never the token, is printed), the executor name, TLS files given in pairs, the
    storage (opened once). ``lease_ttl`` (seconds) also sets ``STAGETREE_LEASE_TTL``
    for this process, so the plan's leases and the sessions expire alike. On a
    loopback host, requests whose ``Host`` or ``Origin`` name another host than
    ``localhost``, ``127.0.0.1``, ``[::1]`` or one of ``allowed_hosts`` are refused
    (403), against DNS rebinding (:mod:`stagetree.web.hosts`).

    With ``executor="ray"``: ``address`` is the Ray cluster (default: ``RAY_ADDRESS``,
    else the cluster ``ray start`` started on this machine, else a one-machine Ray), and
    after ``idle_release`` seconds without a running batch the actors are stopped and
    their resources given back to the cluster; the next submission starts them again
    (None: kept until the server stops).

    Raises:
        StagetreeError: bad options, naming the problem (nothing listens then).
    """
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise StagetreeError(f"stagetree serve needs {install_hint('server')}") from None

    stream = out if out is not None else sys.stdout
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise StagetreeError("TLS needs both --ssl-certfile and --ssl-keyfile")
    try:
        check_executor(executor)
    except ValueError as exc:
        raise StagetreeError(str(exc)) from None
    if executor == "simulated":
        raise StagetreeError(
            "a server trains for real: --executor simulated is for `stagetree simulate`"
        )
    workers_on = _executor(executor, address, idle_release)
    if lease_ttl is not None:
        if not lease_ttl > 0:
            raise StagetreeError(f"--lease-ttl must be > 0 seconds, got {lease_ttl}")
        os.environ["STAGETREE_LEASE_TTL"] = repr(float(lease_ttl))
    ttl = default_ttl()
    token, token_path = server_token(token_file, storage, host)
    try:
        open_storage(storage).close()  # a bad URL fails now, not at the first client
    except StagetreeError:
        raise
    except Exception as exc:
        raise StagetreeError(f"cannot open plan storage {storage!r}: {exc}") from None
    sock = listen(host, port)  # before anything is printed: a busy port fails here
    hub = Hub(HubConfig(storage, workers_on, workers, checkpoints, ttl))
    app = create_app(hub, token, hosts_allowed(host, allowed_hosts))
    scheme = "https" if ssl_certfile else "http"
    shown = shown_host(host)
    print(
        f"stagetree serve: {scheme}://{shown}:{port} (storage {storage}, executor "
        f"{_describe(executor, address, idle_release)}, session lease {ttl:g} s); token in "
        f"{token_path}",
        file=stream,
        flush=True,
    )
    print(
        f"stagetree serve: dashboard at {scheme}://{shown}:{port}/ (open it once with "
        "?token=<the token>)",
        file=stream,
        flush=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("stagetree serve: %(message)s"))
    server_log = logging.getLogger("stagetree.server")
    server_log.addHandler(handler)
    server_log.setLevel(logging.INFO)
    options: dict[str, Any] = {}
    if ssl_certfile is not None:
        options.update(ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
    try:
        quiet_server(app, host=host, port=port, **options).run(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits when its start-up fails
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        hub.close()  # also done by the app's shutdown; closing twice is harmless
        sock.close()
        server_log.removeHandler(handler)
    print(
        "stagetree serve: stopped (every study continues where it was at the next start)",
        file=stream,
        flush=True,
    )
    return 0


def _executor(name: str, address: str | None, idle_release: float | None) -> str | BaseExecutor:
    """What the hub's studies train on: the executor name, or for ``ray`` one
    :class:`RayExecutor` with the cluster address and idle release, shared by every
    study (one engine, one set of actors).

    Raises:
        StagetreeError: an address or an idle release for an executor without them.
    """
    if idle_release is not None and not idle_release > 0:
        raise StagetreeError(f"--idle-release must be > 0 seconds, got {idle_release:g}")
    if name != "ray":
        if address is not None:
            raise StagetreeError(
                f"--address is a Ray cluster's: it needs --executor ray, not {name}"
            )
        return name
    return RayExecutor(address=address, idle_release=idle_release)


def _describe(name: str, address: str | None, idle_release: float | None) -> str:
    if name != "ray":
        return name
    where = f"cluster {address}" if address else "cluster from RAY_ADDRESS or this machine"
    idle = f"released after {idle_release:g} s idle" if idle_release else "never released"
    return f"ray ({where}; workers {idle})"
