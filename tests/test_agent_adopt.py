"""A spare agent adopting a batch's token (P.Adopt): afterwards it is what an agent started with
that token is -- a coordinator coming back with the token reaches it -- and it refuses whenever
it could not be: a second token, a token that is no plain name, a batch whose socket is there.
Against the shipped agent over stdin, as the hub's spare is started (no token)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.agent.hostguard import AGENTS_DIR
from ssh_scheduler.transport.bootstrap import agent_start


class Agent:
    """One shipped agent over pipes."""

    def __init__(self, root: Path, token: str = "") -> None:
        start = agent_start(sys.executable, str(root), token)
        self.proc = subprocess.Popen(["/bin/sh", "-c", start.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None
        self.proc.stdin.write(start.payload)

    def ask(self, request: W.Request) -> W.Message:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(request.encode())
        self.proc.stdin.flush()
        return W.decode_answer(self.proc.stdout.readline())

    def end(self, *, bye: bool = True) -> None:
        """Its input ended (after a ``bye``): it exits 0."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self.proc.stdin.closed:
            if bye:
                self.proc.stdin.write(P.Bye().encode())
            self.proc.stdin.close()
        try:
            assert self.proc.wait(timeout=60) == 0
        finally:
            self.proc.stdout.close()


@pytest.fixture
def spare(tmp_path: Path) -> Iterator[Agent]:
    agent = Agent(tmp_path / "root")
    try:
        yield agent
    finally:
        if agent.proc.poll() is None or not agent.proc.stdout.closed:  # type: ignore[union-attr]
            agent.end()


def test_an_adopted_token_is_the_batchs_a_returning_coordinator_reaches_this_agent(spare: Agent, tmp_path: Path) -> None:
    first = spare.ask(P.Hello(id=1, lease=60))
    assert isinstance(first, P.HelloReply)
    reply = spare.ask(P.Adopt(id=2, token="batch-a1"))
    assert isinstance(reply, P.AdoptReply) and (reply.ok, reply.why) == (True, "")
    assert (tmp_path / "root" / AGENTS_DIR / "batch-a1.sock").exists()
    # One token for good: a second adoption is refused.
    again = spare.ask(P.Adopt(id=3, token="batch-b2"))
    assert isinstance(again, P.AdoptReply) and not again.ok and "already serves a batch" in again.why
    # A coordinator coming back starts the agent with the token: that start relays to this one,
    # which answers it from then on (one coordinator at a time).
    back = Agent(tmp_path / "root", "batch-a1")
    hello = back.ask(P.Hello(id=1, lease=60))
    assert isinstance(hello, P.HelloReply) and hello.pid == first.pid
    back.end()  # its bye reaches the old agent
    spare.end(bye=False)
    assert not (tmp_path / "root" / AGENTS_DIR / "batch-a1.sock").exists()


def test_an_agent_started_with_a_token_refuses_another(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "root", "batch-c3")
    try:
        assert isinstance(agent.ask(P.Hello(id=1, lease=60)), P.HelloReply)
        reply = agent.ask(P.Adopt(id=2, token="batch-d4"))
        assert isinstance(reply, P.AdoptReply) and not reply.ok
    finally:
        agent.end()


def test_a_token_that_is_no_plain_name_is_refused(spare: Agent, tmp_path: Path) -> None:
    reply = spare.ask(P.Adopt(id=1, token="../x"))
    assert isinstance(reply, P.AdoptReply) and not reply.ok and "not a plain name" in reply.why
    assert not list((tmp_path / "root" / AGENTS_DIR).iterdir())


def test_a_batch_whose_socket_is_there_is_left_to_its_own_agent(spare: Agent, tmp_path: Path) -> None:
    assert isinstance(spare.ask(P.Hello(id=1, lease=60)), P.HelloReply)
    planted = tmp_path / "root" / AGENTS_DIR / "batch-e5.sock"
    planted.write_text("")  # an agent of that batch may run: never taken from its coordinator
    reply = spare.ask(P.Adopt(id=2, token="batch-e5"))
    assert isinstance(reply, P.AdoptReply) and not reply.ok and "socket" in reply.why
    assert planted.read_text() == ""  # left as it was
