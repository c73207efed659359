"""known_hosts files are parsed once per process while they stay unchanged, and read again
when they change: an appended key, an entry removed by ``ssh-keygen -R`` (which replaces the
file), a rewrite in place of the same size.  The trust decision is always the one the file's
current text gives (the matching itself is tests/test_hostkeys.py's)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from ssh_scheduler.errors import HostKeyError
from ssh_scheduler.transport import hostkeys
from ssh_scheduler.transport.hostkeys import KnownHosts
from ssh_scheduler.transport.ssh import connect
from tests.hostile_server import HostileServer, hostile_server


def key_line(name: str) -> tuple[str, asyncssh.SSHKey]:
    key = asyncssh.generate_private_key("ssh-ed25519").convert_to_public()
    return f"{name} {key.export_public_key().decode().strip()}\n", key


def trusted(path: Path, name: str) -> list[asyncssh.SSHKey]:
    return KnownHosts([str(path)]).lookup(name, "", 22)[0]


@pytest.fixture
def cache_settled_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache every file however recently it changed (as if it had been written long ago), so
    that only the signature (inode, size, mtime, ctime) can make a change seen."""
    monkeypatch.setattr(hostkeys, "RACY_NS", -(10**15))
    monkeypatch.setattr(hostkeys, "_parsed_files", {})


def test_an_unchanged_file_is_parsed_once(tmp_path: Path, cache_settled_files: None) -> None:
    path = tmp_path / "known_hosts"
    line, key = key_line("h1")
    path.write_text(line)
    first = hostkeys._parsed_file(str(path))
    assert hostkeys._parsed_file(str(path)) is first
    assert trusted(path, "h1") == [key]


def test_an_appended_key_is_seen(tmp_path: Path, cache_settled_files: None) -> None:
    path = tmp_path / "known_hosts"
    line1, key1 = key_line("h1")
    line2, key2 = key_line("h2")
    path.write_text(line1)
    assert trusted(path, "h1") == [key1] and trusted(path, "h2") == []
    with path.open("a") as f:
        f.write(line2)
    assert trusted(path, "h2") == [key2] and trusted(path, "h1") == [key1]


def test_an_entry_removed_by_ssh_keygen_is_no_longer_trusted(tmp_path: Path, cache_settled_files: None) -> None:
    path = tmp_path / "known_hosts"
    line1, key1 = key_line("h1")
    line2, _ = key_line("h2")
    path.write_text(line1 + line2)
    assert trusted(path, "h2") != []
    subprocess.run(["ssh-keygen", "-R", "h2", "-f", str(path)], check=True, capture_output=True)
    assert trusted(path, "h2") == [] and trusted(path, "h1") == [key1]


def test_a_deleted_file_trusts_nothing(tmp_path: Path, cache_settled_files: None) -> None:
    path = tmp_path / "known_hosts"
    line, _ = key_line("h1")
    path.write_text(line)
    assert trusted(path, "h1") != []
    path.unlink()
    assert trusted(path, "h1") == []


def test_a_same_size_rewrite_in_place_right_after_a_read_is_seen(tmp_path: Path) -> None:
    """The default rule: a file changed moments before it was read is not cached, since a
    second change in the same timestamp tick could leave its signature as it was."""
    path = tmp_path / "known_hosts"
    line1, key1 = key_line("h1")
    line2, key2 = key_line("h1")
    assert len(line1) == len(line2)
    path.write_text(line1)
    inode = path.stat().st_ino
    assert trusted(path, "h1") == [key1]
    with path.open("r+") as f:
        f.write(line2)
    assert path.stat().st_ino == inode and trusted(path, "h1") == [key2]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[HostileServer]:
    async with hostile_server(tmp_path) as srv:
        yield srv


async def test_a_key_replaced_between_connections_is_refused(server: HostileServer, cache_settled_files: None) -> None:
    good = f"[127.0.0.1]:{server.port} {server.host_key.export_public_key().decode().strip()}\n"
    server.known_hosts.write_text(good)
    transport = await connect(server.machine())
    await transport.close()
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    server.known_hosts.write_text(f"[127.0.0.1]:{server.port} {other}\n\n")  # one byte longer
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        await connect(server.machine())
