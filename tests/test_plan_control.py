"""The planner's control events (``ssh-scheduler pause`` / ``resume`` / ``cancel``), with plain
values: no sockets, no hosts."""

from __future__ import annotations

from ssh_scheduler.events import BatchPaused, BatchResumed, JobCancelled, JobNotRun, Notice
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.planner.actions import KillJob, StartJob
from ssh_scheduler.planner.phases import JobPhase
from tests.test_plan import events, finish, jobs, planner, starts


def test_pause_starts_nothing_until_resume() -> None:
    plan, actions = planner(jobs(6), hosts=1, cpus=2)  # two fit at once
    running = [s.job.name for s in starts(actions)]
    assert len(running) == 2
    paused = plan.pause()
    assert len(events(paused, BatchPaused)) == 1
    assert plan.pause() == []  # a second pause changes nothing
    ended = finish(plan, running[0])
    assert starts(ended) == []  # room, but paused
    assert not plan.done  # queued jobs wait for resume: the batch must not end
    resumed = plan.resume()
    assert len(events(resumed, BatchResumed)) == 1
    assert [s.job.name for s in starts(resumed)] == ["j2"]
    assert plan.resume() == []


def test_cancel_a_running_job_kills_it_and_the_batch_goes_on() -> None:
    plan, actions = planner(jobs(3), hosts=1, cpus=1)  # one at a time
    first = starts(actions)[0].job.name
    assert plan.cancel(first) == [KillJob(first, "cancel")]
    assert plan.cancel(first) == []  # already being killed
    after = plan.job_cancelled(first)
    assert [e.job for e in events(after, JobCancelled)] == [first]
    assert [s.job.name for s in starts(after)] == ["j1"]  # its room goes to the next job
    assert plan.phase(first) is JobPhase.CANCELLED


def test_cancel_a_waiting_job_drops_it_and_its_dependents() -> None:
    batch = [
        Job("a", "echo a", 1),
        Job("b", "echo b", 2),
        Job("c", "echo c", 3, after=("b",)),
        Job("d", "echo d", 4, after=("c",)),
    ]
    plan, actions = planner(batch, hosts=1, cpus=1)
    assert [s.job.name for s in starts(actions)] == ["a"]
    dropped = plan.cancel("b")
    assert [e.job for e in events(dropped, JobCancelled)] == ["b"]
    assert sorted(e.job for e in events(dropped, JobNotRun)) == ["c", "d"]
    assert all("b was cancelled" in e.reason or "c was cancelled" in e.reason for e in events(dropped, JobNotRun))
    assert starts(finish(plan, "a")) == []  # nothing left to start
    assert plan.done


def test_cancel_an_ended_or_unknown_job_only_warns() -> None:
    plan, actions = planner(jobs(1), hosts=1)
    finish(plan, starts(actions)[0].job.name)
    for name, says in (("j0", "already finished"), ("nope", "not part of this batch")):
        said = plan.cancel(name)
        notices = events(said, Notice)
        assert len(said) == 1 and notices[0].level == "warning" and says in notices[0].message


def test_stop_while_paused_ends_the_batch() -> None:
    plan, actions = planner(jobs(4), hosts=1, cpus=1)
    plan.pause()
    finish(plan, starts(actions)[0].job.name)
    assert not plan.done
    plan.stop()
    assert plan.done
    assert isinstance(actions[-1], StartJob)
