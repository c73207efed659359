"""A host as a place to run jobs: over SSH, or this machine, driven through our agent.

The agent runs each job in its own folder and process group, keeps its output on the host, and
answers over one channel (:mod:`ssh_scheduler.executors.session`); inputs go through the host's
content-addressed cache and results come back checked (:mod:`ssh_scheduler.executors.transfer`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from ssh_scheduler.errors import ConfigError, ProbeError, TransportError
from ssh_scheduler.executors.base import OutputSink, RunRequest, shell_line
from ssh_scheduler.executors.job_events import JobExit
from ssh_scheduler.executors.python_call import call_files, warm_interpreter, work_inputs
from ssh_scheduler.executors.session import DEFAULT_LEASE, HostSession
from ssh_scheduler.executors.stage_plan import StagePlan
from ssh_scheduler.executors.transfer import (
    CopyBackReport,
    CopyLimits,
    HostCache,
    fetch_back,
    prepare_forward,
)
from ssh_scheduler.jobs.forward import ForwardSet
from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.machines.probe import ALONE, PROBE_COMMAND, PROBE_SCRIPT, parse_probe_output
from ssh_scheduler.transport.base import Transport, describe, stopped
from ssh_scheduler.transport.ssh import connect

__all__ = ["AgentExecutor", "open_executor", "probe_only"]

RESTAGE_TRIES = 3
"""Runs of one job whose inputs were sent again because they were gone from the host's cache."""


class AgentExecutor:
    """A host (over SSH, or this machine through :class:`~ssh_scheduler.transport.local.LocalTransport`)
    driven by our agent over one channel."""

    def __init__(self, transport: Transport, session: HostSession) -> None:
        self.machine = transport.machine
        self.transport = transport
        self.session = session
        self.cache = HostCache(session)

    @property
    def name(self) -> str:
        return self.machine.name

    @property
    def lost(self) -> str | None:
        return self.session.lost

    @property
    def agent_jobs(self) -> dict[str, dict[str, Any]]:
        return self.session.agent_jobs

    @property
    def bytes_sent(self) -> int:
        return self.cache.bytes_uploaded

    @property
    def files_sent(self) -> int:
        return self.cache.files_uploaded

    def jobdir(self, token: str, job: str) -> str:
        return f"{self.session.root}/jobs/{token}-{job}"

    async def probe(self) -> tuple[HostState, dict[str, OwnUsage]]:
        text, _rc, own = await self.session.probe(PROBE_SCRIPT)
        state = parse_probe_output(text, ours_ran=bool(own))
        usage = {
            name: OwnUsage(pids=frozenset(int(p) for p in u.get("pids", ())), rss_mb=int(u.get("rss_mb", 0)))
            for name, u in own.items()
        }
        return state, usage

    async def stage(self, forward: ForwardSet) -> StagePlan:
        return await prepare_forward(self.cache, forward)

    async def run(self, request: RunRequest, on_output: OutputSink) -> JobExit:
        # The inputs are in the host's cache and the one run request links them and starts the
        # work: it runs from here, as far as the coordinator can tell (--timeout counts from here).
        try:
            staged = await work_inputs(self.cache, request)  # a Python call's runner and pickle too
        except TransportError as exc:  # as for the job's other inputs (JobRun's staging)
            return JobExit(None, host_lost=True, message=str(exc))
        request.on_started("")
        inputs = (*request.forward.files, *call_files(request))
        for _ in range(RESTAGE_TRIES):
            ended = await self._run(request, staged, on_output)
            if not ended.missing:
                return ended
            # An input went from the host's cache (a job wrote through its link to it and the
            # agent removed the spoiled entry): sent again, and the job staged afresh.
            await self.cache.resend([f for f in inputs if f.key in ended.missing])
        return JobExit(None, message=f"{self.name}: its inputs kept disappearing from the host's cache "
                       f"({ended.message}); is a job rewriting them?")

    async def _run(self, request: RunRequest, staged: StagePlan | None, on_output: OutputSink) -> JobExit:
        jobdir = request.jobdir
        return await self.session.run(
            request.name,
            shell_line(request, self.machine.python),
            cwd=jobdir,
            env=request.env,
            # Output is also kept on the host, so a coordinator that reattaches catches up.
            out_path=f"{jobdir}.out" if request.keep_output else None,
            err_path=f"{jobdir}.err" if request.keep_output else None,
            on_output=on_output,
            stage=staged,
            # The results listing comes with the exit (a round trip saved): of the paths to bring
            # back, or of what the job created or changed.
            results=list(request.copy_backwards or ()) or None,
            max_output=request.limits.max_output_bytes,
            warm=warm_interpreter(request, self.machine.python, dict(self.machine.env)),
        )

    async def resume(self, request: RunRequest, offsets: tuple[int, int], on_output: OutputSink) -> JobExit:
        return await self.session.resume(request.name, offsets, on_output)

    async def kill(self, job: str) -> None:
        await self.session.kill(job)

    async def fetch(
        self, job: str, jobdir: str, dest: Any, paths: tuple[str, ...] | None, limits: CopyLimits, entries: object
    ) -> CopyBackReport:
        return await fetch_back(self.session, jobdir, dest, paths=paths, limits=limits, entries=entries)

    async def remove(self, jobdir: str, job: str | None = None, *, wait: bool = True) -> None:
        if wait:
            await self.session.remove(jobdir, job)
        else:
            await self.session.remove_soon(jobdir, job)

    async def sweep(self, prefix: str) -> None:
        await self.session.sweep(prefix)

    async def close(self) -> None:
        try:
            await self.session.close()
        finally:
            await self.transport.close()


