"""Logging in: client keys (permissions checked), jump hosts and ProxyCommand, and the SSH
algorithms we allow."""

from __future__ import annotations

import os
import shlex
import stat
from typing import Any

from ssh_scheduler.errors import (
    AuthenticationError,
    TransportError,
)
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.base import LEGACY_KEY


def check_key_permissions(path: str) -> None:
    """Refuse a private key others can read, as OpenSSH does."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise AuthenticationError(f"cannot read ssh key {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise AuthenticationError(f"ssh key {path} is not a file; check ssh_key_path")
    if st.st_mode & 0o077:
        raise AuthenticationError(
            f"ssh key {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"OpenSSH refuses such a key too: run chmod 600 {shlex.quote(path)}"
        )


def _agent_socket() -> str | None:
    sock = os.environ.get("SSH_AUTH_SOCK")
    return sock if sock else None


def load_client_keys(machine: Machine) -> list[Any] | None:
    """The machine's private keys, loaded and checked; None: asyncssh's defaults (the ssh-agent
    and ~/.ssh/id_*).  A passphrase-protected key is left to the ssh-agent, or refused with a
    clear message when none runs (we never ask for passphrases)."""
    keys, _ = load_keys(machine)
    return keys


_KEY_CACHE: dict[tuple[str, int, int], Any] = {}


def _read_private_key(path: str) -> Any:
    """Parse each key file once per process (a fleet usually shares one key: parsing it per host
    was a sixth of a short batch's coordinator time).  Keyed by mtime and size, so an edited file
    is read again; permissions are checked by the caller every time."""
    import asyncssh

    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if key not in _KEY_CACHE:
        _KEY_CACHE[key] = asyncssh.read_private_key(path)
    return _KEY_CACHE[key]


def load_keys(machine: Machine) -> tuple[list[Any] | None, list[str]]:
    """The machine's private keys as :func:`load_client_keys`, and the passphrase-protected
    ones left to the ssh-agent (named in the hint when the login is refused)."""
    import asyncssh

    if not machine.key_paths:
        return None, []  # asyncssh's defaults: the ssh-agent and ~/.ssh/id_*
    keys = []
    left_to_agent: list[str] = []
    for path in machine.key_paths:
        check_key_permissions(path)
        try:
            keys.append(_read_private_key(path))
        except asyncssh.KeyImportError as exc:
            if "assphrase" in str(exc):
                if _agent_socket():
                    left_to_agent.append(path)
                    continue  # the agent may hold it
                raise AuthenticationError(
                    f"ssh key {path} is protected by a passphrase and no ssh-agent is running "
                    f"(SSH_AUTH_SOCK is not set): start one with `eval $(ssh-agent)` and run: "
                    f"ssh-add {shlex.quote(path)}"
                ) from None
            raise AuthenticationError(f"cannot load ssh key {path}: {exc}") from None
        except OSError as exc:
            raise AuthenticationError(f"cannot read ssh key {path}: {exc.strerror or exc}") from None
    return (keys or None), left_to_agent


def _parse_hop(hop: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (IPv6 as ``[addr]:port``) of a ProxyJump hop."""
    user, _, rest = hop.rpartition("@")
    port: str | None = None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            port = tail[1:]
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host = rest
    if not host or (port is not None and not port.isdigit()):
        raise TransportError(f"proxy_jump hop {hop!r} is not [user@]host[:port]")
    return (user or None), host, (int(port) if port else None)


def proxy_command_argv(machine: Machine) -> Any:
    """The ssh config's ProxyCommand as ssh runs it: ``$SHELL -c "exec <command>"``."""
    if machine.proxy_command is None:
        return ()
    return [os.environ.get("SHELL") or "/bin/sh", "-c", machine.proxy_command]


def jump_chain(machine: Machine) -> list[Machine]:
    """The jump hosts in the order they are connected, first hop first.

    ``load_machine`` resolves them through the ssh config, as ``ssh -J`` does (``jump_host``);
    a Machine built by hand with only ``proxy_jump`` gets its hops as written."""
    if machine.jump_host is None:
        hops = []
        for text in (machine.proxy_jump or "").split(","):
            user, host, port = _parse_hop(text)
            hops.append(Machine(name=text, host=host, port=port or 22, user=user))
        return hops
    chain = []
    hop: Machine | None = machine.jump_host
    while hop is not None:
        chain.append(hop)
        hop = hop.jump_host
    return chain[::-1]


def algorithm_options(machine: Machine) -> dict[str, Any]:
    """The key exchange, host key, signature and MAC algorithms asyncssh may use.

    Modern only by default: no SHA-1 key exchange (``*-sha1``), no ``ssh-rsa`` (SHA-1) host key
    or user signatures, no ``hmac-sha1`` or ``umac-64`` (64-bit tags) and no MD5 MACs, which
    OpenSSH has not offered by default since 8.8.  asyncssh still enables several of them, so
    its defaults are filtered here.  ``legacy_algorithms: true`` keeps asyncssh's defaults and
    adds the oldest SHA-1 key exchanges, for a host that speaks nothing newer.
    """
    from asyncssh.kex import get_default_kex_algs
    from asyncssh.mac import get_default_mac_algs
    from asyncssh.public_key import get_default_public_key_algs

    if machine.legacy_algorithms:
        return {"kex_algs": "+diffie-hellman-group14-sha1,diffie-hellman-group-exchange-sha1,diffie-hellman-group1-sha1"}

    def names(algs: list[bytes]) -> list[str]:
        return [alg.decode("ascii") for alg in algs]

    weak_macs = (b"hmac-sha1", b"umac-64", b"hmac-md5")
    return {
        "kex_algs": names([a for a in get_default_kex_algs() if not a.endswith(b"-sha1")]),
        "mac_algs": names([a for a in get_default_mac_algs() if not a.startswith(weak_macs)]),
        "signature_algs": names(
            [a for a in get_default_public_key_algs() if a not in (b"ssh-rsa", b"ssh-dss")]
        ),
        # A '-' list removes from asyncssh's default, which is the key types known_hosts
        # records for this host: only those are offered (a changed key type is then noticed).
        "server_host_key_algs": "-ssh-rsa,ssh-rsa-cert-v01@openssh.com",
    }


def negotiation_hint(machine: Machine, reason: str) -> str:
    """What to say when the handshake failed and legacy algorithms might be why."""
    if machine.legacy_algorithms:
        return ""
    where = f" in {machine.source}" if machine.source else ""
    if "No matching" in reason:
        return (
            f"; the host offers only legacy algorithms (SHA-1 key exchange, ssh-rsa, hmac-sha1 or "
            f"umac-64), refused by default: if you trust it, set `{LEGACY_KEY}: true`{where}"
        )
    return (
        f"; if the host offers only legacy algorithms (SHA-1 key exchange, ssh-rsa, hmac-sha1, "
        f"umac-64), they are refused by default: set `{LEGACY_KEY}: true`{where} to allow them"
    )
