from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines import config as config_module
from ssh_scheduler.machines import machine_yaml, ssh_config
from ssh_scheduler.machines.config import SshConfigs, load_machine, load_machines
from ssh_scheduler.machines.machine import DEFAULT_WORKDIR, Machine, local_machine
from ssh_scheduler.machines.machine_yaml import parse_machine_yaml
from ssh_scheduler.machines.ssh_resolve import SshHost
from ssh_scheduler.machines.ssh_tokens import LocalAccount, current_account

ANCESTOR_YAML = """\
username: ben       # Replace with your username on the machine
ip: 105.29.123.241  # Replace with your machine's url or IP address
port: 22    # leave at default value of 22 unless you know what you are doing
# replace with a path to an ssh key to the machine (MUST BE PASSWORDLESS SSH KEY)
ssh_key_path: ~/.ssh/id_ssh_key
"""


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own account and HOME (no real ~/.ssh/config, /etc/ssh/ssh_config or
    ~/.local/var) and cwd."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USER", "not-the-account")
    account = LocalAccount("localuser", str(home), os.getuid(), "testhost")
    monkeypatch.setattr(config_module, "current_account", lambda: account)
    monkeypatch.setattr(ssh_config, "SYSTEM_SSH_CONFIG", tmp_path / "etc_ssh_config")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return home


def one_line_error(message: str, *needles: str) -> None:
    assert "\n" not in message, message
    assert "Traceback" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def config_error(fn: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)  # type: ignore[operator]
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# machine YAML


def test_ancestor_example(tmp_path: Path) -> None:
    home = Path(os.environ["HOME"])
    m = parse_machine_yaml(ANCESTOR_YAML, source="example/machine.yaml")
    assert m == Machine(
        name="machine",
        host="105.29.123.241",
        port=22,
        user="ben",
        key_paths=(str(home / ".ssh/id_ssh_key"),),
        source="example/machine.yaml",
    )
    assert m.workdir == DEFAULT_WORKDIR
    assert m.known_hosts is None
    assert m.max_sessions == 10
    assert m.connect_timeout == 10.0
    assert m.forward_agent is False
    assert m.is_local is False


def test_all_keys(tmp_path: Path) -> None:
    text = """
name: big-gpu
ip: gpu1.example.com
username: alice
port: 2222
ssh_key_path: [keys/id_a, /abs/id_b]
known_hosts: kh/known
workdir: /scratch/alice/sched
max_sessions: 4
connect_timeout: 2.5
forward_agent: yes
proxy_jump: bob@bastion:2200
"""
    m = parse_machine_yaml(text, source=str(tmp_path / "conf" / "m.yaml"))
    assert m.name == "big-gpu"
    assert m.host == "gpu1.example.com"
    assert m.user == "alice"
    assert m.port == 2222
    assert m.key_paths == (str(tmp_path / "conf" / "keys" / "id_a"), "/abs/id_b")
    assert m.known_hosts == (str(tmp_path / "conf" / "kh" / "known"),)
    assert m.workdir == "/scratch/alice/sched"
    assert m.max_sessions == 4
    assert m.connect_timeout == 2.5
    assert m.forward_agent is True
    assert m.proxy_jump == "bob@bastion:2200"


def test_relative_paths_use_yaml_dir_even_when_source_is_relative(tmp_path: Path) -> None:
    m = parse_machine_yaml("ip: h\nssh_key_path: id\n", source="sub/m.yaml")
    assert m.key_paths == (str(Path.cwd() / "sub" / "id"),)
    m2 = parse_machine_yaml("ip: h\nssh_key_path: id\n", source="x", base_dir=tmp_path)
    assert m2.key_paths == (str(tmp_path / "id"),)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("ip: 10.0.0.5\n", {"user": None, "port": 22, "key_paths": ()}),  # only ip is required
        ("ip: '::1'\n", {"host": "::1"}),
        ("ip: '[fe80::1%eth0]'\n", {"host": "fe80::1%eth0"}),
        ("ip: h\nport:\nusername:\n", {"port": 22, "user": None}),  # empty = default
        ("ip: h\nconnect_timeout: 3\n", {"connect_timeout": 3.0}),
        ("ip: h\nproxy_jump: none\n", {"proxy_jump": None}),
        ("ip: h\nusername: svc_user.01\n", {"user": "svc_user.01"}),
        ("ip: h\nusername: 'machine$'\n", {"user": "machine$"}),
        ("ip: My-Host_1.lan\n", {"host": "My-Host_1.lan"}),
    ],
)
def test_yaml_variants(text: str, expect: dict[str, object]) -> None:
    m = parse_machine_yaml(text, source="m.yaml")
    for key, value in expect.items():
        assert getattr(m, key) == value


