"""Checks made before connecting to any host, so a mistake costs a one-line error, not a
traceback after minutes of connecting (or a silently ignored option)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.jobs.options import option

__all__ = ["check_numbers", "check_results_dir"]


def check_numbers(**values: object) -> None:
    """The given options (by name) whose table entry asks for a check: ``seconds`` only make sense
    as a positive number, a ``count`` (``--retries``) may be 0.  ``None`` is not given."""
    for name, value in values.items():
        check, flag = option(name).check, option(name).flag
        if not check or not isinstance(value, int | float):  # None: not given
            continue
        if check == "seconds" and not value > 0:  # "not >" also refuses NaN
            raise ConfigError(f"{flag} must be a positive number of seconds, not {value:g}")
        if check == "count" and value < 0:
            raise ConfigError(f"{flag} must be 0 or more, not {value}")


def check_results_dir(results_dir: Path) -> None:
    """The results folder must be a folder we can create files in (tried, not guessed from the
    mode bits: root ignores those, a read-only mount does not)."""
    if results_dir.exists() and not results_dir.is_dir():
        raise ConfigError(f"{results_dir} is a file, not a folder; remove it or pass another --results-dir")
    existing = results_dir
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(f"cannot create {results_dir}: {existing} is a file")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=existing)
    except OSError as exc:
        where = "the working folder" if existing.resolve() == Path.cwd().resolve() else str(existing)
        raise ConfigError(
            f"cannot write results into {results_dir}: {where} is not writable ({exc.strerror}); "
            "run from a folder you can write to or pass --results-dir"
        ) from None
    os.close(fd)
    os.unlink(probe)
