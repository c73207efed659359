"""Rules of the ssh config code that the mutation run of the ``sshconfig`` group
(``scripts/mutation sshconfig``, docs/mutation.md) found no test stating: which files an
``Include`` reads (ssh's own glob, where the live ``ssh -G`` can tell, it is asked), which config
files are trusted, and the exact line a user gets for a refused value."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import socket
import stat
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines import ssh_include
from ssh_scheduler.machines.ssh_config import parse_config_text, read_config_file
from ssh_scheduler.machines.ssh_include import include_glob, secure_permissions
from ssh_scheduler.machines.ssh_resolve import SshHost, resolve_host
from ssh_scheduler.machines.ssh_tokens import (
    LocalAccount,
    canonical_host,
    convtime,
    current_account,
)
from tests.ssh_reference import Reference, make_reference


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    assert shutil.which("ssh"), "openssh-client is installed by scripts/test"
    return make_reference(tmp_path_factory.mktemp("sshref"))


def ssh_user(ref: Reference, config: Path, host: str = "gpu1") -> str:
    """The user the live ``ssh -G`` takes for ``host`` with ``config``."""
    status, values, stderr = ref.run(host, config)
    assert status == 0, stderr
    return values["user"][0]


# --- Include: which files ------------------------------------------------------------------


def test_include_reads_the_files_of_every_directory_a_wildcard_matched(tmp_path: Path) -> None:
    """``d*/c.conf`` and ``d*//c.conf``: the file under each matching directory, in order (an
    empty component is the directory itself)."""
    for name in ("d1", "d2", "e3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "c.conf").write_text("")
    both = [f"{tmp_path}/d1/c.conf", f"{tmp_path}/d2/c.conf"]
    assert include_glob(f"{tmp_path}/d*/c.conf", None) == both
    assert include_glob(f"{tmp_path}/d*//c.conf", None) == both


def test_include_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pattern with a '/' but not at its start (only a caller other than the config reader
    gives one: the reader puts ``~/.ssh/`` or ``/etc/ssh/`` before it) is glob(3)'s: from the
    working directory, and the names come back relative."""
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "xa.conf").write_text("")
    monkeypatch.chdir(tmp_path)
    assert include_glob("rel/x*.conf", None) == ["rel/xa.conf"]
    assert include_glob("rel/xa.conf", None) == ["rel/xa.conf"]
    assert include_glob("re*/x*.conf", None) == ["rel/xa.conf"]


def test_include_dot_star_walks_through_dot_dot_as_glibc(ref: Reference, tmp_path: Path) -> None:
    """glibc's readdir lists '.' and '..', and '.*' matches both: ``sub/.*/b.conf`` reads
    ``sub/../b.conf`` (the live ssh does)."""
    base = tmp_path / "conf"
    (base / "sub").mkdir(parents=True)
    (base / "b.conf").write_text("Host gpu1\n  User through-dotdot\n")
    assert include_glob(f"{base}/sub/.*/b.conf", None) == [f"{base}/sub/../b.conf"]
    (base / "sub" / "b.conf").write_text("Host gpu1\n  User through-dot\n")
    assert include_glob(f"{base}/sub/.*/b.conf", None) == [
        f"{base}/sub/../b.conf",
        f"{base}/sub/./b.conf",
    ]
    config = tmp_path / "config"
    config.write_text(f"Include {base}/sub/.*/b.conf\n")
    parsed = read_config_file(config, environ=ref.env)
    assert parsed is not None
    users = [sub.lines[1].args[0] for sub in parsed.lines[0].includes]
    assert users == ["through-dotdot", "through-dot"]
    assert ssh_user(ref, config) == "through-dotdot"


def test_include_names_come_sorted_by_their_bytes(tmp_path: Path) -> None:
    """glob(3) sorts by the bytes of the names: a name that is not UTF-8 (byte 0xff, kept as
    U+DCFF) comes after U+E000 (ee 80 80), where Python's text order puts it before."""
    names = [b"cz.conf", b"c\xee\x80\x80.conf", b"c\xff.conf"]
    for name in names:
        with open(os.fsencode(tmp_path) + b"/" + name, "w"):
            pass
    found = include_glob(f"{tmp_path}/c*.conf", None)
    assert [os.fsencode(p).rsplit(b"/", 1)[1] for p in found] == names


