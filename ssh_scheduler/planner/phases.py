"""A job's life in the planner: its slot, its phases, and the one table of moves between them.

h11's ``_state.py`` is the model: the moves a job may make are data (:data:`TRANSITIONS`, each
with the event that makes it), and every change of a job's phase goes through :func:`move`,
which refuses a move the table does not list.  Such a move is a bug in the planner (an event
handled in a phase it cannot happen in), never a user's error: it raises :class:`PlannerBug`
at once instead of letting a job run twice, end twice or never end.

A job starts :attr:`~JobPhase.QUEUED`, or :attr:`~JobPhase.BLOCKED` while it waits for jobs in
its ``after``, or :attr:`~JobPhase.NOT_RUN` when a job it waits for failed in an earlier run.
The four final phases (:data:`FINAL_PHASES`) have no way out: a job ends once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.planner.placement import Placement

__all__ = ["FINAL_PHASES", "TRANSITIONS", "JobPhase", "JobSlot", "PlannerBug", "move", "require"]


class JobPhase(Enum):
    BLOCKED = "blocked"  # waits for jobs in ``after``
    QUEUED = "queued"
    RUNNING = "running"  # placed: staging or running
    COPYING = "copying"  # exited, its results on their way home: its room is free again
    FINISHED = "finished"
    FAILED = "failed"
    NOT_RUN = "not_run"
    CANCELLED = "cancelled"


FINAL_PHASES = frozenset({JobPhase.FINISHED, JobPhase.FAILED, JobPhase.NOT_RUN, JobPhase.CANCELLED})

TRANSITIONS: Mapping[JobPhase, Mapping[JobPhase, str]] = {
    JobPhase.BLOCKED: {
        JobPhase.QUEUED: "job_committed: the last job it waits for finished",
        JobPhase.NOT_RUN: "a job it waits for failed, was cancelled or will not run",
        JobPhase.CANCELLED: "cancel: taken out before it could run",
    },
    JobPhase.QUEUED: {
        JobPhase.RUNNING: "placed on a host with room, or taken up where an earlier run left it",
        JobPhase.NOT_RUN: "every host answered and none could ever fit it",
        JobPhase.CANCELLED: "cancel: taken out of the queue; or the second stop while it waited",
    },
    JobPhase.RUNNING: {
        JobPhase.COPYING: "job_exited: its processes are gone, its results travel home",
        JobPhase.QUEUED: "job_exited: it failed and is retried, or its host was lost",
        JobPhase.CANCELLED: "job_cancelled: killed by stop, --halt now or cancel",
    },
    JobPhase.COPYING: {
        JobPhase.FINISHED: "job_committed: it exited 0 and its results are home",
        JobPhase.FAILED: "job_committed: it failed, or its results could not be brought home",
        JobPhase.CANCELLED: "job_cancelled: the second stop cancelled its copy-back",
    },
    JobPhase.FINISHED: {},
    JobPhase.FAILED: {},
    JobPhase.NOT_RUN: {},
    JobPhase.CANCELLED: {},
}
"""Each phase's allowed next phases, with the event that moves a job there."""


class PlannerBug(RuntimeError):
    """The planner broke its own rules (a job moved between phases the table does not allow).

    Not a :class:`~ssh_scheduler.errors.SchedulerError`: nothing a user did or can fix causes
    it, so it is not turned into a one-line message but fails loudly, with its traceback."""


@dataclass(slots=True)
class JobSlot:
    """What the planner keeps per job.  Its ``phase`` changes only through :func:`move`, which
    also keeps ``tally``, the count of jobs per phase that every job of a batch shares (so
    "does anything run?" is not a walk over every job after every event)."""

    job: Job
    needs: Needs = Needs()
    phase: JobPhase = JobPhase.QUEUED
    attempt: int = 1
    failed_on: list[str] = field(default_factory=list)
    placement: Placement | None = None
    started_at: float | None = None
    killing: str | None = None
    waiting_on: int = 0
    probes_before: int = 0  # probes its host had seen when it was placed (see probe_schedule)
    tally: Counter[JobPhase] = field(default_factory=Counter, repr=False, compare=False)


def move(slot: JobSlot, to: JobPhase) -> None:
    """Move the job to phase ``to``; :class:`PlannerBug` if :data:`TRANSITIONS` does not allow it."""
    if to not in TRANSITIONS[slot.phase]:
        allowed = ", ".join(phase.value for phase in TRANSITIONS[slot.phase]) or "none: it ended"
        raise PlannerBug(
            f"bug: job {slot.job.name} cannot go from {slot.phase.value} to {to.value} "
            f"(from {slot.phase.value}: {allowed})"
        )
    slot.tally[slot.phase] -= 1
    slot.tally[to] += 1
    slot.phase = to


def require(slot: JobSlot, event: str, *phases: JobPhase) -> None:
    """:class:`PlannerBug` unless the job is in one of ``phases``: ``event`` cannot happen to it
    otherwise (checked before the event changes anything)."""
    if slot.phase not in phases:
        raise PlannerBug(f"bug: {event} for job {slot.job.name}, which is {slot.phase.value}")
