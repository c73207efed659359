"""What every command shares: printing a line, the one-line error, running the event loop with
signals wired, and ending quietly when the reader of our output went away."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import typer

from ssh_scheduler.errors import SchedulerError

__all__ = ["err_line", "fail", "out_line", "quiet_on_broken_pipe", "run_async"]

T = TypeVar("T")


def out_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def err_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def fail(exc: SchedulerError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(exc.exit_code)


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
