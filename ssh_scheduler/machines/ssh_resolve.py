"""From the ssh config lines that apply to a host to the values ``ssh`` would connect with.

This is the part of ``ssh.c`` after the config files are read: ``HostName`` with ``%h``, the
host name lower-cased (ASCII) or, for an address, written as the C library writes it, the
account's user, ``Port`` (service names too), the lower-cased ``HostKeyAlias``, and the
``~``/``%``/``${}`` expansion of ``IdentityFile`` (as ``load_public_identity_files`` does it when
connecting), ``UserKnownHostsFile`` and ``ProxyCommand``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ssh_scheduler.errors import ConfigError, show_value
from ssh_scheduler.machines.ssh_config import ConfigFile, SshLine
from ssh_scheduler.machines.ssh_evaluate import Evaluated, evaluate, jump_hops
from ssh_scheduler.machines.ssh_jump import JumpHop, jump_text
from ssh_scheduler.machines.ssh_tokens import (
    LocalAccount,
    a2port,
    ascii_lower,
    canonical_host,
    connection_tokens,
    convtime,
    percent_dollar_expand,
    tilde_expand,
)

__all__ = ["SshHost", "resolve_host"]

DEFAULT_SSH_PORT = 22


@dataclass(frozen=True, slots=True)
class SshHost:
    """What ``ssh -G host`` shows for the values we use, plus their expansions."""

    alias: str
    """The name as typed (``%n``)."""
    hostname: str
    user: str
    port: int
    identity_files: tuple[str, ...]
    """As ``ssh -G`` prints them (unexpanded, duplicates dropped); empty: none configured
    (ssh then tries its default keys)."""
    identity_paths: tuple[str, ...]
    """The same without ``none``, ``~``/``%``/``${}`` expanded and made absolute: the files
    ssh tries."""
    known_hosts: tuple[str, ...] | None
    """Expanded ``UserKnownHostsFile``; ``None``: not configured; ``()``: ``none``."""
    proxy_jump: str | None
    """As written (comment removed); ``None``: unset or ``none``."""
    jump_hops: tuple[JumpHop, ...]
    proxy_command: str | None
    """As written; ``None``: unset or ``none``."""
    proxy_command_expanded: str | None
    """``exec <command>`` with ``%h %k %n %p %r`` expanded, as ssh runs it with ``$SHELL -c``."""
    host_key_alias: str | None
    """Lower-cased, as ssh uses it."""
    forward_agent: bool | None
    connect_timeout: int | None
    found: bool
    """Matched by a ``Host`` pattern with a literal character, a ``Match`` other than ``all``,
    or given a ``HostName``: the config knows this name."""
    where: Mapping[str, str]
    """Keyword -> ``file line N`` of the line that set it (for messages)."""


def _expand(
    line: SshLine,
    text: str,
    tokens: Mapping[str, str],
    environ: Mapping[str, str] | None,
    account: LocalAccount | None,
    *,
    at_connect: bool = False,
) -> str:
    try:
        if account is not None:
            text = tilde_expand(text, account)
        return percent_dollar_expand(text, tokens, environ)
    except ValueError as err:
        when = " (ssh fails on it too, when connecting)" if at_connect else ""
        raise ConfigError(
            f"{line.where}: {line.spelled or line.keyword} {show_value(text)}: {err}{when}"
        ) from None


def resolve_host(
    host_arg: str,
    configs: Sequence[ConfigFile],
    account: LocalAccount,
    *,
    preset_user: str | None = None,
    preset_port: int | None = None,
    preset_jump: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> SshHost:
    """The values ``ssh [-l user] [-p port] [-J jump] host_arg`` would use with ``configs``."""
    env = os.environ if environ is None else environ
    ev = evaluate(
        host_arg,
        configs,
        local_user=account.user,
        preset_user=preset_user,
        preset_port=preset_port,
        preset_jump=preset_jump,
    )
    where = {k: line.where for k, line in ev.first.items()}

    host = host_arg
    hostname_line = ev.first.get("hostname")
    if hostname_line is not None:
        host = _expand(hostname_line, hostname_line.args[0], {"h": host_arg}, None, None)
    host = canonical_host(host, ev.value("addressfamily"))
    user = ev.value("user") or account.user
    port_text = ev.value("port")
    port = a2port(port_text) if port_text is not None else DEFAULT_SSH_PORT
    alias_text = ev.value("hostkeyalias")
    key_alias = ascii_lower(alias_text) if alias_text is not None else None
    tokens = connection_tokens(
        account, host=host, original_host=host_arg, port=port, user=user, key_alias=key_alias
    )

    raw_files: list[str] = []
    paths: list[str] = []
    if ev.identity_files:
        where["identityfile"] = ev.identity_files[0].where
    for line in ev.identity_files:
        raw_files.append(line.args[0])
        if ascii_lower(line.args[0]) == "none":  # a placeholder, skipped when connecting
            continue
        expanded = _expand(line, line.args[0], tokens, env, account, at_connect=True)
        paths.append(os.path.abspath(expanded))

    known: tuple[str, ...] | None = None
    known_line = ev.first.get("userknownhostsfile")
    if known_line is not None:
        if [ascii_lower(a) for a in known_line.args] == ["none"]:
            known = ()
        else:
            known = tuple(
                os.path.abspath(_expand(known_line, a, tokens, env, account))
                for a in known_line.args
            )

    hops, jump_line = jump_hops(ev)
    if hops and (hops[-1].host, hops[-1].port or DEFAULT_SSH_PORT, hops[-1].user or user) == (
        host,
        port,
        user,
    ):
        assert jump_line is not None
        raise ConfigError(
            f"{jump_line.where}: ProxyJump loop via {hops[-1].text} (the jump host is the host "
            "itself; ssh refuses this too)"
        )
    proxy_jump = jump_text(ev.jump[0], hops[-1]) if ev.jump is not None and hops else None
    if jump_line is not None:
        where["proxyjump"] = jump_line.where
    proxy_command = proxy_expanded = None
    if ev.proxy_command is not None and ascii_lower(ev.proxy_command[0]) != "none" and not hops:
        proxy_command, line = ev.proxy_command
        where["proxycommand"] = line.where
        proxy_tokens = {
            "h": host,
            "k": key_alias or host_arg,
            "n": host_arg,
            "p": str(port),
            "r": user,
        }
        proxy_expanded = _expand(
            line, "exec " + proxy_command, proxy_tokens, None, None, at_connect=True
        )

    return SshHost(
        alias=host_arg,
        hostname=host,
        user=user,
        port=port,
        identity_files=tuple(raw_files),
        identity_paths=tuple(paths),
        known_hosts=known,
        proxy_jump=proxy_jump,
        jump_hops=hops,
        proxy_command=proxy_command,
        proxy_command_expanded=proxy_expanded,
        host_key_alias=key_alias,
        forward_agent=_forward_agent(ev),
        connect_timeout=_connect_timeout(ev),
        found=ev.matched_literal or hostname_line is not None,
        where=where,
    )


def _forward_agent(ev: Evaluated) -> bool | None:
    line = ev.first.get("forwardagent")
    if line is None:
        return None
    value = ascii_lower(line.args[0])
    if value in ("yes", "true"):
        return True
    if value in ("no", "false"):
        return False
    raise ConfigError(
        f"{line.where}: ForwardAgent {show_value(line.args[0])}: forwarding another agent "
        "socket is not supported (write yes or no)"
    )


def _connect_timeout(ev: Evaluated) -> int | None:
    value = ev.value("connecttimeout")
    if value is None or value == "none":
        return None
    seconds = convtime(value)
    return seconds if seconds > 0 else None
