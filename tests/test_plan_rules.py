"""Planner rules the mutation run (scripts/mutation, docs/mutation.md) found untested: each test
here failed against at least one surviving mutant, and names the rule it pins."""

from __future__ import annotations

from collections import Counter

import pytest

from ssh_scheduler.errors import ConfigError, UnsatisfiableError
from ssh_scheduler.events import (
    Ended,
    HostBack,
    HostDown,
    HostQuarantined,
    JobCancelled,
    JobRequeued,
    Notice,
    PlanLine,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.planner.actions import Cleanup, KillJob, PlanOptions, Reprobe, Revive
from ssh_scheduler.planner.phases import JobPhase, JobSlot, PlannerBug, move
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import HaltPolicy, parse_halt
from tests.test_plan import CPU, DEFAULT, events, finish, host_state, jobs, planner, starts

# -- --halt ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        (None, HaltPolicy()),
        ("", HaltPolicy()),
        ("never", HaltPolicy()),
        ("now,fail=1", HaltPolicy("now", count=1)),
        (" soon,fail=12 ", HaltPolicy("soon", count=12)),
        ("soon,fail=10%", HaltPolicy("soon", percent=10.0)),
        ("now,fail=2.5%", HaltPolicy("now", percent=2.5)),
    ],
)
def test_halt_is_read_as_gnu_parallel_writes_it(text: str | None, policy: HaltPolicy) -> None:
    assert parse_halt(text) == policy


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("later,fail=1", "--halt 'later,fail=1': expected never, now,fail=N, soon,fail=N or soon,fail=N% (e.g. --halt now,fail=1)"),
        ("now,fail=0", "--halt 'now,fail=0': the failure count must be a whole number >= 1"),
        ("now,fail=1.5", "--halt 'now,fail=1.5': the failure count must be a whole number >= 1"),
    ],
)
def test_a_bad_halt_is_one_line_with_the_fix(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_halt(text)
    assert str(refused.value) == says


def test_halt_is_reached_at_its_count_or_percent_never_before() -> None:
    assert not HaltPolicy().reached(100, 100)
    assert not HaltPolicy("now", count=1).reached(0, 10)
    assert not HaltPolicy("now", count=3).reached(2, 10) and HaltPolicy("now", count=3).reached(3, 10)
    ten = HaltPolicy("soon", percent=10.0)
    assert not ten.reached(1, 11) and ten.reached(1, 10) and ten.reached(2, 11)
    assert HaltPolicy("soon", percent=50.0).reached(1, 0)  # no jobs counts as one
    assert HaltPolicy("soon", percent=100.0).reached(1, 1)  # one job: it failing is 100 %
    assert not HaltPolicy("soon", percent=25.25).reached(1, 4)  # 25 % is not 25.25 %
    assert not HaltPolicy("soon").reached(5, 10)  # neither count nor percent: never
    assert not HaltPolicy("never", count=1).reached(5, 10)  # never means never, whatever else it holds


# -- --dry-run -------------------------------------------------------------------------------------


def test_the_dry_run_places_as_if_jobs_ended_in_the_order_they_started() -> None:
    fresh = Planner(jobs(5), [("h0", "h0"), ("h1", "h1")], PlanOptions(CPU))
    for host in ("h0", "h1"):
        fresh.probe_landed(host, host_state(cpus=2))
    fresh.begin("t")
    lines = fresh.dry_run()
    assert [(line.job, line.host, line.gpus) for line in lines] == [
        ("j0", "h0", ()), ("j1", "h1", ()), ("j2", "h0", ()), ("j3", "h1", ()), ("j4", "h0", ()),
    ]
    assert all(isinstance(line, PlanLine) for line in lines)
    assert fresh.resources("h0").running == {}  # type: ignore[union-attr]  # left as it was
    # A job that ended (here: cancelled before the batch opened) is skipped, not the end of the plan.
    cancelled = Planner(jobs(5), [("h0", "h0"), ("h1", "h1")], PlanOptions(CPU))
    for host in ("h0", "h1"):
        cancelled.probe_landed(host, host_state(cpus=2))
    cancelled.cancel("j0")
    cancelled.begin("t")
    assert [line.job for line in cancelled.dry_run()] == ["j1", "j2", "j3", "j4"]


def test_a_dry_run_with_no_room_now_says_which_job_fits_nowhere() -> None:
    plan = Planner(jobs(1), [("h0", "h0")], PlanOptions(CPU))
    plan.probe_landed("h0", HostState(4, 0.0, 16000, 50, ()))  # other users hold the memory now
    plan.begin("t")
    with pytest.raises(UnsatisfiableError) as refused:
        plan.dry_run()
    assert str(refused.value) == "job j0 fits on no host"


def test_an_illegal_move_names_the_moves_there_are() -> None:
    slot = JobSlot(Job("j", "x", 1), phase=JobPhase.FINISHED, tally=Counter({JobPhase.FINISHED: 1}))
    with pytest.raises(PlannerBug) as ended:
        move(slot, JobPhase.RUNNING)
    assert str(ended.value) == "bug: job j cannot go from finished to running (from finished: none: it ended)"
    slot = JobSlot(Job("j", "x", 1), phase=JobPhase.COPYING, tally=Counter({JobPhase.COPYING: 1}))
    with pytest.raises(PlannerBug) as copying:
        move(slot, JobPhase.QUEUED)
    assert str(copying.value).endswith("(from copying: finished, failed, cancelled)")


# -- hosts -----------------------------------------------------------------------------------------


def test_a_host_that_comes_back_is_probed_ends_what_it_should_not_run_and_takes_jobs() -> None:
    plan, actions = planner(jobs(3), hosts=2, cpus=1)
    on_h0 = next(s.job.name for s in starts(actions) if s.placement.machine == "h0")
    lost = plan.job_exited(on_h0, Ended(None, host_lost=True, message="cut"))
    down = events(lost, HostDown)
    assert [(e.host, e.reason) for e in down] == [("h0", "cut")]
    assert Revive("h0") in lost and plan.hosts["h0"].reviving
    assert [(e.job, e.host, e.reason) for e in events(lost, JobRequeued)] == [(on_h0, "h0", "host h0 was lost")]
    # It comes back: what its agent still runs for us was requeued elsewhere, so it is ended there.
    back = plan.host_back("h0", host_state(cpus=1), {}, {on_h0: True}, now=50.0)
    assert [e.host for e in events(back, HostBack)] == ["h0"]
    assert Cleanup("h0", on_h0) in back
    assert not plan.hosts["h0"].reviving and plan.hosts["h0"].down is None
    assert plan.state.probes.hosts["h0"].landed_at == 50.0  # the periodic probe counts from here
    assert plan.next_deadline() == 50.0 + DEFAULT.probe_interval
    assert [s.placement.machine for s in starts(back)] == ["h0"]  # it takes the waiting job


def test_a_host_that_comes_back_keeps_what_it_still_runs_for_us_and_its_use() -> None:
    plan, actions = planner(jobs(1), hosts=1)
    running = starts(actions)[0].job.name
    plan.host_lost("h0", "flaky")
    back = plan.host_back("h0", host_state(), {running: OwnUsage(frozenset({42}), rss_mb=3000)}, {running: True})
    assert not any(isinstance(a, Cleanup) for a in back)  # still ours, running there
    assert plan.resources("h0").free_memory_mb == 12000 + 3000 - 3000  # type: ignore[union-attr]


def test_quarantine_names_the_host_and_its_failures() -> None:
    plan, _ = planner(jobs(1), hosts=2, options=PlanOptions(CPU, quarantine_after=2))
    said = plan.host_lost("h1", "one") + plan.host_back("h1", host_state()) + plan.host_lost("h1", "two")
    assert [(e.host, e.failures) for e in events(said, HostQuarantined)] == [("h1", 2)]
    assert plan.hosts["h1"].quarantined and plan.hosts["h1"].down == "two"


def test_a_requeued_job_goes_to_the_front_of_the_queue() -> None:
    plan, actions = planner(jobs(4), hosts=2, cpus=1)
    first = starts(actions)
    lost = next(s.job.name for s in first if s.placement.machine == "h1")
    plan.job_exited(lost, Ended(None, host_lost=True, message="cut"))
    other = next(s.job.name for s in first if s.placement.machine == "h0")
    assert [s.job.name for s in starts(finish(plan, other))] == [lost]  # before j2 and j3


# -- stopping and control --------------------------------------------------------------------------


def test_stop_twice_cancels_the_batch_and_kills_with_the_reason() -> None:
    plan, actions = planner(jobs(1), hosts=1)
    assert not plan.cancelled and not plan.halted
    plan.stop()
    assert not plan.cancelled
    killed = plan.stop()
    assert plan.cancelled and KillJob(starts(actions)[0].job.name, "stop") in killed
    assert plan.killed_for(starts(actions)[0].job.name) == "stop"


def test_timeout_marks_the_kill_as_a_timeout() -> None:
    plan, _ = planner(jobs(1), hosts=1, options=PlanOptions(CPU, timeout=5))
    plan.job_started("j0", 0.0)
    plan.tick(5.0)
    assert plan.killed_for("j0") == "timeout"


def test_cancelling_what_cannot_be_cancelled_warns_in_words() -> None:
    plan, _actions = planner(jobs(2), hosts=1, cpus=1)
    finish(plan, "j0")
    for name, message in (
        ("j0", "cancel j0: already finished"),
        ("nope", "cancel nope: is not part of this batch"),
    ):
        (notice,) = events(plan.cancel(name), Notice)
        assert (notice.level, notice.message) == ("warning", message)
    plan.job_started("j1", 0.0)
    plan.job_exited("j1", Ended(0))
    (copying,) = events(plan.cancel("j1"), Notice)
    assert (copying.level, copying.message) == ("warning", "cancel j1: it already ended; its results are being copied back")
    queued = Planner([*jobs(2), Job("late", "x", 3)], [("h0", "h0")], DEFAULT)
    queued.probe_landed("h0", host_state(cpus=1))
    queued.begin("t")
    queued.kick()
    (dropped,) = events(queued.cancel("late"), JobCancelled)
    assert (dropped.job, dropped.host) == ("late", "")
    assert queued.phase("late") is JobPhase.CANCELLED


# -- probes while paused or draining ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["pause", "stop"])
def test_no_probe_for_a_credit_while_nothing_may_start(how: str) -> None:
    plan = Planner(jobs(4), [("h0", "h0")], PlanOptions(CPU, probe_interval=15.0, probe_gap=1.0))
    plan.begin("t")
    running = starts(plan.probe_landed("h0", host_state(cpus=2), now=0.0))
    seen = {s.job.name: OwnUsage(frozenset({100 + i})) for i, s in enumerate(running)}
    plan.probe_landed("h0", host_state(cpus=2), seen, now=1.0)  # it saw them: a release is stale
    getattr(plan, how)()
    finish(plan, running[0].job.name)
    assert plan.next_deadline() == 16.0  # only the periodic one: nothing may start anyway
    assert plan.tick(2.0) == []
    if how == "pause":
        assert len(starts(plan.resume())) == 1  # j0's room; j3 still waits for a credit
        assert plan.next_deadline() == 2.0 and plan.tick(2.0) == [Reprobe("h0")]
