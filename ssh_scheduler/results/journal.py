"""Append-only journal of job state changes, in ``job_results/.journal.jsonl``.

Each change is one JSON line written straight to the OS (``write`` + no user-space buffer), so a
killed coordinator loses nothing it recorded; ``fsync`` is grouped (at most once per
``FSYNC_EVERY`` seconds and at close), since a per-event fsync would cap the batch's job rate.
On reading, a line that is not JSON is a write torn by a crash and is ignored (a rerun appends
after it, so it need not be the last line).  A line that *is* JSON is checked like any input
(:func:`entry_problem`): the batch token names files and sockets on the hosts, so a hand-edited
or planted journal must not steer them; a bad entry is one error naming the file and line.

It holds every command, so it is private (0600), opened through the results folder's verified
descriptor and never through a link.  A full disk loses no line: what cannot be written waits
in memory, in order, and the batch hears it once (:class:`Journal`).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConfigError, LocalWriteError, plain_text, show_value
from ssh_scheduler.events import (
    COMPACT_JSON,
    BatchStarted,
    Event,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobPlaced,
    JobRequeued,
    JobRetrying,
    JobStarted,
)
from ssh_scheduler.results.local_folder import local_write_error, open_results_folder, shown_folder
from ssh_scheduler.results.untrusted import parse_json, read_untrusted

log = logging.getLogger(__name__)

JOURNAL_NAME = ".journal.jsonl"
FSYNC_EVERY = 1.0
TOKEN_FORMAT = re.compile(r"[0-9a-f]{16}")
"""A batch token: ``secrets.token_hex(8)``, as the scheduler makes it."""
class JobState(StrEnum):
    """The ``state`` of a journal line (``BATCH`` lines carry the batch token, job ``""``)."""

    BATCH = "batch"
    PLACED = "placed"
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    RETRY = "retry"
    REQUEUED = "requeued"
    CANCELLED = "cancelled"


IN_FLIGHT = frozenset({JobState.PLACED, JobState.STARTED})
"""States an earlier coordinator may have left running on a host."""


KNOWN_STATES = frozenset(state.value for state in JobState)
MAX_GPUS = 256  # entries in one job's GPU list, and the largest index + 1
MAX_TEXT = 100_000  # characters in a recorded command or name
MAX_JOURNAL_BYTES = 1 << 30  # a million jobs' lines, several times over


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _gpu_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_GPUS
        and all(_whole(g) and 0 <= g < MAX_GPUS for g in value)
    )


def _host_name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 255 and value.isprintable()


def _text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT and "\x00" not in value


_FIELD_CHECKS: dict[str, tuple[Any, str]] = {
    "t": (_number, "a time in seconds"),
    "job": (_text, "a job name"),
    "token": (lambda v: isinstance(v, str) and TOKEN_FORMAT.fullmatch(v), "16 lowercase hex digits"),
    "host": (_host_name, "a machine name"),
    "gpus": (_gpu_list, f"a list of GPU indices from 0 to {MAX_GPUS - 1}"),
    "command": (_text, "a command"),
    "code": (lambda v: v is None or _whole(v), "an exit status or null"),
    "timed_out": (lambda v: isinstance(v, bool), "true or false"),
    "seconds": (lambda v: _number(v) and 0 <= v < 1e12, "a duration in seconds"),
    "bytes": (lambda v: _whole(v) and 0 <= v < 1 << 62, "a byte count"),
    "jobs": (lambda v: _whole(v) and 0 <= v < 1 << 62, "a job count"),
    "kept": (_text, "a host and folder"),
}


def entry_problem(entry: object) -> str | None:
    """What is wrong with one parsed journal line, or None."""
    if not isinstance(entry, dict):
        return "is not a JSON object"
    state = entry.get("state")
    if not isinstance(state, str) or state not in KNOWN_STATES:
        return f"has the unknown state {show_value(state, 40)}"
    if not isinstance(entry.get("job"), str):
        return "has no job name"
    if state == "batch" and "token" not in entry:
        return "records a batch without its token"
    for key, value in entry.items():
        check = _FIELD_CHECKS.get(key)
        if check is not None and not check[0](value):
            return f"'{key}' must be {check[1]}, got {show_value(value, 60)}"
    return None


class Journal:
    """The journal, open for appending (:meth:`open`).

    A line that cannot be written (a full disk) is kept in memory and written before the next
    one, and ``on_failure`` hears it once (the batch stops starting jobs): a job's state is never
    silently dropped, nor recorded out of order.  What is still unwritten when the journal
    closes is the batch's failure (:class:`~ssh_scheduler.errors.LocalWriteError`)."""

    def __init__(self, fd: int, shown: Path, on_failure: Callable[[str], None] | None = None) -> None:
        self.fd = fd
        self.shown = shown  # the results folder as the user named it, for messages
        self.on_failure = on_failure
        self._last_sync = time.monotonic()
        self._unwritten: deque[bytes] = deque()
        self._failure: str | None = None  # why the lines in _unwritten are not on disk yet

    @classmethod
    @contextmanager
    def open(
        cls, results_dir: Path, *, folder: int | None = None, on_failure: Callable[[str], None] | None = None
    ) -> Iterator[Journal]:
        """Open ``results_dir``'s journal through ``folder``, its verified descriptor (opened
        here when None).  Private (0600: it holds every command); an older, wider one is made
        private too, and one that is a link or not ours is refused."""
        own_folder = folder is None
        if folder is None:
            folder = open_results_folder(results_dir, create=False)
        try:
            fd = _open_private(folder, results_dir)
        except BaseException:
            if own_folder:
                os.close(folder)
            raise
        journal = cls(fd, results_dir, on_failure)
        try:
            yield journal
        except BaseException:
            journal._close(raise_unwritten=False)
            raise
        else:
            journal._close(raise_unwritten=True)
        finally:
            if own_folder:
                os.close(folder)

    def record(self, job: str, state: JobState | str, **fields: Any) -> None:
        entry = {"t": round(time.time(), 3), "job": job, "state": JobState(state).value, **fields}
        self._unwritten.append((COMPACT_JSON.encode(entry) + "\n").encode())
        self._write()
        now = time.monotonic()
        if not self._unwritten and now - self._last_sync >= FSYNC_EVERY:
            self._sync()
            self._last_sync = now

    def _write(self) -> None:
        """Write what is waiting, in order; a failure keeps the rest for the next try."""
        while self._unwritten:
            data = self._unwritten[0]
            try:
                written = os.write(self.fd, data)
            except OSError as exc:
                self._failed(exc)
                return
            if written < len(data):  # a short write (the disk filled up mid-line): the rest next
                self._unwritten[0] = data[written:]
            else:
                self._unwritten.popleft()
        if self._failure is not None:
            log.info("%s%s: written again", shown_folder(self.shown), JOURNAL_NAME)
            self._failure = None

    def _sync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        first = self._failure is None
        self._failure = str(local_write_error(exc, self.shown, JOURNAL_NAME))
        if first:
            if self.on_failure is not None:
                self.on_failure(self._failure)
            else:
                log.error("%s; its lines wait in memory", self._failure)

    def _close(self, *, raise_unwritten: bool) -> None:
        try:
            self._write()
            self._sync()
        finally:
            os.close(self.fd)
        if self._unwritten and raise_unwritten:
            raise LocalWriteError(
                f"{self._failure}: {len(self._unwritten)} lines of the journal could not be written; "
                f"a rerun runs those jobs again"
            )


