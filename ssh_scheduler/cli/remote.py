"""``execute_remote``: one command on one machine, its output streamed, its exit status ours."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from ssh_scheduler.cli.common import err_line, fail, run_async
from ssh_scheduler.cli.params import takes_options
from ssh_scheduler.errors import SchedulerError
from ssh_scheduler.jobs.options import REMOTE, destined

__all__ = ["execute_remote"]


@takes_options(REMOTE)
def execute_remote(
    command: Annotated[str, typer.Argument(help="the shell command to run")],
    **values: Any,
) -> None:
    """Run one command on one machine, streaming its output; exits with its exit status."""
    from ssh_scheduler.coordinator.preflight import check_numbers
    from ssh_scheduler.coordinator.remote import RemoteOptions
    from ssh_scheduler.coordinator.remote import execute_remote as run_remote
    from ssh_scheduler.executors.transfer import CopyLimits
    from ssh_scheduler.jobs.job_names import validate_job_name
    from ssh_scheduler.machines.config import load_machine
    from ssh_scheduler.machines.machine import local_machine, with_keep_warm

    try:
        check_numbers(**values)
        if values["job_name"] is not None:
            validate_job_name(values["job_name"])
        target = load_machine(values["machine"]) if values["machine"] else local_machine()
        target = with_keep_warm([target], values["keep_warm"])[0]
        # Each value where the option table sends it: RemoteOptions' fields, its CopyLimits.
        options = RemoteOptions(**destined(values, "options"), limits=CopyLimits(**destined(values, "limits")))
        code = run_async(lambda: run_remote(target, command, options, warn=lambda w: err_line(f"warning: {w}")))
    except SchedulerError as exc:
        raise fail(exc) from None
    except asyncio.CancelledError:
        err_line("cancelled: the remote job was killed")
        raise typer.Exit(130) from None
    raise typer.Exit(code)