def test_include_of_a_home_alone_is_that_directory(tmp_path: Path) -> None:
    """``Include ~`` and ``Include ~user`` name a directory (read as empty); ``~`` with no home
    known and an unknown user stay as written, and match nothing."""
    me = pwd.getpwuid(os.getuid())
    assert include_glob("~", str(tmp_path)) == [str(tmp_path)]
    assert include_glob("~", str(tmp_path / "not-there")) == []
    assert include_glob("~", None) == []
    assert include_glob(f"~{me.pw_name}", None) == [me.pw_dir]
    assert include_glob(f"~{me.pw_name}/", None) == [me.pw_dir]
    # a backslash before a character of the user name is dropped, as glob's escape
    escaped = me.pw_name[0] + "\\" + me.pw_name[1:]
    assert include_glob(f"~{escaped}", None) == [me.pw_dir]
    # "~\" is "~", and "~/x" with no home known matches no file
    assert include_glob("~\\/", str(tmp_path)) == [str(tmp_path)]
    assert include_glob("~/x.conf", None) == []
    (tmp_path / "file").write_text("")
    assert include_glob("~/file", str(tmp_path)) == [f"{tmp_path}/file"]


def test_system_config_includes_are_under_etc_ssh() -> None:
    """In /etc/ssh/ssh_config a relative Include is under /etc/ssh/, and '~' is refused."""
    asked: list[str] = []

    def read_include(pattern: str, _including: str) -> list[tuple[str, str]]:
        asked.append(pattern)
        return []

    parse_config_text("Include a.conf b/*.conf\n", source="/etc/ssh/ssh_config", user_config=False,
                      read_include=read_include)
    parse_config_text("Include a.conf\n", source="/users/u/.ssh/config", read_include=read_include)
    assert asked == ["/etc/ssh/a.conf", "/etc/ssh/b/*.conf", "~/.ssh/a.conf"]
    with pytest.raises(ConfigError) as info:
        parse_config_text("Host *\nInclude ~/x.conf\n", source="/etc/ssh/ssh_config",
                          user_config=False, read_include=read_include)
    assert str(info.value) == (
        "/etc/ssh/ssh_config line 2: Include '~/x.conf': '~' is not allowed in the system config"
    )


