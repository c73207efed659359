"""The typed event stream: every state change of a batch is one frozen event object.

The planner says them, the coordinator adds the ones only it can see (output bytes, transfer
warnings), and subscribers consume them: the journal (``journal.JournalWriter``), the terminal
lines (``terminal.TerminalLines``) and anything else a caller attaches to an :class:`EventBus`
(a live view, ``--json``).  Pure: no I/O here.

Also here: :class:`Ended`, the one type that says how a command ended, used by the batch, by
``execute_remote`` and by ``execute_to``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "COMPACT_JSON",
    "EVENT_VERSION",
    "BatchFinished",
    "BatchPaused",
    "BatchResumed",
    "BatchStarted",
    "Ended",
    "Event",
    "EventBus",
    "GpuReading",
    "HostBack",
    "HostDown",
    "HostProbed",
    "HostQuarantined",
    "JobCancelled",
    "JobFailed",
    "JobFinished",
    "JobNotRun",
    "JobPlaced",
    "JobReattached",
    "JobRequeued",
    "JobRetrying",
    "JobSkipped",
    "JobStarted",
    "JobsAdded",
    "Notice",
    "PlanLine",
    "Stopping",
    "Waiting",
]

EVENT_VERSION = 1
"""Bumped when a field of an event changes meaning or goes away (new fields do not bump it)."""

TIMED_OUT = 124
"""The exit code a job killed by ``--timeout`` reports, as timeout(1) does."""


@dataclass(frozen=True, slots=True)
class Ended:
    """How a command ended.  ``code`` is its exit status (128+n for signal n), ``None`` when it
    never got one (host lost, never started, cancelled).  Expected failures are data, not
    exceptions: a lost host is ``host_lost=True`` with the reason in ``message``.

    ``kept_at``: the command's results did not all come home (a full disk here, a copy-back
    limit), so they stay on its host, at this ``host:/folder``; it failed, whatever ``code``
    says (which stays its own exit status), with the reason in ``message``."""

    code: int | None
    timed_out: bool = False
    host_lost: bool = False
    cancelled: bool = False
    message: str | None = None
    kept_at: str | None = None

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.timed_out and self.kept_at is None

    def describe(self) -> str:
        """``exit 3``, ``timed out after ...``, ``host lost: ...``: for one-line reports."""
        if self.timed_out:
            return self.message or "timed out"
        if self.host_lost:
            return f"host lost: {self.message}" if self.message else "host lost"
        if self.cancelled:
            return "cancelled"
        status = f"exit {self.code}" if self.code is not None else None
        if self.kept_at is not None:
            return f"{status or 'no exit status'}, not copied back"
        return status or self.message or "no exit status"


def _plain(value: Any) -> Any:
    """A tuple's element as JSON wants it (a reading dataclass becomes an object)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(value, separators=(",", ":"))``'s encoder, built once: the journal and the event
