"""``stagetree serve``: a shared tuning server (:func:`stagetree.server.serve.serve`)."""

from __future__ import annotations

import argparse

from stagetree.cli._options import port_number, positive
from stagetree.reports.open import default_storage
from stagetree.server.serve import DEFAULT_IDLE_RELEASE, serve

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree serve``: a shared tuning server (:func:`stagetree.server.serve.serve`)."""

    def handler(args: argparse.Namespace) -> int:
        return serve(
            args.storage or default_storage(),
            executor=args.executor,
            workers=args.workers,
            checkpoints=args.checkpoints,
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            lease_ttl=args.lease_ttl,
            allowed_hosts=args.allowed_host,
            address=args.address,
            idle_release=None if args.idle_release == 0 else args.idle_release,
        )

    p = sub.add_parser(
        "serve",
        help="run a shared tuning server that studies tune against (Study(url=...))",
        description="Own the engines, workers and plan of every study that clients tune "
        "over HTTP (Study(..., url=URL, token=...), STAGETREE_URL, stagetree run --url). "
        "Every request needs the token; without --token-file (loopback hosts only) one "
        "is generated into a file of mode 0600 whose path is printed.",
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help="plan storage (default: $STAGETREE_STORAGE or sqlite:///stagetree.db)",
    )
    p.add_argument(
        "--executor",
        default="local",
        metavar="NAME",
        help="where workers run: local (default), ray, inline...",
    )
    p.add_argument(
        "--workers", type=positive, metavar="N", help="workers of the one pool every study shares"
    )
    p.add_argument(
        "--checkpoints", metavar="URL", help="checkpoint location (default: beside a SQLite plan)"
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="the cluster of --executor ray: auto, HOST:6379 or ray://HOST:10001 "
        "(default: $RAY_ADDRESS, else the cluster `ray start` started here, else a "
        "one-machine Ray)",
    )
    p.add_argument(
        "--idle-release",
        type=float,
        default=DEFAULT_IDLE_RELEASE,
        metavar="S",
        help="with --executor ray: seconds without a running batch after which the "
        "workers give their resources back to the cluster; the next submission takes them "
        f"back (default {DEFAULT_IDLE_RELEASE:g}; 0: never)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8642, help="port (default 8642)")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name browsers may reach the server under besides localhost, "
        "127.0.0.1 and [::1] (repeatable; a guard against DNS rebinding)",
    )
    p.add_argument("--token-file", metavar="F", help="file holding the token (needed off loopback)")
    p.add_argument("--ssl-certfile", metavar="F", help="TLS certificate (PEM), with --ssl-keyfile")
    p.add_argument("--ssl-keyfile", metavar="F", help="TLS private key (PEM)")
    p.add_argument(
        "--lease-ttl",
        type=float,
        metavar="S",
        help="seconds before a silent client's session (and a dead server's plan leases) "
        "expire (default: $STAGETREE_LEASE_TTL or 15)",
    )
    p.set_defaults(handler=handler)
