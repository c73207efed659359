"""The planner's start and probing with plain values: hosts answering one by one, a slow one
never holding back the others, and probes bounded however many jobs turn over."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ssh_scheduler.errors import NoUsableHostError, TransportError, UnsatisfiableError
from ssh_scheduler.events import (
    BatchStarted,
    Ended,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobReattached,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState, OwnUsage
from ssh_scheduler.planner.actions import Action, Commit, PlanOptions, Reprobe, Say, StartJob
from ssh_scheduler.planner.phases import JobPhase
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import Resumable
from tests.test_plan import Said, record_moves

CPU = Needs(cpus=1, memory_mb=100, gpus=0, gpu_memory_mb=0, reserve_gpu=False)


def state(cpus: int = 2, gpus: int = 0, processes: tuple[GpuProcess, ...] = ()) -> HostState:
    cards = tuple(GpuState(i, f"G{i}", "sim", 16000, 0, 15520, 0.0) for i in range(gpus))
    return HostState(cpus, 0.0, 16000, 12000, cards, processes)


def batch(count: int) -> list[Job]:
    return [Job(f"j{i}", "true", i + 1) for i in range(count)]


def hosts(count: int) -> list[tuple[str, str]]:
    return [(f"h{i}", f"h{i}") for i in range(count)]


def starts(actions: list[Action]) -> list[StartJob]:
    return [a for a in actions if isinstance(a, StartJob)]


def said(actions: list[Action], kind: type) -> list:  # type: ignore[type-arg]
    return [a.event for a in actions if isinstance(a, Say) and isinstance(a.event, kind)]


def end(plan: Planner, name: str) -> list[Action]:
    plan.job_started(name, 0.0)
    actions = plan.job_exited(name, Ended(0))
    assert Commit(name) in actions
    return actions + plan.job_committed(name, Ended(0))


def test_the_batch_waits_for_every_host_unless_the_slow_ones_are_overdue() -> None:
    plan = Planner(batch(8), hosts(3), PlanOptions(CPU))
    assert plan.begin("t") == []
    assert plan.probe_landed("h0", state(), now=0.0) == []  # h1, h2 still probing
    opened = plan.probes_overdue()
    assert said(opened, BatchStarted)[0].limits == (("h0", 2),)
    assert {s.placement.machine for s in starts(opened)} == {"h0"}
    # h1 answers while h2 still hangs: it takes jobs at once.
    assert {s.placement.machine for s in starts(plan.probe_landed("h1", state(), now=1.0))} == {"h1"}
    assert starts(plan.host_unreachable("h2", "probe timed out")) == []  # nothing left to place there


def test_all_hosts_answering_opens_the_batch_with_every_host() -> None:
    plan = Planner(batch(3), hosts(2), PlanOptions(CPU))
    plan.begin("t")
    assert plan.probe_landed("h0", state(), now=0.0) == []
    actions = plan.probe_landed("h1", state(), now=0.0)
    assert dict(said(actions, BatchStarted)[0].limits) == {"h0": 2, "h1": 2}
    assert len(starts(actions)) == 3


def test_the_default_gpu_waits_for_a_gpu_host_or_for_every_host() -> None:
    default = PlanOptions(Needs(cpus=1, memory_mb=100))  # one GPU each, not asked for explicitly
    plan = Planner(batch(2), hosts(3), default)
    plan.begin("t")
    plan.probe_landed("h0", state(), now=0.0)
    assert plan.probes_overdue() == []  # h0 has no GPU: maybe h1 or h2 has; the needs wait
    actions = plan.probe_landed("h1", state(gpus=1), now=0.0)
    assert [s.placement.gpu_indices for s in starts(actions)] == [(0,)]  # GPU jobs, on h1
    cpu_only = Planner(batch(2), hosts(2), default)
    cpu_only.begin("t")
    cpu_only.probe_landed("h0", state(), now=0.0)
    cpu_only.probes_overdue()
    actions = cpu_only.host_unreachable("h1", "gone")
    assert [s.placement.gpu_indices for s in starts(actions)] == [(), ()]  # no GPU anywhere: none


def test_a_job_no_answered_host_fits_waits_for_the_others_then_is_refused_or_not_run() -> None:
    big = Job("big", "x", 9, needs=NeedsOverride(cpus=8))
    plan = Planner([*batch(1), big], hosts(2), PlanOptions(CPU))
    plan.begin("t")
    plan.probe_landed("h0", state(cpus=2), now=0.0)
    assert [s.job.name for s in starts(plan.probes_overdue())] == ["j0"]
    ended = plan.host_unreachable("h1", "gone")  # the last host answered: big never fits
    assert "can never run" in said(ended, JobNotRun)[0].reason and not starts(ended)
    end(plan, "j0")
    assert plan.done
    # Nothing placed yet when the last host answers: the batch is refused as before.
    refused = Planner([big], hosts(2), PlanOptions(CPU))
    refused.begin("t")
    refused.probe_landed("h0", state(cpus=2), now=0.0)
    refused.probes_overdue()
    with pytest.raises(UnsatisfiableError, match=r"job big .*can never run"):
        refused.host_unreachable("h1", "gone")
    # A host that fits answers later: the job runs there.
    fits = Planner([big], hosts(2), PlanOptions(CPU))
    fits.begin("t")
    fits.probe_landed("h0", state(cpus=2), now=0.0)
    fits.probes_overdue()
    assert [s.placement.machine for s in starts(fits.probe_landed("h1", state(cpus=16), now=0.0))] == ["h1"]


def test_a_job_left_running_on_a_slow_host_waits_for_it_instead_of_starting_twice() -> None:
    plan = Planner(batch(2), hosts(2), PlanOptions(CPU), resumable={"j0": Resumable("j0", "h1", ())})
    plan.begin("t")
    plan.probe_landed("h0", state(), now=0.0)
    assert [s.job.name for s in starts(plan.probes_overdue())] == ["j1"]
    back = plan.probe_landed("h1", state(), now=0.0, agent_jobs={"j0": True})
    assert [e.job for e in said(back, JobReattached)] == ["j0"]
    assert [(s.job.name, s.resume) for s in starts(back)] == [("j0", True)]


def test_thousands_of_short_jobs_cost_no_probes_and_periodic_probes_stay_periodic() -> None:
    plan = Planner(batch(2000), hosts(4), PlanOptions(CPU, probe_interval=15.0, probe_gap=1.0))
    plan.begin("t")
    running = []
    for i in range(4):
        running += starts(plan.probe_landed(f"h{i}", state(), now=0.0))
    probes = 0
    now = 0.0
    while running:
        job = running.pop(0)
        running += starts(end(plan, job.job.name))
        now += 0.001  # a thousand jobs a second
        probes += sum(isinstance(a, Reprobe) for a in plan.tick(now))
    assert probes == 0  # 2 s in, no probe saw a job run: every release was exact
    assert plan.next_deadline() == 15.0  # the periodic ones


def test_a_release_a_probe_saw_asks_one_probe_per_gap_while_jobs_wait() -> None:
    plan = Planner(batch(40), hosts(1), PlanOptions(CPU, probe_interval=15.0, probe_gap=1.0))
    plan.begin("t")
    running = starts(plan.probe_landed("h0", state(), now=0.0))
    assert len(running) == 2
    assert plan.tick(15.0) == [Reprobe("h0")]  # periodic
    assert plan.tick(15.5) == []  # in flight: never two at once
    seen = {s.job.name: OwnUsage(frozenset({100 + i}), rss_mb=500) for i, s in enumerate(running)}
    plan.probe_landed("h0", state(), seen, now=16.0)  # it saw both jobs running
    for job in running:
        end(plan, job.job.name)  # their memory is still counted: a probe must credit it
    assert plan.next_deadline() == 17.0  # one gap after the last probe
    assert plan.tick(16.5) == []
    assert plan.tick(17.0) == [Reprobe("h0")]
    assert plan.tick(17.0) == []  # coalesced: both releases, one probe
    plan.probe_landed("h0", state(), now=17.2)
    assert plan.next_deadline() == 17.2 + 15.0  # nothing stale any more: periodic only


GPU = Needs(cpus=1, memory_mb=100, gpus=1, gpu_memory_mb=4000, reserve_gpu=True)


def held(*mb: int) -> HostState:
    """One host with len(mb) GPUs; another user's process (pid 900 + i) holds mb[i] MiB on
    GPU i (none where mb[i] is 0)."""
    cards = tuple(GpuState(i, f"G{i}", "sim", 16000, used, 15520 - used, 0.0) for i, used in enumerate(mb))
    processes = tuple(GpuProcess(900 + i, f"G{i}", used) for i, used in enumerate(mb) if used)
    return HostState(2, 0.0, 16000, 12000, cards, processes)


def probe_times(plan: Planner, until: float, shows: HostState, host: str = "h0", took: float = 0.1) -> list[float]:
    """Drive the planner's clock: at each deadline, perform its Reprobes (each lands ``took``
    later, showing ``shows``); the times probes of ``host`` started, up to ``until``."""
    started = []
    now = 0.0
    while (deadline := plan.next_deadline()) is not None and deadline <= until:
        now = max(now, deadline)
        for action in plan.tick(now):
            if isinstance(action, Reprobe):
                if action.host == host:
                    started.append(now)
                plan.probe_landed(action.host, shows, now=now + took)
    return started


def test_a_gpu_another_user_holds_is_looked_at_again_soon_backing_off_while_a_gpu_job_waits() -> None:
    plan = Planner(batch(1), hosts(1), PlanOptions(GPU, gpus_explicit=True, probe_interval=15.0, probe_gap=1.0, probe_held_max=8.0))
    plan.begin("t")
    assert starts(plan.probe_landed("h0", held(15000), now=0.0)) == []  # their GPU: the job waits
    assert plan.resources("h0").gpus_held_by_others == (0,)  # type: ignore[union-attr]
    # 1, 2, 4, then 8 s (held_max) after each probe lands, not 15 s (the periodic interval).
    assert probe_times(plan, 40.0, held(15000)) == [1.0, 3.1, 7.2, 15.3, 23.4, 31.5, 39.6]
    # They free it: the next probe sees it, the job starts, and nothing waits any more.
    assert [s.job.name for s in starts(plan.probe_landed("h0", held(0), now=40.0))] == ["j0"]
    assert plan.next_deadline() == 55.0  # periodic only


def test_held_gpus_cost_no_early_probe_unless_a_job_waits_for_a_gpu() -> None:
    cpu = Planner(batch(3), hosts(1), PlanOptions(CPU, probe_interval=15.0, probe_gap=1.0))
    cpu.begin("t")
    assert len(starts(cpu.probe_landed("h0", held(15000), now=0.0))) == 2  # 2 CPUs: one job waits
    assert cpu.next_deadline() == 15.0  # a freed GPU could not start it
    # A GPU job waits, but the host's GPUs are ours (the one job runs there): no early probe.
    ours = Planner(batch(2), hosts(1), PlanOptions(GPU, gpus_explicit=True, probe_interval=15.0, probe_gap=1.0))
    ours.begin("t")
    assert len(starts(ours.probe_landed("h0", held(0), now=0.0))) == 1
    assert ours.next_deadline() == 15.0


def test_the_back_off_starts_over_when_the_held_gpus_change() -> None:
    plan = Planner(batch(2), hosts(1), PlanOptions(GPU, gpus_explicit=True, probe_interval=15.0, probe_gap=1.0, probe_held_max=8.0))
    plan.begin("t")
    plan.probe_landed("h0", held(15000, 15000), now=0.0)
    assert probe_times(plan, 8.0, held(15000, 15000)) == [1.0, 3.1, 7.2]
    assert plan.next_deadline() == 7.3 + 8.0
    # GPU 1 is freed (a job starts there) and GPU 0 is still theirs: something moved, look again soon.
    assert len(starts(plan.probe_landed("h0", held(15000, 0), now=9.0))) == 1
    assert plan.next_deadline() == 10.0
    # Paused, nothing is placed: held GPUs call for no early probe.
    plan.pause()
    assert plan.next_deadline() == 24.0


def test_no_usable_host_is_the_planners_own_error_not_a_transports() -> None:
    plan = Planner(batch(2), hosts(2), PlanOptions(CPU))
    plan.begin("t")
    plan.host_unreachable("h0", "h0: connection refused")
    with pytest.raises(NoUsableHostError) as refused:
        plan.probe_failed("h1", "h1: probe failed: no answer in 30 s")
    assert not isinstance(refused.value, TransportError)
    assert refused.value.exit_code == 255  # as before: a batch that reached no host exits like ssh
    assert str(refused.value) == "no usable host (h0: h0: connection refused; h1: h1: probe failed: no answer in 30 s)"


# -- replayed random starts ----------------------------------------------------------------------


class Seen:
    """What a replayed history's actions said: jobs running, ends, BatchStarted."""

    def __init__(self, plan: Planner) -> None:
        self.plan = plan
        self.said = Said(plan)
        self.running: set[str] = set()
        self.ends: Counter[str] = Counter()
        self.opened = 0

    def take(self, actions: list[Action]) -> None:
        self.said.check(actions)
        for action in actions:
            if isinstance(action, StartJob):
                assert action.job.name not in self.running
                assert self.plan.hosts[action.placement.machine].usable
                self.running.add(action.job.name)
            elif isinstance(action, Say) and isinstance(action.event, BatchStarted):
                self.opened += 1
            elif isinstance(action, Say) and isinstance(action.event, JobFinished | JobFailed | JobCancelled):
                self.ends[action.event.job] += 1


