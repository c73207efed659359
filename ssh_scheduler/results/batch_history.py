"""What a batch did, read back from its results folder: every attempt of every job (where, on
which GPUs, from when to when, how it ended), the probes (each GPU's memory and utilization,
ours and others'), the hosts lost and back, the totals.  What ``ssh-scheduler report`` draws.

Two records, both in ``job_results/``: the journal (every run, every job state change:
``results/journal.py``) and the event file (the latest run's events, probes included:
``results/event_log.py``).  The report draws the folder's latest run: from the event file when
it holds that run, else from the journal (a run by an older version, or one run through the
Python API without an :class:`~ssh_scheduler.results.event_log.EventLog`).  Earlier runs only lend
the start of a job the latest run reattached to.  The two are folded by one function: journal
entries are first put in the events' words (:func:`_as_event`).

Both files are untrusted input (a folder may come from anyone): a line that is not JSON is a
write torn by a crash and is skipped, a record of a kind this version does not know is skipped,
and a known record with a field of the wrong type is one :class:`ConfigError` naming the file,
the line and the field.  Nothing here runs or follows anything a record says.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.events import GpuReading
from ssh_scheduler.jobs.job_names import job_name_problem
from ssh_scheduler.results.event_log import EVENTS_NAME, EXIT_EVENT
from ssh_scheduler.results.journal import JOURNAL_NAME, JobState, read_journal
from ssh_scheduler.results.record_fields import Fields

__all__ = ["OUTCOMES", "Attempt", "BatchHistory", "HostChange", "Probe", "err_head", "read_history"]

OUTCOMES = ("finished", "failed", "timed_out", "requeued", "cancelled", "running", "unknown")
"""How an attempt ended: ``timed_out`` (killed by ``--timeout``), ``requeued`` (its host was lost:
it ran again elsewhere), ``running`` (still, when the folder was read), ``unknown`` (no end was
recorded: the coordinator stopped without one, a killed batch)."""

MAX_EVENT_FILE = 1 << 30
"""An event file larger than this is not one ssh_scheduler wrote (a batch of 100,000 jobs on 100
hosts for a day writes well under 200 MiB)."""
ERR_LINES = 12
ERR_BYTES = 4096
"""What :func:`err_head` reads of a failed job's ``.err``."""
SAME_RUN = 5.0
"""Seconds between the journal's and the event file's record of one run's start (the journal's
line is written as the event is published: milliseconds apart)."""


@dataclass(slots=True)
class Attempt:
    """One try of a job on one host: a bar of the timeline."""

    job: str
    host: str
    gpus: tuple[int, ...]
    start: float
    command: str = ""
    end: float | None = None
    outcome: str = "running"
    code: int | None = None
    reason: str = ""
    seconds: float | None = None
    bytes_received: int = 0
    slurm_job: str = ""
    gpu_memory_mb: int = 0
    retried: bool = False
    """It failed and the job was tried again (``--retries``)."""


@dataclass(frozen=True, slots=True)
class Probe:
    t: float
    host: str
    gpus: tuple[GpuReading, ...]


@dataclass(frozen=True, slots=True)
class HostChange:
    t: float
    host: str
    what: str  # down, up, quarantined
    reason: str = ""


@dataclass(slots=True)
class BatchHistory:
    results_dir: Path
    snapshot: float
    """When the folder was read (a running batch's bars end there)."""
    state: str = "finished"
    """``running``, ``finished``, or ``stopped``: its coordinator ended without finishing it."""
    attempts: list[Attempt] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    host_changes: list[HostChange] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    jobs: int | None = None
    began: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    exit_lines: list[str] = field(default_factory=list)
    bytes_sent: int | None = None
    files_sent: int | None = None
    bytes_received: int = 0
    skipped: int = 0
    not_run: dict[str, str] = field(default_factory=dict)
    cancelled_queued: list[str] = field(default_factory=list)
    from_events: bool = False
    """The run was read from the event file (probes and reasons), not the journal alone."""
    outputs: frozenset[str] = frozenset()
    """The ``.out`` and ``.err`` files in the folder (a job silent on a stream has none)."""

    @property
    def last(self) -> float:
        """Where the time axis ends."""
        ends = [a.end for a in self.attempts if a.end is not None]
        found = [*ends, *(p.t for p in self.probes), *(self.began, self.ended)]
        if self.state == "running":
            found.append(self.snapshot)
        return max((t for t in found if t is not None), default=self.snapshot)