def test_an_empty_include_argument_is_refused(ref: Reference, tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text('Host gpu1\nInclude a.conf ""\n')
    status, _, _ = ref.run("gpu1", config)
    assert status != 0  # ssh refuses it too
    with pytest.raises(ConfigError) as info:
        read_config_file(config, environ=ref.env)
    assert str(info.value) == f"{config} line 2: Include has an empty argument (remove it)"


# --- which config files are trusted ----------------------------------------------------------


def _stat(uid: int, gid: int, mode: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


def test_only_writing_by_others_makes_a_config_untrusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Others and a crowded group may read and execute it; only their write bit counts.  An
    owner the account database does not know cannot be a group's only member."""
    users = [pwd.struct_passwd(("me", "x", 1000, 500, "", "/nonexistent/me", "/bin/sh")),
             pwd.struct_passwd(("other", "x", 1001, 501, "", "/nonexistent/o", "/bin/sh"))]
    groups = {500: grp.struct_group(("me", "x", 500, [])),
              503: grp.struct_group(("crowd", "x", 503, ["me", "other"]))}

    def getpwuid(uid: int) -> pwd.struct_passwd:
        found = [u for u in users if u.pw_uid == uid]
        if not found:
            raise KeyError(uid)
        return found[0]

    monkeypatch.setattr(ssh_include.grp, "getgrgid", lambda gid: groups[gid])
    monkeypatch.setattr(ssh_include.pwd, "getpwall", lambda: users)
    monkeypatch.setattr(ssh_include.pwd, "getpwuid", getpwuid)
    for mode in (0o645, 0o655, 0o641, 0o651, 0o755):
        assert secure_permissions(_stat(1000, 503, mode), 1000), oct(mode)
    assert not secure_permissions(_stat(1000, 503, 0o646), 1000)
    assert not secure_permissions(_stat(1000, 503, 0o664), 1000)
    assert secure_permissions(_stat(1000, 500, 0o664), 1000)
    # root's file in my private group, where root is unknown to the database: refused
    users[:] = [users[0]]
    assert not secure_permissions(_stat(0, 500, 0o664), 1000)


# --- small values ----------------------------------------------------------------------------


def test_convtime_as_ssh() -> None:
    assert [convtime(t) for t in ("", "90", "1m30s", "2H", "1w", "x", "1m x", str(2**31))] == [
        -1, 90, 90, 7200, 604800, -1, -1, -1
    ]


def test_the_local_account_names_this_host() -> None:
    """``%l`` and ``%L`` (and ``%C``'s hash) are the local host name."""
    account = current_account()
    entry = pwd.getpwuid(os.getuid())
    assert (account.user, account.home, account.uid, account.hostname) == (
        entry.pw_name, entry.pw_dir, entry.pw_uid, socket.gethostname()
    )


# --- the line a user gets --------------------------------------------------------------------

ACCOUNT = LocalAccount("localuser", "/nonexistent/localuser", os.getuid(), "testhost")


def resolve(tmp_path: Path, data: bytes, host: str = "gpu1") -> SshHost:
    config = tmp_path / "config"
    config.write_bytes(data)
    parsed = read_config_file(config, environ={"HOME": str(tmp_path)})
    assert parsed is not None
    return resolve_host(host, [parsed], ACCOUNT, environ={"HOME": str(tmp_path)})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xef\xbb\xbf\nHost gpu1\n", "line 1: the file starts with a UTF-8 byte order mark, "
         "which ssh refuses too (save the file without it)"),
        (b"Host gpu1\nHost\n", "line 2: no value after 'Host' (give one)"),
        (b"\xef\xbb\xbfHost gpu1\n", "line 1: unknown keyword '\\ufeffHost': the file starts "
         "with a UTF-8 byte order mark, which ssh refuses too (save the file without it)"),
        ("Host gpu1\n  \u212aexAlgorithms +x\n".encode(), "line 2: unknown keyword "
         "'\u212aexAlgorithms': it has the non-ASCII character '\u212a' (U+212A), which ssh "
         "refuses too (type it in ASCII)"),
        (b"Host gpu1\n  Usr x\n", "line 2: unknown keyword 'Usr' (ssh refuses it too; fix the "
         "spelling, or list it in IgnoreUnknown)"),
        # Match host reads HostName with %h expanded: a bad token there names the HostName line
        (b"Host *\n  HostName a%zb\nMatch host x\n  User y\n",
         "line 2: HostName: unknown token '%z' (known here: %h %%)"),
        ("Host gpu1\n  ProxyJump ssh://%\u00e9@h\n".encode(), "line 2: invalid ProxyJump: hop "
         "'ssh://%\u00e9@h': bad %-escape in '%\u00e9' (ssh refuses it too; write "
         "[user@]host[:port] or ssh://[user@]host[:port], hops separated by commas)"),
        (b"Host gpu1\n  ProxyJump ssh://caf\xe9@h\n", "line 2: ProxyJump: a value with bytes "
         "that are not UTF-8 is not supported (save the file as UTF-8)"),
        (b"Host gpu1\n  ConnectTimeout 2147483648\n",
         "line 2: ConnectTimeout '2147483648' is not a time (like 10 or 1m)"),
        (("Host gpu1\n" + "".join(f"  IdentityFile ~/k{i}\n" for i in range(101))).encode(),
         "line 102: more than 100 IdentityFile lines apply (ssh refuses this too; remove some)"),
        (b"Host gpu1\n  ProxyJump ssh://[]\n", "line 2: invalid ProxyJump: hop 'ssh://[]': no "
         "host (ssh refuses it too; write [user@]host[:port] or ssh://[user@]host[:port], hops "
         "separated by commas)"),
        (b"Host gpu1\n  ProxyJump ssh://a..b\n", "line 2: invalid ProxyJump: hop 'ssh://a..b': "
         "host 'a..b' has two dots in a row (ssh refuses it too; write [user@]host[:port] or "
         "ssh://[user@]host[:port], hops separated by commas)"),
        (b"Host gpu1\n  ProxyJump ssh://a*b\n", "line 2: invalid ProxyJump: hop 'ssh://a*b': "
         "host 'a*b' has characters other than letters, digits, '.-_' (ssh refuses it too; "
         "write [user@]host[:port] or ssh://[user@]host[:port], hops separated by commas)"),
    ],
)
def test_each_refusal_says_exactly_this(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, data)
    assert str(info.value) == f"{tmp_path / 'config'} {message}"


def test_a_jump_user_that_is_not_utf8_is_left_alone_where_it_does_not_apply(
    ref: Reference, tmp_path: Path
) -> None:
    """Every ProxyJump line is checked, applied or not, as ssh checks it; bytes that are not
    UTF-8 in its user are refused only where the value is used (ssh takes them)."""
    data = b"Host other\n  ProxyJump ssh://caf\xe9@h\nHost gpu1\n  User u\n"
    assert resolve(tmp_path, data).user == "u"
    assert ssh_user(ref, tmp_path / "config") == "u"


