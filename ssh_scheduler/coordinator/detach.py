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
import functools
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from ssh_scheduler import events
from ssh_scheduler.errors import ConfigError, plain_text
from ssh_scheduler.events import BatchStarted, Event
from ssh_scheduler.results.event_log import EVENTS_NAME, EXIT_EVENT, HEADER_EVENT, EventLog
from ssh_scheduler.results.untrusted import open_untrusted, parse_json

__all__ = [
    "LOG_NAME",
    "CoordinatorSession",
    "coordinator_header",
    "event_from_json",
    "exit_record",
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
            # The batch is not under way yet: it stops, its jobs killed.  One SIGTERM: until it
            # says it is under way the coordinator takes any interrupt as "stop now" (cli/detach.py),
            # and before it set its handlers it dies of it quietly (a SIGINT would be a traceback).
            # Two signals as two Ctrl-C raced a drain with nothing running, which ends the batch
            # as "done" before the second one came.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
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
# The event file is read like any input: ``attach`` may be pointed at a folder someone else wrote.
# A link, a FIFO or a folder at its name, a line beyond MAX_RECORD_BYTES, a first record that is
# not the coordinator's, are one error line (ConfigError); a record whose fields do not have their
# event's types is skipped, never half-built into an event that breaks a printer.

MAX_RECORD_BYTES = 16 << 20
"""The longest line of the event file read (a batch_started of 100,000 hosts fits)."""
HEADER_WAIT = 10.0
"""Seconds an empty event file may stay without its first record (written as it is created)."""
MAX_TEXT = 1 << 20
MAX_ITEMS = 1 << 20
_WHAT = "the event file of a detached batch"


def _header_problem(record: Any) -> str | None:
    if not isinstance(record, dict) or record.get("event") != HEADER_EVENT:
        return "does not start with the coordinator's record"
    pid, host = record.get("pid"), record.get("host")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31):
        return "names no coordinator process"
    if not (isinstance(host, str) and 0 < len(host) <= 255):
        return "names no host"
    return None


def coordinator_header(results_dir: Path) -> dict[str, Any] | None:
    """The event file's first record (which coordinator writes it), if there is a sound one."""
    with contextlib.suppress(OSError, ValueError, ConfigError):
        stream = open_untrusted(results_dir / EVENTS_NAME, _WHAT)
        if stream is None:
            return None
        with stream:
            header = parse_json(stream.readline(MAX_RECORD_BYTES))
        if _header_problem(header) is None:
            return dict(header)
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
    path = results_dir / EVENTS_NAME
    stream = open_untrusted(path, _WHAT)
    if stream is None:
        raise ConfigError(f"{plain_text(path)} is gone: no batch to follow there")
    header: dict[str, Any] | None = None
    pending = b""
    number = 0
    waited_from = time.monotonic()
    with stream:
        while True:
            chunk = stream.read(1 << 16)
            if not chunk:
                if header is None and not pending and time.monotonic() - waited_from > HEADER_WAIT:
                    raise ConfigError(f"{plain_text(path)} stays empty: no coordinator writes it (remove it)")
                if _alive(header):
                    time.sleep(poll)
                    continue
                chunk = stream.read(1 << 16)  # what it wrote just before it ended
                if not chunk:
                    return
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            if len(pending) > MAX_RECORD_BYTES:
                raise ConfigError(f"{plain_text(path)} has a line longer than {MAX_RECORD_BYTES} bytes: not an event file")
            for line in lines:
                number += 1
                try:
                    record = parse_json(line)
                except ValueError:
                    if number == 1:
                        raise ConfigError(f"{plain_text(path)} is not an event file ssh_scheduler wrote (line 1 is not JSON)") from None
                    continue
                if number == 1:
                    problem = _header_problem(record)
                    if problem is not None:
                        raise ConfigError(f"{plain_text(path)} {problem}: not an event file ssh_scheduler wrote")
                    header = record
                if not isinstance(record, dict):
                    continue
                yield record
                if record.get("event") == EXIT_EVENT:
                    return


def exit_record(record: dict[str, Any]) -> tuple[int, list[str]]:
    """The exit status and closing lines of a ``coordinator_exit`` record (1 and none when they
    are not what a coordinator writes)."""
    code, lines = record.get("code"), record.get("lines")
    if not (isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 255):
        code = 1
    if not (isinstance(lines, list) and all(isinstance(line, str) for line in lines)):
        lines = []
    return code, lines[:1000]


def _event_classes() -> dict[str, type[Event]]:
    # By name from the module, not Event.__subclasses__(): ``slots=True`` leaves the class it
    # replaced behind as a second subclass of the same kind.
    found: dict[str, type[Event]] = {}
    for name in events.__all__:
        value = getattr(events, name)
        if isinstance(value, type) and issubclass(value, Event) and value is not Event:
            found[value.kind] = value
    return found


class _Mistyped(Exception):
    """A record's value is not of its field's type."""


def _typed(value: Any, hint: Any) -> Any:
    """``value`` (parsed JSON) as a value of type ``hint``, or :class:`_Mistyped`: text, whole
    numbers, finite numbers, booleans, ``X | None``, tuples (from lists) and frozen dataclasses."""
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mistyped
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            with contextlib.suppress(_Mistyped):
                return _typed(value, option)
        raise _Mistyped
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            raise _Mistyped
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(v, args[0]) for v in value)
        if len(value) != len(args):
            raise _Mistyped
        return tuple(_typed(v, a) for v, a in zip(value, args, strict=True))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 63:
            return value
    elif hint is float:
        if isinstance(value, float) and math.isfinite(value):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 63:
            return float(value)
    elif hint is str:
        if isinstance(value, str) and len(value) <= MAX_TEXT:
            return value
    elif dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, dict):
        return _build(hint, value)
    raise _Mistyped


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, record: dict[str, Any]) -> Any:
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in record:
            values[f.name] = _typed(record[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _Mistyped
    return cls(**values)


def event_from_json(record: dict[str, Any]) -> Event | None:
    """The event a ``--json`` line describes (``None``: a kind this version does not know, or a
    record whose fields are not of the event's types)."""
    cls = _event_classes().get(str(record.get("event")))
    if cls is None:
        return None
    try:
        event: Event = _build(cls, record)
    except (_Mistyped, TypeError, ValueError):
        return None
    return event
