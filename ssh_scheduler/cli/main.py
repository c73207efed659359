"""The entry points: which command runs, built as a typer app of that one command.

Start-up time is part of every run, so nothing but typer and this module loads before the
command is known; then only the command's own module (:func:`command`).  The commands' options
come from one table (:mod:`ssh_scheduler.jobs.options`, turned into typer parameters by
:mod:`ssh_scheduler.cli.params`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
from collections.abc import Callable, Sequence

import typer

from ssh_scheduler.cli.common import err_line, quiet_on_broken_pipe, terminal_line, write_held
from ssh_scheduler.cli.params import expand_multi_value

COMMANDS = ("execute_batch", "execute_remote", "combine_folders", "execute_to", "sweep", "results", "report")
CONTROL_COMMANDS = ("status", "jobs", "pause", "resume", "cancel", "doctor", "attach", "hub")
"""Commands that read a batch's journal, steer its coordinator, follow it, check the hosts or
show the hub that keeps their connections warm."""


def command(name: str) -> Callable[..., None]:
    """The typer function of a command, its module loaded only now (start-up time)."""
    if name == "execute_batch":
        from ssh_scheduler.cli.batch import execute_batch

        return execute_batch
    if name == "execute_remote":
        from ssh_scheduler.cli.remote import execute_remote

        return execute_remote
    if name == "combine_folders":
        from ssh_scheduler.cli.combine import combine_folders

        return combine_folders
    if name == "execute_to":
        from ssh_scheduler.cli.fleet import execute_to_command

        return execute_to_command
    if name == "sweep":
        from ssh_scheduler.cli.sweep import sweep

        return sweep
    if name == "results":
        from ssh_scheduler.cli.results import results

        return results
    if name == "report":
        from ssh_scheduler.cli.report import report

        return report
    if name == "attach":
        from ssh_scheduler.cli.detach import attach

        return attach
    if name == "hub":
        from ssh_scheduler.cli.hub import hub

        return hub
    from ssh_scheduler.cli.status import COMMANDS as control

    return control[name]


def sweep_args(args: Sequence[str]) -> list[str]:
    """``execute_batch --sweep FILE rest`` -> ``sweep FILE rest`` (the same flags otherwise)."""
    rest: list[str] = []
    files: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":  # positional words from here on: a batch file may be called --sweep
            rest.extend(args[i:])
            break
        if arg == "--sweep" and i + 1 < len(args):
            files.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("--sweep="):
            files.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return [*files, *rest]


def route(name: str, args: Sequence[str]) -> tuple[str, list[str]]:
    """``execute_batch --sweep FILE ...`` is ``sweep FILE ...``."""
    options = args[: args.index("--")] if "--" in args else args
    if name == "execute_batch" and any(a == "--sweep" or a.startswith("--sweep=") for a in options):
        return "sweep", sweep_args(args)
    return name, list(args)


class _AfterStdout(logging.StreamHandler):  # type: ignore[type-arg]
    """Library warnings on stderr, after what stdout still holds (``out_line_held``)."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError, ValueError):
            write_held()
        super().emit(record)


class _LowerLevel(logging.Formatter):
    """``warning: ...``: one line, through the one sanitizer (a log message may carry a host's
    text); no traceback."""

    def format(self, record: logging.LogRecord) -> str:
        return terminal_line(f"{record.levelname.lower()}: {record.getMessage()}")


def show_library_logs(level: int = logging.WARNING) -> None:
    """Library modules log (logger ``ssh_scheduler``); on the command line their warnings
    appear on stderr as ``warning: ...`` lines."""
    logger = logging.getLogger("ssh_scheduler")
    if not logger.handlers:
        handler = _AfterStdout(sys.stderr)
        handler.setFormatter(_LowerLevel())
        handler.setLevel(level)  # -v lowers the logger's level for its own lines, not these
        logger.addHandler(handler)
        logger.setLevel(level)


# typer exports only BadParameter of click's exceptions (and vendors click from 0.21 on, so
# ``import click`` may fail): its bases are click's UsageError and ClickException.
_UsageError: type[Exception] = typer.BadParameter.__base__  # type: ignore[assignment]
_ClickException: type[Exception] = _UsageError.__base__  # type: ignore[assignment]

GC_THRESHOLD = (10_000, 10, 10)
"""The cycle collector's thresholds in a command's process (the interpreter's: 700, 10, 10).  A
batch keeps every job, its slot and its events alive for the whole run, so with the default a
young collection ran every 700 allocations and the full ones kept walking that growing heap:
30 % of the CPU of planning a 100,000-line batch (``--dry-run``), a few % of each job's in a
live batch.  What is collected does not change, only how often the collector looks; a library
caller's process keeps its own settings (only the command line sets this)."""


def run_app(app: typer.Typer, args: Sequence[str], prog_name: str) -> None:
    """Run the app; a command line click refuses (an unknown option, a value of the wrong type,
    a missing argument) is one ``error:`` line that says where to look, as every other refusal
    is, not click's framed box of usage, hint and message."""
    show_library_logs()
    gc.set_threshold(*GC_THRESHOLD)
    code = _run(app, args, prog_name)
    raise SystemExit(code)


def _run(app: typer.Typer, args: Sequence[str], prog_name: str) -> int:
    with quiet_on_broken_pipe():
        try:
            code = app(args=expand_multi_value(args), prog_name=prog_name, standalone_mode=False)
        except _ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # no words at all: the help, as before
                ctx = getattr(exc, "ctx", None)
                help_text = ctx.get_help() if ctx is not None else ""
                if help_text:
                    sys.stdout.write(help_text + "\n")
                raise SystemExit(2) from None
            message = exc.format_message()  # type: ignore[attr-defined]
            hint = f" (see {prog_name} --help)" if isinstance(exc, _UsageError) else ""
            err_line(f"error: {message.rstrip('.')}{hint}")
            raise SystemExit(exc.exit_code) from None  # type: ignore[attr-defined]
        except typer.Abort:
            err_line("Aborted!")
            raise SystemExit(1) from None
    return code if isinstance(code, int) else 0


def one_command(name: str, args: Sequence[str], prog_name: str) -> None:
    """Build only the command asked for: the others' modules need not load (start-up time)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    wanted, rest = route(name, args)
    app.command(name=name)(command(wanted))
    run_app(app, rest, prog_name)


def single(name: str) -> Callable[[], None]:
    def entry() -> None:
        one_command(name, sys.argv[1:], name)

    return entry


execute_batch_main = single("execute_batch")
execute_remote_main = single("execute_remote")
combine_folders_main = single("combine_folders")
execute_to_main = single("execute_to")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    wanted = args[0].replace("-", "_") if args else ""
    if wanted in (*COMMANDS, *CONTROL_COMMANDS):
        one_command(wanted, args[1:], f"ssh-scheduler {args[0]}")
        return
    app = typer.Typer(
        add_completion=False,
        pretty_exceptions_enable=False,
        help="Run batches of shell commands across many machines and GPUs over plain SSH.",
        no_args_is_help=True,
    )
    for name in (*COMMANDS, *CONTROL_COMMANDS):
        func = command(name)
        app.command(name=name)(func)
        if "_" in name:  # a hidden twin with the same name would hide the command itself
            app.command(name=name.replace("_", "-"), hidden=True)(func)
    run_app(app, args, "ssh-scheduler")