def _event_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The event file's records with their line numbers; torn lines (a crash mid-write, the
    line a running batch is writing now) and lines that are not objects are skipped."""
    try:
        with open(path, "rb") as stream:
            if not path.is_file():
                raise ConfigError(f"{plain_text(str(path))} is not a regular file; remove it")
            size = path.stat().st_size
            if size > MAX_EVENT_FILE:
                raise ConfigError(
                    f"{plain_text(str(path))} is {size} bytes, more than ssh_scheduler writes; remove it "
                    f"(the report then draws from the journal alone)"
                )
            for number, line in enumerate(stream, start=1):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield number, record
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot read {plain_text(str(path))}: {exc.strerror or exc}") from None


_JOURNAL_KINDS = {
    JobState.BATCH: "batch_started",
    JobState.PLACED: "job_placed",
    JobState.STARTED: "job_started",
    JobState.FINISHED: "job_finished",
    JobState.FAILED: "job_failed",
    JobState.RETRY: "job_retrying",
    JobState.REQUEUED: "job_requeued",
    JobState.CANCELLED: "job_cancelled",
}


def _as_event(entry: dict[str, Any]) -> dict[str, Any]:
    """A journal entry in the events' words (``bytes`` is ``bytes_received`` there)."""
    record = {k: v for k, v in entry.items() if k != "state"}
    record["event"] = _JOURNAL_KINDS[JobState(entry["state"])]
    if "bytes" in record:
        record["bytes_received"] = record.pop("bytes")
    return record


def read_history(results_dir: Path, *, running: bool, now: float) -> BatchHistory:
    """The latest run of ``results_dir``.  ``running``: its coordinator answers (the caller
    asked it); ``now``: when the folder is read."""
    if not results_dir.is_dir():
        raise ConfigError(f"{plain_text(str(results_dir))} is not a folder (give a batch's results folder, job_results by default)")
    journal = read_journal(results_dir)
    starts = [i for i, entry in enumerate(journal) if entry.get("state") == JobState.BATCH]
    latest_start = starts[-1] if starts else 0
    earlier, latest = journal[:latest_start], journal[latest_start:]
    events_path = results_dir / EVENTS_NAME
    events = list(_event_lines(events_path))
    began = next((r.get("t") for _, r in events if r.get("event") == "batch_started"), None)
    journal_began = latest[0].get("t") if latest and latest[0].get("state") == JobState.BATCH else None
    use_events = isinstance(began, int | float) and (
        not isinstance(journal_began, int | float) or began >= journal_began - SAME_RUN
    )
    if not journal and not use_events:
        raise ConfigError(
            f"{plain_text(str(results_dir))} holds no batch: neither {JOURNAL_NAME} nor {EVENTS_NAME} "
            f"(give the --results-dir a batch ran with)"
        )
    try:
        outputs = frozenset(n for n in os.listdir(results_dir) if n.endswith((".out", ".err")))
    except OSError as exc:
        raise ConfigError(f"cannot list {plain_text(str(results_dir))}: {exc.strerror or exc}") from None
    history = BatchHistory(results_dir, now, from_events=use_events, outputs=outputs)
    fold = Fold(history, _earlier_starts(earlier))
    if use_events:
        for number, record in events:
            fold.record(record, f"{plain_text(str(events_path))} line {number}")
    else:
        where = plain_text(str(results_dir / JOURNAL_NAME))
        for entry in latest:
            fold.record(_as_event(entry), f"{where} (job {show_value(entry.get('job'), 60)})")
    fold.close(running)
    return history


