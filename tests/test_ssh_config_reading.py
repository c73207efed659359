"""Reading an ssh config file: what ssh skips, what it refuses and the one line a user gets,
and the size limit to the byte (``machines/ssh_config._read_config_bytes``)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.ssh_config import MAX_CONFIG_BYTES, read_config_file
from ssh_scheduler.machines.ssh_resolve import resolve_host
from ssh_scheduler.machines.ssh_tokens import LocalAccount
from tests.ssh_reference import make_reference

ACCOUNT = LocalAccount("localuser", "/nonexistent/localuser", os.getuid(), "testhost")


def user_of(config: Path, check_permissions: bool = False) -> str:
    parsed = read_config_file(config, environ={"HOME": str(config.parent)}, check_permissions=check_permissions)
    assert parsed is not None
    return resolve_host("gpu1", [parsed], ACCOUNT, environ={"HOME": str(config.parent)}).user


def refusal_of(config: Path, check_permissions: bool = False) -> str:
    """The one line reading ``config`` for host gpu1 is refused with."""
    with pytest.raises(ConfigError) as refused:
        user_of(config, check_permissions)
    return str(refused.value)


def test_a_config_others_may_write_is_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host gpu1\n  User x\n")
    config.chmod(0o666)
    assert refusal_of(config, check_permissions=True) == (
        f"{config}: bad owner or permissions (ssh refuses it too; make it yours and not writable by "
        "others, nor by a group that holds anybody else: chmod go-w)"
    )
    assert user_of(config) == "x"  # (a file named with -F is not checked, as ssh -F does not)


def test_a_config_that_cannot_be_opened_says_why(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.symlink_to(config)  # a loop: open fails with ELOOP, whoever we are
    assert refusal_of(config) == (
        f"cannot read ssh config {config}: Too many levels of symbolic links (check it is readable)"
    )


def test_the_size_limit_holds_to_the_byte(tmp_path: Path) -> None:
    config = tmp_path / "config"
    tail = b"Host gpu1\n  User abc"
    config.write_bytes(b"#" * (MAX_CONFIG_BYTES - len(tail) - 1) + b"\n" + tail)
    assert config.stat().st_size == MAX_CONFIG_BYTES
    assert user_of(config) == "abc"  # the last byte read too
    config.write_bytes(b"#" * (MAX_CONFIG_BYTES - len(tail)) + b"\n" + tail)
    assert refusal_of(config) == f"{config}: larger than {MAX_CONFIG_BYTES} bytes, not an ssh config"


def test_an_include_that_matches_a_directory_reads_nothing_from_it(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub.conf").mkdir(parents=True)  # a directory with a config's name
    (tmp_path / "d" / "z.conf").write_text("Host gpu1\n  User from-z\n")
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path}/d/*.conf\n")
    assert user_of(config) == "from-z"


def chain(folder: Path, deep: int) -> Path:
    """A config that includes a file that includes one... ``deep`` Includes down, the last
    file setting the user."""
    files = [folder / f"c{n}" for n in range(deep + 1)]
    for here, below in itertools.pairwise(files):
        here.write_text(f"Include {below}\n")
    files[-1].write_text("Host gpu1\n  User deepest\n")
    return files[0]


def test_includes_nest_sixteen_deep_as_in_ssh(tmp_path: Path) -> None:
    ref = make_reference(tmp_path / "ref")
    (tmp_path / "ok").mkdir()
    top = chain(tmp_path / "ok", 16)
    status, values, stderr = ref.run("gpu1", top)
    assert (status, values.get("user")) == (0, ["deepest"]), stderr
    assert user_of(top) == "deepest"
    (tmp_path / "deep").mkdir()
    top = chain(tmp_path / "deep", 17)
    assert ref.run("gpu1", top)[0] != 0  # ssh: "Too many recursive configuration includes"
    assert refusal_of(top) == (
        f"{tmp_path / 'deep' / 'c17'}: Include nested more than 16 deep (an Include loop? remove it)"
    )


def test_a_refusal_in_an_included_file_names_that_file_and_line(tmp_path: Path) -> None:
    included = tmp_path / "inc.conf"
    included.write_text("# first\nHost gpu1\n  Port x\n")
    config = tmp_path / "config"
    config.write_text(f"Include {included}\n")
    with pytest.raises(ConfigError, match=rf"^{included} line 3: "):
        user_of(config)


def test_a_file_the_system_config_includes_is_read_as_the_system_config(tmp_path: Path) -> None:
    """No '~' in the system config's Includes, in the files it includes either."""
    included = tmp_path / "inc.conf"
    included.write_text("Include ~/more.conf\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Include {included}\n")
    with pytest.raises(ConfigError) as refused:
        read_config_file(config, environ={"HOME": str(tmp_path)}, user_config=False)
    assert str(refused.value) == f"{included} line 1: Include '~/more.conf': '~' is not allowed in the system config"
    parsed = read_config_file(config, environ={"HOME": str(tmp_path)})  # as a user's: '~' is $HOME
    assert parsed is not None


def test_a_file_an_include_reads_is_checked_as_ssh_checks_it(tmp_path: Path) -> None:
    """Even under a config named on the command line (-F, itself not checked), an included
    file others may write is refused, as the live ssh refuses it."""
    included = tmp_path / "inc.conf"
    included.write_text("Host gpu1\n  User inc\n")
    included.chmod(0o666)
    config = tmp_path / "config"
    config.write_text(f"Include {included}\n")
    ref = make_reference(tmp_path / "ref")
    status, _, stderr = ref.run("gpu1", config)
    assert status != 0 and f"Bad owner or permissions on {included}" in stderr
    assert refusal_of(config).startswith(f"{included}: bad owner or permissions")
