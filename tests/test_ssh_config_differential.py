"""Our ssh config resolution against the real ``ssh -G`` (OpenSSH from the distribution).

Each case is one config file and one host name.  Both sides must agree on the host name, user,
port, identity files (and the key files ssh tries with them, read from ``ssh -v``), ProxyJump,
ProxyCommand, UserKnownHostsFile and HostKeyAlias; when ssh refuses the config, we must refuse
it too; when we refuse a config ssh accepts, the refusal must be one of the deliberate ones (one
line naming the file, line and keyword).  The cases users sent in are fixtures under
``tests/data/ssh_config/``; the keywords are checked against the ssh binary itself.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.ssh_config import KEYWORDS, SYSTEM_SSH_CONFIG, read_config_file
from ssh_scheduler.machines.ssh_resolve import SshHost, resolve_host
from tests.ssh_reference import Reference, make_reference

DELIBERATE = ("is not supported", "when connecting")
"""Words of every deliberate refusal (Match exec/canonical/final, CanonicalizeHostname, values
that are not UTF-8 or hold control characters...), and of errors ssh only meets when it connects
(``ssh -G`` does not expand IdentityFile/ProxyCommand)."""
DATA = Path(__file__).parent / "data" / "ssh_config"


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    assert shutil.which("ssh"), "openssh-client is installed by scripts/test"
    return make_reference(tmp_path_factory.mktemp("sshref"))


@pytest.fixture(scope="module")
def default_keys(ref: Reference, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The IdentityFiles ssh uses when none is configured."""
    empty = tmp_path_factory.mktemp("empty") / "config"
    empty.write_text("")
    status, values, stderr = ref.run("x", empty)
    assert status == 0 and len(values["identityfile"]) > 3, stderr
    return values["identityfile"]


def ours(
    ref: Reference, config: Path, host: str, system: Path | None = None, env: dict[str, str] | None = None
) -> SshHost:
    environ = ref.env if env is None else env
    configs = [read_config_file(config, environ=environ)]
    if system is not None:
        configs.append(read_config_file(system, environ=environ, user_config=False))
    return resolve_host(host, [c for c in configs if c is not None], ref.account, environ=environ)


def compare(
    ref: Reference,
    config: Path,
    host: str,
    system: bool = False,
    env: dict[str, str] | None = None,
    defaults: list[str] | None = None,
) -> str:
    """Resolve with both; assert they agree; return 'same', 'both refuse' or 'we refuse'.

    ``defaults``: ssh's default IdentityFiles, to check that we leave them to ssh exactly when
    it uses them; with them, the key files ssh tries are compared too (``ssh -v``)."""
    status, theirs, stderr = ref.run(host, None if system else config, env=env)
    try:
        mine = ours(ref, config, host, SYSTEM_SSH_CONFIG if system else None, env)
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message
        if status != 0:
            return "both refuse"
        text = config.read_bytes()
        assert any(word in message for word in DELIBERATE), (message, text)
        assert " line " in message, message
        return "we refuse"
    text = config.read_bytes()
    assert status == 0, (stderr, text, mine)
    assert theirs["hostname"] == [mine.hostname], text
    assert theirs["user"] == [mine.user], text
    assert theirs["port"] == [str(mine.port)], text
    if mine.identity_files:
        assert theirs["identityfile"] == list(mine.identity_files), text
    elif defaults is not None:  # none configured: ssh tries its own, and so may we
        assert theirs["identityfile"] == defaults, text
    if defaults is not None and mine.identity_files and not system:
        tried = [os.path.abspath(p) for p in ref.identity_paths(host, config, env=env)]
        assert tried == list(mine.identity_paths), text
    home = ref.account.home
    if mine.known_hosts is None:
        expected_known = [f"{home}/.ssh/known_hosts", f"{home}/.ssh/known_hosts2"]
    else:
        expected_known = list(mine.known_hosts) or ["none"]
    assert theirs["userknownhostsfile"][0].split(" ") == expected_known, text
    assert theirs.get("proxyjump") == ([mine.proxy_jump] if mine.proxy_jump else None), text
    assert theirs.get("proxycommand") == (
        [mine.proxy_command] if mine.proxy_command else None
    ), text
    assert theirs.get("hostkeyalias") == (
        [mine.host_key_alias] if mine.host_key_alias else None
    ), text
    return "same"


