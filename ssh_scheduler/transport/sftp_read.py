"""One remote file read over SFTP into a local descriptor: single reads, a few in flight, in order.

The file is opened with asyncssh's ``block_size=0``, so each ``read(n, offset)`` is one SFTP
request.  asyncssh's own parallel reader (a read larger than a block) waits on all of its
requests with ``asyncio.wait`` at every answer and joins the answers into one buffer before
giving any back: reading a 200 MB file from a test host cost 1.1-1.4 s of CPU that way on a
2-core machine, 0.8-1.1 s this way, which awaits the oldest request, writes its answer and asks
for the next block (what is left is asyncssh's decryption and packets, and the writes).  Only a
file that filled its first block gets more than one read in flight, so a small result still
costs two requests (its data, then the end).

The host is untrusted: an answer longer than asked is an error of the host's, a short one is
taken as far as it goes and the rest asked again from there (a regular file is cut short only
at its end), and the caller bounds the bytes and the wait for each answer.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any

from ssh_scheduler.transport.base import CHUNK, SizeLimitExceeded

DEPTH = 8
"""Reads in flight once the file has filled its first block (2 MB of 256 KiB reads): enough to
keep a link of 25 ms round trips busy at 80 MB/s; deeper only held more answers at once."""


class WriteFailed(Exception):
    """Writing the local file failed (carried past the handlers that mean the host)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


class Stalled(Exception):
    """An SFTP request got no answer in time."""


class Overlong(Exception):
    """The host answered a read with more bytes than it asked for."""


def block_size(sftp: Any) -> int:
    """Bytes one read asks for: the server's own limit (OpenSSH's ``limits`` extension says
    255 KiB), at most :data:`CHUNK`; asyncssh's default when the server names none."""
    return max(1, min(CHUNK, int(sftp.limits.max_read_len)))


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def within(awaitable: Any, timeout: float) -> Any:
    """Await with a timeout, but on timeout leave the request running instead of cancelling it:
    the abandoned request ends when its SFTP session is dropped (the caller drops it), and its
    outcome is collected quietly."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.add_done_callback(_retrieve)
        raise Stalled
    return task.result()


async def read_into(f: Any, fd: int, remote: str, limit: int, block: int, timeout: float) -> int:
    """Copy the SFTP file ``f`` (opened with ``block_size=0``) into ``fd`` from its start;
    the bytes copied.  SizeLimitExceeded past ``limit`` bytes, Stalled when an answer takes
    longer than ``timeout``, Overlong for an answer longer than asked, WriteFailed when ``fd``
    cannot be written; the SFTP errors of a read as asyncssh raises them."""
    total = 0
    ahead: deque[tuple[int, asyncio.Future[bytes]]] = deque()  # (offset, its read), in file order
    asked = 0  # where the next read starts

    def ask() -> None:
        nonlocal asked
        ahead.append((asked, asyncio.ensure_future(f.read(block, asked))))
        asked += block

    try:
        ask()
        while ahead:
            offset, reading = ahead.popleft()
            chunk = await within(reading, timeout)
            if len(chunk) > block:
                raise Overlong
            total += len(chunk)
            if total > limit:
                raise SizeLimitExceeded(remote, limit)
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                raise WriteFailed(exc) from None
            if len(chunk) == block:
                while len(ahead) < DEPTH:
                    ask()
                continue
            # The end (nothing came), or an answer cut short: the reads past it asked for the
            # wrong places, so they go, and one read asks on from where this one stopped.
            _cancel(ahead)
            if chunk:
                asked = offset + len(chunk)
                ask()
    finally:
        _cancel(ahead)
    return total


def _cancel(ahead: deque[tuple[int, asyncio.Future[bytes]]]) -> None:
    """Drop the reads in flight: asyncssh ignores the answer to a request whose waiter is gone."""
    for _, reading in ahead:
        reading.cancel()
    ahead.clear()
