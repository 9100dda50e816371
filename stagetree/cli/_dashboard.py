"""``stagetree dashboard``: the web dashboard of a storage
(:func:`stagetree.dashboard.serve_dashboard`)."""

from __future__ import annotations

import argparse

from stagetree.cli._options import port_number
from stagetree.dashboard import DEFAULT_PORT, serve_dashboard
from stagetree.reports.open import DEFAULT_STORAGE, STORAGE_ENV, default_storage

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stagetree dashboard``: the web dashboard of a storage
    (:func:`stagetree.dashboard.serve_dashboard`)."""

    def handler(args: argparse.Namespace) -> int:
        return serve_dashboard(
            args.storage or default_storage(),
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            checkpoints=args.checkpoints,
            show_token=args.show_token,
            allowed_hosts=args.allowed_host,
        )

    p = sub.add_parser(
        "dashboard",
        help="serve a web dashboard of a storage: the live stage tree, curves, savings",
        description="Serve a read-only dashboard of every study of STORAGE_URL (which "
        "other processes may be training): the stage tree live, learning curves, the "
        "trials, the workers timeline and what sharing saved. Listens on 127.0.0.1; on "
        "any other address every request needs the token of --token-file.",
    )
    p.add_argument(
        "storage",
        nargs="?",
        metavar="STORAGE_URL",
        help=f"plan storage URL (default: ${STORAGE_ENV} or {DEFAULT_STORAGE})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name browsers may reach the dashboard under besides localhost, "
        "127.0.0.1 and [::1] (repeatable; a guard against DNS rebinding)",
    )
    p.add_argument(
        "--token-file",
        metavar="F",
        help="file holding the token every request needs (required off loopback)",
    )
    p.add_argument(
        "--checkpoints",
        metavar="DIR",
        help="checkpoint location for downloads (default: beside a SQLite plan)",
    )
    p.add_argument(
        "--show-token",
        action="store_true",
        help="print the address with ?token= (puts the token on the terminal)",
    )
    p.set_defaults(handler=handler)