def test_name_defaults_to_stem_or_host() -> None:
    assert parse_machine_yaml("ip: h\n", source="/x/gpu7.yaml").name == "gpu7"
    assert parse_machine_yaml("ip: h\n", source="").name == "h"


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("", ["m.yaml", "empty"]),
        ("# only a comment\n", ["m.yaml", "empty"]),
        ("- ip: h\n", ["m.yaml", "got a list"]),
        ("just text\n", ["m.yaml", "single value"]),
        ("username: ben\nport: 22\n", ["m.yaml", "missing key 'ip'", "host name or address"]),
        ("ip:\n", ["m.yaml line 1", "'ip' is empty"]),
        (
            "ip: h\nusernme: ben\n",
            ["m.yaml line 2", "'usernme'", "did you mean 'username'", "valid keys: ip, username"],
        ),
        ("ip: h\n1: x\n", ["m.yaml", "unknown key 1"]),
        ("ip: h\nip: g\n", ["m.yaml line 2", "'ip' is given twice", "line 1"]),
        ("ip: 12345\n", ["m.yaml line 1", "'ip' must be a host name", "quotes"]),
        ("ip: ben@h\n", ["'ben@h'", "user name in its own setting"]),
        ("ip: 'h:22'\n", ["'h:22'", "port in its own setting"]),
        ("ip: '-oProxyCommand=x'\n", ["'-oProxyCommand=x'", "not starting with '-'"]),
        ("ip: 'h; rm -rf /'\n", ["not a valid host"]),
        ("ip: 'a b'\n", ["not a valid host"]),
        ("ip: h/x\n", ["not a valid host"]),
        ("ip: '[1::2::3]'\n", ["not a valid host"]),
        (
            "ip: h\nport: abc\n",
            ["m.yaml line 2", "'port' must be a whole number from 1 to 65535", "'abc'"],
        ),
        ("ip: h\nport: 0\n", ["'port'", "from 1 to 65535"]),
        ("ip: h\nport: 70000\n", ["'port'", "70000"]),
        ("ip: h\nport: true\n", ["'port'", "True"]),
        ("ip: h\nport: 22.5\n", ["'port'", "22.5"]),
        ("ip: h\nusername: '-x'\n", ["m.yaml line 2", "'-x'", "not starting with '-'"]),
        ("ip: h\nusername: 'a b'\n", ["'a b'", "not a valid user name"]),
        ("ip: h\nusername: 'a;b'\n", ["'a;b'"]),
        ("ip: h\nusername: 42\n", ["'username' must be text"]),
        ("ip: h\nssh_key_path: 5\n", ["'ssh_key_path' must be a path"]),
        ("ip: h\nssh_key_path: []\n", ["'ssh_key_path' is an empty list"]),
        ("ip: h\nssh_key_path: [a, {b: c}]\n", ["'ssh_key_path' must be a path"]),
        ("ip: h\nknown_hosts: ''\n", ["'known_hosts' must be a path"]),
        ("ip: h\nmax_sessions: 0\n", ["'max_sessions'", "at least 1"]),
        ("ip: h\nmax_sessions: many\n", ["'max_sessions'", "'many'"]),
        ("ip: h\nconnect_timeout: 0\n", ["'connect_timeout'", "greater than 0"]),
        ("ip: h\nconnect_timeout: -1\n", ["'connect_timeout'"]),
        ("ip: h\nconnect_timeout: .nan\n", ["'connect_timeout'"]),
        ("ip: h\nconnect_timeout: soon\n", ["'connect_timeout'", "'soon'"]),
        ("ip: h\nforward_agent: 'yes'\n", ["'forward_agent' must be true or false"]),
        ('ip: h\nworkdir: "a\\nb"\n', ["'workdir'", "newline"]),
        ('ip: h\nworkdir: "a\\0b"\n', ["'workdir'", "NUL"]),
        ("ip: h\nworkdir: [a]\n", ["'workdir' must be a remote folder path"]),
        ("ip: h\nname: ''\n", ["'name' must be printable text"]),
        ("ip: h\nname: a/b\n", ["'name'", "'a/b'"]),
        ("ip: h\nproxy_jump: 'a b'\n", ["proxy_jump", "[user@]host[:port]"]),
        ("ip: h\nproxy_jump: '-J x'\n", ["proxy_jump"]),
    ],
)
def test_yaml_errors(text: str, needles: list[str]) -> None:
    one_line_error(config_error(parse_machine_yaml, text, source="m.yaml"), *needles)


