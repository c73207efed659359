"""The planner with plain values: events in, actions out; no asyncio, no hosts."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter

import pytest

from ssh_scheduler.errors import UnsatisfiableError
from ssh_scheduler.events import (
    BatchStarted,
    Ended,
    HostQuarantined,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobPlaced,
    JobReattached,
    JobRequeued,
    JobRetrying,
    Stopping,
    Waiting,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.machines.host_state import GpuState, HostState
from ssh_scheduler.planner import phases
from ssh_scheduler.planner.actions import (
    Action,
    Cleanup,
    Commit,
    Discard,
    KillJob,
    PlanOptions,
    Reprobe,
    Revive,
    Say,
    StartJob,
    StopBatch,
)
from ssh_scheduler.planner.phases import JobPhase, JobSlot
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import Resumable, parse_halt
from tests.event_schema import load_schema, problems

CPU = Needs(cpus=1, memory_mb=100, gpus=0, gpu_memory_mb=0, reserve_gpu=False)


def host_state(cpus: int = 4, gpus: int = 0, gpu_mb: int = 16000) -> HostState:
    cards = tuple(GpuState(i, f"G{i}", "sim", gpu_mb, 0, gpu_mb - 480, 0.0) for i in range(gpus))
    return HostState(cpus, 0.0, 16000, 12000, cards)


def jobs(count: int, **kwargs: object) -> list[Job]:
    return [Job(f"j{i}", f"echo {i}", i + 1, **kwargs) for i in range(count)]  # type: ignore[arg-type]


DEFAULT = PlanOptions(CPU)


def planner(
    batch: list[Job], hosts: int = 2, options: PlanOptions = DEFAULT, cpus: int = 4, gpus: int = 0, **kw: object
) -> tuple[Planner, list[Action]]:
    plan = Planner(batch, [(f"h{i}", f"h{i}.yaml") for i in range(hosts)], options, **kw)  # type: ignore[arg-type]
    for i in range(hosts):
        assert plan.probe_landed(f"h{i}", host_state(cpus, gpus)) == []
    actions = plan.begin("token")
    return plan, actions + plan.kick()


def starts(actions: list[Action]) -> list[StartJob]:
    return [a for a in actions if isinstance(a, StartJob)]


def events(actions: list[Action], kind: type) -> list:  # type: ignore[type-arg]
    return [a.event for a in actions if isinstance(a, Say) and isinstance(a.event, kind)]


def finish(plan: Planner, name: str, code: int = 0) -> list[Action]:
    plan.job_started(name, 0.0)
    actions = plan.job_exited(name, Ended(code))
    if any(isinstance(a, Commit) for a in actions):
        actions += plan.job_committed(name, Ended(code), now=1.0)
    return actions


SCHEMA = load_schema()


class Said:
    """Checks what a replayed history's actions say, action by action: every event as ``--json``
    prints it matches the README's schema, a job is announced where it is started, a StartJob
    comes after its JobPlaced (or JobReattached) with the same host and GPUs, and a Waiting
    names a job that waits and what each usable host has (or that every host is down)."""

    def __init__(self, plan: Planner) -> None:
        self.plan = plan
        self.announced: dict[str, tuple[str, tuple[int, ...]]] = {}

    def check(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Say):
                record = json.loads(json.dumps(action.event.to_json()))
                assert problems(record, SCHEMA) == [], (action, problems(record, SCHEMA))
                event = action.event
                if isinstance(event, JobPlaced | JobReattached):
                    self.announced[event.job] = (event.host, event.gpus)
                    assert event.host in self.plan.hosts
                if isinstance(event, JobPlaced):
                    assert event.command == self.plan.jobs[event.job].job.command
                if isinstance(event, Waiting):
                    assert self.plan.phase(event.job) is JobPhase.QUEUED, event
                    hosts = self.plan.hosts.values()
                    reason = "; ".join(
                        f"{h.name}: {h.resources.capacity_summary()}" for h in hosts if h.usable and h.resources
                    ) or "; ".join(f"{h.name}: down" for h in hosts)
                    assert event.reason == reason, event
                if isinstance(event, JobRequeued | JobRetrying):
                    assert event.host in self.plan.hosts and event.job in self.plan.jobs
            elif isinstance(action, StartJob):
                placed = (action.placement.machine, action.placement.gpu_indices)
                assert self.announced.pop(action.job.name) == placed, action


Moves = Counter[tuple[JobPhase, JobPhase]]


def record_moves(monkeypatch: pytest.MonkeyPatch) -> Moves:
    """From now on, every phase move the planner makes, counted: each goes through phases.move
    (which refuses what its table does not list), wherever the planner's modules call it from."""
    seen: Moves = Counter()
    real = phases.move

    def recording(slot: JobSlot, to: JobPhase) -> None:
        seen[slot.phase, to] += 1
        real(slot, to)

    for module in list(sys.modules.values()):
        if module.__name__.startswith("ssh_scheduler.planner") and getattr(module, "move", None) is real:
            monkeypatch.setattr(module, "move", recording)
    return seen


