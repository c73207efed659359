"""Modern SSH only by default; ``legacy_algorithms: true`` per machine for an old host.

The cluster host's real sshd is reconfigured to offer one legacy algorithm family at a time
(SHA-1 key exchange, an ``ssh-rsa`` host key, ``hmac-sha1``, ``umac-64``, ``ssh-rsa`` user
signatures): the default connection is refused with a message naming the machine key, and the
same machine with the key set connects.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError, TransportError
from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.auth import algorithm_options
from ssh_scheduler.transport.hostkeys import known_hosts_name
from ssh_scheduler.transport.ssh import connect
from tests.cluster import Cluster, Host, HostSpec

MODERN = Machine(name="m", host="127.0.0.1")


def test_default_algorithms_leave_out_sha1_and_short_macs() -> None:
    options = algorithm_options(MODERN)
    assert options["kex_algs"] and not [a for a in options["kex_algs"] if "sha1" in a]
    assert "curve25519-sha256" in options["kex_algs"]
    assert options["mac_algs"] and not [
        a for a in options["mac_algs"] if a.startswith(("hmac-sha1", "umac-64", "hmac-md5"))
    ]
    assert "hmac-sha2-256-etm@openssh.com" in options["mac_algs"]
    assert "ssh-rsa" not in options["signature_algs"] and "rsa-sha2-512" in options["signature_algs"]
    assert options["server_host_key_algs"].startswith("-") and "ssh-rsa" in options["server_host_key_algs"].split(",")[0]


def test_legacy_machines_keep_the_old_ones() -> None:
    options = algorithm_options(dataclasses.replace(MODERN, legacy_algorithms=True))
    assert "diffie-hellman-group14-sha1" in options["kex_algs"]
    assert "mac_algs" not in options  # asyncssh's defaults, hmac-sha1 and umac-64 included
    assert "signature_algs" not in options  # ...and ssh-rsa


def test_the_machine_key_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("ip: 10.0.0.1\nlegacy_algorithms: true\n")
    assert load_machine(str(path)).legacy_algorithms is True
    path.write_text("ip: 10.0.0.1\n")
    assert load_machine(str(path)).legacy_algorithms is False
    path.write_text("ip: 10.0.0.1\nlegacy_algorithms: yes please\n")
    with pytest.raises(ConfigError, match="'legacy_algorithms' must be true or false"):
        load_machine(str(path))


# --- against a real sshd ----------------------------------------------------------------------------


def _keygen(path: Path, kind: str) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-b", "2048", "-N", "", "-f", str(path)], check=True)
    return path


def _reconfigure(host: Host, extra: list[str]) -> None:
    """Restart the host's sshd with ``extra`` lines first (sshd keeps the first value given)."""
    config = host.dir / "sshd_config"
    base = config.read_text().split("# --- test extra ---\n")[-1]
    config.write_text("\n".join(extra) + "\n# --- test extra ---\n" + base)
    host.stop_sshd()
    host.start_sshd()


async def _echo(machine: Machine) -> str:
    transport = await connect(machine)
    try:
        return (await transport.exec("echo ok")).stdout.decode()
    finally:
        await transport.close()


LEGACY_SERVERS: dict[str, list[str]] = {
    "sha1 key exchange": ["KexAlgorithms diffie-hellman-group14-sha1,diffie-hellman-group1-sha1"],
    "hmac-sha1": ["Ciphers aes128-ctr", "MACs hmac-sha1,hmac-sha1-etm@openssh.com"],
    "umac-64": ["Ciphers aes128-ctr", "MACs umac-64@openssh.com,umac-64-etm@openssh.com"],
}


# The legacy machines do use finite-field Diffie-Hellman: that is what they are for.
@pytest.mark.filterwarnings("ignore:Diffie-Hellman over finite fields")
async def test_legacy_only_hosts_are_refused_unless_the_machine_allows_them(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster([HostSpec()])
    host = cluster[0]
    machine = load_machine(str(host.machine_file))
    assert await _echo(machine) == "ok\n"  # a normal sshd: modern algorithms suffice

    # An ssh-rsa-only host key: known_hosts records it (as `ssh-keyscan` would).
    rsa_host_key = _keygen(host.dir / "ssh_host_rsa_key", "rsa")  # where its sshd can read it
    known = tmp_path / "known_hosts"
    rsa_pub = (host.dir / "ssh_host_rsa_key.pub").read_text().split()[:2]
    known.write_text(cluster.known_hosts.read_text() + f"{known_hosts_name(machine)} {' '.join(rsa_pub)}\n")
    machine = dataclasses.replace(machine, known_hosts=(str(known),))
    servers = dict(LEGACY_SERVERS)
    servers["ssh-rsa host key"] = [f"HostKey {rsa_host_key}", "HostKeyAlgorithms ssh-rsa"]

    # An RSA user key that the host accepts only with SHA-1 (ssh-rsa) signatures.
    rsa_user_key = _keygen(tmp_path / "id_rsa", "rsa")
    os.chmod(rsa_user_key, 0o600)
    authorized = host.home / ".ssh" / "authorized_keys" if cluster.namespaces else host.dir / "authorized_keys"
    with open(authorized, "a") as f:
        f.write((tmp_path / "id_rsa.pub").read_text())
    servers["ssh-rsa signatures"] = ["PubkeyAcceptedAlgorithms ssh-rsa"]

    for name, extra in servers.items():
        _reconfigure(host, extra)
        old = machine
        if name == "ssh-rsa signatures":
            old = dataclasses.replace(machine, key_paths=(str(rsa_user_key),))
        with pytest.raises(TransportError) as err:
            await _echo(old)
        message = str(err.value)
        assert "legacy_algorithms: true" in message and str(host.machine_file) in message, (name, message)
        assert "\n" not in message
        if name == "ssh-rsa signatures":
            # OpenSSH 9.2 lists rsa-sha2-* in server-sig-algs even when it accepts only ssh-rsa,
            # so no client offers SHA-1 to it; only a server too old to send that list (< 7.2)
            # gets ssh-rsa signatures from a legacy machine (its algorithm list: pure test above).
            assert "RSA keys are signed with SHA-2 only" in message
            continue
        assert await _echo(dataclasses.replace(old, legacy_algorithms=True)) == "ok\n", name

    _reconfigure(host, [])  # back to a normal sshd: modern connections work again
    assert await _echo(machine) == "ok\n"