def test_deep_nesting_is_a_config_error() -> None:
    message = config_error(parse_machine_yaml, "ip: " + "[" * 5000 + "]" * 5000, source="d.yaml")
    one_line_error(message, "d.yaml", "nested too deeply")


def test_python_tag_refused() -> None:
    text = "ip: !!python/object/apply:os.system ['touch /tmp/pwned']\n"
    message = config_error(parse_machine_yaml, text, source="evil.yaml")
    one_line_error(message, "evil.yaml line 1", "python/object/apply:os.system", "not allowed")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("ip: h\nport: [22\n", "line 3"),
        ("ip: h\n  port: 22\n", "line 2, column 7"),
        ("ip: 'unterminated\n", "line 2"),
        ("ip: h\n\tport: 22\n", "line 2"),
        ("ip: h\n---\nip: g\n", "line 2"),
        ("ip: *nope\n", "line 1"),
    ],
)
def test_malformed_yaml_has_line_and_column(text: str, where: str) -> None:
    message = config_error(parse_machine_yaml, text, source="bad.yaml")
    one_line_error(message, "bad.yaml", where, "column")


# Read by libyaml (when PyYAML has it) and by PyYAML's Python parser, each machine file must give
# the same Machine, or the same message: the values, the errors and where they stand.
BOTH_PARSERS = [
    ANCESTOR_YAML, "ip: 10.0.0.5\n", "ip: '::1'\n", "ip: h\nport:\nusername:\n", "ip: h\nconnect_timeout: 3\n",
    "ip: h\nport: 0x16\n", "ip: h\nport: 1_000\n", "ip: h\nusername: 0o17\n", "ip: h\nname: 2001-01-01\n",
    "ip: &a h\nname: *a\n", "ip: h\nport: .inf\n", "\ufeffip: h\n", "ip: h\r\nport: 22\r\n", 'ip: "\\x00"\n',
    "ip: h\nport: 22 # a comment\n", "ip: >\n  folded\n", "ip: h\nenv:\n  A: 1\n  B: yes\n",
    "", "# only a comment\n", "- ip: h\n", "just text\n", "ip: h\nusernme: ben\n", "ip: h\nport: [22\n",
    "ip: h\n  port: 22\n", "ip: 'unterminated\n", "ip: h\n\tport: 22\n", "ip: h\n---\nip: g\n", "ip: *nope\n",
    "ip: " + "[" * 5000 + "]" * 5000, "ip: !!python/object/apply:os.system ['touch /tmp/x']\n", "ip: h\nip: g\n",
    "ip: h\n? [a]\n: b\n", "ip: h\nport: !!int '22'\n", "ip: h\nport: !!binary aGk=\n", "ip: [h\n",
]