@pytest.mark.parametrize(
    "value", ["90", "1m30s", "1h1M1s", "2147483647", "35791394m", "0", "none"]
)
def test_connect_timeout_as_ssh(ref: Reference, tmp_path: Path, value: str) -> None:
    """Each part of a time adds up, in seconds, up to 2^31 - 1; none and 0 are no timeout
    (ssh shows 0 as it is, and waits without a limit)."""
    resolved = resolve(tmp_path, f"Host gpu1\n  ConnectTimeout {value}\n".encode())
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0, stderr
    shown = "0" if value == "0" else "none"
    assert values["connecttimeout"] == [str(resolved.connect_timeout or shown)]


@pytest.mark.parametrize("value", ["2147483648", "35791395m", "1x", "m"])
def test_connect_timeout_ssh_refuses(ref: Reference, tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="is not a time"):
        resolve(tmp_path, f"Host gpu1\n  ConnectTimeout {value}\n".encode())
    status, _, _ = ref.run("gpu1", tmp_path / "config")
    assert status != 0


def test_identity_and_certificate_files_are_counted_apart(ref: Reference, tmp_path: Path) -> None:
    """The same path as a CertificateFile and an IdentityFile is both; 60 of each is under
    each one's limit of 100."""
    certs = "".join(f"  CertificateFile ~/k{i}\n" for i in range(60))
    keys = "".join(f"  IdentityFile ~/k{i}\n" for i in range(60))
    resolved = resolve(tmp_path, f"Host gpu1\n{certs}{keys}".encode())
    assert resolved.identity_files == tuple(f"~/k{i}" for i in range(60))
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0, stderr
    assert values["identityfile"] == list(resolved.identity_files)


def test_an_ssh_uri_host_loses_one_trailing_dot(ref: Reference, tmp_path: Path) -> None:
    for value, shown in [("ssh://jump.lan.", "jump.lan"), ("ssh://u@jump.lan.:2200", "u@jump.lan:2200")]:
        resolved = resolve(tmp_path, f"Host gpu1\n  ProxyJump {value}\n".encode())
        assert resolved.proxy_jump == shown
        status, values, stderr = ref.run("gpu1", tmp_path / "config")
        assert status == 0 and values["proxyjump"] == [shown], stderr


def test_a_pattern_list_is_read_one_pattern_at_a_time(ref: Reference, tmp_path: Path) -> None:
    """``Match host a,gpu1,b`` matches by its middle pattern; ``IgnoreUnknown`` lists alike."""
    text = "IgnoreUnknown x,Foo*,y\nFooBar 1\nMatch host a,gpu1,b\n  User middle\n"
    assert resolve(tmp_path, text.encode()).user == "middle"
    assert ssh_user(ref, tmp_path / "config") == "middle"


def test_match_user_is_case_sensitive(ref: Reference, tmp_path: Path) -> None:
    """``Match user`` compares the user as given (``Match host`` folds case, this does not)."""
    for pattern, port in [("Ben", "2200"), ("ben", "22")]:
        text = f"Host gpu1\n  User Ben\nMatch user {pattern}\n  Port 2200\n"
        assert str(resolve(tmp_path, text.encode()).port) == port
        status, values, stderr = ref.run("gpu1", tmp_path / "config")
        assert status == 0 and values["port"] == [port], stderr


@pytest.mark.parametrize(
    ("value", "shown"),
    [("ssh://u%41%2c+v@h", "uA, v@h"), ("ssh://%75%73%65%72@h", "user@h")],
)
def test_an_ssh_uri_user_is_decoded_as_ssh(
    ref: Reference, tmp_path: Path, value: str, shown: str
) -> None:
    """``%XX`` is a byte and ``+`` a space."""
    assert resolve(tmp_path, f"Host gpu1\n  ProxyJump {value}\n".encode()).proxy_jump == shown
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0 and values["proxyjump"] == [shown], stderr


@pytest.mark.parametrize("escape", ["%4", "%zz", "%\u00e9"])
def test_a_bad_escape_in_an_ssh_uri_user_is_refused(
    ref: Reference, tmp_path: Path, escape: str
) -> None:
    value = f"ssh://u{escape}@h"
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, f"Host gpu1\n  ProxyJump {value}\n".encode())
    assert f"hop '{value}': bad %-escape in 'u{escape}' (ssh refuses it too;" in str(info.value)
    status, _, _ = ref.run("gpu1", tmp_path / "config")
    assert status != 0


