"""The server's bearer token: where it comes from, and how a request is checked.

Every request carries ``Authorization: Bearer <token>``; the token is compared with
:func:`hmac.compare_digest`. A missing or malformed header is a 401, a wrong token a
403. Tokens never appear in logs, messages or the server's output: the server prints
the path of its token file, never the token.

A server on a loopback host may generate its token: :func:`server_token` writes a new
one (``secrets.token_urlsafe``) to a file with mode 0600, or reads the one it wrote
before (so that a restarted server accepts the clients of the previous one). It never
follows a symbolic link at that path (a link there is replaced, its target untouched).
A server on any other host needs ``--token-file``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from pathlib import Path

from stagetree.exceptions import RequestRefusedError, StagetreeError

__all__ = [
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "check_authorization",
    "client_token",
    "default_token_file",
    "is_loopback",
    "read_token_file",
    "server_token",
]

TOKEN_ENV = "STAGETREE_TOKEN"
TOKEN_FILE_ENV = "STAGETREE_TOKEN_FILE"
_MIN_LENGTH = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (``127.0.0.1``, ``::1``,
    ``localhost``); ``0.0.0.0``, ``::`` and other names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding whitespace stripped).

    Raises:
        StagetreeError: no such file, it cannot be read, or it holds too short a token
            (the message names the file, never its content).
    """
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise StagetreeError(
            f"cannot read the token file {path}: {exc.__class__.__name__}"
        ) from None
    if len(token) < _MIN_LENGTH or any(c.isspace() for c in token):
        raise StagetreeError(
            f"the token file {path} must hold one token of at least {_MIN_LENGTH} characters "
            "without spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    return token


def default_token_file(storage: str) -> Path:
    """Where a generated token goes: beside a SQLite plan (``plan.db.token``), else
    ``./stagetree-server.token``."""
    if storage.startswith("sqlite:///") and storage[len("sqlite:///") :] not in ("", ":memory:"):
        db = Path(storage[len("sqlite:///") :])
        return db.with_name(db.name + ".token")
    return Path("stagetree-server.token")


def server_token(
    token_file: str | os.PathLike[str] | None, storage: str, host: str
) -> tuple[str, Path]:
    """The server's token and the file it is in.

    With ``token_file``, read it. Without, on a loopback host only: reuse the token of
    :func:`default_token_file` when this user wrote it with mode 0600, else write a new
    one there with mode 0600.

    Raises:
        StagetreeError: no token file for a host other than loopback, or a token file
            that cannot be read or written.
    """
    if token_file is not None:
        return read_token_file(token_file), Path(token_file)
    if not is_loopback(host):
        raise StagetreeError(
            f"refusing to listen on {host} without --token-file: anyone who reaches the "
            "server could run code on it. Write a token to a file only you can read "
            "(python -c 'import secrets; print(secrets.token_urlsafe())' > server.token; "
            "chmod 600 server.token) and pass --token-file server.token, or listen on "
            "127.0.0.1"
        )
    # Never follow a link at the token path: a link placed there would have the server
    # read a token from, or write one into, a file of the link's choosing.
    path = Path(os.path.abspath(default_token_file(storage)))
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    if (
        info is not None
        and stat.S_ISREG(info.st_mode)
        and stat.S_IMODE(info.st_mode) == 0o600
        and info.st_uid == os.getuid()
    ):
        try:
            return read_token_file(path), path
        except StagetreeError:
            pass  # unusable: write a new one
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # the link itself, never its target
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
    except OSError as exc:
        raise StagetreeError(f"cannot write the token file {path}: {exc.strerror or exc}") from None
    return token, path


def client_token(token: str | None, override: str | None = None) -> str | None:
    """The token a client sends: ``token``, else ``override`` (``stagetree run
    --token-file``), else ``$STAGETREE_TOKEN``, else the file ``$STAGETREE_TOKEN_FILE``;
    None when there is none.

    Raises:
        StagetreeError: ``$STAGETREE_TOKEN_FILE`` cannot be read.
    """
    if token:
        return token
    if override:
        return override
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    return read_token_file(path) if path else None


def check_authorization(header: str | None, token: str) -> None:
    """Accept ``Authorization: Bearer <token>``.

    Raises:
        RequestRefusedError: 401 when the header is missing or malformed, 403 when the token
            is wrong (messages never contain a token).
    """
    if not header:
        raise RequestRefusedError(
            401,
            "AuthError",
            "missing Authorization header: send 'Authorization: Bearer <token>' (clients: "
            "Study(..., token=...), STAGETREE_TOKEN or STAGETREE_TOKEN_FILE)",
        )
    scheme, _, given = header.partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        raise RequestRefusedError(
            401, "AuthError", "malformed Authorization header: expected 'Bearer <token>'"
        )
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise RequestRefusedError(403, "AuthError", "wrong token")
