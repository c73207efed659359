"""``combine_folders``: merge result folders (identical files collapse, conflicts are errors)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ssh_scheduler.cli.common import err_line, fail, out_line
from ssh_scheduler.errors import SchedulerError

__all__ = ["combine_folders"]


def combine_folders(
    dest: Annotated[Path, typer.Argument(help="folder to merge into")],
    sources: Annotated[list[Path], typer.Argument(help="folders to merge")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be copied")] = False,
) -> None:
    """Merge result folders: identical files collapse, conflicting ones are an error."""
    from ssh_scheduler.results.combine import combine_folders as combine

    try:
        report = combine(dest, sources, dry_run=dry_run, out=out_line, warn=err_line)
    except SchedulerError as exc:
        raise fail(exc) from None
    if not dry_run:
        err_line(f"combined: {report.copied} copied, {report.identical} identical")
