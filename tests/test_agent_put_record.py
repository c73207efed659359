"""The agent's record of checked cache entries (``cache-trusted.json``, the whole cache's) is
written once after a burst of bulk uploads, not after each message: a dataset of 100,000 files
came in 50 messages, and each rewrote the growing record (~300 MB in all, a quarter second of
the agent's CPU each at the end).  Still written before the last message is answered, and
after each message that comes alone.  The agent in this process, its messages captured."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from pathlib import Path

import pytest

from ssh_scheduler.agent import hostguard
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent.main import Agent
from ssh_scheduler.agent.wire import decode_answer


class Said:
    """Stands for the agent's output: the messages it sent, decoded."""

    def __init__(self) -> None:
        self.messages: list[object] = []

    def write(self, data: bytes) -> None:
        self.messages.extend(decode_answer(line) for line in data.splitlines(keepends=True))


def put_request(request_id: int, count: int) -> P.Put:
    blobs = []
    for i in range(count):
        data = f"message {request_id}, file {i}\n".encode()
        blobs.append(P.Blob(name=hashlib.sha256(data).hexdigest() + "-r", data=base64.b64encode(data).decode()))
    return P.Put(id=request_id, files=blobs)


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Agent, Said, list[int]]:
    writes: list[int] = []  # entries in each record written
    save = hostguard.CacheTrust.save

    def counted(trust: hostguard.CacheTrust) -> None:
        if trust.changed:
            writes.append(len(trust.known))
        save(trust)

    monkeypatch.setattr(hostguard.CacheTrust, "save", counted)
    agent = Agent(str(tmp_path / "root"), "t1")
    said = Said()
    agent.client = said
    return agent, said, writes


def record(tmp_path: Path) -> dict[str, object]:
    return json.loads((tmp_path / "root" / hostguard.TRUST_RECORD).read_text())


async def test_a_burst_of_puts_writes_the_record_once_after_the_last(agent: tuple[Agent, Said, list[int]], tmp_path: Path) -> None:
    served, said, writes = agent
    requests = [put_request(i, 50) for i in range(1, 5)]
    await asyncio.gather(*(served.op_put(r) for r in requests))
    assert sorted(m.id for m in said.messages if isinstance(m, P.PutReply) and not m.failed) == [1, 2, 3, 4]
    assert writes == [200]  # without the change: one per message, [50, 100, 150, 200] or so
    assert len(record(tmp_path)) == 200


async def test_a_put_alone_is_recorded_before_it_is_answered(agent: tuple[Agent, Said, list[int]], tmp_path: Path) -> None:
    served, said, writes = agent
    for i in (1, 2):
        await served.op_put(put_request(i, 10))
        assert [m.id for m in said.messages if isinstance(m, P.PutReply)] == list(range(1, i + 1))
        assert len(record(tmp_path)) == 10 * i
    assert writes == [10, 20]
