"""Jump hosts: connecting through each ProxyJump hop in turn, as ``ssh -J`` does."""

from __future__ import annotations

from typing import Any

from ssh_scheduler.errors import (
    AuthenticationError,
    HostKeyError,
    HostUnreachableError,
    TransportError,
)
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.auth import (
    algorithm_options,
    jump_chain,
    load_keys,
    proxy_command_argv,
)
from ssh_scheduler.transport.base import (
    KEEPALIVE_COUNT_MAX,
    KEEPALIVE_INTERVAL,
    bounded,
    describe,
    os_reason,
)
from ssh_scheduler.transport.hostkeys import KnownHosts, known_hosts_files


async def open_jump_hosts(machine: Machine) -> list[Any]:
    """Connect through each ProxyJump hop in turn, as ``ssh -J`` would: each hop has its own
    user, port, keys and known_hosts from the ssh config (resolved by ssh_scheduler.machines.config, never
    by asyncssh's reader), the first hop may have a ProxyCommand; agent forwarding stays off."""
    import asyncssh

    assert machine.proxy_jump
    conns: list[Any] = []
    try:
        for hop in jump_chain(machine):
            label = f"{describe(machine)}: jump host {hop.name}"
            client_keys, _ = load_keys(hop)
            known = KnownHosts(known_hosts_files(hop))
            try:
                conn = await bounded(
                    asyncssh.connect(
                        hop.host,
                        hop.port,
                        username=hop.user if hop.user is not None else (),
                        client_keys=client_keys if client_keys is not None else (),
                        known_hosts=known.lookup,
                        tunnel=conns[-1] if conns else (),
                        proxy_command=proxy_command_argv(hop) if not conns else (),
                        config=None,
                        agent_forwarding=False,
                        connect_timeout=machine.connect_timeout,
                        login_timeout=machine.connect_timeout,
                        keepalive_interval=KEEPALIVE_INTERVAL,
                        keepalive_count_max=KEEPALIVE_COUNT_MAX,
                        **algorithm_options(machine),
                    ),
                    machine.connect_timeout + 5,
                )
            except asyncssh.HostKeyNotVerifiable as exc:
                raise HostKeyError(
                    f"{label}: {exc.reason}; check its key and add it to "
                    f"{known.files[0] if known.files else '~/.ssh/known_hosts'} (for example "
                    f"with ssh-keyscan) before using it as a jump host"
                ) from None
            except asyncssh.PermissionDenied:
                raise AuthenticationError(
                    f"{label}: permission denied; check that `ssh {hop.name}` works"
                ) from None
            except TimeoutError:
                raise HostUnreachableError(
                    f"{label}: no answer within {machine.connect_timeout:g} s"
                ) from None
            except OSError as exc:
                raise HostUnreachableError(f"{label}: {os_reason(exc, hop.host, hop.port)}") from None
            except asyncssh.Error as exc:
                raise TransportError(f"{label}: {exc.reason}") from None
            conns.append(conn)
    except BaseException:
        for conn in reversed(conns):
            conn.close()
        raise
    return conns
