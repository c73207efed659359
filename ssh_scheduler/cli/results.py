"""``ssh-scheduler results``: a sweep's combinations as a table (text, CSV, TSV or JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ssh_scheduler.cli.common import err_line, fail, out_line
from ssh_scheduler.errors import SchedulerError

__all__ = ["results"]


def results(
    results_dir: Annotated[Path, typer.Argument(help="a sweep's --results-dir")] = Path("job_results"),
    as_csv: Annotated[bool, typer.Option("--csv", help="comma-separated values on stdout")] = False,
    as_tsv: Annotated[bool, typer.Option("--tsv", help="tab-separated values on stdout")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="a JSON list of records on stdout")] = False,
) -> None:
    """One row per combination of a sweep: varying parameters, state, metrics.json values."""
    from ssh_scheduler.results.results_table import (
        format_delimited,
        format_json,
        format_text,
        read_results,
        table,
    )

    if sum((as_csv, as_tsv, as_json)) > 1:
        err_line("error: choose one of --csv, --tsv, --json")
        raise typer.Exit(2)
    try:
        columns, body = table(read_results(results_dir))
    except SchedulerError as exc:
        raise fail(exc) from None
    if as_csv or as_tsv:
        text = format_delimited(columns, body, "," if as_csv else "\t")
    elif as_json:
        text = format_json(columns, body)
    else:
        text = format_text(columns, body)
    for line in text.split("\n"):  # each line through the sanitizing printer, as one line
        out_line(line)
