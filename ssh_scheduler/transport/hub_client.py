"""Reaching a host through the hub (hub_server.py): the same :class:`Transport`, kept warm.

:func:`open_via_hub` is the one choice point (transport/ssh.connect asks it first): for a machine
with ``keep_warm`` above 0 it reaches this user's hub -- starting it when none runs -- and
borrows a connection to the host, warm when an earlier command left one.  What it returns is a
:class:`HubTransport`, which every caller uses as it would an SSH connection: the agent's
channel, commands, the file channel, uploads and downloads, the same errors with the same
messages.  Whatever goes wrong with the hub itself (none can start, it refuses us, it is another
user's, it died, it is stuck) gives ``None``, and the caller connects directly: slower, never
wrong, never a hang.  A hub that dies while lent is a lost connection, as a cut network is.

The command line asks the hubs what they hold and tells them to stop in hub_ask.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import select
import socket
import subprocess
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConnectionLostError, TransportError
from ssh_scheduler.machines.machine import DEFAULT_KEEP_WARM, Machine
from ssh_scheduler.transport.base import (
    CHUNK,
    KEEPALIVE_COUNT_MAX,
    KEEPALIVE_INTERVAL,
    AgentProcess,
    ExecResult,
    OutputSink,
    bounded,
    describe,
    file_channel_timeout,
    stopped,
)
from ssh_scheduler.transport.hub_place import (
    KEEP_WARM_VARIABLE,
    REACH_TIMEOUT,
    SUPPORTED,
    HubAbsent,
    HubUnusable,
    keep_warm_seconds,
    lock_path,
    private_folder,
    socket_path,
    spawn_hub,
    take_early,
)
from ssh_scheduler.transport.hub_wire import (
    END,
    ERR,
    FAIL,
    OUT,
    connect_socket,
    error_from_json,
    machine_json,
    read_frame,
    send_request,
)
from ssh_scheduler.transport.lines import BoundedLines

log = logging.getLogger(__name__)

START_TIMEOUT = 20.0
"""Seconds a starting hub may take to listen (python3 and asyncssh to import, on a busy host)."""
AGENT_REPLY_TIMEOUT = 60.0
"""Seconds the hub has to answer a request for an agent (its longest path takes well under half
of it: a spare waited for, refused, a kept agent closed, one started); past it, the host is lost."""
_borrowed: set[Path] = set()
_on_hub_use: list[Callable[[], None]] = []
_starting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future[None]] = weakref.WeakKeyDictionary()


def keep_warm_of(machine: Machine) -> float:
    """Seconds the hub keeps this machine's connection warm: its own ``keep_warm`` (or the
    ``--keep-warm`` that replaced it), else ``$SSH_SCHEDULER_KEEP_WARM``, else 60."""
    if machine.keep_warm is not None:
        return machine.keep_warm
    return _default(os.environ.get(KEEP_WARM_VARIABLE, "").strip())


@functools.cache
def _default(text: str) -> float:
    """The variable's value (said once when it is no number of seconds)."""
    value = keep_warm_seconds(text)
    if value is not None:
        return value
    if not text:
        return DEFAULT_KEEP_WARM
    log.warning("%s=%s is not a number of seconds (0 or more); using %g", KEEP_WARM_VARIABLE, text, DEFAULT_KEEP_WARM)
    return DEFAULT_KEEP_WARM


# --- the choice point -------------------------------------------------------------------------


