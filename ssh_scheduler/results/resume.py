"""What a rerun of a batch learns from the journal of an earlier run (pure: journal entries in,
plain values out): which jobs an earlier coordinator may have left running on a host, to be taken
up there (the planner's :class:`~ssh_scheduler.planner.policy.Resumable`), and which jobs'
commands changed since."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.planner.policy import Resumable
from ssh_scheduler.results.journal import IN_FLIGHT

__all__ = ["changed_commands", "in_flight"]


def changed_commands(jobs: Sequence[Job], last: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Jobs whose command differs from the one an earlier run recorded under the same name."""
    changed = []
    for job in jobs:
        recorded = last.get(job.name, {}).get("command")
        if recorded is not None and recorded != job.command:
            changed.append(job.name)
    return changed


def in_flight(jobs: Sequence[Job], last: Mapping[str, Mapping[str, Any]]) -> dict[str, Resumable]:
    """Jobs an earlier coordinator placed or started and never saw end: maybe still running."""
    found = {}
    for job in jobs:
        entry = last.get(job.name)
        if entry and entry.get("state") in IN_FLIGHT and entry.get("host"):
            gpus = tuple(int(g) for g in entry.get("gpus") or ())
            found[job.name] = Resumable(job.name, str(entry["host"]), gpus)
    return found
