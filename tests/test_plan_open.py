"""An open batch in the planner, with plain values: jobs added while it runs (the ``jobs_added``
event), and a batch that is done only once its owner closed it (``ssh_scheduler.Executor``)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ssh_scheduler.errors import BatchError, UnsatisfiableError
from ssh_scheduler.events import (
    BatchStarted,
    Ended,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobReattached,
    JobsAdded,
)
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.planner.actions import Action, Cleanup, Commit, KillJob, PlanOptions
from ssh_scheduler.planner.phases import FINAL_PHASES, JobPhase
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import Resumable
from tests.test_plan import CPU, events, host_state, record_moves, starts

OPTIONS = PlanOptions(CPU)


def job(name: str, **kwargs: object) -> Job:
    return Job(name, f"echo {name}", 0, **kwargs)  # type: ignore[arg-type]


def open_planner(first: list[Job] | None = None, hosts: int = 1, cpus: int = 2, gpus: int = 0) -> tuple[Planner, list[Action]]:
    plan = Planner(first or [], [(f"h{i}", f"h{i}") for i in range(hosts)], OPTIONS, open=True)
    for i in range(hosts):
        plan.probe_landed(f"h{i}", host_state(cpus, gpus))
    return plan, plan.begin("token") + plan.kick()


def end(plan: Planner, name: str, code: int = 0) -> list[Action]:
    plan.job_started(name, 0.0)
    actions = plan.job_exited(name, Ended(code))
    if any(isinstance(a, Commit) for a in actions):
        actions += plan.job_committed(name, Ended(code), now=1.0)
    return actions


def test_an_open_batch_with_no_jobs_opens_and_is_done_only_once_closed() -> None:
    plan, actions = open_planner()
    (started,) = events(actions, BatchStarted)
    assert started.jobs == 0 and plan.began
    assert not plan.done  # an empty batch file would be over; an open batch waits for jobs
    assert plan.close() == [] and plan.done


def test_jobs_added_while_it_runs_are_announced_and_placed_where_room_is() -> None:
    plan, _ = open_planner(cpus=2)  # 2 cpus x 1.25 overload: 2 jobs at once
    actions = plan.jobs_added([job("a"), job("b"), job("c")])
    (added,) = events(actions, JobsAdded)
    assert (added.jobs, added.total) == (3, 3)
    assert [s.job.name for s in starts(actions)] == ["a", "b"]
    assert plan.phase("c") is JobPhase.QUEUED
    more = end(plan, "a")
    assert [s.job.name for s in starts(more)] == ["c"]  # the queue, in order
    later = plan.jobs_added([job("d")])
    assert events(later, JobsAdded)[0].total == 4 and starts(later) == []  # no room: it waits
    for name in ("b", "c", "d"):
        end(plan, name)
    assert not plan.done  # everything ended, but more may come
    plan.close()
    assert plan.done and plan.unfinished() == []


def test_closing_with_jobs_still_running_ends_the_batch_when_they_end() -> None:
    plan, _ = open_planner()
    plan.jobs_added([job("a")])
    plan.close()
    assert not plan.done
    end(plan, "a")
    assert plan.done


def test_jobs_added_before_the_batch_opens_wait_for_it_and_count_in_its_start() -> None:
    plan = Planner([job("first")], [("h0", "h0")], OPTIONS, open=True)
    assert plan.jobs_added([job("early")]) == []  # nothing is placed before the batch opens
    plan.probe_landed("h0", host_state(4))
    actions = plan.begin("token") + plan.kick()
    assert events(actions, BatchStarted)[0].jobs == 2 and events(actions, JobsAdded) == []
    assert sorted(s.job.name for s in starts(actions)) == ["early", "first"]


def test_a_name_already_in_the_batch_is_refused_and_nothing_is_added() -> None:
    plan, _ = open_planner()
    plan.jobs_added([job("a")])
    with pytest.raises(BatchError, match="job a is already in this batch"):
        plan.jobs_added([job("new"), job("a")])
    with pytest.raises(BatchError, match="job twice is already in this batch"):
        plan.jobs_added([job("twice"), job("twice")])
    assert set(plan.jobs) == {"a"}


def test_a_job_no_host_could_ever_fit_is_not_run_and_the_open_batch_goes_on() -> None:
    plan, _ = open_planner(cpus=2)
    huge = job("huge", needs=NeedsOverride(cpus=64))
    actions = plan.jobs_added([huge, job("fine")])
    (not_run,) = events(actions, JobNotRun)
    assert not_run.job == "huge" and "can never run" in not_run.reason
    assert plan.phase("huge") is JobPhase.NOT_RUN
    assert [s.job.name for s in starts(actions)] == ["fine"]
    # ... where a batch file with that job is refused before anything runs
    closed = Planner([huge, job("fine")], [("h0", "h0")], OPTIONS)
    closed.probe_landed("h0", host_state(2))
    with pytest.raises(UnsatisfiableError, match=r"job huge .*can never run"):
        closed.begin("token")


def test_a_job_that_fits_only_a_host_not_answered_yet_waits_for_it() -> None:
    plan = Planner([], [("small", "small"), ("big", "big")], OPTIONS, open=True)
    plan.probe_landed("small", host_state(2))
    plan.begin("token")
    plan.probes_overdue()  # open with the host that answered
    actions = plan.jobs_added([job("wide", needs=NeedsOverride(cpus=8))])
    assert events(actions, JobNotRun) == [] and starts(actions) == []
    placed = plan.probe_landed("big", host_state(16))
    assert [(s.job.name, s.placement.machine) for s in starts(placed)] == [("wide", "big")]


def test_added_jobs_wait_for_the_jobs_they_name_in_after() -> None:
    plan, _ = open_planner(cpus=4)
    plan.jobs_added([job("a"), job("bad")])
    end(plan, "a")
    end(plan, "bad", code=1)
    plan.jobs_added([job("running")])
    actions = plan.jobs_added(
        [job("after_done", after=("a",)), job("after_failed", after=("bad",)), job("after_running", after=("running",))]
    )
    assert [s.job.name for s in starts(actions)] == ["after_done"]
    (not_run,) = events(actions, JobNotRun)
    assert (not_run.job, not_run.reason) == ("after_failed", "bad failed")
    assert plan.phase("after_running") is JobPhase.BLOCKED
    assert [s.job.name for s in starts(end(plan, "running"))] == ["after_running"]


def test_an_added_job_takes_the_batchs_needs_as_settled_at_the_opening() -> None:
    """The default GPU becomes "no GPU" on a fleet without GPUs; a job added later gets the
    same settled needs, not the raw default it could never get."""
    plan = Planner([], [("h0", "h0")], PlanOptions(Needs(cpus=1, memory_mb=100)), open=True)
    plan.probe_landed("h0", host_state(2, gpus=0))
    plan.begin("token")
    actions = plan.jobs_added([job("a")])
    assert [s.job.name for s in starts(actions)] == ["a"] and plan.jobs["a"].needs.gpus == 0


def test_a_job_an_earlier_run_left_running_is_taken_up_when_it_joins_and_ended_if_it_never_does() -> None:
    """A script killed while its calls ran, run again: the host's agent still runs them.  A call
    that joins again is taken up there (not run twice); one that never joins is ended at the
    close; what no journal names is ended at once."""
    left = {name: Resumable(name, "h0", ()) for name in ("again", "gone")}
    plan = Planner([], [("h0", "h0")], OPTIONS, resumable=left, open=True)
    plan.probe_landed("h0", host_state(4), agent_jobs={"again": True, "gone": False, "stranger": True})
    opened = plan.begin("token")
    assert [a for a in opened if isinstance(a, Cleanup)] == [Cleanup("h0", "stranger")]
    joined = plan.jobs_added([job("again"), job("new")])
    (taken,) = events(joined, JobReattached)
    assert (taken.job, taken.running) == ("again", True)
    assert [(s.job.name, s.resume) for s in starts(joined)] == [("again", True), ("new", False)]
    assert plan.close() == [Cleanup("h0", "gone")]


def test_stopping_an_open_batch_ends_it_once_nothing_runs() -> None:
    plan, _ = open_planner(cpus=1)  # one job at a time
    plan.jobs_added([job("a"), job("queued")])
    assert events(plan.cancel("queued"), JobCancelled)[0].job == "queued"
    plan.stop()  # drain: nothing new starts, even though the batch is open
    assert not plan.done
    assert starts(plan.jobs_added([job("late")])) == []
    end(plan, "a")
    assert plan.done and sorted(plan.unfinished()) == ["late"]


class History:
    """One random history of an open batch, checked after every step."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.plan, _ = open_planner(hosts=2, cpus=self.rng.choice([1, 2, 4]))
        self.added = 0
        self.ended: Counter[str] = Counter()
        self.closed = False

    def step(self, actions: list[Action]) -> None:
        plan = self.plan
        for kill in [a for a in actions if isinstance(a, KillJob)]:
            actions += plan.job_cancelled(kill.job)
        for kind in (JobFinished, JobFailed, JobCancelled, JobNotRun):
            self.ended.update(event.job for event in events(actions, kind))
        unfinished = any(slot.phase not in FINAL_PHASES for slot in plan.jobs.values())
        assert plan.done == (self.closed and not unfinished)

    def running(self) -> list[str]:
        return [name for name, slot in self.plan.jobs.items() if slot.phase is JobPhase.RUNNING]

    def play(self, steps: int) -> None:
        plan, rng = self.plan, self.rng
        for _ in range(steps):
            choice = rng.random()
            if not self.closed and choice < 0.3:
                burst = []
                for _ in range(rng.randint(1, 4)):
                    after = (f"j{rng.randrange(self.added)}",) if self.added and rng.random() < 0.2 else ()
                    burst.append(job(f"j{self.added}", after=after))
                    self.added += 1
                self.step(plan.jobs_added(burst))
            elif self.running() and choice < 0.85:
                self.step(end(plan, rng.choice(self.running()), code=rng.choice([0, 0, 0, 1])))
            elif plan.jobs and choice < 0.9:
                self.step(plan.cancel(rng.choice(list(plan.jobs))))
            elif not self.closed and choice > 0.97:
                self.closed = True
                self.step(plan.close())
        if not self.closed:
            self.closed = True
            self.step(plan.close())
        while self.running():
            self.step(end(plan, self.running()[0]))


def test_random_adds_ends_and_a_close_end_every_job_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replayed random histories: jobs added in bursts at random moments (some waiting for
    earlier ones), ending in any order, some failing, some cancelled, the batch closed at a
    random moment: the batch is done exactly when it is closed and every job ended, and every
    job ends exactly once, only through the transition table."""
    moves = record_moves(monkeypatch)
    for seed in range(40):
        history = History(seed)
        history.play(200)
        plan, ended = history.plan, history.ended
        assert plan.done and set(ended) == set(plan.jobs) and set(ended.values()) <= {1}, seed
    assert moves[JobPhase.QUEUED, JobPhase.RUNNING] and moves[JobPhase.BLOCKED, JobPhase.QUEUED]
