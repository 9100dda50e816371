"""What the server and the dashboard share against local attacks: the generated token
file never follows a link, ports are 0-65535, and the loopback host names."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stagetree.cli import main
from stagetree.exceptions import StagetreeError
from stagetree.web.auth import server_token
from stagetree.web.hosts import allowed_hosts, host_name
from stagetree.web.listen import listen


def test_the_generated_token_is_never_written_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "plan.db.token"
    link.symlink_to(victim)
    token, path = server_token(None, f"sqlite:///{tmp_path / 'plan.db'}", "127.0.0.1")
    assert victim.read_text() == "precious\n"  # the link's target is untouched
    assert path == link and not path.is_symlink()
    info = path.lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert path.read_text().strip() == token


def test_a_link_to_a_private_file_is_not_read_as_the_token(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-secret-that-is-not-a-token-0123456789\n")
    os.chmod(secret, 0o600)
    (tmp_path / "plan.db.token").symlink_to(secret)
    token, _ = server_token(None, f"sqlite:///{tmp_path / 'plan.db'}", "127.0.0.1")
    assert token != "a-secret-that-is-not-a-token-0123456789"
    assert secret.read_text() == "a-secret-that-is-not-a-token-0123456789\n"
    # A token file the server wrote itself is reused.
    again, _ = server_token(None, f"sqlite:///{tmp_path / 'plan.db'}", "127.0.0.1")
    assert again == token


@pytest.mark.parametrize("port", [70000, -1, 65536])
def test_a_port_out_of_range_is_refused(port: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(StagetreeError, match="0-65535"):
        listen("127.0.0.1", port)
    for command in ("serve", "dashboard"):
        assert main([command, "--port", str(port)]) == 2  # a usage error: nothing listens
        assert "0-65535" in capsys.readouterr().err


def test_host_names() -> None:
    assert host_name("LocalHost:8642") == "localhost"
    assert host_name("[::1]:8642") == "::1" and host_name("[::1]") == "::1"
    assert host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("::1") == "::1"
    assert allowed_hosts("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("::1", ["Box.Lan", "[fe80::1]"]) >= {"box.lan", "fe80::1"}
    assert allowed_hosts("0.0.0.0") is None
    assert allowed_hosts("0.0.0.0", ["box.lan"]) == {"localhost", "127.0.0.1", "::1", "box.lan"}
