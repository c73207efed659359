"""The planner's vocabulary: the actions it returns, its options and the state it keeps per host
(per job: :mod:`ssh_scheduler.planner.phases`).

Actions are plain frozen values; the coordinator (``coordinator/batch.py``) performs them.  See
:mod:`ssh_scheduler.planner.plan` for who decides what.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssh_scheduler.events import Event
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.planner.allocate import MachineResources
from ssh_scheduler.planner.placement import Placement
from ssh_scheduler.planner.policy import HaltPolicy

__all__ = [
    "Action",
    "Cleanup",
    "Commit",
    "Discard",
    "HostSlot",
    "KillJob",
    "PlanOptions",
    "Reprobe",
    "Revive",
    "Say",
    "StartJob",
    "StopBatch",
]


# -- actions ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartJob:
    """Run ``job`` with ``placement`` (host and GPUs); ``resume``: take up the run a host kept
    going for an earlier coordinator instead of starting it."""

    job: Job
    placement: Placement
    attempt: int = 1
    resume: bool = False


@dataclass(frozen=True, slots=True)
class KillJob:
    """Kill the job's whole process tree.  ``reason``: ``timeout`` (the attempt then ends as
    timed out and its results are committed), ``halt`` or ``stop`` (the attempt is cancelled)."""

    job: str
    reason: str


@dataclass(frozen=True, slots=True)
class Commit:
    """Bring the ended attempt's results home; report with :meth:`Planner.job_committed`."""

    job: str


@dataclass(frozen=True, slots=True)
class Discard:
    """Remove the ended attempt's folder on its host without bringing anything home."""

    job: str
    host: str


@dataclass(frozen=True, slots=True)
class Reprobe:
    """Probe ``host`` now; report with :meth:`Planner.probe_landed` or ``probe_failed`` (the
    planner already coalesced and rate-limited these, see :mod:`ssh_scheduler.planner.probe_schedule`)."""

    host: str


@dataclass(frozen=True, slots=True)
class Revive:
    """Reconnect to a lost host with backoff; report with :meth:`Planner.host_back`."""

    host: str


@dataclass(frozen=True, slots=True)
class Cleanup:
    """End and remove what ``host``'s agent still holds for ``job`` (not ours to run there)."""

    host: str
    job: str


@dataclass(frozen=True, slots=True)
class StopBatch:
    """The second stop: cancel everything now (the coordinator exits with 130)."""


@dataclass(frozen=True, slots=True)
class Say:
    event: Event


Action = StartJob | KillJob | Commit | Discard | Reprobe | Revive | Cleanup | StopBatch | Say


# -- state -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanOptions:
    needs: Needs = Needs()
    gpus_explicit: bool = False
    """False: the default of one GPU per job quietly becomes none when no host has a GPU."""
    retries: int = 0
    timeout: float | None = None
    halt: HaltPolicy = HaltPolicy()
    quarantine_after: int = 3
    probe_interval: float = 15.0
    """Seconds between a host's periodic probes (``--probe-interval``)."""
    probe_gap: float = 1.0
    """The shortest time between a host's probes asked for by job ends."""
    probe_held_max: float = 8.0
    """The longest time between probes of a host whose GPUs other users hold while a job waits
    for a GPU (the wait doubles from ``probe_gap`` up to this, see
    :mod:`~ssh_scheduler.planner.probe_schedule`)."""
    copy_backs_per_host: int = 32
    """Copy-backs in flight on one host beyond which it starts no new job: a job's room is free
    at its exit, so thousands of short jobs could otherwise pile up commits (and their disk and
    transfer load) faster than they land."""


@dataclass(slots=True)
class HostSlot:
    name: str
    label: str  # how the header names it (the machine file, as the ancestor printed)
    resources: MachineResources | None = None
    down: str | None = None
    failures: int = 0  # outages in a row
    quarantined: bool = False
    reviving: bool = False
    answered: bool = False  # the first connect and probe landed or failed
    copying: int = 0  # our jobs that exited here and whose results are on their way home

    @property
    def usable(self) -> bool:
        return self.down is None and self.resources is not None and not self.quarantined
