"""The ancestor's plain terminal lines, as a subscriber of the event stream.

``started:`` / ``finished:`` / ``failed:`` (and ``retrying:``, ``requeued:``, ``reattached:``, the
``machine limits:`` header, ``plan:`` lines) go to ``out``; warnings, waiting and stopping notes to
``err``.  The library hands these lines to the printers its caller gives; only the CLI prints.
Every field of an event may hold a host's or a job's text, so each line is passed through the one
sanitizer (:func:`ssh_scheduler.errors.plain_text`) before any printer sees it: an escape
sequence or a newline in a host name, a reason or a command is shown escaped, never acted on.
"""

from __future__ import annotations

from collections.abc import Callable

from ssh_scheduler.errors import plain_text
from ssh_scheduler.events import (
    BatchStarted,
    Event,
    HostBack,
    HostDown,
    HostQuarantined,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobReattached,
    JobRequeued,
    JobRetrying,
    JobSkipped,
    JobStarted,
    Notice,
    PlanLine,
    Stopping,
    Waiting,
)

Printer = Callable[[str], None]

_STOPPING = {
    "drain": "stopping: no new jobs will start; running jobs finish (Ctrl-C again to kill them)",
    "kill": "killing running jobs",
}


def _gpus(gpus: tuple[int, ...]) -> str:
    return ",".join(map(str, gpus))


def sanitized(printer: Printer) -> Printer:
    """``printer``, given each line through the one sanitizer."""

    def print_line(line: str) -> None:
        printer(plain_text(line))

    return print_line


class TerminalLines:
    def __init__(self, out: Printer, err: Printer) -> None:
        self.out = sanitized(out)
        self.err = sanitized(err)

    def __call__(self, event: Event) -> None:
        out, err = self.out, self.err
        match event:
            case PlanLine():  # first: a dry run prints one for every job at once
                out(f"plan: {event.job} -> {event.host} CUDA_VISIBLE_DEVICES={_gpus(event.gpus)}")
            case JobStarted() if event.slurm_job:  # Slurm, not us, sets CUDA_VISIBLE_DEVICES
                out(f"started: {event.job};  {event.command}  (Slurm job {event.slurm_job} through {event.host})")
            case JobStarted():
                out(f"started: {event.job};  export CUDA_VISIBLE_DEVICES={_gpus(event.gpus)} && {event.command}")
            case JobFinished():
                out(f"finished: {event.job}; {event.command}")
            case JobFailed():
                out(f"failed: {event.job}; {event.command}  ({event.reason} on {event.host})")
            case JobRetrying():
                out(
                    f"retrying: {event.job}; exit {event.code} on {event.host} "
                    f"(attempt {event.attempt} of {event.attempts})"
                )
            case JobRequeued():
                out(f"requeued: {event.job}; {event.reason}")
            case JobReattached():
                out(f"reattached: {event.job} on {event.host} ({'running' if event.running else 'ended'})")
            case JobSkipped():
                out(
                    f"WARNING: job results already exists for line {event.line}, "
                    "skipping evaluation: delete if you wish to rerun"
                )
            case JobNotRun():
                err(f"not run: {event.job} ({event.reason})")
            case BatchStarted():
                out(f"machine limits:  {dict(event.limits)}")
                out(f"machine gpu choices: {[list(c) for c in event.gpu_choices]}")
            case HostDown():
                err(f"warning: {event.reason}" if event.at_start else f"warning: host {event.host} lost: {event.reason}")
            case HostQuarantined():
                err(
                    f"warning: host {event.host} failed {event.failures} times in a row; "
                    "not using it again in this batch"
                )
            case HostBack():
                err(f"host {event.host} is back")
            case Waiting():
                err(f"waiting: no host has room for {event.job} now ({event.reason})")
            case Stopping():
                err(_STOPPING.get(event.how) or f"halting: {event.reason}")
            case Notice():
                if event.level == "info":
                    out(event.message)
                else:
                    err(f"{event.level}: {event.message}")