def test_an_escaped_byte_that_is_not_utf8_is_checked_only_where_used(
    ref: Reference, tmp_path: Path
) -> None:
    """``%ff`` decodes to a byte that is not UTF-8: a line that does not apply is still read
    (every ProxyJump is parsed, as ssh parses it) and ssh takes it."""
    data = b"Host other\n  ProxyJump ssh://u%ff@h\nHost gpu1\n  User u\n"
    assert resolve(tmp_path, data).user == "u"
    assert ssh_user(ref, tmp_path / "config") == "u"


@pytest.mark.parametrize("user", ["u%00x", "u%00", "%00", "u%00x%00y"])
def test_a_nul_byte_in_an_ssh_uri_user_is_refused(
    ref: Reference, tmp_path: Path, user: str
) -> None:
    """ssh refuses ``%00`` in the user (we took the user up to it: ``u%00x`` was ``u``)."""
    value = f"ssh://{user}@h"
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, f"Host gpu1\n  ProxyJump {value}\n".encode())
    assert str(info.value) == (
        f"{tmp_path / 'config'} line 2: invalid ProxyJump: hop '{value}': a NUL byte (%00) in "
        f"'{user}' (ssh refuses it too; write [user@]host[:port] or ssh://[user@]host[:port], "
        "hops separated by commas)"
    )
    status, _, stderr = ref.run("gpu1", tmp_path / "config")
    assert status != 0 and "Invalid ProxyJump" in stderr


@pytest.mark.parametrize(
    ("value", "hop"),
    [("h:1", (None, "h", 1)), ("u@h:2", ("u", "h", 2)), ("a@b@h:3", ("a@b", "h", 3)),
     ("h:", (None, "h", None)), ("h:ssh", (None, "h", 22)), ("h:65535", (None, "h", 65535)),
     # only a host in brackets loses them
     ("ab]:2", (None, "ab]", 2)),
     ("h#c", (None, "h", None)), ("h#c#d", (None, "h", None)), ("ssh://u;a;b@h", ("u", "h", None)),
     ("ssh://h:", (None, "h", None)), ("ssh://h/", (None, "h", None)),
     ("ssh://h:1", (None, "h", 1))],
)
def test_a_jump_hop_is_user_host_and_port_as_ssh(
    ref: Reference, tmp_path: Path, value: str, hop: tuple[str | None, str, int | None]
) -> None:
    """``[user@]host[:port]``: the user up to the last '@', any port from 1 (or a service)."""
    resolved = resolve(tmp_path, f"Host gpu1\n  ProxyJump {value}\n".encode())
    (parsed,) = resolved.jump_hops
    assert (parsed.user, parsed.host, parsed.port) == hop
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0 and values["proxyjump"] == [resolved.proxy_jump], stderr


@pytest.mark.parametrize(
    ("value", "reason"),
    [("@h", "empty user name before '@'"), ("h/22", "'/' after the host (write host:port)"),
     ("u@", "no host"), ("h:0", "bad port '0'"), ("h:x", "bad port 'x'"),
     ("[h", "'[' without ']'"), ("[h]:2]", "bad port '2]'"), ("h:2:3", "bad port '2:3'"),
     ("h/a:b/c", "'/' after the host (write host:port)"),
     ("[h]X", "unexpected 'X' after ']'"),
     ("ssh://;x@h", "empty user name in the ssh:// address"), ("ssh://u@", "no host"),
     ("ssh://h/x", "an ssh:// address has no path"), ("ssh://h:22/p", "an ssh:// address has no path"),
     ("ssh://h:0", "bad port '0'")],
)
def test_a_jump_hop_ssh_refuses_says_why(
    ref: Reference, tmp_path: Path, value: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, f"Host gpu1\n  ProxyJump {value}\n".encode())
    assert str(info.value) == (
        f"{tmp_path / 'config'} line 2: invalid ProxyJump: hop '{value}': {reason} (ssh refuses "
        "it too; write [user@]host[:port] or ssh://[user@]host[:port], hops separated by commas)"
    )
    status, _, _ = ref.run("gpu1", tmp_path / "config")
    assert status != 0


def test_tilde_is_the_home_with_one_slash(tmp_path: Path) -> None:
    """``tilde_expand_filename``: a home ending in '/' (or '/' itself) gets no second one."""
    for home, path in [("/", "/k"), ("/users/u/", "/users/u/k"), ("/users/u", "/users/u/k")]:
        account = LocalAccount("u", home, os.getuid(), "testhost")
        config = tmp_path / "config"
        config.write_text("Host gpu1\n  IdentityFile ~/k\n")
        parsed = read_config_file(config, environ={"HOME": str(tmp_path)})
        assert parsed is not None
        assert resolve_host("gpu1", [parsed], account).identity_paths == (path,)


