"""``--dry-run``'s plan (:func:`ssh_scheduler.planner.dispatch.dry_run`) against the plain rule it
shortcuts: every job placed by :func:`~ssh_scheduler.planner.allocate.choose` over every usable
host, the oldest running job ended whenever nothing fits.  The planner only re-scores the hosts
changed since nothing fitted; random fleets and batches (jobs that share the batch's needs and
jobs with needs of their own, interleaved) must give the same plan line for line."""

from __future__ import annotations

import random
from collections import deque

import pytest

from ssh_scheduler.errors import UnsatisfiableError
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.machines.host_state import GpuState, HostState
from ssh_scheduler.planner.actions import PlanOptions
from ssh_scheduler.planner.allocate import MachineResources, choose
from ssh_scheduler.planner.phases import FINAL_PHASES
from ssh_scheduler.planner.plan import Planner


def every_host_scored(plan: Planner) -> list[tuple[str, str, tuple[int, ...]]] | str:
    """The plan as the rule states it: each placement chosen over every usable host."""
    state = plan.state
    machines = state.usable()
    running: deque[tuple[MachineResources, str]] = deque()
    lines: list[tuple[str, str, tuple[int, ...]]] = []
    try:
        for slot in state.jobs.values():
            if slot.phase in FINAL_PHASES:
                continue
            while True:
                target = choose(machines, slot.needs)
                if target is not None:
                    placement = target.allocate(slot.job.name, slot.needs)
                    running.append((target, slot.job.name))
                    lines.append((slot.job.name, target.name, placement.gpu_indices))
                    break
                if not running:
                    raise UnsatisfiableError(f"job {slot.job.name} fits on no host")
                done_on, done_job = running.popleft()
                done_on.release(done_job)
    except UnsatisfiableError as exc:
        return str(exc)
    finally:
        for machine, name in running:
            machine.release(name)
    return lines


def fleet_and_batch(seed: int) -> Planner:
    """A random fleet and batch; drawn again while the batch holds a job no host could ever run
    (the planner refuses such a batch before any plan)."""
    rng = random.Random(seed)
    while True:
        try:
            return draw(rng)
        except UnsatisfiableError:
            continue


def draw(rng: random.Random) -> Planner:
    hosts = rng.randint(1, 6)
    jobs = []
    for i in range(rng.randint(1, 120)):
        override = NeedsOverride()
        if rng.random() < 0.3:  # needs of its own: a Needs object of its own, scored over every host
            override = NeedsOverride(
                cpus=rng.choice([0.0, 0.5, 1.0, 3.0]),
                gpus=rng.choice([0, 1, 2]),
                gpu_memory_mb=rng.choice([0, 4000, 9000]),
                memory_mb=rng.choice([0, 100, 6000]),
            )
        jobs.append(Job(f"j{i}", f"echo {i}", i + 1, needs=override))
    base = Needs(
        cpus=rng.choice([0.0, 1.0, 2.0]),
        memory_mb=rng.choice([0, 500]),
        gpus=rng.choice([0, 1]),
        gpu_memory_mb=rng.choice([0, 3000, 8000]),
        reserve_gpu=rng.random() < 0.5,
    )
    plan = Planner(jobs, [(f"h{i}", f"h{i}") for i in range(hosts)], PlanOptions(base, gpus_explicit=True))
    for i in range(hosts):
        cards = tuple(
            GpuState(g, f"G{i}-{g}", "sim", mb, used, mb - used, 0.0)
            for g, (mb, used) in enumerate(
                (rng.choice([10000, 16000]), rng.choice([0, 0, 2000])) for _ in range(rng.randint(0, 4))
            )
        )
        state = HostState(rng.choice([2, 4, 8]), rng.choice([0.0, 1.5]), 16000, rng.choice([8000, 12000]), cards)
        plan.probe_landed(f"h{i}", state)
    plan.begin("token")
    return plan


@pytest.mark.parametrize("seed", range(150))
def test_the_dry_run_plans_as_if_every_host_were_scored_for_every_job(seed: int) -> None:
    plan = fleet_and_batch(seed)
    expected = every_host_scored(plan)
    try:
        got: list[tuple[str, str, tuple[int, ...]]] | str = [
            (line.job, line.host, line.gpus) for line in plan.dry_run()
        ]
    except UnsatisfiableError as exc:
        got = str(exc)
    assert got == expected
    # Both leave the hosts as they were: a second plan is the same plan.
    again = [(line.job, line.host, line.gpus) for line in plan.dry_run()] if isinstance(got, list) else got
    assert again == got