def _earlier_starts(entries: list[dict[str, Any]]) -> dict[str, tuple[float, str]]:
    """Where and when earlier runs last started each job (a reattached job began there)."""
    found: dict[str, tuple[float, str]] = {}
    for entry in entries:
        t = entry.get("t")
        if entry.get("state") in (JobState.PLACED, JobState.STARTED) and isinstance(t, int | float):
            found[str(entry["job"])] = (float(t), str(entry.get("host", "")))
    return found


class Fold:
    """The records of one run, in order, into a :class:`BatchHistory`."""

    def __init__(self, history: BatchHistory, earlier: dict[str, tuple[float, str]]) -> None:
        self.history = history
        self.earlier = earlier
        self.open: dict[str, Attempt] = {}
        self.listed_hosts: dict[str, None] = {}  # the batch's machines, in the order given
        self.seen_hosts: dict[str, None] = {}
        self.finished = False
        self.last_t: float | None = None
        self.kind = ""  # the record being folded
        self.handlers: dict[str, Callable[[Fields, float], None]] = {
            "batch_started": self.batch_started,
            "host_probed": self.host_probed,
            "host_down": lambda f, t: self.host_change(f, t, "down"),
            "host_up": lambda f, t: self.host_change(f, t, "up"),
            "host_quarantined": lambda f, t: self.host_change(f, t, "quarantined"),
            "job_placed": self.job_placed,
            "job_started": self.job_started,
            "job_reattached": self.job_reattached,
            "job_finished": self.job_ended,
            "job_failed": self.job_ended,
            "job_retrying": self.job_ended,
            "job_requeued": self.job_ended,
            "job_cancelled": self.job_ended,
            "job_skipped": self.job_skipped,
            "job_not_run": self.job_not_run,
            "batch_finished": self.batch_finished,
            EXIT_EVENT: self.coordinator_exit,
        }

    def record(self, record: dict[str, Any], where: str) -> None:
        kind = str(record.get("event"))
        handler = self.handlers.get(kind)
        if handler is None:
            return  # the header, paused, notices, or a kind a newer version writes
        fields = Fields(record, where)
        t = fields.number("t")
        self.last_t = t if self.last_t is None else max(self.last_t, t)
        self.kind = kind
        handler(fields, t)

    def host(self, fields: Fields) -> str:
        name = fields.text("host")
        if name:
            self.seen_hosts.setdefault(name, None)
        return name

    def batch_started(self, fields: Fields, t: float) -> None:
        history = self.history
        history.began = t if history.began is None else history.began
        jobs = fields.whole("jobs", None)
        history.jobs = jobs if jobs is None or jobs >= 0 else None
        for name in fields.texts("hosts"):
            self.listed_hosts.setdefault(name, None)

    def host_probed(self, fields: Fields, t: float) -> None:
        self.history.probes.append(Probe(t, self.host(fields), fields.readings()))

    def host_change(self, fields: Fields, t: float, what: str) -> None:
        self.history.host_changes.append(HostChange(t, self.host(fields), what, fields.text("reason")))

    def _new(self, fields: Fields, t: float) -> Attempt:
        job = fields.text("job")
        attempt = Attempt(job, self.host(fields), fields.gpus(), t, command=fields.text("command"))
        self.history.attempts.append(attempt)
        self.open[job] = attempt
        return attempt

    def job_placed(self, fields: Fields, t: float) -> None:
        self._new(fields, t)

    def job_started(self, fields: Fields, t: float) -> None:
        attempt = self.open.get(fields.text("job"))
        if attempt is None or attempt.host != fields.text("host"):
            attempt = self._new(fields, t)
        attempt.start = t  # placed until now: its inputs were on their way
        attempt.gpus = fields.gpus() or attempt.gpus
        attempt.command = fields.text("command") or attempt.command
        attempt.slurm_job = fields.text("slurm_job")
        attempt.gpu_memory_mb = fields.count("gpu_memory_mb")

    def job_reattached(self, fields: Fields, t: float) -> None:
        job = fields.text("job")
        if job in self.open:
            return  # it goes on
        attempt = self._new(fields, t)
        began, host = self.earlier.get(job, (t, ""))
        if host == attempt.host:
            attempt.start = began  # it ran since then, under the coordinator before

    def job_ended(self, fields: Fields, t: float) -> None:
        job = fields.text("job")
        attempt = self.open.pop(job, None)
        kind = self.kind
        if kind == "job_cancelled" and attempt is None:
            self.history.cancelled_queued.append(job)
            return
        if attempt is None:  # its start is not recorded (a journal cut short): from its runtime
            seconds = fields.number("seconds", 0.0)
            attempt = Attempt(job, self.host(fields), (), t - max(seconds, 0.0), command=fields.text("command"))
            self.history.attempts.append(attempt)
        attempt.end = max(t, attempt.start)
        attempt.command = fields.text("command") or attempt.command
        attempt.code = fields.whole("code", None)
        if kind in ("job_finished", "job_failed"):
            attempt.seconds = max(fields.number("seconds", 0.0), 0.0)
            attempt.bytes_received = fields.count("bytes_received")
            self.history.bytes_received += attempt.bytes_received
        if kind == "job_finished":
            attempt.outcome = "finished" if attempt.code in (0, None) else "failed"
        elif kind == "job_failed":
            attempt.outcome = "timed_out" if fields.flag("timed_out") else "failed"
            reason, message = fields.text("reason"), fields.text("message")
            attempt.reason = f"{reason}: {message}" if message and message not in reason else reason
        elif kind == "job_retrying":
            attempt.outcome, attempt.retried = "failed", True
            attempt.reason = f"exit {attempt.code}, tried again" if attempt.code is not None else "tried again"
        elif kind == "job_requeued":
            attempt.outcome, attempt.reason = "requeued", fields.text("reason") or "its host was lost"
        else:
            attempt.outcome, attempt.reason = "cancelled", "cancelled"
        if not attempt.reason and attempt.outcome != "finished":
            attempt.reason = "timed out" if attempt.outcome == "timed_out" else (
                f"exit {attempt.code}" if attempt.code is not None else "no exit status"
            )

    def job_skipped(self, fields: Fields, t: float) -> None:
        self.history.skipped += 1

    def job_not_run(self, fields: Fields, t: float) -> None:
        self.history.not_run[fields.text("job")] = fields.text("reason")

    def batch_finished(self, fields: Fields, t: float) -> None:
        history = self.history
        self.finished = True
        history.ended = t
        history.bytes_sent = fields.count("bytes_sent")
        history.files_sent = fields.count("files_sent")
        history.bytes_received = max(history.bytes_received, fields.count("bytes_received"))
        history.skipped = max(history.skipped, fields.count("skipped"))

    def coordinator_exit(self, fields: Fields, t: float) -> None:
        history = self.history
        self.finished = True
        history.ended = history.ended or t
        history.exit_code = fields.whole("code", None)
        history.exit_lines = fields.texts("lines")

    def close(self, running: bool) -> None:
        """The run as it stands: still running, finished, or stopped without an end."""
        history = self.history
        history.hosts = list({**self.listed_hosts, **self.seen_hosts})
        if running:
            history.state = "running"
            return
        history.state = "finished" if self.finished or not self.open else "stopped"
        end = self.last_t if self.last_t is not None else history.snapshot
        for attempt in self.open.values():
            attempt.outcome, attempt.end = "unknown", max(end, attempt.start)
            attempt.reason = "no end recorded: its coordinator stopped"


def err_head(results_dir: Path, job: str) -> str | None:
    """The first lines of a job's ``.err`` (``None``: it wrote none), read without following a
    link (a planted one must not carry another file into a report that is shared)."""
    if job_name_problem(job) is not None:
        return None  # a crafted name ("../x") names no file of this folder
    try:
        fd = os.open(results_dir / f"{job}.err", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, ERR_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[:ERR_LINES])
