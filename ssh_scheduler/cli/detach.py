"""``execute_batch --detach`` (and a sweep's) on the command line, and ``ssh-scheduler attach``.

The mechanism (re-exec, the event file, following it) is :mod:`ssh_scheduler.coordinator.detach`;
this module decides what is printed and with which exit status.  The coordinator is the same
command run again with the hidden ``--detached-status-fd`` (the pipe it tells the parent through
that the batch is under way): an explicit way in, never a variable in the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ssh_scheduler.cli.common import StreamLines
from ssh_scheduler.cli.common import err_line as _err
from ssh_scheduler.cli.common import out_line as _out
from ssh_scheduler.coordinator.detach import (
    LOG_NAME,
    CoordinatorSession,
    event_from_json,
    exit_record,
    follow_events,
    start_coordinator,
)
from ssh_scheduler.errors import ConfigError, SchedulerError, plain_text
from ssh_scheduler.results.event_log import EVENTS_NAME, EXIT_EVENT

if TYPE_CHECKING:
    from ssh_scheduler.coordinator.batch import Batch

__all__ = ["DetachedDisplay", "attach", "detached_session", "start_detached"]

CANCELLED_LINE = "cancelled: running jobs were killed"


def start_detached(
    command: Callable[[int], list[str]], results_dir: Path, *, json_events: bool, dry_run: bool, what: str = "batch"
) -> int:
    """The parent: refuse what cannot go with --detach, start ``command(status_fd)`` (the same
    command's argv, as the coordinator) and return its refusal's exit status or 0 once the
    ``what`` (batch or sweep) is under way.  ``results_dir`` is the batch's folder: its log and
    event file, the folder attach, status and cancel are pointed at.  ``json_events``: stdout
    gets the event records up to the batch's start, as ``attach --json`` prints them."""
    where = _where(results_dir)
    if dry_run:
        _err("error: --dry-run runs nothing to detach from; drop --detach")
        return 2

    def argv(status_fd: int) -> list[str]:
        return [sys.executable, "-m", "ssh_scheduler", *command(status_fd)]

    early = StreamLines(_err)  # the coordinator's first words, a local agent's among them
    pid, code = start_coordinator(argv, early.feed)
    early.flush()
    if pid is None:
        return code
    if json_events:
        # stdout gets what `attach --json` would show first: the coordinator's record (its pid and
        # host), then the events up to the batch's start; the rest is in the event file.
        for record in _records_until_started(results_dir / EVENTS_NAME):
            _out(record)
    _err(f"detached: the {what} runs on in the background (pid {pid}); its log: {results_dir}/{LOG_NAME}")
    _err(f"  follow it: ssh-scheduler attach{where}; stop it: ssh-scheduler cancel --all{where}")
    return 0


def _records_until_started(path: Path) -> list[str]:
    """The event file's lines up to and including ``batch_started`` (the coordinator wrote them
    before it let us return)."""
    import json

    lines: list[str] = []
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as stream:
        for line in stream:  # the coordinator just wrote them, each through json.dumps
            lines.append(line.rstrip("\n"))
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == "batch_started":
                    break
    return lines


def detached_session(results_dir: Path, status_fd: int) -> CoordinatorSession:
    """This process is the detached coordinator ``--detach`` started: its session, which tells
    the parent through ``status_fd`` once the batch is under way."""
    try:
        is_pipe = stat.S_ISFIFO(os.fstat(status_fd).st_mode)
    except OSError:
        is_pipe = False
    if not is_pipe:
        raise ConfigError(
            f"--detached-status-fd {status_fd} is not a pipe; it is set by --detach for the coordinator "
            "it starts (use --detach)"
        )
    return CoordinatorSession.detached(results_dir, status_fd)


class DetachedDisplay:
    """The detached coordinator's display: plain lines into its log, every event of each batch it
    watches into the event file, and at the end the exit record ``attach`` ends with: ``end()``'s
    exit status and lines when the run ended, else the error that ended it."""

    def __init__(self, session: CoordinatorSession, verbosity: int, end: Callable[[], tuple[int, list[str]]]) -> None:
        from ssh_scheduler.view.display import wire_logging

        self.session = session
        self.verbosity = verbosity
        self.end = end
        self.out, self.err = session.printer(_out), session.printer(_err)
        wire_logging(verbosity, self.err)

    def interrupt(self, request_stop: Callable[[], None]) -> Callable[[], None]:
        """The signal handler for ``request_stop`` (first call drains, second kills).  Until the
        batch is under way only the parent signals us, and it means "stop now" (its user pressed
        Ctrl-C while it waited): one signal then stops and kills, whether or not the parent's
        second one comes before a drain with nothing running has already ended the batch."""

        def handler() -> None:
            request_stop()
            if not self.session.under_way:
                request_stop()

        return handler

    def watch(self, batch: Batch) -> None:
        from ssh_scheduler.view.display import plain_subscriber

        batch.bus.subscribe(self.session)
        batch.bus.subscribe(plain_subscriber(self.out, self.err, self.verbosity))

    def __enter__(self) -> DetachedDisplay:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        results_dir = self.session.results_dir
        if exc is None:
            code, lines = self.end()
        elif isinstance(exc, SchedulerError):
            code, lines = exc.exit_code, [f"error: {exc}"]
        elif isinstance(exc, asyncio.CancelledError):
            code, lines = 130, [CANCELLED_LINE]
        else:
            code, lines = 1, [f"error: the coordinator stopped: {exc!r} (see {results_dir}/{LOG_NAME})"]
        self.session.finish(code, lines)


def attach(
    results_dir: Annotated[Path, typer.Option("--results-dir", help="the batch's results folder")] = Path("job_results"),
    json_output: Annotated[bool, typer.Option("--json", help="the event records as they are (one JSON object a line)")] = False,
    live: Annotated[bool, typer.Option("--live", help="the live view (progress and hosts) on a terminal")] = False,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="also show probes")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only failures and the summary")] = False,
) -> None:
    """Follow a detached batch: what it printed so far, then its lines as they come; ends with the
    batch's exit status.  Ctrl-C leaves the viewer, never the batch."""
    import contextlib

    from ssh_scheduler.view.display import plain_subscriber

    if json_output and live:
        _err("error: --json and --live are two views; choose one")
        raise typer.Exit(2)
    if not os.path.lexists(results_dir / EVENTS_NAME):
        why = (
            "its batch was not started with --detach (ssh-scheduler status shows its progress)"
            if os.path.lexists(results_dir / ".journal.jsonl")
            else "no batch ran there with --detach"
        )
        _err(f"error: nothing to attach to in {plain_text(results_dir)}: {why}")
        raise typer.Exit(2)
    verbosity = -1 if quiet else verbose
    view: Any = None
    if live:
        from ssh_scheduler.view.live import LiveView

        view = LiveView(verbosity=verbosity)
    show = view or plain_subscriber(_out, _err, verbosity)
    end: dict[str, Any] | None = None
    header: dict[str, Any] = {}
    try:
        with view or contextlib.nullcontext():
            for record in follow_events(results_dir):
                if json_output:
                    _out(_json_line(record))
                if record.get("event") == EXIT_EVENT:
                    end = record
                elif record.get("event") == "coordinator":
                    header = record
                elif not json_output and (event := event_from_json(record)) is not None:
                    show(event)
    except KeyboardInterrupt:
        _err(f"detached from the view; the batch goes on (ssh-scheduler attach{_where(results_dir)} to follow it again)")
        raise typer.Exit(130) from None
    except SchedulerError as exc:  # the event file is not what a coordinator writes
        _err(f"error: {exc}")
        raise typer.Exit(exc.exit_code) from None
    if end is None:
        _err(
            f"error: the coordinator (pid {header.get('pid', '?')}) ended without finishing the batch; "
            f"ssh-scheduler status shows what it left, and the same execute_batch again goes on with it"
        )
        raise typer.Exit(1)
    code, lines = exit_record(end)
    if not json_output:
        for line in lines:
            _err(line)
    raise typer.Exit(code)


def _where(results_dir: Path) -> str:
    return "" if results_dir == Path("job_results") else f" --results-dir {results_dir}"


def _json_line(record: dict[str, Any]) -> str:
    import json

    return json.dumps(record, separators=(",", ":"))
