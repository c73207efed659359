"""What the planner says about a job, field by field (the mutation run found these fields
unchecked: scripts/mutation planner, docs/mutation.md): where and what a start runs, how long a
job ran and how it ended, what --halt says and kills, what a stop and a cancel say."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ssh_scheduler.errors import UnsatisfiableError
from ssh_scheduler.events import (
    Ended,
    HostDown,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobRetrying,
    JobStarted,
    Stopping,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.planner.actions import Commit, KillJob, PlanOptions
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import parse_halt
from tests.test_plan import CPU, events, host_state, jobs, planner, starts

GPU = Needs(cpus=1, memory_mb=100, gpus=1, gpu_memory_mb=7000, reserve_gpu=False)


def said(actions: list, kind: type) -> list:  # type: ignore[type-arg]
    """The events of that kind, their times left out (compared field by field otherwise)."""
    return [replace(event, t=0.0) for event in events(actions, kind)]


def at0(event: object) -> object:
    return replace(event, t=0.0)  # type: ignore[type-var]


def ended(plan: Planner, name: str, how: Ended, *, now: float | None = None, received: int = 0) -> list:  # type: ignore[type-arg]
    actions = plan.job_exited(name, how)
    assert Commit(name) in actions
    return actions + plan.job_committed(name, how, received, now=now)


@pytest.mark.parametrize(("needs", "gpus", "gpu_memory"), [(GPU, 1, 7000), (CPU, 0, 0)])
def test_a_start_says_where_what_which_attempt_and_the_gpu_memory_it_reserves(
    needs: Needs, gpus: int, gpu_memory: int
) -> None:
    plan, actions = planner(jobs(1), hosts=1, options=PlanOptions(needs, gpus_explicit=True, retries=1), gpus=2)
    (start,) = starts(actions)
    assert len(start.placement.gpu_indices) == gpus
    started = said(plan.job_started("j0", 5.0, slurm_job="77"), JobStarted)
    assert started == [
        at0(
            JobStarted(
                job="j0", host="h0", gpus=start.placement.gpu_indices, command="echo 0",
                attempt=1, slurm_job="77", gpu_memory_mb=gpu_memory,
            )
        )
    ]
    # A failed first attempt is retried (attempt 2 of 2): the second start says so.
    retried = plan.job_exited("j0", Ended(3))
    assert said(retried, JobRetrying) == [at0(JobRetrying(job="j0", host="h0", code=3, attempt=2, attempts=2))]
    assert [e.attempt for e in events(plan.job_started("j0", 6.0), JobStarted)] == [2]


def test_a_finished_job_says_its_exit_status_how_long_it_ran_and_what_came_home() -> None:
    plan, _ = planner(jobs(3))
    plan.job_started("j0", 5.0)
    assert said(ended(plan, "j0", Ended(0), now=12.5, received=123), JobFinished) == [
        at0(JobFinished(job="j0", host="h0", command="echo 0", code=0, seconds=7.5, bytes_received=123))
    ]
    # Without the commit's time (or a start's), no duration is made up.
    plan.job_started("j1", 5.0)
    assert [e.seconds for e in events(ended(plan, "j1", Ended(0)), JobFinished)] == [0.0]
    assert [e.seconds for e in events(ended(plan, "j2", Ended(0), now=9.0), JobFinished)] == [0.0]


def test_a_failed_job_says_why_and_where_its_results_stayed() -> None:
    plan, _ = planner(jobs(2))
    plan.job_started("j0", 1.0)
    kept = Ended(0, message="disk full here", kept_at="h0:/work/j0")
    (failed,) = said(ended(plan, "j0", kept, now=3.0, received=10), JobFailed)
    assert failed == at0(
        JobFailed(
            job="j0", host=failed.host, command="echo 0", code=0, reason=kept.describe(), seconds=2.0,
            message="disk full here", bytes_received=10, kept="h0:/work/j0",
        )
    )
    plan.job_started("j1", 1.0)
    (plain,) = events(ended(plan, "j1", Ended(3)), JobFailed)
    assert (plain.code, plain.message, plain.kept) == (3, "", "")


@pytest.mark.parametrize(("halt", "failures"), [("now,fail=2", 2), ("now,fail=50%", 2), ("now,fail=25%", 1)])
def test_halt_now_counts_every_failure_says_so_and_kills_the_others(halt: str, failures: int) -> None:
    plan, actions = planner(jobs(4), hosts=1, options=PlanOptions(CPU, halt=parse_halt(halt)))
    assert len(starts(actions)) == 4
    for n in range(failures - 1):
        assert events(ended(plan, f"j{n}", Ended(1)), Stopping) == []
    last = f"j{failures - 1}"
    halted = ended(plan, last, Ended(1))
    assert said(halted, Stopping) == [at0(Stopping(how="halt", reason=f"{failures} jobs failed (--halt {halt.split(',')[0]})"))]
    assert [a for a in halted if isinstance(a, KillJob)] == [
        KillJob(f"j{n}", "halt") for n in range(failures, 4)
    ]
    assert all(plan.killed_for(f"j{n}") == "halt" for n in range(failures, 4))


def test_the_second_stop_says_it_kills() -> None:
    plan, _ = planner(jobs(2))
    assert said(plan.stop(), Stopping) == [at0(Stopping(how="drain"))]
    second = plan.stop()
    assert said(second, Stopping) == [at0(Stopping(how="kill"))]
    assert [a for a in second if isinstance(a, KillJob)] == [KillJob("j0", "stop"), KillJob("j1", "stop")]


def test_a_lost_connection_without_a_message_says_so() -> None:
    plan, _ = planner(jobs(1), hosts=1)
    lost = plan.job_exited("j0", Ended(None, host_lost=True))
    assert [e.reason for e in events(lost, HostDown)] == ["connection lost"]


def test_a_job_cancelled_alone_says_what_will_not_run_after_it() -> None:
    batch = [Job("a", "echo a", 1), Job("b", "echo b", 2, after=("a",))]
    plan, _ = planner(batch, hosts=1)
    actions = plan.cancel("a")
    kills = [a for a in actions if isinstance(a, KillJob)]
    assert kills == [KillJob("a", "cancel")]
    cancelled = plan.job_cancelled("a")
    assert said(cancelled, JobCancelled) == [at0(JobCancelled(job="a", host="h0"))]
    assert [(e.job, e.reason) for e in events(cancelled, JobNotRun)] == [("b", "a was cancelled")]


# -- the batch's start -----------------------------------------------------------------------------


def test_on_a_fleet_without_gpus_the_default_gpu_need_is_no_gpu_need_at_all() -> None:
    """The default of one GPU per job (not asked for) becomes no GPU on a fleet without any:
    none of its memory, utilization or reservation is left to be recorded or shown."""
    base = Needs(cpus=1, memory_mb=100, gpus=1, gpu_memory_mb=5000, gpu_utilization=0.5, reserve_gpu=True)
    _plan, actions = planner(jobs(1), hosts=1, options=PlanOptions(base))
    (start,) = starts(actions)
    assert start.placement.needs == Needs(cpus=1, memory_mb=100, gpus=0, gpu_memory_mb=0, gpu_utilization=0.0, reserve_gpu=False)


def test_a_batch_no_host_could_ever_run_is_refused_in_one_line_with_the_fix() -> None:
    plan = Planner(jobs(2), [("h0", "h0")], PlanOptions(Needs(gpus=0, cpus=100)))
    plan.probe_landed("h0", host_state())
    with pytest.raises(UnsatisfiableError) as refused:
        plan.begin("t")
    assert str(refused.value) == (
        "job j0 (and every job of this batch) can never run: needs 100 cpus; the largest host h0 has "
        "4 cpus (5 with overload 1.25); lower the job's needs or add a bigger machine"
    )
    # One job of several needs: it alone is named.
    batch = [Job("ok", "x", 1), Job("huge", "y", 2, needs=NeedsOverride(memory_mb=10**7))]
    plan = Planner(batch, [("h0", "h0")], PlanOptions(CPU))
    plan.probe_landed("h0", host_state())
    with pytest.raises(UnsatisfiableError) as refused:
        plan.begin("t")
    assert str(refused.value) == (
        "job huge can never run: needs 10000000 MiB RAM; the largest host h0 has 16000 MiB RAM; "
        "lower the job's needs or add a bigger machine"
    )


# -- retries, cancels, defaults --------------------------------------------------------------------


def test_a_job_killed_for_its_timeout_is_retried_first_when_retries_remain() -> None:
    """--timeout's kill is a failure like any other: retried while attempts remain, before the
    jobs still queued (one job at a time fits this host)."""
    plan, actions = planner(jobs(3), hosts=1, options=PlanOptions(CPU, timeout=5, retries=1), cpus=1)
    assert [s.job.name for s in starts(actions)] == ["j0"]
    plan.job_started("j0", 100.0)
    assert plan.tick(105.0) == [KillJob("j0", "timeout")]
    retried = plan.job_exited("j0", plan.timed_out("j0"))
    assert [e.attempt for e in events(retried, JobRetrying)] == [2]
    assert [s.job.name for s in starts(retried)] == ["j0"]


def test_a_job_cancelled_while_queued_says_no_host() -> None:
    plan, actions = planner(jobs(2), hosts=1, cpus=1)
    assert [s.job.name for s in starts(actions)] == ["j0"]
    assert plan.host_of("j1") is None and plan.host_of("j0") == "h0"
    assert said(plan.cancel("j1"), JobCancelled) == [at0(JobCancelled(job="j1", host=""))]


def test_what_is_not_given_is_not_made_up() -> None:
    """A start not run by Slurm names no Slurm job; a job without GPUs reserves no GPU memory,
    whatever the batch's GPU memory; a commit that brought nothing home says 0 bytes."""
    batch = [Job("cpu", "echo", 1, needs=NeedsOverride(gpus=0))]
    plan, actions = planner(batch, hosts=1, options=PlanOptions(GPU, gpus_explicit=True), gpus=1)
    assert starts(actions)[0].placement.gpu_indices == ()
    (started,) = events(plan.job_started("cpu", 1.0), JobStarted)
    assert (started.slurm_job, started.gpu_memory_mb) == ("", 0)
    assert Commit("cpu") in plan.job_exited("cpu", Ended(0))
    assert [e.bytes_received for e in events(plan.job_committed("cpu", Ended(0)), JobFinished)] == [0]
