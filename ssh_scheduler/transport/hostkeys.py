"""Host keys: known_hosts lookups ([host]:port, hashed, revoked), recording with --accept-new, and
the messages for an unknown or changed key."""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import time
from collections.abc import Sequence
from typing import Any

from ssh_scheduler.errors import (
    HostKeyError,
    HostUnreachableError,
)
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.auth import proxy_command_argv
from ssh_scheduler.transport.base import bounded, describe


def default_known_hosts() -> list[str]:
    return [os.path.expanduser("~/.ssh/known_hosts")]


def known_hosts_files(machine: Machine) -> list[str]:
    """The files a host key is looked up in; ``--accept-new`` records into the first one."""
    files = list(machine.known_hosts) if machine.known_hosts is not None else default_known_hosts()
    return [os.path.expanduser(f) for f in files]


def known_hosts_name(machine: Machine) -> str:
    """How known_hosts names this host: ``host``, or ``[host]:port`` for a port other than 22."""
    return machine.host if machine.port == 22 else f"[{machine.host}]:{machine.port}"


def _parse_known_hosts(text: str) -> Any:
    """Parse known_hosts text; a malformed line is skipped (as OpenSSH does), never the file."""
    import asyncssh

    try:
        return asyncssh.import_known_hosts(text)
    except ValueError:
        pass
    good = []
    for line in text.splitlines():
        try:
            asyncssh.import_known_hosts(line)
        except ValueError:
            continue
        good.append(line)
    return asyncssh.import_known_hosts("\n".join(good))


# path -> (what os.fstat said when it was read, its parsed entries).  A batch connects to many
# hosts, each looking its key up in the same files: parsing them once per connection made the
# start quadratic in hosts (asyncssh builds a key object per line).  The signature has the
# inode, size, mtime and ctime, so an edit, a replacement (ssh-keygen -R renames) or a chmod
# (ctime) is seen and the file read again; the trust decision is the one made on fresh text.
# A file changed less than RACY_NS before it was read might change again within the same
# timestamp tick without its signature changing (same size, in place): it is not cached.
_parsed_files: dict[str, tuple[tuple[int, ...], Any]] = {}
RACY_NS = 2_000_000_000


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _parsed_file(path: str) -> Any:
    """The parsed entries of one known_hosts file (None when it does not exist), read and parsed
    again only when the file changed since the last time this process read it."""
    cached = _parsed_files.get(path)
    try:
        if cached is not None and _signature(os.stat(path)) == cached[0]:
            return cached[1]
        reading_at = time.time_ns()
        with open(path, encoding="utf-8", errors="replace") as f:
            st = os.fstat(f.fileno())
            text = f.read()
    except FileNotFoundError:
        _parsed_files.pop(path, None)
        return None
    except OSError as exc:
        _parsed_files.pop(path, None)
        raise HostKeyError(
            f"cannot read known_hosts file {path}: {exc.strerror or exc}; fix its "
            f"permissions (host keys are always checked)"
        ) from None
    parsed = _parse_known_hosts(text)
    if max(st.st_mtime_ns, st.st_ctime_ns) < reading_at - RACY_NS:
        _parsed_files[path] = (_signature(st), parsed)
    else:
        _parsed_files.pop(path, None)
    return parsed


class KnownHosts:
    """The trusted host keys of some known_hosts files, matched as OpenSSH does.

    A port other than 22 is looked up as ``[host]:port`` only: unlike asyncssh's own matching
    there is no fallback to the port-less entry, so a key trusted for one port is not trusted
    for a different server on another port of the same host.  Hashed (``|1|...``) entries,
    wildcards, ``@cert-authority`` and ``@revoked`` work.
    """

    def __init__(self, files: Sequence[str]) -> None:
        self.files = list(files)
        # Matching each file and joining the answers in file order is matching their
        # concatenation: every known_hosts line stands alone (a @revoked line in one file
        # revokes a key that another file trusts, as before: revoked keys are collected).
        self._dbs = [db for db in map(_parsed_file, self.files) if db is not None]

    def lookup(self, host: str, addr: str, port: int | None) -> tuple[list[Any], list[Any], list[Any]]:
        """(trusted host keys, trusted CA keys, revoked keys) for a host: asyncssh's callable."""
        if port in (None, 22):
            names = [host, addr]
        else:
            names = [f"[{host}]:{port}", f"[{addr}]:{port}" if addr else ""]
        keys: list[Any] = []
        cas: list[Any] = []
        revoked: list[Any] = []
        for name in dict.fromkeys(n for n in names if n):
            for db in self._dbs:
                found = db.match(name, "", None)
                keys += found[0]
                cas += found[1]
                revoked += found[2]
        return keys, cas, revoked

    def knows(self, host: str, port: int) -> bool:
        """Is any key (or CA) recorded for this host, so that a mismatch means a CHANGED key?"""
        keys, cas, _ = self.lookup(host, "", port)
        return bool(keys or cas)

    def revoked(self, host: str, port: int, key: Any) -> bool:
        return any(key == r for r in self.lookup(host, "", port)[2])


