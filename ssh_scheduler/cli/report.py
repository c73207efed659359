"""``ssh-scheduler report [RESULTS_DIR] [-o report.html]``: a batch as one self-contained HTML
page (timeline, GPUs, summary, failures; a sweep's results and plots), of a running batch (a
snapshot), a finished, detached or killed one.

What the page shows is read by ``results/batch_history.py`` and laid out by
``view/report_data.py``; ``view/report_page.py`` writes it.  Only here: which folder (a sweep's
``--results-dir`` holds its batch in ``.jobs/``), and whether its coordinator still runs (it is
asked, as ``status`` asks it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from ssh_scheduler.cli.common import fail, out_line
from ssh_scheduler.errors import ConfigError, SchedulerError, plain_text

__all__ = ["report"]


def report(
    results_dir: Annotated[Path, typer.Argument(help="a batch's results folder, or a sweep's --results-dir")] = Path("job_results"),
    output: Annotated[Path, typer.Option("--output", "-o", help="the HTML file to write")] = Path("report.html"),
) -> None:
    """One self-contained HTML page of a batch: a timeline of every attempt per host and GPU, each
    GPU's memory and utilization, the summary and the failures; for a sweep also its results
    and each metric against each parameter.  Opens offline: nothing is fetched."""
    from ssh_scheduler.coordinator.control import ControlError, send_request
    from ssh_scheduler.results.batch_history import read_history
    from ssh_scheduler.results.results_table import ResultRow, read_results
    from ssh_scheduler.results.sweep_store import JOBS_FOLDER
    from ssh_scheduler.view.report_data import report_data
    from ssh_scheduler.view.report_page import render_page, write_page

    try:
        sweep = (results_dir / JOBS_FOLDER).is_dir()
        batch_dir = results_dir / JOBS_FOLDER if sweep else results_dir
        try:
            send_request(batch_dir, {"command": "status"}, timeout=5.0)
            running = True
        except (ControlError, OSError):
            running = False
        history = read_history(batch_dir, running=running, now=time.time())
        rows: list[ResultRow] = []
        if sweep:
            try:
                rows = read_results(results_dir)
            except ConfigError:
                rows = []  # no combination has its folder yet
            except (ValueError, TypeError) as exc:
                raise ConfigError(
                    f"a param.json under {plain_text(str(results_dir))} is not as the sweep wrote it ({exc}); "
                    "fix or remove it"
                ) from None
        title = results_dir.resolve().name or str(results_dir)
        write_page(output, render_page(report_data(history, title=title, sweep=rows)))
    except SchedulerError as exc:
        raise fail(exc) from None
    lanes = len({(a.host, g) for a in history.attempts for g in (a.gpus or (None,))})
    snapshot = "; a snapshot: the batch runs on" if running else ""
    out_line(f"report: {output} ({len(history.attempts)} attempts on {lanes} lanes{snapshot})")
