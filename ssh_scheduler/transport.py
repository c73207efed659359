"""Connections to hosts: the only module that imports asyncssh.

One SSH connection per host is reused for the agent channel, SFTP and any plain command; the
number of channels open at once stays below the host's ``MaxSessions``.  ``LocalTransport`` offers
the same interface for the coordinator's own machine, with no SSH at all.

Every asyncssh / OS error is mapped to our small exception tree (``ssh_scheduler.errors``) with a
message that says what to do about it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import shlex
import shutil
import stat
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .config import Machine
from .errors import (
    AuthenticationError,
    ConnectionLostError,
    HostKeyError,
    HostUnreachableError,
    TransportError,
)

KEEPALIVE_INTERVAL = 10.0
KEEPALIVE_COUNT_MAX = 3
PREFERRED_CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes256-ctr",
    "aes192-ctr",
    "aes128-ctr",
)
CHUNK = 256 * 1024


def printable(text: object, limit: int = 300) -> str:
    """Text from a host, safe for a one-line message: control characters escaped, cut if long."""
    shown = text if isinstance(text, str) else "" if text is None else str(text)
    if not shown.isprintable():
        shown = repr(shown)[1:-1]
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def agent_bootstrap(python: str, root: str, token: str = "") -> str:
    """The shell command that starts the agent: its source travels on the command line.

    With a batch ``token``, a still-running agent of that batch is reattached to (see agent.py).
    """
    source = (Path(__file__).with_name("agent.py")).read_bytes()
    blob = base64.b64encode(zlib.compress(source, 9)).decode()
    code = (
        "import sys,zlib,base64;g={'__name__':'ssh_scheduler_agent'};"
        "exec(zlib.decompress(base64.b64decode(sys.argv[1])),g);g['main'](*sys.argv[2:4])"
    )
    # -I -S: no site packages or PYTHON* variables to read, half the start-up time; the agent
    # needs only the standard library.
    return f"exec {python} -u -I -S -c {shlex.quote(code)} {blob} {shlex.quote(root)} {shlex.quote(token)}"


class Stream(Protocol):
    """The agent's byte streams, from asyncssh or from a local subprocess."""

    async def readline(self) -> bytes: ...


class AgentProcess:
    """A running agent: line-oriented JSON in, line-oriented JSON out."""

    def __init__(self, stdin: Any, stdout: Stream, closer: Callable[[], Any]) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self._closer = closer

    def write(self, data: bytes) -> None:
        self.stdin.write(data)

    async def drain(self) -> None:
        with contextlib.suppress(Exception):
            await self.stdin.drain()

    async def readline(self) -> bytes:
        return await self.stdout.readline()

    async def close(self) -> None:
        result = self._closer()
        if asyncio.iscoroutine(result):
            await result


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes


OutputSink = Callable[[bytes], None]


class Transport(Protocol):
    machine: Machine
    bytes_sent: int
    bytes_received: int

    async def start_agent(self, token: str = "") -> AgentProcess: ...
    async def upload(self, local: Path, remote: str, mode: int) -> int: ...
    async def download(self, remote: str, fd: int, limit: int) -> int: ...
    async def exec(
        self, command: str, on_stdout: OutputSink | None = None, on_stderr: OutputSink | None = None
    ) -> ExecResult: ...
    async def close(self) -> None: ...


# --- local ---------------------------------------------------------------------------------------


