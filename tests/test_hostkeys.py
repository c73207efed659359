"""Host trust and client keys, end to end.

In-process tests use the hostile asyncssh server on 127.0.0.1 (a port other than 22, so the
``[host]:port`` known_hosts form is exercised); cluster tests drive the real ``execute_remote``
CLI against real sshd hosts, checking the one-line error, the exit status (255) and that nothing
was dispatched.  Every CLI run gets its own HOME, so the developer's ~/.ssh is never read or
written.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import pwd
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncssh
import pytest
import yaml

from ssh_scheduler.errors import AuthenticationError, HostKeyError
from ssh_scheduler.transport.ssh import connect
from tests.cluster import Cluster, Host
from tests.hostile_server import HostileServer, hostile_server
from tests.ssh_reference import account_env

REPO = Path(__file__).resolve().parents[1]
EXECUTE_REMOTE = [sys.executable, "-m", "ssh_scheduler", "execute_remote"]


# --- helpers -------------------------------------------------------------------------------------


def fingerprint(pub_path: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(pub_path)], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]  # "256 SHA256:... comment (ED25519)"


def host_pub(host: Host) -> str:
    return " ".join((host.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2])


def hashed_name(name: str) -> str:
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


class Env:
    """A scratch HOME and cwd for CLI runs, plus machine files written into it."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.cwd = tmp_path / "work"
        self.cwd.mkdir()
        self.vars = {
            k: v for k, v in os.environ.items() if k not in ("SSH_AUTH_SOCK", "SSH_AGENT_PID")
        }
        self.vars.update(HOME=str(self.home), PYTHONPATH=str(REPO))
        # ssh (and so ssh_scheduler) takes the home from the password database, not $HOME.
        self.vars.update(account_env(tmp_path, self.home, pwd.getpwuid(os.getuid()).pw_name))

    def machine(self, host: Host, name: str = "m", **changes: object) -> Path:
        spec = dict(host.machine_yaml())
        for key, value in changes.items():
            if value is None:
                spec.pop(key, None)
            else:
                spec[key] = value
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    def run(self, machine: Path | str, *args: str, command: str = "echo hi") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*EXECUTE_REMOTE, "--machine", str(machine), *args, command],
            cwd=self.cwd, env=self.vars, capture_output=True, text=True, timeout=90,
        )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def nothing_dispatched(env: Env, host: Host, job: str) -> None:
    assert not (env.cwd / "job_results" / job).exists()
    assert not (env.cwd / "job_results" / f"{job}.out").exists()
    jobs = host.workdir / "jobs"
    assert not (jobs.exists() and any(p.name.endswith("-" + job) for p in jobs.iterdir()))


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


# --- in-process: known_hosts matching ------------------------------------------------------------


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[HostileServer]:
    async with hostile_server(tmp_path) as srv:
        yield srv


def server_key_line(srv: HostileServer) -> str:
    return srv.host_key.export_public_key().decode().strip()


async def check_connects(srv: HostileServer, **changes: object) -> None:
    transport = await connect(srv.machine(**changes))
    await transport.close()


async def test_port_entry_is_accepted(server: HostileServer) -> None:
    await check_connects(server)  # known_hosts: "[127.0.0.1]:<port> ssh-ed25519 ..."


async def test_hashed_port_entry_is_accepted(server: HostileServer) -> None:
    name = f"[127.0.0.1]:{server.port}"
    server.known_hosts.write_text(f"{hashed_name(name)} {server_key_line(server)}\n")
    await check_connects(server)


async def test_entry_without_the_port_does_not_cover_another_port(server: HostileServer) -> None:
    """OpenSSH looks a non-22 port up as [host]:port only (asyncssh would fall back)."""
    server.known_hosts.write_text(f"127.0.0.1 {server_key_line(server)}\n")
    with pytest.raises(HostKeyError) as info:
        await check_connects(server)
    message = str(info.value)
    assert "unknown host key SHA256:" in message and "(ssh-ed25519)" in message
    assert f"ssh-keyscan -p {server.port} 127.0.0.1" in message and "--accept-new" in message


async def test_accept_new_records_host_and_port(server: HostileServer) -> None:
    server.known_hosts.write_text("# my hosts\nother.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl")
    transport = await connect(server.machine(), accept_new=True)
    await transport.close()
    lines = server.known_hosts.read_text().splitlines()
    assert lines[1].startswith("other.example ")  # the unterminated last line was not glued to
    assert lines[2] == f"[127.0.0.1]:{server.port} {server_key_line(server)}"
    await check_connects(server)  # and now without accept_new


