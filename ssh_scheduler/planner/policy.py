"""Pure rules the coordinator applies: when to halt, what a rerun may reuse."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.results.journal import IN_FLIGHT


@dataclass(frozen=True, slots=True)
class HaltPolicy:
    """GNU parallel's ``--halt``: after ``count`` failures (or ``percent`` of all jobs), stop
    starting jobs and either let the running ones finish (``soon``) or kill them (``now``)."""

    when: str = "never"  # never | soon | now
    count: int | None = None
    percent: float | None = None

    def reached(self, failures: int, total: int) -> bool:
        if self.when == "never" or failures == 0:
            return False
        if self.count is not None:
            return failures >= self.count
        return self.percent is not None and failures * 100 >= self.percent * max(total, 1)


def parse_halt(text: str | None) -> HaltPolicy:
    """``now,fail=3``, ``soon,fail=10%``, ``never`` (also GNU parallel's ``now,fail=1`` form)."""
    if not text or text == "never":
        return HaltPolicy()
    match = re.fullmatch(r"(now|soon),fail=(\d+(?:\.\d+)?)(%?)", text.strip())
    if not match:
        raise ConfigError(
            f"--halt {text!r}: expected never, now,fail=N, soon,fail=N or soon,fail=N% "
            f"(e.g. --halt now,fail=1)"
        )
    when, number, percent = match.groups()
    if percent:
        return HaltPolicy(when, percent=float(number))
    if "." in number or int(number) < 1:
        raise ConfigError(f"--halt {text!r}: the failure count must be a whole number >= 1")
    return HaltPolicy(when, count=int(number))


@dataclass(frozen=True, slots=True)
class Resumable:
    """What the journal of an earlier run of the same batch says about one job."""

    job: str
    host: str
    gpus: tuple[int, ...]


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
