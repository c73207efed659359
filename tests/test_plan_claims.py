"""A host's claim at reattachment (issue 23, item 8): what a host's agent says it still runs from
an earlier coordinator is taken up only where the journal says the job ran.  A hostile host that
claims another host's job (and answers first) gets its own claim ended, and takes nothing from
the host that really holds the job: that one is not killed and run again.  The cluster test
(tests/test_shared_host_paths.py) plays it with real agents; here it is the planner's rule."""

from __future__ import annotations

import pytest

from ssh_scheduler.events import JobReattached
from ssh_scheduler.planner.actions import Action, Cleanup, PlanOptions
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.planner.policy import Resumable
from tests.test_plan_start import CPU, batch, hosts, said, starts, state


@pytest.mark.parametrize("claim_before_the_batch_opens", [True, False])
def test_a_claim_by_another_host_takes_nothing_from_the_host_that_holds_the_job(
    claim_before_the_batch_opens: bool,
) -> None:
    plan = Planner(batch(2), hosts(2), PlanOptions(CPU), resumable={"j0": Resumable("j0", "h1", ())})
    actions: list[Action] = []
    if not claim_before_the_batch_opens:
        actions += plan.begin("t")
    actions += plan.probe_landed("h0", state(), now=0.0, agent_jobs={"j0": True})  # the claim, first
    if claim_before_the_batch_opens:
        actions += plan.begin("t") + plan.probes_overdue()
    back = plan.probe_landed("h1", state(), now=0.0, agent_jobs={"j0": True})
    assert Cleanup("h0", "j0") in actions + back  # the claimant's own "j0" is ended there
    assert Cleanup("h1", "j0") not in back  # the real one is not killed...
    assert [e.job for e in said(back, JobReattached)] == ["j0"]  # ...it is taken up where it runs
    assert [(s.job.name, s.resume, s.placement.machine) for s in starts(actions + back) if s.job.name == "j0"] == [
        ("j0", True, "h1")
    ]


def test_a_claim_on_a_job_of_no_host_is_ended_and_the_job_runs_once() -> None:
    plan = Planner(batch(1), hosts(2), PlanOptions(CPU))
    actions = plan.begin("t") + plan.probe_landed("h0", state(), now=0.0, agent_jobs={"j0": True})
    actions += plan.probe_landed("h1", state(), now=0.0)
    assert Cleanup("h0", "j0") in actions
    assert [(s.job.name, s.resume) for s in starts(actions)] == [("j0", False)]
