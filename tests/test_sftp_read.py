"""A result file read over SFTP a few requests deep (transport/sftp_read.py).

The reader is driven first by a file object of our own whose answers come back out of order and
may be cut short or run long, then end to end through asyncssh and the SSH transport against the
hostile in-process server (tests/hostile_server.py), whose SFTP answers follow the same rules.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.remote import RemoteOptions, execute_remote
from ssh_scheduler.transport import sftp_read
from ssh_scheduler.transport.base import SizeLimitExceeded
from ssh_scheduler.transport.sftp_read import DEPTH, Overlong, WriteFailed, read_into
from tests.hostile_server import Answers, HostileServer, Scenario, hostile_server
from tests.test_hostile_server import workspace

BLOCK = 1000  # the reader's block in the unit tests: small, so files span many of them


class Remote:
    """A remote file: each read yields to the loop a random number of times (so answers come
    back in another order than asked) and answers as ``answer(data, offset, size)`` says."""

    def __init__(self, data: bytes, rng: random.Random, answer: Callable[[bytes, int, int], bytes] | None = None) -> None:
        self.data = data
        self.rng = rng
        self.answer = answer or (lambda d, o, n: d[o : o + n])
        self.asked: list[tuple[int, int]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def read(self, size: int, offset: int) -> bytes:
        self.asked.append((offset, size))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for _ in range(1 + self.rng.randrange(4)):  # at least once: every read asked at once starts
                await asyncio.sleep(0)
            return self.answer(self.data, offset, size)
        finally:
            self.in_flight -= 1


def cut_at_random(rng: random.Random) -> Callable[[bytes, int, int], bytes]:
    """Answers a host may give: a third of them cut short, to a random length of at least 1."""

    def answer(data: bytes, offset: int, size: int) -> bytes:
        whole = data[offset : offset + size]
        if whole and rng.random() < 0.33:
            return whole[: rng.randint(1, len(whole))]
        return whole

    return answer


async def copy(remote: Remote, tmp_path: Path, limit: int = 1 << 40) -> tuple[int, bytes]:
    target = tmp_path / "copied"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        n = await read_into(remote, fd, "r.bin", limit, BLOCK, 30)
    finally:
        os.close(fd)
        await asyncio.sleep(0)  # the reads it dropped (past the end) end in their next step
    return n, target.read_bytes()


SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, DEPTH * BLOCK, DEPTH * BLOCK + 1, 3 * DEPTH * BLOCK + 5]


@pytest.mark.parametrize("size", SIZES + [random.Random(s).randrange(40 * BLOCK) for s in range(6)])
async def test_every_size_comes_whole_and_in_order(size: int, tmp_path: Path) -> None:
    data = random.Random(size).randbytes(size)
    remote = Remote(data, random.Random(size + 1))
    assert await copy(remote, tmp_path) == (size, data)
    assert remote.in_flight == 0


@pytest.mark.parametrize("seed", range(40))
async def test_answers_cut_short_are_asked_on_from_where_they_stopped(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(1, 30 * BLOCK))
    remote = Remote(data, rng, cut_at_random(rng))
    assert await copy(remote, tmp_path) == (len(data), data)
    assert remote.in_flight == 0


async def test_only_a_file_that_fills_its_first_block_gets_reads_in_flight(tmp_path: Path) -> None:
    small = Remote(b"x" * (BLOCK - 1), random.Random(1))
    await copy(small, tmp_path)
    assert small.asked == [(0, BLOCK), (BLOCK - 1, BLOCK)]  # its data, then its end
    big = Remote(b"y" * (20 * BLOCK + 3), random.Random(2))
    await copy(big, tmp_path)
    assert big.most_in_flight == DEPTH
    assert big.asked[:2] == [(0, BLOCK), (BLOCK, BLOCK)]


async def test_an_answer_longer_than_asked_is_the_hosts_error(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(5 * BLOCK)
    remote = Remote(data, random.Random(4), lambda d, o, n: d[o : o + n] + (b"!" if 2 * BLOCK <= o < len(d) else b""))
    with pytest.raises(Overlong):
        await copy(remote, tmp_path)
    assert remote.in_flight == 0  # none left running
    assert (tmp_path / "copied").read_bytes() == data[: 2 * BLOCK]  # nothing of the long answer


@pytest.mark.parametrize("over", [0, 1])
async def test_the_byte_limit_holds_across_reads_in_flight(over: int, tmp_path: Path) -> None:
    data = random.Random(5).randbytes(7 * BLOCK + 11)
    remote = Remote(data, random.Random(6))
    if over:
        with pytest.raises(SizeLimitExceeded):
            await copy(remote, tmp_path, limit=len(data) - 1)
        assert remote.in_flight == 0
    else:
        assert await copy(remote, tmp_path, limit=len(data)) == (len(data), data)


async def test_a_local_write_that_fails_is_ours(tmp_path: Path) -> None:
    fd = os.open(os.devnull, os.O_RDONLY)  # writing it fails with EBADF
    try:
        with pytest.raises(WriteFailed) as info:
            await read_into(Remote(b"z" * 10, random.Random(7)), fd, "r.bin", 100, BLOCK, 30)
    finally:
        os.close(fd)
    assert isinstance(info.value.error, OSError)


def test_the_block_is_the_servers_limit_at_most_a_chunk() -> None:
    class Limits:
        max_read_len = 261120  # what OpenSSH's sftp-server says

    class Client:
        limits = Limits()

    assert sftp_read.block_size(Client()) == 261120
    Limits.max_read_len = 1 << 30
    assert sftp_read.block_size(Client()) == sftp_read.CHUNK


# ------------------------------------------------------------------ end to end, a hostile host
@pytest.fixture
async def evil(tmp_path: Path) -> AsyncIterator[HostileServer]:
    async with hostile_server(tmp_path) as server:
        yield server


async def test_a_large_result_cut_into_short_answers_comes_back_whole(evil: HostileServer, tmp_path: Path) -> None:
    """3 MB (more than DEPTH reads of OpenSSH's block), every answer at most 100 KB and a
    third of them cut to a random length: byte for byte what the host has."""
    rng = random.Random(8)
    big = rng.randbytes(3 * 1024 * 1024 + 77)
    plain = rng.randbytes(1024 * 1024)

    def cut(data: bytes, offset: int, size: int) -> bytes:
        return cut_at_random(rng)(data, offset, min(size, 100_000))

    evil.scenarios["cut"] = Scenario(
        entries=[["big.bin", "file", len(big), 0o644, None], ["plain.bin", "file", len(plain), 0o644, None]],
        contents={"big.bin": Answers(big, cut), "plain.bin": plain},
    )
    src, results = workspace(tmp_path)
    code = await execute_remote(
        evil.machine(), "true", RemoteOptions(job_name="cut", results_dir=results, base_dir=src), stdout=(), stderr=(),
    )
    assert code == 0
    assert (results / "cut" / "big.bin").read_bytes() == big
    assert (results / "cut" / "plain.bin").read_bytes() == plain


async def test_a_result_answered_longer_than_asked_is_not_copied(evil: HostileServer, tmp_path: Path) -> None:
    data = random.Random(9).randbytes(600_000)
    warned: list[str] = []
    evil.scenarios["long"] = Scenario(
        entries=[["long.bin", "file", len(data), 0o644, None], ["after", "file", 5, 0o644, None]],
        contents={"long.bin": Answers(data, lambda d, o, n: d[o : o + n] + b"\x1b[2J" if o < len(d) else b"")},
    )
    src, results = workspace(tmp_path)
    code = await execute_remote(
        evil.machine(), "true",
        RemoteOptions(job_name="long", results_dir=results, base_dir=src),
        stdout=(), stderr=(), warn=warned.append,
    )  # fmt: skip
    assert code == 0
    assert os.listdir(results / "long") == ["after"]  # no part of the long answers kept
    text = "\n".join(warned)
    assert "long.bin: not copied" in text and "more bytes than asked" in text, warned
    assert "\x1b" not in text
