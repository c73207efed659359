"""What ``execute_batch`` shows when it is not drawing a live view: JSON events, plain lines
(quiet, normal or verbose), and the final summary.

Printers are handed in (only the CLI prints); nothing here touches a terminal.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ssh_scheduler.errors import plain_text
from ssh_scheduler.events import Event, HostProbed, JobCancelled, JobFailed, Notice
from ssh_scheduler.view.terminal import Printer, TerminalLines

if TYPE_CHECKING:
    from ssh_scheduler.results.summary import BatchSummary

__all__ = ["JsonLines", "plain_subscriber", "probed_line", "report_line", "summary_lines", "wire_logging"]


class JsonLines:
    """``--json``: one JSON object per event, one per line (the README documents the schema)."""

    def __init__(self, out: Printer) -> None:
        self.out = out

    def __call__(self, event: Event) -> None:
        self.out(json.dumps(event.to_json(), separators=(",", ":")))


def probed_line(event: HostProbed) -> str:
    gpus = "".join(
        f", gpu{g.index} {g.memory_used_mb}/{g.memory_total_mb} MB {g.utilization:.0%}" for g in event.gpus
    )
    return (
        f"probed: {event.host} load {event.load:.2f}/{event.cpus} cpus, "
        f"{event.memory_free_mb}/{event.memory_total_mb} MB free{gpus}"
    )


def plain_subscriber(out: Printer, err: Printer, verbosity: int = 0) -> Callable[[Event], None]:
    """The ancestor's lines.  ``verbosity`` -1 (``-q``): only failures and errors; 1 (``-v``):
    also every probe (the transfers and connections come through :func:`wire_logging`)."""
    lines = TerminalLines(out, err)
    out, err = lines.out, lines.err  # sanitizing, for the lines of our own below too

    def subscriber(event: Event) -> None:
        if verbosity < 0 and not isinstance(event, JobFailed) and not (
            isinstance(event, Notice) and event.level == "error"
        ):
            return
        if isinstance(event, HostProbed):
            if verbosity > 0:
                err(probed_line(event))
            return
        if isinstance(event, JobCancelled):  # the ancestor had no cancel: a line of our own
            out(f"cancelled: {event.job}" + (f" on {event.host}" if event.host else ""))
            return
        lines(event)

    return subscriber


def wire_logging(verbosity: int, err: Printer) -> None:
    """``-v``: the library's log (connections, transfers with byte counts) goes to ``err``."""
    if verbosity <= 0:
        return
    logger = logging.getLogger("ssh_scheduler")
    for old in [h for h in logger.handlers if isinstance(h, _ToPrinter)]:
        logger.removeHandler(old)  # one run per process, but tests call the CLI in-process
    logger.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)
    printer = _ToPrinter(err)
    if logger.handlers:  # the command line's warning lines (cli/main.show_library_logs): not twice
        printer.addFilter(lambda record: record.levelno < logging.WARNING)
    logger.addHandler(printer)


class _ToPrinter(logging.Handler):
    def __init__(self, err: Printer) -> None:
        super().__init__()
        self.err = err

    def emit(self, record: logging.LogRecord) -> None:
        self.err(plain_text(f"{record.name.removeprefix('ssh_scheduler.')}: {record.getMessage()}"))


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _size(count: int) -> str:
    """``83886080 bytes (80.0 MB)``: the exact count for scripts, the rounded one for people."""
    if count < 1024:
        return f"{count} bytes"
    value, units = count / 1024, ["KB", "MB", "GB"]
    while value >= 1024 and len(units) > 1:
        value /= 1024
        units.pop(0)
    return f"{count} bytes ({value:.1f} {units[0]})"


def summary_lines(summary: BatchSummary, results_dir: Path) -> list[str]:
    """The end of a run: counts, wall time, bytes moved, then each job that did not succeed with
    where to look (its ``.err``) or what to do (``--retry-failed``)."""
    finished = len(summary.outcomes) - len(summary.failed)
    extra = "".join(
        f", {len(names)} {what}"
        for names, what in ((summary.not_run, "not run"), (summary.cancelled_jobs, "cancelled"))
        if names
    )
    lines = [
        f"done: {finished} finished, {len(summary.failed)} failed, {len(summary.skipped)} skipped{extra} "
        f"in {_duration(summary.seconds)}; sent {_size(summary.bytes_uploaded)} in "
        f"{summary.files_uploaded} files, received {_size(summary.bytes_downloaded)}"
    ]
    for name in summary.failed:
        outcome = summary.outcomes[name]
        # Where to look: what stayed on the host, and the .err, when there is one to read (a
        # job refused before it ran, or whose output could not be written here, may have none).
        err = results_dir / f"{name}.err"
        where = [f"results kept on {outcome.ended.kept_at}"] if outcome.ended.kept_at else []
        where += [str(err)] if err.is_file() and not err.is_symlink() else []
        lines.append(f"  failed: {name} ({outcome.ended.describe()} on {outcome.host})" + (f": {'; '.join(where)}" if where else ""))
    for name in summary.cancelled_jobs:
        lines.append(f"  cancelled: {name}")
    if summary.skipped_failed:
        shown = ", ".join(summary.skipped_failed[:10])
        more = f" and {len(summary.skipped_failed) - 10} more" if len(summary.skipped_failed) > 10 else ""
        lines.append(
            f"{len(summary.skipped_failed)} jobs failed in an earlier run and were skipped: {shown}{more}; "
            "rerun with --retry-failed to run them again"
        )
    lines.append(report_line(results_dir))
    return lines


def report_line(results_dir: Path) -> str:
    """The line a run ends with that names the command drawing it (the summary, the live
    view's last screen, a detached run's exit record).  Here, not beside the page: loading the
    page's module was 8 ms at the end of every batch."""
    where = "" if results_dir == Path("job_results") else f" {shlex.quote(str(results_dir))}"
    return f"  report: ssh-scheduler report{where}  (one HTML page: timeline, GPUs, failures)"