def test_placement_fills_the_hosts_then_waits_for_room() -> None:
    plan, actions = planner(jobs(10), hosts=2, cpus=2)
    batch = events(actions, BatchStarted)[0]
    assert dict(batch.limits) == {"h0.yaml": 2, "h1.yaml": 2}  # 2 cpus x 1.25 overload / 1 cpu
    placed = starts(actions)
    assert len(placed) == 4 and Counter(s.placement.machine for s in placed) == {"h0": 2, "h1": 2}
    assert [e.job for e in events(actions, JobPlaced)] == [s.job.name for s in placed]
    more = finish(plan, placed[0].job.name)
    assert [s.job.name for s in starts(more)] == ["j4"]  # FIFO
    # No probe saw j0 run: its release was exact, so its end costs no probe.
    assert not any(isinstance(a, Reprobe) for a in more) and plan.next_deadline() is None


def test_one_outage_counts_once_and_three_quarantine() -> None:
    plan, actions = planner(jobs(8), hosts=2, cpus=4)
    on_h0 = [s.job.name for s in starts(actions) if s.placement.machine == "h0"]
    assert len(on_h0) >= 2
    lost = [plan.job_exited(name, Ended(None, host_lost=True, message="gone")) for name in on_h0]
    assert plan.hosts["h0"].failures == 1
    assert sum(isinstance(a, Revive) for group in lost for a in group) == 1  # one reviver
    assert [e.job for g in lost for e in events(g, JobRequeued)] == on_h0
    for outage in range(2):
        plan.host_back("h0", host_state())
        plan.host_lost("h0", f"outage {outage}")
    assert plan.hosts["h0"].quarantined
    assert not plan.hosts["h0"].usable


def test_quarantine_is_announced_once() -> None:
    plan, _ = planner(jobs(1), hosts=2, options=PlanOptions(CPU, quarantine_after=1))
    said = plan.host_lost("h1", "cut") + plan.host_lost("h1", "cut again")
    assert len(events(said, HostQuarantined)) == 1
    assert not any(isinstance(a, Revive) for a in said)


def test_a_requeued_job_runs_again_elsewhere() -> None:
    plan, actions = planner(jobs(1), hosts=2)
    first = starts(actions)[0]
    again = plan.job_exited("j0", Ended(None, host_lost=True, message="cut"))
    retried = starts(again)
    assert len(retried) == 1 and retried[0].placement.machine != first.placement.machine


def test_retries_prefer_another_host_and_discard_the_failed_attempt() -> None:
    plan, actions = planner(jobs(1), hosts=2, options=PlanOptions(CPU, retries=1))
    first = starts(actions)[0]
    plan.job_started("j0", 0.0)
    after = plan.job_exited("j0", Ended(3))
    assert Discard("j0", first.placement.machine) in after
    assert not any(isinstance(a, Commit) for a in after)
    retry = starts(after)[0]
    assert retry.attempt == 2 and retry.placement.machine != first.placement.machine
    assert events(after, JobRetrying)[0].attempts == 2
    last = plan.job_exited("j0", Ended(3))
    assert Commit("j0") in last  # no retries left: the failure is final
    assert events(plan.job_committed("j0", Ended(3)), JobFailed)[0].code == 3