@pytest.mark.parametrize("text", BOTH_PARSERS)
def test_libyaml_and_python_read_a_machine_file_alike(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def outcome() -> Machine | str:
        try:
            return parse_machine_yaml(text, source="m.yaml")
        except ConfigError as exc:
            return str(exc)

    assert machine_yaml._FAST_LOADER is not None  # (PyYAML's wheels have libyaml: this compares two)
    fast = outcome()
    monkeypatch.setattr(machine_yaml, "_FAST_LOADER", None)
    assert outcome() == fast


def test_local_machine() -> None:
    m = local_machine()
    assert (m.name, m.is_local, m.workdir) == ("localhost", True, DEFAULT_WORKDIR)


# ---------------------------------------------------------------------------------------------
# lookup


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_lookup_order(tmp_path: Path) -> None:
    var = tmp_path / "var"
    write(Path("m"), "ip: from-path\n")
    write(Path("m.yaml"), "ip: from-path-yaml\n")
    write(var / "m", "ip: from-var\n")
    write(var / "m.yaml", "ip: from-var-yaml\n")
    dirs = [var]
    assert load_machine("m", search_dirs=dirs).host == "from-path"
    Path("m").unlink()
    m = load_machine("m", search_dirs=dirs)
    assert (m.host, m.source) == ("from-path-yaml", "m.yaml")
    Path("m.yaml").unlink()
    assert load_machine("m", search_dirs=dirs).host == "from-var"
    (var / "m").unlink()
    m = load_machine("m", search_dirs=dirs)
    assert (m.host, m.source, m.name) == ("from-var-yaml", str(var / "m.yaml"), "m")


def test_lookup_default_search_dir_is_local_var(_home: Path) -> None:
    write(_home / ".local" / "var" / "box.yaml", "ip: box.lan\nssh_key_path: k\n")
    m = load_machine("box")
    assert m.host == "box.lan"
    assert m.key_paths == (str(_home / ".local" / "var" / "k"),)


def test_lookup_path_with_directories_and_tilde(_home: Path) -> None:
    write(Path("example/machine.yaml"), ANCESTOR_YAML)
    assert load_machine("example/machine.yaml").source == "example/machine.yaml"
    assert load_machine("example/machine").source == "example/machine.yaml"
    write(_home / "ms" / "a.yaml", "ip: a\n")
    assert load_machine("~/ms/a.yaml").host == "a"


def test_not_found_message(_home: Path) -> None:
    message = config_error(load_machine, "gpu99")
    one_line_error(
        message,
        "no machine 'gpu99'",
        "not a file (gpu99, gpu99.yaml)",
        "not in ~/.local/var/",
        "not a Host in ~/.ssh/config",
        "user@gpu99",
    )


def test_errors_in_found_file_name_the_file() -> None:
    write(Path("m.yaml"), "ip: h\nprot: 22\n")
    one_line_error(
        config_error(load_machine, "m"), "m.yaml line 2", "'prot'", "did you mean 'port'"
    )


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    write(Path("bin.yaml"), "")
    Path("bin.yaml").write_bytes(b"ip: \xff\xfe\n")
    one_line_error(config_error(load_machine, "bin"), "bin.yaml", "UTF-8")
    Path("big.yaml").write_bytes(b"#" * (2 << 20))
    one_line_error(config_error(load_machine, "big"), "big.yaml", "larger than")


def test_empty_spec() -> None:
    one_line_error(config_error(load_machine, "  "), "empty machine name")
    one_line_error(config_error(load_machine, "~\x00x"), "control character")
    one_line_error(config_error(load_machine, "a\nb"), "control character")


# ---------------------------------------------------------------------------------------------
# ~/.ssh/config (the differential tests against ssh -G are in test_ssh_config_differential.py)

SSH_CONFIG = """\
# comment
ForwardAgent no

Host gpu1 gpu1-alias
    HostName gpu1.cluster.example.com
    User alice
    Port 2201
    IdentityFile ~/.ssh/id_gpu
    IdentityFile=~/.ssh/id_%h_%r
    ProxyJump bastion

Host gpu*
    HostName %h.internal
    User bob
    UserKnownHostsFile ~/.ssh/kh1 ~/.ssh/kh2

Host *.lan !bad.lan
    ConnectTimeout 3

host = quoted
    hostname "q.example.com"
    IdentityFile "~/.ssh/my key"

Match originalhost foo
    User matchuser

Host * !bastion
    User fallback
    ConnectTimeout 7
    ForwardAgent yes
"""


def keys(home: Path, *names: str) -> None:
    for name in names:
        write(home / ".ssh" / name, "not really a key\n")


def resolve(tmp_path: Path, text: str, alias: str, **preset: object) -> SshHost:
    cfg = write(tmp_path / "ssh_config_under_test", text)
    return SshConfigs(cfg).resolve(alias, **preset)  # type: ignore[arg-type]


def test_load_machine_from_alias(tmp_path: Path, _home: Path) -> None:
    keys(_home, "id_gpu")
    cfg = write(tmp_path / "ssh_config", SSH_CONFIG)
    m = load_machine("gpu1", ssh_config=cfg)
    assert m.name == "gpu1"
    assert m.host == "gpu1.cluster.example.com"
    assert m.user == "alice"
    assert m.port == 2201
    assert m.key_paths == (str(_home / ".ssh/id_gpu"),)  # the second key does not exist
    assert m.proxy_jump == "bastion"
    assert m.jump_host is not None and m.jump_host.host == "bastion"
    assert m.jump_host.user == "localuser"  # Host * !bastion does not apply to the jump host
    assert m.forward_agent is False  # the global line comes first
    assert m.connect_timeout == 7.0  # from Host *
    assert m.known_hosts == (str(_home / ".ssh/kh1"), str(_home / ".ssh/kh2"))
    assert "Host gpu1" in m.source


def test_first_value_wins_and_tokens(tmp_path: Path, _home: Path) -> None:
    r = resolve(tmp_path, SSH_CONFIG, "gpu1")
    assert (r.hostname, r.user, r.port) == ("gpu1.cluster.example.com", "alice", 2201)
    assert r.identity_files == ("~/.ssh/id_gpu", "~/.ssh/id_%h_%r")
    assert r.identity_paths[1] == str(_home / ".ssh/id_gpu1.cluster.example.com_alice")
    gpu7 = resolve(tmp_path, SSH_CONFIG, "gpu7")
    assert (gpu7.hostname, gpu7.user) == ("gpu7.internal", "bob")
    assert resolve(tmp_path, SSH_CONFIG, "box.lan").connect_timeout == 3
    assert resolve(tmp_path, SSH_CONFIG, "bad.lan").connect_timeout == 7  # negated
    assert resolve(tmp_path, SSH_CONFIG, "quoted").identity_paths == (str(_home / ".ssh/my key"),)


def test_host_patterns_are_case_sensitive_as_in_ssh(tmp_path: Path) -> None:
    upper = resolve(tmp_path, SSH_CONFIG, "GPU1")
    assert (upper.hostname, upper.user, upper.port) == ("gpu1", "fallback", 22)


def test_match_blocks_apply(tmp_path: Path, _home: Path) -> None:
    text = (
        "Match originalhost gpu1\n  Port 2200\n"
        "Host gpu1\n  HostName 10.0.0.7\n"
        "Match host 10.0.0.*\n  ProxyJump bastion\n"
        "Match user ben\n  IdentityFile ~/.ssh/ben_key\n"
        "Match localuser localuser\n  ConnectTimeout 4\n"
    )
    cfg = write(tmp_path / "c", text)
    m = load_machine("gpu1", ssh_config=cfg)
    assert (m.host, m.port, m.proxy_jump, m.connect_timeout) == ("10.0.0.7", 2200, "bastion", 4.0)
    assert m.jump_host is not None and m.jump_host.host == "bastion"
    keys(_home, "ben_key")
    assert load_machine("ben@gpu1", ssh_config=cfg).key_paths == (str(_home / ".ssh/ben_key"),)
    # an alias known only through a Match, or through Host * with a HostName, is found
    assert load_machine("foo", ssh_config=write(tmp_path / "d", SSH_CONFIG)).user == "matchuser"
    star = write(tmp_path / "e", "Host *\n  HostName %h.corp.example.com\n")
    assert load_machine("db1", ssh_config=star).host == "db1.corp.example.com"


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("Host a\n  HostNmae 10.0.0.1\n", ["line 2", "unknown keyword 'HostNmae'", "IgnoreUnknown"]),
        ("Host b\n  HostNmae 10.0.0.1\n", ["line 2", "HostNmae"]),  # also where it does not apply
        ("Host a\n  HostName a b\n", ["line 2", "hostname takes one value"]),
        ("Host a\n  IdentityFile /k1 /k2\n", ["line 2", "identityfile takes one value"]),
        ("Host a\n  HostName 'x\n", ["line 2", "unbalanced"]),
        ("Host\n", ["line 1", "no value"]),
        ("Host a\n  IdentityFile ~/.ssh/id_%Q\n", ["line 2", "'%Q'", "when connecting"]),
        ("Host a\n  IdentityFile ~\x00x\n", ["line 2", "control character"]),
        ("Host a\n  Port http-nope\n", ["line 2", "Port 'http-nope'"]),
        ("Match exec true\n  User x\n", ["line 1", "Match exec is not supported"]),
        ("Match final\n  User x\n", ["line 1", "Match final is not supported"]),
        ("CanonicalizeHostname yes\n", ["line 1", "CanonicalizeHostname is not supported"]),
        ("Match frob x\n", ["line 1", "unsupported Match criterion 'frob'"]),
        ("Host a\n  UserKnownHostsFile none /x\n", ["line 2", "'none' must appear alone"]),
        ("Host a\n  ProxyJump h:nope\n", ["line 2", "invalid ProxyJump"]),
    ],
)
def test_ssh_config_errors(tmp_path: Path, text: str, needles: list[str]) -> None:
    cfg = write(tmp_path / "c", text)
    message = config_error(load_machine, "a", ssh_config=cfg)
    one_line_error(message, str(cfg), *needles)


