"""The SSH transport: one asyncssh connection per host, shared by everything that talks to it.

One SSH connection per host is reused for the agent channel, SFTP and any plain command; the
number of channels open at once stays below the host's ``MaxSessions``.  :func:`connect` gives
this machine's :class:`~ssh_scheduler.transport.local.LocalTransport` instead, with the same
interface (base.py) and no SSH at all.  Logging in (keys, jump hosts, algorithms) is auth.py's,
host keys are hostkeys.py's.

Every asyncssh / OS error is mapped to our small exception tree (``ssh_scheduler.errors``) with a
message that says what to do about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import (
    AgentStartError,
    AuthenticationError,
    ConnectionLostError,
    HostKeyError,
    HostUnreachableError,
    TransportError,
)
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.auth import (
    algorithm_options,
    load_keys,
    negotiation_hint,
    proxy_command_argv,
)
from ssh_scheduler.transport.base import (
    CHUNK,
    KEEPALIVE_COUNT_MAX,
    KEEPALIVE_INTERVAL,
    LEGACY_KEY,
    PREFERRED_CIPHERS,
    AgentProcess,
    ExecResult,
    OutputSink,
    RemoteFileError,
    Transport,
    bounded,
    describe,
    file_channel_within,
    os_reason,
    printable,
    pump,
)
from ssh_scheduler.transport.bootstrap import agent_start
from ssh_scheduler.transport.hostkeys import (
    KnownHosts,
    changed_key_message,
    fetch_host_key,
    key_text,
    known_hosts_files,
    new_key_message,
    record_host_key,
    refuse_if_key_changed,
)
from ssh_scheduler.transport.hub_client import open_via_hub
from ssh_scheduler.transport.jump import open_jump_hosts
from ssh_scheduler.transport.lines import BoundedLines
from ssh_scheduler.transport.loading import import_asyncssh
from ssh_scheduler.transport.local import LocalTransport
from ssh_scheduler.transport.sftp_read import (
    Overlong,
    Stalled,
    WriteFailed,
    block_size,
    read_into,
    within,
)

STDERR_TAIL = 4096
"""Bytes kept of the end of the agent's stderr."""
# A download that makes no progress for this long is abandoned (a FIFO on the host, a stuck
# server): it must not hold up a whole batch.
SFTP_READ_TIMEOUT = 120.0