def test_an_unknown_tilde_user_names_the_keyword_as_written(tmp_path: Path) -> None:
    """Refused when the file is used, as ssh fails then (the keyword was shown lower-cased)."""
    config = tmp_path / "config"
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, b"Host gpu1\n  IdentityFile ~nosuchuser-x/k\n")
    assert str(info.value) == (
        f"{config} line 2: IdentityFile '~nosuchuser-x/k': no such user 'nosuchuser-x' for "
        "'~nosuchuser-x' (ssh fails on it too, when connecting)"
    )


@pytest.mark.parametrize(
    ("text", "user"),
    [("Match host gpu1 all\n  User m\n", "m"), ("Match !host x all\n  User m\n", "m"),
     ("Match host x all\n  User m\n", "localuser"), ("Match all # c\n  User m\n", "m")],
)
def test_match_all_may_follow_one_criterion(
    ref: Reference, tmp_path: Path, text: str, user: str
) -> None:
    """ssh counts ``all`` among the criteria: one before it is allowed (and decides)."""
    assert resolve(tmp_path, text.encode()).user == user
    assert ssh_user(ref, tmp_path / "config") == user


@pytest.mark.parametrize(
    ("text", "message"),
    [("Match host gpu1 user x all\n", "Match 'all' cannot be combined with other criteria"),
     ("Match all host gpu1\n", "Match 'all' cannot be combined with other criteria"),
     ("Match all extra\n", "Match 'all' cannot be combined with other criteria"),
     ("Match '\"host' gpu1\n", "unbalanced \" quote in Match (close it)"),
     ("Match host '\"gpu1'\n", "Match host needs an argument"),
     ("Match host #c\n", "Match host needs an argument"),
     ("Match #c\n", "Match needs at least one criterion"),
     # a criterion after an exec that is not run is still read (and refused)
     ("Match host x exec true bogus y\n", "unsupported Match criterion 'bogus'")],
)
def test_a_match_line_ssh_refuses_says_why(
    ref: Reference, tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, (text + "  User m\n").encode())
    assert str(info.value) == f"{tmp_path / 'config'} line 1: {message}"
    status, _, _ = ref.run("gpu1", tmp_path / "config")
    assert status != 0


@pytest.mark.parametrize(
    ("text", "message"),
    [("Match canonical\n", "Match canonical is not supported (it needs ssh's DNS "
      "canonicalization and second pass; use Match host or originalhost)"),
     ("Match exec true\n", "Match exec is not supported (we do not run commands from the ssh "
      "config; use Match host, originalhost, user or localuser)")],
)
def test_a_match_we_cannot_evaluate_says_so(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, (text + "  User m\n").encode())
    assert str(info.value) == f"{tmp_path / 'config'} line 1: {message}"


@pytest.mark.parametrize(
    ("pattern", "user"),
    [("localuser", "m"), ("nobody-x", "localuser"), ("LOCALUSER", "localuser")],
)
def test_match_localuser_is_the_account_case_sensitive(
    ref: Reference, tmp_path: Path, pattern: str, user: str
) -> None:
    text = f"Match localuser {pattern}\n  User m\n"
    assert resolve(tmp_path, text.encode()).user == user
    assert ssh_user(ref, tmp_path / "config") == user


def test_a_port_is_1_to_65535(ref: Reference, tmp_path: Path) -> None:
    """A number, or a TCP service's name (tftp is UDP only)."""
    assert resolve(tmp_path, b"Host gpu1\n  Port 65535\n").port == 65535
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0 and values["port"] == ["65535"], stderr
    for port in ("65536", "0", "tftp"):
        with pytest.raises(ConfigError, match=f"Port '{port}' is not a port number"):
            resolve(tmp_path, f"Host gpu1\n  Port {port}\n".encode())
        assert ref.run("gpu1", tmp_path / "config")[0] != 0


def test_an_environment_variable_after_a_brace(ref: Reference, tmp_path: Path) -> None:
    """``${NAME}`` ends at the first '}' after it, whatever came before."""
    text = "Host gpu1\n  UserKnownHostsFile /k}${HOME}/x\n"
    resolved = resolve(tmp_path, text.encode())
    assert resolved.known_hosts == (f"/k}}{tmp_path}/x",)
    status, values, stderr = ref.run("gpu1", tmp_path / "config", env={**ref.env, "HOME": str(tmp_path)})
    assert status == 0 and values["userknownhostsfile"] == [f"/k}}{tmp_path}/x"], stderr


