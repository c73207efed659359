"""What every transport shares: the interface, constants, errors and small helpers."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ssh_scheduler.errors import (
    ConnectionLostError,
    TransportError,
    plain_text,
)
from ssh_scheduler.machines.machine import Machine

T = TypeVar("T")
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
LEGACY_KEY = "legacy_algorithms"
"""The machine YAML key that lets a host use SHA-1 and other legacy algorithms."""


def printable(text: object, limit: int = 300) -> str:
    """Text from a host, safe for a one-line message: the one sanitizer, cut if long."""
    return plain_text(text, limit)


class Stream(Protocol):
    """The agent's byte streams, from asyncssh or from a local subprocess."""

    async def readline(self) -> bytes: ...


ExitDetails = Callable[[], Awaitable[tuple[int | None, str]]]
"""After the agent's stdout ended: its exit status (None: unknown) and the end of its stderr."""


async def _no_details() -> tuple[int | None, str]:
    return None, ""


class AgentProcess:
    """A running agent: line-oriented JSON in, line-oriented JSON out."""

    def __init__(
        self,
        stdin: Any,
        stdout: Stream,
        closer: Callable[[], Any],
        exit_details: ExitDetails = _no_details,
        abort: Callable[[], None] = lambda: None,
    ) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self._closer = closer
        self.exit_details = exit_details
        self.abort = abort
        """Drop its channel at once, as the connection's end would (the hub's relay, hub_agent)."""

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
    async def open_file_channel(self) -> None:
        """Open the channel file transfers use, now: a host that refuses it is unusable."""
        ...
    async def upload(self, local: Path, remote: str, mode: int) -> int: ...
    async def download(self, remote: str, fd: int, limit: int) -> int: ...
    async def exec(
        self, command: str, on_stdout: OutputSink | None = None, on_stderr: OutputSink | None = None
    ) -> ExecResult: ...
    async def close(self) -> None: ...


class SizeLimitExceeded(TransportError):
    def __init__(self, path: str, limit: int) -> None:
        super().__init__(f"{printable(path)} is larger than the copy-back limit of {limit} bytes")


class RemoteFileError(TransportError):
    """One remote file could not be opened or read (the connection itself is fine)."""


def describe(machine: Machine) -> str:
    user = f"{machine.user}@" if machine.user else ""
    port = f":{machine.port}" if machine.port != 22 else ""
    return f"{machine.name} ({user}{machine.host}{port})"


async def bounded(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``await awaitable``, TimeoutError after ``seconds``: asyncio.wait_for without its flaw.
    Python 3.11's wait_for returns the result when its task is cancelled in the same moment the
    awaited thing completes, and the cancelled task goes on as if never cancelled (a closing
    HubTransport waited for ever on its keepalive loop that way, once in a 256-host batch).
    tests/test_cancellation.py keeps wait_for out of the package (the agent, on the hosts'
    Python 3.8 and later, has no asyncio.timeout: it waits with asyncio.wait)."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def stopped(*tasks: asyncio.Task[Any]) -> None:
    """Cancel ``tasks``, wait until each has ended (their ends, exceptions included, are
    theirs), and then raise the caller's own cancellation if one came meanwhile: suppressing
    CancelledError around ``await task`` swallowed it, and the caller went on as if never
    cancelled.  The tasks are ours and end once cancelled, so the wait is short."""
    for task in tasks:
        task.cancel()
    own: asyncio.CancelledError | None = None
    while tasks and not all(task.done() for task in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError as exc:
            own = exc  # raised once they have ended: cancelling kills, waits, re-raises
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: asyncio logs one nobody looked at
    if own is not None:
        raise own


def file_channel_timeout(machine: Machine) -> float:
    """Seconds the SFTP channel may take to open and answer: three times the connection's own
    bound (``connect_timeout``), as the channel opens on a connection already made."""
    return 3 * machine.connect_timeout


async def file_channel_within(machine: Machine, opening: Awaitable[Any]) -> Any:
    """``opening`` (the SFTP channel opened and its server's first answer read) within
    :func:`file_channel_timeout`: an sftp server that never answers makes the host lost, said
    as such, where the host was silently never used (its opening waited without end)."""
    seconds = file_channel_timeout(machine)
    try:
        return await bounded(opening, seconds)
    except TimeoutError:
        raise ConnectionLostError(
            f"{describe(machine)}: its SFTP channel did not answer within {seconds:g} s "
            "(3 x connect_timeout); the host is left out"
        ) from None


async def pump(stream: Any, sink: OutputSink | None) -> bytes:
    """Everything a command's stdout or stderr says, passed to ``sink`` as it arrives."""
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


def os_reason(exc: OSError, host: str, port: int | None) -> str:
    """``connect to HOST port PORT: connection refused``, as OpenSSH words it (asyncio's own
    "Connect call failed (...)" does not say what happened)."""
    reason = os.strerror(exc.errno).lower() if exc.errno else (exc.strerror or str(exc))
    return f"connect to {host} port {port or 22}: {reason}"
