"""Machine specs: machine YAML files, ``~/.ssh/config`` aliases and ``user@host``, with ranges.

Spec lookup (:func:`load_machine`), first hit wins:

1. ``spec`` is a file (``~`` expanded); 2. ``spec + ".yaml"`` is a file;
3. ``<dir>/spec`` then ``<dir>/spec.yaml`` for each search dir (default ``~/.local/var``);
4. ``spec`` is a host the ssh config knows: matched by a ``Host`` pattern with at least one
   literal character (``gpu1``, ``gpu*``, ``*.lan``) or by a ``Match`` other than ``Match all``,
   or given a ``HostName`` (``Host *`` + ``HostName %h.lan``).  A match through ``Host *`` alone
   does not count, so a typo is an error rather than a connection attempt to a random name;
5. ``user@host``, ``user@host:port``, ``user@[v6addr]:port``: like ``ssh -l user -p port host``,
   the ssh config applies with the user/port of the spec taking precedence.

The ssh config is resolved exactly as ``ssh`` resolves it (:mod:`ssh_scheduler.machines.ssh_config`,
:mod:`ssh_scheduler.machines.ssh_resolve`): the user's ``~/.ssh/config`` then ``/etc/ssh/ssh_config``
(or only the file given, like ``ssh -F``), the local account from the password database.  Jump
hosts (``ProxyJump``, machine YAML ``proxy_jump``) are resolved the same way, as ``ssh -J`` does.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.machines import hostlist
from ssh_scheduler.machines import ssh_config as ssh_config_files
from ssh_scheduler.machines.machine import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PORT,
    DEFAULT_WORKDIR,
    Machine,
    check_user,
    local_machine,
    normalize_host,
    read_text,
    tilde_path,
)
from ssh_scheduler.machines.machine_yaml import MACHINE_KEYS, parse_machine_yaml
from ssh_scheduler.machines.ssh_config import ConfigFile, read_config_file
from ssh_scheduler.machines.ssh_jump import JumpHop, parse_jump
from ssh_scheduler.machines.ssh_resolve import SshHost, resolve_host
from ssh_scheduler.machines.ssh_tokens import LocalAccount, current_account

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_PORT",
    "DEFAULT_WORKDIR",
    "MACHINE_KEYS",
    "LocalAccount",
    "Machine",
    "SshConfigs",
    "SshHost",
    "load_machine",
    "load_machines",
    "local_machine",
    "parse_machine_yaml",
    "resolve_host",
]

_show = show_value
_plain = plain_text
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
MAX_JUMP_DEPTH = 8


class SshConfigs:
    """The ssh config files, read on first use only: ``ssh_config`` alone when given (like
    ``ssh -F``), else ``~/.ssh/config`` then the system config."""

    def __init__(
        self,
        ssh_config: Path | None = None,
        account: LocalAccount | None = None,
        system_config: Path | None = None,
    ) -> None:
        self.account = account if account is not None else current_account()
        self._explicit = ssh_config
        default_system = ssh_config_files.SYSTEM_SSH_CONFIG
        self._system = system_config if system_config is not None else default_system
        self._files: list[ConfigFile] | None = None
        user_config = Path(self.account.home) / ".ssh" / "config"
        if ssh_config is not None:
            self.shown = tilde_path(ssh_config)
        else:
            self.shown = f"~/.ssh/config or {_plain(str(self._system))}"
        self._user_config = user_config

    def files(self) -> list[ConfigFile]:
        if self._files is None:
            # ~/.ssh/config is under the account's home (the password database), while '~'
            # in an Include is $HOME (glob's): ssh does the same
            if self._explicit is not None:
                found = [read_config_file(self._explicit)]
            else:
                found = [
                    read_config_file(self._user_config, check_permissions=True),
                    read_config_file(self._system, user_config=False),
                ]
            self._files = [f for f in found if f is not None]
        return self._files

    def resolve(
        self,
        host: str,
        *,
        user: str | None = None,
        port: int | None = None,
        jump: str | None = None,
    ) -> SshHost:
        return resolve_host(
            host, self.files(), self.account, preset_user=user, preset_port=port, preset_jump=jump
        )


def _existing_keys(resolved: SshHost, at: str) -> tuple[str, ...]:
    """The IdentityFiles that exist: ssh skips missing ones (and ``none``) when it connects,
    and tries its default keys only when no IdentityFile applies."""
    present = tuple(p for p in resolved.identity_paths if os.path.isfile(p))
    if resolved.identity_files and not present:
        where = resolved.where.get("identityfile", at)
        keys = ", ".join(map(tilde_path, resolved.identity_paths or resolved.identity_files))
        raise ConfigError(
            f"{where}: none of the IdentityFile keys exist ({keys}); ssh would try only the "
            "agent's keys, which is not supported (fix the IdentityFile lines)"
        )
    return present


def _machine_from_ssh(
    resolved: SshHost, configs: SshConfigs, *, name: str, source: str, chain: tuple[str, ...] = ()
) -> Machine:
    at = _plain(source)
    host, why = normalize_host(resolved.hostname)
    if host is None:
        where = resolved.where.get("hostname", at)
        raise ConfigError(f"{where}: HostName: {why} (fix it in the ssh config or the spec)")
    problem = check_user(resolved.user)
    if problem:
        where = resolved.where.get("user", at)
        raise ConfigError(f"{where}: User: {problem}")
    if resolved.host_key_alias is not None:
        raise ConfigError(
            f"{resolved.where['hostkeyalias']}: HostKeyAlias is not supported (host keys are "
            "looked up under the host name; remove it, or use a machine YAML)"
        )
    jump_host = None
    if resolved.jump_hops:
        chain = (*chain, _address(resolved))
        where = resolved.where.get("proxyjump", at)
        jump_host = _resolve_jump(resolved.jump_hops, configs, chain, at, where)
    timeout = resolved.connect_timeout
    return Machine(
        name=name,
        host=host,
        port=resolved.port,
        user=resolved.user,
        key_paths=_existing_keys(resolved, at),
        known_hosts=resolved.known_hosts,
        proxy_jump=resolved.proxy_jump,
        jump_host=jump_host,
        proxy_command=resolved.proxy_command_expanded,
        connect_timeout=float(timeout) if timeout else DEFAULT_CONNECT_TIMEOUT,
        forward_agent=bool(resolved.forward_agent),
        source=source,
    )


def _address(resolved: SshHost) -> str:
    return f"{resolved.user}@{resolved.hostname}:{resolved.port}"


def _resolve_jump(
    hops: Sequence[JumpHop], configs: SshConfigs, chain: tuple[str, ...], at: str, where: str
) -> Machine:
    """The last hop, resolved as ``ssh -l user -p port -J <earlier hops> host`` would be."""
    last = hops[-1]
    earlier = ",".join(h.text for h in hops[:-1]) or None
    resolved = configs.resolve(last.host, user=last.user, port=last.port, jump=earlier)
    address = _address(resolved)
    if address in chain or len(chain) > MAX_JUMP_DEPTH:
        path = " -> ".join((*chain, address))
        raise ConfigError(
            f"{where}: ProxyJump loops ({path}); ssh would loop too (exclude the jump host from "
            "the block that sets ProxyJump, e.g. 'Host * !bastion')"
        )
    return _machine_from_ssh(
        resolved, configs, name=last.text, source=f"{at}: jump host {last.text}", chain=chain
    )


def _parse_user_at_host(spec: str) -> tuple[str, str, int | None]:
    """``user@host[:port]`` -> (user, host, port); ConfigError when malformed."""
    user, _, rest = spec.rpartition("@")
    problem = check_user(user) if user else "the user name before '@' is empty"
    if problem:
        raise ConfigError(f"machine {_show(spec)}: {problem} (write user@host or user@host:port)")
    port_text: str | None = None
    if rest.startswith("["):
        close = rest.find("]")
        if close == -1:
            raise ConfigError(
                f"machine {_show(spec)}: '[' without ']' (write IPv6 as user@[addr]:port)"
            )
        host_text, tail = rest[: close + 1], rest[close + 1 :]
        if tail:
            if not tail.startswith(":"):
                raise ConfigError(
                    f"machine {_show(spec)}: unexpected {_show(tail)} after ']' "
                    "(write user@[addr]:port)"
                )
            port_text = tail[1:]
    elif rest.count(":") == 1:
        host_text, _, port_text = rest.partition(":")
    else:
        host_text = rest
    host, why = normalize_host(host_text)
    if host is None:
        raise ConfigError(f"machine {_show(spec)}: {why}")
    port: int | None = None
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ConfigError(
                f"machine {_show(spec)}: port {_show(port_text)} is not a number from 1 to 65535 "
                "(write user@host:port)"
            )
        port = int(port_text)
    return user, host, port


def _default_search_dirs() -> list[Path]:
    return [Path(os.path.expanduser("~")) / ".local" / "var"]


def load_machine(
    spec: str,
    *,
    search_dirs: Sequence[Path] | None = None,
    ssh_config: Path | None = None,
    account: LocalAccount | None = None,
    system_ssh_config: Path | None = None,
) -> Machine:
    """Find and load one machine by spec (lookup order in the module docstring).

    ``ssh_config`` is read alone (like ``ssh -F``); without it ``~/.ssh/config`` of ``account``
    (default: the current account) then ``system_ssh_config`` (default /etc/ssh/ssh_config)."""
    dirs = list(search_dirs) if search_dirs is not None else _default_search_dirs()
    return _load_machine(spec, dirs, SshConfigs(ssh_config, account, system_ssh_config))


def _load_machine(spec: str, dirs: Sequence[Path], configs: SshConfigs) -> Machine:
    if not spec.strip():
        raise ConfigError(
            "empty machine name (give a machine YAML file, a Host from ~/.ssh/config, or user@host)"
        )
    if _CONTROL_RE.search(spec):
        raise ConfigError(
            f"machine {_show(spec)} contains a control character (remove it; a machine is a "
            "YAML file, a Host from ~/.ssh/config or user@host)"
        )
    expanded = os.path.expanduser(spec)
    candidates = [Path(expanded), Path(expanded + ".yaml")]
    for directory in dirs:
        candidates += [directory / spec, directory / (spec + ".yaml")]
    for candidate in candidates:
        try:
            is_file = candidate.is_file()
        except (OSError, ValueError):  # name too long, NUL byte...
            is_file = False
        if is_file:
            source = str(candidate)
            machine = parse_machine_yaml(read_text(candidate, "machine file"), source=source)
            return _complete_yaml_machine(machine, configs)

    if "@" not in spec:
        resolved = configs.resolve(spec)
        if resolved.found:
            return _machine_from_ssh(
                resolved, configs, name=spec, source=f"{configs.shown} (Host {_plain(spec)})"
            )
        places = " or ".join(tilde_path(d).rstrip("/") + "/" for d in dirs) or "no search folder"
        raise ConfigError(
            f"no machine {_show(spec)}: not a file ({_plain(spec)}, {_plain(spec)}.yaml), "
            f"not in {places}, and not a Host in {configs.shown} "
            f"(to ssh to it directly, write user@{_plain(spec)})"
        )

    user, host, port = _parse_user_at_host(spec)
    resolved = configs.resolve(host, user=user, port=port)
    return _machine_from_ssh(resolved, configs, name=spec, source=spec)


def _complete_yaml_machine(machine: Machine, configs: SshConfigs) -> Machine:
    """The account's user when the YAML names none, and its jump hosts resolved as ssh -J."""
    user = machine.user if machine.user is not None else configs.account.user
    jump_host = None
    if machine.proxy_jump:
        try:
            hops = parse_jump(machine.proxy_jump)
        except ValueError as err:
            raise ConfigError(f"{_plain(machine.source)}: proxy_jump: {err}") from None
        if hops:
            at = _plain(machine.source)
            jump_host = _resolve_jump(hops, configs, (), at, at)
    return dataclasses.replace(machine, user=user, jump_host=jump_host)


