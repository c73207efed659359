"""What a batch run shows in the foreground: ``--json`` events, the live view on a terminal, or
the plain lines; ``-v`` / ``-q`` say how much.  (A detached run's output: ``cli/detach.py``.)"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ssh_scheduler.cli.common import err_line, out_line, out_line_held, write_held

if TYPE_CHECKING:
    from ssh_scheduler.coordinator.batch import Batch

__all__ = ["batch_display", "verbosity_of"]


def verbosity_of(values: Mapping[str, Any]) -> int:
    """``-q``: -1 (only failures and the summary); else how many ``-v``."""
    return -1 if values["quiet"] else int(values["verbose"])


def batch_display(batch: Batch, *, json_events: bool, plain: bool, verbosity: int) -> contextlib.AbstractContextManager[Any]:
    """Subscribe what the user sees: ``--json`` events, the live view on a terminal, or the plain
    lines (not a terminal, ``--plain``, ``NO_COLOR``, ``TERM=dumb``); and, but for a dry run, the
    event file that ``attach`` and ``report`` read (as a detached run keeps it)."""
    if batch.options.dry_run:
        return _shown(batch, json_events=json_events, plain=plain, verbosity=verbosity)
    from ssh_scheduler.results.event_log import EventLog
    from ssh_scheduler.view.display import summary_lines

    def end() -> tuple[int, list[str]]:
        return batch.summary.exit_code, summary_lines(batch.summary, batch.options.results_dir)

    kept = EventLog(batch.options.results_dir, end)
    batch.bus.subscribe(kept)
    stack = contextlib.ExitStack()
    stack.enter_context(kept)
    stack.enter_context(_shown(batch, json_events=json_events, plain=plain, verbosity=verbosity))
    return stack


def _shown(batch: Batch, *, json_events: bool, plain: bool, verbosity: int) -> contextlib.AbstractContextManager[Any]:
    from ssh_scheduler.view.display import JsonLines, plain_subscriber, wire_logging

    # A dry run's plan is printed all at once, after every host was looked at: its lines are
    # kept and written 64 KiB at a time (out_line_held), not a write for each of 100,000 lines.
    out = out_line_held if batch.options.dry_run else out_line
    if json_events:
        batch.bus.subscribe(JsonLines(out))
        batch.bus.subscribe(plain_subscriber(lambda _: None, err_line, min(verbosity, 0)))
        wire_logging(verbosity, err_line)
        return _flushed()
    tty = sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
    if plain or not tty or batch.options.dry_run:
        batch.bus.subscribe(plain_subscriber(out, err_line, verbosity))
        wire_logging(verbosity, err_line)
        return _flushed()
    from ssh_scheduler.view.live import LiveView

    view = LiveView(verbosity=verbosity)
    batch.bus.subscribe(view)
    wire_logging(verbosity, view.print_err)  # above the live area, not through it
    return view


@contextlib.contextmanager
def _flushed() -> Iterator[None]:
    """What ``out_line_held`` kept written as the display ends (a reader gone away raises here,
    inside the command's handling of that)."""
    try:
        yield
    finally:
        write_held()
