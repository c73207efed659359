"""The hub's parts without a cluster: what crosses its socket, what "the same connection" means,
its private folder, the keep_warm settings, and how it keeps an agent between two clients (a
scripted agent stands in for the host's)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import random
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.errors import AuthenticationError, ConfigError, ConnectionLostError, HostKeyError
from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.machines.machine import Machine, with_keep_warm
from ssh_scheduler.machines.slurm import SlurmSettings
from ssh_scheduler.transport import hub_agent, hub_client, hub_pool
from ssh_scheduler.transport.base import AgentProcess, SizeLimitExceeded
from ssh_scheduler.transport.hub_agent import AgentLink
from ssh_scheduler.transport.hub_ask import hub_status
from ssh_scheduler.transport.hub_client import (
    HubTransport,
    keep_warm_of,
    open_via_hub,
)
from ssh_scheduler.transport.hub_place import (
    KEEP_WARM_VARIABLE,
    HubUnusable,
    private_folder,
    socket_path,
)
from ssh_scheduler.transport.hub_pool import Held, Pool, identity, key_files
from ssh_scheduler.transport.hub_wire import (
    END,
    OUT,
    error_from_json,
    error_json,
    machine_from_json,
    machine_json,
    read_frame,
)
from ssh_scheduler.transport.lines import BoundedLines

MACHINE = Machine(
    name="gpu1", host="10.0.0.5", port=2222, user="ben", key_paths=("/k/id",), known_hosts=("/k/known",),
    proxy_jump="jump", jump_host=Machine(name="jump", host="10.0.0.1", user="j"), workdir="~/w",
    env=(("A", "1"), ("B", "2")), setup=("module load x",), slurm=SlurmSettings(partition="gpu", sbatch_args=("-x",)),
    keep_warm=12.5, source="m.yaml",
)


# --- what crosses the socket --------------------------------------------------------------------


def test_a_machine_crosses_the_socket_unchanged() -> None:
    assert machine_from_json(json.loads(json.dumps(machine_json(MACHINE)))) == MACHINE
    plain = Machine(name="h", host="h")
    assert machine_from_json(json.loads(json.dumps(machine_json(plain)))) == plain


def test_an_error_crosses_the_socket_as_the_same_class_and_line() -> None:
    for exc in (HostKeyError("h1: HOST KEY CHANGED: ..."), AuthenticationError("denied"), SizeLimitExceeded("/x", 5)):
        again = error_from_json(json.loads(json.dumps(error_json(exc))))
        assert type(again) is type(exc) and str(again) == str(exc)
    # Writing a download here failed (a full disk): the caller must tell it from the host's fault.
    full = error_from_json(json.loads(json.dumps(error_json(OSError(errno.ENOSPC, "No space left on device")))))
    assert type(full) is OSError and (full.errno, full.strerror) == (errno.ENOSPC, "No space left on device")
    other = error_from_json(error_json(RuntimeError("boom")))  # not ours: a lost connection
    assert isinstance(other, ConnectionLostError) and "boom" in str(other)
    assert isinstance(error_from_json("nonsense"), ConnectionLostError)


# --- the same connection --------------------------------------------------------------------------


def test_the_same_connection_is_everything_about_how_it_is_made() -> None:
    key = identity(MACHINE, None)
    # How it is used is not how it is made: another name, work root, environment, setup...
    for used in ({"name": "other"}, {"workdir": "/scratch"}, {"env": ()}, {"setup": ()}, {"slurm": None},
                 {"connect_timeout": 3.0}, {"keep_warm": 0.0}, {"source": "x"}):
        assert identity(dataclasses.replace(MACHINE, **used), None) == key, used
    # ...but any change to how it is made is another connection.
    for made in ({"host": "10.0.0.6"}, {"port": 22}, {"user": "eve"}, {"key_paths": ("/k/other",)},
                 {"known_hosts": ()}, {"proxy_command": "exec nc %h %p"}, {"forward_agent": True},
                 {"legacy_algorithms": True}, {"max_sessions": 2},
                 {"jump_host": Machine(name="jump", host="10.0.0.2", user="j")}):
        assert identity(dataclasses.replace(MACHINE, **made), None) != key, made
    assert identity(MACHINE, 5.0) != key  # another keepalive


def test_a_key_file_edited_or_replaced_is_another_identity(tmp_path: Path) -> None:
    key = tmp_path / "id"
    key.write_text("one")
    machine = Machine(name="h", host="h", key_paths=(str(key),))
    before = key_files(machine)
    assert key_files(machine) == before
    replacement = tmp_path / "id.new"
    replacement.write_text("one")  # the same bytes, another file (what an editor's save does)
    os.replace(replacement, key)
    assert key_files(machine) != before
    now = key_files(machine)
    key.unlink()
    assert key_files(machine) != now  # gone: never "unchanged"


# --- the private folder ---------------------------------------------------------------------------


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Not tmp_path: a test binds its own socket in the folder, and under a pytest-xdist worker
    # tmp_path is long enough to pass the 107 bytes a unix socket's path may have.
    folder = Path(tempfile.mkdtemp(prefix="sshs-hub-"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    yield folder / "ssh_scheduler"
    shutil.rmtree(folder, ignore_errors=True)


def test_the_folder_is_made_private_and_a_planted_one_is_refused(runtime: Path) -> None:
    assert private_folder(create=True) == runtime
    assert (runtime.stat().st_mode & 0o777) == 0o700
    runtime.chmod(0o755)
    with pytest.raises(HubUnusable, match="open to others"):
        private_folder(create=False)
    runtime.rmdir()
    target = runtime.parent / "elsewhere"
    target.mkdir(mode=0o700)
    runtime.symlink_to(target)
    with pytest.raises(HubUnusable, match="not a folder"):
        private_folder(create=True)
    runtime.unlink()
    if os.getuid() == 0:  # someone else's folder at our name
        runtime.mkdir(mode=0o700)
        os.chown(runtime, 65534, 65534)
        with pytest.raises(HubUnusable, match="belongs to uid 65534"):
            private_folder(create=True)


async def test_no_hub_means_none_and_a_machine_at_keep_warm_0_never_starts_one(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_status() == []
    machine = Machine(name="h", host="192.0.2.1", keep_warm=0.0)
    assert await open_via_hub(machine) is None
    assert not runtime.exists()  # nothing was even looked for
    # A planted folder: no hub is started in it, the caller connects directly.
    runtime.mkdir(mode=0o755)
    assert await open_via_hub(dataclasses.replace(machine, keep_warm=5.0)) is None
    assert list(runtime.iterdir()) == []


@pytest.mark.parametrize("how", ["closes before answering", "ends before accepting"])
async def test_a_hub_that_goes_while_a_client_connects_means_a_direct_connection(runtime: Path, how: str) -> None:
    """The race of a hub's idle exit with a new client: its socket is reached, then nothing."""
    path = socket_path(private_folder(create=True))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(5)
    machine = Machine(name="h", host="192.0.2.1", keep_warm=30.0)
    asking = asyncio.ensure_future(open_via_hub(machine))
    if how == "closes before answering":
        client, _ = await asyncio.get_running_loop().run_in_executor(None, listener.accept)
        client.close()
    else:
        await asyncio.sleep(0.2)  # the request waits in the backlog...
    listener.close()  # ...and the hub is gone
    path.unlink()
    assert await asyncio.wait_for(asking, 30) is None  # (the limit only stops a hung test)