class LocalTransport:
    """This machine, without SSH: same agent, plain file copies."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.bytes_sent = 0
        self.bytes_received = 0

    async def start_agent(self, token: str = "") -> AgentProcess:
        cmd = agent_bootstrap(shlex.quote(sys.executable), self.machine.workdir, token)
        proc = await asyncio.create_subprocess_shell(
            cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 26,
            start_new_session=True,
        )

        async def closer() -> None:
            if proc.stdin is not None:
                proc.stdin.close()
            await proc.wait()

        return AgentProcess(proc.stdin, proc.stdout, closer)  # type: ignore[arg-type]

    async def upload(self, local: Path, remote: str, mode: int) -> int:
        return await asyncio.to_thread(self._copy_in, local, remote, mode)

    def _copy_in(self, local: Path, remote: str, mode: int) -> int:
        final = os.path.expanduser(remote)
        tmp = f"{final}.part-{secrets.token_hex(6)}"  # two uploads of one file may race
        shutil.copyfile(local, tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, final)
        size = os.path.getsize(final)
        self.bytes_sent += size
        return size

    async def download(self, remote: str, fd: int, limit: int) -> int:
        return await asyncio.to_thread(self._copy_out, remote, fd, limit)

    def _copy_out(self, remote: str, fd: int, limit: int) -> int:
        total = 0
        src = os.open(os.path.expanduser(remote), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise TransportError(f"{remote} is not a regular file")
            while chunk := os.read(src, CHUNK):
                total += len(chunk)
                if total > limit:
                    raise SizeLimitExceeded(remote, limit)
                os.write(fd, chunk)
        finally:
            os.close(src)
        self.bytes_received += total
        return total

    async def exec(
        self, command: str, on_stdout: OutputSink | None = None, on_stderr: OutputSink | None = None
    ) -> ExecResult:
        proc = await asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            out, err = await asyncio.gather(
                _pump(proc.stdout, on_stdout), _pump(proc.stderr, on_stderr)
            )
            code = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            raise
        return ExecResult(128 - code if code < 0 else code, out, err)

    async def close(self) -> None:
        return None


async def _pump(stream: Any, sink: OutputSink | None) -> bytes:
    parts: list[bytes] = []
    while True:
        chunk = await stream.read(CHUNK)
        if not chunk:
            return b"".join(parts)
        if isinstance(chunk, str):
            chunk = chunk.encode()
        parts.append(chunk)
        if sink is not None:
            sink(chunk)


class SizeLimitExceeded(TransportError):
    def __init__(self, path: str, limit: int) -> None:
        super().__init__(f"{printable(path)} is larger than the copy-back limit of {limit} bytes")


class RemoteFileError(TransportError):
    """One remote file could not be opened or read (the connection itself is fine)."""


# --- ssh -----------------------------------------------------------------------------------------

# Longest line the agent may send (a manifest of 10^5 long names fits); a host that sends an
# endless line must not exhaust the coordinator's memory.
MAX_AGENT_LINE = 1 << 26
# A download that makes no progress for this long is abandoned (a FIFO on the host, a stuck
# server): it must not hold up a whole batch.
SFTP_READ_TIMEOUT = 120.0


class _BoundedLines:
    """``readline`` over a byte stream, refusing a line longer than ``limit``."""

    def __init__(self, stream: Any, limit: int = MAX_AGENT_LINE) -> None:
        self._stream = stream
        self._limit = limit
        self._buf = bytearray()
        self._pos = 0  # start of the unread data in _buf
        self._scan = 0  # no newline before this index
        self._eof = False

    async def readline(self) -> bytes:
        while True:
            nl = self._buf.find(b"\n", max(self._pos, self._scan))
            if nl >= 0:
                line = bytes(self._buf[self._pos : nl + 1])
                self._pos = self._scan = nl + 1
                if self._pos >= CHUNK and self._pos * 2 >= len(self._buf):
                    del self._buf[: self._pos]
                    self._pos = self._scan = 0
                return line
            self._scan = len(self._buf)
            if self._scan - self._pos > self._limit:
                raise ConnectionLostError(
                    f"the agent sent a line longer than {self._limit} bytes; the host is not "
                    f"speaking our protocol"
                )
            if self._eof:
                line = bytes(self._buf[self._pos :])
                self._buf.clear()
                self._pos = self._scan = 0
                return line
            chunk = await self._stream.read(CHUNK)
            if not chunk:
                self._eof = True
            else:
                self._buf += chunk


def describe(machine: Machine) -> str:
    user = f"{machine.user}@" if machine.user else ""
    port = f":{machine.port}" if machine.port != 22 else ""
    return f"{machine.name} ({user}{machine.host}{port})"


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


class KnownHosts:
    """The trusted host keys of some known_hosts files, matched as OpenSSH does.

    A port other than 22 is looked up as ``[host]:port`` only: unlike asyncssh's own matching
    there is no fallback to the port-less entry, so a key trusted for one port is not trusted
    for a different server on another port of the same host.  Hashed (``|1|...``) entries,
    wildcards, ``@cert-authority`` and ``@revoked`` work.
    """

    def __init__(self, files: Sequence[str]) -> None:
        self.files = list(files)
        texts = []
        for path in self.files:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise HostKeyError(
                    f"cannot read known_hosts file {path}: {exc.strerror or exc}; fix its "
                    f"permissions (host keys are always checked)"
                ) from None
        self._db = _parse_known_hosts("\n".join(texts))

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
            found = self._db.match(name, "", None)
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

    return await asyncio.wait_for(
        asyncssh.get_server_host_key(
            machine.host, machine.port, tunnel=tunnel if tunnel is not None else (), config=None
        ),
        machine.connect_timeout,
    )


def _key_text(key: Any) -> str:
    """``SHA256:... (ssh-ed25519)`` for a message."""
    return f"{key.get_fingerprint()} ({key.get_algorithm()})"


def record_host_key(machine: Machine, key: Any) -> str:
    """Append ``key`` for this host to the first known_hosts file; returns that file."""
    files = known_hosts_files(machine)
    if not files:
        raise HostKeyError(
            f"{describe(machine)}: unknown host key {_key_text(key)}, and no known_hosts file is "
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
                    f"{describe(machine)}: unknown host key {_key_text(key)}, and its known_hosts "
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


def _changed_message(machine: Machine, offered: Any) -> str:
    name = known_hosts_name(machine)
    files = known_hosts_files(machine)
    offers = f"it offers {_key_text(offered)}" if offered is not None else "its key"
    where = f" -f {shlex.quote(files[0])}" if files else ""
    return (
        f"{describe(machine)}: HOST KEY CHANGED: {offers}, but {', '.join(files)} records a "
        f"different key for {name}. This can be an attack; nothing was sent to it. If the host "
        f"was really reinstalled, remove the old entry with `ssh-keygen -R {shlex.quote(name)}"
        f"{where}`, check the new fingerprint and rerun with --accept-new"
    )


async def _refuse_if_key_changed(machine: Machine, known: KnownHosts, tunnel: Any) -> None:
    """Raise HostKeyError when the host is known but now offers a key that is not recorded."""
    if not known.knows(machine.host, machine.port):
        return
    offered = None
    with contextlib.suppress(Exception):
        offered = await fetch_host_key(machine, tunnel)
    if offered is not None and offered not in known.lookup(machine.host, "", machine.port)[0]:
        raise HostKeyError(
            _changed_message(machine, offered) + " (it offers none of the key types recorded)"
        )


def _unknown_message(machine: Machine, offered: Any) -> str:
    files = known_hosts_files(machine)
    shown = ", ".join(files) or "no known_hosts file (UserKnownHostsFile none)"
    what = _key_text(offered) if offered is not None else "(its fingerprint could not be fetched)"
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
        return _changed_message(machine, offered)
    return _unknown_message(machine, offered)


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
    keys, _ = _load_client_keys(machine)
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


def _load_client_keys(machine: Machine) -> tuple[list[Any] | None, list[str]]:
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


class SSHTransport:
    """One asyncssh connection to one host, shared by everything that talks to it."""

    def __init__(self, machine: Machine, conn: Any, tunnels: Sequence[Any] = ()) -> None:
        self.machine = machine
        self.conn = conn
        self._tunnels = list(tunnels)
        self.bytes_sent = 0
        self.bytes_received = 0
        # The agent and SFTP hold a channel each for the whole batch; plain commands share the
        # rest.  Staying under MaxSessions avoids "open failed" refusals from sshd.
        self.sessions = asyncio.Semaphore(max(1, machine.max_sessions - 2))
        self._sftp: Any = None
        self._sftp_lock = asyncio.Lock()
        self.python = "python3"

    @classmethod
    async def connect(
        cls, machine: Machine, *, accept_new: bool = False, keepalive: float | None = None
    ) -> SSHTransport:
        client_keys, left_to_agent = _load_client_keys(machine)
        known = KnownHosts(known_hosts_files(machine))
        options: dict[str, Any] = {
            "port": machine.port,
            # A callable, never None: None would turn host key checking off.
            "known_hosts": known.lookup,
            "connect_timeout": machine.connect_timeout,
            "keepalive_interval": keepalive if keepalive is not None else KEEPALIVE_INTERVAL,
            "keepalive_count_max": KEEPALIVE_COUNT_MAX,
            "agent_forwarding": machine.forward_agent,
            # The ssh config was already applied by ssh_scheduler.config; () would make asyncssh
            # read ~/.ssh/config a second time and apply it again (HostName, ProxyCommand...).
            "config": None,
            "login_timeout": machine.connect_timeout,
            # Both are AEAD ciphers; asyncssh's AES-GCM costs about half of its ChaCha20-Poly1305
            # per packet (measured: 187 vs 352 us per small round trip), and a batch is many
            # small packets.
            "encryption_algs": PREFERRED_CIPHERS,
        }
        if machine.user:
            options["username"] = machine.user
        if client_keys is not None:
            options["client_keys"] = client_keys
        tunnels: list[Any] = []
        try:
            if machine.proxy_jump:
                tunnels = await _open_jump_hosts(machine)
                options["tunnel"] = tunnels[-1]
            conn = await cls._connect_checked(
                machine, known, options, accept_new, tunnels, left_to_agent
            )
        except BaseException:
            for tunnel in reversed(tunnels):
                tunnel.close()
            raise
        return cls(machine, conn, tunnels)

    @classmethod
    async def _connect_checked(
        cls,
        machine: Machine,
        known: KnownHosts,
        options: dict[str, Any],
        accept_new: bool,
        tunnels: Sequence[Any],
        left_to_agent: Sequence[str] = (),
    ) -> Any:
        import asyncssh

        tunnel = tunnels[-1] if tunnels else None
        try:
            return await asyncio.wait_for(
                asyncssh.connect(machine.host, **options), machine.connect_timeout + 5
            )
        except asyncssh.HostKeyNotVerifiable:
            offered = None
            with contextlib.suppress(Exception):
                offered = await fetch_host_key(machine, tunnel)
            if known.knows(machine.host, machine.port):
                raise HostKeyError(_changed_message(machine, offered)) from None
            if offered is not None and known.revoked(machine.host, machine.port, offered):
                raise HostKeyError(
                    f"{describe(machine)}: its host key {_key_text(offered)} is marked @revoked "
                    f"in {', '.join(known.files)}; nothing was sent to it"
                ) from None
            if accept_new and offered is not None:
                record_host_key(machine, offered)
                # Connect again, strictly: only the key just recorded is accepted now.
                known = KnownHosts(known_hosts_files(machine))
                options = dict(options, known_hosts=known.lookup)
                return await cls._connect_checked(
                    machine, known, options, False, tunnels, left_to_agent
                )
            raise HostKeyError(_unknown_message(machine, offered)) from None
        except (asyncssh.KeyExchangeFailed, asyncssh.ConnectionLost, ConnectionResetError) as exc:
            # Only the key types recorded for a known host are offered to it; a server that has
            # none of them (its keys were regenerated as another type) hangs up in the key
            # exchange.  That is a changed key, not a network problem.
            await _refuse_if_key_changed(machine, known, tunnel)
            if isinstance(exc, ConnectionResetError):
                raise HostUnreachableError(
                    f"{describe(machine)}: {_os_reason(exc, machine.host, machine.port)}; check "
                    f"the address and port, and that sshd runs"
                ) from None
            raise TransportError(f"{describe(machine)}: {exc.reason}") from None
        except asyncssh.PermissionDenied:
            keys = ", ".join(machine.key_paths) or "the ssh-agent and ~/.ssh/id_*"
            hint = ""
            if left_to_agent:
                added = " ".join(shlex.quote(p) for p in left_to_agent)
                hint = f"; a passphrase-protected key must be in the ssh-agent: ssh-add {added}"
            raise AuthenticationError(
                f"{describe(machine)}: permission denied for the key(s) {keys}; "
                f"check username and ssh_key_path, and that the public key is in the host's "
                f"~/.ssh/authorized_keys{hint}"
            ) from None
        except TimeoutError:
            raise HostUnreachableError(
                f"{describe(machine)}: no answer within {machine.connect_timeout:g} s; "
                f"check that the host is up and reachable (or raise connect_timeout)"
            ) from None
        except OSError as exc:
            raise HostUnreachableError(
                f"{describe(machine)}: {_os_reason(exc, machine.host, machine.port)}; check the "
                f"address and port, and that sshd runs"
            ) from None
        except asyncssh.Error as exc:
            raise TransportError(f"{describe(machine)}: {exc.reason}") from None

    # -- channels ---------------------------------------------------------------------------------
    async def _with_retry(self, opener: Callable[[], Any]) -> Any:
        """Open a channel, retrying briefly when sshd refuses it (MaxSessions reached)."""
        import asyncssh

        delay = 0.02
        for attempt in range(8):
            try:
                return await opener()
            except asyncssh.ChannelOpenError as exc:
                if attempt == 7:
                    raise ConnectionLostError(
                        f"{describe(self.machine)}: cannot open a session: {exc.reason}"
                    ) from None
                await asyncio.sleep(delay)
                delay *= 2
            except (asyncssh.ConnectionLost, asyncssh.DisconnectError, OSError) as exc:
                raise ConnectionLostError(f"{describe(self.machine)}: {exc}") from None
        raise AssertionError("unreachable")

    async def start_agent(self, token: str = "") -> AgentProcess:
        cmd = agent_bootstrap(self.python, self.machine.workdir, token)
        proc = await self._with_retry(lambda: self.conn.create_process(cmd, encoding=None))

        async def closer() -> None:
            with contextlib.suppress(Exception):
                proc.stdin.write_eof()
            with contextlib.suppress(Exception):
                await proc.wait_closed()

        return AgentProcess(proc.stdin, _BoundedLines(proc.stdout), closer)

    async def sftp(self) -> Any:
        async with self._sftp_lock:
            if self._sftp is None:
                self._sftp = await self._with_retry(self.conn.start_sftp_client)
            return self._sftp

    async def upload(self, local: Path, remote: str, mode: int) -> int:
        import asyncssh

        sftp = await self.sftp()
        tmp = f"{remote}.part-{secrets.token_hex(6)}"  # another batch may upload the same file
        try:
            await sftp.put(str(local), tmp)
            await sftp.chmod(tmp, mode)
            await sftp.posix_rename(tmp, remote)
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"{describe(self.machine)}: upload of {local} failed: {exc}") from None
        size = local.stat().st_size
        self.bytes_sent += size
        return size

    async def download(self, remote: str, fd: int, limit: int) -> int:
        """Copy one remote file into ``fd``, stopping past ``limit`` bytes.

        The host is untrusted: the file may never end (a FIFO, /dev/zero behind a symlink on its
        side) or never answer, so bytes are counted chunk by chunk and each read has a timeout.
        A file that cannot be opened or read raises :class:`RemoteFileError`; a broken
        connection raises :class:`ConnectionLostError`.
        """
        import asyncssh

        sftp = await self.sftp()
        total = 0
        path = os.fsencode(remote)  # bytes: a non-UTF-8 remote name arrives surrogate-escaped
        try:
            f = await _within(sftp.open(path, "rb"), SFTP_READ_TIMEOUT)
            try:
                while True:
                    chunk = await _within(f.read(CHUNK), SFTP_READ_TIMEOUT)
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > limit:
                        raise SizeLimitExceeded(remote, limit)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
            except _Stalled:
                raise  # the session is stuck: no polite close, it is dropped below
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(f.close(), 5)
                raise
            else:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(f.close(), 5)
        except _Stalled:
            await self._drop_sftp()
            raise RemoteFileError(
                f"{describe(self.machine)}: download of {printable(remote)} stalled for "
                f"{SFTP_READ_TIMEOUT:g} s (a FIFO or device on the host?)"
            ) from None
        except asyncssh.SFTPError as exc:
            raise RemoteFileError(
                f"{describe(self.machine)}: cannot read {printable(remote)}: {printable(exc.reason)}"
            ) from None
        except (asyncssh.Error, ConnectionError) as exc:
            raise ConnectionLostError(
                f"{describe(self.machine)}: download of {printable(remote)} failed: {printable(exc)}"
            ) from None
        except OSError as exc:
            raise TransportError(
                f"{describe(self.machine)}: download of {printable(remote)} failed: "
                f"{exc.strerror or exc}"
            ) from None
        self.bytes_received += total
        return total

    async def _drop_sftp(self) -> None:
        """Forget a stuck SFTP session: the next transfer opens a fresh one."""
        async with self._sftp_lock:
            sftp, self._sftp = self._sftp, None
        if sftp is not None:
            with contextlib.suppress(Exception):
                sftp.exit()

    async def exec(
        self, command: str, on_stdout: OutputSink | None = None, on_stderr: OutputSink | None = None
    ) -> ExecResult:
        import asyncssh

        async with self.sessions:
            proc = await self._with_retry(lambda: self.conn.create_process(command, encoding=None))
            try:
                out, err = await asyncio.gather(
                    _pump(proc.stdout, on_stdout), _pump(proc.stderr, on_stderr)
                )
                await proc.wait_closed()
            except (asyncssh.Error, OSError) as exc:
                raise ConnectionLostError(f"{describe(self.machine)}: {exc}") from None
            except asyncio.CancelledError:
                proc.close()
                raise
        status = proc.exit_status
        if status is None or status < 0:
            signame = proc.exit_signal[0] if proc.exit_signal else None
            status = 128 + _signal_number(signame) if signame else 255
        return ExecResult(status, out, err)

    async def close(self) -> None:
        if self._sftp is not None:
            self._sftp.exit()
        self.conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.wait_closed(), 2)
        for tunnel in reversed(self._tunnels):
            tunnel.close()


async def _open_jump_hosts(machine: Machine) -> list[Any]:
    """Connect through each ProxyJump hop in turn, as ``ssh -J`` would: the user's ssh config,
    known_hosts and keys apply to the jump hosts; agent forwarding stays off."""
    import asyncssh

    assert machine.proxy_jump
    conns: list[Any] = []
    try:
        for hop in machine.proxy_jump.split(","):
            user, host, port = _parse_hop(hop)
            label = f"{describe(machine)}: jump host {hop}"
            try:
                conn = await asyncio.wait_for(
                    asyncssh.connect(
                        host,
                        port if port is not None else (),
                        username=user if user is not None else (),
                        tunnel=conns[-1] if conns else (),
                        agent_forwarding=False,
                        connect_timeout=machine.connect_timeout,
                        login_timeout=machine.connect_timeout,
                        keepalive_interval=KEEPALIVE_INTERVAL,
                        keepalive_count_max=KEEPALIVE_COUNT_MAX,
                    ),
                    machine.connect_timeout + 5,
                )
            except asyncssh.HostKeyNotVerifiable as exc:
                raise HostKeyError(
                    f"{label}: {exc.reason}; check its key and add it to ~/.ssh/known_hosts "
                    f"(for example with ssh-keyscan) before using it as a jump host"
                ) from None
            except asyncssh.PermissionDenied:
                raise AuthenticationError(
                    f"{label}: permission denied; check that `ssh {hop}` works"
                ) from None
            except TimeoutError:
                raise HostUnreachableError(
                    f"{label}: no answer within {machine.connect_timeout:g} s"
                ) from None
            except OSError as exc:
                raise HostUnreachableError(f"{label}: {_os_reason(exc, host, port)}") from None
            except asyncssh.Error as exc:
                raise TransportError(f"{label}: {exc.reason}") from None
            conns.append(conn)
    except BaseException:
        for conn in reversed(conns):
            conn.close()
        raise
    return conns


def _os_reason(exc: OSError, host: str, port: int | None) -> str:
    """``connect to HOST port PORT: connection refused``, as OpenSSH words it (asyncio's own
    "Connect call failed (...)" does not say what happened)."""
    reason = os.strerror(exc.errno).lower() if exc.errno else (exc.strerror or str(exc))
    return f"connect to {host} port {port or 22}: {reason}"


class _Stalled(Exception):
    """An SFTP request got no answer in time."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _within(awaitable: Any, timeout: float) -> Any:
    """Await with a timeout, but on timeout leave the request running instead of cancelling it:
    asyncssh's parallel reads leave orphan tasks behind when cancelled.  The abandoned request
    ends when its SFTP session is dropped, and its outcome is collected quietly."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.add_done_callback(_retrieve)
        raise _Stalled
    return task.result()


def _signal_number(name: str) -> int:
    import signal

    try:
        return int(getattr(signal, "SIG" + name))
    except AttributeError:
        return 0


async def connect(
    machine: Machine, *, accept_new: bool = False, keepalive: float | None = None
) -> Transport:
    if machine.is_local:
        return LocalTransport(machine)
    return await SSHTransport.connect(machine, accept_new=accept_new, keepalive=keepalive)