file write every line through it, several lines per job (``dumps`` with a separator builds a new
encoder on every call)."""

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
"""Each event kind's field names in declaration order (what :meth:`Event.to_json` writes), read
from the dataclass once: every event is written to the journal's event file, several per job."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every event: ``kind`` names it on the wire, ``t`` is when it happened (Unix time)."""

    kind: ClassVar[str] = "event"
    t: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"version", "event", "t", ...fields}``."""
        data: dict[str, Any] = {"version": EVENT_VERSION, "event": self.kind}
        names = _FIELD_NAMES.get(type(self))
        if names is None:  # once per kind: fields() walks the class's field table on every call
            names = _FIELD_NAMES[type(self)] = tuple(f.name for f in dataclasses.fields(self))
        for name in names:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = [_plain(v) for v in value]
            data[name] = value
        data["t"] = round(self.t, 3)
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchStarted(Event):
    kind: ClassVar[str] = "batch_started"
    token: str
    jobs: int
    hosts: tuple[str, ...]
    limits: tuple[tuple[str, int], ...] = ()
    """Per host (by its source file or name) how many jobs fit at once."""
    gpu_choices: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class JobsAdded(Event):
    """Jobs joined a batch under way (an open batch, like ``ssh_scheduler.Executor``'s calls):
    ``jobs`` new ones, ``total`` in the batch now."""

    kind: ClassVar[str] = "jobs_added"
    jobs: int
    total: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanLine(Event):
    """One placement of a ``--dry-run``."""

    kind: ClassVar[str] = "plan"
    job: str
    host: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostDown(Event):
    kind: ClassVar[str] = "host_down"
    host: str
    reason: str
    at_start: bool = False


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as a probe saw it (memory in MB, utilization 0..1).  ``ours_mb``: the part of
    ``memory_used_mb`` held by processes of our running jobs (the rest is other users', or no
    process's); utilization cannot be split so, the driver reports it per card."""

    index: int
    memory_used_mb: int
    memory_total_mb: int
    utilization: float
    ours_mb: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostProbed(Event):
    """A probe landed: what the host has now (everyone's use, not only ours)."""

    kind: ClassVar[str] = "host_probed"
    host: str
    cpus: int
    load: float
    memory_free_mb: int
    memory_total_mb: int
    gpus: tuple[GpuReading, ...] = ()



@dataclass(frozen=True, slots=True, kw_only=True)
class HostBack(Event):
    kind: ClassVar[str] = "host_up"
    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HostQuarantined(Event):
    kind: ClassVar[str] = "host_quarantined"
    host: str
    failures: int


@dataclass(frozen=True, slots=True, kw_only=True)
class JobPlaced(Event):
    kind: ClassVar[str] = "job_placed"
    job: str
    host: str
    gpus: tuple[int, ...]
    command: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobStarted(Event):
    kind: ClassVar[str] = "job_started"
    job: str
    host: str
    gpus: tuple[int, ...]
    command: str
    attempt: int = 1
    slurm_job: str = ""  # the Slurm job id when Slurm runs it (then Slurm, not us, picks its GPUs)
    gpu_memory_mb: int = 0
    """GPU memory reserved for it on each of its GPUs (its ``--gpu-memory-required``), MiB."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobReattached(Event):
    kind: ClassVar[str] = "job_reattached"
    job: str
    host: str
    gpus: tuple[int, ...]
    running: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFinished(Event):
    kind: ClassVar[str] = "job_finished"
    job: str
    host: str
    command: str
    code: int
    seconds: float
    bytes_received: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFailed(Event):
    kind: ClassVar[str] = "job_failed"
    job: str
    host: str
    command: str
    code: int | None
    reason: str
    """What the failed line says: ``exit 3``, ``timed out after 5 s``."""
    seconds: float
    message: str = ""
    """More detail where there is some (why the copy back failed, say)."""
    timed_out: bool = False
    bytes_received: int = 0
    kept: str = ""
    """``host:/folder`` where its results stay, when they did not all come home."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRetrying(Event):
    kind: ClassVar[str] = "job_retrying"
    job: str
    host: str
    code: int | None
    attempt: int
    attempts: int


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRequeued(Event):
    kind: ClassVar[str] = "job_requeued"
    job: str
    host: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCancelled(Event):
    kind: ClassVar[str] = "job_cancelled"
    job: str
    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSkipped(Event):
    """Not run because ``job_results/<job>`` exists (results are never overwritten)."""

    kind: ClassVar[str] = "job_skipped"
    job: str
    line: int
    failed: bool = False
    """The earlier run recorded it as failed (``--retry-failed`` reruns it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobNotRun(Event):
    """A job that will not run in this batch (a job it waits for failed, or every host is gone)."""

    kind: ClassVar[str] = "job_not_run"
    job: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting(Event):
    """Nothing of ours runs and still nothing fits: other users hold the room."""

    kind: ClassVar[str] = "waiting"
    job: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Stopping(Event):
    """``how``: ``drain`` (start nothing new), ``kill`` (kill what runs), ``halt`` (--halt)."""

    kind: ClassVar[str] = "stopping"
    how: str
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPaused(Event):
    """``ssh-scheduler pause``: no new job starts until ``resume``; running jobs go on."""

    kind: ClassVar[str] = "paused"


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchResumed(Event):
    kind: ClassVar[str] = "resumed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice(Event):
    """Something the user should read that changes no state: ``level`` is warning or error."""

    kind: ClassVar[str] = "notice"
    level: str
    message: str
    job: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchFinished(Event):
    kind: ClassVar[str] = "batch_finished"
    finished: int
    failed: tuple[str, ...]
    skipped: int
    not_run: tuple[str, ...]
    cancelled: bool
    halted: bool
    seconds: float
    bytes_sent: int
    files_sent: int
    bytes_received: int


Subscriber = Callable[[Event], None]


class EventBus:
    """Hands each event to every subscriber, in the order they subscribed.

    A subscriber that raises stops the batch (the journal failing to write must not be
    ignored); a subscriber that only displays should catch its own errors.
    """

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber, *, first: bool = False) -> None:
        """``first``: before every earlier subscriber (the journal: an event is on disk before
        anyone acts on it)."""
        if first:
            self._subscribers.insert(0, subscriber)
        else:
            self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.remove(subscriber)

    def publish(self, event: Event) -> None:
        for subscriber in self._subscribers:
            subscriber(event)