async def test_changed_key_is_refused_even_with_accept_new(server: HostileServer) -> None:
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    text = f"[127.0.0.1]:{server.port} {other}\n"
    server.known_hosts.write_text(text)
    for accept_new in (False, True):
        with pytest.raises(HostKeyError, match="HOST KEY CHANGED") as info:
            await connect(server.machine(), accept_new=accept_new)
        assert str(server.host_key.get_fingerprint()) in str(info.value)
    assert server.known_hosts.read_text() == text
    assert server.commands == []  # never logged in


async def test_revoked_key_is_refused_and_never_recorded(server: HostileServer) -> None:
    text = f"@revoked [127.0.0.1]:{server.port} {server_key_line(server)}\n"
    server.known_hosts.write_text(text)
    with pytest.raises(HostKeyError, match="revoked"):
        await connect(server.machine(), accept_new=True)
    assert server.known_hosts.read_text() == text


async def test_malformed_lines_are_skipped_not_fatal(server: HostileServer) -> None:
    good = server.known_hosts.read_text()
    server.known_hosts.write_text("garbage\n@bogus-marker x y\n|1|notbase64|x ssh-ed25519 AAAA\n" + good)
    await check_connects(server)


async def test_no_known_hosts_file_means_nothing_is_trusted(server: HostileServer) -> None:
    """``UserKnownHostsFile none`` must not turn checking off."""
    for accept_new in (False, True):
        with pytest.raises(HostKeyError, match="no known_hosts file"):
            await connect(server.machine(known_hosts=()), accept_new=accept_new)
    assert server.commands == []