async def open_via_hub(machine: Machine, *, accept_new: bool = False, keepalive: float | None = None) -> HubTransport | None:
    """A connection to ``machine`` borrowed from the hub, or None: connect directly.  Raises
    what connecting raises (an unknown host key, a refused login...) when the hub connected and
    the host said no: a direct attempt would only hear the same."""
    keep = keep_warm_of(machine)
    if keep <= 0 or machine.is_local or not SUPPORTED:
        return None
    while _on_hub_use:  # once per process, before the hub is reached (or started)
        callback = _on_hub_use.pop(0)
        try:
            callback()
        except Exception as exc:  # a hook's failure is the hook's: the connection goes on
            log.debug("a hook on using the hub failed: %s", exc)
    try:
        path = socket_path(private_folder(create=True))
        sock = await _reach(path)
    except HubUnusable as exc:
        log.debug("%s: no warm connection (%s); connecting directly", machine.name, exc)
        return None
    try:
        send_request(sock, {
            "op": "open", "machine": machine_json(machine), "accept_new": accept_new,
            "keepalive": keepalive, "keep": keep,
        })
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
    except (OSError, HubUnusable) as exc:
        sock.close()
        log.debug("%s: the hub did not take the request (%s); connecting directly", machine.name, exc)
        return None
    try:
        # The hub says at once that it took the request (a stopped or stuck hub says nothing and
        # is given up quickly), then may connect for us: as long as a direct connect may take,
        # with its host-key lookup, and room to spare.
        reply = json.loads(await bounded(reader.readline(), REACH_TIMEOUT))
        if isinstance(reply, dict) and reply.get("accepted"):
            reply = json.loads(await bounded(reader.readline(), machine.connect_timeout * 3 + 30))
    except (OSError, ValueError, TimeoutError) as exc:
        writer.close()
        log.debug("%s: the hub gave no answer (%s); connecting directly", machine.name, exc or "it ended")
        return None
    except BaseException:
        writer.close()
        raise
    if not isinstance(reply, dict) or not reply.get("ok"):
        writer.close()
        if isinstance(reply, dict) and "error" in reply:
            raise error_from_json(reply)
        log.debug("%s: the hub refused (%s); connecting directly", machine.name, reply)
        return None
    # Its operations go to the hub that lent it, on its own socket (the name may pass to a new
    # hub while this one finishes what it lent: hub stop).
    own = Path(str(reply.get("own") or path))
    if own.parent != path.parent:
        writer.close()
        log.debug("%s: the hub named a socket outside its folder (%s); connecting directly", machine.name, own)
        return None
    _borrowed.add(path)
    return HubTransport(machine, own, str(reply["lease"]), reader, writer, bool(reply.get("warm")))


def borrowed() -> bool:
    """Whether this process borrowed a connection from a hub."""
    return bool(_borrowed)


def when_hub_used(callback: Callable[[], None]) -> None:
    """Call ``callback`` once, when this process first goes to the hub for a connection, before
    reaching or starting it (the command line starts its launcher then, so that it loads while
    the command goes on: cli/launch.py)."""
    _on_hub_use.append(callback)


async def _reach(path: Path) -> socket.socket:
    """A connection to this user's hub, started first when none answers."""
    try:
        sock = await connect_socket(path, REACH_TIMEOUT)
    except HubAbsent:
        pass  # start one (something else answering there, not our hub, is never replaced)
    else:
        _settle_early(path)
        return sock
    loop = asyncio.get_running_loop()
    starting = _starting.get(loop)
    if starting is None or starting.done():  # one start per process, however many hosts wait
        starting = loop.create_future()
        _starting[loop] = starting
        try:
            await loop.run_in_executor(None, start_hub, path)
        except HubUnusable as exc:
            starting.set_exception(exc)
            starting.exception()  # retrieved: only the waiters below care
        else:
            starting.set_result(None)
    await asyncio.shield(starting)
    return await connect_socket(path, REACH_TIMEOUT)


def _settle_early(path: Path) -> None:
    """The hub this command started first thing listens already, so nobody waits on its start:
    close its pipe and reap its first process (which exits as the hub forks away), rather than
    leave it a zombie for as long as the command runs."""
    starting = take_early(path)
    if starting is None:
        return
    os.close(starting.said)
    process = starting.process
    if process.poll() is not None:
        return
    # Not gone yet (it exits within moments of the fork): reaped when its pidfd says it ended.
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:
        return

    def ended() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        process.poll()

    loop.add_reader(pidfd, ended)


