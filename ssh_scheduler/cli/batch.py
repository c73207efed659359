"""``execute_batch``: run every line of a batch file as a job, in the foreground or detached.

Its options are the table's (:mod:`ssh_scheduler.jobs.options`); their values arrive by name in
``values`` and go where the table says (:func:`~ssh_scheduler.coordinator.batch_run.batch_options`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ssh_scheduler.cli.common import err_line, fail, run_async
from ssh_scheduler.cli.display import batch_display, verbosity_of
from ssh_scheduler.cli.params import command_argv, takes_options
from ssh_scheduler.errors import SchedulerError
from ssh_scheduler.jobs.options import BATCH

if TYPE_CHECKING:
    from ssh_scheduler.coordinator.batch import Batch
    from ssh_scheduler.coordinator.detach import CoordinatorSession
    from ssh_scheduler.coordinator.early_hosts import EarlyHosts
    from ssh_scheduler.machines.machine import Machine
    from ssh_scheduler.results.summary import BatchSummary

__all__ = ["execute_batch", "run_with_early_hosts"]


@takes_options(BATCH)
def execute_batch(
    batch_file: Annotated[Path, typer.Argument(help="one shell command per line")],
    **values: Any,
) -> None:
    """Run every line of BATCH_FILE as a job, placed where its needs fit.

    execute_batch --sweep SWEEP.yaml runs a parameter sweep instead (ssh-scheduler sweep --help).
    """
    from ssh_scheduler.coordinator.early_hosts import suits as early_start_suits
    from ssh_scheduler.coordinator.preflight import check_numbers, check_results_dir
    from ssh_scheduler.jobs.batch_file import parse_batch
    from ssh_scheduler.jobs.needs import flag_needs
    from ssh_scheduler.machines.config import load_machines
    from ssh_scheduler.machines.machine import local_machine, with_keep_warm

    results_dir: Path = values["results_dir"]
    dry_run: bool = values["dry_run"]
    machines: list[str] | None = values["machines"]
    if values["detach"]:  # start the batch in the background (cli/detach.py)
        from ssh_scheduler.cli.detach import start_detached

        def again(status_fd: int) -> list[str]:  # this command once more, as the coordinator
            return command_argv(BATCH, {**values, "status_fd": status_fd}, [str(batch_file)], leave_out=("detach",))

        raise typer.Exit(start_detached(again, results_dir, json_events=values["json_events"], dry_run=dry_run))
    session: CoordinatorSession | None = None
    try:
        if values["status_fd"] is not None:  # we are that background run
            from ssh_scheduler.cli.detach import detached_session

            session = detached_session(results_dir, values["status_fd"])
        check_numbers(**values)
        if not dry_run:
            check_results_dir(results_dir)
        try:
            data = batch_file.read_bytes()
        except OSError as exc:
            raise SchedulerError(f"cannot read batch file {batch_file}: {exc.strerror}") from None
        jobs = parse_batch(data, str(batch_file), commands_mode=values["commands"])
        hosts = load_machines(machines, exclude=values["exclude_hosts"] or ()) if machines else [local_machine()]
        hosts = with_keep_warm(hosts, values["keep_warm"])
        flag_needs(values)  # a need out of range, like a bad --halt, is refused before any host is contacted
        if values["halt"]:
            from ssh_scheduler.planner.policy import parse_halt

            parse_halt(values["halt"])
        verbosity = verbosity_of(values)
        # The hosts can start their agents while we import and set the batch up (early_hosts.py);
        # not with -v, whose connection log would start before it is wired to the display.
        early = bool(machines) and not dry_run and session is None and verbosity <= 0 and early_start_suits(results_dir)

        def prepare(early_hosts: EarlyHosts | None) -> tuple[Batch, contextlib.AbstractContextManager[Any]]:
            from ssh_scheduler.coordinator.batch import Batch
            from ssh_scheduler.coordinator.batch_run import batch_options

            batch = Batch(jobs, hosts, batch_options(values), early=early_hosts)
            if session is not None:
                from ssh_scheduler.cli.detach import DetachedDisplay
                from ssh_scheduler.view.display import summary_lines

                def end() -> tuple[int, list[str]]:
                    return batch.summary.exit_code, summary_lines(batch.summary, results_dir)

                output = DetachedDisplay(session, verbosity, end)
                output.watch(batch)
                return batch, output
            return batch, batch_display(batch, json_events=values["json_events"], plain=values["plain"], verbosity=verbosity)

        if early:
            summary = run_with_early_hosts(
                hosts, prepare, accept_new=values["accept_new"], keepalive=values["keepalive"],
                lease=values["lease"], max_connecting=values["max_connecting"],
            )
        else:
            batch, display = prepare(None)
            stop = batch.request_stop
            if session is not None:
                from ssh_scheduler.cli.detach import DetachedDisplay

                assert isinstance(display, DetachedDisplay)
                stop = display.interrupt(stop)
            with display:
                summary = run_async(batch.run, stop)
    except SchedulerError as exc:
        raise fail(exc) from None
    except asyncio.CancelledError:
        err_line("cancelled: running jobs were killed")
        raise typer.Exit(130) from None
    if not dry_run:
        from ssh_scheduler.view.display import summary_lines

        for line in summary_lines(summary, results_dir):
            err_line(line)
    raise typer.Exit(summary.exit_code)


def run_with_early_hosts(
    machines: Sequence[Machine],
    prepare: Callable[[EarlyHosts | None], tuple[Batch, contextlib.AbstractContextManager[Any]]],
    **connect: Any,
) -> BatchSummary:
    """Start the hosts (early_hosts.py), set the batch up while they start their agents, run it."""
    from ssh_scheduler.coordinator.early_hosts import EarlyHosts

    batch: Batch | None = None
    main_task: asyncio.Task[Any] | None = None

    def interrupted() -> None:  # before the batch exists, a signal ends the start-up
        if batch is not None:
            batch.request_stop()
        elif main_task is not None:
            main_task.cancel()

    async def run() -> BatchSummary:
        nonlocal batch, main_task
        main_task = asyncio.current_task()
        early = EarlyHosts(machines, **connect)
        early.start()
        try:
            await early.agents_starting()  # the handshakes first, then our set-up beside the agents
            batch, display = prepare(early)
        except BaseException:
            await early.close()
            raise
        with display:
            return await batch.run()

    return run_async(run, interrupted)