def test_dependencies_wait_and_a_failure_stops_what_depends_on_it() -> None:
    batch = [
        Job("train", "t", 1),
        Job("test", "e", 2, after=("train",)),
        Job("report", "r", 3, after=("test",)),
        Job("other", "o", 4),
    ]
    plan, actions = planner(batch, hosts=1)
    assert {s.job.name for s in starts(actions)} == {"train", "other"}
    assert plan.phase("test") is JobPhase.BLOCKED
    after = finish(plan, "train")
    assert [s.job.name for s in starts(after)] == ["test"]
    failed = finish(plan, "test", code=1)
    assert [e.job for e in events(failed, JobNotRun)] == ["report"]
    assert plan.phase("report") is JobPhase.NOT_RUN
    finish(plan, "other")
    assert plan.done and plan.unfinished() == ["report"]


def test_a_dependency_that_failed_in_an_earlier_run() -> None:
    batch = [Job("test", "e", 2, after=("train",))]
    _plan, actions = planner(batch, hosts=1, already_done={"train": False})
    assert [e.job for e in events(actions, JobNotRun)] == ["test"] and not starts(actions)
    _ok, actions = planner(batch, hosts=1, already_done={"train": True})
    assert [s.job.name for s in starts(actions)] == ["test"]


def test_a_job_whose_dependency_failed_earlier_is_not_run_even_if_it_waits_for_others_too() -> None:
    batch = [
        Job("train", "t", 1),
        Job("test", "e", 2, after=("prep", "data", "train")),  # data ran fine, prep failed earlier
        Job("report", "r", 3, after=("test",)),
    ]
    plan, actions = planner(batch, hosts=1, already_done={"prep": False, "data": True})
    said = {e.job: e.reason for e in events(actions, JobNotRun)}
    assert said == {"test": "prep failed in an earlier run (--retry-failed reruns it)", "report": "test will not run"}
    assert [s.job.name for s in starts(actions)] == ["train"]
    assert not starts(finish(plan, "train"))  # its end does not start test
    assert plan.done and sorted(plan.unfinished()) == ["report", "test"]


def test_a_job_cancelled_before_the_batch_opens_stops_what_waits_for_it() -> None:
    plan = Planner([Job("a", "x", 1), Job("b", "y", 2, after=("a",))], [("h0", "h0")], DEFAULT)
    cancelled = plan.cancel("a")  # from another terminal, while the hosts still connect
    assert [e.job for e in events(cancelled, JobCancelled)] == ["a"]
    assert [e.reason for e in events(cancelled, JobNotRun)] == ["a was cancelled"]
    plan.probe_landed("h0", host_state())
    opened = plan.begin("t") + plan.kick()
    assert events(opened, BatchStarted) and not events(opened, JobNotRun) and not starts(opened)
    assert plan.done


def test_mixed_needs_a_big_gpu_job_does_not_hold_back_cpu_jobs() -> None:
    gpu_job = Job("big", "train", 1, needs=NeedsOverride(gpus=2, gpu_memory_mb=9000, cpus=1))
    cpu_jobs = [Job(f"c{i}", "prep", i + 2, needs=NeedsOverride(gpus=0)) for i in range(3)]
    options = PlanOptions(Needs(cpus=1, memory_mb=100, gpus=1, gpu_memory_mb=1000), gpus_explicit=True)
    plan = Planner([Job("g", "x", 0), gpu_job, *cpu_jobs], [("h0", "h0")], options)
    plan.probe_landed("h0", host_state(cpus=8, gpus=2))
    actions = plan.begin("t") + plan.kick()
    placed = {s.job.name: s.placement for s in starts(actions)}
    assert placed["g"].gpu_indices in ((0,), (1,))
    assert "big" not in placed  # one GPU is taken: two are needed
    for name in ("c0", "c1", "c2"):
        assert placed[name].gpu_indices == ()  # CPU lines never hold a GPU
    later = finish(plan, "g")
    assert [s.placement.gpu_indices for s in starts(later)] == [(0, 1)]


def test_a_job_no_host_could_ever_fit_is_refused_before_anything_runs() -> None:
    batch = [Job("ok", "x", 1), Job("huge", "y", 2, needs=NeedsOverride(memory_mb=10**7))]
    plan = Planner(batch, [("h0", "h0")], PlanOptions(CPU))
    plan.probe_landed("h0", host_state())
    with pytest.raises(UnsatisfiableError, match=r"job huge can never run: .*RAM"):
        plan.begin("t")