# --- keep_warm: the key, the flag, the variable ----------------------------------------------------


def test_keep_warm_comes_from_the_machine_then_the_variable_then_60(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(KEEP_WARM_VARIABLE, raising=False)
    plain = Machine(name="h", host="h")
    assert keep_warm_of(plain) == 60.0
    monkeypatch.setenv(KEEP_WARM_VARIABLE, "0")
    assert keep_warm_of(plain) == 0.0
    assert keep_warm_of(dataclasses.replace(plain, keep_warm=30.0)) == 30.0  # the machine says
    monkeypatch.setenv(KEEP_WARM_VARIABLE, "soon")
    assert keep_warm_of(plain) == 60.0
    assert "SSH_SCHEDULER_KEEP_WARM=soon is not a number" in caplog.text
    # --keep-warm replaces every machine's own value; not given, each keeps its own.
    assert [m.keep_warm for m in with_keep_warm([plain, MACHINE], 0)] == [0.0, 0.0]
    assert with_keep_warm([MACHINE], None) == [MACHINE]
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--keep-warm must be a number of seconds, 0 or more"):
            with_keep_warm([plain], bad)


@pytest.mark.parametrize(("text", "value"), [("keep_warm: 30", 30.0), ("keep_warm: 0", 0.0), ("keep_warm: 2.5", 2.5), ("", None)])
def test_the_machine_yaml_key(tmp_path: Path, text: str, value: float | None) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(f"ip: 10.0.0.5\n{text}\n")
    assert load_machine(str(path)).keep_warm == value


@pytest.mark.parametrize("bad", ["-5", "yes", "'30'", "[30]"])
def test_a_bad_keep_warm_is_one_line_naming_the_file(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(f"ip: 10.0.0.5\nkeep_warm: {bad}\n")
    with pytest.raises(ConfigError) as err:
        load_machine(str(path))
    assert str(err.value).startswith(f"{path} line 2: 'keep_warm' must be a number of seconds, 0 or more")
    assert "\n" not in str(err.value)


# --- an agent kept between two clients ------------------------------------------------------------


class ScriptedAgent:
    """The agent's channel as the hub sees it: what the hub writes is recorded, what the test
    says the agent answers comes out."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.out: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError("closed")
        self.written += data

    async def drain(self) -> None:
        pass

    def write_eof(self) -> None:
        self.closed = True
        self.out.put_nowait(b"")  # an agent without jobs exits at the end of its input

    async def read(self, n: int) -> bytes:
        return await self.out.get()

    def requests(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in bytes(self.written).splitlines()]

    def process(self) -> AgentProcess:
        async def details() -> tuple[int | None, str]:
            return 0, ""

        return AgentProcess(self, BoundedLines(self), lambda: None, details, lambda: self.write_eof())


@pytest.fixture
async def client_pair() -> AsyncIterator[Any]:
    """A connected pair of streams: the hub's side and the client's."""
    made: list[asyncio.StreamWriter] = []

    async def make() -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        a, b = socket.socketpair()
        hub = await asyncio.open_unix_connection(sock=a)
        client = await asyncio.open_unix_connection(sock=b)
        made.extend((hub[1], client[1]))
        return hub, client

    yield make
    for writer in made:
        writer.close()


def line(message: Any) -> bytes:
    return bytes(message.encode())


async def session(link: AgentLink, make: Any, agent: ScriptedAgent, requests: list[bytes], answers: list[bytes]) -> dict[str, Any]:
    """One client: its requests, the agent's answers, its close; returns the hub's last frame."""
    (hub_r, hub_w), (cli_r, cli_w) = await make()
    served = asyncio.create_task(link.serve(hub_r, hub_w))
    cli_w.write(b"".join(requests))
    await cli_w.drain()
    await asyncio.sleep(0.05)
    for answer in answers:
        agent.out.put_nowait(answer)
    await asyncio.sleep(0.05)
    cli_w.write_eof()
    await asyncio.wait_for(served, 10)
    hub_w.close()  # as the hub does once a request is served
    last: dict[str, Any] = {}
    while True:
        kind, data = await asyncio.wait_for(read_frame(cli_r), 10)
        if kind == END:
            last = json.loads(data)
        elif kind != OUT:
            return last


async def test_an_agent_is_kept_only_when_its_session_ended_cleanly(client_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_agent, "QUIET_WAIT", 0.3)
    agent = ScriptedAgent()
    link = AgentLink(agent.process(), "~/w", keepable=True, on_end=lambda _: None)
    hello = P.Hello(id=1, lease=8.0)
    run = P.Run(job="j1", cmd="true", cwd="/w/j1")
    remove = P.Remove(id=2, dir="/w/j1", job="j1")
    answers = [line(P.HelloReply(id=1, pid=7, root="/w", python="3.11")), line(P.Exit(job="j1", code=0)),
               line(P.Removed(id=2))]
    ended = await session(link, client_pair, agent, [line(hello), line(run), line(remove), line(P.Bye())], answers)
    # Everything answered and the session said bye: kept, and the agent never heard the bye.
    assert ended == {"released": True} and link.kept
    assert [r["op"] for r in agent.requests()] == ["hello", "run", "remove"]

    # The next client takes it over; a request it leaves unanswered means no keeping: the
    # agent is told bye (its session's) and its input ends.
    probe = P.Probe(id=2, cmd="nvidia-smi")
    ended = await session(link, client_pair, agent, [line(P.Hello(id=1, lease=8.0)), line(probe), line(P.Bye())],
                          [line(P.HelloReply(id=1, pid=7, root="/w", python="3.11"))])
    assert not link.kept and agent.closed
    assert [r["op"] for r in agent.requests()][-3:] == ["hello", "probe", "bye"]
    assert ended == {"released": True}  # the client went at once, whatever became of the agent


async def test_a_client_that_vanishes_without_bye_leaves_the_agent_as_a_lost_coordinator(client_pair: Any) -> None:
    agent = ScriptedAgent()
    link = AgentLink(agent.process(), "~/w", keepable=True, on_end=lambda _: None)
    await session(link, client_pair, agent, [line(P.Hello(id=1, lease=8.0))], [line(P.HelloReply(id=1, pid=7, root="/w", python="3.11"))])
    assert not link.kept and agent.closed
    assert [r["op"] for r in agent.requests()] == ["hello"]  # no bye: its jobs keep their lease


async def test_a_batch_s_agent_is_relayed_byte_for_byte_and_never_kept(client_pair: Any) -> None:
    agent = ScriptedAgent()
    link = AgentLink(agent.process(), "~/w", keepable=False, on_end=lambda _: None)
    sent = [line(P.Hello(id=1, lease=8.0)), b'{"op": "not json at all\n', line(P.Bye())]
    await session(link, client_pair, agent, sent, [line(P.HelloReply(id=1, pid=7, root="/w", python="3.11"))])
    assert bytes(agent.written) == b"".join(sent) and not link.kept


def test_lines_come_out_whole_however_the_stream_is_cut() -> None:
    rng = random.Random(5)
    text = b"".join(b"x" * rng.randrange(0, 3000) + b"\n" for _ in range(200)) + b"tail"
    for _ in range(20):
        lines = hub_agent.WholeLines()
        got: list[bytes] = []
        at = 0
        while at < len(text):
            step = rng.randrange(1, 5000)
            got += lines.feed(text[at : at + step])
            at += step
        assert got == text.split(b"\n")[:-1] and lines.pending


def test_an_endless_line_is_never_held() -> None:
    lines = hub_agent.WholeLines(10)
    assert lines.feed(b"abc\n0123456789X") == [b"abc"] and lines.overflowed and not lines.pending
    assert lines.feed(b"\nmore\n") == []  # what follows is relayed, no longer read as lines
    unbounded = hub_agent.WholeLines()
    assert unbounded.feed(b"y" * 100_000) == [] and unbounded.feed(b"\n") == [b"y" * 100_000]


async def test_an_agent_line_past_the_limit_means_the_agent_is_not_kept(client_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_agent, "QUIET_WAIT", 0.3)
    monkeypatch.setattr(P, "MAX_LINE", 1000)
    agent = ScriptedAgent()
    link = AgentLink(agent.process(), "~/w", keepable=True, on_end=lambda _: None)
    hello = line(P.HelloReply(id=1, pid=7, root="/w", python="3.11"))
    ended = await session(link, client_pair, agent, [line(P.Hello(id=1, lease=8.0)), line(P.Bye())], [hello, b"x" * 3000])
    # Everything asked was answered, but the hub stopped reading the agent's lines: not kept,
    # ended as the session asked (bye).
    assert ended == {"status": 0, "stderr": ""}  # the client saw the agent's end, as directly
    assert not link.kept and agent.closed and agent.requests()[-1]["op"] == "bye"


async def test_a_session_going_on_after_bye_reaches_the_agent_whole(client_pair: Any) -> None:
    agent = ScriptedAgent()
    link = AgentLink(agent.process(), "~/w", keepable=True, on_end=lambda _: None)
    (hub_r, hub_w), (_, cli_w) = await client_pair()
    served = asyncio.create_task(link.serve(hub_r, hub_w))
    hello, after, last = line(P.Hello(id=1, lease=8.0)), line(P.Ping()), line(P.Probe(id=3, cmd="true"))
    cli_w.write(hello + line(P.Bye()) + after + last[:7])  # a line cut where the relay turns raw
    await cli_w.drain()
    await asyncio.sleep(0.05)
    cli_w.write(last[7:])
    await cli_w.drain()
    await asyncio.sleep(0.05)
    cli_w.write_eof()
    await asyncio.wait_for(served, 10)
    hub_w.close()
    assert bytes(agent.written) == hello + after + last + line(P.Bye()) and not link.kept


# --- a spare agent adopting a batch's token -----------------------------------------------------


async def answer_adoption(agent: ScriptedAgent, answer: bytes | None) -> None:
    """Once the hub asked for an adoption: the agent's answer (None: it says nothing)."""
    while b'"adopt"' not in agent.written:
        await asyncio.sleep(0.01)
    assert agent.requests()[-1] == {"id": 0, "token": "b1", "op": "adopt"}  # id 0: no client's
    if answer is not None:
        agent.out.put_nowait(answer)


@pytest.mark.parametrize(
    "answer, adopted",
    [
        (line(P.AdoptReply(id=0, ok=True)), True),
        (line(P.AdoptReply(id=0, ok=False, why="holds jobs")), False),
        (line(P.Error(id=0, message="unknown op 'adopt'")), False),  # an agent older than Adopt
        (b"", False),  # the agent ended meanwhile
        (None, False),  # no answer in time
    ],
)
async def test_a_spare_is_the_batchs_only_when_it_says_it_adopted_the_token(
    client_pair: Any, monkeypatch: pytest.MonkeyPatch, answer: bytes | None, adopted: bool
) -> None:
    monkeypatch.setattr(hub_agent, "ADOPT_WAIT", 0.5)
    agent = ScriptedAgent()
    link = AgentLink(agent.process(), "~/w", keepable=True, on_end=lambda _: None)
    assert not link.kept
    link.park()
    assert link.kept
    answering = asyncio.create_task(answer_adoption(agent, answer))
    assert await link.adopt("b1") is adopted
    await answering
    if not adopted:
        return
    # The batch's now: its session is relayed byte for byte and never kept.
    sent = [line(P.Hello(id=1, lease=8.0)), line(P.Bye())]
    before = len(agent.written)
    await session(link, client_pair, agent, sent, [line(P.HelloReply(id=1, pid=7, root="/w", python="3.11"))])
    assert bytes(agent.written[before:]) == b"".join(sent) and not link.kept


class SpareTransport:
    """A connection whose agents are scripted: each start makes a new one."""

    def __init__(self) -> None:
        self.machine = MACHINE
        self.started: list[tuple[str, ScriptedAgent]] = []

    async def start_agent(self, token: str) -> AgentProcess:
        agent = ScriptedAgent()
        self.started.append((token, agent))
        return agent.process()


def pool_holding(transport: SpareTransport) -> tuple[Pool, Held]:
    """A pool with one idle connection over ``transport``."""
    pool = Pool()
    held = Held("k", transport, (), (), "", lent=False)  # type: ignore[arg-type]
    pool.held.append(held)
    return pool, held


async def test_a_refused_spare_is_closed_and_the_batch_gets_an_agent_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_agent, "ADOPT_WAIT", 0.5)
    transport = SpareTransport()
    pool, held = pool_holding(transport)
    pool.start_spare(held)
    link, warm = await pool.agent_for(held, "")  # a token-less session waits for it, and has it
    assert warm and held.agent is link and [t for t, _ in transport.started] == [""]
    spare = transport.started[0][1]

    answering = asyncio.create_task(answer_adoption(spare, line(P.AdoptReply(id=0, ok=False, why="socket"))))
    batch, warm = await pool.agent_for(held, "b1")
    await answering
    assert not warm and batch is not link and spare.closed  # no second agent left beside it
    assert [t for t, _ in transport.started] == ["", "b1"] and held.agent is None


async def test_no_spare_where_the_host_allows_two_sessions() -> None:
    transport = SpareTransport()
    transport.machine = dataclasses.replace(MACHINE, max_sessions=2)  # the agent's and the file channel's
    pool, held = pool_holding(transport)
    pool.start_spare(held)
    assert held.spare is None and transport.started == []
    transport.machine = dataclasses.replace(MACHINE, max_sessions=3)
    pool.start_spare(held)
    assert held.spare is not None and held.describe()["spare_starting"]  # what the benchmark waits out
    await held.spare
    assert held.agent is not None and held.agent.kept and [t for t, _ in transport.started] == [""]
    assert held.describe()["spare_starting"] is False and held.describe()["agent"] is True


class StuckSpareTransport(SpareTransport):
    """A spare's start that never ends (a channel nobody answers); other starts as usual."""

    async def start_agent(self, token: str) -> AgentProcess:
        if not token:
            await asyncio.Event().wait()
        return await super().start_agent(token)


async def test_a_spare_that_never_starts_keeps_no_session_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_pool, "SPARE_WAIT", 0.2)
    transport = StuckSpareTransport()
    pool, held = pool_holding(transport)
    pool.start_spare(held)
    _, warm = await asyncio.wait_for(pool.agent_for(held, "b1"), 10)  # the test's own bound
    assert not warm and [t for t, _ in transport.started] == ["b1"]
    assert held.spare is not None
    held.spare.cancel()


