"""What a job's folder gets from its host's cache before the job runs.

Made by :func:`ssh_scheduler.executors.transfer.prepare_forward` once the inputs are in the
cache, carried by the run request (the agent links them as it starts the job: no round trip of
their own) or sent alone by :meth:`ssh_scheduler.executors.session.HostSession.stage`.  Its own
module because the session (which sends it) and the transfers (which make it) both need it and
the transfers import the session.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["StagePlan"]


class StagePlan(NamedTuple):
    files: list[tuple[str, str]]
    """(path in the job's folder, cache key) of each input file."""
    dirs: list[str]
    """Folders to create in the job's folder (the inputs' empty ones included)."""