def test_ignore_unknown_is_honoured(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c", "IgnoreUnknown HostNmae,Use*\nHost a\n  HostNmae x\n  UseFoo 1\n"
                "  HostName 10.1.1.1\n")
    assert load_machine("a", ssh_config=cfg).host == "10.1.1.1"


def test_account_comes_from_the_password_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real account, with $USER and $HOME lying about it
    monkeypatch.setenv("USER", "somebody-else")
    monkeypatch.setenv("LOGNAME", "somebody-else")
    monkeypatch.setenv("HOME", "/nonexistent")
    account = current_account()
    entry = pwd.getpwuid(os.getuid())
    assert (account.user, account.home, account.uid) == (entry.pw_name, entry.pw_dir, os.getuid())


def test_system_config_is_read_after_the_user_config(tmp_path: Path, _home: Path) -> None:
    write(_home / ".ssh" / "config", "Host box\n  HostName 10.0.0.9\n  Port 2222\n")
    write(tmp_path / "etc.d" / "10-site.conf", "Host box\n  User siteuser\n  Port 1\n")
    system = write(tmp_path / "etc_ssh_config", f"Include {tmp_path}/etc.d/*.conf\nHost *\n  User x\n")
    m = load_machine("box")
    assert (m.host, m.port, m.user) == ("10.0.0.9", 2222, "siteuser")
    assert "~/.ssh/config or" in config_error(load_machine, "nothere")
    system.write_text("Host box\n  Bogus 1\n")
    one_line_error(config_error(load_machine, "box"), str(system), "line 2", "Bogus")


