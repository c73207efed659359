"""What every command shares: printing a line, the one-line error, running the event loop with
signals wired, and ending quietly when the reader of our output went away.

Every line the commands print goes through :func:`out_line` / :func:`err_line` (or the live
view, or the log handler of ``cli.main``), and those pass it through the one sanitizer
(:func:`ssh_scheduler.errors.plain_text`): whatever a host, a job, a results folder or a socket
put into a line, no escape sequence reaches the terminal raw and no line is split in two.  Only
a command's own output that the user asked to see (``execute_remote``, ``execute_to``, a
sweep's ``-d``) is passed through as it came, as ``ssh`` passes it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import typer

from ssh_scheduler.errors import SchedulerError, plain_text

__all__ = [
    "StreamLines", "err_line", "fail", "out_line", "out_line_held", "quiet_on_broken_pipe", "run_async", "terminal_line",
    "write_held",
]

T = TypeVar("T")


def terminal_line(line: str) -> str:
    """One line as it may reach the terminal: the one sanitizer, tabs kept (``jobs`` prints TSV
    and a tab cannot move back over text)."""
    return plain_text(line, tabs=True)


def out_line(line: str) -> None:
    write_held()
    sys.stdout.write(terminal_line(line) + "\n")
    sys.stdout.flush()


_held: list[str] = []
_held_size = 0
HELD_MAX = 1 << 16
"""Characters :func:`out_line_held` keeps before it writes them."""


def out_line_held(line: str) -> None:
    """:func:`out_line` for output nobody waits for line by line (a dry run's plan: it is all
    there at once): kept, and written 64 KiB at a time, whatever stdout's own buffering
    (``PYTHONUNBUFFERED`` writes each line on its own).  Whoever prints with it calls
    :func:`write_held` when done; every other line, to stdout or stderr, writes what is kept
    first, so the two streams still come in the order they were printed."""
    global _held_size
    text = terminal_line(line) + "\n"
    _held.append(text)
    _held_size += len(text)
    if _held_size >= HELD_MAX:
        write_held()


def write_held() -> None:
    """Write and flush what :func:`out_line_held` kept (nothing to do when it kept nothing)."""
    global _held_size
    if not _held:
        return
    text = "".join(_held)
    _held.clear()
    _held_size = 0
    sys.stdout.write(text)
    sys.stdout.flush()


def err_line(line: str) -> None:
    # A reader of stdout that went away must not cost the user this line (an error's, say):
    # what was held for it is dropped, and the next line to stdout ends the command (141).
    with contextlib.suppress(BrokenPipeError):
        write_held()
    sys.stderr.write(terminal_line(line) + "\n")
    sys.stderr.flush()


def fail(exc: SchedulerError) -> typer.Exit:
    err_line(f"error: {exc}")
    return typer.Exit(exc.exit_code)


class StreamLines:
    """Bytes another process printed (the detached coordinator before it is under way, a local
    agent's stderr among them), to ``write`` line by line through the one sanitizer; an
    unfinished line waits for its end (at most ``limit`` bytes) or :meth:`flush`."""

    def __init__(self, write: Callable[[str], None] = err_line, limit: int = 1 << 16) -> None:
        self.write = write
        self.limit = limit
        self.pending = b""

    def feed(self, data: bytes) -> None:
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self.write(line.decode("utf-8", "surrogateescape"))
        if len(self.pending) >= self.limit:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.write(self.pending.decode("utf-8", "surrogateescape"))
            self.pending = b""


def run_async(factory: Callable[[], Coroutine[Any, Any, T]], on_interrupt: Callable[[], None] | None = None) -> T:
    """Run a coroutine; SIGINT/SIGTERM call ``on_interrupt`` (drain, then kill) when given."""

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        handler = on_interrupt or task.cancel
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, handler)
        return await factory()

    # Handled here too, not only around the app: click would turn a bare EPIPE into exit 1.
    with quiet_on_broken_pipe():
        return asyncio.run(main())


@contextlib.contextmanager
def quiet_on_broken_pipe() -> Iterator[None]:
    """A reader that went away (``execute_to ... | head``) ends us quietly with 141, as it ends
    any Unix filter, instead of with a traceback (asyncio may wrap the error in a group)."""
    try:
        yield
    except (BrokenPipeError, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(
            lambda e: not isinstance(e, (BrokenPipeError, BaseExceptionGroup))
        ):
            raise
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None  # 128 + SIGPIPE, what a shell reports for a filter
