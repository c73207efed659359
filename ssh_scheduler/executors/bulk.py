"""Small files in bulk through the agent's channel.

Over SFTP every file costs round trips, whatever its size: open, read, read (the end), close to
bring one home; open, write, close, chmod, rename to send one.  With thousands of small files
that, not the bytes, was the cost (about 1.6 ms of wall and 1.1 ms of coordinator CPU per file).
Here one agent message carries many files (base64 in the JSON line: the agent's channel is
already open, and a few MB per message amortise every round trip), so a dataset of 5000 files is
a handful of messages.  Files above ``SMALL_FILE`` still go by SFTP, where bytes, not round
trips, are the cost.

Only the carrying changes, never the checks.  Uploads still land in the cache under their content
hash, and the agent keeps a file only when it hashes to its key.  Every file brought home is
still written by ``transfer.fetch_back``, entry by entry in the listing's order, through the same
checked names, directory descriptors, O_EXCL / O_NOFOLLOW and byte budget as an SFTP download;
only names that passed those checks are ever asked for, and an answer is matched to what was
asked, never trusted to name a place.  Whatever goes wrong with a batch (an agent without these
requests, no answer in time, an error) sends its files the old way, one by one by SFTP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from ssh_scheduler.agent.protocol import Blob
from ssh_scheduler.errors import TransportError
from ssh_scheduler.executors.session import HostSession
from ssh_scheduler.jobs.forward import LocalFile
from ssh_scheduler.transport import ssh
from ssh_scheduler.transport.base import RemoteFileError, printable, stopped

log = logging.getLogger(__name__)

SMALL_FILE = 256 * 1024  # larger files go by SFTP: bytes, not round trips, are their cost
BATCH_BYTES = 4 * 1024 * 1024  # per message (x 4/3 in base64), far below the agent's line limit
BATCH_FILES = 2000
AHEAD = 4  # batches in flight at once (bounds what is held in memory)

T = TypeVar("T")


def batches(items: Sequence[T], size_of: Callable[[T], int]) -> list[list[T]]:
    """Consecutive groups of at most BATCH_FILES items and about BATCH_BYTES, in order."""
    groups: list[list[T]] = []
    current: list[T] = []
    total = 0
    for item in items:
        size = size_of(item)
        if current and (len(current) >= BATCH_FILES or total + size > BATCH_BYTES):
            groups.append(current)
            current, total = [], 0
        current.append(item)
        total += size
    if current:
        groups.append(current)
    return groups


# --- forward -------------------------------------------------------------------------------------


def _read_blobs(host: HostSession, files: Sequence[LocalFile]) -> list[Blob]:
    blobs = []
    for f in files:
        try:
            data = f.path.read_bytes()
        except OSError as exc:
            raise TransportError(f"{host.name}: upload of {f.path} failed: {exc.strerror or exc}") from None
        blobs.append(Blob(name=f.key, data=base64.b64encode(data).decode()))
    return blobs


async def put_small(host: HostSession, files: Sequence[LocalFile]) -> list[LocalFile]:
    """Send small files into the host's cache, a few MB per message; returns those the host did
    not keep (to send by SFTP)."""
    limit = asyncio.Semaphore(AHEAD)

    async def send(group: list[LocalFile]) -> list[LocalFile]:
        async with limit:
            blobs = await asyncio.to_thread(_read_blobs, host, group)
            try:
                failed = await host.put(blobs)
            except TransportError as exc:
                if host.lost is not None:
                    raise
                log.info("%s: %d files in one message failed (%s); each goes by SFTP", host.name, len(group), exc)
                return group
        if failed:
            log.info("%s: the host did not keep %d files (%s); each goes by SFTP", host.name, len(failed), printable(failed[0]))
        refused = {entry.split(":", 1)[0] for entry in failed}
        return [f for f in group if f.key in refused]

    left = await asyncio.gather(*(send(group) for group in batches(files, lambda f: f.size)))
    return [f for group in left for f in group]


# --- back ----------------------------------------------------------------------------------------


class Prefetch:
    """Small result files asked of the agent in batches, a few ahead of ``fetch_back`` writing
    them in the listing's order."""

    def __init__(self, host: HostSession, jobdir: str, files: Sequence[tuple[str, int]], limit: int) -> None:
        self.host = host
        self.jobdir = jobdir
        self.limit = limit  # the copy-back byte budget: the agent sends at most one byte more
        self._groups = batches(files, lambda f: f[1])
        self._where = {rel: i for i, group in enumerate(self._groups) for rel, _ in group}
        self._asked: dict[int, asyncio.Task[dict[str, Blob] | None]] = {}

    async def get(self, rel: str) -> Blob | None:
        """The agent's answer for ``rel``; None: not asked this way, its batch failed or was cut
        at the byte limit (then SFTP brings it, and counts it against the same budget)."""
        i = self._where.get(rel)
        if i is None:
            return None
        for j in range(i, min(i + AHEAD, len(self._groups))):
            if j not in self._asked:
                self._asked[j] = asyncio.create_task(self._ask(j))
        for j in [j for j in self._asked if j < i]:  # written already: free their bytes
            self._asked.pop(j).cancel()
        found = await self._asked[i]
        return None if found is None else found.get(rel)

    async def _ask(self, i: int) -> dict[str, Blob] | None:
        paths = [rel for rel, _ in self._groups[i]]
        try:
            blobs = await self.host.fetch(self.jobdir, paths, self.limit, ssh.SFTP_READ_TIMEOUT)
        except TransportError as exc:
            if self.host.lost is not None:
                raise
            log.info("%s: %d results in one message failed (%s); each comes by SFTP", self.host.name, len(paths), exc)
            return None
        asked = set(paths)
        return {blob.name: blob for blob in blobs if blob.name in asked}

    async def close(self) -> None:
        tasks = list(self._asked.values())
        self._asked.clear()
        await stopped(*tasks)  # a closer cancelled meanwhile still ends cancelled


def content(host: HostSession, rel: str, blob: Blob) -> bytes:
    """A fetched file's bytes; RemoteFileError when the host could not (or would not) read it."""
    if blob.data is None:
        reason = blob.error if blob.error is not None else "no data"
        raise RemoteFileError(f"{host.name}: cannot read {printable(rel)}: {printable(reason)}")
    try:
        return base64.b64decode(blob.data, validate=True)
    except (binascii.Error, ValueError):
        raise RemoteFileError(f"{host.name}: {printable(rel)}: malformed data from the host") from None
