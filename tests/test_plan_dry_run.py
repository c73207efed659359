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
    plans_as_the_plain_rule(fleet_and_batch(seed), f"seed {seed}")


def plans_as_the_plain_rule(plan: Planner, case: str) -> None:
    """The dry run's plan is :func:`every_host_scored`'s (or the same refusal), and both leave
    the hosts as they were: a second plan is the same plan."""
    expected = every_host_scored(plan)
    try:
        got: list[tuple[str, str, tuple[int, ...]]] | str = [
            (line.job, line.host, line.gpus) for line in plan.dry_run()
        ]
    except UnsatisfiableError as exc:
        got = str(exc)
    assert got == expected, case
    again = [(line.job, line.host, line.gpus) for line in plan.dry_run()] if isinstance(got, list) else got
    assert again == got, case


# --- long runs of the batch's needs: where the plan repeats (dispatch._Cycle) -------------------


def long_runs(seed: int) -> Planner:
    """A small fleet and a long batch: runs of jobs with the batch's needs (one object), some
    long enough to repeat their placements many times over, between jobs with needs of their
    own (a GPU job among them holds more than the jobs around it, on the same GPUs)."""
    rng = random.Random(seed)
    while True:
        hosts = rng.randint(1, 4)
        jobs: list[Job] = []
        for _segment in range(rng.randint(1, 4)):
            for _ in range(rng.choice([1, 3, 40, 300, 1500])):
                jobs.append(Job(f"j{len(jobs)}", "true", len(jobs) + 1))
            for _ in range(rng.choice([0, 0, 1, 2, 5])):
                override = NeedsOverride(
                    cpus=rng.choice([0.0, 1.0, 2.0]),
                    gpus=rng.choice([0, 1, 2]),
                    gpu_memory_mb=rng.choice([0, 3000, 9000]),
                    memory_mb=rng.choice([0, 500]),
                )
                jobs.append(Job(f"j{len(jobs)}", "true", len(jobs) + 1, needs=override))
        base = Needs(
            cpus=rng.choice([0.0, 1.0, 2.0]),
            memory_mb=rng.choice([0, 500, 3000]),
            gpus=rng.choice([0, 1, 1, 2]),
            gpu_memory_mb=rng.choice([0, 3000, 5000]),
            reserve_gpu=rng.random() < 0.3,
        )
        plan = Planner(jobs, [(f"h{i}", f"h{i}") for i in range(hosts)], PlanOptions(base, gpus_explicit=True))
        try:
            for i in range(hosts):
                cards = tuple(
                    GpuState(g, f"G{i}-{g}", "sim", mb, used, mb - used, 0.0)
                    for g, (mb, used) in enumerate(
                        (rng.choice([10000, 16000]), rng.choice([0, 0, 2500])) for _ in range(rng.randint(0, 3))
                    )
                )
                load = rng.choice([0.0, 1.5])
                plan.probe_landed(f"h{i}", HostState(rng.choice([2, 4, 8]), load, 16000, rng.choice([8000, 12000]), cards))
            plan.begin("token")
        except UnsatisfiableError:
            continue
        return plan


@pytest.mark.parametrize("block", range(8))
def test_long_batches_plan_as_if_every_job_were_placed_one_by_one(block: int) -> None:
    """Where a run of the batch's needs repeats its placements, the dry run copies whole turns
    instead of playing them: the plan must still be the plain rule's, line for line, and the
    hosts left as they were (8 tests of 10 fleets each)."""
    for seed in range(block * 10, block * 10 + 10):
        plans_as_the_plain_rule(long_runs(seed), f"seed {seed}")


