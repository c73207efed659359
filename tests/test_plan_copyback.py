"""A job's room is free at its exit; its end is final at its commit (plain values, no hosts).

Between the two the job is "copying back": its processes are gone (so its CPU, RAM, GPU and the
host's slot go to the next job at once) while its results travel home.  These tests pin down
what must still hold in that window: what waits for it with ``after``, ``--timeout``,
``--halt``, stop and cancel, the GPU memory invariant, the counts users see, and the bound on
copy-backs in flight per host; and replay random histories where exits and commits interleave.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ssh_scheduler.events import (
    Ended,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    Notice,
    Stopping,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState, OwnUsage
from ssh_scheduler.planner.actions import (
    Action,
    Commit,
    Discard,
    KillJob,
    PlanOptions,
    Say,
    StartJob,
    StopBatch,
)
from ssh_scheduler.planner.phases import JobPhase
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import parse_halt
from tests.test_plan import Said, record_moves

CPU = Needs(cpus=1, memory_mb=100, gpus=0, gpu_memory_mb=0, reserve_gpu=False)
GPU = Needs(cpus=0.5, memory_mb=100, gpus=1, gpu_memory_mb=9000, reserve_gpu=False)


def host_state(cpus: int = 4, gpus: int = 0, used_mb: int = 0, apps: tuple[GpuProcess, ...] = ()) -> HostState:
    cards = tuple(GpuState(i, f"G{i}", "sim", 16000, used_mb, 16000 - 480 - used_mb, 0.0) for i in range(gpus))
    return HostState(cpus, 0.0, 16000, 12000, cards, apps)


def planner(batch: list[Job], options: PlanOptions, hosts: int = 1, **state: int) -> tuple[Planner, list[Action]]:
    plan = Planner(batch, [(f"h{i}", f"h{i}") for i in range(hosts)], options)
    for i in range(hosts):
        plan.probe_landed(f"h{i}", host_state(**state))
    return plan, plan.begin("t") + plan.kick()


def jobs(count: int) -> list[Job]:
    return [Job(f"j{i}", f"echo {i}", i + 1) for i in range(count)]


def started(actions: list[Action]) -> list[str]:
    return [a.job.name for a in actions if isinstance(a, StartJob)]


def said(actions: list[Action], kind: type) -> list:  # type: ignore[type-arg]
    return [a.event for a in actions if isinstance(a, Say) and isinstance(a.event, kind)]


def exit_(plan: Planner, name: str, code: int = 0) -> list[Action]:
    plan.job_started(name, 0.0)
    return plan.job_exited(name, Ended(code))


def test_the_room_is_free_at_exit_and_the_end_is_final_at_the_commit() -> None:
    plan, actions = planner(jobs(3), PlanOptions(CPU), cpus=1)  # one slot (1 cpu x 1.25)
    assert started(actions) == ["j0"]
    at_exit = exit_(plan, "j0")
    assert Commit("j0") in at_exit and started(at_exit) == ["j1"]  # before j0's results are home
    assert not said(at_exit, JobFinished) and plan.phase("j0") is JobPhase.COPYING
    # What users are told runs: j1 runs, j0 copies back.
    assert plan.running() == ["j1"] and plan.copying_back() == ["j0"]
    assert plan.hosts["h0"].copying == 1
    assert said(plan.job_committed("j0", Ended(0), now=1.0), JobFinished)[0].job == "j0"
    assert plan.phase("j0") is JobPhase.FINISHED and plan.hosts["h0"].copying == 0 and plan.copying_back() == []


def test_the_batch_is_not_done_while_results_travel_home() -> None:
    plan, _ = planner(jobs(1), PlanOptions(CPU))
    exit_(plan, "j0")
    assert not plan.done
    plan.job_committed("j0", Ended(0))
    assert plan.done


def test_what_depends_on_a_job_waits_for_its_commit() -> None:
    batch = [Job("train", "t", 1), Job("test", "e", 2, after=("train",))]
    plan, _ = planner(batch, PlanOptions(CPU))
    assert started(exit_(plan, "train")) == []  # its results are not home yet
    assert plan.phase("test") is JobPhase.BLOCKED
    assert started(plan.job_committed("train", Ended(0))) == ["test"]


def test_a_failed_copy_back_is_the_jobs_final_failure_and_stops_its_dependents() -> None:
    batch = [Job("train", "t", 1), Job("test", "e", 2, after=("train",))]
    plan, _ = planner(batch, PlanOptions(CPU, retries=2))
    assert Commit("train") in exit_(plan, "train")  # exited 0: no retry, its results go home
    lost = plan.job_committed("train", Ended(1, message="copy back failed: disk full"))
    assert said(lost, JobFailed)[0].code == 1 and [e.job for e in said(lost, JobNotRun)] == ["test"]
    assert plan.failures == 1 and plan.hosts["h0"].copying == 0 and plan.done


def test_a_retried_attempt_discards_and_is_never_copying() -> None:
    plan, _ = planner(jobs(1), PlanOptions(CPU, retries=1))
    again = exit_(plan, "j0", code=3)
    assert Discard("j0", "h0") in again and started(again) == ["j0"]
    assert plan.phase("j0") is JobPhase.RUNNING and plan.hosts["h0"].copying == 0


def test_a_job_copying_back_past_its_timeout_is_not_killed() -> None:
    plan, _ = planner(jobs(1), PlanOptions(CPU, timeout=5))
    plan.job_started("j0", 100.0)
    plan.job_exited("j0", Ended(0))  # at 104.9
    assert plan.next_deadline() is None and plan.tick(200.0) == []
    assert said(plan.job_committed("j0", Ended(0)), JobFinished)


def test_cancel_while_copying_back_keeps_the_results() -> None:
    plan, _ = planner(jobs(1), PlanOptions(CPU))
    exit_(plan, "j0")
    answer = plan.cancel("j0")
    assert not any(isinstance(a, KillJob) for a in answer)
    assert "being copied back" in said(answer, Notice)[0].message
    assert said(plan.job_committed("j0", Ended(0)), JobFinished)


def test_halt_now_lets_a_copy_back_in_flight_land() -> None:
    plan, actions = planner(jobs(4), PlanOptions(CPU, halt=parse_halt("now,fail=1")), cpus=2)
    assert started(actions) == ["j0", "j1"]
    after = exit_(plan, "j0")  # j0 ok, copying back; j2 takes its room
    assert started(after) == ["j2"]
    halted = exit_(plan, "j1", code=2) + plan.job_committed("j1", Ended(2))
    assert said(halted, Stopping)[0].how == "halt"
    assert started(halted) == ["j3"]  # j1's room, at its exit
    assert {a.job for a in halted if isinstance(a, KillJob)} == {"j2", "j3"}  # not j0
    plan.job_cancelled("j2")
    plan.job_cancelled("j3")
    assert not plan.done  # j0's results are still on their way
    assert said(plan.job_committed("j0", Ended(0)), JobFinished) and plan.done


def test_the_second_stop_cancels_a_copy_back_once() -> None:
    plan, actions = planner(jobs(3), PlanOptions(CPU), cpus=2)
    assert started(actions) + started(exit_(plan, "j0")) == ["j0", "j1", "j2"]
    plan.stop()
    second = plan.stop()
    assert StopBatch() in second
    assert [a.job for a in second if isinstance(a, KillJob)] == ["j1", "j2"]  # not j0
    # StopBatch cancels every task, the copy-backs too: each ends once, as cancelled.
    ended = [e for name in ("j0", "j1", "j2") for e in said(plan.job_cancelled(name), JobCancelled)]
    assert [e.job for e in ended] == ["j0", "j1", "j2"]
    assert plan.hosts["h0"].copying == 0 and plan.done


def test_the_second_stop_while_a_failed_attempt_discards_its_folder_ends_the_job_once() -> None:
    # The coordinator's task of a failed attempt removes its folder on the host (Discard) while
    # the retry is placed, runs, even ends; the second stop cancels every task, that one too.
    plan, _ = planner(jobs(1), PlanOptions(CPU, retries=1), hosts=2)
    assert Discard("j0", "h0") in exit_(plan, "j0", code=3)  # the retry runs on h1 at once
    assert Commit("j0") in exit_(plan, "j0")
    assert said(plan.job_committed("j0", Ended(0)), JobFinished)
    plan.stop()
    plan.stop()
    assert plan.job_cancelled("j0") == []  # the old attempt's task: the job already ended
    assert plan.phase("j0") is JobPhase.FINISHED and plan.done
    # The retry still waits in the queue when the second stop comes: the job ends cancelled.
    plan, _ = planner(jobs(1), PlanOptions(CPU, retries=1))
    plan.pause()
    assert started(exit_(plan, "j0", code=3)) == [] and plan.phase("j0") is JobPhase.QUEUED
    plan.stop()
    assert not any(isinstance(a, KillJob) for a in plan.stop())
    assert [e.job for e in said(plan.job_cancelled("j0"), JobCancelled)] == ["j0"]
    assert plan.job_cancelled("j0") == [] and plan.done and plan.unfinished() == []
    assert not plan.kick() and not any(plan.state.queues.values())  # out of the queue too


def test_copy_backs_in_flight_per_host_are_bounded() -> None:
    plan, actions = planner(jobs(8), PlanOptions(CPU, copy_backs_per_host=2), cpus=2)
    assert started(actions) == ["j0", "j1"]
    assert started(exit_(plan, "j0")) == ["j2"]
    assert started(exit_(plan, "j1")) == []  # two copy-backs in flight: the host waits
    assert started(exit_(plan, "j2")) == []
    assert not said(plan.kick(), Notice)  # waiting on its copy-backs, not "every host is down"
    assert started(plan.job_committed("j0", Ended(0))) == []  # still two in flight
    assert started(plan.job_committed("j1", Ended(0))) == ["j3", "j4"]


def test_a_gpu_freed_at_exit_stays_charged_until_a_probe_asked_after_the_exit() -> None:
    batch = [Job("a", "x", 1), Job("b", "y", 2)]
    plan, actions = planner(batch, PlanOptions(GPU, gpus_explicit=True), cpus=8, gpus=1)
    assert started(actions) == ["a"]  # 9000 + 9000 MiB do not fit on 15520
    resources = plan.resources("h0")
    assert resources is not None
    # A probe sees a's process using 12000 MiB.
    seen = plan.probe_landed(
        "h0", host_state(8, 1, 12000, (GpuProcess(11, "G0", 12000),)), {"a": OwnUsage(frozenset({11}))},
        resources.probe_started(),
    )
    assert started(seen) == []
    early = resources.probe_started()  # asked before a exited: may still show a's memory
    assert started(exit_(plan, "a")) == []  # a's observed memory is a ghost now
    stale = plan.probe_landed("h0", host_state(8, 1, 12000), {}, early)
    assert started(stale) == []  # a's memory there and its ghost: too much, never too little
    fresh = plan.probe_landed("h0", host_state(8, 1), {}, resources.probe_started())
    assert started(fresh) == ["b"]
    plan.job_committed("a", Ended(0))
    assert plan.phase("a") is JobPhase.FINISHED


# -- replayed random histories: exits and commits interleaved ------------------------------------


def test_random_histories_with_copy_backs_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exits, commits (ok or failed), host losses, probes (some asked before a release), cancels,
    ``--halt`` and stops interleave at random: every job ends exactly once, never runs twice at
    once (a copying-back job is not placed again), no GPU is promised more than it has, and no
    job is placed on a host with the bound of copy-backs in flight."""
    moves = record_moves(monkeypatch)
    total = overlapped = 0
    for seed in range(60):
        rng = random.Random(seed)
        bound = rng.choice([1, 2, 32])
        batch = [
            Job(
                f"j{i}", "x", i + 1,
                needs=NeedsOverride(gpus=0) if rng.random() < 0.3 else NeedsOverride(),
                after=(f"j{i - 1}",) if i and rng.random() < 0.1 else (),
            )
            for i in range(40)
        ]  # fmt: skip
        halt = rng.choice(["never", "now,fail=3", "soon,fail=3"])
        options = PlanOptions(
            Needs(cpus=0.5, memory_mb=100, gpus=1, gpu_memory_mb=6000, reserve_gpu=False),
            gpus_explicit=True, retries=rng.choice([0, 1]), halt=parse_halt(halt), copy_backs_per_host=bound,
        )  # fmt: skip
        plan = Planner(batch, [(f"h{i}", f"h{i}") for i in range(3)], options)
        for i in range(3):
            plan.probe_landed(f"h{i}", host_state(cpus=8, gpus=2))
        pending: list[Action] = plan.begin("t") + plan.kick()
        running: set[str] = set()
        copying: set[str] = set()
        asked: dict[str, list[int]] = {h: [] for h in plan.hosts}  # probes asked, not landed yet
        ends: Counter[str] = Counter()
        said = Said(plan)
        for _step in range(800):
            said.check(pending)
            for action in pending:
                if isinstance(action, StartJob):
                    assert action.job.name not in running | copying
                    assert plan.hosts[action.placement.machine].copying < bound  # placed within it
                    running.add(action.job.name)
                    overlapped += bool(copying)  # started while results travel home
                elif isinstance(action, Commit):
                    copying.add(action.job)
                elif isinstance(action, Say) and isinstance(action.event, JobFinished | JobFailed | JobCancelled):
                    ends[action.event.job] += 1
            for host, slot in plan.hosts.items():
                assert slot.copying >= 0
                resources = plan.resources(host)
                if resources is not None:
                    for capacity, others, ours in resources.gpu_promises():
                        assert others + ours <= capacity
            assert set(plan.running()) == running and set(plan.copying_back()) == copying
            assert +plan.state.tally == Counter(slot.phase for slot in plan.jobs.values())
            pending = []
            roll = rng.random()
            if running and roll < 0.35:
                name = rng.choice(sorted(running))
                running.discard(name)
                plan.job_started(name, 0.0)
                outcome = rng.random()
                ended = Ended(None, host_lost=True, message="x") if outcome < 0.1 else Ended(0 if outcome < 0.8 else 1)
                pending = plan.job_exited(name, ended)
            elif copying and roll < 0.6:
                name = rng.choice(sorted(copying))
                copying.discard(name)
                pending = plan.job_committed(name, Ended(0 if rng.random() < 0.9 else 1))
            elif roll < 0.75:
                host = rng.choice(list(plan.hosts))
                resources = plan.resources(host)
                if plan.hosts[host].down is not None and not plan.hosts[host].quarantined:
                    pending = plan.host_back(host, host_state(cpus=8, gpus=2))
                    asked[host] = []
                elif resources is not None and asked[host] and rng.random() < 0.5:
                    pending = plan.probe_landed(host, host_state(cpus=8, gpus=2), {}, asked[host].pop(0))
                elif resources is not None:
                    asked[host].append(resources.probe_started())
            elif roll < 0.78 and (running or copying):
                name = rng.choice(sorted(running | copying))
                pending = plan.cancel(name)
                if KillJob(name, "cancel") in pending:
                    running.discard(name)
                    pending += plan.job_cancelled(name)
            elif roll < 0.785:
                pending = plan.stop()
                assert {a.job for a in pending if isinstance(a, KillJob)} <= running  # never a copy-back
                if StopBatch() in pending:  # every task is cancelled, copy-backs too
                    for name in sorted(running | copying):
                        pending += plan.job_cancelled(name)
                    running.clear()
                    copying.clear()
                else:
                    for action in pending:
                        if isinstance(action, KillJob):
                            running.discard(action.job)
                            pending += plan.job_cancelled(action.job)
            # halt now: the coordinator cancels what it was told to kill
            for action in list(pending):
                if isinstance(action, KillJob) and action.reason == "halt":
                    assert action.job in running  # never a copy-back
                    running.discard(action.job)
                    pending += plan.job_cancelled(action.job)
            if plan.done and not running and not copying and not pending:
                break
        assert all(count == 1 for count in ends.values()), ends
        assert not (set(ends) & set(plan.unfinished()))
        assert plan.done, seed
        assert set(ends) | set(plan.unfinished()) == set(plan.jobs), seed
        if not plan.draining:  # nothing stopped it: what did not end was never to run
            assert all(plan.phase(name) is JobPhase.NOT_RUN for name in plan.unfinished()), seed
        total += len(ends)
    assert total > 1000 and overlapped > 500, (total, overlapped)
    B, Q, R, C = JobPhase.BLOCKED, JobPhase.QUEUED, JobPhase.RUNNING, JobPhase.COPYING
    cancelled = JobPhase.CANCELLED
    every = {(B, Q), (B, JobPhase.NOT_RUN), (Q, R), (R, C), (R, Q), (R, cancelled), (C, cancelled)}
    every |= {(C, JobPhase.FINISHED), (C, JobPhase.FAILED)}
    assert set(moves) == every, moves