def test_include_relative_to_dot_ssh(tmp_path: Path, _home: Path) -> None:
    ssh = _home / ".ssh"
    write(ssh / "conf.d" / "a.conf", "Host inc1\n  HostName 10.9.9.9\n")
    write(ssh / "config", "Include conf.d/*.conf\nHost other\n  User o\n")
    assert load_machine("inc1").host == "10.9.9.9"
    # an Include inside a Host block only applies to that host
    write(ssh / "config", "Host outer\n  Include extra\n  HostName 10.0.0.1\n")
    write(ssh / "extra", "User fromextra\n")
    m = load_machine("outer")
    assert (m.user, m.host) == ("fromextra", "10.0.0.1")
    write(ssh / "config", "Include config\n")
    one_line_error(config_error(load_machine, "x"), "Include nested")
    # -F style: relative includes are still under ~/.ssh, not next to the file
    cfg = write(tmp_path / "elsewhere" / "cfg", "Include conf.d/*.conf\n")
    assert load_machine("inc1", ssh_config=cfg).host == "10.9.9.9"


def test_jump_host_resolved_with_the_same_rules(tmp_path: Path, _home: Path) -> None:
    """A host defined twice through an Include: the target and the jump host agree."""
    ssh = _home / ".ssh"
    write(ssh / "config.d" / "1.conf", "Host bastion\n  HostName 10.0.0.1\n  Port ssh\n")
    write(ssh / "config.d" / "2.conf", "Host bastion\n  HostName 10.0.0.2\n  User nope\n")
    write(
        ssh / "config",
        "Include config.d/*.conf\nHost gpu1\n  HostName 10.1.0.1\n  ProxyJump bastion\n"
        "Host bastion\n  User ops\n",
    )
    direct = load_machine("bastion")
    via = load_machine("gpu1").jump_host
    assert via is not None
    assert (direct.host, direct.port, direct.user) == ("10.0.0.1", 22, "nope")
    assert (via.host, via.port, via.user) == (direct.host, direct.port, direct.user)


