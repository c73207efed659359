"""A job's events from its host's agent, and how the job ended.

:class:`JobExit` is how any run ends (executors/base.py's seam returns it); :class:`RunningJob`
is what a host session follows of one job; :data:`JOB_EVENTS` is what the coordinator does with
each event the agent may send about a job (every Event in agent/protocol.py must be there:
tests/test_protocol.py checks).  Output is held to the job's limit here too, whatever the host
sends.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.transport.base import printable


@dataclass(frozen=True, slots=True)
class JobExit:
    """How a job ended: ``code`` is its exit status (128+n for signal n), or None when the host
    was lost before the job's end could be seen."""

    code: int | None
    host_lost: bool = False
    message: str | None = None
    entries: object = None  # the results listing, when the run asked for one (P.decode_listing)
    missing: tuple[str, ...] = ()  # it never ran: these inputs were gone from the host's cache


@dataclass(slots=True)
class RunningJob:
    """A job the session follows: where its output and start go, its output limit, its end."""

    on_output: Callable[[int, bytes], None]
    on_started: Callable[[int], None]
    on_limit: Callable[[], None] = lambda: None
    room: int | None = None  # bytes of output still accepted (None: no limit)
    limit: int | None = None
    done: asyncio.Future[JobExit] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def _on_output(running: RunningJob, event: P.Output) -> None:
    if event.fd not in (1, 2):
        raise W.ProtocolError(f"'out': fd {event.fd} is neither 1 nor 2 (job {event.job})")
    try:
        data = base64.b64decode(event.data, validate=True)
    except ValueError:
        raise W.ProtocolError(f"'out': data is not base64 (job {event.job})") from None
    if running.room is not None:  # the host is held to the limit too, whatever it sends
        if running.room < 0:
            return
        if len(data) > running.room:
            running.on_output(event.fd, data[: running.room])
            _over_limit(running)
            running.on_limit()
            return
        running.room -= len(data)
    running.on_output(event.fd, data)

def _over_limit(running: RunningJob) -> None:
    running.room = -1  # said once; any later output is dropped
    running.on_output(2, (
        f"\nssh_scheduler: the job's output passed the limit of {running.limit} bytes "
        f"(--max-output-bytes); the job was killed\n").encode())

def _on_started(running: RunningJob, event: P.Started) -> None:
    running.on_started(event.pid)

def _on_exit(running: RunningJob, event: P.Exit) -> None:
    if running.done.done():
        return
    if event.message == P.OUTPUT_LIMIT and running.room is not None and running.room >= 0:
        _over_limit(running)  # the agent stopped it at the limit
    if event.missing:  # inputs gone from its cache: the executor sends them, tries again
        ended = JobExit(None, message=printable(event.message), missing=tuple(event.missing))
    elif event.lost is not None:  # its output is incomplete: whatever its status, not good
        ended = JobExit(None, message=printable(event.lost, 500))
    elif event.code is None:  # staging failed, or the agent does not know the job
        ended = JobExit(None, host_lost=True, message=printable(event.message))
    else:
        ended = JobExit(event.code, message=printable(event.message), entries=event.entries)
    running.done.set_result(ended)

JOB_EVENTS: dict[type[W.Message], Callable[[RunningJob, Any], None]] = {
    P.Output: _on_output,
    P.Started: _on_started,
    P.Exit: _on_exit,
    P.Notice: lambda running, event: None,  # said by the session, once per host rather than per job
}


__all__ = ["JOB_EVENTS", "JobExit", "RunningJob"]