# --------------------------------------------------------------------------------------------
# generated configs

HOSTS = ["gpu1", "GPU1", "gpu10", "web.lan", "db-2", "10.0.0.5", "Box", "login"]
PATTERNS = ["gpu*", "gpu1", "GPU1", "!gpu10", "*.lan", "*", "db-?", "10.0.0.*", "box", "Box", "g*1"]
VALUES = {
    "HostName": [
        "10.0.0.1", "%h.lan", "Node-%h", "x%%y", "MiXeD.Example", "%h", "FE80::1", '"q.%h"',
    ],
    "User": ["ben", "alice", "ben@corp.example.com", "%u", "'quoted user'"],
    "Port": ["2200", "ssh", "22", "+2201", "http", "022"],
    "IdentityFile": [
        "~/.ssh/id_%h", "/keys/%r@%h:%p", "${HOME}/k", "id_rel", "~/.ssh/id_a", "none",
        "%d/%u/%C", '"~/my key"', "~localuser/k",
    ],
    "UserKnownHostsFile": [
        "~/.ssh/kh_%h %d/kh2", "none", "/kh/%C", "/kh/%n_%l_%L_%i_%u_%k", "${HOME}/kh",
    ],
    "ProxyJump": [
        "bastion", "ben@jump:2222", "ssh://ops@j2:2022,j3", "none", "a,b", "j # comment",
        "[::1]:2200", "u@h:ssh", "ssh://j4/",
    ],
    "ProxyCommand": ["nc %h %p", "none", "ssh -W %h:%p gw # c", "'q' \"%r\" %n %k %%"],
    "HostKeyAlias": ["alias1", "%h"],
    "ConnectTimeout": ["5", "1m"],
    "ForwardAgent": ["yes", "no"],
    "SendEnv": ["LANG"],
    "IgnoreUnknown": ["HostNmae", "Foo*"],
}
BAD_LINES = [
    "HostName a b", "Port 0", "Port 70000", "Port x1", "HostName %n", "HostNmae typo",
    "IdentityFile ~/.ssh/id_%Q", "IdentityFile ${NOPE}/x", "IdentityFile /a /b",
    "UserKnownHostsFile none /x", "UserKnownHostsFile /kh/%j", "ProxyJump bad:port",
    "ConnectTimeout soon", "User", "Host", "Match", "Match host", "Match frobnicate x",
    "Match all host x", "ProxyCommand nc %x", "Foo bar", "User 'open",
    "Match exec true", "Match canonical", "Match final", "CanonicalizeHostname yes",
]
HEADERS = [
    "Host {p}", "Host {p} {p}", "Host {p}", "Match originalhost {p}", "Match host {p}",
    "Match user ben,alice", "Match localuser localuser", "Match all", "Match !originalhost {p}",
    "Match originalhost {p} user {u}", "Host={p}", "Match originalhost {p},!gpu10",
    "Match host {p} exec false",
    'Match originalhost "{p}"',
    'Host "{p}" {p}',
    "Match !all",
    "Match user {u} originalhost {p} # why",
    "Host {p} # comment",
]
SPELLINGS = ["{k} {v}", "{k}={v}", "{k} = {v}", "  {kl} {v}", "\t{k}\t{v}  ", "{k} {v} # note"]


def generated_config(rng: random.Random) -> str:
    lines: list[str] = []
    for block in range(rng.randint(1, 5)):
        if block or rng.random() < 0.5:
            header = rng.choice(HEADERS)
            pattern = rng.choice(PATTERNS).replace("!", "") if "Match" in header else None
            header = header.replace("{u}", rng.choice(["ben", "localuser", "root"]))
            while "{p}" in header:
                header = header.replace("{p}", pattern or rng.choice(PATTERNS), 1)
            lines.append(header)
        for _ in range(rng.randint(1, 5)):
            if rng.random() < 0.03:
                lines.append(rng.choice(BAD_LINES))
                continue
            keyword = rng.choice(list(VALUES))
            value = rng.choice(VALUES[keyword])
            spelling = rng.choice(SPELLINGS)
            lines.append(spelling.format(k=keyword, kl=keyword.lower(), v=value))
    return "\n".join(lines) + ("\n" if rng.random() < 0.8 else "")


