"""Reading an ssh config file: what ssh skips, what it refuses and the one line a user gets,
and the size limit to the byte (``machines/ssh_config._read_config_bytes``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.ssh_config import MAX_CONFIG_BYTES, read_config_file
from ssh_scheduler.machines.ssh_resolve import resolve_host
from ssh_scheduler.machines.ssh_tokens import LocalAccount

ACCOUNT = LocalAccount("localuser", "/nonexistent/localuser", os.getuid(), "testhost")


def user_of(config: Path, check_permissions: bool = False) -> str:
    parsed = read_config_file(config, environ={"HOME": str(config.parent)}, check_permissions=check_permissions)
    assert parsed is not None
    return resolve_host("gpu1", [parsed], ACCOUNT, environ={"HOME": str(config.parent)}).user


def test_a_config_others_may_write_is_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host gpu1\n  User x\n")
    config.chmod(0o666)
    with pytest.raises(ConfigError) as refused:
        user_of(config, check_permissions=True)
    assert str(refused.value) == (
        f"{config}: bad owner or permissions (ssh refuses it too; make it yours and not writable by "
        "others, nor by a group that holds anybody else: chmod go-w)"
    )
    assert user_of(config) == "x"  # (a file named with -F is not checked, as ssh -F does not)


def test_a_config_that_cannot_be_opened_says_why(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.symlink_to(config)  # a loop: open fails with ELOOP, whoever we are
    with pytest.raises(ConfigError) as refused:
        user_of(config)
    assert str(refused.value) == (
        f"cannot read ssh config {config}: Too many levels of symbolic links (check it is readable)"
    )


def test_the_size_limit_holds_to_the_byte(tmp_path: Path) -> None:
    config = tmp_path / "config"
    tail = b"Host gpu1\n  User abc"
    config.write_bytes(b"#" * (MAX_CONFIG_BYTES - len(tail) - 1) + b"\n" + tail)
    assert config.stat().st_size == MAX_CONFIG_BYTES
    assert user_of(config) == "abc"  # the last byte read too
    config.write_bytes(b"#" * (MAX_CONFIG_BYTES - len(tail)) + b"\n" + tail)
    with pytest.raises(ConfigError) as refused:
        user_of(config)
    assert str(refused.value) == f"{config}: larger than {MAX_CONFIG_BYTES} bytes, not an ssh config"


def test_an_include_that_matches_a_directory_reads_nothing_from_it(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub.conf").mkdir(parents=True)  # a directory with a config's name
    (tmp_path / "d" / "z.conf").write_text("Host gpu1\n  User from-z\n")
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path}/d/*.conf\n")
    assert user_of(config) == "from-z"