def test_random_starts_open_once_and_every_job_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts answer in any order (a probe landing with what an earlier run left there, an
    unreachable host, a failed probe), around begin() and the slow hosts called overdue; jobs
    wait for others, some need a big host, some an earlier run left on a host.  Then the jobs run
    while hosts fail and come back.  Each batch is refused before anything starts (no usable
    host, a job nothing could ever fit) or opens exactly once; no job starts twice or runs on a
    host that is down; every job moves only as the phase table allows and ends exactly once, and
    the batch finishes with every job ended or not run."""
    moves = record_moves(monkeypatch)
    opened = refused = 0
    for seed in range(200):
        rng = random.Random(seed)
        names = [name for name, _ in hosts(rng.randint(1, 4))]
        cpus = {h: rng.choice([1, 2, 8]) for h in names}
        gpus = {h: rng.choice([0, 0, 1, 2]) for h in names}
        jobs = [
            Job(
                f"j{i}", "true", i + 1,
                needs=NeedsOverride(cpus=4) if rng.random() < 0.1 else NeedsOverride(),
                after=(f"j{i - 1}",) if i and rng.random() < 0.2 else (),
            )
            for i in range(12)
        ]  # fmt: skip
        left = {job.name: Resumable(job.name, rng.choice(names), ()) for job in jobs if rng.random() < 0.2}
        base = CPU if rng.random() < 0.5 else Needs(cpus=1, memory_mb=100)  # or one GPU by default
        plan = Planner(jobs, hosts(len(names)), PlanOptions(base, retries=rng.choice([0, 1])), resumable=left)
        seen = Seen(plan)
        take, running, ends = seen.take, seen.running, seen.ends

        script: list[str] = ["begin", "overdue", *names]
        rng.shuffle(script)
        try:
            for step in script:
                if step == "begin":
                    take(plan.begin("t") + plan.kick())
                elif step == "overdue":
                    take(plan.probes_overdue())
                elif (roll := rng.random()) < 0.7:
                    found = {name: True for name, entry in left.items() if entry.host == step and rng.random() < 0.7}
                    state_ = state(cpus[step], gpus[step])
                    take(plan.probe_landed(step, state_, now=0.0, agent_jobs={**found, "stranger": False}))
                elif roll < 0.85:
                    take(plan.host_unreachable(step, f"{step}: connection refused"))
                else:
                    take(plan.probe_failed(step, f"{step}: probe failed"))
        except (NoUsableHostError, UnsatisfiableError):
            assert not running and seen.opened == 0  # refused before anything ran
            refused += 1
            continue
        assert plan.began and seen.opened == 1  # every host answered after begin: it opened, once
        opened += 1
        for _step in range(500):
            if plan.done and not running:
                break
            roll = rng.random()
            reviving = [h for h in names if plan.hosts[h].reviving]
            if running and roll < 0.8:
                name = rng.choice(sorted(running))
                running.discard(name)
                plan.job_started(name, 0.0)
                ended = Ended(0 if rng.random() < 0.85 else 1)
                actions = plan.job_exited(name, ended)
                if Commit(name) in actions:
                    actions += plan.job_committed(name, ended)
                take(actions)
            elif reviving and roll < 0.95:
                take(plan.host_back(rng.choice(reviving), state(8, 2)))
            else:
                up = [h for h in names if plan.hosts[h].usable]
                if up:
                    take(plan.probe_failed(rng.choice(up), "probe failed"))
        assert plan.done, seed
        assert +plan.state.tally == Counter(slot.phase for slot in plan.jobs.values())
        assert all(count == 1 for count in ends.values()), (seed, ends)
        assert set(ends) | set(plan.unfinished()) == set(plan.jobs), seed
        assert not (set(ends) & set(plan.unfinished())), seed
        if not plan.draining:  # nothing stopped it: what did not end was never to run
            assert all(plan.phase(name) is JobPhase.NOT_RUN for name in plan.unfinished()), seed
    assert opened > 100 and refused > 10, (opened, refused)
    assert (JobPhase.QUEUED, JobPhase.RUNNING) in moves and (JobPhase.BLOCKED, JobPhase.NOT_RUN) in moves