def test_generated_configs_agree_with_ssh(
    ref: Reference, default_keys: list[str], tmp_path: Path
) -> None:
    rng = random.Random(20261126)
    outcomes: dict[str, int] = {}
    config = tmp_path / "config"
    for _ in range(300):
        config.write_text(generated_config(rng))
        outcome = compare(ref, config, rng.choice(HOSTS), defaults=default_keys)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # the generator must exercise all three outcomes, mostly agreement
    print(outcomes)
    assert outcomes["same"] > 150, outcomes
    assert outcomes["both refuse"] > 10, outcomes
    assert outcomes["we refuse"] > 3, outcomes


def test_jump_hosts_resolve_as_ssh_dash_j(ref: Reference, tmp_path: Path) -> None:
    """The last hop of a ProxyJump resolves as ``ssh -l user -p port -J <earlier hops> host``."""
    rng = random.Random(7)
    config = tmp_path / "config"
    compared = 0
    for _ in range(150):
        text = generated_config(rng) + "Host *\n  ProxyJump ssh://ops@j1:2022,Jump2\n"
        config.write_text(text)
        try:
            target = ours(ref, config, rng.choice(HOSTS))
        except ConfigError:
            continue
        if not target.jump_hops:
            continue
        last = target.jump_hops[-1]
        earlier = ",".join(h.text for h in target.jump_hops[:-1]) or None
        args = [*(["-l", last.user] if last.user else []), *(["-p", str(last.port)] if last.port else [])]
        args += ["-J", earlier] if earlier else []
        status, theirs, stderr = ref.run(last.host, config, *args)
        try:
            mine = resolve_host(
                last.host,
                [c for c in [read_config_file(config, environ=ref.env)] if c is not None],
                ref.account,
                preset_user=last.user,
                preset_port=last.port,
                preset_jump=earlier,
                environ=ref.env,
            )
        except ConfigError as err:
            assert status != 0 or "is not supported" in str(err), (str(err), text)
            continue
        assert status == 0, stderr
        assert (theirs["hostname"], theirs["user"], theirs["port"]) == (
            [mine.hostname], [mine.user], [str(mine.port)]
        ), text
        assert theirs.get("proxyjump") == ([mine.proxy_jump] if mine.proxy_jump else None), text
        compared += 1
    assert compared > 40


# --------------------------------------------------------------------------------------------
# hand-written configs

