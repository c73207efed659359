"""The start of a batch: when it opens, and what hosts that answer late (or not at all) mean for
its jobs.

Each host answers once at the start (its connect and probe landed or failed), in any order and
at any time.  The batch opens (BatchStarted, then placements) when every host has answered, or
earlier once the coordinator calls the slow ones overdue (:meth:`BatchStart.probes_overdue`):
from then on each host takes jobs as soon as it answers.  Opening settles each job's needs (the
"one GPU by default" becomes none on a fleet without GPUs, which is known only once every host
answered), refuses a job no host could ever fit, holds the jobs an earlier run left on a host
that has not answered yet (to take them up there rather than start them twice) and takes up
what the hosts' agents still hold (:meth:`BatchStart.agent_jobs_found`).

The :class:`~ssh_scheduler.planner.plan.Planner` holds one :class:`BatchStart` and hands it these
events; both work on the same :class:`~ssh_scheduler.planner.state.PlanState`, and jobs are
placed by :func:`~ssh_scheduler.planner.dispatch.dispatch`.  Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ssh_scheduler.errors import BatchError, NoUsableHostError, UnsatisfiableError
from ssh_scheduler.events import BatchStarted, HostDown, JobNotRun, JobReattached, JobsAdded
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.planner.actions import Action, Cleanup, HostSlot, Say, StartJob
from ssh_scheduler.planner.allocate import MachineResources, max_concurrent
from ssh_scheduler.planner.dispatch import dispatch
from ssh_scheduler.planner.explain import explain_unfit
from ssh_scheduler.planner.phases import JobPhase, JobSlot, move
from ssh_scheduler.planner.policy import Resumable
from ssh_scheduler.planner.state import FAILED_EARLIER, PlanState

__all__ = ["BatchStart"]


class BatchStart:
    """The start-up decisions of one batch, over the :class:`PlanState` it shares with its
    :class:`~ssh_scheduler.planner.plan.Planner`."""

    def __init__(self, state: PlanState) -> None:
        self.state = state
        self._token: str | None = None  # begin() was called: open as soon as ready
        self._overdue = False  # the coordinator stopped waiting for the slow first probes
        # Needs no answered host could ever fit (yet): refused once every host has answered.
        self._unresolved: set[Needs] = set()
        # Jobs an earlier run left on a host that has not answered yet: they wait for it, to be
        # taken up there rather than started twice.
        self._held: dict[str, list[JobSlot]] = {}
        self._found: dict[str, Mapping[str, bool]] = {}  # agent jobs of hosts that answered early
        # An open batch: jobs an earlier run left on a host, kept there for their job to join
        # (taken up then, not run twice); those that never join are ended at the close.
        self._adoptable: dict[str, tuple[str, bool, Resumable]] = {}
        # Jobs added before the opening that will not run (a job of the batch they wait for will
        # not), with why: said at the opening, which finds only failed_before's reasons itself.
        self._refused: list[tuple[str, str]] = []

    # -- views ---------------------------------------------------------------------------------

    @property
    def answered(self) -> bool:
        """Every host's first connect and probe landed or failed."""
        return all(h.answered for h in self.state.hosts.values())

    @property
    def holding(self) -> bool:
        """Some job waits for the host an earlier run left it on to answer."""
        return any(self._held.values())

    # -- events --------------------------------------------------------------------------------

    def host_unreachable(self, host: str, reason: str) -> list[Action]:
        """Connecting failed at the start: the host is retried in the background."""
        slot = self.state.hosts[host]
        slot.down = reason
        self.state.probes.failed(host)
        actions: list[Action] = [Say(HostDown(host=host, reason=reason, at_start=True))]
        if slot.answered:
            return actions
        slot.answered = True
        return actions + self._host_answered(slot)

    def probe_landed(
        self,
        host: str,
        state: HostState,
        own: Mapping[str, OwnUsage] | None,
        generation: int | None,
        agent_jobs: Mapping[str, bool] | None,
        now: float | None,
    ) -> list[Action]:
        """A probe of ``host`` landed (see :meth:`~ssh_scheduler.planner.plan.Planner.probe_landed`)."""
        slot = self.state.hosts[host]
        if slot.resources is None:
            slot.resources = MachineResources(host, state)
        else:
            slot.resources.update(state, own or {}, generation)
        self.state.probes.landed(host, now, slot.resources.gpus_held_by_others)
        if slot.answered:
            return dispatch(self.state)
        slot.answered = True
        if agent_jobs:
            self._found[host] = agent_jobs
        return self._host_answered(slot)

    def begin(self, token: str) -> list[Action]:
        """Open as soon as every host answered (now, if they all did); jobs are placed by the
        event that opened it, or by ``kick`` when this call did."""
        self._token = token
        return self._open() if self._ready() else []

    def probes_overdue(self) -> list[Action]:
        """Open with the hosts that answered; each other host takes jobs when it answers."""
        self._overdue = True
        if self.state.began or not self._ready():
            return []
        return self._open() + dispatch(self.state)

    def jobs_added(self, jobs: Sequence[Job]) -> list[Action]:
        """Jobs joined the batch (an open one).  Before it opens they wait for the opening like
        the first jobs; after, each is settled now: its needs from the batch's, a job no
        answered host could ever fit is not run (once every host answered; until then it waits
        for a host that fits), one whose ``after`` already failed is not run, and what fits is
        placed.  A name already in the batch is refused (:class:`BatchError`), nothing added."""
        state = self.state
        seen: set[str] = set()
        for job in jobs:
            if job.name in state.jobs or job.name in seen:
                raise BatchError(f"job {job.name} is already in this batch; give each job a name of its own")
            seen.add(job.name)
        added = state.add(jobs)
        if not state.began:
            # Settled, refused or queued when the batch opens (_open).
            self._refused += [(s.job.name, why) for s, why in added if why and s.job.name not in state.failed_before]
            return []
        assert state.base_needs is not None
        actions: list[Action] = [Say(JobsAdded(jobs=len(jobs), total=state.total))]
        for slot, reason in added:
            if slot.phase is JobPhase.NOT_RUN:
                # Without a reason it was BLOCKED on a job of this call said not to run above,
                # and was said not to run with it.
                if reason:
                    actions.append(Say(JobNotRun(job=slot.job.name, reason=reason)))
                    actions += state.not_run_after(slot.job.name, "will not run")
                continue
            slot.needs = slot.job.needs.apply(state.base_needs) if not slot.job.needs.empty else state.base_needs
            if not any(m.could_ever_fit(slot.needs) for m in state.usable()):
                self._unresolved.add(slot.needs)
            held = self._adoptable.pop(slot.job.name, None)
            if held is not None and slot.phase is JobPhase.QUEUED and state.hosts[held[0]].usable:
                actions += self._adopt(slot, *held)
            elif slot.phase is JobPhase.QUEUED:
                state.enqueue(slot)
        return actions + self._resolve() + dispatch(state)

    def release_held(self) -> list[Action]:
        """An open batch closes: what earlier runs left on the hosts for jobs that never joined
        is ended there."""
        held, self._adoptable = self._adoptable, {}
        return [Cleanup(host, name) for name, (host, _, _) in held.items()]

    def agent_jobs_found(self, host: str, jobs: Mapping[str, bool]) -> list[Action]:
        """What a host's agent still holds from an earlier coordinator (job -> still running):
        take up what the journal says ran there and is still to do; end everything else."""
        actions: list[Action] = []
        slot_host = self.state.hosts[host]
        for name, running in jobs.items():
            slot = self.state.jobs.get(name)
            entry = self.state.resumable.get(name)
            if entry is not None and entry.host == host:
                del self.state.resumable[name]  # this host's to take up, once
            else:
                # A claim on a job the journal puts on another host (or on none): ended here,
                # and the entry stays for the host that really holds it, whenever it answers.
                entry = None
            if slot is None and entry is not None and self.state.open:
                self._adoptable[name] = (host, running, entry)  # its job may join later
                continue
            if (
                slot is None
                or entry is None
                or entry.host != host
                or slot.phase is not JobPhase.QUEUED
                or slot_host.resources is None
            ):
                if slot is None or slot.placement is None or slot.placement.machine != host:
                    actions.append(Cleanup(host, name))
                continue
            self.state.dequeue(slot)
            actions += self._adopt(slot, host, running, entry)
        return actions

    def _adopt(self, slot: JobSlot, host: str, running: bool, entry: Resumable) -> list[Action]:
        """Take up the run of ``slot``'s job that an earlier coordinator left on ``host``."""
        resources = self.state.hosts[host].resources
        assert resources is not None
        placement = resources.adopt(slot.job.name, slot.needs, entry.gpus)
        move(slot, JobPhase.RUNNING)
        slot.placement = placement
        # Its use may be in the probe that just landed: its release then calls for a probe.
        slot.probes_before = self.state.probes.hosts[host].landed - 1
        return [
            Say(JobReattached(job=slot.job.name, host=host, gpus=placement.gpu_indices, running=running)),
            StartJob(slot.job, placement, slot.attempt, resume=True),
        ]

    # -- internals -----------------------------------------------------------------------------

    def _ready(self) -> bool:
        if self._token is None or self.state.began:
            return False
        if self.answered:
            return True
        return self._overdue and self._base_needs() is not None and any(h.usable for h in self.state.hosts.values())

    def _base_needs(self) -> Needs | None:
        """The batch's needs; None while they depend on hosts that did not answer yet."""
        base = self.state.options.needs
        if not base.gpus or self.state.options.gpus_explicit:
            return base
        hosts = self.state.hosts.values()
        if any(h.resources.state.gpus or h.resources.state.job_slots for h in hosts if h.resources is not None):
            return base  # (a Slurm queue may have GPUs: sbatch says when it has none)
        if not self.answered:
            return None
        # The ancestor requires a GPU by default; on a fleet without any it could never be
        # met, so unless the user asked for GPUs it quietly becomes "no GPU".
        return replace(base, gpus=0, gpu_memory_mb=0, gpu_utilization=0.0, reserve_gpu=False)

    def _host_answered(self, slot: HostSlot) -> list[Action]:
        if not self.state.began:
            return self._open() + dispatch(self.state) if self._ready() else []
        actions = self._take_up(slot.name)
        if slot.down is not None:
            actions += self.state.revive(slot)
        return actions + self._resolve() + dispatch(self.state)

    def _take_up(self, host: str) -> list[Action]:
        """What ``host``'s agent holds from an earlier run, then the jobs that waited for it."""
        found = self._found.pop(host, None)
        actions = self.agent_jobs_found(host, found) if found else []
        for slot in reversed(self._held.pop(host, [])):
            if slot.phase is JobPhase.QUEUED and slot.placement is None:
                self.state.enqueue(slot, front=True)
        return actions

    def _open(self) -> list[Action]:
        state = self.state
        base = self._base_needs()
        assert base is not None
        usable = state.usable()
        if not usable:
            reasons = "; ".join(f"{h.name}: {h.down}" for h in state.hosts.values())
            raise NoUsableHostError(f"no usable host ({reasons})")
        checked: dict[Needs, bool] = {}
        base_fits: bool | None = None  # (the batch's needs, most jobs': not hashed for each job)
        for name, slot in state.jobs.items():
            slot.needs = slot.job.needs.apply(base) if not slot.job.needs.empty else base
            fits = base_fits if slot.needs is base else checked.get(slot.needs)
            if fits is None:
                fits = checked[slot.needs] = any(m.could_ever_fit(slot.needs) for m in usable)
                if slot.needs is base:
                    base_fits = fits
            if not fits:
                if self.answered and not state.open:
                    raise self._never_fits(name, slot.needs, usable, only=len(checked) == 1)
                self._unresolved.add(slot.needs)  # (an open batch refuses just those jobs)
        state.began = True
        state.base_needs = base
        limits = tuple(
            (h.label, max_concurrent(h.resources, base)) for h in state.hosts.values() if h.usable and h.resources is not None
        )
        choices = tuple(tuple(g.index for g in m.state.gpus) for m in usable)
        actions: list[Action] = [
            Say(BatchStarted(token=self._token or "", jobs=state.total, hosts=tuple(state.hosts), limits=limits, gpu_choices=choices))
        ]
        for slot in state.jobs.values():
            entry = state.resumable.get(slot.job.name)
            if slot.phase is JobPhase.QUEUED:
                if entry is not None and entry.host in state.hosts and not state.hosts[entry.host].answered:
                    self._held.setdefault(entry.host, []).append(slot)
                else:
                    state.enqueue(slot)
            elif slot.phase is JobPhase.NOT_RUN and slot.job.name in state.failed_before:
                failed = state.failed_before[slot.job.name]
                reason = f"{failed} {FAILED_EARLIER}"
                actions.append(Say(JobNotRun(job=slot.job.name, reason=reason)))
                actions += state.not_run_after(slot.job.name, "will not run")
        for name, reason in self._refused:
            actions.append(Say(JobNotRun(job=name, reason=reason)))
            actions += state.not_run_after(name, "will not run")
        self._refused.clear()
        for host in state.hosts.values():
            if host.down is not None:
                actions += state.revive(host)
        for name in list(self._found):
            actions += self._take_up(name)
        return actions + self._resolve()

    @staticmethod
    def _never_fits(job: str, needs: Needs, usable: list[MachineResources], *, only: bool) -> UnsatisfiableError:
        every = " (and every job of this batch)" if only else ""
        return UnsatisfiableError(
            f"job {job}{every} can never run: {explain_unfit(usable, needs)}; "
            "lower the job's needs or add a bigger machine"
        )

    def _resolve(self) -> list[Action]:
        """Needs no host fitted when the batch opened: fine once a host that fits answers;
        once every host has answered, the jobs still unfit can never run: the batch is refused
        if nothing was placed yet, else just those jobs are not run."""
        if not self._unresolved:
            return []
        state = self.state
        usable = state.usable()
        self._unresolved = {n for n in self._unresolved if not any(m.could_ever_fit(n) for m in usable)}
        if not self._unresolved or not self.answered:
            return []
        # An open batch takes more jobs: it refuses only those that can never run.
        placed_any = state.open or any(slot.placement is not None for slot in state.jobs.values())
        actions: list[Action] = []
        for name, slot in state.jobs.items():
            if slot.needs not in self._unresolved or slot.phase not in (JobPhase.QUEUED, JobPhase.BLOCKED):
                continue
            error = self._never_fits(name, slot.needs, usable, only=False)
            if not placed_any:
                raise error
            state.dequeue(slot)
            move(slot, JobPhase.NOT_RUN)
            actions.append(Say(JobNotRun(job=name, reason=str(error))))
            actions += state.not_run_after(name)
        self._unresolved.clear()
        return actions
