"""Placing what fits: the queue's jobs onto the hosts with room, over the planner's shared
:class:`~ssh_scheduler.planner.state.PlanState` (pure).

:func:`dispatch` runs after every event that may have made room or queued a job; each queue (one
per kind of needs) is served in order, its head placed on the best host for it
(:func:`~ssh_scheduler.planner.allocate.choose`) until it fits nowhere.  A job that failed on
some hosts prefers the others.  A host with ``copy_backs_per_host`` copy-backs in flight starts
nothing new until one lands.  When nothing of ours runs and nothing fits, the user is told why,
once per reason; when no host is left at all, the batch drains.  :func:`dry_run` is the same
placement played out without hosts (``--dry-run``).
"""

from __future__ import annotations

from collections import deque

from ssh_scheduler.errors import UnsatisfiableError
from ssh_scheduler.events import JobPlaced, Notice, PlanLine, Waiting
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.planner.actions import Action, Say, StartJob
from ssh_scheduler.planner.allocate import MachineResources, choose
from ssh_scheduler.planner.phases import FINAL_PHASES, JobPhase, JobSlot, move
from ssh_scheduler.planner.state import PlanState

__all__ = ["dispatch", "dry_run"]


def dispatch(state: PlanState) -> list[Action]:
    """Place every queued job that fits now (nothing before the batch opens, while it drains or
    while it is paused)."""
    if not state.began or state.draining or state.paused:
        return []
    bound = state.options.copy_backs_per_host
    usable = [
        h.resources for h in state.hosts.values() if h.usable and h.resources is not None and h.copying < bound
    ]
    actions: list[Action] = []
    for needs, queue in state.queues.items():
        while queue:
            slot = state.jobs[queue[0]]
            machines = usable
            if slot.failed_on:
                avoid = set(slot.failed_on)
                machines = [m for m in usable if m.name not in avoid] or usable
            target = choose(machines, needs)
            if target is None:
                break
            queue.popleft()
            placement = target.allocate(slot.job.name, needs)
            move(slot, JobPhase.RUNNING)
            slot.placement, slot.started_at, slot.killing = placement, None, None
            slot.probes_before = state.probes.hosts[target.name].landed
            actions.append(
                Say(JobPlaced(job=slot.job.name, host=target.name, gpus=placement.gpu_indices, command=slot.job.command))
            )
            actions.append(StartJob(slot.job, placement, slot.attempt))
    if actions or not state.queued():
        state.last_wait = ""
        return actions
    if state.busy():  # a job's end (or a copy-back landing) makes room
        return actions
    # Nothing of ours runs and nothing fits.
    if not any(h.usable or h.reviving for h in state.hosts.values()):
        state.draining = True
        actions.append(Say(Notice(level="error", message="every host is down or quarantined; the remaining jobs were not run")))
        return actions
    head = next(q[0] for q in state.queues.values() if q)
    reason = "; ".join(
        f"{h.name}: {h.resources.capacity_summary()}" for h in state.hosts.values() if h.usable and h.resources is not None
    ) or "; ".join(f"{h.name}: down" for h in state.hosts.values())
    if reason != state.last_wait:
        state.last_wait = reason
        actions.append(Say(Waiting(job=head, reason=reason)))
    return actions