HAND_WRITTEN = [
    ("crlf", "Host gpu1\r\n  HostName 10.0.0.1\r\n  User ben\r\n", "gpu1"),
    ("equals", "Host=gpu1\nHostName=10.0.0.1\nUser = ben\nPort= 2200\n", "gpu1"),
    ("upper keywords", "HOST gpu1\n  HOSTNAME 10.0.0.1\n  USER ben\n", "gpu1"),
    ("quoted pattern", 'Host "gpu1" other\n  User "a b"\n', "gpu1"),
    ("escaped space", "Host gpu1\n  IdentityFile ~/my\\ key\n", "gpu1"),
    ("escaped quote", "Host gpu1\n  IdentityFile \"~/a\\\"b\"\n", "gpu1"),
    ("tab and formfeed", "Host\tgpu1\n\tUser\tben\t\x0c\n", "gpu1"),
    ("comment after value", "Host gpu1 # the first\n  User ben # me\n", "gpu1"),
    ("case sensitive host", "Host gpu1\n  User ben\nHost *\n  User other\n", "GPU1"),
    ("negation", "Host * !gpu1\n  User star\nHost gpu1\n  User one\n", "gpu1"),
    ("negation first", "Host !gpu1 *\n  User star\n", "gpu1"),
    ("star hostname", "Host *\n  HostName %h.corp.example.com\n", "db1"),
    ("percent percent", "Host *\n  HostName a%%b%h\n", "x"),
    ("match originalhost", "Match originalhost gpu1\n  Port 2200\n", "gpu1"),
    ("match host after hostname", "Host gpu1\n  HostName 10.0.0.7\nMatch host 10.0.0.*\n  ProxyJump bastion\n", "gpu1"),
    ("match host uses %h", "Host *\n  HostName %h.lan\nMatch host *.lan\n  User lan\n", "gpu1"),
    ("match host lowercases", "Match host GPU*\n  User upper\n", "gpu1"),
    ("match originalhost lowercases", "Match originalhost gpu1\n  User low\n", "GPU1"),
    ("match user after user", "Host *\n  User ben\nMatch user ben\n  Port 2201\n", "x"),
    ("match user default", "Match user localuser\n  Port 2202\n", "x"),
    ("match localuser", "Match localuser localuser\n  Port 2203\n", "x"),
    ("match negated", "Match !originalhost gpu1\n  User notgpu\n", "gpu2"),
    ("match list", "Match originalhost gpu*,!gpu10\n  User list\n", "gpu10"),
    ("match all", "Match all\n  User all\n", "x"),
    ("match all comment", "Match all # everything\n  User all\n", "x"),
    ("match two criteria", "Match originalhost x user localuser\n  User two\n", "x"),
    ("match exec skipped", "Match originalhost other exec false\n  User no\n", "x"),
    ("match equals", "Match originalhost=x\n  User eq\n", "x"),
    ("host then match", "Host x\n  User hx\nMatch originalhost x\n  User mx\n", "x"),
    ("ignoreunknown", "IgnoreUnknown Foo*,Bar\nFooBaz 1\nBar 2\nHost x\n  User ok\n", "x"),
    ("ignoreunknown too late", "FooBaz 1\nIgnoreUnknown Foo*\n", "x"),
    ("ignoreunknown inactive", "Host other\n  IgnoreUnknown Foo\nFoo 1\n", "x"),
    ("unknown in other block", "Host other\n  HostNmae y\n", "x"),
    ("deprecated keyword", "Host x\n  UsePrivilegedPort no\n  Protocol 2\n  User dep\n", "x"),
    ("identityfile2 alias", "Host x\n  IdentityFile2 ~/.ssh/old\n", "x"),
    ("identity duplicates", "Host x\n  IdentityFile ~/a\n  IdentityFile ~/b\n  IdentityFile ~/a\n", "x"),
    ("identity none", "Host x\n  IdentityFile none\n  IdentityFile ~/k\n", "x"),
    ("port service", "Host x\n  Port ssh\n", "x"),
    ("port plus", "Host x\n  Port +22\n", "x"),
    ("port zero", "Host x\n  Port 0\n", "x"),
    ("two hostnames", "Host x\n  HostName a b\n", "x"),
    ("known hosts tokens", "Host x\n  UserKnownHostsFile ~/kh_%h_%p_%r %d/%u/%C\n", "x"),
    ("known hosts tilde user", "Host x\n  UserKnownHostsFile ~nosuchuser/kh\n", "x"),
    ("known hosts tilde self", "Host x\n  UserKnownHostsFile ~localuser/kh\n", "x"),
    ("known hosts env", "Host x\n  UserKnownHostsFile ${HOME}/kh\n", "x"),
    ("known hosts none", "Host x\n  UserKnownHostsFile none\n", "x"),
    ("jump then command", "Host x\n  ProxyJump j\n  ProxyCommand nc %h %p\n", "x"),
    ("command then jump", "Host x\n  ProxyCommand nc %h %p\n  ProxyJump j\n", "x"),
    ("jump none then command", "Host x\n  ProxyJump none\n  ProxyCommand nc\n", "x"),
    ("jump uri", "Host x\n  ProxyJump ssh://ben@jump:2222\n", "x"),
    ("jump user at", "Host x\n  ProxyJump ben@corp@jump\n", "x"),
    ("jump v6", "Host x\n  ProxyJump [fe80::1]:2200\n", "x"),
    ("jump comment", "Host x\n  ProxyJump j1,j2 # two\n", "x"),
    ("jump empty port", "Host x\n  ProxyJump j:\n", "x"),
    ("jump bad", "Host other\n  ProxyJump j:/\n", "x"),
    ("jump loop", "Host *\n  ProxyJump bastion\n", "bastion"),
    ("jump loop by hostname", "Host x\n  HostName bastion\n  ProxyJump bastion\n", "x"),
    ("jump other port", "Host *\n  ProxyJump bastion:2222\n", "bastion"),
    ("jump other user", "Host *\n  ProxyJump u@bastion\n", "bastion"),
    ("user with at", "Host x\n  User ben@corp.example.com\n", "x"),
    ("ip literal upper", "Host x\n  HostName FE80::A\n", "x"),
    ("hostname upper", "Host x\n  HostName Gpu1.Example.COM\n", "x"),
    ("empty host pattern", 'Host ""\n  User e\n', "x"),
    ("unbalanced quote", 'Host x\n  User "ben\n', "x"),
    ("no value", "Host x\n  User\n", "x"),
    ("empty file", "", "x"),
    ("only comments", "# nothing\n   # here\n\n", "x"),
    ("canonicalize no", "CanonicalizeHostname no\nHost x\n  User c\n", "x"),
]


