"""The batch's event file, ``job_results/.events.jsonl``: every event of a run as its ``--json``
line, between a first record ``{"event": "coordinator", "pid", "host", "detached"}`` and a last one
``{"event": "coordinator_exit", "code", "lines"}`` (the exit status and the summary lines).

Every run keeps one, in the foreground (the CLI subscribes an :class:`EventLog`) or detached
(``coordinator/detach.py``'s session writes through one): ``ssh-scheduler attach`` follows it and
``ssh-scheduler report`` draws it.  The journal stays what a rerun trusts; this file is for
seeing, so it is written like the journal (one ``write`` per line, nothing buffered in the
process) but never fsynced, and a write that fails costs the viewers the rest, never the batch.

The file is made when the batch is under way (``BatchStarted``): by then this run holds the
results folder (``results_folder.py``), so the file of another run still going there is never
replaced.  The events before it are kept in memory until then.

Bounded: a few hundred bytes per job, and the probes thinned by :class:`ProbeThinning` (all of a
short batch's, one a minute per host in a long one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from ssh_scheduler.errors import SchedulerError
from ssh_scheduler.events import COMPACT_JSON, EVENT_VERSION, BatchStarted, Event, HostProbed

__all__ = [
    "EVENTS_NAME",
    "EXIT_EVENT",
    "HEADER_EVENT",
    "EventLog",
    "ProbeThinning",
    "events_header",
]

log = logging.getLogger(__name__)

EVENTS_NAME = ".events.jsonl"
HEADER_EVENT = "coordinator"
EXIT_EVENT = "coordinator_exit"
CANCELLED_LINE = "cancelled: running jobs were killed"

PROBE_EVERY = 60.0
"""Seconds between two kept probes of one host, once the batch is old enough."""
PROBE_MIN = 1.0
PROBE_SHARE = 200.0
"""A host's probe is kept when ``min(PROBE_EVERY, max(PROBE_MIN, age / PROBE_SHARE))`` seconds
passed since its last kept one (``age``: since the first probe seen).  A batch of a few minutes
keeps every probe (its GPU plots are not one dot each); the spacing grows with the batch until
it is one a minute: at most about ``PROBE_SHARE * (1 + ln(PROBE_EVERY / PROBE_MIN))`` (~1000)
probes per host more than one a minute would keep."""


class ProbeThinning:
    """Which probes go to the event file (the rest are seen by the planner and the live view
    only)."""

    def __init__(self) -> None:
        self._first: float | None = None
        self._kept: dict[str, float] = {}

    def keep(self, event: HostProbed) -> bool:
        if self._first is None:
            self._first = event.t
        spacing = min(PROBE_EVERY, max(PROBE_MIN, (event.t - self._first) / PROBE_SHARE))
        last = self._kept.get(event.host)
        if last is not None and event.t - last < spacing:
            return False
        self._kept[event.host] = event.t
        return True


def events_header(pid: int, *, detached: bool) -> dict[str, Any]:
    """The file's first record: which coordinator writes it (``attach`` watches that pid), and
    whether it is a detached one (``status`` then points at its log)."""
    return {
        "version": EVENT_VERSION, "event": HEADER_EVENT, "t": round(time.time(), 3), "pid": pid,
        "host": socket.gethostname(), "detached": detached,
    }


def _line(record: dict[str, Any]) -> bytes:
    return (COMPACT_JSON.encode(record) + "\n").encode()


class EventLog:
    """An event subscriber writing the event file of ``results_dir``; a context manager whose
    end writes the exit record: ``end()``'s exit status and lines when the run ended, else the
    error that ended it."""

    def __init__(
        self, results_dir: Path, end: Callable[[], tuple[int, list[str]]] | None = None, *, detached: bool = False
    ) -> None:
        self.results_dir = results_dir
        self.end = end
        self.detached = detached
        self.under_way = False
        self._early: list[bytes] = []
        self._fd: int | None = None
        self._thinning = ProbeThinning()

    def __call__(self, event: Event) -> None:
        if isinstance(event, HostProbed) and not self._thinning.keep(event):
            return
        line = _line(event.to_json())
        if self.under_way:
            self._write(line)
            return
        self._early.append(line)
        if isinstance(event, BatchStarted):
            self._open()

    def _open(self) -> None:
        """Under way: an earlier run's file makes room for this one's, header first."""
        self.under_way = True
        path = self.results_dir / EVENTS_NAME
        early, self._early = self._early, []
        try:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._fd = os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            log.warning("cannot write %s (%s): attach and report will not see this batch", path, exc.strerror or exc)
            return
        self._write(_line(events_header(os.getpid(), detached=self.detached)) + b"".join(early))

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, data)
        except OSError as exc:  # the batch goes on; only its viewers lose the rest
            log.warning("cannot write %s (%s): attach and report will not see the rest of this batch", EVENTS_NAME, exc)
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def finish(self, code: int, lines: list[str]) -> None:
        """The last record: the exit status and the lines the run ended with."""
        if self.under_way:
            record = {"version": EVENT_VERSION, "event": EXIT_EVENT, "t": round(time.time(), 3), "code": code, "lines": lines}
            self._write(_line(record))
        self._close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            code, lines = self.end() if self.end is not None else (0, [])
        elif isinstance(exc, SchedulerError):
            code, lines = exc.exit_code, [f"error: {exc}"]
        elif isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
            code, lines = 130, [CANCELLED_LINE]
        else:
            code, lines = 1, [f"error: the coordinator stopped: {exc!r}"]
        self.finish(code, lines)
