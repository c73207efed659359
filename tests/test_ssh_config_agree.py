"""What issue 24 found, piece by piece: each refusal is one line naming the file, the line, what
is wrong and the fix; the pieces (address forms, ProxyJump hops, Include globs, Debian's
group-writable rule) on their own.  ``tests/test_ssh_config_differential.py`` holds the whole to
the live ``ssh -G``."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines import hostlist, ssh_include
from ssh_scheduler.machines.config import load_machines
from ssh_scheduler.machines.ssh_config import read_config_file
from ssh_scheduler.machines.ssh_include import include_glob, secure_permissions
from ssh_scheduler.machines.ssh_jump import jump_text, parse_jump
from ssh_scheduler.machines.ssh_resolve import SshHost, resolve_host
from ssh_scheduler.machines.ssh_tokens import LocalAccount, ascii_lower, canonical_host

ACCOUNT = LocalAccount("localuser", "/nonexistent/localuser", os.getuid(), "testhost")


def resolve(tmp_path: Path, data: bytes | str, host: str = "gpu1") -> SshHost:
    config = tmp_path / "config"
    config.write_bytes(data.encode() if isinstance(data, str) else data)
    parsed = read_config_file(config, environ={"HOME": str(tmp_path)})
    assert parsed is not None
    return resolve_host(host, [parsed], ACCOUNT, environ={"HOME": str(tmp_path)})


def refusal(tmp_path: Path, data: bytes | str, host: str = "gpu1") -> str:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, data, host)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert str(tmp_path / "config") in message, message
    assert "(" in message, message  # says what to do
    return message


@pytest.mark.parametrize(
    "keyword",
    ["User", "Port", "HostName", "IdentityFile", "HostKeyAlias", "ConnectTimeout",
     "ForwardAgent", "IgnoreUnknown", "CanonicalizeHostname", "AddressFamily"],
)
def test_a_value_that_is_only_a_comment_is_one_line(tmp_path: Path, keyword: str) -> None:
    """It raised IndexError; ssh says "Missing argument"."""
    message = refusal(tmp_path, f"Host gpu1\n  {keyword} # nobody\n")
    assert f"line 2: {keyword} has no value" in message and "quote" in message
    assert f"line 2: {keyword} has no value" in refusal(tmp_path, f'Host other\n  {keyword} ""\n')


def test_known_hosts_given_only_a_comment_keeps_the_default(tmp_path: Path) -> None:
    """It was read as 'none': every host unknown."""
    assert resolve(tmp_path, "Host gpu1\n  UserKnownHostsFile # later\n").known_hosts is None
    assert resolve(tmp_path, "Host gpu1\n  UserKnownHostsFile none\n").known_hosts == ()


def test_old_hosts_keywords_are_known(tmp_path: Path) -> None:
    text = "Host gpu1\n  KexAlgorithms +diffie-hellman-group1-sha1\n  RSAAuthentication no\n"
    assert resolve(tmp_path, text + "  User old\n").user == "old"


def test_bytes_ssh_reads_as_they_are(tmp_path: Path) -> None:
    assert resolve(tmp_path, b"Host gpu1\r  User ben\r").user == "localuser"  # one line
    assert resolve(tmp_path, b"# caf\xe9\nHost gpu1 # \xe9\n  User ben # \xe9\n").user == "ben"
    assert resolve(tmp_path, b"Host other\n  User caf\xe9\nHost gpu1\n  Port 2\n").port == 2


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (b"Host gpu1\n  User caf\xe9\n", ["line 2", "not UTF-8 is not supported", "save"]),
        (b"Host gpu1\n  ProxyCommand nc %h # \xe9\n", ["line 2", "ProxyCommand", "not UTF-8"]),
        ("Host gpu1\n  HostName a\x01b\n", ["line 2", "control character", "remove it"]),
        ("\ufeffHost gpu1\n", ["line 1", "byte order mark", "save the file without it"]),
        ("\ufeff\nHost gpu1\n", ["line 1", "byte order mark"]),
        ("Host gpu1\n  \u212aexAlgorithms +x\n", ["line 2", "U+212A", "type it in ASCII"]),
        ("Host gpu1\n\f\n", ["line 2", "a stray '\\x0c'", "remove it"]),
        ("Host gpu1\n" + "".join(f"  IdentityFile ~/k{i}\n" for i in range(101)),
         ["line 102", "more than 100 IdentityFile", "remove some"]),
        ("Host gpu1\n  UserKnownHostsFile" + " /k" * 33 + "\n",
         ["line 2", "33 files", "limit of 32", "remove some"]),
        ("Host gpu1\n  ProxyJump ssh://[::1]\n", ["line 2", "invalid ProxyJump", "'::1'"]),
        ("Host gpu1\n  ProxyJump SSH://h\n", ["line 2", "invalid ProxyJump"]),
    ],
)
def test_refusals_are_one_line(tmp_path: Path, data: bytes | str, needles: list[str]) -> None:
    message = refusal(tmp_path, data)
    for needle in needles:
        assert needle in message, (needle, message)


def test_addresses_are_written_as_ssh_writes_them(tmp_path: Path) -> None:
    text = "Host gpu1\n  HostName 2001:db8:0:0:0:0:0:1\n  UserKnownHostsFile /kh/%h\n"
    resolved = resolve(tmp_path, text)
    assert (resolved.hostname, resolved.known_hosts) == ("2001:db8::1", ("/kh/2001:db8::1",))
    assert canonical_host("192.168.001.010", None) == "192.168.1.8"
    assert canonical_host("10.1", None) == "10.0.0.1"
    assert canonical_host("10.1", "inet6") == "10.1"  # not an address there, kept as written
    assert canonical_host("FE80::A", None) == "FE80::A"  # differs only in case: kept
    assert canonical_host("FOO:BAR", "any") == "FOO:BAR"  # looks like one: not lower-cased
    assert canonical_host("\u00c4BC.Example", None) == "\u00c4bc.example"
    assert ascii_lower("\u212aELVIN \u00c4") == "\u212aelvin \u00c4"


def test_match_host_folds_ascii_only(tmp_path: Path) -> None:
    text = "Host *\n  HostName \u00c4X\nMatch host \u00e4*\n  User folded\n"
    assert resolve(tmp_path, text).user == "localuser"
    assert resolve(tmp_path, "Host *\n  HostKeyAlias FooBar\n").host_key_alias == "foobar"


@pytest.mark.parametrize(
    ("value", "shown", "hops"),
    [
        ("ssh://u;fp=x@h", "u@h", [("u", "h", None)]),
        ("ssh://j.", "j", [(None, "j", None)]),
        ("ssh://a%40b@h", "a@b@h", [("a@b", "h", None)]),
        ("ssh://u+v@h:2022/", "u v@h:2022", [("u v", "h", 2022)]),
        ("10.0.0.1", "[10.0.0.1]", [(None, "10.0.0.1", None)]),
        ("p,a b,c", "p,a", [(None, "p", None), (None, "a", None)]),  # ssh ends it at a space
        ("a,b # c,d", "a,b", [(None, "a", None), (None, "b", None)]),
    ],
)
def test_jump_values_as_ssh_reads_them(
    value: str, shown: str, hops: list[tuple[str | None, str, int | None]]
) -> None:
    parsed = parse_jump(value)
    assert [(h.user, h.host, h.port) for h in parsed] == hops
    assert jump_text(value, parsed[-1]) == shown


@pytest.mark.parametrize(
    "value",
    ["SSH://h", "ssh://[::1]", "ssh://a@b@h", "ssh://-h", "ssh://a..b", "j/22", "ssh://h%20x",
     "ssh://h:22/p", "ssh://;x@h", "ssh://u%zz@h", "a, b"],
)
def test_jump_values_ssh_refuses(value: str) -> None:
    with pytest.raises(ValueError):
        parse_jump(value)


def test_include_glob_escapes_and_tilde(tmp_path: Path) -> None:
    (tmp_path / "x*.conf").write_text("")
    (tmp_path / "xa.conf").write_text("")
    (tmp_path / ".xb.conf").write_text("")
    assert include_glob(f"{tmp_path}/x\\*.conf", None) == [f"{tmp_path}/x*.conf"]
    assert include_glob(f"{tmp_path}/x*.conf", None) == [f"{tmp_path}/x*.conf", f"{tmp_path}/xa.conf"]
    assert include_glob("~/x[!*].conf", str(tmp_path)) == [f"{tmp_path}/xa.conf"]
    assert include_glob("~/nothing*", str(tmp_path)) == []
    root_home = pwd.getpwuid(0).pw_dir
    assert include_glob("~root", None) == [root_home]
    assert include_glob("~nosuchuser-x/y", str(tmp_path)) == []


def test_include_tilde_is_home_from_the_environment(tmp_path: Path) -> None:
    """Under sudo without -H, $HOME is the caller's, and so are ssh's Include paths."""
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "extra").write_text("Host gpu1\n  User from-home\n")
    config = tmp_path / "config"
    config.write_text("Include extra\n")
    parsed = read_config_file(config, environ={"HOME": str(tmp_path)})
    assert parsed is not None
    assert resolve_host("gpu1", [parsed], ACCOUNT).user == "from-home"
    other = read_config_file(config, environ={"HOME": str(tmp_path / "elsewhere")})
    assert other is not None and resolve_host("gpu1", [other], ACCOUNT).user == "localuser"


def _stat(uid: int, gid: int, mode: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


def test_debian_group_writable_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    users = [
        pwd.struct_passwd(("me", "x", 1000, 500, "", "/nonexistent/me", "/bin/sh")),
        pwd.struct_passwd(("other", "x", 1001, 501, "", "/nonexistent/other", "/bin/sh")),
    ]
    groups = {
        500: grp.struct_group(("me", "x", 500, [])),  # my private group
        501: grp.struct_group(("other", "x", 501, [])),  # somebody else's
        502: grp.struct_group(("listed", "x", 502, ["me"])),  # only me, listed
        503: grp.struct_group(("crowd", "x", 503, ["me", "other"])),
        504: grp.struct_group(("empty", "x", 504, [])),  # nobody
    }

    def getgrgid(gid: int) -> grp.struct_group:
        return groups[gid]

    def getpwuid(uid: int) -> pwd.struct_passwd:
        return next(u for u in users if u.pw_uid == uid)

    monkeypatch.setattr(ssh_include.grp, "getgrgid", getgrgid)
    monkeypatch.setattr(ssh_include.pwd, "getpwall", lambda: users)
    monkeypatch.setattr(ssh_include.pwd, "getpwuid", getpwuid)
    assert secure_permissions(_stat(1000, 500, 0o664), 1000)
    assert secure_permissions(_stat(1000, 502, 0o664), 1000)
    assert secure_permissions(_stat(1000, 501, 0o644), 1000)
    for gid in (501, 503, 504, 599):
        assert not secure_permissions(_stat(1000, gid, 0o664), 1000), gid
    assert not secure_permissions(_stat(1000, 500, 0o666), 1000)
    assert not secure_permissions(_stat(1001, 501, 0o644), 1000)  # not mine
    assert secure_permissions(_stat(0, 501, 0o644), 1000)  # root's


def test_group_writable_config_in_a_private_group_is_read(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host gpu1\n  User private\n")
    config.chmod(0o664)
    info = os.stat(config)
    parsed = read_config_file(config, check_permissions=True)
    if not secure_permissions(info, os.getuid()):  # a group with others in it: refused
        pytest.skip("this account's group is not private")
    assert parsed is not None and resolve_host("gpu1", [parsed], ACCOUNT).user == "private"


def test_wildcards_are_refused_as_machine_specs() -> None:
    """They became literal host names; ClusterShell reads them against a group source."""
    for spec in ("gpu*", "gpu?"):
        with pytest.raises(ConfigError, match=r"wildcards like .* are not supported"):
            load_machines([spec])
    assert hostlist.expand("gpu[1-2]") == ["gpu1", "gpu2"]