@pytest.mark.parametrize(("text", "host"), [c[1:] for c in HAND_WRITTEN], ids=[c[0] for c in HAND_WRITTEN])
def test_hand_written_configs_agree_with_ssh(
    ref: Reference, default_keys: list[str], tmp_path: Path, text: str, host: str
) -> None:
    config = tmp_path / "config"
    config.write_text(text)
    assert compare(ref, config, host, defaults=default_keys) in ("same", "both refuse")


def test_includes_agree_with_ssh(ref: Reference, default_keys: list[str], tmp_path: Path) -> None:
    """Relative Include paths are under ~/.ssh/ (also for a -F file); Host/Match in an included
    file do not leak out of it; an Include inside a non-matching block reads nothing."""
    dot_ssh = Path(ref.account.home) / ".ssh"
    (dot_ssh / "inc.d").mkdir(exist_ok=True)
    (dot_ssh / "inc.d" / "1.conf").write_text("Host gpu*\n  User inc1\n  Port 2201\n")
    (dot_ssh / "inc.d" / "2.conf").write_text("Host gpu1\n  HostName 10.0.0.2\nMatch all\n  User late\n")
    (dot_ssh / "inner").write_text("User inner\nHost other\n  Port 9\n")
    (dot_ssh / "loop").write_text("Include loop\n")
    cases = [
        ("Include inc.d/*.conf\nHost *\n  User star\n", "gpu1"),
        ("Host gpu1\n  Include inner\n  Port 2222\n", "gpu1"),
        ("Host gpu1\n  Include inner\n  Port 2222\n", "gpu2"),
        ("Host nomatch\n  Include inc.d/*.conf\nHost *\n  Port 3\n", "gpu1"),
        ("Include ~/.ssh/inc.d/2.conf inc.d/1.conf\n", "gpu1"),
        ("Include does-not-exist inc.d/none*.conf\nHost *\n  User u\n", "gpu1"),
        ("Include loop\n", "gpu1"),
    ]
    config = tmp_path / "config"
    for text, host in cases:
        config.write_text(text)
        assert compare(ref, config, host, defaults=default_keys) in ("same", "both refuse"), text


def test_user_and_system_config_agree_with_ssh(ref: Reference, default_keys: list[str]) -> None:
    """Without -F: ~/.ssh/config, then the machine's own /etc/ssh/ssh_config with its Includes,
    read by both sides."""
    user_config = Path(ref.account.home) / ".ssh" / "config"
    user_config.write_text("Host gpu1\n  HostName 10.0.0.1\nHost *\n  User fromuser\n")
    user_config.chmod(0o600)
    try:
        for host in ("gpu1", "other"):
            assert compare(ref, user_config, host, system=True, defaults=default_keys) == "same"
    finally:
        user_config.unlink()


# --------------------------------------------------------------------------------------------
# what users sent in (issue 24), as fixtures


def fixture_cases() -> list[tuple[str, str]]:
    lines = (DATA / "index.txt").read_text(encoding="utf-8").splitlines()
    return [
        (name, host)
        for name, host in (line.split(" ", 1) for line in lines if line and not line.startswith("#"))
    ]


@pytest.mark.parametrize(
    ("name", "host"), [pytest.param(n, h, id=f"{n}@{h}") for n, h in fixture_cases()]
)
def test_users_configs_agree_with_ssh(
    ref: Reference, default_keys: list[str], tmp_path: Path, name: str, host: str
) -> None:
    config = tmp_path / "config"
    config.write_bytes((DATA / name).read_bytes())
    compare(ref, config, host, defaults=default_keys)


