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
import shlex
import shutil
import stat
import sys
import zlib
from collections.abc import Callable
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
CHUNK = 256 * 1024


def agent_bootstrap(python: str, root: str) -> str:
    """The shell command that starts the agent: its source travels on the command line."""
    source = (Path(__file__).with_name("agent.py")).read_bytes()
    blob = base64.b64encode(zlib.compress(source, 9)).decode()
    code = (
        "import sys,zlib,base64;g={'__name__':'ssh_scheduler_agent'};"
        "exec(zlib.decompress(base64.b64decode(sys.argv[1])),g);g['main'](sys.argv[2])"
    )
    return f"exec {python} -u -c {shlex.quote(code)} {blob} {shlex.quote(root)}"


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

    async def start_agent(self) -> AgentProcess: ...
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

    async def start_agent(self) -> AgentProcess:
        cmd = agent_bootstrap(shlex.quote(sys.executable), self.machine.workdir)
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
        tmp = f"{final}.part{os.getpid()}"
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
        super().__init__(f"{path} is larger than the copy-back limit of {limit} bytes")


# --- ssh -----------------------------------------------------------------------------------------


def describe(machine: Machine) -> str:
    user = f"{machine.user}@" if machine.user else ""
    port = f":{machine.port}" if machine.port != 22 else ""
    return f"{machine.name} ({user}{machine.host}{port})"


def default_known_hosts() -> list[str]:
    return [os.path.expanduser("~/.ssh/known_hosts")]


def known_hosts_files(machine: Machine) -> list[str]:
    files = list(machine.known_hosts) if machine.known_hosts is not None else default_known_hosts()
    return [os.path.expanduser(f) for f in files]


def check_key_permissions(path: str) -> None:
    """Refuse a private key others can read, as OpenSSH does."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise AuthenticationError(f"cannot read ssh key {path}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise AuthenticationError(
            f"ssh key {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod 600 {shlex.quote(path)}"
        )


def load_client_keys(machine: Machine) -> list[Any] | None:
    import asyncssh

    if not machine.key_paths:
        return None  # asyncssh's defaults: the ssh-agent and ~/.ssh/id_*
    keys = []
    for path in machine.key_paths:
        check_key_permissions(path)
        try:
            keys.append(asyncssh.read_private_key(path))
        except asyncssh.KeyImportError as exc:
            if "assphrase" in str(exc):
                if os.environ.get("SSH_AUTH_SOCK"):
                    continue  # the agent may hold it
                raise AuthenticationError(
                    f"ssh key {path} is protected by a passphrase and no ssh-agent is running: "
                    f"start one and run: ssh-add {shlex.quote(path)}"
                ) from None
            raise AuthenticationError(f"cannot load ssh key {path}: {exc}") from None
    return keys or None


def host_key_entry_exists(machine: Machine) -> bool:
    """Does any known_hosts file name this host at all (so a mismatch means a CHANGED key)?"""
    import asyncssh

    for path in known_hosts_files(machine):
        if not os.path.exists(path):
            continue
        try:
            kh = asyncssh.read_known_hosts(path)
        except (OSError, ValueError):
            continue
        matched = kh.match(machine.host, "", machine.port)
        if matched[0] or matched[1]:
            return True
    return False


def known_hosts_name(machine: Machine) -> str:
    return machine.host if machine.port == 22 else f"[{machine.host}]:{machine.port}"


async def fetch_host_key(machine: Machine) -> Any:
    import asyncssh

    return await asyncio.wait_for(
        asyncssh.get_server_host_key(machine.host, machine.port, config=()),
        machine.connect_timeout,
    )


async def accept_new_host_key(machine: Machine) -> str:
    """Trust on first use: record the host's key, like StrictHostKeyChecking=accept-new."""
    key = await fetch_host_key(machine)
    if key is None:
        raise HostUnreachableError(f"{describe(machine)} sent no host key")
    path = known_hosts_files(machine)[0]
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    line = f"{known_hosts_name(machine)} {key.export_public_key().decode().strip()}\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
    return str(key.get_fingerprint())


async def unknown_key_message(machine: Machine) -> str:
    name = known_hosts_name(machine)
    files = ", ".join(known_hosts_files(machine))
    if host_key_entry_exists(machine):
        return (
            f"{describe(machine)}: HOST KEY CHANGED — the key it offers does not match {files}. "
            f"This can be an attack; if the host was really reinstalled, remove the old entry with "
            f"`ssh-keygen -R '{name}'` and trust the new key"
        )
    fingerprint = "unknown"
    with contextlib.suppress(Exception):
        key = await fetch_host_key(machine)
        if key is not None:
            fingerprint = key.get_fingerprint()
    return (
        f"{describe(machine)}: unknown host key {fingerprint} (not in {files}); "
        f"if that fingerprint is right, rerun with --accept-new, or run "
        f"`ssh-keyscan -p {machine.port} {machine.host} >> {known_hosts_files(machine)[0]}`"
    )


