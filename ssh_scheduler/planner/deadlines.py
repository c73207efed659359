"""What time makes happen in a batch: ``--timeout`` kills and the probes that are due, over the
planner's shared :class:`~ssh_scheduler.planner.state.PlanState` (pure: no clock of its own,
``now`` is the coordinator's, in seconds).  The probes' own rules are in
:mod:`ssh_scheduler.planner.probe_schedule`."""

from __future__ import annotations

from ssh_scheduler.planner.actions import Action, KillJob, Reprobe
from ssh_scheduler.planner.phases import JobPhase
from ssh_scheduler.planner.state import PlanState

__all__ = ["next_deadline", "tick"]


def next_deadline(state: PlanState) -> float | None:
    """When :func:`tick` next has something to do (a ``--timeout``, a probe), or None."""
    times = []
    if state.began:
        due = state.probes.next_due(_probe_targets(state), _jobs_waiting(state), _gpu_jobs_waiting(state))
        if due is not None:
            times.append(due)
    timeout = state.options.timeout
    if timeout is not None:
        starts = [
            slot.started_at
            for slot in state.jobs.values()
            if slot.phase is JobPhase.RUNNING and slot.started_at is not None and not slot.killing
        ]
        if starts:
            times.append(min(starts) + timeout)
    return min(times) if times else None


def tick(state: PlanState, now: float) -> list[Action]:
    """Time passed: kill the jobs past ``--timeout``, probe the hosts that are due."""
    actions: list[Action] = []
    if state.began:
        due = state.probes.start_due(_probe_targets(state), _jobs_waiting(state), now, _gpu_jobs_waiting(state))
        actions += [Reprobe(h) for h in due]
    timeout = state.options.timeout
    if timeout is None:
        return actions
    for name, slot in state.jobs.items():
        if (
            slot.phase is JobPhase.RUNNING
            and slot.started_at is not None
            and not slot.killing
            and now >= slot.started_at + timeout
        ):
            slot.killing = "timeout"
            actions.append(KillJob(name, "timeout"))
    return actions


def _probe_targets(state: PlanState) -> list[str]:
    return [name for name, h in state.hosts.items() if h.usable]


def _jobs_waiting(state: PlanState) -> bool:
    """Jobs wait for room (a credit a probe would give could start them)."""
    return not (state.draining or state.paused) and state.queued()


def _gpu_jobs_waiting(state: PlanState) -> bool:
    """A job that needs a GPU waits for room (a GPU another user frees could start it)."""
    if state.draining or state.paused:
        return False
    return any(queue and needs.gpus > 0 for needs, queue in state.queues.items())
