"""A job's phases: the one transition table, the one function that moves a job, and that the
planner changes a job's phase nowhere else (plain values, no hosts)."""

from __future__ import annotations

import ast
import itertools
from collections import Counter
from pathlib import Path

import pytest

from ssh_scheduler.events import Ended
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.planner.phases import (
    FINAL_PHASES,
    TRANSITIONS,
    JobPhase,
    JobSlot,
    PlannerBug,
    move,
    require,
)
from tests.test_plan import finish, jobs, planner

PLANNER = Path(__file__).parent.parent / "ssh_scheduler" / "planner"
STARTS = {JobPhase.QUEUED, JobPhase.BLOCKED, JobPhase.NOT_RUN}  # where a job may begin


def test_the_table_names_every_phase_and_the_event_of_every_move() -> None:
    assert set(TRANSITIONS) == set(JobPhase)
    for moves in TRANSITIONS.values():
        assert all(event.strip() for event in moves.values())


@pytest.mark.parametrize("old,new", list(itertools.product(JobPhase, JobPhase)))
def test_every_move_the_table_does_not_list_is_refused(old: JobPhase, new: JobPhase) -> None:
    slot = JobSlot(Job("j", "true", 1), phase=old)
    if new in TRANSITIONS[old]:
        move(slot, new)
        assert slot.phase is new
        return
    with pytest.raises(PlannerBug, match=f"job j cannot go from {old.value} to {new.value}"):
        move(slot, new)
    assert slot.phase is old and not slot.tally  # refused before anything changed


def test_a_batchs_jobs_share_one_count_of_jobs_per_phase() -> None:
    tally: Counter[JobPhase] = Counter({JobPhase.QUEUED: 2})
    a, b = (JobSlot(Job(name, "true", 1), tally=tally) for name in "ab")
    move(a, JobPhase.RUNNING)
    move(a, JobPhase.COPYING)
    move(b, JobPhase.CANCELLED)
    assert +tally == Counter({JobPhase.COPYING: 1, JobPhase.CANCELLED: 1})


def _reachable(start: JobPhase) -> set[JobPhase]:
    seen = {start}
    frontier = [start]
    while frontier:
        for new in TRANSITIONS[frontier.pop()]:
            if new not in seen:
                seen.add(new)
                frontier.append(new)
    return seen


def test_a_job_ends_once_and_every_phase_leads_to_an_end() -> None:
    for phase in FINAL_PHASES:
        assert TRANSITIONS[phase] == {}  # no way out of an end, not even to itself
    assert set().union(*(_reachable(start) for start in STARTS)) == set(JobPhase)
    for phase in JobPhase:
        assert _reachable(phase) & FINAL_PHASES, phase


def test_an_event_in_a_phase_it_cannot_happen_in_is_a_bug_before_it_changes_anything() -> None:
    slot = JobSlot(Job("j", "true", 1))
    with pytest.raises(PlannerBug, match="job_exited for job j, which is queued"):
        require(slot, "job_exited", JobPhase.RUNNING)
    plan, _ = planner(jobs(2), hosts=1, cpus=1)  # j0 runs, j1 waits
    with pytest.raises(PlannerBug, match="job_exited for job j1, which is queued"):
        plan.job_exited("j1", Ended(0))
    with pytest.raises(PlannerBug, match="job_committed for job j0, which is running"):
        plan.job_committed("j0", Ended(0))
    assert plan.resources("h0") is not None and "j0" in plan.resources("h0").running  # type: ignore[union-attr]
    finish(plan, "j0")
    with pytest.raises(PlannerBug, match="job_exited for job j0, which is finished"):
        plan.job_exited("j0", Ended(0))


def _phase_assignments(tree: ast.AST) -> list[int]:
    """Lines that assign to some ``.phase`` (plain, augmented, annotated, or in a tuple)."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute) and target.attr == "phase":
                found.append(target.lineno)
    return found


def test_the_planner_changes_a_phase_only_through_move() -> None:
    everywhere = {path.name: _phase_assignments(ast.parse(path.read_text())) for path in PLANNER.glob("*.py")}
    phases = ast.parse((PLANNER / "phases.py").read_text())
    inside_move = next(n for n in ast.walk(phases) if isinstance(n, ast.FunctionDef) and n.name == "move")
    assert everywhere.pop("phases.py") == _phase_assignments(inside_move)  # move's one assignment
    assert {name: lines for name, lines in everywhere.items() if lines} == {}


def test_the_scan_finds_the_assignments_it_must_refuse() -> None:
    code = "s.phase = 1\na.x, (b.phase, c) = t\nslot.phase: int = 2\nother = s.phase\n"
    assert _phase_assignments(ast.parse(code)) == [1, 2, 3]
