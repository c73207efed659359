"""Jobs added to an open batch, rule by rule (``PlanState.add``, ``BatchStart.jobs_added``) and
what the opening says and settles (``BatchStart._open``), with plain values.

What an added job waits for, what it is told when a job it names in ``after`` will not run,
what ``jobs_added`` says, and the needs and announcement of the opening.  (``test_plan_open.py``
has the open batch's life: added, placed, closed, done.)"""

from __future__ import annotations

from ssh_scheduler.events import BatchStarted, JobNotRun, JobReattached, JobsAdded
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.planner.actions import PlanOptions, Revive
from ssh_scheduler.planner.phases import JobPhase
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import Resumable
from tests.test_plan import events, host_state, starts
from tests.test_plan_open import OPTIONS, end, job, open_planner


def not_run(actions: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(e.job, e.reason) for e in events(actions, JobNotRun)]


# -- what an added job waits for -------------------------------------------------------------


def test_an_added_job_waits_for_every_job_it_names_not_just_the_first_to_end() -> None:
    """``after=(a, b)`` counts both, whether they joined earlier or in the same call: the job
    starts when the last of them finished, not when the first did."""
    plan, _ = open_planner(cpus=8)
    plan.jobs_added([job("a"), job("b")])
    plan.jobs_added([job("later", after=("a", "b")), job("c"), job("d"), job("together", after=("c", "d"))])
    assert plan.phase("later") is JobPhase.BLOCKED and plan.phase("together") is JobPhase.BLOCKED
    assert starts(end(plan, "a")) == [] and starts(end(plan, "c")) == []
    assert plan.phase("later") is JobPhase.BLOCKED and plan.phase("together") is JobPhase.BLOCKED
    assert [s.job.name for s in starts(end(plan, "b"))] == ["later"]
    assert [s.job.name for s in starts(end(plan, "d"))] == ["together"]


def test_an_after_the_batch_knows_nothing_of_is_not_waited_for() -> None:
    """A name neither in the batch nor among the jobs skipped for their results (a batch file's
    names are checked before it starts): nothing to wait for, the job runs."""
    plan, _ = open_planner()
    actions = plan.jobs_added([job("x", after=("elsewhere",))])
    assert [s.job.name for s in starts(actions)] == ["x"] and not_run(actions) == []


# -- what it is told when a job it names will not run -------------------------------------------


def test_an_added_job_after_one_that_ended_badly_is_told_how_that_one_ended() -> None:
    """Failed, was cancelled, or will not run itself (never fits, or one it waited for failed):
    each said word for word, and the first such name counts."""
    plan, _ = open_planner(cpus=2)
    plan.jobs_added([job("bad"), job("cancelled"), job("huge", needs=NeedsOverride(cpus=64))])
    end(plan, "bad", code=1)
    plan.cancel("cancelled")  # it runs: killed, then cancelled
    plan.job_cancelled("cancelled")
    plan.jobs_added([job("chained", after=("bad",))])
    assert plan.phase("huge") is JobPhase.NOT_RUN and plan.phase("chained") is JobPhase.NOT_RUN
    actions = plan.jobs_added(
        [
            job("after_bad", after=("bad",)),
            job("after_cancelled", after=("cancelled",)),
            job("after_huge", after=("huge",)),
            job("after_chained", after=("chained",)),
            job("after_two", after=("huge", "bad")),
        ]
    )
    assert not_run(actions) == [
        ("after_bad", "bad failed"),
        ("after_cancelled", "cancelled was cancelled"),
        ("after_huge", "huge will not run"),
        ("after_chained", "chained will not run"),
        ("after_two", "huge will not run"),
    ]
    assert starts(actions) == []


def test_a_job_waiting_in_the_same_call_for_one_not_run_is_told_with_it() -> None:
    """``v`` is not run (the job it names failed); ``w``, added with it, waits for ``v``: it
    will not run either, and is told why, after ``v``."""
    plan, _ = open_planner(cpus=2)
    plan.jobs_added([job("bad")])
    end(plan, "bad", code=1)
    actions = plan.jobs_added([job("w", after=("v",)), job("v", after=("bad",)), job("free")])
    assert not_run(actions) == [("v", "bad failed"), ("w", "v will not run")]
    assert plan.phase("w") is JobPhase.NOT_RUN and [s.job.name for s in starts(actions)] == ["free"]


def test_jobs_waiting_in_the_same_call_for_one_not_run_are_told_once_each() -> None:
    """``x`` is not run; ``y`` joined after it and waits for ``x``, ``z`` for ``y``: each is
    said not to run once, with the job at the root of it (``y`` was said again, with an empty
    reason, when the call came to it)."""
    plan, _ = open_planner(cpus=2)
    plan.jobs_added([job("bad")])
    end(plan, "bad", code=1)
    actions = plan.jobs_added([job("x", after=("bad",)), job("y", after=("x",)), job("z", after=("y",))])
    assert not_run(actions) == [("x", "bad failed"), ("y", "x will not run"), ("z", "x will not run")]
    assert {plan.phase(name) for name in "xyz"} == {JobPhase.NOT_RUN}


