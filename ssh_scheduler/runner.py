"""A host session: one transport plus the agent running on that host.

It turns the agent's JSON lines into awaitable calls (``probe``, ``stage``, ``run``...) and job
events into callbacks.  When the link dies, every pending call and running job resolves with a
``HostLost`` result instead of hanging: a lost host is data the scheduler acts on.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import ConnectionLostError, TransportError
from .transport import AgentProcess, Transport, describe, printable

DEFAULT_LEASE = 60.0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class JobExit:
    """How a job ended: ``code`` is its exit status (128+n for signal n), or None when the host
    was lost before the job's end could be seen."""

    code: int | None
    host_lost: bool = False
    message: str | None = None
    entries: list[Any] | None = None  # the results listing, when the run asked for one


@dataclass(slots=True)
class _RunningJob:
    on_output: Callable[[int, bytes], None]
    on_started: Callable[[int], None]
    done: asyncio.Future[JobExit] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class HostSession:
    """Talks to one host's agent.  Use as ``async with HostSession(transport) as host:``."""

    def __init__(self, transport: Transport, *, lease: float = DEFAULT_LEASE, token: str = "") -> None:
        self.transport = transport
        self.token = token
        # Jobs the agent already had when we (re)attached: {job: {"running": bool, "code": int}}.
        self.agent_jobs: dict[str, dict[str, Any]] = {}
        self.machine = transport.machine
        self.lease = lease
        self.root = ""
        self.agent: AgentProcess | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._jobs: dict[str, _RunningJob] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._write_lock = asyncio.Lock()
        self._outbox: list[bytes] = []
        self.lost: str | None = None

    @property
    def name(self) -> str:
        return self.machine.name

    async def __aenter__(self) -> HostSession:
        self.agent = await self.transport.start_agent(self.token)
        self._tasks.append(asyncio.create_task(self._read_events()))
        hello = await self._call({"op": "hello", "lease": self.lease}, timeout=30)
        self.root = self._field(hello, "root", str)
        self.agent_jobs = self._field(hello, "jobs", dict) if hello.get("jobs") else {}
        self._tasks.append(asyncio.create_task(self._renew_lease()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, *, orderly: bool = True) -> None:
        if self.agent is not None and self.lost is None and orderly:
            with contextlib.suppress(Exception):
                await self._send({"op": "bye"})
                self._flush()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.agent.close(), 5)
        self._mark_lost("session closed")

    # -- wire -------------------------------------------------------------------------------------
    async def _send(self, obj: dict[str, Any]) -> None:
        """Queue a request; everything queued in one turn of the event loop leaves in one write
        (one SSH packet instead of one per job when a thousand jobs start at once)."""
        if self.lost is not None or self.agent is None:
            raise ConnectionLostError(f"{describe(self.machine)}: {self.lost or 'not started'}")
        self._outbox.append((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        if self._outbox_bytes() > 1 << 20:
            self._flush()
            async with self._write_lock:
                await self.agent.drain()

    def _outbox_bytes(self) -> int:
        return sum(len(chunk) for chunk in self._outbox) if len(self._outbox) > 64 else 0

    def _flush(self) -> None:
        if not self._outbox or self.agent is None:
            return
        data = b"".join(self._outbox)
        self._outbox.clear()
        try:
            self.agent.write(data)
        except Exception as exc:  # the channel closed under us: the reader will say why
            self._mark_lost(f"connection lost ({type(exc).__name__}: {exc})")

    async def _call(self, obj: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        call_id = next(self._ids)
        obj["id"] = call_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(obj)
            reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise ConnectionLostError(
                f"{describe(self.machine)}: the agent did not answer {obj['op']!r} in {timeout:g} s"
            ) from None
        finally:
            self._calls.pop(call_id, None)
        if reply.get("ev") == "error":
            raise TransportError(f"{describe(self.machine)}: agent: {printable(reply.get('message'))}")
        return reply

    def _field(self, reply: dict[str, Any], key: str, kind: type[T]) -> T:
        """A field of an agent's reply, checked: a host must not crash us with a bad answer."""
        value = reply.get(key)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise ConnectionLostError(
                f"{describe(self.machine)}: the agent sent a malformed reply ({key!r} is not a "
                f"{kind.__name__}); is the host's python3 working?"
            )
        return value

    async def _read_events(self) -> None:
        assert self.agent is not None
        reason = "the agent exited"
        try:
            while True:
                line = await self.agent.readline()
                if not line:
                    break
                if not line.startswith(b"{"):
                    # e.g. "python3: command not found" from the login shell
                    reason = line.decode("utf-8", "replace").strip()[:200]
                    continue
                self._dispatch(json.loads(line))
        except asyncio.CancelledError:
            reason = "session closed"
            raise
        except Exception as exc:  # the link broke: every waiter learns it now
            reason = f"connection lost ({type(exc).__name__}: {exc})"
        finally:
            self._mark_lost(reason)

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("ev")
        job = event.get("job")
        if kind in ("out", "started", "exit") and job is not None:
            running = self._jobs.get(job)
            if running is None:
                return
            if kind == "out":
                running.on_output(int(event["fd"]), base64.b64decode(event["data"]))
            elif kind == "started":
                running.on_started(int(event["pid"]))
            elif not running.done.done():
                code = event.get("code")
                if code is None:  # staging failed, or the agent does not know the job
                    running.done.set_result(
                        JobExit(None, host_lost=True, message=printable(event.get("message")))
                    )
                else:
                    entries = event.get("entries")
                    running.done.set_result(
                        JobExit(int(code), message=printable(event.get("message")), entries=entries)
                    )
            return
        call = self._calls.get(event.get("id", -1))
        if call is not None and not call.done():
            call.set_result(event)
        elif kind == "error" and job is not None and job in self._jobs:
            running = self._jobs[job]
            if not running.done.done():
                running.done.set_result(JobExit(127, message=printable(event.get("message"))))

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
                await self._send({"op": "ping"})
            except TransportError:
                return

    # -- requests ---------------------------------------------------------------------------------
    async def probe(self, command: str, timeout: float = 30) -> tuple[str, int, dict[str, Any]]:
        reply = await self._call({"op": "probe", "cmd": command}, timeout)
        own = self._field(reply, "own", dict) if reply.get("own") else {}
        return self._field(reply, "out", str), self._field(reply, "rc", int), own

    async def have(self, keys: list[str], sizes: dict[str, int]) -> Any:
        reply = await self._call({"op": "have", "hashes": keys, "sizes": sizes}, 120)
        return reply.get("missing")  # transfer.HostCache checks what the host sent

    async def stage(self, jobdir: str, files: list[tuple[str, str]], dirs: list[str]) -> None:
        await self._call({"op": "stage", "dir": jobdir, "files": files, "dirs": dirs}, 300)

    async def manifest(self, jobdir: str, paths: list[str] | None) -> Any:
        reply = await self._call({"op": "manifest", "dir": jobdir, "paths": paths}, 300)
        return reply.get("entries")  # transfer.fetch_back checks what the host sent

    async def sweep(self, prefix: str) -> None:
        """Remove every job folder and output file whose name starts with ``prefix``."""
        await self._call({"op": "sweep", "prefix": prefix}, 60)

    async def remove_soon(self, jobdir: str, job: str | None = None) -> None:
        """Like ``remove`` without waiting for the answer (the agent does them in order)."""
        await self._send({"op": "remove", "dir": jobdir, "job": job})

    async def remove(self, jobdir: str, job: str | None = None) -> None:
        """Delete a job's directory (and, naming the job, its output files and record)."""
        await self._call({"op": "remove", "dir": jobdir, "job": job}, 300)

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
        stage: tuple[list[tuple[str, str]], list[str]] | None = None,
        results: list[str] | bool | None = False,
    ) -> JobExit:
        """Run a job to its end.  Cancelling this kills the job's whole process tree.

        ``stage``: (files, dirs) to link from the cache into ``cwd`` first.  ``results``: list
        what to bring home with the exit (None: what the job created or changed; a list: those
        paths; False: nothing) -- each saves a round trip per job.
        """
        request: dict[str, Any] = {
            "op": "run", "job": job, "cmd": command, "cwd": cwd, "env": env,
            "out": out_path, "err": err_path,
        }
        if stage is not None:
            request["stage"] = {"files": stage[0], "dirs": stage[1]}
        if results is not False:
            request["manifest"] = {"paths": results}
        return await self._follow(job, request, on_output, on_started)

    async def resume(
        self, job: str, offsets: tuple[int, int], on_output: Callable[[int, bytes], None]
    ) -> JobExit:
        """Take up a job the agent kept running while no coordinator was attached: the output
        after ``offsets`` (bytes of stdout, stderr already received) arrives first."""
        request = {"op": "resume", "job": job, "offsets": list(offsets)}
        return await self._follow(job, request, on_output, lambda pid: None)

    async def _follow(
        self,
        job: str,
        request: dict[str, Any],
        on_output: Callable[[int, bytes], None],
        on_started: Callable[[int], None],
    ) -> JobExit:
        running = _RunningJob(on_output, on_started)
        self._jobs[job] = running
        try:
            await self._send(request)
            return await asyncio.shield(running.done)
        except ConnectionLostError as exc:
            return JobExit(None, host_lost=True, message=str(exc))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.kill(job, grace=5.0)
                await asyncio.wait_for(asyncio.shield(running.done), 10)
            raise
        finally:
            self._jobs.pop(job, None)

    async def kill(self, job: str, grace: float = 5.0) -> None:
        await self._send({"op": "kill", "job": job, "grace": grace})
