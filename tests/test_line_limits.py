"""What a host can make us hold (issue 23, item 8): a hostile host sent 64 MiB lines and cost the
coordinator about 300 MB each.  Now one line of a host is at most ``P.MAX_LINE`` (16 MiB), an
``out`` event at most ``P.MAX_OUTPUT_LINE`` (1 MiB), each held about once while it is read, and
the host that passes a limit is lost with one line naming it and the limit.  A real agent never
meets them: its largest messages are far below, and what could grow past (a results listing,
Slurm output) is refused with the reason or sent over several replies."""

from __future__ import annotations

import asyncio
import base64
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import slurm as agent_slurm
from ssh_scheduler.agent import wire as W
from ssh_scheduler.agent.main import Agent
from ssh_scheduler.coordinator.remote import RemoteOptions, execute_remote
from ssh_scheduler.errors import TransportError
from ssh_scheduler.executors import bulk
from ssh_scheduler.transport.base import CHUNK
from ssh_scheduler.transport.lines import BoundedLines
from tests.hostile_server import HostileServer, Scenario, hostile_server


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "input.txt").write_text("input\n")
    return src, tmp_path / "job_results"


async def remote(hostile: HostileServer, tmp_path: Path, job: str) -> int:
    src, results = workspace(tmp_path)
    return await execute_remote(
        hostile.machine(), "true", RemoteOptions(job_name=job, results_dir=results, base_dir=src), stdout=(), stderr=()
    )


async def test_a_line_over_the_limit_loses_the_host_with_one_clear_line(tmp_path: Path) -> None:
    async with hostile_server(tmp_path) as hostile:
        hostile.long_hello = P.MAX_LINE + CHUNK  # well-formed, just too long
        with pytest.raises(TransportError) as caught:
            await remote(hostile, tmp_path, "long")
    said = str(caught.value)
    assert said.startswith("evil (tester@127.0.0.1:"), said  # the host
    assert "the agent sent a line longer than 16 MiB (the protocol's limit for one message)" in said


async def test_an_output_event_over_its_limit_loses_the_host(tmp_path: Path) -> None:
    async with hostile_server(tmp_path) as hostile:
        hostile.scenarios["chatty"] = Scenario(output=b"x" * (800 << 10))  # one event, 1.07 MB in base64
        with pytest.raises(TransportError) as caught:
            await remote(hostile, tmp_path, "chatty")
    said = str(caught.value)
    assert said.startswith("evil: "), said  # the host
    assert "the agent sent an output event longer than 1 MiB, the protocol's limit" in said


class Chunks:
    """A stream of ``size`` bytes of one line, CHUNK at a time."""

    def __init__(self, size: int) -> None:
        self.left = size

    async def read(self, n: int) -> bytes:
        if self.left <= 0:
            return b""
        if self.left <= n:
            self.left = 0
            return b"x" * 7 + b"\n"
        self.left -= n
        return b"x" * n


def test_a_long_line_is_held_about_twice_while_it_is_read() -> None:
    """The buffer and the line handed on; the old reader copied it once more on the way."""
    size = 12 << 20
    tracemalloc.start()
    try:
        line = asyncio.run(BoundedLines(Chunks(size)).readline())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(line) > size - CHUNK
    assert peak < 2.5 * size, peak / size


def test_a_real_agents_largest_messages_stay_under_the_limits() -> None:
    output = P.Output(job="j" * 200, fd=1, data=base64.b64encode(b"\xff" * (256 << 10)).decode())
    assert len(output.encode()) < P.MAX_OUTPUT_LINE
    files = [P.Blob(name="d/" * 100 + str(i), data=base64.b64encode(b"\xff" * 1000).decode())
             for i in range(bulk.BATCH_BYTES // 1000)]
    assert len(P.Fetched(id=1, files=files).encode()) < P.MAX_LINE
    # --max-result-files' default (100,000) of 100-character paths
    entries = [P.ManifestEntry(path="p" * 94 + f"{i:06d}", kind="file", size=10**9, mode=0o644) for i in range(100_000)]
    assert len(P.Exit(job="j", code=0, entries=P.encode_listing(entries)).encode()) < P.MAX_LINE


class Captured:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines.append(data)


def test_the_agent_never_sends_a_line_past_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing that would pass it is refused with the reason (the job's copy back fails, the
    host stays); an exit keeps its status and leaves its listing to be asked for."""
    monkeypatch.setattr(P, "MAX_LINE", 4096)
    agent = Agent(str(tmp_path / "root"), "t1")
    agent.client = sent = Captured()
    entries = P.encode_listing([P.ManifestEntry(path=f"f{i:04d}", kind="file", size=1, mode=0o644) for i in range(500)])
    agent.send(P.ManifestReply(id=3, entries=entries))
    agent.send(P.Exit(job="j", code=0, entries=entries))
    answers: list[Any] = [W.decode_answer(line) for line in sent.lines]
    assert all(len(line) <= 4096 for line in sent.lines)
    assert isinstance(answers[0], P.Error) and answers[0].id == 3
    assert "over the agent protocol's limit" in answers[0].message and "--copy-backwards" in answers[0].message
    assert answers[1] == P.Exit(job="j", code=0)


def test_slurm_output_comes_over_several_replies_within_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = Agent(str(tmp_path / "root"), "t1")
    for n in range(4):
        (Path(agent.root) / "jobs" / f"t1-j{n}.out").write_bytes(b"o" * 3000)
    monkeypatch.setattr(agent_slurm, "DATA_BUDGET", 6000)  # room for two jobs' stdout and stderr
    query = P.SlurmQuery(base=f"{agent.root}/jobs/t1-", chunk=2000,
                         outputs=[P.OutputAt(job=f"j{n}", rest=f"j{n}", out=0, err=0) for n in range(4)])
    chunks, more = agent_slurm.new_output(query, agent.below_root, agent.work.fd)
    assert [(c.job, len(base64.b64decode(c.data))) for c in chunks] == [("j0", 2000), ("j1", 2000)]
    assert more == ["j2", "j3"]  # not full chunks: the coordinator must not take them as the end
