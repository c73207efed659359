"""An agent in the hub: its channel relayed to one client at a time, and kept between clients.

Starting the agent (an SSH session, the login shell, python3, the boot stage) is most of a short
command's cost once the connection is warm, so the hub keeps it, the way mitogen keeps its
interpreters -- but only an agent started without a batch token.  A token is a batch's identity
on the host (its reattachment socket, its jobs' process tags, what a lapsed lease sweeps: see
agent/main.py and agent/relay.py), so a batch always gets an agent of its own, relayed byte for
byte and ended as a direct connection would end it.  The token-less sessions (``execute_remote``,
``execute_to --copy-forwards``) are the short ones where the start counts.

Keeping one between clients follows the agent's model of one coordinator at a time: the hub
reads the session's requests line by line, withholds the client's closing ``bye`` (the agent
would exit), and keeps the agent only when the session ended cleanly and nothing it asked is
still unanswered -- every request with a reply answered, every job it ran ended (its ``exit``
seen) -- so the next client can never receive an earlier client's answer.  Meanwhile the hub
renews the agent's lease (the client's ``hello`` set it), and the next client's ``hello`` takes
the agent over.  A client that vanishes without ``bye`` (killed) leaves the agent as a lost
coordinator does: its channel closed, its jobs kept for the lease and then killed (agent/main.py).

A batch gets the start saved too, without sharing: after a batch the hub starts a spare agent
without a token (hub_pool.py), and the next batch's session has it adopt the batch's token
(:meth:`AgentLink.adopt`, P.Adopt) before the session begins.  The agent then is what one started
with that token is, and ends with the batch.  Only a token-less agent holding no job adopts (every
job an earlier session ran ended and was removed: it was kept); one that finds the batch's socket
there (a coordinator coming back, reaching its old agent) refuses, and a fresh one is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.transport.base import CHUNK, AgentProcess, bounded
from ssh_scheduler.transport.hub_wire import END, OUT, frame, json_frame
from ssh_scheduler.transport.lines import BoundedLines

log = logging.getLogger(__name__)

QUIET_WAIT = 2.0
"""Seconds a session's last answers may take after its ``bye``; still unanswered then, the agent
is closed rather than kept."""
ADOPT_WAIT = 5.0
"""Seconds a spare may take to answer an adoption before it is closed and another started."""
END_WAIT = 5.0
"""Seconds an agent may take to exit after the end of its input (the session's close waits as
long) before its channel is closed under it."""
_PING = P.Ping().encode()
_RUN_TAGS = (P.Run.TAG, P.Resume.TAG)


class AgentLink:
    """One agent process started by the hub, relayed to the client attached now (if any)."""

    def __init__(self, agent: AgentProcess, workdir: str, *, keepable: bool, on_end: Callable[[AgentLink], None]) -> None:
        self.agent = agent
        self.workdir = workdir
        self.keepable = keepable
        self._on_end = on_end
        self.client: asyncio.StreamWriter | None = None
        self.ended = False
        self._pending_ids: set[int] = set()
        self._pending_jobs: set[str] = set()
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._lease = 60.0
        self._pinger: asyncio.Task[None] | None = None
        self._adopted: asyncio.Future[bool] | None = None
        self._reader = asyncio.create_task(self._read_agent(), name="hub agent reader")

    @property
    def kept(self) -> bool:
        """Parked between clients, alive, ready for the next one."""
        return self._pinger is not None and not self.ended

    # -- agent -> client -------------------------------------------------------------------------
    async def _read_agent(self) -> None:
        stdout = self.agent.stdout
        lines = WholeLines(P.MAX_LINE)
        try:
            while True:
                chunk = await stdout.read_chunk() if isinstance(stdout, BoundedLines) else await stdout.readline()
                if not chunk:
                    break
                if self.keepable:
                    for line in lines.feed(chunk):
                        self._answered(line)
                    if lines.overflowed:  # past the protocol's limit: the client loses the host
                        self.keepable = False
                client = self.client
                if client is not None:
                    with contextlib.suppress(ConnectionError, RuntimeError):
                        client.write(frame(OUT, chunk))
                        await client.drain()
        except Exception as exc:  # the channel broke: like an exit, without details
            log.debug("agent output ended: %s", exc)
        self.ended = True
        if self._adopted is not None and not self._adopted.done():
            self._adopted.set_result(False)
        if self._pinger is not None:
            self._pinger.cancel()
        status, stderr = await self.agent.exit_details()
        client = self.client
        if client is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                client.write(json_frame(END, {"status": status, "stderr": stderr}))
                await client.drain()
                client.close()
        self._on_end(self)

    def _answered(self, line: bytes) -> None:
        """Forget what this answer or event settles (parsed only when it can settle something:
        output events, the bulk, carry neither an id nor an exit)."""
        if b'"id"' not in line and b'"exit"' not in line and b'"error"' not in line:
            return
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict):
                adopted = self._adopted
                if adopted is not None and message.get("id") == 0 and message.get("ev") in (P.AdoptReply.TAG, P.Error.TAG):
                    if not adopted.done():
                        adopted.set_result(message.get("ok") is True)
                    return
                if isinstance(message.get("id"), int):
                    self._pending_ids.discard(message["id"])
                if message.get("ev") in (P.Exit.TAG, P.Error.TAG) and message.get("id") is None:
                    self._pending_jobs.discard(str(message.get("job")))
        if not self._pending_ids and not self._pending_jobs:
            self._quiet.set()

    # -- client -> agent -------------------------------------------------------------------------
    def _asked(self, line: bytes) -> bool:
        """Note what this request will be answered with; False for the session's ``bye``."""
        try:
            message = json.loads(line)
        except ValueError:
            return True  # the agent answers nonsense with an error of no id: nothing to wait for
        if not isinstance(message, dict):
            return True
        tag = message.get("op")
        if tag == P.Bye.TAG:
            return False
        request = W.REQUESTS.get(tag) if isinstance(tag, str) else None
        if tag == P.Hello.TAG and isinstance(message.get("lease"), int | float):
            self._lease = float(message["lease"])
            probe = message.get("probe")
            if isinstance(probe, dict) and isinstance(probe.get("id"), int):
                self._pending_ids.add(probe["id"])
        if tag in _RUN_TAGS and isinstance(message.get("job"), str):
            self._pending_jobs.add(message["job"])
        elif request is not None and request.REPLY is not None and isinstance(message.get("id"), int):
            self._pending_ids.add(message["id"])
        if self._pending_ids or self._pending_jobs:
            self._quiet.clear()
        return True

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Relay one client's session until its stream ends; then keep the agent for the next
        client when it may be kept, else close it as a direct connection would."""
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None
        self.client = writer
        said_bye = False
        lines = WholeLines()
        try:
            while not self.ended:
                chunk = await reader.read(CHUNK)
                if not chunk:
                    break
                if not self.keepable:  # relayed as it comes (with a line begun before)
                    self.agent.write(lines.take() + chunk)
                    await self.agent.drain()
                    continue
                forward = []
                for line in lines.feed(chunk):
                    if said_bye:  # a word after bye: not a session we understand, do not keep
                        self.keepable = False
                    if self._asked(line):
                        forward.append(line + b"\n")
                    else:
                        said_bye = True
                if forward:
                    self.agent.write(b"".join(forward))
                    await self.agent.drain()
        except (ConnectionError, OSError) as exc:
            log.debug("agent client went away: %s", exc)
        finally:
            self.client = None
        if said_bye and self.keepable and not lines.pending and not self.ended:
            # The client is done: it goes at once; the agent is kept once its answers are in.
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(json_frame(END, {"released": True}))
                writer.close()
            if await self._settled():
                self._pinger = asyncio.create_task(self._renew_lease(), name="hub agent lease")
                return
        else:
            self.client = writer  # its exit details go to this client
        await self.close(bye=said_bye)

    def park(self) -> None:
        """Keep it for a client to come (a spare, never served): its lease renewed meanwhile."""
        if self._pinger is None and not self.ended:
            self._pinger = asyncio.create_task(self._renew_lease(), name="hub agent lease")

    async def adopt(self, token: str) -> bool:
        """Have this kept agent become batch ``token``'s (P.Adopt, answered under id 0: no
        client is attached, and a client's ids start at 1).  True: it is that batch's now, relayed
        as any batch's agent, never kept again; False: the caller closes it and starts one."""
        if not self.kept or not self.keepable:
            return False
        self._adopted = asyncio.get_running_loop().create_future()
        try:
            self.agent.write(P.Adopt(id=0, token=token).encode())
            await self.agent.drain()
            ok = await bounded(asyncio.shield(self._adopted), ADOPT_WAIT)
        except Exception as exc:  # the channel broke, or no answer in time
            log.debug("a spare agent was not adopted: %s", exc)
            ok = False
        finally:
            self._adopted = None
        if ok:
            self.keepable = False  # relayed byte for byte from now on, and ended with the batch
        return ok

    async def _settled(self) -> bool:
        try:
            await bounded(self._quiet.wait(), QUIET_WAIT)
        except TimeoutError:
            return False
        return not self.ended

    async def _renew_lease(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self._lease / 4))
            try:
                self.agent.write(_PING)
                await self.agent.drain()
            except Exception:
                return

    async def close(self, *, bye: bool = False) -> None:
        """End it as a direct connection does: ``bye`` when the session said it (or the agent
        was kept, with nothing of its own running), the end of its input, a wait for its exit,
        then its channel closed under it (the connection's end, directly)."""
        kept = self._pinger is not None
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None
        with contextlib.suppress(Exception):
            if (bye or kept) and not self.ended:
                self.agent.write(P.Bye().encode())
            self.agent.stdin.write_eof()
        for step in (None, self.agent.abort):
            if step is not None:
                with contextlib.suppress(Exception):
                    step()
            await asyncio.wait({self._reader}, timeout=END_WAIT)
            if self._reader.done():
                return
        self._reader.cancel()


