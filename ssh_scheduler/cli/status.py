"""``ssh-scheduler status`` / ``jobs`` (read the journal) and ``pause`` / ``resume`` /
``cancel`` (ask the running coordinator over its control socket); ``status`` also shows the
connections the hub keeps warm (cli/hub.py).

The results folder and the socket are input like any other: a journal or reply that is not what
ssh_scheduler writes is one error line (``results.journal.read_journal``,
``coordinator.control.send_request`` check them); every line goes out through the sanitizing
printers of ``cli.common``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ssh_scheduler.cli.common import err_line, out_line
from ssh_scheduler.cli.hub import hub_lines
from ssh_scheduler.coordinator.control import ControlError, NoCoordinator, send_request
from ssh_scheduler.coordinator.detach import LOG_NAME, coordinator_header
from ssh_scheduler.errors import SchedulerError, plain_text
from ssh_scheduler.jobs.options import option
from ssh_scheduler.results.journal import JOURNAL_NAME, read_journal
from ssh_scheduler.results.status import fold_journal, joblog_lines, status_json, status_lines
from ssh_scheduler.transport.hub_ask import hub_status

ResultsArg = Annotated[Path, typer.Argument(help="the batch's results folder")]
ResultsOpt = Annotated[Path, typer.Option("--results-dir", help="the batch's results folder")]


def _echo(line: str) -> None:
    out_line(line)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_line(f"error: {message}")
    return typer.Exit(code)


def _journal(results_dir: Path) -> list[dict[str, Any]]:
    if not os.path.lexists(results_dir / JOURNAL_NAME):
        raise _fail(f"{plain_text(results_dir)} holds no batch journal ({JOURNAL_NAME}); pass the results folder of a batch")
    try:
        return read_journal(results_dir)
    except SchedulerError as exc:
        raise _fail(str(exc), exc.exit_code) from None


def status(
    results_dir: ResultsArg = Path("job_results"),
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Counts, running jobs with their host and GPUs, and failures of a batch (running or not);
    and the connections the hub keeps warm, when one runs."""
    hubs = hub_status()
    if hubs and not (results_dir / JOURNAL_NAME).is_file():
        if json_output:
            _echo(json.dumps({"hub": hubs}))
        else:
            for line in hub_lines(hubs):
                _echo(line)
        return
    batch = fold_journal(_journal(results_dir))
    coordinator: dict[str, Any] | None = None
    try:
        coordinator = send_request(results_dir, {"command": "status"})
    except NoCoordinator:
        pass
    except ControlError as exc:  # a socket that is not our coordinator's: said, then ignored
        err_line(f"warning: {exc}")
    if json_output:
        _echo(json.dumps({**status_json(batch, results_dir, coordinator), **({"hub": hubs} if hubs else {})}))
        return
    for line in status_lines(batch, results_dir, coordinator, time.time()):
        _echo(line)
    header = coordinator_header(results_dir)
    # Every run keeps an event file; only a detached one has a log (files before the flag: detached).
    detached = header is not None and header.get("detached", True) is True
    if coordinator is not None and detached and header is not None and header.get("pid") == coordinator.get("pid"):
        _echo(f"  detached: its log is {results_dir}/{LOG_NAME}; ssh-scheduler attach follows it")
    for line in hub_lines(hubs) if hubs else ():
        _echo(line)


def jobs(results_dir: ResultsArg = Path("job_results")) -> None:
    """Every ended job as GNU parallel's --joblog (TSV)."""
    for line in joblog_lines(fold_journal(_journal(results_dir))):
        _echo(line)


def _ask(results_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    try:
        return send_request(results_dir, request)
    except SchedulerError as exc:
        raise _fail(str(exc), exc.exit_code) from None


def pause(results_dir: ResultsOpt = Path("job_results")) -> None:
    """Start no new job in the running batch until `resume`; running jobs go on."""
    reply = _ask(results_dir, {"command": "pause"})
    _echo(f"paused ({len(reply.get('running', []))} jobs still running)")


def resume(results_dir: ResultsOpt = Path("job_results")) -> None:
    """Let the running batch start jobs again."""
    _ask(results_dir, {"command": "resume"})
    _echo("resumed")


def cancel(
    job_names: Annotated[list[str] | None, typer.Argument(help="jobs to kill (running) or drop (waiting); none: the whole batch", metavar="[JOB...]")] = None,
    results_dir: ResultsOpt = Path("job_results"),
    stop_all: Annotated[bool, typer.Option("--all", help="stop the whole batch: kill its jobs, clean its hosts")] = False,
) -> None:
    """Kill the named jobs of the running batch (or take them out of its queue); with no names
    (or --all) stop the whole batch as Ctrl-C twice would, and wait until it has."""
    if job_names and stop_all:
        raise _fail("name jobs or pass --all, not both")
    if job_names:
        _ask(results_dir, {"command": "cancel", "jobs": job_names})
        _echo(f"cancelled: {' '.join(job_names)}")
        return
    reply = _ask(results_dir, {"command": "stop"})
    _echo(
        f"stopping the batch (pid {reply.get('pid', '?')}): killing {len(reply.get('running', []))} running jobs, "
        "cleaning its hosts"
    )
    _echo("stopped" if wait_for_exit(reply) else "still stopping; ssh-scheduler status shows when it has")


def wait_for_exit(reply: dict[str, Any], limit: float = 120.0) -> bool:
    """Wait until the coordinator that sent ``reply`` has ended (seen only on its own host)."""
    import socket

    if reply.get("host") != socket.gethostname() or not isinstance(reply.get("pid"), int):
        return False
    deadline = time.monotonic() + limit
    while True:
        try:
            os.kill(int(reply["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it exists
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def doctor(
    machines: Annotated[list[str], typer.Option("--machines", help="machine YAML files, ~/.ssh/config aliases or ranges")],
    accept_new: Annotated[bool, typer.Option("--accept-new", help="trust and record unknown host keys")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="one JSON list, an object per host")] = False,
    keep_warm: Annotated[float | None, typer.Option(*option("keep_warm").flags, help=option("keep_warm").help)] = None,
) -> None:
    """Check every host at once; exit 0 only when all pass."""
    import asyncio

    from ssh_scheduler.coordinator.doctor import check_hosts, report_json, report_lines
    from ssh_scheduler.machines.config import load_machines
    from ssh_scheduler.machines.machine import with_keep_warm

    try:
        hosts = with_keep_warm(load_machines(machines), keep_warm)
    except SchedulerError as exc:
        raise _fail(str(exc), exc.exit_code) from None
    reports = asyncio.run(check_hosts(hosts, accept_new=accept_new))
    if json_output:
        _echo(json.dumps(report_json(reports)))
    else:
        for line in report_lines(reports):
            _echo(line)
    raise typer.Exit(0 if all(r.ok for r in reports) else 1)


COMMANDS: dict[str, Callable[..., None]] = {"doctor": doctor, "status": status, "jobs": jobs, "pause": pause, "resume": resume, "cancel": cancel}