class SSHTransport:
    """One asyncssh connection to one host, shared by everything that talks to it."""

    def __init__(self, machine: Machine, conn: Any, tunnels: Sequence[Any] = ()) -> None:
        self.machine = machine
        self.conn = conn
        self._tunnels = list(tunnels)
        # asyncssh forgets the ProxyCommand's tunnel when the connection closes: keep it to wait
        # for the command's exit in close().
        self._proxy = getattr(conn, "_tunnel", None) if machine.proxy_command else None
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
        import_asyncssh()  # before anything here imports it: see loading.py
        client_keys, left_to_agent = load_keys(machine)
        known = KnownHosts(known_hosts_files(machine))
        options: dict[str, Any] = {
            "port": machine.port,
            # A callable, never None: None would turn host key checking off.
            "known_hosts": known.lookup,
            "connect_timeout": machine.connect_timeout,
            "keepalive_interval": keepalive if keepalive is not None else KEEPALIVE_INTERVAL,
            "keepalive_count_max": KEEPALIVE_COUNT_MAX,
            "agent_forwarding": machine.forward_agent,
            # The ssh config was already applied by ssh_scheduler.machines.config; () would make asyncssh
            # read ~/.ssh/config a second time and apply it again (HostName, ProxyCommand...).
            "config": None,
            "login_timeout": machine.connect_timeout,
            # Both are AEAD ciphers; asyncssh's AES-GCM costs about half of its ChaCha20-Poly1305
            # per packet (measured: 187 vs 352 us per small round trip), and a batch is many
            # small packets.
            "encryption_algs": PREFERRED_CIPHERS,
            **algorithm_options(machine),
        }
        if machine.user:
            options["username"] = machine.user
        if client_keys is not None:
            options["client_keys"] = client_keys
        tunnels: list[Any] = []
        try:
            if machine.proxy_jump:
                tunnels = await open_jump_hosts(machine)
                options["tunnel"] = tunnels[-1]
            elif machine.proxy_command is not None:
                options["proxy_command"] = proxy_command_argv(machine)
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
            return await bounded(
                asyncssh.connect(machine.host, **options), machine.connect_timeout + 5
            )
        except asyncssh.HostKeyNotVerifiable:
            offered = None
            with contextlib.suppress(Exception):
                offered = await fetch_host_key(machine, tunnel)
            if known.knows(machine.host, machine.port):
                raise HostKeyError(changed_key_message(machine, offered)) from None
            if offered is not None and known.revoked(machine.host, machine.port, offered):
                raise HostKeyError(
                    f"{describe(machine)}: its host key {key_text(offered)} is marked @revoked "
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
            raise HostKeyError(new_key_message(machine, offered)) from None
        except (asyncssh.KeyExchangeFailed, asyncssh.ConnectionLost, ConnectionResetError) as exc:
            # Only the key types recorded for a known host are offered to it; a server that has
            # none of them (its keys were regenerated as another type) hangs up in the key
            # exchange.  That is a changed key, not a network problem.
            await refuse_if_key_changed(machine, known, tunnel)
            # OpenSSH hangs up (a reset) when no host key type matches.
            hint = negotiation_hint(machine, getattr(exc, "reason", ""))
            if isinstance(exc, ConnectionResetError):
                raise HostUnreachableError(
                    f"{describe(machine)}: {os_reason(exc, machine.host, machine.port)}; check "
                    f"the address and port, and that sshd runs{hint}"
                ) from None
            raise TransportError(f"{describe(machine)}: {exc.reason}{hint}") from None
        except asyncssh.PermissionDenied:
            keys = ", ".join(machine.key_paths) or "the ssh-agent and ~/.ssh/id_*"
            hint = ""
            if left_to_agent:
                added = " ".join(shlex.quote(p) for p in left_to_agent)
                hint = f"; a passphrase-protected key must be in the ssh-agent: ssh-add {added}"
            rsa = [k for k in options.get("client_keys") or () if k.algorithm == b"ssh-rsa"]
            if rsa and not machine.legacy_algorithms:
                hint += (
                    f"; RSA keys are signed with SHA-2 only: a host that accepts only ssh-rsa "
                    f"(SHA-1) signatures needs `{LEGACY_KEY}: true` in {machine.source or 'its machine file'}"
                )
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
                f"{describe(machine)}: {os_reason(exc, machine.host, machine.port)}; check the "
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
        start = agent_start(self.python, self.machine.workdir, token)
        proc = await self._with_retry(
            lambda: self.conn.create_process(start.command, encoding=None)
        )
        # The agent's code, before any request (its first stage reads exactly this much).  An
        # agent that could not start (no python3) refuses it: what it said is read below.
        with contextlib.suppress(Exception):
            proc.stdin.write(start.payload)

        # The agent's stderr is drained (only its end kept): when the agent cannot start, what
        # the login shell or python3 said there is the cause to show ("python3: not found").
        stderr_tail = bytearray()

        async def drain_stderr() -> None:
            with contextlib.suppress(Exception):
                while chunk := await proc.stderr.read(CHUNK):
                    stderr_tail.extend(chunk)
                    del stderr_tail[:-STDERR_TAIL]

        drainer = asyncio.create_task(drain_stderr())

        async def closer() -> None:
            with contextlib.suppress(Exception):
                proc.stdin.write_eof()
            with contextlib.suppress(Exception):
                await proc.wait_closed()
            drainer.cancel()

        async def exit_details() -> tuple[int | None, str]:
            with contextlib.suppress(Exception):
                await bounded(asyncio.shield(drainer), 5)
            with contextlib.suppress(Exception):
                await bounded(proc.wait_closed(), 5)
            return proc.exit_status, stderr_tail.decode("utf-8", "replace")

        return AgentProcess(proc.stdin, BoundedLines(proc.stdout), closer, exit_details, proc.close)

    async def open_file_channel(self) -> None:
        """The SFTP channel, beside the agent's: an sshd with ``MaxSessions 1`` refuses it, and
        we cannot work there (the agent and file transfers each need a session)."""
        import asyncssh

        try:
            async with self._sftp_lock:
                if self._sftp is None:
                    self._sftp = await file_channel_within(self.machine, self.conn.start_sftp_client())
        except asyncssh.ChannelOpenError as exc:
            raise AgentStartError(
                f"{self.machine.name}: sshd refused a second session on the connection "
                f"({printable(exc.reason)}; is its MaxSessions 1?): ssh_scheduler needs 2 per "
                f"host, one for its agent and one for file transfers; fix: set MaxSessions 2 or "
                f"more in the host's sshd_config (the default is 10)"
            ) from None
        except (asyncssh.Error, OSError) as exc:
            raise ConnectionLostError(f"{describe(self.machine)}: cannot start SFTP: {exc}") from None

    async def sftp(self) -> Any:
        async with self._sftp_lock:
            if self._sftp is None:
                self._sftp = await file_channel_within(self.machine, self._with_retry(self.conn.start_sftp_client))
            return self._sftp

    async def upload(self, local: Path, remote: str, mode: int) -> int:
        return await self._put(str(local), remote, mode, local, follow=False)

    async def upload_descriptor(self, fd: int, remote: str, mode: int, shown: str) -> int:
        """Upload the file open as ``fd`` (a client's, passed to the hub; ``shown``: its name)."""
        return await self._put(f"/proc/self/fd/{fd}", remote, mode, shown, follow=True)

    async def _put(self, source: str, remote: str, mode: int, shown: object, *, follow: bool) -> int:
        import asyncssh

        sftp = await self.sftp()
        tmp = f"{remote}.part-{secrets.token_hex(6)}"  # another batch may upload the same file
        try:
            await sftp.put(source, tmp, follow_symlinks=follow)
            await sftp.chmod(tmp, mode)
            await sftp.posix_rename(tmp, remote)
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"{describe(self.machine)}: upload of {shown} failed: {exc}") from None
        size = os.stat(source).st_size
        self.bytes_sent += size
        return size

    async def download(self, remote: str, fd: int, limit: int) -> int:
        """Copy one remote file into ``fd``, stopping past ``limit`` bytes.

        The host is untrusted: the file may never end (a FIFO, /dev/zero behind a symlink on its
        side) or never answer, so bytes are counted chunk by chunk and each read has a timeout.
        A file that cannot be opened or read raises :class:`RemoteFileError`; a broken
        connection raises :class:`ConnectionLostError`; writing ``fd`` failing (a full disk
        here) raises the OSError it is, for the caller to name: it is not the host's fault.
        """
        import asyncssh

        sftp = await self.sftp()
        path = os.fsencode(remote)  # bytes: a non-UTF-8 remote name arrives surrogate-escaped
        try:
            # block_size=0: each read is one request (sftp_read.py keeps a few in flight)
            f = await within(sftp.open(path, "rb", block_size=0), SFTP_READ_TIMEOUT)
            try:
                total = await read_into(f, fd, remote, limit, block_size(sftp), SFTP_READ_TIMEOUT)
            except Stalled:
                raise  # the session is stuck: no polite close, it is dropped below
            except BaseException:
                with contextlib.suppress(Exception):
                    await bounded(f.close(), 5)
                raise
            else:
                with contextlib.suppress(Exception):
                    await bounded(f.close(), 5)
        except Stalled:
            await self._drop_sftp()
            raise RemoteFileError(
                f"{describe(self.machine)}: download of {printable(remote)} stalled for "
                f"{SFTP_READ_TIMEOUT:g} s (a FIFO or device on the host?)"
            ) from None
        except Overlong:
            raise RemoteFileError(
                f"{describe(self.machine)}: cannot read {printable(remote)}: the host answered a "
                "read with more bytes than asked"
            ) from None
        except WriteFailed as failed:
            raise failed.error from None
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
                    pump(proc.stdout, on_stdout), pump(proc.stderr, on_stderr)
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
            await bounded(self.conn.wait_closed(), 2)
        # A ProxyCommand runs as our child: wait for it to exit (asyncssh closes its pipes but
        # does not wait), so no process is left unreaped behind a closed connection.
        if self._proxy is not None and hasattr(self._proxy, "wait_closed"):
            with contextlib.suppress(Exception):
                await bounded(self._proxy.wait_closed(), 2)
        for tunnel in reversed(self._tunnels):
            tunnel.close()


def _signal_number(name: str) -> int:
    import signal

    try:
        return int(getattr(signal, "SIG" + name))
    except AttributeError:
        return 0


async def connect(
    machine: Machine, *, accept_new: bool = False, keepalive: float | None = None
) -> Transport:
    """The transport every caller reaches ``machine`` through: this machine without SSH; a
    connection the hub keeps warm (hub_client.py), unless the machine's ``keep_warm`` is 0 or
    the hub cannot be used; else a connection of our own."""
    if machine.is_local:
        return LocalTransport(machine)
    borrowed = await open_via_hub(machine, accept_new=accept_new, keepalive=keepalive)
    if borrowed is not None:
        return borrowed
    return await SSHTransport.connect(machine, accept_new=accept_new, keepalive=keepalive)
