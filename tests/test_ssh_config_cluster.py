"""ssh config aliases connecting for real on the SSH test cluster: ProxyCommand (run by asyncssh)
and a jump host that exists only as an alias in the config file given (resolved by our resolver,
never by asyncssh's own config reader)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.transport.ssh import connect
from tests.cluster import Cluster, Host

RELAY = """\
import pathlib, socket, sys, threading
host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pathlib.Path(marker).write_text(f"{host} {port}\\n")
conn = socket.create_connection((host, port))
def upstream():
    while True:
        data = sys.stdin.buffer.read1(65536)
        if not data:
            conn.shutdown(socket.SHUT_WR)
            return
        conn.sendall(data)
threading.Thread(target=upstream, daemon=True).start()
while True:
    data = conn.recv(65536)
    if not data:
        break
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""


def login_lines(cluster: Cluster, host: Host) -> str:
    return (
        f"  User {host.user}\n  IdentityFile {cluster.key_path}\n"
        f"  UserKnownHostsFile {cluster.known_hosts}\n"
    )


async def run_via(alias: str, config: Path, command: str = "hostname") -> str:
    transport = await connect(load_machine(alias, ssh_config=config))
    try:
        return (await transport.exec(command)).stdout.decode().strip()
    finally:
        await transport.close()


def test_proxy_command_is_run(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[0]
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    marker = tmp_path / "relay-was-used"
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host viaproxy\n  HostName {host.ip}\n  Port {host.port}\n{login_lines(cluster4, host)}"
        f"  ProxyCommand {sys.executable} {relay} %h %p {marker}\n"
    )
    assert asyncio.run(run_via("viaproxy", config)) == host.name
    assert marker.read_text() == f"{host.ip} {host.port}\n"  # the tokens, expanded as ssh does


def test_jump_host_alias_from_the_given_config(cluster4: Cluster, tmp_path: Path) -> None:
    if not cluster4.namespaces:
        pytest.skip("needs the namespaced cluster (hosts reachable from each other on port 22)")
    jump, target = cluster4.hosts[0], cluster4.hosts[1]
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host target\n  HostName {target.ip}\n  ProxyJump jumpalias\n{login_lines(cluster4, target)}"
        f"Host jumpalias\n  HostName {jump.ip}\n  Port ssh\n{login_lines(cluster4, jump)}"
    )
    machine = load_machine("target", ssh_config=config)
    assert machine.jump_host is not None and machine.jump_host.host == jump.ip
    # the target sees the jump host as its client: the connection really went through it
    seen = asyncio.run(run_via("target", config, "hostname; echo $SSH_CONNECTION")).split("\n")
    assert seen[0] == target.name
    assert seen[1].split()[0] == jump.ip