def dry_run(state: PlanState) -> list[PlanLine]:
    """The schedule if jobs ended in the order they started (the placements of ``--dry-run``);
    the hosts' resources are left as they were.

    Every host is scored only until nothing fits the job's needs; from then on, as long as the
    jobs keep those needs (the same object: usually the batch's), only the hosts changed since
    (a job ended or was placed there) can fit them: the others' scores are what they were,
    ``-inf``, so :func:`~ssh_scheduler.planner.allocate.choose` over the changed ones picks what
    it would pick over all of them (its ties go by jobs held and name, not by order).  A big
    batch on a full fleet then costs O(1) choices per job, not O(hosts).

    Once the placements repeat (:class:`_Cycle`), the rest of a run of jobs with those needs is
    not played out at all: each whole turn of the cycle places them where the last turn did."""
    running: deque[tuple[MachineResources, str]] = deque()
    machines = state.usable()
    lines: list[PlanLine] = []
    full_for: Needs | None = None  # nothing fitted these needs when every host was last scored
    changed: dict[str, MachineResources] = {}  # the hosts changed since, by name
    slots = [slot for slot in state.jobs.values() if slot.phase not in FINAL_PHASES]
    alike_ahead = _alike_ahead(slots)
    cycle = _Cycle()
    at = 0
    while at < len(slots):
        slot = slots[at]
        needs = slot.needs
        while True:
            if needs is full_for:
                target = choose(list(changed.values()), needs)
            else:
                target = choose(machines, needs)
            if target is not None:
                placement = target.allocate(slot.job.name, needs)
                running.append((target, slot.job.name))
                changed[target.name] = target
                lines.append(PlanLine(job=slot.job.name, host=target.name, gpus=placement.gpu_indices))
                break
            if not running:
                raise UnsatisfiableError(f"job {slot.job.name} fits on no host")
            full_for, changed = needs, {}
            done_on, done_job = running.popleft()
            done_on.release(done_job)
            changed[done_on.name] = done_on
        at += 1
        period = cycle.placed(target.name, placement.gpu_indices, needs, len(running))
        if period and at < len(slots) and slots[at].needs is needs and alike_ahead[at] >= period:
            # The hosts hold what they held one turn ago: whole turns go as the last one went
            # and end where it ended, so the jobs after them are played out from there.
            turn = cycle.last(period)
            whole = alike_ahead[at] // period * period
            for offset in range(whole):
                host, gpus = turn[offset % period]
                lines.append(PlanLine(job=slots[at + offset].job.name, host=host, gpus=gpus))
            at += whole
    for machine, name in running:
        machine.release(name)
    return lines


def _alike_ahead(slots: list[JobSlot]) -> list[int]:
    """For each job: how many jobs from it on have its needs (the same object)."""
    ahead = [0] * len(slots)
    for at in range(len(slots) - 1, -1, -1):
        follows = at + 1 < len(slots) and slots[at + 1].needs is slots[at].needs
        ahead[at] = ahead[at + 1] + 1 if follows else 1
    return ahead


class _Cycle:
    """Finds when a dry run's placements repeat.  Jobs end in the order they started, so the
    jobs running are always the last ``n`` placed: what every host holds is those placements
    (host and GPUs), in order, with their needs.  When the last ``n`` placements are the
    ``n`` before them, all with the same needs and ``n`` running both times, the hosts hold
    exactly what they held ``n`` placements ago, and jobs with those needs go on as they went
    from there: a turn of ``n`` placements, over and over."""

    __slots__ = ("_alike", "_history", "_needs", "_period", "_streak")

    def __init__(self) -> None:
        self._history: list[tuple[str, tuple[int, ...], int]] = []  # host, GPUs, jobs running after
        self._needs: Needs | None = None
        self._alike = 0  # placements in a row, to the last, with the last one's needs
        self._period = 0
        self._streak = 0  # placements in a row, to the last, that repeat the one _period before

    def placed(self, host: str, gpus: tuple[int, ...], needs: Needs, running: int) -> int:
        """Note one placement, after which ``running`` jobs run: ``running`` when the last
        ``running`` placements repeat the ones before them (a turn: :meth:`last`), else 0."""
        history = self._history
        history.append((host, gpus, running))
        self._alike = self._alike + 1 if needs is self._needs else 1
        self._needs = needs
        if running != self._period:
            self._period, self._streak = running, 0
        back = len(history) - 1 - running
        self._streak = self._streak + 1 if back >= 0 and history[back] == history[-1] else 0
        return running if self._streak >= running and self._alike >= 2 * running else 0

    def last(self, count: int) -> list[tuple[str, tuple[int, ...]]]:
        """The last ``count`` placements (host and GPUs), oldest first."""
        return [(host, gpus) for host, gpus, _ in self._history[-count:]]
