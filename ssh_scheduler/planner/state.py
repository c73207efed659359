"""What the planner's parts share, explicitly: one :class:`PlanState` per batch.

The :class:`~ssh_scheduler.planner.plan.Planner` (a job's lifecycle, hosts, stopping), its
:class:`~ssh_scheduler.planner.plan_start.BatchStart` (when the batch opens, hosts that answer
late) and :func:`~ssh_scheduler.planner.dispatch.dispatch` (placing what fits) each hold the same
:class:`PlanState` and change it only through its fields and the few moves all of them make:
the queue, a job's dependents, reviving a host.  Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ssh_scheduler.events import JobNotRun
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.planner.actions import Action, HostSlot, PlanOptions, Revive, Say
from ssh_scheduler.planner.allocate import MachineResources
from ssh_scheduler.planner.phases import FINAL_PHASES, JobPhase, JobSlot, move
from ssh_scheduler.planner.policy import Resumable
from ssh_scheduler.planner.probe_schedule import ProbeSchedule

__all__ = ["FAILED_EARLIER", "PlanState"]

_ENDED_AS = {JobPhase.FAILED: "failed", JobPhase.CANCELLED: "was cancelled"}

FAILED_EARLIER = "failed in an earlier run (--retry-failed reruns it)"
"""Why a job whose ``after`` failed in an earlier run is not run (after that job's name)."""


@dataclass(slots=True, eq=False)
class PlanState:
    """One batch's hosts and jobs, its queue and dependencies, and the flags every part reads."""

    options: PlanOptions
    hosts: dict[str, HostSlot]
    jobs: dict[str, JobSlot]
    resumable: dict[str, Resumable]
    """Jobs an earlier run of this batch left running on a host (to take up there)."""
    probes: ProbeSchedule
    dependents: dict[str, list[str]] = field(default_factory=dict)
    """Job -> the jobs of this batch that wait for it (``after``)."""
    failed_before: dict[str, str] = field(default_factory=dict)
    """Job -> a job it waits for that failed in an earlier run: it is not run."""
    queues: dict[Needs, deque[str]] = field(default_factory=dict)
    """The queue: FIFO per kind of needs, so a big GPU job waiting for room does not hold back
    small CPU jobs."""
    began: bool = False
    """BatchStarted was said: jobs may be placed."""
    draining: bool = False
    """Start nothing new (stop, --halt, or every host gone)."""
    paused: bool = False
    open: bool = False
    """The batch takes more jobs (``Planner.jobs_added``) until its owner closes it: it is not
    done while open, even with nothing queued (``ssh_scheduler.Executor``'s batch)."""
    base_needs: Needs | None = None
    """The batch's needs as settled when it opened (the default GPU dropped on a fleet without
    any): jobs added later are settled with them."""
    done_before: Mapping[str, bool] = field(default_factory=dict)
    """Jobs not run now because results exist, with whether they succeeded (for ``after``)."""
    last_wait: str = ""
    """The reason of the last Waiting said (each reason is said once)."""
    tally: Counter[JobPhase] = field(default_factory=Counter)
    """Jobs per phase, shared by every job's slot and kept by :func:`~ssh_scheduler.planner.phases.move`."""

    @classmethod
    def new(
        cls,
        jobs: Sequence[Job],
        hosts: Sequence[tuple[str, str]],
        options: PlanOptions,
        resumable: Mapping[str, Resumable],
        already_done: Mapping[str, bool],
    ) -> PlanState:
        """The state before anything happened: each job QUEUED, BLOCKED while it waits for jobs
        of this batch, or NOT_RUN when one it waits for failed in an earlier run (``already_done``:
        jobs not run now because results exist, with whether they succeeded)."""
        state = cls(
            options,
            {name: HostSlot(name, label) for name, label in hosts},
            {},
            dict(resumable),
            ProbeSchedule(
                [name for name, _ in hosts], options.probe_interval, options.probe_gap, options.probe_held_max
            ),
            done_before=dict(already_done),
        )
        state.add(jobs)
        return state

    def add(self, jobs: Sequence[Job]) -> list[tuple[JobSlot, str]]:
        """New slots for ``jobs`` (names not in the batch yet): QUEUED, BLOCKED while they wait
        for jobs of this batch, or NOT_RUN when one they wait for failed (in an earlier run: it
        is in :attr:`failed_before`, reported when the batch opens; in this one: returned, with
        the reason, for the caller to report).  Every NOT_RUN slot comes with its reason, also
        when the job it waits for failed in an earlier run: a job added after the opening is
        told then, not at the opening."""
        names = {job.name for job in jobs}
        added: list[tuple[JobSlot, str]] = []
        for job in jobs:
            waiting_on = 0
            reason = ""
            for name in job.after:
                there = self.jobs.get(name)
                if name in names or (there is not None and there.phase not in FINAL_PHASES):
                    waiting_on += 1
                    self.dependents.setdefault(name, []).append(job.name)
                elif there is not None and there.phase is not JobPhase.FINISHED:
                    reason = reason or f"{name} {_ENDED_AS.get(there.phase, 'will not run')}"
                elif there is None and not self.done_before.get(name, True):
                    self.failed_before.setdefault(job.name, name)
                    reason = reason or f"{name} {FAILED_EARLIER}"
            if job.name in self.failed_before or reason:  # failed_before: reported at the opening
                phase = JobPhase.NOT_RUN
            else:
                phase = JobPhase.BLOCKED if waiting_on else JobPhase.QUEUED
            slot = self.jobs[job.name] = JobSlot(job, phase=phase, waiting_on=waiting_on, tally=self.tally)
            self.tally[phase] += 1
            added.append((slot, reason))
        return added

    @property
    def total(self) -> int:
        return len(self.jobs)

    # -- the queue -----------------------------------------------------------------------------

    def enqueue(self, slot: JobSlot, front: bool = False) -> None:
        queue = self.queues.get(slot.needs)
        if queue is None:  # (not setdefault: its deque would be made for every job)
            queue = self.queues[slot.needs] = deque()
        if front:
            queue.appendleft(slot.job.name)
        else:
            queue.append(slot.job.name)

    def dequeue(self, slot: JobSlot) -> None:
        queue = self.queues.get(slot.needs)
        if queue is not None and slot.job.name in queue:
            queue.remove(slot.job.name)

    def queued(self) -> bool:
        """Some job waits in the queue."""
        return any(self.queues.values())

    # -- views ---------------------------------------------------------------------------------

    def busy(self) -> bool:
        """Some job of ours runs or copies its results back."""
        return self.tally[JobPhase.RUNNING] + self.tally[JobPhase.COPYING] > 0

    def usable(self) -> list[MachineResources]:
        """The resources of every host that may take jobs now."""
        return [h.resources for h in self.hosts.values() if h.usable and h.resources is not None]

    # -- moves every part makes ----------------------------------------------------------------

    def revive(self, host: HostSlot) -> list[Action]:
        """Have the coordinator reconnect to a host that is down (once, unless quarantined)."""
        if host.quarantined or host.reviving:
            return []
        host.reviving = True
        return [Revive(host.name)]

    def finished(self, job: str) -> None:
        """``job`` finished: each job that waited for it and nothing else any more is queued."""
        for name in self.dependents.get(job, ()):
            waiting = self.jobs[name]
            waiting.waiting_on -= 1
            if waiting.waiting_on == 0 and waiting.phase is JobPhase.BLOCKED:
                move(waiting, JobPhase.QUEUED)
                self.enqueue(waiting)

    def not_run_after(self, failed: str, why: str = "failed") -> list[Action]:
        """Jobs waiting (directly or not) for a job that failed will not run in this batch."""
        actions: list[Action] = []
        stack = list(self.dependents.get(failed, ()))
        while stack:
            slot = self.jobs[stack.pop()]
            if slot.phase is not JobPhase.BLOCKED:
                continue
            move(slot, JobPhase.NOT_RUN)
            actions.append(Say(JobNotRun(job=slot.job.name, reason=f"{failed} {why}")))
            stack.extend(self.dependents.get(slot.job.name, ()))
        return actions