def host_key_entry_exists(machine: Machine) -> bool:
    """Does any known_hosts file name this host at all (so a mismatch means a CHANGED key)?"""
    return KnownHosts(known_hosts_files(machine)).knows(machine.host, machine.port)


async def fetch_host_key(machine: Machine, tunnel: Any = None) -> Any:
    """The key the host offers now (from a handshake that trusts nothing and logs in nowhere)."""
    import asyncssh

    return await bounded(
        asyncssh.get_server_host_key(
            machine.host,
            machine.port,
            tunnel=tunnel if tunnel is not None else (),
            proxy_command=proxy_command_argv(machine) if tunnel is None else (),
            config=None,
        ),
        machine.connect_timeout,
    )


def key_text(key: Any) -> str:
    """``SHA256:... (ssh-ed25519)`` for a message."""
    return f"{key.get_fingerprint()} ({key.get_algorithm()})"


def record_host_key(machine: Machine, key: Any) -> str:
    """Append ``key`` for this host to the first known_hosts file; returns that file."""
    files = known_hosts_files(machine)
    if not files:
        raise HostKeyError(
            f"{describe(machine)}: unknown host key {key_text(key)}, and no known_hosts file is "
            f"configured for it (UserKnownHostsFile none) to record it in; set known_hosts "
            f"in the machine file"
        )
    path = files[0]
    line = f"{known_hosts_name(machine)} {key.export_public_key().decode().strip()}\n"
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise HostKeyError(
                    f"{describe(machine)}: unknown host key {key_text(key)}, and its known_hosts "
                    f"file {path} is not a regular file, so the key cannot be recorded there; "
                    f"add it yourself (ssh-keyscan) to a known_hosts file the machine uses"
                )
            size = st.st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = "\n" + line  # never glue our entry onto an unterminated last line
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise HostKeyError(
            f"{describe(machine)}: cannot record its host key in {path}: {exc.strerror or exc}"
        ) from None
    return path


async def accept_new_host_key(machine: Machine, tunnel: Any = None) -> str:
    """Trust on first use: record the host's key, like StrictHostKeyChecking=accept-new."""
    key = await fetch_host_key(machine, tunnel)
    if key is None:
        raise HostUnreachableError(f"{describe(machine)} sent no host key")
    record_host_key(machine, key)
    return str(key.get_fingerprint())


def changed_key_message(machine: Machine, offered: Any) -> str:
    name = known_hosts_name(machine)
    files = known_hosts_files(machine)
    offers = f"it offers {key_text(offered)}" if offered is not None else "its key"
    where = f" -f {shlex.quote(files[0])}" if files else ""
    return (
        f"{describe(machine)}: HOST KEY CHANGED: {offers}, but {', '.join(files)} records a "
        f"different key for {name}. This can be an attack; nothing was sent to it. If the host "
        f"was really reinstalled, remove the old entry with `ssh-keygen -R {shlex.quote(name)}"
        f"{where}`, check the new fingerprint and rerun with --accept-new"
    )


async def refuse_if_key_changed(machine: Machine, known: KnownHosts, tunnel: Any) -> None:
    """Raise HostKeyError when the host is known but now offers a key that is not recorded."""
    if not known.knows(machine.host, machine.port):
        return
    offered = None
    with contextlib.suppress(Exception):
        offered = await fetch_host_key(machine, tunnel)
    if offered is not None and offered not in known.lookup(machine.host, "", machine.port)[0]:
        raise HostKeyError(
            changed_key_message(machine, offered) + " (it offers none of the key types recorded)"
        )


def new_key_message(machine: Machine, offered: Any) -> str:
    files = known_hosts_files(machine)
    shown = ", ".join(files) or "no known_hosts file (UserKnownHostsFile none)"
    what = key_text(offered) if offered is not None else "(its fingerprint could not be fetched)"
    if not files:
        return (
            f"{describe(machine)}: unknown host key {what}, and no known_hosts file is configured "
            f"for it; set known_hosts in the machine file, then rerun with --accept-new"
        )
    port = f"-p {machine.port} " if machine.port != 22 else ""
    return (
        f"{describe(machine)}: unknown host key {what} (not in {shown}); nothing was sent to "
        f"it. If that fingerprint is right, rerun with --accept-new to trust and record it, or "
        f"run `ssh-keyscan {port}{machine.host} >> {shlex.quote(files[0])}`"
    )


async def unknown_key_message(machine: Machine, tunnel: Any = None) -> str:
    offered = None
    with contextlib.suppress(Exception):
        offered = await fetch_host_key(machine, tunnel)
    if host_key_entry_exists(machine):
        return changed_key_message(machine, offered)
    return new_key_message(machine, offered)