def start_hub(path: Path, tries: int = 2) -> None:
    """Start the hub for ``path`` (or take the start the command made early) and wait until it
    listens, or until another that won the race does; HubUnusable when neither happens."""
    try:
        starting = take_early(path) or spawn_hub(path)
    except OSError as exc:
        raise HubUnusable(f"cannot start the hub: {exc.strerror or exc}") from None
    said = b""
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while not said.endswith(b"\n") and (left := deadline - time.monotonic()) > 0:
            if not select.select([starting.said], [], [], left)[0]:
                break
            chunk = os.read(starting.said, 256)
            if not chunk:
                break
            said += chunk
        with contextlib.suppress(subprocess.TimeoutExpired):
            starting.process.wait(1)  # it forked the hub and exited: reaped here, nobody's zombie
    except OSError as exc:
        raise HubUnusable(f"cannot start the hub: {exc.strerror or exc}") from None
    finally:
        os.close(starting.said)
    if said.startswith(b"busy"):  # another start won: wait until it listens
        while time.monotonic() < deadline and not path.exists():
            if not lock_path(path).exists() and tries > 1:  # it gave its name up meanwhile
                start_hub(path, tries - 1)
                return
            time.sleep(0.02)
    elif not said.startswith(b"ready"):
        raise HubUnusable(f"the hub did not start ({said.decode(errors='replace').strip() or 'no answer'}; see {starting.logfile})")


# --- the transport ------------------------------------------------------------------------------