class WholeLines:
    """Whole lines out of a byte stream's chunks (a line may span many: a listing of 10^5
    entries is one line).  With a ``limit`` (the agent's side: a host's endless line is never
    held here, and the client's own reader refuses it, transport/lines.py) a line held past it
    is dropped: ``overflowed``, and no more lines.  The client's side, our own uid's requests,
    has none."""

    def __init__(self, limit: int | None = None) -> None:
        self._buf = bytearray()
        self._limit = limit
        self.overflowed = False

    @property
    def pending(self) -> bool:
        return bool(self._buf)

    def take(self) -> bytes:
        """The part of a line held now, handed over (the stream goes on unparsed)."""
        held, self._buf = bytes(self._buf), bytearray()
        return held

    def feed(self, chunk: bytes) -> list[bytes]:
        if self.overflowed:
            return []
        start = len(self._buf)
        self._buf += chunk
        out = []
        if chunk.find(b"\n") >= 0:
            begin = 0
            while (nl := self._buf.find(b"\n", max(begin, start))) >= 0:
                out.append(bytes(self._buf[begin:nl]))
                begin = start = nl + 1
            del self._buf[:begin]
        if self._limit is not None and len(self._buf) > self._limit:
            self.overflowed = True
            self._buf = bytearray()
        return out