def test_the_batch_s_needs_are_judged_on_their_own_after_a_job_with_needs_of_its_own() -> None:
    """A first line that fits with needs of its own says nothing of the batch's needs (checked
    once for all the jobs that have them): a GPU batch on a host without GPUs is refused."""
    batch = [Job("cpu", "x", 1, needs=NeedsOverride(gpus=0)), Job("gpu", "y", 2), Job("gpu2", "y", 3)]
    plan = Planner(batch, [("h0", "h0")], PlanOptions(Needs(cpus=1, memory_mb=100, gpus=1, gpu_memory_mb=1000), gpus_explicit=True))
    plan.probe_landed("h0", host_state(gpus=0))
    with pytest.raises(UnsatisfiableError, match=r"job gpu can never run"):
        plan.begin("t")


def test_timeout_kills_at_the_deadline_and_the_attempt_ends_timed_out() -> None:
    plan, _actions = planner(jobs(1), hosts=1, options=PlanOptions(CPU, timeout=5))
    plan.job_started("j0", 100.0)
    assert plan.next_deadline() == 105.0
    assert plan.tick(104.9) == []
    assert plan.tick(105.0) == [KillJob("j0", "timeout")]
    assert plan.tick(106.0) == []  # killed once
    ended = plan.timed_out("j0")
    assert Commit("j0") in plan.job_exited("j0", ended)
    failed = events(plan.job_committed("j0", ended), JobFailed)[0]
    assert failed.timed_out and failed.code == 124 and failed.reason == "timed out after 5 s"


def test_halt_now_kills_the_others_and_halt_soon_lets_them_finish() -> None:
    plan, actions = planner(jobs(6), hosts=1, options=PlanOptions(CPU, halt=parse_halt("now,fail=1")))
    running = [s.job.name for s in starts(actions)]
    said = finish(plan, running[0], code=2)
    # j0's room went to the next job while its results travelled home; then its failure halted.
    running += [s.job.name for s in starts(said)]
    assert {a.job for a in said if isinstance(a, KillJob)} == set(running[1:])
    assert events(said, Stopping)[0].how == "halt" and plan.halted
    for name in running[1:]:
        assert events(plan.job_cancelled(name), JobCancelled)
    assert plan.done
    soon, actions = planner(jobs(6), hosts=1, options=PlanOptions(CPU, halt=parse_halt("soon,fail=1")))
    running = [s.job.name for s in starts(actions)]
    said = finish(soon, running[0], code=2)
    running += [s.job.name for s in starts(said)]  # placed before the failure was final
    assert not any(isinstance(a, KillJob) for a in said)
    assert not soon.done and not starts(soon.kick())
    for name in running[1:]:
        finish(soon, name)
    assert soon.done


def test_stop_drains_then_kills() -> None:
    plan, actions = planner(jobs(6), hosts=1)
    running = [s.job.name for s in starts(actions)]
    first = plan.stop()
    assert events(first, Stopping)[0].how == "drain" and not starts(finish(plan, running[0]))
    second = plan.stop()
    assert {a.job for a in second if isinstance(a, KillJob)} == set(running[1:])
    assert StopBatch() in second


def test_reattach_takes_up_what_the_journal_says_ran_there() -> None:
    resumable = {"j0": Resumable("j0", "h1", ()), "j1": Resumable("j1", "h0", ())}
    plan = Planner(jobs(3), [("h0", "h0"), ("h1", "h1")], PlanOptions(CPU), resumable=resumable)
    plan.probe_landed("h0", host_state())
    plan.probe_landed("h1", host_state())
    plan.begin("t")
    found = plan.agent_jobs_found("h1", {"j0": True, "j1": True, "stranger": False})
    assert [e.job for e in events(found, JobReattached)] == ["j0"]
    assert [(s.job.name, s.resume) for s in starts(found)] == [("j0", True)]
    assert Cleanup("h1", "j1") in found and Cleanup("h1", "stranger") in found
    rest = plan.kick()
    assert sorted(s.job.name for s in starts(rest)) == ["j1", "j2"]  # j1 runs anew


