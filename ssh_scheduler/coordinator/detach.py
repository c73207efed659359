"""A coordinator that outlives the terminal: ``execute_batch --detach``.

The parent re-executes the same command (never a fork of a running event loop) as a child in a
session of its own, stdin from ``/dev/null``, no controlling terminal; the child's command line
names the descriptor of a status pipe (the CLI's hidden ``--detached-status-fd``), which is what
makes it the detached coordinator: its environment is the user's, unchanged.
Until the batch is under way the child's stdout and stderr are an anonymous temporary file the
parent echoes as it grows, so a refusal (bad YAML, unknown host key, a job nothing can fit)
reaches the user's terminal as the one line a foreground run prints, with its exit status.  The
child never holds the user's terminal or a pipe to the parent: a local agent it starts inherits
its stderr, and an SSH session would otherwise wait for that descriptor to close.

"Under way" is the ``BatchStarted`` event: the results folder is locked by the child, the
journal is open, the control socket is served and the hosts are connected.  Then the child moves
its output to ``job_results/.coordinator.log`` (rotated at :data:`LOG_MAX_BYTES`, one old file
kept) and tells the parent, through a pipe, that it may return.  Its events go to the event file
``job_results/.events.jsonl`` every run keeps (``results/event_log.py``), which ends with one
``coordinator_exit`` record with the exit status and the lines a foreground run ends with.
``ssh-scheduler attach`` follows that file (:func:`follow_events`): any number of viewers, a
catch-up from the start, and a finished batch's replay, without ever touching the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from ssh_scheduler import events
from ssh_scheduler.events import BatchStarted, Event, GpuReading, HostProbed
from ssh_scheduler.results.event_log import EVENTS_NAME, EXIT_EVENT, HEADER_EVENT, EventLog

__all__ = [
    "LOG_NAME",
    "CoordinatorSession",
    "coordinator_header",
    "event_from_json",
    "follow_events",
    "start_coordinator",
]

LOG_NAME = ".coordinator.log"
LOG_MAX_BYTES = 8 << 20
READY = b"ready\n"


# --- the parent: start the coordinator and wait until it is under way ------------------------


def start_coordinator(argv: Callable[[int], Sequence[str]], echo: Callable[[bytes], None]) -> tuple[int | None, int]:
    """Run ``argv(status_fd)`` detached: the coordinator's command line, given the descriptor of
    the pipe it writes :data:`READY` to (:meth:`CoordinatorSession.detached`).  ``echo`` gets its
    output until the batch is under way.  Returns (the coordinator's pid, 0) once it is, or
    (None, its exit status) when it ended first."""
    status_read, status_write = os.pipe()
    with tempfile.TemporaryFile() as early:
        proc = subprocess.Popen(
            list(argv(status_write)), stdin=subprocess.DEVNULL, stdout=early, stderr=early,
            pass_fds=(status_write,), start_new_session=True,
        )
        os.close(status_write)
        said = b""
        shown = 0
        try:
            while True:
                readable, _, _ = select.select([status_read], [], [], 0.2)
                shown = _echo_new(early, shown, echo)
                if readable:
                    chunk = os.read(status_read, 64)
                    if not chunk:
                        break
                    said += chunk
        except KeyboardInterrupt:
            # Twice, as two Ctrl-C: the batch that was not yet under way is stopped, jobs killed.
            # Two different signals: two of one kind sent at once may arrive as one.
            for signo in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signo)
            proc.wait()
            _echo_new(early, shown, echo)
            return None, 130
        finally:
            os.close(status_read)
        _echo_new(early, shown, echo)
    if said == READY:
        # The child is no longer ours to wait for: it outlives us (and Popen would warn that it
        # still runs when this object goes away).
        proc.returncode = 0
        return proc.pid, 0
    code = proc.wait()
    return None, code if code >= 0 else 128 - code  # killed by signal n: 128+n, as a shell says


def _echo_new(early: IO[bytes], shown: int, echo: Callable[[bytes], None]) -> int:
    while data := os.pread(early.fileno(), 1 << 20, shown):
        echo(data)
        shown += len(data)
    return shown


# --- the child: the detached coordinator -----------------------------------------------------


class CoordinatorSession:
    """The detached coordinator's side: an event subscriber that writes the event file and, at
    ``BatchStarted`` (once the file is made), moves the output to the log and releases the
    parent."""

    def __init__(self, results_dir: Path, status_fd: int, *, log_max_bytes: int = LOG_MAX_BYTES, out_fds: tuple[int, ...] = (1, 2)) -> None:
        self.results_dir = results_dir
        self.status_fd: int | None = status_fd
        self.log_max_bytes = log_max_bytes
        self.out_fds = out_fds
        self.under_way = False
        self.events = EventLog(results_dir, detached=True)
        os.set_inheritable(status_fd, False)  # jobs and agents must not hold the parent waiting

    @classmethod
    def detached(cls, results_dir: Path, status_fd: int) -> CoordinatorSession:
        """The session of this process, the detached coordinator :func:`start_coordinator` ran
        with ``status_fd``."""
        # Its own session already: the old terminal's hangup is not ours, whoever sends it.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        return cls(results_dir, status_fd)

    # The event subscriber.
    def __call__(self, event: Event) -> None:
        self.events(event)
        if not self.under_way and isinstance(event, BatchStarted):
            self._go()

    def _go(self) -> None:
        """Under way (the event file is made): the log, then the parent may return."""
        self.under_way = True
        self._move_output(copy_early=True)
        if self.status_fd is not None:
            with contextlib.suppress(OSError):  # a parent that is gone has nothing to learn
                os.write(self.status_fd, READY)
            os.close(self.status_fd)
            self.status_fd = None

    def _move_output(self, *, copy_early: bool) -> None:
        """Point stdout and stderr at a fresh log: the first time after copying what was written
        before (the temporary file), later after keeping the full log as ``.1``."""
        path = self.results_dir / LOG_NAME
        _flush_std()
        if path.exists():
            os.replace(path, path.with_name(LOG_NAME + ".1"))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if copy_early:
                offset = 0
                while chunk := os.pread(self.out_fds[0], 1 << 20, offset):
                    os.write(fd, chunk)
                    offset += len(chunk)
            for target in self.out_fds:
                os.dup2(fd, target)
        finally:
            os.close(fd)

    def printer(self, write: Callable[[str], None]) -> Callable[[str], None]:
        """A line printer that keeps the log under its bound."""

        def out(line: str) -> None:
            write(line)
            if self.under_way and os.fstat(self.out_fds[0]).st_size > self.log_max_bytes:
                self._move_output(copy_early=False)

        return out

    def finish(self, code: int, lines: list[str]) -> None:
        """The last record: the exit status and the lines a foreground run would end with."""
        self.events.finish(code, lines)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


# --- the viewers: follow the event file -------------------------------------------------------


def coordinator_header(results_dir: Path) -> dict[str, Any] | None:
    """The event file's first record (which coordinator writes it), if there is one."""
    with contextlib.suppress(OSError, ValueError), open(results_dir / EVENTS_NAME, "rb") as stream:
        header = json.loads(stream.readline())
        if isinstance(header, dict) and header.get("event") == HEADER_EVENT:
            return header
    return None


def _alive(header: dict[str, Any] | None) -> bool:
    """Whether the coordinator that wrote ``header`` still runs (on another host: assumed)."""
    if header is None:
        return True  # the header is written before anything else: not read yet
    if header.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(header["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


def follow_events(results_dir: Path, poll: float = 0.2) -> Iterator[dict[str, Any]]:
    """Every record of the event file from its start, then the new ones as they come, until
    the ``coordinator_exit`` record (yielded) or until its coordinator is gone without one."""
    header: dict[str, Any] | None = None
    pending = b""
    with open(results_dir / EVENTS_NAME, "rb") as stream:
        while True:
            chunk = stream.read(1 << 16)
            if not chunk:
                if _alive(header):
                    time.sleep(poll)
                    continue
                chunk = stream.read(1 << 16)  # what it wrote just before it ended
                if not chunk:
                    return
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                if record.get("event") == HEADER_EVENT:
                    header = record
                yield record
                if record.get("event") == EXIT_EVENT:
                    return


def _event_classes() -> dict[str, type[Event]]:
    # By name from the module, not Event.__subclasses__(): ``slots=True`` leaves the class it
    # replaced behind as a second subclass of the same kind.
    found: dict[str, type[Event]] = {}
    for name in events.__all__:
        value = getattr(events, name)
        if isinstance(value, type) and issubclass(value, Event) and value is not Event:
            found[value.kind] = value
    return found


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def event_from_json(record: dict[str, Any]) -> Event | None:
    """The event a ``--json`` line describes (``None``: a kind this version does not know)."""
    cls = _event_classes().get(str(record.get("event")))
    if cls is None:
        return None
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in record:
            values[f.name] = _tuples(record[f.name])
    if cls is HostProbed:
        values["gpus"] = tuple(GpuReading(**g) for g in record.get("gpus", ()))
    try:
        return cls(**values)
    except TypeError:
        return None
