"""Append-only journal of job state changes, in ``job_results/.journal.jsonl``.

Each change is one JSON line written straight to the OS (``write`` + no user-space buffer), so a
killed coordinator loses nothing it recorded; ``fsync`` is grouped (at most once per
``FSYNC_EVERY`` seconds and at close), since a per-event fsync would cap the batch's job rate.
On reading, a torn last line (a crash mid-write) is ignored.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from .events import (
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

JOURNAL_NAME = ".journal.jsonl"
FSYNC_EVERY = 1.0


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
    path = results_dir / JOURNAL_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    entries = []
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue  # a torn line from a crash mid-write
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
