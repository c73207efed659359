"""Append-only journal of job state changes, in ``job_results/.journal.jsonl``.

Each change is one JSON line written straight to the OS (``write`` + no user-space buffer), so a
killed coordinator loses nothing it recorded; ``fsync`` is grouped (at most once per
``FSYNC_EVERY`` seconds and at close), since a per-event fsync would cap the batch's job rate.
On reading, a line that is not JSON is a write torn by a crash and is ignored (a rerun appends
after it, so it need not be the last line).  A line that *is* JSON is checked like any input
(:func:`entry_problem`): the batch token names files and sockets on the hosts, so a hand-edited
or planted journal must not steer them; a bad entry is one error naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.events import (
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
from ssh_scheduler.results.untrusted import parse_json, read_untrusted

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
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._last_sync = time.monotonic()

    @classmethod
    @contextmanager
    def open(cls, results_dir: Path) -> Iterator[Journal]:
        fd = os.open(
            results_dir / JOURNAL_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644
        )
        journal = cls(fd)
        try:
            yield journal
        finally:
            os.fsync(fd)
            os.close(fd)

    def record(self, job: str, state: JobState | str, **fields: Any) -> None:
        entry = {"t": round(time.time(), 3), "job": job, "state": JobState(state).value, **fields}
        os.write(self.fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())
        now = time.monotonic()
        if now - self._last_sync >= FSYNC_EVERY:
            os.fsync(self.fd)
            self._last_sync = now


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
                record(
                    event.job, JobState.FAILED, code=event.code, host=event.host, timed_out=event.timed_out,
                    seconds=round(event.seconds, 3), bytes=event.bytes_received,
                )
            case JobRetrying():
                record(event.job, JobState.RETRY, host=event.host, code=event.code)
            case JobRequeued():
                record(event.job, JobState.REQUEUED, host=event.host)
            case JobCancelled():
                record(event.job, JobState.CANCELLED, host=event.host)


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