def test_the_fixtures_cover_all_three_outcomes(
    ref: Reference, default_keys: list[str], tmp_path: Path
) -> None:
    config = tmp_path / "config"
    outcomes: dict[str, list[str]] = {}
    for name, host in fixture_cases():
        config.write_bytes((DATA / name).read_bytes())
        outcomes.setdefault(compare(ref, config, host, defaults=default_keys), []).append(name)
    assert len(outcomes["same"]) > 30, outcomes
    assert len(outcomes["both refuse"]) > 25, outcomes
    assert outcomes["we refuse"] == ["latin1-used-value.conf"], outcomes


def test_keywords_are_the_ones_ssh_accepts(ref: Reference, tmp_path: Path) -> None:
    """Every keyword ssh's parser knows is ours, and nothing else: the candidates are the
    words in the ssh binary, each asked of ssh itself in a block that does not apply."""
    binary = Path(str(shutil.which("ssh"))).read_bytes()
    words = {w.decode() for w in re.findall(rb"[a-z][a-z0-9]{2,40}(?=\x00)", binary)}
    # the linker may keep "host" only as the tail of "...localhost": try every tail
    candidates = sorted({w[i:] for w in words for i in range(len(w) - 2)} | KEYWORDS)
    config = tmp_path / "config"
    sentinel = "zzznotakeyword"
    accepted: set[str] = set()
    while candidates:
        config.write_text(
            "Host nomatch\n" + "".join(f"{word} zz\n" for word in candidates) + f"{sentinel} zz\n"
        )
        _, _, stderr = ref.run("x", config)
        refused = set(re.findall(r"line [0-9]+: Bad configuration option: (\S+)", stderr))
        if sentinel in refused:  # ssh read every line
            accepted |= set(candidates) - refused
            break
        # a value "zz" that ssh cannot take at all stops it: that keyword is known, go on after it
        last = max(int(n) for n in re.findall(r"line ([0-9]+)", stderr)) - 1
        assert 1 <= last <= len(candidates), stderr[-2000:]
        accepted |= set(candidates[:last]) - refused
        candidates = candidates[last:]
    assert accepted == KEYWORDS, (sorted(accepted - KEYWORDS), sorted(KEYWORDS - accepted))


def test_includes_use_home_from_the_environment(
    ref: Reference, default_keys: list[str], tmp_path: Path
) -> None:
    """'~' and relative Include paths are glob's: $HOME, not the account's home (they differ
    under sudo without -H); the config file itself is still the account's."""
    other = tmp_path / "other-home"
    (other / ".ssh").mkdir(parents=True)
    (other / ".ssh" / "inc").write_text("Host gpu1\n  User from-env-home\n")
    (other / ".ssh" / "inc2").write_text("Host gpu1\n  Port 2201\n")
    dot_ssh = Path(ref.account.home) / ".ssh"
    (dot_ssh / "inc").write_text("Host gpu1\n  User from-account-home\n")
    (dot_ssh / "inc2").write_text("Host gpu1\n  Port 2202\n")
    config = tmp_path / "config"
    config.write_text("Include inc\nInclude ~/.ssh/inc2\n")
    env = {**ref.env, "HOME": str(other)}
    assert compare(ref, config, "gpu1", env=env, defaults=default_keys) == "same"
    assert ours(ref, config, "gpu1", env=env).user == "from-env-home"
    assert ours(ref, config, "gpu1").user == "from-account-home"


def test_include_globs_as_ssh(ref: Reference, default_keys: list[str], tmp_path: Path) -> None:
    """A backslash makes the next character literal; wildcards skip dot files; '.*' also
    matches '.' and '..' (directories, read as empty); brackets; names sorted by bytes."""
    dot_ssh = Path(ref.account.home) / ".ssh" / "glob"
    dot_ssh.mkdir()
    for name, user in [("x*.conf", "literal-star"), ("xa.conf", "xa"), (".xb.conf", "hidden"),
                       ("x[1].conf", "bracket-name"), ("x1.conf", "x1"), ("B.conf", "upper")]:
        (dot_ssh / name).write_text(f"Host gpu1\n  User {user}\n")
    cases = [
        "Include glob/x\\*.conf\n",
        "Include glob/x*.conf\n",
        "Include glob/.x*\n",
        "Include glob/x[1].conf\n",
        "Include glob/x\\[1\\].conf\n",
        "Include glob/[!x]*.conf\n",
        "Include glob/x[a-c].conf glob/x[[:digit:]].conf\n",
        "Include glob/.*\n",
        "Include glob/*\n",
        "Include gl?b/x?.conf\n",
    ]
    config = tmp_path / "config"
    users = []
    for text in cases:
        config.write_text(text)
        assert compare(ref, config, "gpu1", defaults=default_keys) == "same", text
        users.append(ours(ref, config, "gpu1").user)
    assert users[:5] == ["literal-star", "literal-star", "hidden", "x1", "bracket-name"], users


