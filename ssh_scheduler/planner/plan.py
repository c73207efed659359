"""The planner: every decision of a batch as a pure state machine.  Events in, actions out.

The coordinator (``coordinator/batch.py``) performs I/O and tells the planner what happened by
calling one method per event (a probe landed, a job started or exited, a host was lost or came
back, a timer fired, the user asked to stop); each method returns the :data:`Action` list to
perform: start a job on a host and GPUs, kill a job, discard or commit an attempt's results,
re-probe, revive a host, clean up what a host still holds, and :class:`Say` an event to the
event stream.
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

The planner is composed of parts that share one :class:`~ssh_scheduler.planner.state.PlanState`:
the start of a batch (when it opens, hosts that answer late, jobs no host could ever fit,
reattachment) is a :class:`~ssh_scheduler.planner.plan_start.BatchStart` it holds and hands those
events; placing what fits is :func:`~ssh_scheduler.planner.dispatch.dispatch`; a job's phase
changes only through the one table of :mod:`ssh_scheduler.planner.phases`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    JobRequeued,
    JobRetrying,
    JobStarted,
    Notice,
    PlanLine,
    Stopping,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.planner.actions import (
    Action,
    Cleanup,
    Commit,
    Discard,
    HostSlot,
    KillJob,
    PlanOptions,
    Reprobe,
    Revive,
    Say,
    StartJob,
    StopBatch,
)
from ssh_scheduler.planner.allocate import MachineResources
from ssh_scheduler.planner.deadlines import next_deadline, tick
from ssh_scheduler.planner.dispatch import dispatch, dry_run
from ssh_scheduler.planner.phases import FINAL_PHASES, JobPhase, JobSlot, move, require
from ssh_scheduler.planner.plan_start import BatchStart
from ssh_scheduler.planner.policy import Resumable
from ssh_scheduler.planner.state import PlanState

# The actions are defined in ssh_scheduler.planner.actions; they are still named here for the
# coordinator, which takes them from this module with the Planner.
__all__ = [
    "Action",
    "Cleanup",
    "Commit",
    "Discard",
    "KillJob",
    "PlanOptions",
    "Planner",
    "Reprobe",
    "Revive",
    "Say",
    "StartJob",
    "StopBatch",
]


class Planner:
    """One batch's decisions.  Feed it events (method calls), perform what they return.

    The start (when the batch opens, hosts answering late) is its :class:`BatchStart`."""

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
        self.state = PlanState.new(jobs, hosts, options or PlanOptions(), resumable or {}, already_done or {})
        self.start = BatchStart(self.state)
        self.halted = False
        self.cancelled = False
        self.local_failed = False
        self.failures = 0

    # -- views ---------------------------------------------------------------------------------

    @property
    def options(self) -> PlanOptions:
        return self.state.options

    @property
    def hosts(self) -> dict[str, HostSlot]:
        return self.state.hosts

    @property
    def jobs(self) -> dict[str, JobSlot]:
        return self.state.jobs

    @property
    def draining(self) -> bool:
        """Nothing new starts (stop, ``--halt``, or every host gone)."""
        return self.state.draining

    @property
    def paused(self) -> bool:
        return self.state.paused

    @property
    def began(self) -> bool:
        """Jobs may be placed (the batch was announced)."""
        return self.state.began

    @property
    def answered(self) -> bool:
        """Every host's first connect and probe landed or failed."""
        return self.start.answered

    @property
    def done(self) -> bool:
        """Nothing runs or copies back, and nothing more will start."""
        if self.state.busy():
            return False
        if self.state.draining or self.halted:
            return True
        return not self.state.queued() and not self.start.holding

    def phase(self, job: str) -> JobPhase:
        return self.jobs[job].phase

    def running(self) -> list[str]:
        """Jobs placed whose processes did not end yet (staging or running)."""
        return [name for name, slot in self.jobs.items() if slot.phase is JobPhase.RUNNING]

    def copying_back(self) -> list[str]:
        """Jobs that exited and whose results are on their way home (their room is free)."""
        return [name for name, slot in self.jobs.items() if slot.phase is JobPhase.COPYING]

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
        return next_deadline(self.state)

    def dry_run(self) -> list[PlanLine]:
        """The schedule if jobs ended in the order they started (the placements of ``--dry-run``)."""
        return dry_run(self.state)

    def kick(self) -> list[Action]:
        """Place what fits now (after :meth:`begin` and any reattachment)."""
        return dispatch(self.state)

    # -- the start (see BatchStart) ------------------------------------------------------------

    def host_unreachable(self, host: str, reason: str) -> list[Action]:
        """Connecting failed at the start: the host is retried in the background."""
        return self.start.host_unreachable(host, reason)

    def probe_landed(
        self,
        host: str,
        state: HostState,
        own: Mapping[str, OwnUsage] | None = None,
        generation: int | None = None,
        *,
        agent_jobs: Mapping[str, bool] | None = None,
        now: float | None = None,
    ) -> list[Action]:
        """A probe of ``host`` landed.  ``agent_jobs``: with a host's first probe, what its agent
        still holds from an earlier run (see :meth:`agent_jobs_found`); ``now``: when (it times
        the next periodic probe)."""
        return self.start.probe_landed(host, state, own, generation, agent_jobs, now)

    def probe_failed(self, host: str, reason: str) -> list[Action]:
        """A probe failed: before the batch opened, the host did not answer (as
        :meth:`host_unreachable`); later, it is down (and revived in the background)."""
        slot = self.hosts[host]
        if not slot.answered or not self.state.began:
            return self.start.host_unreachable(host, reason)
        self.state.probes.failed(host)
        return self._host_failed(slot, reason)

    def begin(self, token: str) -> list[Action]:
        """Start the batch: it opens as soon as every host answered (now, if they all did), or
        earlier after :meth:`probes_overdue`.  Opening settles each job's needs, refuses a job
        no host could ever fit (before anything runs) and announces the batch; the jobs are
        placed by the event that opened it, or by :meth:`kick` when this call did."""
        return self.start.begin(token)

    def probes_overdue(self) -> list[Action]:
        """The coordinator waited long enough for the first probes: open with the hosts that
        answered; each other host takes jobs when it answers."""
        return self.start.probes_overdue()

    def agent_jobs_found(self, host: str, jobs: Mapping[str, bool]) -> list[Action]:
        """What a host's agent still holds from an earlier coordinator (job -> still running):
        take up what the journal says ran there and is still to do; end everything else."""
        return self.start.agent_jobs_found(host, jobs)

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
                    gpu_memory_mb=slot.placement.needs.gpu_memory_mb if slot.placement.gpu_indices else 0,
                )
            )
        ]

    def job_exited(self, job: str, ended: Ended) -> list[Action]:
        """The attempt's processes are gone (or its host is).  Returns exactly one of
        :class:`Commit` / :class:`Discard` for a job that still needs its folder handled."""
        slot = self.jobs[job]
        require(slot, "job_exited", JobPhase.RUNNING)
        placement = slot.placement
        assert placement is not None
        host = self.hosts[placement.machine]
        actions: list[Action] = []
        if host.resources is not None:
            host.resources.release(job)
        if ended.host_lost:
            actions += self._host_failed(host, ended.message or "connection lost")
            actions += self._requeue(slot, f"host {host.name} was lost")
            return actions + dispatch(self.state)
        host.failures = 0
        self.state.probes.released(host.name, slot.probes_before)
        if not ended.ok and slot.killing in (None, "timeout") and self._retry(slot):
            actions.append(
                Say(JobRetrying(job=job, host=host.name, code=ended.code, attempt=slot.attempt, attempts=self.options.retries + 1))
            )
            actions.append(Discard(job, host.name))
            return actions + dispatch(self.state)
        # Its processes are gone: its room went back above and the next job may start there
        # while its results travel home.  Its end is final only at job_committed (what waits
        # for it with ``after`` may read those results).
        move(slot, JobPhase.COPYING)
        host.copying += 1
        actions.append(Commit(job))
        return actions + dispatch(self.state)

    def job_committed(self, job: str, ended: Ended, bytes_received: int = 0, now: float | None = None) -> list[Action]:
        """The attempt's results are home (or could not be brought): the job's end is final."""
        slot = self.jobs[job]
        require(slot, "job_committed", JobPhase.COPYING)
        assert slot.placement is not None
        host = slot.placement.machine
        self.hosts[host].copying -= 1
        seconds = (now - slot.started_at) if now is not None and slot.started_at is not None else 0.0
        actions: list[Action] = []
        if ended.ok:
            move(slot, JobPhase.FINISHED)
            actions.append(
                Say(JobFinished(job=job, host=host, command=slot.job.command, code=0, seconds=seconds, bytes_received=bytes_received))
            )
            self.state.finished(job)
            return actions + dispatch(self.state)
        move(slot, JobPhase.FAILED)
        self.failures += 1
        actions.append(
            Say(
                JobFailed(
                    job=job, host=host, command=slot.job.command, code=ended.code,
                    reason=ended.describe(), seconds=seconds, timed_out=ended.timed_out,
                    message=ended.message or "",
                    bytes_received=bytes_received, kept=ended.kept_at or "",
                )
            )
        )
        actions += self.state.not_run_after(job)
        if self.options.halt.reached(self.failures, self.state.total) and not self.state.draining:
            self.halted = self.state.draining = True
            policy = self.options.halt
            actions.append(Say(Stopping(how="halt", reason=f"{self.failures} jobs failed (--halt {policy.when})")))
            if policy.when == "now":
                actions += self._kill_running("halt", but=job)
        return actions + dispatch(self.state)

    def job_cancelled(self, job: str) -> list[Action]:
        """The attempt was cancelled (stop, halt now) and its processes killed, or its copy-back
        was cancelled (the second stop cancels everything).

        The second stop cancels every task, also that of a failed attempt still removing its
        folder on its host while the job's retry waits in the queue (the job ends cancelled)
        or already ran: a job that ended is left as it is, it ends once."""
        slot = self.jobs[job]
        if slot.phase in FINAL_PHASES:
            return []
        was = slot.phase
        move(slot, JobPhase.CANCELLED)
        host = slot.placement.machine if slot.placement is not None else ""
        if was is JobPhase.COPYING:  # released at its exit
            self.hosts[host].copying -= 1
        elif was is JobPhase.QUEUED:  # its retry, or a requeue: nothing held
            self.state.dequeue(slot)
        elif slot.placement is not None and (resources := self.hosts[host].resources) is not None:
            resources.release(job)
            self.state.probes.released(host, slot.probes_before)
        actions: list[Action] = [Say(JobCancelled(job=job, host=host))]
        if slot.killing == "cancel":  # this job alone (ssh-scheduler cancel): the batch goes on
            actions += self.state.not_run_after(job, "was cancelled")
            actions += dispatch(self.state)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Time passed: kill the jobs past ``--timeout``, probe the hosts that are due."""
        return tick(self.state, now)

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
        slot.reviving = False
        slot.down = None
        slot.resources = MachineResources(host, state)
        if own:
            slot.resources.update(state, own)
        self.state.probes.landed(host, now, slot.resources.gpus_held_by_others)
        actions: list[Action] = [Say(HostBack(host=host))]
        # Whatever it still runs for us was requeued elsewhere when it was lost: end it there.
        for name in agent_jobs or ():
            if self.host_of(name) != host or self.jobs[name].phase is not JobPhase.RUNNING:
                actions.append(Cleanup(host, name))
        return actions + dispatch(self.state)

    def revive_gave_up(self, host: str) -> None:
        self.hosts[host].reviving = False

    # -- stopping ------------------------------------------------------------------------------

    def stop(self) -> list[Action]:
        """First call: start nothing new, let running jobs finish.  Second: kill them."""
        if not self.state.draining:
            self.state.draining = True
            return [Say(Stopping(how="drain"))]
        self.cancelled = True
        return [Say(Stopping(how="kill")), *self._kill_running("stop"), StopBatch()]

    def local_failure(self, reason: str) -> list[Action]:
        """Writing on this machine failed (a full disk, the batch's copy-back budget spent): the
        batch's failure, never a host's.  Nothing new starts (and nothing is retried); running
        jobs finish, what they cannot bring home stays on their hosts.  Said once."""
        if self.local_failed:
            return []
        self.local_failed = True
        self.halted = self.state.draining = True
        return [Say(Stopping(how="halt", reason=f"{reason}; no new jobs start"))]

    # -- control from another terminal (ssh-scheduler pause / resume / cancel) ----------------

    def pause(self) -> list[Action]:
        """Start nothing new until :meth:`resume`; what runs goes on."""
        if self.state.paused:
            return []
        self.state.paused = True
        return [Say(BatchPaused())]

    def resume(self) -> list[Action]:
        if not self.state.paused:
            return []
        self.state.paused = False
        self.state.last_wait = ""
        return [Say(BatchResumed()), *dispatch(self.state)]

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
        self.state.dequeue(slot)
        move(slot, JobPhase.CANCELLED)
        return [Say(JobCancelled(job=job, host="")), *self.state.not_run_after(job, "was cancelled"), *dispatch(self.state)]

    # -- internals -----------------------------------------------------------------------------

    def _retry(self, slot: JobSlot) -> bool:
        """--retries: a failed job runs again, preferably on a host where it has not failed."""
        assert slot.placement is not None
        slot.failed_on.append(slot.placement.machine)
        if len(slot.failed_on) > self.options.retries or self.state.draining:
            return False
        slot.attempt += 1
        move(slot, JobPhase.QUEUED)
        self.state.enqueue(slot, front=True)
        return True

    def _requeue(self, slot: JobSlot, reason: str) -> list[Action]:
        assert slot.placement is not None
        host = slot.placement.machine
        move(slot, JobPhase.QUEUED)
        self.state.enqueue(slot, front=True)
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
        return actions + self.state.revive(host)

    def _kill_running(self, reason: str, but: str | None = None) -> list[Action]:
        actions: list[Action] = []
        for name, slot in self.jobs.items():
            if slot.phase is JobPhase.RUNNING and name != but and not slot.killing:
                slot.killing = reason
                actions.append(KillJob(name, reason))
        return actions
