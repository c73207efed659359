"""The planner: every decision of a batch as a pure state machine.  Events in, actions out.

The coordinator (``scheduler.py``) performs I/O and tells the planner what happened by calling
one method per event (a probe landed, a job started or exited, a host was lost or came back, a
timer fired, the user asked to stop); each method returns the :data:`Action` list to perform:
start a job on a host and GPUs, kill a job, discard or commit an attempt's results, re-probe,
revive a host, clean up what a host still holds, and :class:`Say` an event to the event stream.
Nothing here awaits, sleeps or touches a socket or a file (httpcore's connection pool and h11's
state machine are the models), so every rule is tested with plain values and replayed event
sequences (tests/test_plan.py).

What the planner owns: each host's :class:`~ssh_scheduler.planner.allocate.MachineResources` and its
lifecycle (up, down, quarantined), each job's phase and attempts, the queue (FIFO per kind of
needs, so a big GPU job waiting for room does not hold back small CPU jobs), dependencies
(``Job.after``), retries (preferably on a host where the job has not failed), requeue of jobs a
lost host took down, quarantine after repeated outages, ``--halt``, ``--timeout`` and the two
steps of stopping (drain, then kill).  A job's room is given back when its processes exit
(:meth:`Planner.job_exited`), so the next job starts there while the results travel home; its
end is final, and what waits for it with ``after`` may start, only at
:meth:`Planner.job_committed`.  In between it is ``copying``: not killed by ``--timeout``,
``--halt now`` or ``cancel`` (its processes are gone; killing would only lose its results), and
a host with ``copy_backs_per_host`` copy-backs in flight starts no new job until one lands.

The start of a batch (when it opens, hosts that answer late, jobs no host could ever fit,
reattachment) is the planner's base class, in :mod:`ssh_scheduler.planner.plan_start`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from ssh_scheduler.errors import UnsatisfiableError
from ssh_scheduler.events import (
    TIMED_OUT,
    BatchPaused,
    BatchResumed,
    Ended,
    HostBack,
    HostDown,
    HostQuarantined,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobPlaced,
    JobRequeued,
    JobRetrying,
    JobStarted,
    Notice,
    PlanLine,
    Stopping,
    Waiting,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.probe import HostState, OwnUsage
from ssh_scheduler.planner.actions import (
    FINAL_PHASES,
    Action,
    Cleanup,
    Commit,
    Discard,
    HostSlot,
    JobPhase,
    JobSlot,
    KillJob,
    PlanOptions,
    Reprobe,
    Revive,
    Say,
    StartJob,
    StopBatch,
)
from ssh_scheduler.planner.allocate import MachineResources, choose
from ssh_scheduler.planner.plan_start import PlannerStart
from ssh_scheduler.planner.policy import Resumable
from ssh_scheduler.planner.probe_schedule import ProbeSchedule

__all__ = [
    "Action",
    "Cleanup",
    "Commit",
    "Discard",
    "JobPhase",
    "KillJob",
    "PlanOptions",
    "Planner",
    "Reprobe",
    "Revive",
    "Say",
    "StartJob",
    "StopBatch",
]


class Planner(PlannerStart):
    """One batch's decisions.  Feed it events (method calls), perform what they return.

    The start (when the batch opens, hosts answering late) is in :class:`PlannerStart`."""

    def __init__(
        self,
        jobs: Sequence[Job],
        hosts: Sequence[tuple[str, str]],
        options: PlanOptions | None = None,
        *,
        resumable: Mapping[str, Resumable] | None = None,
        already_done: Mapping[str, bool] | None = None,
    ) -> None:
        """``hosts``: (name, label) pairs.  ``already_done``: jobs of the batch file that are not
        run now because results exist, with whether they succeeded (for ``after``)."""
        self.options = options = options or PlanOptions()
        self.hosts = {name: HostSlot(name, label) for name, label in hosts}
        self.jobs: dict[str, JobSlot] = {job.name: JobSlot(job) for job in jobs}
        self.resumable = dict(resumable or {})
        self.draining = False
        self.paused = False
        self.halted = False
        self.cancelled = False
        self.total = len(self.jobs)
        self.failures = 0
        self._queues: dict[Needs, deque[str]] = {}
        self._dependents: dict[str, list[str]] = {}
        self._last_wait = ""
        self._init_start()
        self.probes = ProbeSchedule(list(self.hosts), options.probe_interval, options.probe_gap)
        done = already_done or {}
        for slot in self.jobs.values():
            for name in slot.job.after:
                if name in self.jobs:
                    slot.waiting_on += 1
                    self._dependents.setdefault(name, []).append(slot.job.name)
                elif not done.get(name, True):
                    slot.phase = JobPhase.NOT_RUN  # reported by begin()
            if slot.waiting_on:
                slot.phase = JobPhase.BLOCKED

    # -- views ---------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Nothing runs or copies back, and nothing more will start."""
        if self._busy():
            return False
        if self.draining or self.halted:
            return True
        return not any(self._queues.values()) and not any(self._held.values())

    def phase(self, job: str) -> JobPhase:
        return self.jobs[job].phase

    def running(self) -> list[str]:
        """Jobs placed whose processes did not end yet (staging or running)."""
        return [name for name, slot in self.jobs.items() if slot.phase is JobPhase.RUNNING]

    def copying_back(self) -> list[str]:
        """Jobs that exited and whose results are on their way home (their room is free)."""
        return [name for name, slot in self.jobs.items() if slot.phase is JobPhase.COPYING]

    def _busy(self) -> bool:
        return any(slot.phase in (JobPhase.RUNNING, JobPhase.COPYING) for slot in self.jobs.values())

    def resources(self, host: str) -> MachineResources | None:
        return self.hosts[host].resources

    def host_of(self, job: str) -> str | None:
        placement = self.jobs[job].placement
        return placement.machine if placement is not None else None

    def unfinished(self) -> list[str]:
        """Jobs that did not reach an end (for the summary's "not run")."""
        return [
            name
            for name, slot in self.jobs.items()
            if slot.phase in (JobPhase.QUEUED, JobPhase.BLOCKED, JobPhase.NOT_RUN)
        ]

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (a ``--timeout``, a probe), or None."""
        times = []
        if self._began:
            due = self.probes.next_due(self._probe_targets(), self._jobs_waiting())
            if due is not None:
                times.append(due)
        if self.options.timeout is not None:
            starts = [
                slot.started_at
                for slot in self.jobs.values()
                if slot.phase is JobPhase.RUNNING and slot.started_at is not None and not slot.killing
            ]
            if starts:
                times.append(min(starts) + self.options.timeout)
        return min(times) if times else None

    def _probe_targets(self) -> list[str]:
        return [name for name, h in self.hosts.items() if h.usable]

    def _jobs_waiting(self) -> bool:
        return not (self.draining or self.paused) and any(self._queues.values())

    def dry_run(self) -> list[PlanLine]:
        """The schedule if jobs ended in the order they started (the placements of ``--dry-run``)."""
        running: deque[tuple[MachineResources, str]] = deque()
        machines = [h.resources for h in self.hosts.values() if h.usable and h.resources is not None]
        lines: list[PlanLine] = []
        for slot in self.jobs.values():
            if slot.phase in FINAL_PHASES:
                continue
            while True:
                target = choose(machines, slot.needs)
                if target is not None:
                    placement = target.allocate(slot.job.name, slot.needs)
                    running.append((target, slot.job.name))
                    lines.append(PlanLine(job=slot.job.name, host=target.name, gpus=placement.gpu_indices))
                    break
                if not running:
                    raise UnsatisfiableError(f"job {slot.job.name} fits on no host")
                done_on, done_job = running.popleft()
                done_on.release(done_job)
        for machine, name in running:
            machine.release(name)
        return lines

    def kick(self) -> list[Action]:
        """Place what fits now (after :meth:`begin` and any reattachment)."""
        return self._dispatch()

    # -- jobs ----------------------------------------------------------------------------------

    def job_started(self, job: str, now: float, slurm_job: str = "") -> list[Action]:
        """The job's inputs are on its host and its command is about to run (or, on a Slurm
        machine, Slurm runs it as ``slurm_job``)."""
        slot = self.jobs[job]
        slot.started_at = now
        assert slot.placement is not None
        return [
            Say(
                JobStarted(
                    job=job,
                    host=slot.placement.machine,
                    gpus=slot.placement.gpu_indices,
                    command=slot.job.command,
                    attempt=slot.attempt,
                    slurm_job=slurm_job,
                )
            )
        ]

    def job_exited(self, job: str, ended: Ended) -> list[Action]:
        """The attempt's processes are gone (or its host is).  Returns exactly one of
        :class:`Commit` / :class:`Discard` for a job that still needs its folder handled."""
        slot = self.jobs[job]
        placement = slot.placement
        assert placement is not None and slot.phase is JobPhase.RUNNING
        host = self.hosts[placement.machine]
        actions: list[Action] = []
        if host.resources is not None:
            host.resources.release(job)
        if ended.host_lost:
            actions += self._host_failed(host, ended.message or "connection lost")
            actions += self._requeue(slot, f"host {host.name} was lost")
            return actions + self._dispatch()
        host.failures = 0
        self.probes.released(host.name, slot.probes_before)
        if not ended.ok and slot.killing in (None, "timeout") and self._retry(slot):
            actions.append(
                Say(JobRetrying(job=job, host=host.name, code=ended.code, attempt=slot.attempt, attempts=self.options.retries + 1))
            )
            actions.append(Discard(job, host.name))
            return actions + self._dispatch()
        # Its processes are gone: its room went back above and the next job may start there
        # while its results travel home.  Its end is final only at job_committed (what waits
        # for it with ``after`` may read those results).
        slot.phase = JobPhase.COPYING
        host.copying += 1
        actions.append(Commit(job))
        return actions + self._dispatch()

    def job_committed(self, job: str, ended: Ended, bytes_received: int = 0, now: float | None = None) -> list[Action]:
        """The attempt's results are home (or could not be brought): the job's end is final."""
        slot = self.jobs[job]
        assert slot.placement is not None and slot.phase is JobPhase.COPYING
        host = slot.placement.machine
        self.hosts[host].copying -= 1
        seconds = (now - slot.started_at) if now is not None and slot.started_at is not None else 0.0
        actions: list[Action] = []
        if ended.ok:
            slot.phase = JobPhase.FINISHED
            actions.append(
                Say(JobFinished(job=job, host=host, command=slot.job.command, code=0, seconds=seconds, bytes_received=bytes_received))
            )
            for name in self._dependents.get(job, ()):
                waiting = self.jobs[name]
                waiting.waiting_on -= 1
                if waiting.waiting_on == 0 and waiting.phase is JobPhase.BLOCKED:
                    waiting.phase = JobPhase.QUEUED
                    self._enqueue(waiting)
            return actions + self._dispatch()
        slot.phase = JobPhase.FAILED
        self.failures += 1
        actions.append(
            Say(
                JobFailed(
                    job=job, host=host, command=slot.job.command, code=ended.code,
                    reason=ended.describe(), seconds=seconds, timed_out=ended.timed_out,
                    message=ended.message or "",
                    bytes_received=bytes_received,
                )
            )
        )
        actions += self._not_run_after(job)
        if self.options.halt.reached(self.failures, self.total) and not self.draining:
            self.halted = self.draining = True
            policy = self.options.halt
            actions.append(Say(Stopping(how="halt", reason=f"{self.failures} jobs failed (--halt {policy.when})")))
            if policy.when == "now":
                actions += self._kill_running("halt", but=job)
        return actions + self._dispatch()

    def job_cancelled(self, job: str) -> list[Action]:
        """The attempt was cancelled (stop, halt now) and its processes killed, or its copy-back
        was cancelled (the second stop cancels everything)."""
        slot = self.jobs[job]
        copying = slot.phase is JobPhase.COPYING
        slot.phase = JobPhase.CANCELLED
        host = slot.placement.machine if slot.placement is not None else ""
        if copying:  # released at its exit
            self.hosts[host].copying -= 1
        elif slot.placement is not None and (resources := self.hosts[host].resources) is not None:
            resources.release(job)
            self.probes.released(host, slot.probes_before)
        actions: list[Action] = [Say(JobCancelled(job=job, host=host))]
        if slot.killing == "cancel":  # this job alone (ssh-scheduler cancel): the batch goes on
            actions += self._not_run_after(job, "was cancelled")
            actions += self._dispatch()
        return actions

    def tick(self, now: float) -> list[Action]:
        """Time passed: kill the jobs past ``--timeout``, probe the hosts that are due."""
        actions: list[Action] = []
        if self._began:
            actions += [Reprobe(h) for h in self.probes.start_due(self._probe_targets(), self._jobs_waiting(), now)]
        timeout = self.options.timeout
        if timeout is None:
            return actions
        for name, slot in self.jobs.items():
            if (
                slot.phase is JobPhase.RUNNING
                and slot.started_at is not None
                and not slot.killing
                and now >= slot.started_at + timeout
            ):
                slot.killing = "timeout"
                actions.append(KillJob(name, "timeout"))
        return actions

    def timed_out(self, job: str) -> Ended:
        """How a job killed for ``--timeout`` ended (its own exit status is the kill's)."""
        return Ended(TIMED_OUT, timed_out=True, message=f"timed out after {self.options.timeout:g} s")

    def killed_for(self, job: str) -> str | None:
        return self.jobs[job].killing

    # -- hosts ---------------------------------------------------------------------------------

    def host_lost(self, host: str, reason: str) -> list[Action]:
        return self._host_failed(self.hosts[host], reason)

    def host_back(
        self,
        host: str,
        state: HostState,
        own: Mapping[str, OwnUsage] | None = None,
        agent_jobs: Mapping[str, bool] | None = None,
        now: float | None = None,
    ) -> list[Action]:
        """A revived host answered again and was probed."""
        slot = self.hosts[host]
        self.probes.landed(host, now)
        slot.reviving = False
        slot.down = None
        slot.resources = MachineResources(host, state)
        if own:
            slot.resources.update(state, own)
        actions: list[Action] = [Say(HostBack(host=host))]
        # Whatever it still runs for us was requeued elsewhere when it was lost: end it there.
        for name in agent_jobs or ():
            if self.host_of(name) != host or self.jobs[name].phase is not JobPhase.RUNNING:
                actions.append(Cleanup(host, name))
        return actions + self._dispatch()

    def revive_gave_up(self, host: str) -> None:
        self.hosts[host].reviving = False

    # -- stopping ------------------------------------------------------------------------------

    def stop(self) -> list[Action]:
        """First call: start nothing new, let running jobs finish.  Second: kill them."""
        if not self.draining:
            self.draining = True
            return [Say(Stopping(how="drain"))]
        self.cancelled = True
        return [Say(Stopping(how="kill")), *self._kill_running("stop"), StopBatch()]

    # -- control from another terminal (ssh-scheduler pause / resume / cancel) ----------------

    def pause(self) -> list[Action]:
        """Start nothing new until :meth:`resume`; what runs goes on."""
        if self.paused:
            return []
        self.paused = True
        return [Say(BatchPaused())]

    def resume(self) -> list[Action]:
        if not self.paused:
            return []
        self.paused = False
        self._last_wait = ""
        return [Say(BatchResumed()), *self._dispatch()]

    def cancel(self, job: str) -> list[Action]:
        """Kill ``job`` if it runs, or take it out of the queue; the jobs waiting for it will not
        run.  A job that already ended (or is unknown) is left as it is, with a warning."""
        slot = self.jobs.get(job)
        if slot is None or slot.phase in FINAL_PHASES:
            state = "is not part of this batch" if slot is None else f"already {slot.phase.value}"
            return [Say(Notice(level="warning", message=f"cancel {job}: {state}"))]
        if slot.phase is JobPhase.COPYING:
            message = f"cancel {job}: it already ended; its results are being copied back"
            return [Say(Notice(level="warning", message=message))]
        if slot.phase is JobPhase.RUNNING:
            if slot.killing:
                return []
            slot.killing = "cancel"
            return [KillJob(job, "cancel")]
        self._dequeue(slot)
        slot.phase = JobPhase.CANCELLED
        return [Say(JobCancelled(job=job, host="")), *self._not_run_after(job, "was cancelled"), *self._dispatch()]

    # -- internals -----------------------------------------------------------------------------

    def _enqueue(self, slot: JobSlot, front: bool = False) -> None:
        queue = self._queues.setdefault(slot.needs, deque())
        if front:
            queue.appendleft(slot.job.name)
        else:
            queue.append(slot.job.name)

    def _dequeue(self, slot: JobSlot) -> None:
        queue = self._queues.get(slot.needs)
        if queue is not None and slot.job.name in queue:
            queue.remove(slot.job.name)

    def _dispatch(self) -> list[Action]:
        if not self._began or self.draining or self.paused:
            return []
        bound = self.options.copy_backs_per_host
        usable = [
            h.resources for h in self.hosts.values() if h.usable and h.resources is not None and h.copying < bound
        ]
        actions: list[Action] = []
        for needs, queue in self._queues.items():
            while queue:
                slot = self.jobs[queue[0]]
                machines = usable
                if slot.failed_on:
                    avoid = set(slot.failed_on)
                    machines = [m for m in usable if m.name not in avoid] or usable
                target = choose(machines, needs)
                if target is None:
                    break
                queue.popleft()
                placement = target.allocate(slot.job.name, needs)
                slot.phase, slot.placement, slot.started_at, slot.killing = JobPhase.RUNNING, placement, None, None
                slot.probes_before = self.probes.hosts[target.name].landed
                self._placed_any = True
                actions.append(
                    Say(JobPlaced(job=slot.job.name, host=target.name, gpus=placement.gpu_indices, command=slot.job.command))
                )
                actions.append(StartJob(slot.job, placement, slot.attempt))
        if actions or not any(self._queues.values()):
            self._last_wait = ""
            return actions
        if self._busy():  # a job's end (or a copy-back landing) makes room
            return actions
        # Nothing of ours runs and nothing fits.
        if not any(h.usable or h.reviving for h in self.hosts.values()):
            self.draining = True
            actions.append(Say(Notice(level="error", message="every host is down or quarantined; the remaining jobs were not run")))
            return actions
        head = next(q[0] for q in self._queues.values() if q)
        reason = "; ".join(
            f"{h.name}: {h.resources.capacity_summary()}" for h in self.hosts.values() if h.usable and h.resources is not None
        ) or "; ".join(f"{h.name}: down" for h in self.hosts.values())
        if reason != self._last_wait:
            self._last_wait = reason
            actions.append(Say(Waiting(job=head, reason=reason)))
        return actions

    def _retry(self, slot: JobSlot) -> bool:
        """--retries: a failed job runs again, preferably on a host where it has not failed."""
        assert slot.placement is not None
        slot.failed_on.append(slot.placement.machine)
        if len(slot.failed_on) > self.options.retries or self.draining:
            return False
        slot.attempt += 1
        slot.phase = JobPhase.QUEUED
        self._enqueue(slot, front=True)
        return True

    def _requeue(self, slot: JobSlot, reason: str) -> list[Action]:
        assert slot.placement is not None
        host = slot.placement.machine
        slot.phase = JobPhase.QUEUED
        self._enqueue(slot, front=True)
        return [Say(JobRequeued(job=slot.job.name, host=host, reason=reason))]

    def _host_failed(self, host: HostSlot, reason: str) -> list[Action]:
        actions: list[Action] = []
        if host.down is None:
            # One outage counts once, however many of our jobs it took down with it.
            host.failures += 1
            host.down = reason
            actions.append(Say(HostDown(host=host.name, reason=reason)))
        if host.failures >= self.options.quarantine_after and not host.quarantined:
            host.quarantined = True
            actions.append(Say(HostQuarantined(host=host.name, failures=host.failures)))
        return actions + self._revive(host)

    def _revive(self, host: HostSlot) -> list[Action]:
        if host.quarantined or host.reviving:
            return []
        host.reviving = True
        return [Revive(host.name)]

    def _kill_running(self, reason: str, but: str | None = None) -> list[Action]:
        actions: list[Action] = []
        for name, slot in self.jobs.items():
            if slot.phase is JobPhase.RUNNING and name != but and not slot.killing:
                slot.killing = reason
                actions.append(KillJob(name, reason))
        return actions

    def _not_run_after(self, failed: str, why: str = "failed") -> list[Action]:
        """Jobs waiting (directly or not) for a job that failed will not run in this batch."""
        actions: list[Action] = []
        stack = list(self._dependents.get(failed, ()))
        while stack:
            slot = self.jobs[stack.pop()]
            if slot.phase is not JobPhase.BLOCKED:
                continue
            slot.phase = JobPhase.NOT_RUN
            actions.append(Say(JobNotRun(job=slot.job.name, reason=f"{failed} {why}")))
            stack.extend(self._dependents.get(slot.job.name, ()))
        return actions
