"""Checks made before connecting to any host, so a mistake costs a one-line error, not a
traceback after minutes of connecting (or a silently ignored option)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ssh_scheduler.errors import ConfigError

__all__ = ["check_numbers", "check_results_dir"]


def check_numbers(
    *,
    timeout: float | None = None,
    keepalive: float | None = None,
    retries: int = 0,
    lease: float = 60.0,
    probe_interval: float = 15.0,
) -> None:
    """Options that only make sense as positive numbers (``--retries`` may be 0)."""
    positive = {"--timeout": timeout, "--keepalive": keepalive, "--lease": lease, "--probe-interval": probe_interval}
    for flag, value in positive.items():
        if value is not None and not value > 0:  # "not >" also refuses NaN
            raise ConfigError(f"{flag} must be a positive number of seconds, not {value:g}")
    if retries < 0:
        raise ConfigError(f"--retries must be 0 or more, not {retries}")


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