def test_a_job_added_after_the_opening_that_waits_for_one_failed_in_an_earlier_run_says_so() -> None:
    """As the first jobs are told at the opening: the job it names, and how to rerun it.  One
    that waits for a job that succeeded in an earlier run runs."""
    plan = Planner([], [("h0", "h0")], OPTIONS, already_done={"ok": True, "bad": False}, open=True)
    plan.probe_landed("h0", host_state(4))
    plan.begin("token")
    actions = plan.jobs_added([job("after_bad", after=("bad",)), job("after_ok", after=("ok",))])
    assert not_run(actions) == [("after_bad", "bad failed in an earlier run (--retry-failed reruns it)")]
    assert [s.job.name for s in starts(actions)] == ["after_ok"]
    # ... the same words as a first job's, at the opening
    first = Planner([job("first", after=("bad",))], [("h0", "h0")], OPTIONS, already_done={"bad": False})
    first.probe_landed("h0", host_state(4))
    assert not_run(first.begin("token")) == [("first", not_run(actions)[0][1])]


def test_a_job_added_before_the_opening_after_one_that_will_not_run_is_told_at_the_opening() -> None:
    """Added while the hosts still connect, it waits for a first job that will not run (its own
    ``after`` failed in an earlier run): it is told so when the batch opens, after that job,
    as is one added with it that waits for it, and one of every call before the opening."""
    plan = Planner([job("first", after=("bad",))], [("h0", "h0")], OPTIONS, already_done={"bad": False}, open=True)
    assert plan.jobs_added([job("early", after=("first",)), job("earlier", after=("early",))]) == []
    assert plan.jobs_added([job("second", after=("first",))]) == []
    plan.probe_landed("h0", host_state(4))
    assert not_run(plan.begin("token")) == [
        ("first", "bad failed in an earlier run (--retry-failed reruns it)"),
        ("early", "first will not run"),
        ("earlier", "early will not run"),
        ("second", "first will not run"),
    ]
    assert {plan.phase(name) for name in ("first", "early", "earlier", "second")} == {JobPhase.NOT_RUN}


def test_an_added_job_no_host_could_ever_fit_is_told_why_word_for_word() -> None:
    """The need no host meets, the largest host, the fix; never "(and every job of this
    batch)": the others run."""
    plan, _ = open_planner(cpus=2)
    actions = plan.jobs_added([job("huge", needs=NeedsOverride(cpus=64)), job("fine")])
    assert not_run(actions) == [
        (
            "huge",
            "job huge can never run: needs 64 cpus; the largest host h0 has 2 cpus (2.5 with overload 1.25); "
            "lower the job's needs or add a bigger machine",
        )
    ]


# -- what jobs_added says -------------------------------------------------------------------------


def test_jobs_added_says_how_many_joined_before_what_became_of_them() -> None:
    """JobsAdded first (the call's count, the batch's total), then each job's fate in order: a
    refusal, a job an earlier run left running taken up, the placements."""
    left = {"again": Resumable("again", "h0", ())}
    plan = Planner([], [("h0", "h0")], OPTIONS, resumable=left, open=True)
    plan.probe_landed("h0", host_state(4), agent_jobs={"again": True})
    plan.begin("token")
    plan.jobs_added([job("bad")])
    end(plan, "bad", code=1)
    actions = plan.jobs_added([job("refused", after=("bad",)), job("again"), job("new")])
    said = [type(a.event) for a in actions if hasattr(a, "event")]
    assert said[:3] == [JobsAdded, JobNotRun, JobReattached]
    assert [(e.jobs, e.total) for e in events(actions, JobsAdded)] == [(3, 4)]
    assert [(s.job.name, s.resume) for s in starts(actions)] == [("again", True), ("new", False)]


# -- the opening ----------------------------------------------------------------------------------


def test_jobs_without_needs_of_their_own_share_the_batchs_needs() -> None:
    """The very object, first jobs and added ones alike: the dry run narrows its search by it
    (``needs is full_for``), and the queue serves them as one kind.  A job with needs of its
    own gets them on top of the batch's."""
    plan = Planner([job("first")], [("h0", "h0")], OPTIONS, open=True)
    plan.probe_landed("h0", host_state(4))
    plan.begin("token")
    plan.jobs_added([job("later"), job("own", needs=NeedsOverride(cpus=2))])
    assert plan.jobs["first"].needs is OPTIONS.needs and plan.jobs["later"].needs is OPTIONS.needs
    assert plan.jobs["own"].needs == Needs(2, 100, 0, 0, 0.0, False, False)


def test_the_opening_announces_the_token_and_what_the_usable_hosts_offer() -> None:
    """BatchStarted carries the token the batch began with (as given, even empty), and per
    usable host how many jobs fit at once and its GPUs; a host lost after its probe landed (and
    revived in the background) is named among the batch's hosts but offers nothing."""
    options = PlanOptions(Needs(cpus=1, memory_mb=100, gpus=1, gpu_memory_mb=1000))
    plan = Planner([job("a")], [("h0", "h0.yaml"), ("h1", "h1.yaml")], options)
    plan.probe_landed("h0", host_state(4, gpus=2))
    plan.probe_landed("h1", host_state(4, gpus=3))
    assert Revive("h1") in plan.host_lost("h1", "connection lost")
    actions = plan.begin("tok-1")
    (started,) = events(actions, BatchStarted)
    assert (started.token, started.jobs, started.hosts) == ("tok-1", 1, ("h0", "h1"))
    assert (started.limits, started.gpu_choices) == ((("h0.yaml", 2),), ((0, 1),))
    empty = Planner([job("a")], [("h0", "h0")], OPTIONS)
    empty.probe_landed("h0", host_state(4))
    assert events(empty.begin(""), BatchStarted)[0].token == ""
