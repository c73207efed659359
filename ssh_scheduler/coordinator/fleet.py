"""``execute_to``: one shell command on every machine at once, like clush and pdsh.

All hosts are contacted concurrently (bounded only by ``max_connections``); each host's fate is
data (a :class:`HostResult`), never an exception: an unreachable, refused or timed-out host is
reported by name and the others carry on.

Output, by default, is every line prefixed with its host name as it arrives (line-buffered per
host and stream; stderr lines go to stderr).  ``gather`` prints each distinct output once under
the folded set of hosts that produced it (like ``clush -b``); ``json`` prints one JSON object per
host.  A summary of exit codes per host set ends the run, on stderr.

Without copy-forwards a command runs on one plain SSH channel in the login directory (no agent).
With copy-forwards the files travel through the content-addressed cache (``transfer``) and the
command runs through the host's agent in a fresh job directory holding them, removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import shlex
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ssh_scheduler import agent
from ssh_scheduler.coordinator.fleet_output import (
    TIMEOUT_EXIT,
    Capture,
    FleetResult,
    HostResult,
    LineSink,
    discard,
    gather_blocks,
    json_line,
    summarize_exit_codes,
)
from ssh_scheduler.errors import ConfigError, SchedulerError
from ssh_scheduler.executors.session import DEFAULT_LEASE, HostSession
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.base import Transport, bounded
from ssh_scheduler.transport.ssh import connect

if TYPE_CHECKING:  # the files path imports them when used: ~35 ms of every plain start
    from ssh_scheduler.jobs.forward import ForwardSet

T = TypeVar("T")

DEFAULT_MAX_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class FleetOptions:
    timeout: float | None = None
    """Seconds the command may run on each host (connecting not included); then it is killed
    and the host reports exit code 124."""
    connect_timeout: float | None = None
    """Overrides every machine's ``connect_timeout``."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Hosts being connected to or running the command at once."""
    accept_new: bool = False
    gather: bool = False
    json: bool = False
    copy_forwards: tuple[str, ...] = ()
    base_dir: Path = Path(".")
    """What relative copy-forward paths are relative to."""
    lease: float = DEFAULT_LEASE


# --- running ---------------------------------------------------------------------------------

# sshd leaves a command running when its channel closes (no pty: no SIGHUP), so closing the
# channel on timeout or Ctrl-C would not stop it: the command runs under a watchdog
# (agent/watchdog.sh) that kills its process group when the channel closes before it ended
# (transport.exec never sends EOF on stdin).  A POSIX shell, whatever the login shell (tcsh,
# fish, dash as sh), parses the one line below; the command runs in ``bash --norc -c`` as
# execute_batch's jobs, /bin/sh only where bash is missing.
KILL_GRACE = 2.0


@functools.cache
def _watchdog() -> str:
    """The watchdog as one line (tcsh refuses a quoted newline): its file's commands, each of
    which ends with ``;`` or ``&``, without the comments."""
    text = (Path(agent.__file__).parent / "watchdog.sh").read_text()
    return " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def killable(command: str, grace: float = KILL_GRACE) -> str:
    """The remote command line that runs ``command`` under the watchdog."""
    return f"exec /bin/sh -c {shlex.quote(_watchdog())} sshs {shlex.quote(command)} {grace:g}"


@dataclass(slots=True)
class _Outcome:
    exit_code: int | None = None
    error: str | None = None
    timed_out: bool = False
    reached: bool = False


async def execute_to(
    machines: Sequence[Machine],
    command: str,
    options: FleetOptions = FleetOptions(),
    *,
    out: LineSink | None = None,
    err: LineSink | None = None,
) -> FleetResult:
    """Run ``command`` on every machine at once; print as ``options`` says to ``out``/``err``
    (default: nowhere); return every host's result.

    Only a problem that concerns the whole run raises (bad options, a copy-forward path that
    does not exist); each host's own failure is in its :class:`HostResult`.
    """
    out = out or discard
    err = err or discard
    if options.max_connections < 1:
        raise ConfigError("--max-connections must be at least 1")
    if options.timeout is not None and options.timeout <= 0:
        raise ConfigError("--timeout must be more than 0 seconds")
    if options.connect_timeout is not None and options.connect_timeout <= 0:
        raise ConfigError("--connect-timeout must be more than 0 seconds")
    if options.connect_timeout is not None:
        machines = [dataclasses.replace(m, connect_timeout=options.connect_timeout) for m in machines]
    forward: ForwardSet | None = None
    if options.copy_forwards:
        from ssh_scheduler.jobs.forward import Hasher, collect_forward
        from ssh_scheduler.jobs.hash_memo import HashMemo, default_path

        hasher = Hasher(HashMemo(default_path()))
        forward = await asyncio.to_thread(collect_forward, options.copy_forwards, options.base_dir, hasher)
        await asyncio.to_thread(hasher.save)  # (execute_to copies forward rarely: not worth a task)
    streaming = not (options.gather or options.json)
    limit = asyncio.Semaphore(options.max_connections)
    start = time.monotonic()

    async def one(machine: Machine) -> HostResult:
        async with limit:
            began = time.monotonic()
            capture = Capture(machine.name, out if streaming else None, err if streaming else None)
            outcome = await _run_host(machine, command, options, forward, capture)
            capture.flush()
        result = HostResult(
            host=machine.name,
            exit_code=outcome.exit_code,
            stdout=bytes(capture.stdout),
            stderr=bytes(capture.stderr),
            seconds=time.monotonic() - began,
            error=outcome.error,
            timed_out=outcome.timed_out,
            reached=outcome.reached,
        )
        if options.json:
            out(json_line(result))
        return result

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(m), name=f"execute_to {m.name}") for m in machines]
    results = tuple(task.result() for task in tasks)

    if options.gather:
        for line in gather_blocks(results, "stdout"):
            out(line)
        for line in gather_blocks(results, "stderr"):
            err(line)
    for line in summarize_exit_codes(results):
        err(line)
    return FleetResult(results, time.monotonic() - start)