def test_a_long_batch_is_not_played_out_job_by_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """20,000 jobs of the batch's needs on 3 hosts x 2 GPUs (6 at once): once a turn of 6
    placements repeats, the rest are copied; hosts are chosen a few dozen times, not 20,000,
    and the plan is the plain rule's."""
    import ssh_scheduler.planner.dispatch as dispatch

    jobs = [Job(f"j{i}", "true", i + 1) for i in range(20_000)]
    plan = Planner(jobs, [(f"h{i}", f"h{i}") for i in range(3)], PlanOptions(Needs(cpus=1, gpus=1, gpu_memory_mb=1000)))
    for i in range(3):
        cards = tuple(GpuState(g, f"G{i}-{g}", "sim", 16000, 0, 16000, 0.0) for g in range(2))
        plan.probe_landed(f"h{i}", HostState(8, 0.0, 16000, 12000, cards))
    plan.begin("token")
    chosen = 0
    plain_choose = dispatch.choose

    def counted(machines: list[MachineResources], needs: Needs) -> MachineResources | None:
        nonlocal chosen
        chosen += 1
        return plain_choose(machines, needs)

    monkeypatch.setattr(dispatch, "choose", counted)
    got = [(line.job, line.host, line.gpus) for line in plan.dry_run()]
    assert chosen < 100
    monkeypatch.undo()
    assert got == every_host_scored(plan)
    assert len(got) == 20_000 and got[-1][0] == "j19999"
    assert {(host, gpus) for _, host, gpus in got} == {(f"h{i}", (g,)) for i in range(3) for g in range(2)}


def test_a_turn_is_found_only_when_the_jobs_running_repeat_exactly() -> None:
    """_Cycle's rule, placement by placement: a turn of n once the last n placements (each
    with n running after it) are the n before them, all with the same needs; not a
    placement earlier, and not when one of those had other needs or another count running."""
    from ssh_scheduler.planner.dispatch import _Cycle

    same, other = Needs(cpus=1), Needs(cpus=1)
    fill = [("a", (0,), 1), ("b", (0,), 2), ("a", (1,), 3)]
    turn = [("a", (0,)), ("b", (0,)), ("a", (1,))]

    def found(steps: list[tuple[str, tuple[int, ...], int]], needs: list[Needs]) -> list[int]:
        cycle = _Cycle()
        return [at for at, ((host, gpus, running), n) in enumerate(zip(steps, needs, strict=True)) if cycle.placed(host, gpus, n, running)]

    # The fill's last placement is the first with 3 running: from the 8th on, the jobs
    # running (the last 3 placed) are those of 3 placements before.
    steps = fill + [(h, g, 3) for h, g in turn] * 3
    assert found(steps, [same] * len(steps)) == [7, 8, 9, 10, 11]
    cycle = _Cycle()
    periods = [cycle.placed(host, gpus, same, running) for host, gpus, running in steps[:8]]
    assert periods == [0] * 7 + [3]
    assert cycle.last(3) == [("a", (1,)), ("a", (0,)), ("b", (0,))]  # the 6th to the 8th
    # The 8th placement left 2 running: the placements repeat from the 9th on, three in a row
    # with 3 running only at the 14th.
    steps = fill + [(h, g, 3) for h, g in turn] + [("a", (0,), 3), ("b", (0,), 2), ("a", (1,), 3)] + [(h, g, 3) for h, g in turn] * 2
    assert found(steps, [same] * len(steps)) == [13, 14]
    # One placement of the first turn had needs of its own (an equal object, not the same).
    steps = fill + [(h, g, 3) for h, g in turn] * 3
    needs = [same] * len(steps)
    needs[4] = other
    assert found(steps, needs) == [10, 11]  # the 5th is not among the 6 before the 11th


def test_a_turn_is_copied_only_for_jobs_with_its_needs() -> None:
    """Two long runs of jobs, each run sharing a needs object of its own (as the batch's needs
    are shared): the second run is placed for its own needs, not as the first run's turn."""
    jobs = [Job(f"j{i}", "true", i + 1) for i in range(400)]
    plan = Planner(jobs, [("h0", "h0"), ("h1", "h1")], PlanOptions(Needs(cpus=1)))
    for name in ("h0", "h1"):
        cards = tuple(GpuState(g, f"{name}-{g}", "sim", 16000, 0, 16000, 0.0) for g in range(2))
        plan.probe_landed(name, HostState(4, 0.0, 16000, 12000, cards))
    plan.begin("token")
    two_gpus = Needs(cpus=1, gpus=2, gpu_memory_mb=1000)
    for at, slot in enumerate(plan.state.jobs.values()):
        if at >= 200:
            slot.needs = two_gpus
    got = [(line.job, line.host, line.gpus) for line in plan.dry_run()]
    assert got == every_host_scored(plan)
    assert {gpus for _, _, gpus in got[200:]} == {(0, 1)}
