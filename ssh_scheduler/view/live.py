"""The live view of ``execute_batch`` on a terminal (rich): a progress bar and a table per host.

:class:`BoardState` folds the event stream into what the view shows (pure, tested without a
terminal); :class:`LiveView` draws it with ``rich.live`` and prints the ``started:`` /
``finished:`` / ``failed:`` lines above the live area, so the scrollback keeps the history.
Events arrive on the event loop's thread while rich redraws from its own; a lock keeps the two
from seeing a half-applied event.

rich passes an escape sequence in a string through to the terminal, and reads ``[...]`` in a
plain string as markup (a link, a style): every line and every table cell is therefore a
``Text`` (never markup) of the one sanitizer's output (:func:`ssh_scheduler.errors.plain_text`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ssh_scheduler.errors import plain_text
from ssh_scheduler.events import (
    BatchStarted,
    Event,
    HostBack,
    HostDown,
    HostProbed,
    HostQuarantined,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobReattached,
    JobRequeued,
    JobRetrying,
    JobsAdded,
    JobStarted,
)
from ssh_scheduler.view.display import plain_subscriber

__all__ = ["BoardState", "LiveView", "estimate_left"]


def estimate_left(runtimes: list[float], waiting: int, running: int) -> float | None:
    """Seconds until the batch ends, from the mean runtime of finished jobs: the jobs still to
    run pass through as many slots as run now.  ``None`` until one job has finished."""
    if not runtimes:
        return None
    mean = sum(runtimes) / len(runtimes)
    slots = max(running, 1)
    return mean * (waiting + running) / slots


@dataclass(slots=True)
class HostRow:
    state: str = "connecting"
    probe: HostProbed | None = None
    jobs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # our running job -> its GPUs


@dataclass(slots=True)
class BoardState:
    """What the live view shows, folded from the events."""

    total: int = 0
    finished: int = 0
    failed: int = 0
    other: int = 0  # cancelled or not run: ended without a result
    runtimes: list[float] = field(default_factory=list)
    hosts: dict[str, HostRow] = field(default_factory=dict)
    running: dict[str, str] = field(default_factory=dict)  # job -> host
    started_at: float = field(default_factory=time.monotonic)

    @property
    def waiting(self) -> int:
        return max(0, self.total - self.finished - self.failed - self.other - len(self.running))

    def host(self, name: str) -> HostRow:
        return self.hosts.setdefault(name, HostRow())

    def _job_left(self, job: str) -> None:
        host = self.running.pop(job, None)
        if host is not None:
            self.host(host).jobs.pop(job, None)

    def apply(self, event: Event) -> None:
        match event:
            case BatchStarted():
                self.total = event.jobs
                # Elapsed counts from the batch's start, also for a view attached later.
                self.started_at = time.monotonic() - max(0.0, time.time() - event.t)
                for name in event.hosts:
                    self.host(name)
            case JobsAdded():
                self.total = event.total
            case HostProbed():
                row = self.host(event.host)
                row.probe = event
                if row.state == "connecting":
                    row.state = "up"
            case HostDown():
                self.host(event.host).state = "down"
            case HostBack():
                self.host(event.host).state = "up"
            case HostQuarantined():
                self.host(event.host).state = "quarantined"
            case JobStarted() | JobReattached():
                self._job_left(event.job)
                self.running[event.job] = event.host
                self.host(event.host).jobs[event.job] = event.gpus
            case JobFinished():
                self._job_left(event.job)
                self.finished += 1
                self.runtimes.append(event.seconds)
            case JobFailed():
                self._job_left(event.job)
                self.failed += 1
            case JobCancelled() | JobNotRun():
                self._job_left(event.job)
                self.other += 1
            case JobRequeued() | JobRetrying():
                self._job_left(event.job)

    def eta(self) -> float | None:
        return estimate_left(self.runtimes, self.waiting, len(self.running))


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _cell(value: object, style: str = "") -> Text:
    """A table cell: sanitized text, never markup."""
    return Text(plain_text(value), style=style)


def render(board: BoardState) -> Group:
    ended = board.finished + board.failed + board.other
    bar = ProgressBar(total=max(board.total, 1), completed=ended, width=30)
    counts = Text(
        f" {ended}/{board.total}  done {board.finished}  running {len(board.running)}  "
        f"waiting {board.waiting}  failed {board.failed}  "
        f"elapsed {_clock(time.monotonic() - board.started_at)}  ETA {_clock(board.eta())}"
    )
    table = Table(box=None, padding=(0, 1), show_edge=False)
    for column in ("host", "state", "jobs", "load", "free mem", "GPUs (used/total MB, util)", "our jobs"):
        table.add_column(column, no_wrap=column != "our jobs")
    for name, row in board.hosts.items():
        probe = row.probe
        load = f"{probe.load:.1f}/{probe.cpus}" if probe else "-"
        memory = f"{probe.memory_free_mb // 1024} GB" if probe else "-"
        gpus = (
            " ".join(f"{g.index}:{g.memory_used_mb}/{g.memory_total_mb} {g.utilization:.0%}" for g in probe.gpus)
            if probe and probe.gpus
            else "-"
        )
        ours = " ".join(
            f"{job}[{','.join(map(str, cards))}]" if cards else job for job, cards in row.jobs.items()
        )
        style = {"down": "red", "quarantined": "red", "up": "green"}.get(row.state, "")
        table.add_row(
            _cell(name), _cell(row.state, style), _cell(len(row.jobs)), _cell(load), _cell(memory), _cell(gpus),
            _cell(ours or "-"),
        )
    header = Table.grid(padding=(0, 1))
    header.add_row(bar, counts)
    return Group(header, table)


class LiveView:
    """A subscriber that keeps the live area drawn and the plain lines printed above it."""

    def __init__(self, console: Console | None = None, verbosity: int = 0) -> None:
        self.console = console or Console(highlight=False)
        self.board = BoardState()
        self._lock = threading.Lock()
        self._live = Live(console=self.console, get_renderable=self._renderable, refresh_per_second=2)
        self._lines = plain_subscriber(self.print_out, self.print_err, verbosity)

    def print_out(self, line: str) -> None:
        self.console.print(Text(plain_text(line)))

    def print_err(self, line: str) -> None:
        self.console.print(Text(plain_text(line), style="yellow"))

    def _renderable(self) -> Group:
        with self._lock:
            board = board_copy(self.board)
        return render(board)

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.board.apply(event)
        self._lines(event)

    def __enter__(self) -> LiveView:
        self._live.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._live.stop()


def board_copy(board: BoardState) -> BoardState:
    """A snapshot for drawing outside the lock (rows are copied; probes are frozen)."""
    hosts = {name: HostRow(row.state, row.probe, dict(row.jobs)) for name, row in board.hosts.items()}
    return BoardState(
        board.total, board.finished, board.failed, board.other, list(board.runtimes), hosts,
        dict(board.running), board.started_at,
    )