def test_jump_chain_as_ssh_dash_j(tmp_path: Path) -> None:
    text = (
        "Host target\n  ProxyJump ssh://ops@j1:2022,j2\n"
        "Host j2\n  HostName 10.0.0.2\n  ProxyJump elsewhere\n"
        "Host j1\n  HostName 10.0.0.1\n"
    )
    m = load_machine("target", ssh_config=write(tmp_path / "c", text))
    assert m.proxy_jump == "ssh://ops@j1:2022,j2"
    j2 = m.jump_host
    assert j2 is not None and (j2.host, j2.proxy_jump) == ("10.0.0.2", "ops@j1:2022")
    j1 = j2.jump_host  # -J overrides j2's own ProxyJump, as on ssh's command line
    assert j1 is not None and (j1.host, j1.port, j1.user, j1.jump_host) == ("10.0.0.1", 2022, "ops", None)


def test_jump_loop_is_refused(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c", "Host *\n  ProxyJump bastion\n  HostName %h.lan\n")
    one_line_error(config_error(load_machine, "gpu1", ssh_config=cfg), "ProxyJump loops", "!bastion")


def test_values_ssh_accepts(tmp_path: Path, _home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYS", str(tmp_path / "keys"))
    write(tmp_path / "keys" / f"id_{os.getuid()}", "k\n")
    keys(_home, "second")
    text = (
        "Host a\n  User ben@corp.example.com\n  Port ssh\n  IdentityFile ~/.ssh/missing\n"
        "  IdentityFile ~/.ssh/second\n  IdentityFile ${KEYS}/id_%i\n"
        "  ProxyCommand ssh -W %h:%p gw.example.com\n"
    )
    m = load_machine("a", ssh_config=write(tmp_path / "c", text))
    assert (m.user, m.port) == ("ben@corp.example.com", 22)
    assert m.key_paths == (str(_home / ".ssh/second"), str(tmp_path / "keys" / f"id_{os.getuid()}"))
    assert m.proxy_command == "exec ssh -W a:22 gw.example.com"
    assert m.jump_host is None


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        ("Host b\n  HostKeyAlias other\n", ["line 2", "HostKeyAlias is not supported"]),
        ("Host b\n  IdentityFile none\n", ["line 2", "none of the IdentityFile keys exist"]),
        ("Host b\n  User '-oops'\n", ["line 2", "'-oops'"]),
        ("Host b\n  HostName 'bad host'\n", ["line 2", "'bad host'"]),
        ("Host b\n  ForwardAgent /tmp/sock\n", ["line 2", "ForwardAgent"]),
    ],
)
def test_alias_value_errors(tmp_path: Path, config: str, needles: list[str]) -> None:
    cfg = write(tmp_path / "c", config)
    one_line_error(config_error(load_machine, "b", ssh_config=cfg), *needles)


def test_default_ssh_config_location(_home: Path) -> None:
    write(_home / ".ssh" / "config", "Host mybox\n  HostName 10.0.0.9\n")
    assert load_machine("mybox").host == "10.0.0.9"
    message = config_error(load_machine, "other")
    one_line_error(message, "not a Host in ~/.ssh/config")


