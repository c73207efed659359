"""What a batch run takes (its options), and which of its jobs run now.

Plain data and file-system reads of ``job_results/`` (the journal, existing results); no
connections.  The coordinator (:mod:`ssh_scheduler.coordinator.batch`) uses these.  The command
line's values become :class:`BatchOptions` through the option table
(:mod:`ssh_scheduler.jobs.options`), which says where each value goes (:func:`batch_options`).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.events import (
    EventBus,
    JobSkipped,
)
from ssh_scheduler.executors.session import DEFAULT_LEASE
from ssh_scheduler.executors.transfer import CopyLimits
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.forward import ForwardPolicy
from ssh_scheduler.jobs.needs import Needs, flag_needs
from ssh_scheduler.jobs.options import destined
from ssh_scheduler.planner.policy import HaltPolicy, Resumable, parse_halt
from ssh_scheduler.results.journal import IN_FLIGHT, JobState, batch_token, last_states
from ssh_scheduler.results.resume import changed_commands, in_flight

__all__ = ["BatchOptions", "Selection", "Selector", "batch_options", "select_jobs", "set_aside"]


@dataclass(frozen=True, slots=True)
class BatchOptions:
    needs: Needs = Needs()
    gpus_explicit: bool = False  # False: a GPU is wanted only if some host has one
    copy_forwards: tuple[str, ...] = (".",)
    copy_backwards: tuple[str, ...] | None = None
    results_dir: Path = Path("job_results")
    base_dir: Path = Path(".")
    dry_run: bool = False
    accept_new: bool = False
    probe_interval: float = 15.0
    max_connecting: int = 8
    """Hosts logging in at once: below sshd's default ``MaxStartups 10:30:100`` (from 10
    unauthenticated connections on, sshd starts dropping new ones); agents start outside it."""
    lease: float = DEFAULT_LEASE
    keepalive: float | None = None
    limits: CopyLimits = CopyLimits()
    retries: int = 0
    retry_failed: bool = False
    allow_changed: bool = False
    timeout: float | None = None
    halt: HaltPolicy = HaltPolicy()
    quarantine_after: int = 3
    forward: ForwardPolicy = ForwardPolicy()
    """What the copy forward may send (secrets, paths outside, size)."""
    echo_output: bool = False
    """Also copy every job's output to this process's stdout/stderr as it arrives."""


def batch_options(values: Mapping[str, Any], **fields: Any) -> BatchOptions:
    """The :class:`BatchOptions` that command-line ``values`` (by option name) ask for: each value
    goes where the option table says (``options.F``, ``limits.F``, ``forward.F``, the needs);
    ``fields`` set what the caller decides itself (a sweep's results folder)."""
    needs, gpus_explicit = flag_needs(values)
    direct = destined(values, "options")
    if "halt" in direct:
        direct["halt"] = parse_halt(direct["halt"])
    forward = destined(values, "forward")
    # Naming what to send is a confirmation too: only the default copy (.) stops above the limits.
    forward["confirmed"] = bool(forward.get("confirmed")) or bool(values.get("copy_forwards"))
    return BatchOptions(
        needs=needs,
        gpus_explicit=gpus_explicit,
        limits=CopyLimits(**destined(values, "limits")),
        forward=ForwardPolicy(**forward),
        **{**direct, **fields},
    )


def set_aside(results: Path, name: str) -> None:
    """--retry-failed keeps the failed attempt's results, under .failed/ (never deleted)."""
    aside = results / ".failed"
    aside.mkdir(exist_ok=True)
    n = 1
    while (aside / f"{name}.{n}").exists():
        n += 1
    target = aside / f"{name}.{n}"
    target.mkdir()
    os.rename(results / name, target / name)
    for suffix in (".out", ".err"):
        if (results / f"{name}{suffix}").exists():
            os.rename(results / f"{name}{suffix}", target / f"{name}{suffix}")


@dataclass(slots=True)
class Selection:
    """Which jobs of the batch file run now, and what an earlier run of it left."""

    pending: list[Job]
    token: str
    resumable: dict[str, Resumable]
    already_done: dict[str, bool]


def select_jobs(jobs: Sequence[Job], options: BatchOptions, bus: EventBus) -> Selection:
    """Skip jobs with results, set the batch token, and learn from an earlier run's journal."""
    return Selector(options, bus).select(jobs)


class Selector:
    """Which jobs run now, decided for a batch's first jobs and again for each job added to an
    open batch: the results folder and its journal are read once, at the start (a job added
    later cannot have results that were not there then: one run holds the folder)."""

    def __init__(self, options: BatchOptions, bus: EventBus) -> None:
        results = self.results = options.results_dir
        self.options, self.bus = options, bus
        if results.exists() and not results.is_dir():
            raise ConfigError(f"{results} is a file, not a folder; remove it or pass another --results-dir")
        if results.is_dir():
            for partial in results.glob(".partial-*"):
                shutil.rmtree(partial, ignore_errors=True)  # a copy cut short by a crash
        self.last = last_states(results)
        self.token = batch_token(results) or secrets.token_hex(8)
        # One listing instead of a stat per job (a 100,000-line batch).
        self.existing = set(os.listdir(results)) if results.is_dir() else set()

    def select(self, jobs: Sequence[Job]) -> Selection:
        """Skip jobs with results (rerun those that failed, with ``--retry-failed``); refuse
        jobs whose command changed since the journal recorded it (unless allowed)."""
        options, last = self.options, self.last
        pending: list[Job] = []
        done: dict[str, bool] = {}
        for job in jobs:
            if job.name not in self.existing:
                pending.append(job)
                continue
            failed = last.get(job.name, {}).get("state") == JobState.FAILED
            if options.retry_failed and failed:
                set_aside(self.results, job.name)
                self.existing.discard(job.name)
                pending.append(job)
                continue
            done[job.name] = not failed
            self.bus.publish(JobSkipped(job=job.name, line=job.line_number, failed=failed))
        changed = changed_commands(pending, last)
        if changed and not options.allow_changed:
            raise ConfigError(
                f"the command of {changed[0]}"
                + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
                + f" changed since {self.results}/.journal.jsonl recorded it; rerun with "
                f"--allow-changed to run the new commands, or use another --results-dir"
            )
        return Selection(pending, self.token, in_flight(pending, last), done)

    def left_running(self) -> dict[str, Resumable]:
        """Every job the journal says an earlier run placed or started and never saw end
        (an open batch: their jobs may join later, to be taken up where they run)."""
        return {
            name: Resumable(name, str(entry["host"]), tuple(int(g) for g in entry.get("gpus") or ()))
            for name, entry in self.last.items()
            if entry.get("state") in IN_FLIGHT and entry.get("host") and name not in self.existing
        }