class SSHTransport:
    """One asyncssh connection to one host, shared by everything that talks to it."""

    def __init__(self, machine: Machine, conn: Any) -> None:
        self.machine = machine
        self.conn = conn
        self.bytes_sent = 0
        self.bytes_received = 0
        # The agent and SFTP hold a channel each for the whole batch; plain commands share the
        # rest.  Staying under MaxSessions avoids "open failed" refusals from sshd.
        self.sessions = asyncio.Semaphore(max(1, machine.max_sessions - 2))
        self._sftp: Any = None
        self._sftp_lock = asyncio.Lock()
        self.python = "python3"

    @classmethod
    async def connect(cls, machine: Machine, *, accept_new: bool = False) -> SSHTransport:
        import asyncssh

        client_keys = load_client_keys(machine)
        known = [f for f in known_hosts_files(machine) if os.path.exists(f)]
        options: dict[str, Any] = {
            "port": machine.port,
            "known_hosts": known if known else ([], [], []),
            "connect_timeout": machine.connect_timeout,
            "keepalive_interval": KEEPALIVE_INTERVAL,
            "keepalive_count_max": KEEPALIVE_COUNT_MAX,
            "agent_forwarding": machine.forward_agent,
            "config": (),
            "login_timeout": machine.connect_timeout,
        }
        if machine.user:
            options["username"] = machine.user
        if client_keys is not None:
            options["client_keys"] = client_keys
        if machine.proxy_jump:
            options["tunnel"] = machine.proxy_jump
        try:
            conn = await asyncio.wait_for(
                asyncssh.connect(machine.host, **options), machine.connect_timeout + 5
            )
        except asyncssh.HostKeyNotVerifiable:
            if accept_new and not host_key_entry_exists(machine):
                await accept_new_host_key(machine)
                return await cls.connect(machine, accept_new=False)
            raise HostKeyError(await unknown_key_message(machine)) from None
        except asyncssh.PermissionDenied:
            keys = ", ".join(machine.key_paths) or "the ssh-agent and ~/.ssh/id_*"
            raise AuthenticationError(
                f"{describe(machine)}: permission denied for the key(s) {keys}; "
                f"check username and ssh_key_path, and that the public key is in the host's "
                f"~/.ssh/authorized_keys"
            ) from None
        except (TimeoutError, asyncio.TimeoutError):
            raise HostUnreachableError(
                f"{describe(machine)}: no answer within {machine.connect_timeout:g} s; "
                f"check that the host is up and reachable (or raise connect_timeout)"
            ) from None
        except OSError as exc:
            # asyncio reports a refused connect as "Connect call failed (...)": say what errno means.
            reason = os.strerror(exc.errno).lower() if exc.errno else (exc.strerror or str(exc))
            raise HostUnreachableError(
                f"{describe(machine)}: {reason}; check the address and port, and that sshd runs"
            ) from None
        except asyncssh.Error as exc:
            raise TransportError(f"{describe(machine)}: {exc.reason}") from None
        return cls(machine, conn)

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

    async def start_agent(self) -> AgentProcess:
        cmd = agent_bootstrap(self.python, self.machine.workdir)
        proc = await self._with_retry(lambda: self.conn.create_process(cmd, encoding=None))

        async def closer() -> None:
            with contextlib.suppress(Exception):
                proc.stdin.write_eof()
            with contextlib.suppress(Exception):
                await proc.wait_closed()

        return AgentProcess(proc.stdin, proc.stdout, closer)

    async def sftp(self) -> Any:
        async with self._sftp_lock:
            if self._sftp is None:
                self._sftp = await self._with_retry(self.conn.start_sftp_client)
            return self._sftp

    async def upload(self, local: Path, remote: str, mode: int) -> int:
        import asyncssh

        sftp = await self.sftp()
        tmp = f"{remote}.part"
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
        import asyncssh

        sftp = await self.sftp()
        total = 0
        try:
            async with sftp.open(remote, "rb") as f:
                while True:
                    chunk = await f.read(CHUNK)
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > limit:
                        raise SizeLimitExceeded(remote, limit)
                    os.write(fd, chunk)
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"{describe(self.machine)}: download of {remote} failed: {exc}") from None
        self.bytes_received += total
        return total

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


def _signal_number(name: str) -> int:
    import signal

    try:
        return int(getattr(signal, "SIG" + name))
    except AttributeError:
        return 0


async def connect(machine: Machine, *, accept_new: bool = False) -> Transport:
    if machine.is_local:
        return LocalTransport(machine)
    return await SSHTransport.connect(machine, accept_new=accept_new)