def test_wildcard_only_alias_is_an_error(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c", "Host *\n  User u\n")
    one_line_error(config_error(load_machine, "gpu-typo", ssh_config=cfg), "no machine 'gpu-typo'")


# ---------------------------------------------------------------------------------------------
# user@host[:port]


@pytest.mark.parametrize(
    ("spec", "user", "host", "port"),
    [
        ("ben@gpu1", "ben", "gpu1", 22),
        ("ben@gpu1:2222", "ben", "gpu1", 2222),
        ("ben@10.0.0.5:22", "ben", "10.0.0.5", 22),
        ("ben@[::1]:2200", "ben", "::1", 2200),
        ("ben@[::1]", "ben", "::1", 22),
        ("ben@fe80::1", "ben", "fe80::1", 22),
    ],
)
def test_user_at_host(spec: str, user: str, host: str, port: int) -> None:
    m = load_machine(spec)
    assert (m.user, m.host, m.port, m.name, m.source) == (user, host, port, spec, spec)


def test_user_at_host_uses_ssh_config_with_spec_precedence(tmp_path: Path, _home: Path) -> None:
    keys(_home, "id_gpu", "id_gpu1.cluster.example.com_carol")
    cfg = write(tmp_path / "c", SSH_CONFIG)
    m = load_machine("carol@gpu1:2999", ssh_config=cfg)
    assert (m.user, m.host, m.port) == ("carol", "gpu1.cluster.example.com", 2999)
    assert m.key_paths[1] == str(_home / ".ssh/id_gpu1.cluster.example.com_carol")  # %r = carol
    m2 = load_machine("carol@random-host", ssh_config=cfg)  # Host * applies here
    assert (m2.user, m2.connect_timeout, m2.forward_agent) == ("carol", 7.0, False)


@pytest.mark.parametrize(
    ("spec", "needles"),
    [
        ("@h", ["'@h'", "user name before '@' is empty"]),
        ("ben@", ["'ben@'", "not a valid host"]),
        ("ben@h:x", ["'ben@h:x'", "port 'x'"]),
        ("ben@h:0", ["port '0'"]),
        ("ben@[::1", ["'[' without ']'"]),
        ("ben@[::1]x", ["after ']'"]),
        ("-x@h", ["'-x'"]),
        ("ben@-h", ["not starting with '-'"]),
        ("ben@h;ls", ["not a valid host"]),
    ],
)
def test_user_at_host_errors(spec: str, needles: list[str]) -> None:
    one_line_error(config_error(load_machine, spec), *needles)


# ---------------------------------------------------------------------------------------------
# load_machines


def make_machines(var: Path, *names: str, port: int = 22) -> None:
    for name in names:
        write(var / f"{name}.yaml", f"ip: {name}.lan\nport: {port}\n")


def test_load_machines_ranges_and_exclude(tmp_path: Path) -> None:
    var = tmp_path / "var"
    make_machines(var, *(f"gpu{i}" for i in range(1, 9)), "gpu12")
    ms = load_machines(["gpu[1-8,12]"], exclude=["gpu[3-4]", "gpu12"], search_dirs=[var])
    assert [m.name for m in ms] == ["gpu1", "gpu2", "gpu5", "gpu6", "gpu7", "gpu8"]


def test_load_machines_exclude_matches_display_name(tmp_path: Path) -> None:
    var = tmp_path / "var"
    write(var / "a.yaml", "ip: a.lan\nname: alpha\n")
    write(var / "b.yaml", "ip: b.lan\n")
    ms = load_machines(["a", "b"], exclude=["alpha"], search_dirs=[var])
    assert [m.name for m in ms] == ["b"]


def test_load_machines_excluded_specs_are_never_loaded(tmp_path: Path) -> None:
    var = tmp_path / "var"
    make_machines(var, "ok")
    write(var / "broken.yaml", "ip: [\n")
    assert [
        m.name for m in load_machines(["ok", "broken"], exclude=["broken"], search_dirs=[var])
    ] == ["ok"]


def test_load_machines_range_of_user_at_host() -> None:
    ms = load_machines(["ben@gpu[1-2]:2222", "ben@[::1]:22"])
    assert [(m.host, m.port) for m in ms] == [("gpu1", 2222), ("gpu2", 2222), ("::1", 22)]


def test_load_machines_file_with_brackets_in_name(tmp_path: Path) -> None:
    write(Path("odd[1].yaml"), "ip: odd\n")
    assert load_machines(["odd[1].yaml"])[0].host == "odd"


@pytest.mark.parametrize(
    ("specs", "exclude", "needles"),
    [
        (
            ["a", "a"],
            [],
            ["'a' and 'a'", "both connect to localuser@a.lan:22", "list each machine once"],
        ),
        (["a", "a2"], [], ["'a' and 'a2'", "A.LAN:22"]),
        (["a", "localuser@a.lan"], [], ["'a' and 'localuser@a.lan'"]),
        (["a", "sub/a"], [], ["same name 'a'", "name:"]),
        (["a"], ["a"], ["every machine was excluded"]),
        (["a", "b"], ["c"], ["exclude 'c' matches no machine", "a,b"]),
        ([], [], ["no machines given"]),
        (["gpu[2-1]"], [], ["'gpu[2-1]'", "2-1"]),
        (["nothere"], [], ["no machine 'nothere'"]),
    ],
)
def test_load_machines_errors(
    tmp_path: Path, specs: list[str], exclude: list[str], needles: list[str]
) -> None:
    var = tmp_path / "var"
    make_machines(var, "a", "b")
    write(var / "a2.yaml", "ip: A.LAN\n")
    write(var / "sub" / "a.yaml", "ip: other.lan\n")
    message = config_error(load_machines, specs, exclude=exclude, search_dirs=[var])
    one_line_error(message, *needles)