def _open_private(folder: int, results_dir: Path) -> int:
    """The journal's descriptor, appending; created 0600, made 0600 if an older run left it wider."""
    path = plain_text(str(results_dir / JOURNAL_NAME))
    try:
        fd = os.open(JOURNAL_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link; remove it (the journal is never written through a link)") from None
        raise local_write_error(exc, results_dir, JOURNAL_NAME) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(f"{path} is not a file of yours; remove it or use another --results-dir")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


class JournalWriter:
    """The journal as a subscriber of the event stream: one line per job state change."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def __call__(self, event: Event) -> None:
        record = self.journal.record
        match event:
            case BatchStarted():
                record("", JobState.BATCH, token=event.token, jobs=event.jobs)
            case JobPlaced() | JobStarted():
                state = JobState.PLACED if isinstance(event, JobPlaced) else JobState.STARTED
                record(event.job, state, host=event.host, gpus=list(event.gpus), command=event.command)
            case JobFinished():
                record(
                    event.job, JobState.FINISHED, code=event.code, host=event.host, timed_out=False,
                    seconds=round(event.seconds, 3), bytes=event.bytes_received,
                )
            case JobFailed():
                kept = {"kept": event.kept} if event.kept else {}
                record(
                    event.job, JobState.FAILED, code=event.code, host=event.host, timed_out=event.timed_out,
                    seconds=round(event.seconds, 3), bytes=event.bytes_received, **kept,
                )
            case JobRetrying():
                record(event.job, JobState.RETRY, host=event.host, code=event.code)
            case JobRequeued():
                record(event.job, JobState.REQUEUED, host=event.host)
            case JobCancelled():
                # A job cancelled while queued had no host: say none rather than an empty name.
                record(event.job, JobState.CANCELLED, **({"host": event.host} if event.host else {}))


def read_journal(results_dir: Path) -> list[dict[str, Any]]:
    """Every entry, checked; ``[]`` when there is no journal.  Whatever stands at its name (a
    link, a FIFO, a folder, a file beyond :data:`MAX_JOURNAL_BYTES`) is one error line."""
    path = results_dir / JOURNAL_NAME
    data = read_untrusted(path, "the batch journal", MAX_JOURNAL_BYTES)
    if data is None:
        return []
    entries = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line:
            continue
        try:
            entry = parse_json(line)
        except ValueError:
            continue  # a torn line from a crash mid-write
        problem = entry_problem(entry)
        if problem is not None:
            raise ConfigError(
                f"{plain_text(str(path))} line {number} {problem}; the journal is not as "
                f"ssh_scheduler wrote it: fix or delete that line, or use another --results-dir"
            )
        entries.append(entry)
    return entries


def last_states(results_dir: Path) -> dict[str, dict[str, Any]]:
    """Each job's entries folded in order: the latest ``state``, and every other field as last
    recorded (so a final ``failed`` entry still carries the command its ``started`` entry had)."""
    states: dict[str, dict[str, Any]] = {}
    for entry in read_journal(results_dir):
        name = str(entry.get("job"))
        states[name] = {**states.get(name, {}), **entry}
    return states


def batch_token(results_dir: Path) -> str | None:
    """The token of the batch an earlier run recorded here: hosts' agents and job folders are
    named by it, so a rerun finds (and reattaches to) what that run left running."""
    for entry in read_journal(results_dir):
        if entry.get("state") == JobState.BATCH and entry.get("token"):
            return str(entry["token"])
    return None
