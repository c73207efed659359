"""A host session: one transport plus the agent running on that host.

It turns the agent's messages (protocol.py) into awaitable calls (``probe``, ``stage``, ``run``...)
and job events into callbacks.  When the link dies, every pending call and running job resolves with a
``HostLost`` result instead of hanging: a lost host is data the scheduler acts on.

What a host (untrusted, one of hundreds) can make us hold is bounded: one line at a time, of at
most ``P.MAX_LINE`` bytes (``P.MAX_OUTPUT_LINE`` for an ``out`` event); past it, it is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import posixpath
from collections.abc import Callable
from typing import Any, TypeVar

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.agent.boot import REFUSED as AGENT_REFUSED  # how a refusal line begins
from ssh_scheduler.errors import AgentStartError, ConnectionLostError, TransportError
from ssh_scheduler.executors.agent_checks import agent_start_cause, work_root
from ssh_scheduler.executors.job_events import JOB_EVENTS, JobExit, RunningJob
from ssh_scheduler.executors.stage_plan import StagePlan
from ssh_scheduler.transport.base import (
    AgentProcess,
    Transport,
    bounded,
    describe,
    printable,
    stopped,
)

DEFAULT_LEASE = 60.0
R = TypeVar("R", bound=W.Reply)

log = logging.getLogger(__name__)


class HostSession:
    """Talks to one host's agent.  Use as ``async with HostSession(transport) as host:``."""

    def __init__(
        self,
        transport: Transport,
        *,
        lease: float = DEFAULT_LEASE,
        token: str = "",
        first_probe: str | None = None,
        probe_alone: str = "",
        on_hello_sent: Callable[[], None] | None = None,
    ) -> None:
        self.transport = transport
        self.on_hello_sent = on_hello_sent  # the agent is starting: the host's CPU from here on
        self.token = token
        # A probe command sent inside the hello (no round trip of its own); its answer waits in
        # _folded_probe until the first probe() asks for that command.
        self.first_probe = first_probe
        self.probe_alone = probe_alone  # the probes' first argument while no job runs (P.Probe)
        self._folded_probe: tuple[P.Probe, asyncio.Future[W.Message]] | None = None
        # Jobs the agent already had when we (re)attached: {job: {"running": bool, "code": int}}.
        self.agent_jobs: dict[str, dict[str, Any]] = {}
        self.machine = transport.machine
        self.lease = lease
        self.root = ""
        self.agent: AgentProcess | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[W.Message]] = {}
        self._jobs: dict[str, RunningJob] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._write_lock = asyncio.Lock()
        self._outbox: list[bytes] = []
        self._outbox_size = 0  # bytes in _outbox (summing it per send was quadratic in a burst)
        self.lost: str | None = None
        self._refusal = ""  # why the agent refused to start, in its own words
        self._agent_ended = False  # its output ended (not: the link broke, it spoke nonsense)
        self._said: set[str] = set()  # the agent's notices, each said once

    @property
    def name(self) -> str:
        return self.machine.name

    def inside_root(self, path: str) -> bool:
        """Is ``path`` inside this host's work root?  (Everything we upload or fetch must be.)"""
        return bool(self.root) and posixpath.normpath(path).startswith(self.root + "/")

    async def __aenter__(self) -> HostSession:
        self.agent = await self.transport.start_agent(self.token)
        self._tasks.append(asyncio.create_task(self._read_events()))
        request = P.Hello(lease=self.lease)
        if self.first_probe is not None:
            request.probe = P.Probe(cmd=self.first_probe, alone=self.probe_alone)
            self._folded_probe = (request.probe, self._expect(request.probe))
        future = self._expect(request)
        try:
            await self._send(request)
            self._flush()  # now, not on the loop's next turn: the caller may be busy then
            if self.on_hello_sent is not None:
                self.on_hello_sent()
            hello = await self._answer(request, future, P.HelloReply, 30)
        except ConnectionLostError:
            self._calls.pop(request.id or 0, None)
            self._drop_folded_probe()
            if not self._agent_ended and self._tasks:
                # The hello is flushed at once: writing to an agent that already exited (no
                # python3, say) fails before the reader has seen its output end.  Let the
                # reader catch up, so the cause is said rather than "connection lost".
                await asyncio.wait({self._tasks[0]}, timeout=5)
            if self._agent_ended:  # the agent ended before its hello: say why
                status, stderr = await self.agent.exit_details()
                cause = agent_start_cause(status, stderr, self._refusal, self.machine.workdir)
                raise AgentStartError(f"{self.name}: {cause}") from None
            raise
        # Every path we name there (job folders, SFTP uploads and downloads) starts with where
        # the root really is: a path whose every folder only its owner (us, root) can change.
        self.root = work_root(hello.root, hello.real, self.machine.workdir) or ""
        if not self.root:
            await self.close(orderly=False)
            raise ConnectionLostError(
                f"{describe(self.machine)}: the agent reports the work root "
                f"{printable(hello.real or hello.root)}, not the configured workdir "
                f"{printable(self.machine.workdir)}; nothing was sent there"
            )
        if not hello.probing:  # an older agent: the first probe() sends its own request
            self._drop_folded_probe()
        self.agent_jobs = {name: {"running": s.running, "code": s.code} for name, s in hello.jobs.items()}
        self._tasks.append(asyncio.create_task(self._renew_lease()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, *, orderly: bool = True) -> None:
        self._drop_folded_probe()
        if self.agent is not None and self.lost is None and orderly:
            with contextlib.suppress(Exception):
                await self._send(P.Bye())
                self._flush()
        await stopped(*self._tasks)
        self._tasks.clear()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                await bounded(self.agent.close(), 5)
        self._mark_lost("session closed")

    # -- wire -------------------------------------------------------------------------------------
    async def _send(self, message: W.Request) -> None:
        """Queue a request; everything queued in one turn of the event loop leaves in one write
        (one SSH packet instead of one per job when a thousand jobs start at once)."""
        if self.lost is not None or self.agent is None:
            raise ConnectionLostError(f"{describe(self.machine)}: {self.lost or 'not started'}")
        data = message.encode()
        self._outbox.append(data)
        self._outbox_size += len(data)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        if self._outbox_size > 1 << 20:
            self._flush()
            async with self._write_lock:
                await self.agent.drain()

    def _flush(self) -> None:
        if not self._outbox or self.agent is None:
            return
        data = b"".join(self._outbox)
        self._outbox.clear()
        self._outbox_size = 0
        try:
            self.agent.write(data)
        except Exception as exc:  # the channel closed under us: the reader will say why
            self._mark_lost(f"connection lost ({type(exc).__name__}: {exc})")

    def _expect(self, request: W.Request) -> asyncio.Future[W.Message]:
        """Give the request an id and a future its answer resolves (sending is the caller's)."""
        call_id = next(self._ids)
        request.id = call_id
        future: asyncio.Future[W.Message] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        return future

    def _drop_folded_probe(self) -> None:
        if self._folded_probe is not None:
            request, future = self._folded_probe
            self._calls.pop(request.id or 0, None)
            future.cancel()  # never awaited: cancelled, so no "exception never retrieved"
            self._folded_probe = None

    async def call(self, request: W.Request, reply: type[R], timeout: float | None = None) -> R:
        """Send ``request``, wait for its ``reply`` (TransportError when the agent refused it)."""
        future = self._expect(request)
        try:
            await self._send(request)
        except BaseException:
            self._calls.pop(request.id or 0, None)
            raise
        return await self._answer(request, future, reply, timeout)

    async def _answer(
        self, request: W.Request, future: asyncio.Future[W.Message], reply: type[R], timeout: float | None
    ) -> R:
        try:
            answer = await bounded(future, timeout)
        except TimeoutError:
            raise ConnectionLostError(
                f"{describe(self.machine)}: the agent did not answer {request.TAG!r} in {timeout:g} s"
            ) from None
        finally:
            self._calls.pop(request.id or 0, None)
        if isinstance(answer, P.Error):
            raise TransportError(f"{describe(self.machine)}: agent: {printable(answer.message)}")
        if not isinstance(answer, reply):
            raise self._malformed(f"{answer.TAG!r} in answer to {request.TAG!r}")
        return answer

    def _malformed(self, what: object) -> ConnectionLostError:
        """A host must not crash us with a bad answer: its agent is broken (or hostile)."""
        return ConnectionLostError(
            f"{describe(self.machine)}: the agent sent a malformed answer ({printable(what)}); "
            f"is the host's python3 working?"
        )

    async def _read_events(self) -> None:
        assert self.agent is not None
        reason = "the agent exited"
        try:
            while True:
                line = await self.agent.readline()
                if not line:
                    self._agent_ended = True
                    break
                if not line.startswith(b"{"):
                    # e.g. "python3: command not found" from the login shell
                    said = printable(line.decode("utf-8", "replace").strip(), 600)
                    reason = said[:200]
                    if said.startswith(AGENT_REFUSED):  # its cause and fix, in full
                        self._refusal = said.removeprefix(AGENT_REFUSED)
                    continue
                try:
                    message = W.decode_answer(line)
                    if isinstance(message, P.Output) and len(line) > P.MAX_OUTPUT_LINE:
                        reason = (f"the agent sent an output event longer than {P.MAX_OUTPUT_LINE >> 20} MiB, "
                                  f"the protocol's limit; the host is not speaking our protocol")
                        break
                    self._dispatch(message)
                except W.ProtocolError as exc:
                    call = self._calls.get(exc.id) if exc.id is not None else None
                    if call is None or call.done():  # about a job, or about nothing: host lost
                        reason = f"the agent sent a malformed answer ({printable(exc)})"
                        break
                    call.set_exception(self._malformed(exc))  # that call fails, the host stays
        except asyncio.CancelledError:
            reason = "session closed"
            raise
        except ConnectionLostError as exc:  # the reader's own: a line past the limit
            reason = str(exc)
        except Exception as exc:  # the link broke: every waiter learns it now
            reason = f"connection lost ({type(exc).__name__}: {exc})"
        finally:
            self._mark_lost(reason)

    def _dispatch(self, message: W.Message) -> None:
        if isinstance(message, P.Notice):
            self._notice(message)
            return
        if isinstance(message, W.Event):
            running = self._jobs.get(message.job)
            if running is not None:
                JOB_EVENTS[type(message)](running, message)
            return
        call = self._calls.get(message.id) if message.id is not None else None
        if call is not None and not call.done():
            call.set_result(message)
        elif isinstance(message, P.Error) and message.job in self._jobs:
            running = self._jobs[message.job]
            if not running.done.done():
                running.done.set_result(JobExit(127, message=printable(message.message)))

    def _notice(self, notice: P.Notice) -> None:
        """Said once per host and cause (its copy of jobs' output failed), however many jobs."""
        said = printable(notice.message, 500)
        if said not in self._said:
            self._said.add(said)
            log.warning("%s: %s", self.name, said)

    def _mark_lost(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
        for call in self._calls.values():
            if not call.done():
                call.set_exception(ConnectionLostError(f"{describe(self.machine)}: {reason}"))
        for running in self._jobs.values():
            if not running.done.done():
                running.done.set_result(JobExit(None, host_lost=True, message=reason))

    async def _renew_lease(self) -> None:
        # Not a poll: the agent kills our jobs when this heartbeat stops for a whole lease.
        while True:
            await asyncio.sleep(self.lease / 4)
            try:
                await self._send(P.Ping())
            except TransportError:
                return

    # -- requests ---------------------------------------------------------------------------------
    async def probe(self, command: str, timeout: float = 30) -> tuple[str, int, dict[str, Any]]:
        """The command's output and status, and per running job {"pids": [...], "rss_mb": n}."""
        folded = self._folded_probe
        if folded is not None and folded[0].cmd == command:  # sent with the hello: just wait
            self._folded_probe = None
            reply = await self._answer(folded[0], folded[1], P.ProbeReply, timeout)
        else:
            self._drop_folded_probe()
            reply = await self.call(P.Probe(cmd=command, alone=self.probe_alone), P.ProbeReply, timeout)
        own = {name: {"pids": u.pids, "rss_mb": u.rss_mb} for name, u in reply.own.items()}
        return reply.out, reply.rc, own

    async def have(self, keys: list[str], sizes: dict[str, int]) -> list[str]:
        """Which of these cache entries the host lacks."""
        reply = await self.call(P.Have(hashes=keys, sizes=sizes), P.HaveReply, 120)
        return reply.missing

    async def stage(self, jobdir: str, files: list[tuple[str, str]], dirs: list[str]) -> None:
        await self.call(P.Stage(dir=jobdir, files=_staged(files), dirs=dirs), P.Staged, 300)

    async def manifest(self, jobdir: str, paths: list[str] | None) -> object:
        reply = await self.call(P.Manifest(dir=jobdir, paths=paths), P.ManifestReply, 300)
        return reply.entries  # transfer.fetch_back checks it (P.decode_listing)

    async def put(self, files: list[P.Blob]) -> list[str]:
        """Keep small files in the host's cache (bulk.py); returns "key: reason" of each refused."""
        reply = await self.call(P.Put(files=files), P.PutReply, 300)
        return reply.failed

    async def fetch(self, jobdir: str, paths: list[str], limit: int, timeout: float) -> list[P.Blob]:
        """Small result files' bytes (bulk.py); transfer.fetch_back checks every one."""
        reply = await self.call(P.Fetch(dir=jobdir, paths=paths, limit=limit), P.Fetched, timeout)
        return reply.files

    async def sweep(self, prefix: str) -> None:
        """Remove every job folder and output file whose name starts with ``prefix``."""
        await self.call(P.Sweep(prefix=prefix), P.Swept, 60)

    async def remove_soon(self, jobdir: str, job: str | None = None) -> None:
        """Like ``remove`` without waiting for the answer (the agent does them in order)."""
        await self._send(P.Remove(dir=jobdir, job=job))

    async def remove(self, jobdir: str, job: str | None = None) -> None:
        """Delete a job's directory (and, naming the job, its output files and record)."""
        await self.call(P.Remove(dir=jobdir, job=job), P.Removed, 300)

    async def run(
        self,
        job: str,
        command: str,
        *,
        cwd: str,
        env: dict[str, str],
        out_path: str | None,
        err_path: str | None,
        on_output: Callable[[int, bytes], None],
        on_started: Callable[[int], None] = lambda pid: None,
        stage: StagePlan | None = None,
        results: list[str] | bool | None = False,
        max_output: int | None = None,
        warm: P.Warm | None = None,
    ) -> JobExit:
        """Run a job to its end.  Cancelling this kills the job's whole process tree.

        ``stage``: (files, dirs) to link from the cache into ``cwd`` first.  ``results``: list
        what to bring home with the exit (None: what the job created or changed; a list: those
        paths; False: nothing) -- each saves a round trip per job.  ``max_output``: bytes of
        stdout and stderr together; past it the rest is dropped and the job killed.  ``warm``:
        the interpreter the agent may fork it from (a Python call).
        """
        request = P.Run(
            job=job, cmd=command, cwd=cwd, env=env, out=out_path, err=err_path, max_output=max_output, warm=warm,
            stage=None if stage is None else P.Staging(files=_staged(stage.files), dirs=stage.dirs),
            listing=results is not False, listing_paths=results if isinstance(results, list) else None,
        )
        return await self._follow(job, request, on_output, on_started, max_output)

    async def resume(
        self, job: str, offsets: tuple[int, int], on_output: Callable[[int, bytes], None]
    ) -> JobExit:
        """Take up a job the agent kept running while no coordinator was attached: the output
        after ``offsets`` (bytes of stdout, stderr already received) arrives first."""
        request = P.Resume(job=job, offsets=list(offsets))
        return await self._follow(job, request, on_output, lambda pid: None)

    async def _follow(
        self,
        job: str,
        request: W.Request,
        on_output: Callable[[int, bytes], None],
        on_started: Callable[[int], None],
        max_output: int | None = None,
    ) -> JobExit:
        running = RunningJob(on_output, on_started, room=max_output, limit=max_output)

        def over_limit() -> None:
            task = asyncio.create_task(self.kill(job, grace=1.0))
            self._tasks.append(task)

        running.on_limit = over_limit
        self._jobs[job] = running
        try:
            await self._send(request)
            return await asyncio.shield(running.done)
        except ConnectionLostError as exc:
            return JobExit(None, host_lost=True, message=str(exc))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.kill(job, grace=5.0)
                await bounded(asyncio.shield(running.done), 10)
            raise
        finally:
            self._jobs.pop(job, None)

    async def kill(self, job: str, grace: float = 5.0) -> None:
        await self._send(P.Kill(job=job, grace=grace))


def _staged(files: list[tuple[str, str]]) -> list[P.StagedFile]:
    return [P.StagedFile(rel=rel, key=key) for rel, key in files]