class HubTransport:
    """A host's connection lent by the hub: the :class:`Transport` interface over its socket."""

    def __init__(
        self, machine: Machine, path: Path, lease: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, warm: bool
    ) -> None:
        self.machine = machine
        self.warm = warm  # the connection was already open (an earlier command's)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._path = path
        self._lease = lease
        self._hold = (reader, writer)
        self._streams: set[asyncio.StreamWriter] = set()
        self._lost: str | None = None
        self._keepalive = asyncio.create_task(self._ping(), name=f"hub keepalive {machine.name}")

    async def _ping(self) -> None:
        """The hub must answer as a host answers SSH keepalives, or the connection is lost (a
        stopped hub must not hang the command)."""
        reader, writer = self._hold
        try:
            while True:
                await asyncio.sleep(KEEPALIVE_INTERVAL)
                writer.write(b"ping\n")
                await writer.drain()
                if await bounded(reader.readline(), KEEPALIVE_INTERVAL * KEEPALIVE_COUNT_MAX) != b"pong\n":
                    raise ConnectionError("the hub let the connection go")
        except (OSError, TimeoutError) as exc:
            self._lose(f"the connection hub stopped answering ({exc or 'no answer'})")

    def _lose(self, reason: str) -> None:
        if self._lost is None:
            self._lost = reason
        for stream in list(self._streams):
            stream.close()

    def _gone(self, what: object) -> ConnectionLostError:
        return ConnectionLostError(f"{describe(self.machine)}: {self._lost or f'the connection hub is gone ({what})'}")

    async def _request(
        self, request: dict[str, Any], fds: tuple[int, ...] = (), within: float | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]:
        """One operation's connection to the hub, its request sent and the reply read (``within``:
        a bound, where no transfer comes first); raises its own error or ConnectionLostError."""
        if self._lost is not None:
            raise self._gone("")
        try:
            sock = await connect_socket(self._path, REACH_TIMEOUT)
        except HubUnusable as exc:
            raise self._gone(exc) from None
        try:
            send_request(sock, {**request, "lease": self._lease}, fds)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        except (OSError, HubUnusable) as exc:
            sock.close()
            raise self._gone(exc) from None
        self._streams.add(writer)
        try:
            reply = json.loads(await bounded(reader.readline(), within) or b"null")
        except BaseException as exc:
            self._close_stream(writer)
            if isinstance(exc, TimeoutError):
                raise self._gone(f"no answer to {request.get('op')} within {within:g} s") from None
            if isinstance(exc, OSError | ValueError):
                raise self._gone(exc) from None
            raise
        if not isinstance(reply, dict) or not reply.get("ok"):
            self._close_stream(writer)
            raise error_from_json(reply) if isinstance(reply, dict) and "error" in reply else self._gone(reply)
        return reader, writer, reply

    def _close_stream(self, writer: asyncio.StreamWriter) -> None:
        self._streams.discard(writer)
        writer.close()

    async def start_agent(self, token: str = "") -> AgentProcess:
        reader, writer, _ = await self._request({"op": "agent", "token": token}, within=AGENT_REPLY_TIMEOUT)
        stream = _AgentStream(reader, self)
        details: asyncio.Future[tuple[int | None, str]] = stream.details

        async def closer() -> None:
            with contextlib.suppress(OSError, RuntimeError):
                writer.write_eof()  # the agent's end of input (the hub keeps it, or ends it)
                while await reader.read(CHUNK):  # what is left, until the hub has let it go
                    pass
            self._close_stream(writer)

        async def exit_details() -> tuple[int | None, str]:
            with contextlib.suppress(TimeoutError):
                return await bounded(asyncio.shield(details), 11)
            return None, ""

        return AgentProcess(writer, BoundedLines(stream), closer, exit_details, lambda: self._close_stream(writer))

    async def open_file_channel(self) -> None:
        _, writer, _ = await self._request({"op": "sftp"}, within=file_channel_timeout(self.machine) + REACH_TIMEOUT)
        self._close_stream(writer)

    async def upload(self, local: Path, remote: str, mode: int) -> int:
        try:
            fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TransportError(f"{describe(self.machine)}: upload of {local} failed: {exc}") from None
        try:
            _, writer, reply = await self._request(
                {"op": "upload", "remote": remote, "mode": mode, "shown": str(local)}, (fd,)
            )
        finally:
            os.close(fd)
        self._close_stream(writer)
        self.bytes_sent += int(reply["size"])
        return int(reply["size"])

    async def download(self, remote: str, fd: int, limit: int) -> int:
        _, writer, reply = await self._request({"op": "download", "remote": remote, "limit": limit}, (fd,))
        self._close_stream(writer)
        self.bytes_received += int(reply["size"])
        return int(reply["size"])

    async def exec(
        self, command: str, on_stdout: OutputSink | None = None, on_stderr: OutputSink | None = None
    ) -> ExecResult:
        reader, writer, _ = await self._request({"op": "exec", "command": command})
        out: list[bytes] = []
        err: list[bytes] = []
        try:  # cancelled: the stream closes below, and the hub closes the command's channel
            while True:
                kind, data = await read_frame(reader)
                if kind in (OUT, ERR):
                    (out if kind == OUT else err).append(data)
                    sink = on_stdout if kind == OUT else on_stderr
                    if sink is not None:
                        sink(data)
                elif kind == END:
                    return ExecResult(int(json.loads(data)["code"]), b"".join(out), b"".join(err))
                elif kind == FAIL:
                    raise error_from_json(json.loads(data))
                else:
                    raise self._gone("it ended while the command ran")
        finally:
            self._close_stream(writer)

    async def close(self) -> None:
        await stopped(self._keepalive)
        for stream in list(self._streams):
            stream.close()
        hold = self._hold[1]
        with contextlib.suppress(OSError, RuntimeError):
            hold.write(b"bye\n")  # an orderly end: the hub may lend the connection again
        hold.close()


class _AgentStream:
    """The agent's stdout out of the hub's frames (``read`` as a stream's), then its exit details."""

    def __init__(self, reader: asyncio.StreamReader, transport: HubTransport) -> None:
        self._reader = reader
        self._transport = transport
        self.details: asyncio.Future[tuple[int | None, str]] = asyncio.get_running_loop().create_future()

    async def read(self, n: int = -1) -> bytes:
        while True:
            kind, data = await read_frame(self._reader)
            if kind == OUT:
                return data
            if kind == END:
                ended = json.loads(data)
                if not self.details.done():
                    self.details.set_result((ended.get("status"), str(ended.get("stderr") or "")))
                return b""
            if not self.details.done():
                self.details.set_result((None, ""))
            raise self._transport._gone("it ended while the agent ran")


__all__ = ["KEEP_WARM_VARIABLE", "HubTransport", "keep_warm_of", "open_via_hub"]