async def test_missing_known_hosts_file_is_unknown(server: HostileServer, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "known_hosts"
    with pytest.raises(HostKeyError, match="unknown host key"):
        await connect(server.machine(known_hosts=(str(missing),)))
    assert not missing.exists()
    transport = await connect(server.machine(known_hosts=(str(missing),)), accept_new=True)
    await transport.close()
    assert missing.read_text() == f"[127.0.0.1]:{server.port} {server_key_line(server)}\n"
    assert (missing.parent.stat().st_mode & 0o777) == 0o700


async def test_wrong_client_key_is_permission_denied(server: HostileServer, tmp_path: Path) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    path = tmp_path / "other"
    key.write_private_key(str(path))
    path.chmod(0o600)
    with pytest.raises(AuthenticationError, match="permission denied"):
        await connect(server.machine(key_paths=(str(path),)))


# --- on the cluster, through the CLI -------------------------------------------------------------


def test_unknown_host_is_refused_then_accepted_and_recorded(cluster4: Cluster, env: Env) -> None:
    host = cluster4.hosts[0]
    kh = env.root / "known_hosts"
    machine = env.machine(host, known_hosts=str(kh))
    fp = fingerprint(host.dir / "ssh_host_ed25519_key.pub")

    refused = env.run(machine, "--job-name", "hk1")
    assert refused.returncode == 255
    line = one_line_error(refused)
    assert f"unknown host key {fp} (ssh-ed25519)" in line
    assert host.ip in line and "--accept-new" in line and f"ssh-keyscan {host.ip} >> {kh}" in line
    nothing_dispatched(env, host, "hk1")
    assert not kh.exists()

    accepted = env.run(machine, "--accept-new", "--job-name", "hk2")
    assert accepted.returncode == 0, accepted.stderr
    assert accepted.stdout == "hi\n"
    assert kh.read_text() == f"{host.ip} {host_pub(host)}\n"

    again = env.run(machine, "--job-name", "hk3")
    assert again.returncode == 0, again.stderr
    assert kh.read_text() == f"{host.ip} {host_pub(host)}\n"  # recorded once


def test_default_known_hosts_is_home_ssh_known_hosts(cluster4: Cluster, env: Env) -> None:
    host = cluster4.hosts[0]
    machine = env.machine(host, known_hosts=None)
    refused = env.run(machine)
    assert refused.returncode == 255
    assert f"not in {env.home}/.ssh/known_hosts" in one_line_error(refused)
    assert not (env.home / ".ssh").exists()
    accepted = env.run(machine, "--accept-new")
    assert accepted.returncode == 0, accepted.stderr
    assert (env.home / ".ssh" / "known_hosts").read_text() == f"{host.ip} {host_pub(host)}\n"
    assert ((env.home / ".ssh").stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize("key_type", ["ssh-ed25519", "ssh-rsa"])
def test_changed_host_key_is_refused_even_with_accept_new(cluster4: Cluster, env: Env, key_type: str) -> None:
    host = cluster4.hosts[0]
    kh = env.root / "known_hosts"
    other = asyncssh.generate_private_key(key_type, **({"key_size": 2048} if key_type == "ssh-rsa" else {}))
    text = f"{host.ip} {other.export_public_key().decode().strip()}\n"
    kh.write_text(text)
    machine = env.machine(host, known_hosts=str(kh))
    fp = fingerprint(host.dir / "ssh_host_ed25519_key.pub")
    for args in ((), ("--accept-new",)):
        result = env.run(machine, *args, "--job-name", "changed")
        assert result.returncode == 255
        line = one_line_error(result)
        assert "HOST KEY CHANGED" in line and fp in line and f"ssh-keygen -R {host.ip}" in line
        nothing_dispatched(env, host, "changed")
    assert kh.read_text() == text


def test_hashed_known_hosts_written_by_ssh_keygen(cluster4: Cluster, env: Env) -> None:
    host = cluster4.hosts[0]
    kh = env.root / "known_hosts"
    kh.write_text(f"{host.ip} {host_pub(host)}\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], capture_output=True, check=True)
    assert kh.read_text().startswith("|1|") and host.ip not in kh.read_text()
    result = env.run(env.machine(host, known_hosts=str(kh)))
    assert result.returncode == 0, result.stderr


def test_two_known_hosts_files_are_both_read(cluster4: Cluster, env: Env) -> None:
    host = cluster4.hosts[0]
    empty = env.root / "empty_known_hosts"
    empty.write_text("")
    result = env.run(env.machine(host, known_hosts=[str(empty), str(cluster4.known_hosts)]))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_private_key_readable_by_others_is_refused(cluster4: Cluster, env: Env, mode: int) -> None:
    host = cluster4.hosts[0]
    key = env.root / "id_open"
    key.write_bytes(cluster4.key_path.read_bytes())
    key.chmod(mode)
    result = env.run(env.machine(host, ssh_key_path=str(key)), "--job-name", "perm")
    assert result.returncode == 255
    line = one_line_error(result)
    assert "readable by others" in line and f"chmod 600 {key}" in line
    nothing_dispatched(env, host, "perm")


def passphrase_copy(cluster: Cluster, path: Path) -> Path:
    path.write_bytes(cluster.key_path.read_bytes())
    path.chmod(0o600)
    subprocess.run(
        ["ssh-keygen", "-q", "-p", "-P", "", "-N", "correct horse battery", "-f", str(path)],
        capture_output=True, check=True,
    )
    return path


def test_passphrase_key_without_agent_is_a_clear_error(cluster4: Cluster, env: Env) -> None:
    host = cluster4.hosts[0]
    key = passphrase_copy(cluster4, env.root / "id_locked")
    result = env.run(env.machine(host, ssh_key_path=str(key)), "--job-name", "locked")
    assert result.returncode == 255
    line = one_line_error(result)
    assert "protected by a passphrase" in line and "no ssh-agent" in line and f"ssh-add {key}" in line
    assert "correct horse" not in result.stderr + result.stdout
    nothing_dispatched(env, host, "locked")


@pytest.fixture
def agent(env: Env) -> Iterator[str]:
    """A private ssh-agent on a socket in tmp (stopped by its pid afterwards)."""
    sock = env.root / "agent.sock"
    out = subprocess.run(
        ["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, check=True, env=env.vars
    ).stdout
    match = re.search(r"SSH_AGENT_PID=(\d+)", out)
    assert match, out
    pid = int(match.group(1))
    try:
        yield str(sock)
    finally:
        os.kill(pid, signal.SIGTERM)


def test_ssh_agent_is_used(cluster4: Cluster, env: Env, agent: str) -> None:
    host = cluster4.hosts[0]
    env.vars["SSH_AUTH_SOCK"] = agent
    # Without a key the agent is refused the login...
    result = env.run(env.machine(host, ssh_key_path=None), "--job-name", "noagentkey")
    assert result.returncode == 255 and "permission denied" in one_line_error(result)
    subprocess.run(["ssh-add", str(cluster4.key_path)], env=env.vars, capture_output=True, check=True)
    # ...then the agent's key logs in (no ssh_key_path: the agent and ~/.ssh/id_*).
    result = env.run(env.machine(host, ssh_key_path=None))
    assert result.returncode == 0, result.stderr
    # A passphrase-protected IdentityFile is left to the agent that holds it.
    locked = passphrase_copy(cluster4, env.root / "id_locked")
    result = env.run(env.machine(host, ssh_key_path=str(locked)))
    assert result.returncode == 0, result.stderr


def test_agent_forwarding_is_off_unless_asked(cluster4: Cluster, env: Env, agent: str) -> None:
    host = cluster4.hosts[0]
    env.vars["SSH_AUTH_SOCK"] = agent
    subprocess.run(["ssh-add", str(cluster4.key_path)], env=env.vars, capture_output=True, check=True)
    probe = 'echo "sock=${SSH_AUTH_SOCK:-none}"'
    off = env.run(env.machine(host), command=probe)
    assert off.returncode == 0 and off.stdout == "sock=none\n", off.stderr
    on = env.run(env.machine(host, name="fwd", forward_agent=True), command=probe)
    assert on.returncode == 0, on.stderr
    assert on.stdout.startswith("sock=/") and on.stdout != "sock=none\n"


def test_ssh_config_alias_user_known_hosts_file(cluster4: Cluster, env: Env) -> None:
    host = cluster4.hosts[0]
    kh = env.root / "alias_known_hosts"
    ssh = env.home / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "config").write_text(
        f"Host myhost\n  HostName {host.ip}\n  Port {host.port}\n  User {host.user}\n"
        f"  IdentityFile {cluster4.key_path}\n  UserKnownHostsFile {kh}\n"
    )
    if not cluster4.namespaces:
        pytest.skip("the loopback cluster needs a per-host workdir, which an ssh alias cannot set")
    refused = env.run("myhost")
    assert refused.returncode == 255
    assert f"not in {kh}" in one_line_error(refused)
    accepted = env.run("myhost", "--accept-new")
    assert accepted.returncode == 0, accepted.stderr
    name = host.ip if host.port == 22 else f"[{host.ip}]:{host.port}"
    assert kh.read_text() == f"{name} {host_pub(host)}\n"
    assert not (ssh / "known_hosts").exists()


def test_ssh_config_cannot_turn_checking_off(cluster4: Cluster, env: Env) -> None:
    """StrictHostKeyChecking no / UserKnownHostsFile /dev/null: still refused, --accept-new too."""
    if not cluster4.namespaces:
        pytest.skip("the loopback cluster needs a per-host workdir, which an ssh alias cannot set")
    host = cluster4.hosts[0]
    ssh = env.home / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "config").write_text(
        f"Host lax\n  HostName {host.ip}\n  User {host.user}\n  IdentityFile {cluster4.key_path}\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  CheckHostIP no\n"
    )
    for args in ((), ("--accept-new",)):
        result = env.run("lax", *args, "--job-name", "lax")
        assert result.returncode == 255
        assert "unknown host key SHA256:" in one_line_error(result)
        nothing_dispatched(env, host, "lax")


def test_proxy_jump_checks_both_hosts(cluster4: Cluster, env: Env) -> None:
    if not cluster4.namespaces:
        pytest.skip("needs the namespaced cluster (hosts reachable from each other on port 22)")
    jump, target = cluster4.hosts[0], cluster4.hosts[1]
    ssh = env.home / ".ssh"
    ssh.mkdir(mode=0o700)
    jump_kh = env.root / "jump_known_hosts"
    jump_kh.write_text(f"{jump.ip} {host_pub(jump)}\n")
    (ssh / "config").write_text(
        f"Host {jump.ip}\n  User {jump.user}\n  IdentityFile {cluster4.key_path}\n"
        f"  UserKnownHostsFile {jump_kh}\n"
    )
    machine = env.machine(target, proxy_jump=jump.ip)
    result = env.run(machine, command="hostname")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == target.name
    # an unknown jump host is refused, naming it
    jump_kh.write_text("")
    result = env.run(machine, "--job-name", "viajump")
    assert result.returncode == 255
    line = one_line_error(result)
    assert f"jump host {jump.ip}" in line
    nothing_dispatched(env, target, "viajump")