async def test_a_spare_goes_to_one_session_of_two_asking_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_agent, "ADOPT_WAIT", 2.0)
    transport = SpareTransport()
    pool, held = pool_holding(transport)
    pool.start_spare(held)
    assert held.spare is not None
    await held.spare
    spare = transport.started[0][1]
    first, second, _ = await asyncio.gather(
        pool.agent_for(held, "b1"), pool.agent_for(held, "b2"),
        answer_adoption(spare, line(P.AdoptReply(id=0, ok=True))),
    )
    assert first[1] is True and second[1] is False and first[0] is not second[0]
    assert [r["op"] for r in spare.requests()] == ["adopt"]  # asked once: never of two sessions
    assert [t for t, _ in transport.started] == ["", "b2"]


async def test_a_hub_that_never_answers_a_request_for_an_agent_loses_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hub_client, "AGENT_REPLY_TIMEOUT", 0.3)
    asked: list[bytes] = []
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await reader.readline())  # takes the request, and never says a word
        await done.wait()
        writer.close()

    path = tmp_path / "own"
    server = await asyncio.start_unix_server(silent, path=str(path))
    a, b = socket.socketpair()
    lease = await asyncio.open_unix_connection(sock=a)
    transport = HubTransport(MACHINE, path, "lease-1", *lease, warm=True)
    try:
        with pytest.raises(ConnectionLostError, match=r"no answer to agent within 0\.3 s"):
            await asyncio.wait_for(transport.start_agent("b1"), 10)  # the test's own bound
        assert json.loads(asked[0])["op"] == "agent"
    finally:
        done.set()
        await transport.close()
        lease[1].close()
        b.close()
        server.close()
        await server.wait_closed()