def test_a_brace_after_an_environment_variable_is_text(ref: Reference, tmp_path: Path) -> None:
    env = {**ref.env, "HOME": str(tmp_path)}
    resolved = resolve(tmp_path, b"Host gpu1\n  UserKnownHostsFile /${HOME}/a}b\n")
    assert resolved.known_hosts == (f"/{tmp_path}/a}}b",)
    status, values, stderr = ref.run("gpu1", tmp_path / "config", env=env)
    assert status == 0 and values["userknownhostsfile"] == [f"/{tmp_path}/a}}b"], stderr


@pytest.mark.parametrize(
    ("value", "reason"),
    [("/k${}", "invalid environment variable name ${}"),
     ("/k${1A}", "invalid environment variable name ${1A}"),
     ("/k${HOME", "'${' without '}'"),
     ("/k${NOPE_X}", "environment variable ${NOPE_X} is not set"),
     ("/k%", "a lone '%' at the end (write '%%' for a percent sign)"),
     ("/k%z", "unknown token '%z' (known here: %C %L %d %h %i %k %l %n %p %r %u %%)")],
)
def test_a_bad_environment_variable_says_why(
    ref: Reference, tmp_path: Path, value: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, f"Host gpu1\n  UserKnownHostsFile {value}\n".encode())
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'config'} line 2: ")
    assert message.endswith(f" '{value}': {reason}"), message
    assert ref.run("gpu1", tmp_path / "config")[0] != 0


def test_an_environment_variable_name_may_be_lower_case(ref: Reference, tmp_path: Path) -> None:
    env = {**ref.env, "lower_x9": "/lx"}
    config = tmp_path / "config"
    config.write_text("Host gpu1\n  UserKnownHostsFile ${lower_x9}/k\n")
    parsed = read_config_file(config, environ=env)
    assert parsed is not None
    assert resolve_host("gpu1", [parsed], ACCOUNT, environ=env).known_hosts == ("/lx/k",)
    status, values, stderr = ref.run("gpu1", config, env=env)
    assert status == 0 and values["userknownhostsfile"] == ["/lx/k"], stderr


def test_a_bad_identity_file_name_fails_as_ssh_fails_when_connecting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, b"Host gpu1\n  IdentityFile /k%z\n")
    assert str(info.value).endswith(
        " '/k%z': unknown token '%z' (known here: %C %L %d %h %i %k %l %n %p %r %u %%) (ssh fails "
        "on it too, when connecting)"
    )


@pytest.mark.parametrize(
    ("value", "ours", "shown"),
    [("yes", True, "yes"), ("TRUE", True, "yes"), ("no", False, "no"), ("False", False, "no")],
)
def test_forward_agent_yes_or_no(
    ref: Reference, tmp_path: Path, value: str, ours: bool, shown: str
) -> None:
    assert resolve(tmp_path, f"Host gpu1\n  ForwardAgent {value}\n".encode()).forward_agent is ours
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0 and values["forwardagent"] == [shown], stderr


def test_forward_agent_to_another_socket_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, b"Host gpu1\n  ForwardAgent /tmp/agent.sock\n")
    assert str(info.value) == (
        f"{tmp_path / 'config'} line 2: ForwardAgent '/tmp/agent.sock': forwarding another agent "
        "socket is not supported (write yes or no)"
    )


@pytest.mark.parametrize(("value", "seconds"), [("0", None), ("none", None), ("1", 1)])
def test_connect_timeout_0_is_none(tmp_path: Path, value: str, seconds: int | None) -> None:
    """ssh waits without a limit for 0 as for none: we pass no timeout, not 0."""
    assert resolve(tmp_path, f"Host gpu1\n  ConnectTimeout {value}\n".encode()).connect_timeout == seconds


def test_percent_l_is_the_local_host_name_to_its_first_dot(tmp_path: Path) -> None:
    account = LocalAccount("u", "/users/u", os.getuid(), "node1.lab.example")
    config = tmp_path / "config"
    config.write_text("Host gpu1\n  IdentityFile /k/%L/%l\n")
    parsed = read_config_file(config, environ={"HOME": str(tmp_path)})
    assert parsed is not None
    resolved = resolve_host("gpu1", [parsed], account)
    assert resolved.identity_paths == ("/k/node1/node1.lab.example",)


