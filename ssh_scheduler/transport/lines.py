"""The agent's output as lines, none longer than a limit: a host that sends an endless line
must not exhaust the coordinator's memory (there may be hundreds of hosts, each holding at most
one line here at a time, and the line itself once more when it is handed on)."""

from __future__ import annotations

from typing import Any

from ssh_scheduler.agent.protocol import MAX_LINE
from ssh_scheduler.errors import ConnectionLostError
from ssh_scheduler.transport.base import CHUNK


class BoundedLines:
    """``readline`` over a byte stream, refusing a line longer than ``limit``."""

    def __init__(self, stream: Any, limit: int = MAX_LINE) -> None:
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
                with memoryview(self._buf) as view:  # one copy of the line, not two
                    line = bytes(view[self._pos : nl + 1])
                self._pos = self._scan = nl + 1
                if self._pos >= CHUNK and self._pos * 2 >= len(self._buf):
                    self._buf = self._buf[self._pos :]  # a long line's room is given back
                    self._pos = self._scan = 0
                return line
            self._scan = len(self._buf)
            if self._scan - self._pos > self._limit:
                raise ConnectionLostError(
                    f"the agent sent a line longer than {self._limit >> 20} MiB (the protocol's limit "
                    f"for one message); the host is not speaking our protocol"
                )
            if self._eof:
                line = bytes(self._buf[self._pos :])
                self._buf = bytearray()
                self._pos = self._scan = 0
                return line
            chunk = await self._stream.read(CHUNK)
            if not chunk:
                self._eof = True
            else:
                self._buf += chunk
