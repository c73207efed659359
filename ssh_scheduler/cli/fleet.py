"""The ``execute_to`` command line (typer), over :func:`ssh_scheduler.coordinator.fleet.execute_to`."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from ssh_scheduler.cli.common import run_async, terminal_line
from ssh_scheduler.coordinator.fleet import (
    DEFAULT_MAX_CONNECTIONS,
    FleetOptions,
    execute_to,
    take_trailing_command,
)
from ssh_scheduler.coordinator.fleet_output import FleetResult
from ssh_scheduler.errors import ConfigError, SchedulerError
from ssh_scheduler.machines.machine import Machine


def _write_line(stream: Any, line: str) -> None:
    """A line of a command's output, as it came (``ssh`` and ``pdsh`` pass it so too); the lines
    this module composes itself go through the sanitizer first."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:  # raw bytes through, whatever the locale
        stream.flush()
        buffer.write(line.encode("utf-8", "surrogateescape") + b"\n")
        buffer.flush()
    else:
        stream.write(line + "\n")
        stream.flush()


def stdout_line(line: str) -> None:
    _write_line(sys.stdout, line)


def stderr_line(line: str) -> None:
    _write_line(sys.stderr, line)



MachinesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--machines",
        help="machine YAML files, ~/.ssh/config aliases or ranges like gpu[1-8,12]",
    ),
]


def execute_to_command(
    command: Annotated[
        str | None,
        typer.Argument(help="the shell command to run on every machine (may also come last, after the --machines values)"),
    ] = None,
    machines: MachinesOpt = None,
    exclude_hosts: Annotated[list[str] | None, typer.Option("--exclude-hosts", "-x", help="hosts to leave out (ranges allowed)")] = None,
    gather: Annotated[bool, typer.Option("--gather", "-b", help="print each distinct output once, under the hosts that produced it")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object per host per line")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="seconds the command may run on each host; then it is killed (exit 124)")] = None,
    connect_timeout: Annotated[float | None, typer.Option("--connect-timeout", help="seconds to wait for each host to answer (overrides the machines' connect_timeout)")] = None,
    max_connections: Annotated[int, typer.Option("--max-connections", help="hosts contacted at once")] = DEFAULT_MAX_CONNECTIONS,
    copy_forwards: Annotated[list[str] | None, typer.Option("--copy-forwards", help="files to send first, into the command's working directory")] = None,
    accept_new: Annotated[bool, typer.Option("--accept-new", help="trust and record unknown host keys")] = False,
) -> None:
    """Run one shell command on every machine at once; exit 0 only when it exited 0 everywhere."""
    from ssh_scheduler.machines.config import load_machines

    machine_specs = list(machines or [])
    excludes = list(exclude_hosts or [])
    forwards = list(copy_forwards or [])
    try:
        if not machine_specs:
            raise ConfigError("execute_to needs --machines")
        if command is None:
            command = take_trailing_command(machine_specs, excludes, forwards, sys.argv[1:])
        if command is None or not command.strip():
            raise ConfigError(
                "execute_to needs a command (write it after the --machines values, or before them)"
            )
        if gather and json_output:
            raise ConfigError("--gather and --json do not go together (choose one)")
        hosts = load_machines(machine_specs, exclude=excludes)
        options = FleetOptions(
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_connections=max_connections,
            accept_new=accept_new,
            gather=gather,
            json=json_output,
            copy_forwards=tuple(forwards),
        )
        result = _run_cancellable(hosts, command, options)
    except SchedulerError as exc:
        stderr_line(terminal_line(f"error: {exc}"))
        raise typer.Exit(exc.exit_code) from None
    except asyncio.CancelledError:
        stderr_line("cancelled: the remote commands were stopped")
        raise typer.Exit(130) from None
    raise typer.Exit(result.exit_status)


def _run_cancellable(machines: Sequence[Machine], command: str, options: FleetOptions) -> FleetResult:
    """Ctrl-C / SIGTERM cancel the run: every channel closes, every transport too."""
    return run_async(lambda: execute_to(machines, command, options, out=stdout_line, err=stderr_line))