def test_waiting_is_said_once_per_reason_and_all_down_ends_the_batch() -> None:
    batch = [Job("j", "x", 1)]
    plan = Planner(batch, [("h0", "h0")], PlanOptions(CPU))
    busy = HostState(1, 1.0, 16000, 50, ())  # other users took the memory
    plan.probe_landed("h0", host_state())
    plan.begin("t")
    said = plan.probe_landed("h0", busy)
    assert len(events(said, Waiting)) == 1
    assert events(plan.probe_landed("h0", busy), Waiting) == []
    plan.hosts["h0"].quarantined = True
    gone = plan.kick()
    assert plan.done
    notice = gone[-1].event  # type: ignore[union-attr]
    assert (notice.level, notice.message) == ("error", "every host is down or quarantined; the remaining jobs were not run")


# -- replayed random histories -----------------------------------------------------------------


def test_random_histories_end_every_job_exactly_once_within_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of interleaved probes, starts, exits (ok, failed, host lost), host returns and
    stops: every job ends exactly once, never runs twice at once, and no GPU is ever promised
    more memory than it has; every job moves only as the phase table allows, and each history
    finishes with every job ended or (if a stop or every host's loss ended it early, or a job it
    waits for failed) not run."""
    moves = record_moves(monkeypatch)
    total_jobs = 0
    for seed in range(60):
        rng = random.Random(seed)
        needs = Needs(cpus=0.5, memory_mb=100, gpus=1, gpu_memory_mb=6000, reserve_gpu=False)
        batch = [
            Job(f"j{i}", "x", i + 1, needs=NeedsOverride(gpus=0) if rng.random() < 0.3 else NeedsOverride())
            for i in range(40)
        ]
        options = PlanOptions(needs, gpus_explicit=True, retries=rng.choice([0, 1, 2]))
        plan = Planner(batch, [(f"h{i}", f"h{i}") for i in range(3)], options)
        for i in range(3):
            plan.probe_landed(f"h{i}", host_state(cpus=8, gpus=2))
        pending: list[Action] = plan.begin("t") + plan.kick()
        running: set[str] = set()
        ends: Counter[str] = Counter()
        said = Said(plan)
        for _step in range(600):
            said.check(pending)
            for action in pending:
                if isinstance(action, StartJob):
                    assert action.job.name not in running
                    running.add(action.job.name)
                if isinstance(action, Say) and isinstance(action.event, JobFinished | JobFailed | JobCancelled):
                    ends[action.event.job] += 1
            for name in plan.hosts:
                resources = plan.resources(name)
                if resources is not None:
                    for capacity, others, ours in resources.gpu_promises():
                        assert others + ours <= capacity
            assert +plan.state.tally == Counter(slot.phase for slot in plan.jobs.values())
            pending = []
            roll = rng.random()
            if running and roll < 0.6:
                name = rng.choice(sorted(running))
                plan.job_started(name, 0.0)
                outcome = rng.random()
                ended = Ended(None, host_lost=True, message="x") if outcome < 0.1 else Ended(0 if outcome < 0.8 else 1)
                running.discard(name)
                pending = plan.job_exited(name, ended)
                if Commit(name) in pending:
                    pending += plan.job_committed(name, ended)
            elif roll < 0.75:
                host = rng.choice(list(plan.hosts))
                if plan.hosts[host].down is not None and not plan.hosts[host].quarantined:
                    pending = plan.host_back(host, host_state(cpus=8, gpus=2))
                elif plan.resources(host) is not None:
                    pending = plan.probe_landed(host, host_state(cpus=8, gpus=2))
            elif roll < 0.76:
                pending = plan.stop()
                for action in pending:
                    if isinstance(action, KillJob):
                        running.discard(action.job)
                        pending = pending + plan.job_cancelled(action.job)
            if plan.done and not running and not pending:
                break
        assert all(count == 1 for count in ends.values()), ends
        assert not (set(ends) & set(plan.unfinished()))
        assert plan.done, seed
        assert set(ends) | set(plan.unfinished()) == set(plan.jobs), seed
        if not plan.draining:  # nothing stopped it: what did not end was never to run
            assert all(plan.phase(name) is JobPhase.NOT_RUN for name in plan.unfinished()), seed
        total_jobs += len(ends)
    assert total_jobs > 1000
    Q, R, C = JobPhase.QUEUED, JobPhase.RUNNING, JobPhase.COPYING
    every = {(Q, R), (R, C), (C, JobPhase.FINISHED), (C, JobPhase.FAILED), (R, Q), (R, JobPhase.CANCELLED)}
    assert set(moves) == every, moves  # retries, lost hosts and stops took every way they have