async def _run_host(
    machine: Machine,
    command: str,
    options: FleetOptions,
    forward: ForwardSet | None,
    capture: Capture,
) -> _Outcome:
    outcome = _Outcome()
    transport: Transport | None = None
    try:
        transport = await connect(machine, accept_new=options.accept_new)
        outcome.reached = True
        if forward is None:
            remote = command if machine.is_local else killable(command)
            run = transport.exec(remote, capture.on_stdout, capture.on_stderr)
            outcome.exit_code = (await _bounded(run, options.timeout)).exit_code
        else:
            outcome.exit_code = await _run_with_files(transport, command, options, forward, capture)
    except _TimedOut:
        outcome.exit_code = TIMEOUT_EXIT
        outcome.timed_out = True
        outcome.error = f"killed after {options.timeout:g} s"
    except (_HostLost, SchedulerError) as exc:
        outcome.exit_code = None
        outcome.error = str(exc)
    except Exception as exc:  # a host never stops the others, whatever went wrong there
        outcome.exit_code = None
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        if transport is not None:
            await transport.close()
    return outcome


class _TimedOut(Exception):
    pass


async def _bounded(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``await awaitable``, cancelled after ``seconds`` (raising :class:`_TimedOut`)."""
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            return await awaitable
    except TimeoutError:
        if deadline.expired():
            raise _TimedOut from None
        raise


class _HostLost(Exception):
    pass


async def _run_with_files(
    transport: Transport,
    command: str,
    options: FleetOptions,
    forward: ForwardSet,
    capture: Capture,
) -> int:
    """Send the files into a fresh job directory and run the command there, through the same
    per-job pipeline as a batch job (its folder is removed afterwards, also when cancelled)."""
    from ssh_scheduler.coordinator.jobrun import JobRun, job_environment
    from ssh_scheduler.executors.base import RunRequest, ShellCommand
    from ssh_scheduler.executors.host import AgentExecutor

    async with HostSession(transport, lease=options.lease) as session:
        executor = AgentExecutor(transport, session)
        name = f"execute_to.{secrets.token_hex(4)}"
        request = RunRequest(
            name=name, work=ShellCommand(command), jobdir=executor.jobdir("fleet", name),
            env=job_environment(name, None), timeout=options.timeout, forward=forward, copy_backwards=(),
        )
        run = JobRun(executor, request, capture, Path("."))
        ended = await run.run()
        if session.lost is None:
            with contextlib.suppress(Exception):
                await bounded(run.discard(), 30)
    if ended.timed_out:
        raise _TimedOut
    if ended.host_lost or ended.code is None:
        raise _HostLost(ended.message or "connection lost while the command ran")
    return ended.code


# --- command line ----------------------------------------------------------------------------

_SWALLOWING = {
    "--machines": "machines",
    "--exclude-hosts": "exclude",
    "-x": "exclude",
    "--copy-forwards": "copy_forwards",
}


def take_trailing_command(
    machines: list[str], exclude: list[str], copy_forwards: list[str], argv: Sequence[str]
) -> str | None:
    """``execute_to --machines a b 'cmd'``: the multi-value flags swallow the command as their
    last value (cli.expand_multi_value).  Take it back from the list of the flag written last in
    ``argv`` (removing it there); when ``argv`` does not tell, from the only candidate list.
    Returns None when no list can have it."""
    lists = {"machines": machines, "exclude": exclude, "copy_forwards": copy_forwards}

    def usable(key: str) -> bool:
        return len(lists[key]) >= (2 if key == "machines" else 1)

    owner: str | None = None
    for token in argv:
        if token == "--":
            break
        if token in _SWALLOWING:
            owner = _SWALLOWING[token]
    if owner is None or not usable(owner):
        candidates = [key for key in lists if usable(key)]
        owner = candidates[0] if len(candidates) == 1 else None
    if owner is None:
        return None
    return lists[owner].pop()
