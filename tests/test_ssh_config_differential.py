"""Our ssh config resolution against the real ``ssh -G`` (OpenSSH from the distribution).

Each case is one config file and one host name.  Both sides must agree on the host name, user,
port, identity files, ProxyJump, ProxyCommand, UserKnownHostsFile and HostKeyAlias; when ssh
refuses the config, we must refuse it too; when we refuse a config ssh accepts, the refusal must
be one of the deliberate ones (one line naming the file, line and keyword).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.ssh_config import SYSTEM_SSH_CONFIG, read_config_file
from ssh_scheduler.ssh_resolve import SshHost, resolve_host
from tests.ssh_reference import Reference, make_reference

DELIBERATE = ("is not supported", "when connecting")
"""Words of every deliberate refusal (Match exec/canonical/final, CanonicalizeHostname...), and of
errors ssh only meets when it connects (``ssh -G`` does not expand IdentityFile/ProxyCommand)."""


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    assert shutil.which("ssh"), "openssh-client is installed by scripts/test"
    return make_reference(tmp_path_factory.mktemp("sshref"))


def ours(ref: Reference, config: Path, host: str, system: Path | None = None) -> SshHost:
    home = ref.account.home
    configs = [read_config_file(config, home=home)]
    if system is not None:
        configs.append(read_config_file(system, home=home, user_config=False))
    return resolve_host(
        host, [c for c in configs if c is not None], ref.account, environ=ref.env
    )


def compare(ref: Reference, config: Path, host: str, system: bool = False) -> str:
    """Resolve with both; assert they agree; return 'same', 'both refuse' or 'we refuse'."""
    status, theirs, stderr = ref.run(host, None if system else config)
    try:
        mine = ours(ref, config, host, SYSTEM_SSH_CONFIG if system else None)
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message
        if status != 0:
            return "both refuse"
        assert any(word in message for word in DELIBERATE), (message, config.read_text())
        assert " line " in message, message
        return "we refuse"
    text = config.read_text()
    assert status == 0, (stderr, text, mine)
    assert theirs["hostname"] == [mine.hostname], text
    assert theirs["user"] == [mine.user], text
    assert theirs["port"] == [str(mine.port)], text
    if mine.identity_files:
        assert theirs["identityfile"] == list(mine.identity_files), text
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
    "HostName": ["10.0.0.1", "%h.lan", "Node-%h", "x%%y", "MiXeD.Example", "%h", "FE80::1"],
    "User": ["ben", "alice", "ben@corp.example.com", "%u", "'quoted user'"],
    "Port": ["2200", "ssh", "22", "+2201", "http", "022"],
    "IdentityFile": [
        "~/.ssh/id_%h", "/keys/%r@%h:%p", "${HOME}/k", "id_rel", "~/.ssh/id_a", "none",
        "%d/%u/%C", '"~/my key"', "~root/k",
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


def test_generated_configs_agree_with_ssh(ref: Reference, tmp_path: Path) -> None:
    rng = random.Random(20261126)
    outcomes: dict[str, int] = {}
    config = tmp_path / "config"
    for _ in range(300):
        config.write_text(generated_config(rng))
        outcome = compare(ref, config, rng.choice(HOSTS))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # the generator must exercise all three outcomes, mostly agreement
    print(outcomes)
    assert outcomes["same"] > 150, outcomes
    assert outcomes["both refuse"] > 10, outcomes
    assert outcomes["we refuse"] > 3, outcomes