_IPV6_BRACKETS = re.compile(r"\[[^\]]*:[^\]]*\]")


def _expand_spec(spec: str) -> list[str]:
    """Expand a host range in a spec, unless it is an existing file or an ``[IPv6]`` literal.
    A wildcard (``gpu*``) goes to the range parser too, which refuses it in one line rather than
    letting it through as a host name."""
    if not any(ch in spec for ch in "[*?" + hostlist.OPERATORS) or _IPV6_BRACKETS.search(spec):
        return [spec]
    try:
        if Path(os.path.expanduser(spec)).is_file():
            return [spec]
    except (OSError, ValueError):
        pass
    return hostlist.expand(spec)


def load_machines(
    specs: Sequence[str],
    *,
    exclude: Sequence[str] = (),
    ssh_config: Path | None = None,
    search_dirs: Sequence[Path] | None = None,
    account: LocalAccount | None = None,
    system_ssh_config: Path | None = None,
) -> list[Machine]:
    """Load every machine named by ``specs`` (host ranges expanded), minus ``exclude``.

    ``exclude`` entries (ranges allowed) remove machines whose expanded spec, display name or
    source (the YAML path as found) equals them; excluded specs are not even loaded; an exclude entry that removes nothing is an error (likely a typo).  Two specs
    that reach the same user@host:port, or two machines with the same display name, are an
    error; so is an empty result.  Order follows ``specs``.
    """
    if not specs:
        raise ConfigError("no machines given (name at least one machine file, Host or user@host)")
    excluded: dict[str, str] = {}
    for pattern in exclude:
        for name in _expand_spec(pattern):
            excluded.setdefault(name, pattern)
    used: set[str] = set()
    dirs = list(search_dirs) if search_dirs is not None else _default_search_dirs()
    configs = SshConfigs(ssh_config, account, system_ssh_config)

    machines: list[tuple[str, Machine]] = []
    for spec in specs:
        for one in _expand_spec(spec):
            if one in excluded:
                used.add(excluded[one])
                continue
            machine = _load_machine(one, dirs, configs)
            hit = next((k for k in (machine.name, machine.source) if k in excluded), None)
            if hit is not None:
                used.add(excluded[hit])
                continue
            machines.append((one, machine))

    unused = [p for p in dict.fromkeys(excluded.values()) if p not in used]
    if unused:
        names = hostlist.fold(m.name for _, m in machines) or "none"
        raise ConfigError(
            f"exclude {_show(unused[0])} matches no machine (the machines are {_plain(names)}; "
            "check the spelling)"
        )
    if not machines:
        raise ConfigError("every machine was excluded (remove an --exclude or add machines)")

    local = configs.account.user
    by_address: dict[tuple[str, int, str, bool], str] = {}
    by_name: dict[str, str] = {}
    for one, machine in machines:
        address = (machine.host.lower(), machine.port, machine.user or local, machine.is_local)
        if address in by_address:
            raise ConfigError(
                f"machines {_show(by_address[address])} and {_show(one)} both connect to "
                f"{_plain(machine.user or local)}@{_plain(machine.host)}:{machine.port} "
                "(list each machine once)"
            )
        by_address[address] = one
        if machine.name in by_name:
            raise ConfigError(
                f"machines {_show(by_name[machine.name])} and {_show(one)} have the same name "
                f"{_show(machine.name)} (set a different 'name:' in one of the YAML files)"
            )
        by_name[machine.name] = one
    return [machine for _, machine in machines]