async def open_executor(
    machine: Machine,
    *,
    accept_new: bool = False,
    keepalive: float | None = None,
    lease: float = DEFAULT_LEASE,
    token: str = "",
    probe_first: bool = False,
    on_hello_sent: Callable[[], None] | None = None,
    connecting: AbstractAsyncContextManager[Any] | None = None,
) -> AgentExecutor:
    """Connect, start the agent and open the file channel; raises TransportError (HostKeyError,
    AuthenticationError, AgentStartError...), or ConfigError for a machine we cannot work on.
    ``probe_first``: the agent starts the probe with its hello, so the first :meth:`probe` only
    waits for the answer (for callers that probe at once; others would waste the host's CPU).
    ``on_hello_sent``: called once the agent was started and its hello sent.  ``connecting``:
    held while connecting only (the key exchange and login, what sshd's ``MaxStartups`` counts),
    not while the agent starts."""
    if machine.max_sessions < 2:  # refused before connecting: it could never work
        raise ConfigError(
            f"{machine.name}: max_sessions is {machine.max_sessions}, but a batch needs 2 ssh "
            "sessions per host (its agent and file transfers); fix: set MaxSessions 2 or more in "
            "the host's sshd_config and max_sessions: 2 or more in the machine YAML"
        )
    transport = await _connect(machine, accept_new, keepalive, connecting)
    # The file channel opens while the hello is answered (a round trip, the probe): after the
    # agent's channel, so a MaxSessions 1 host still refuses the file channel, said as such.
    files: asyncio.Task[None] | None = None

    def hello_sent() -> None:
        nonlocal files
        files = asyncio.get_running_loop().create_task(transport.open_file_channel())
        if on_hello_sent is not None:
            on_hello_sent()

    session = HostSession(
        # The agent runs a probe with /bin/sh itself: the script as it is, not PROBE_COMMAND,
        # which wraps it for whatever login shell runs it (a second shell, found on PATH).
        transport, lease=lease, token=token, first_probe=PROBE_SCRIPT if probe_first else None, probe_alone=ALONE,
        on_hello_sent=hello_sent,
    )
    try:
        await session.__aenter__()
        await (files if files is not None else transport.open_file_channel())
    except BaseException:
        if files is not None:  # ended, its outcome taken (the session's failure is said)
            await stopped(files)
        with contextlib.suppress(Exception):
            await session.close()
        with contextlib.suppress(Exception):
            await transport.close()
        raise
    return AgentExecutor(transport, session)


async def probe_only(
    machine: Machine, *, accept_new: bool = False, keepalive: float | None = None,
    connecting: AbstractAsyncContextManager[Any] | None = None,
) -> HostState:
    """One probe without an agent (a dry run needs a plan, not a session); ``connecting`` as for
    :func:`open_executor`."""
    transport = await _connect(machine, accept_new, keepalive, connecting)
    try:
        text = (await transport.exec(PROBE_COMMAND)).stdout.decode(errors="replace")
    finally:
        await transport.close()
    try:
        return parse_probe_output(text)
    except ProbeError as exc:
        raise TransportError(f"{describe(machine)}: probe failed: {exc}") from None


async def _connect(
    machine: Machine, accept_new: bool, keepalive: float | None, connecting: AbstractAsyncContextManager[Any] | None
) -> Transport:
    """A connection to ``machine``, ``connecting`` held only while it is made (the key exchange
    and login: what sshd's ``MaxStartups`` counts)."""
    async with connecting if connecting is not None else contextlib.nullcontext():
        return await connect(machine, accept_new=accept_new, keepalive=keepalive)
