"""What every transport shares: the interface, the agent bootstrap, constants and errors."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import shlex
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ssh_scheduler.errors import (
    TransportError,
)
from ssh_scheduler.machines.config import Machine

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
    """Text from a host, safe for a one-line message: control characters escaped, cut if long."""
    shown = text if isinstance(text, str) else "" if text is None else str(text)
    if not shown.isprintable():
        shown = repr(shown)[1:-1]
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


AGENT_MODULES = ("protocol", "hostguard", "plumbing", "main")  # shipped together, run in this order

# Runs on the host (python3 >= 3.8); argv: blob, root, token, key.  Compiling the ~1500 lines
# shipped cost more than the rest of the agent's start, so the code objects are kept in the work
# root (code-<key of the sources>-<python's cache tag>, written by the agent once the root is
# checked private) and loaded only when the root and that file are ours and writable by nobody
# else, checked through descriptors, never following a link; otherwise the blob is compiled.
# The helpers become modules ssh_scheduler_<name>, where agent.py looks for them.
_BOOT = """\
import sys,os,marshal
n=('protocol','hostguard','plumbing','main');k='code-%s-%s'%(sys.argv[4],sys.implementation.cache_tag);c=None
def mine(fd):
 s=os.fstat(fd);return s.st_uid==os.getuid() and not s.st_mode&18
try:
 d=os.open(os.path.expanduser(sys.argv[2]),os.O_RDONLY|os.O_DIRECTORY|os.O_NOFOLLOW)
 try:
  f=os.open(k,os.O_RDONLY|os.O_NOFOLLOW,dir_fd=d)
  with os.fdopen(f,'rb') as x:
   if mine(d) and mine(f):c=marshal.load(x)
 finally:os.close(d)
except (OSError,ValueError,EOFError,TypeError):c=None
if not isinstance(c,list) or len(c)!=len(n):
 import zlib,base64;c=[compile(s,'ssh_scheduler/agent/%s.py'%m,'exec') for m,s in zip(n,zlib.decompress(base64.b64decode(sys.argv[1])).split(b'\\0'))]
for m,s in zip(n[:-1],c):x=sys.modules['ssh_scheduler_'+m]=type(sys)(m);exec(s,x.__dict__)
g={'__name__':'ssh_scheduler_agent','CODE':(k,c)};exec(c[-1],g);g['main'](*sys.argv[2:4])
"""


@functools.cache
def _agent_blob() -> tuple[str, str]:
    """The shipped sources, compressed, and a key naming this version of them."""
    here = Path(__file__).parent.parent / "agent"  # what travels to the hosts
    sources = b"\0".join((here / f"{name}.py").read_bytes() for name in AGENT_MODULES)
    return base64.b64encode(zlib.compress(sources, 9)).decode(), hashlib.sha256(sources).hexdigest()[:20]


def agent_bootstrap(python: str, root: str, token: str = "") -> str:
    """The shell command that starts the agent: its source travels on the command line.

    With a batch ``token``, a still-running agent of that batch is reattached to (see agent.py).
    """
    blob, key = _agent_blob()
    # -I -S: no site packages or PYTHON* variables to read, half the start-up time; the agent
    # needs only the standard library.  The bootstrap travels as one line (a string literal
    # with \n): tcsh and fish, as login shells, refuse a newline inside quotes.
    return (
        f"exec {python} -u -I -S -c {shlex.quote(f'exec({_BOOT!r})')} {blob} {shlex.quote(root)} "
        f"{shlex.quote(token)} {key}"
    )


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
        self, stdin: Any, stdout: Stream, closer: Callable[[], Any], exit_details: ExitDetails = _no_details
    ) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self._closer = closer
        self.exit_details = exit_details

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