@pytest.mark.parametrize(
    ("data", "message"),
    [(b'Host ""\n', "line 1: Host has an empty pattern"),
     (b"Host gpu1\n  User # x\n", "line 2: User has no value (ssh refuses this too; give one, "
      "and quote a value that starts with '#')"),
     (b"Host gpu1\n  User a b\n", "line 2: user takes one value, got 2 (ssh refuses this too; "
      "quote a value with spaces)"),
     (b'Host gpu1\n  UserKnownHostsFile /a ""\n',
      "line 2: userknownhostsfile has an empty argument"),
     (b"Host gpu1\n  AddressFamily ipv4\n",
      "line 2: AddressFamily 'ipv4' is not one of any, inet, inet6")],
)
def test_a_value_ssh_refuses_says_why(
    ref: Reference, tmp_path: Path, data: bytes, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, data)
    assert str(info.value) == f"{tmp_path / 'config'} {message}"
    assert ref.run("gpu1", tmp_path / "config")[0] != 0


@pytest.mark.parametrize(
    ("hostname", "shown"), [("X1", "x1"), ("127.000.000.001", "127.0.0.1"), ("Node.Lan", "node.lan")]
)
def test_a_host_name_is_written_as_ssh_writes_it(
    ref: Reference, tmp_path: Path, hostname: str, shown: str
) -> None:
    """Lower-cased, or an address as the C library writes it (never a name looked up)."""
    assert resolve(tmp_path, f"Host gpu1\n  HostName {hostname}\n".encode()).hostname == shown
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0 and values["hostname"] == [shown], stderr
    assert canonical_host("ABC%1", None) == "ABC%1"  # a '%' makes it an address: kept


def test_a_host_pattern_with_a_capital_x_is_literal(tmp_path: Path) -> None:
    """``found``: the config knows the name when a pattern with a literal character matched it."""
    assert resolve(tmp_path, b"Host X*\n  User x\n", host="Xgpu").found
    assert not resolve(tmp_path, b"Host *\n  User x\n", host="Xgpu").found


@pytest.mark.parametrize(
    "data",
    [b"Host gpu1\n  User Xavier\n", b"Host caf\xe9 gpu1\n  User x\n",
     b"Host gpu1\n  ProxyJump ==h\n", b"Host gpu1\n  ProxyJump=Xjump\n",
     b"Host gpu1\n  ProxyCommand==Xnc %h\n",
     # a backslash escapes a quote, a backslash or a space, and is itself elsewhere
     b"Host gpu1\n  User a\\\n", b"Host gpu1\n  User a\\Xb\n", b'Host gpu1\n  User a\\"b\n',
     b"Host gpu1\n  User a\\ b\n", b'Host gpu1\n  User a\\"\n',
     # the ProxyJump wins: the ProxyCommand after it is not used, nor checked as text
     b"Host gpu1\n  ProxyJump j\n  ProxyCommand nc %h \xe9\n"],
)
def test_values_read_as_ssh_reads_them(ref: Reference, tmp_path: Path, data: bytes) -> None:
    """A leading capital X is text; '=' signs before a value go; a host pattern that is not
    UTF-8 is matched as bytes."""
    resolved = resolve(tmp_path, data)
    status, values, stderr = ref.run("gpu1", tmp_path / "config")
    assert status == 0, stderr
    assert values["user"] == [resolved.user]
    assert values.get("proxyjump") == ([resolved.proxy_jump] if resolved.proxy_jump else None)
    assert values.get("proxycommand") == (
        [resolved.proxy_command] if resolved.proxy_command else None
    )


def test_a_bracket_first_in_a_set_is_itself(ref: Reference, tmp_path: Path) -> None:
    """glob(3): ``[]a]`` is the set of ']' and 'a', ``[!]]`` anything but ']'."""
    base = tmp_path / "g"
    base.mkdir()
    for name, user in [("x].conf", "bracket"), ("xa.conf", "a"), ("xb.conf", "b")]:
        (base / name).write_text(f"Host gpu1\n  User {user}\n")
    assert include_glob(f"{base}/x[]a].conf", None) == [f"{base}/x].conf", f"{base}/xa.conf"]
    assert include_glob(f"{base}/x[!]].conf", None) == [f"{base}/xa.conf", f"{base}/xb.conf"]
    config = tmp_path / "config"
    config.write_text(f"Include {base}/x[]b].conf\n")
    assert ssh_user(ref, config) == "bracket"
    parsed = read_config_file(config, environ=ref.env)
    assert parsed is not None
    assert resolve_host("gpu1", [parsed], ref.account, environ=ref.env).user == "bracket"