def test_account_database_cases_agree_with_ssh(tmp_path: Path) -> None:
    """What depends on the password and group databases, with our side run under the same
    made-up ones: Debian accepts a group-writable config or Include when the group holds the
    owner alone (a private group, Ubuntu's default), and Include ~user/... is that user's."""
    if os.getuid() != 0:
        pytest.skip("needs root to give files other groups")
    buddy = tmp_path / "buddy"
    (buddy / "conf").mkdir(parents=True)
    (buddy / "conf" / "b.conf").write_text("Host gpu1\n  User from-buddy\n")
    groups = {"private": 4340, "shared": 4343, "listed": 4344, "crowd": 4345, "empty": 4346}
    ref = make_reference(
        tmp_path / "r",
        gid=groups["private"],
        passwd=[
            f"other:x:1001:{groups['shared']}:Other:/nonexistent:/bin/sh",
            f"buddy:x:1002:{groups['empty'] + 100}:Buddy:{buddy}:/bin/sh",
        ],
        group=[
            f"localuser:x:{groups['private']}:",
            f"shared:x:{groups['shared']}:",
            f"listed:x:{groups['listed']}:localuser",
            f"crowd:x:{groups['crowd']}:localuser,other",
            f"empty:x:{groups['empty']}:",
        ],
    )
    dot_ssh = Path(ref.account.home) / ".ssh"
    inc = dot_ssh / "inc.conf"
    inc.write_text("Host gpu1\n  User included\n")
    config = tmp_path / "config"
    config.write_text("Include inc.conf\n")
    outcomes = {}
    for group, gid in [*groups.items(), ("unknown", 4347)]:
        for mode in (0o664, 0o644, 0o666, 0o660):
            os.chown(inc, 0, gid)
            inc.chmod(mode)
            status, theirs, stderr = ref.run("gpu1", config)
            mine = ref.ours("gpu1", config)
            key = f"{group} {mode:o}"
            if status != 0:
                assert "error" in mine and "permissions" in str(mine["error"]), (key, stderr, mine)
                outcomes[key] = "refused"
            else:
                assert (mine.get("user"), theirs["user"]) == ("included", ["included"]), (key, mine)
                outcomes[key] = "read"
    assert outcomes["private 664"] == outcomes["listed 664"] == outcomes["shared 644"] == "read"
    for refused in ("shared 664", "crowd 664", "empty 664", "unknown 664", "private 666"):
        assert outcomes[refused] == "refused", outcomes
    # ~/.ssh/config itself, group-writable by the private group (read without -F)
    user_config = dot_ssh / "config"
    user_config.write_text("Host gpu1\n  User from-user-config\n")
    os.chown(user_config, 0, groups["private"])
    user_config.chmod(0o664)
    status, theirs, stderr = ref.run("gpu1", None)
    assert status == 0 and theirs["user"] == ["from-user-config"], stderr
    assert ref.ours("gpu1")["user"] == "from-user-config"
    os.chown(user_config, 0, groups["shared"])
    status, theirs, stderr = ref.run("gpu1", None)
    assert status != 0 and "permissions" in str(ref.ours("gpu1").get("error")), stderr
    user_config.unlink()
    # ~user in an Include is that user's home, from the account database
    for text, user in [("Include ~buddy/conf/b.conf\n", "from-buddy"),
                       ("Include ~nosuchuser/conf/b.conf\nHost *\n  User none-found\n", "none-found")]:
        config.write_text(text)
        status, theirs, stderr = ref.run("gpu1", config)
        assert status == 0 and theirs["user"] == [user], stderr
        assert ref.ours("gpu1", config)["user"] == user
