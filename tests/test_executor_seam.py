"""The executor seam: the coordinator speaks to every backend through one RunRequest.

No ``isinstance`` on an executor class outside ``executors/`` (an ast scan of the package); a
backend written here, unknown to the coordinator, gets each job's needs, timeout, setup and
inputs through the request and says itself when the job started (with its own name for it),
and the per-job pipeline counts its own ``--timeout`` from that hook.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.batch import Batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.jobrun import JobRun, OutputFiles
from ssh_scheduler.events import Event, EventBus, JobFinished, JobStarted
from ssh_scheduler.executors import backends
from ssh_scheduler.executors.base import OutputSink, RunRequest, ShellCommand, shell_line
from ssh_scheduler.executors.host import AgentExecutor, open_executor
from ssh_scheduler.executors.job_events import JobExit
from ssh_scheduler.executors.stage_plan import StagePlan
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.forward import ForwardSet
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.machine import Machine, local_machine

PACKAGE = Path(__file__).resolve().parents[1] / "ssh_scheduler"
SCAN = Path(__file__).resolve().parent / "executor_scan.py"


def scan(package: Path) -> dict[str, list[object]]:
    found = subprocess.run([sys.executable, str(SCAN), str(package)], capture_output=True, text=True, check=True)
    result: dict[str, list[object]] = json.loads(found.stdout)
    return result


def test_nothing_outside_executors_tests_an_object_against_an_executor_class() -> None:
    result = scan(PACKAGE)
    # the scan knows the executors (it would find nothing if it knew none)
    assert {"Executor", "AgentExecutor", "SlurmExecutor"} <= set(map(str, result["classes"]))
    assert result["found"] == [], "choose by what the machine is in executors/, or ask the request: " + repr(
        result["found"]
    )


def test_the_scan_finds_a_planted_isinstance(tmp_path: Path) -> None:
    copy = tmp_path / "ssh_scheduler"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    planted = copy / "coordinator" / "planted.py"
    planted.write_text("from ssh_scheduler.executors import slurm\n\n\ndef f(x):\n    return isinstance(x, (int, slurm.SlurmExecutor))\n")
    assert scan(copy)["found"] == [["coordinator/planted.py", 5, "isinstance(x, (int, slurm.SlurmExecutor))"]]


class ByPid(AgentExecutor):
    """A backend the coordinator does not know: this machine through the real agent, which
    records every request and announces a job only once the agent says its process started,
    naming it by its pid."""

    def __init__(self, inner: AgentExecutor) -> None:
        super().__init__(inner.transport, inner.session)
        self.requests: list[RunRequest] = []
        self.pids: list[int] = []

    async def run(self, request: RunRequest, on_output: OutputSink) -> JobExit:
        self.requests.append(request)

        def started(pid: int) -> None:
            self.pids.append(pid)
            request.on_started(f"pid {pid}")

        return await self.session.run(
            request.name, shell_line(request), cwd=request.jobdir, env=request.env, out_path=None, err_path=None,
            on_output=on_output, on_started=started, stage=request.staged, results=None,
        )


def this_machine(tmp_path: Path) -> Machine:
    return dataclasses.replace(
        local_machine(), workdir=str(tmp_path / "work"), env=(("FROM_ENV", "env"),), setup=("export FROM_SETUP=setup",)
    )


async def test_a_backend_of_its_own_gets_needs_timeout_and_the_started_hook_through_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[ByPid] = []

    async def open_by_pid(machine: Machine, **options: object) -> ByPid:
        executor = ByPid(await open_executor(machine, **options))  # type: ignore[arg-type]
        opened.append(executor)
        return executor

    # executors.backends is where a new backend goes; the coordinator is left as it is
    monkeypatch.setattr(backends, "open_executor", open_by_pid)
    src = tmp_path / "src"
    src.mkdir()
    (src / "in.txt").write_text("forwarded\n")
    needs = Needs(cpus=0.5, memory_mb=10, gpus=0, gpu_memory_mb=0)
    options = BatchOptions(
        needs=needs, gpus_explicit=True, results_dir=tmp_path / "results", base_dir=src, timeout=600.0,
        probe_interval=3600,
    )
    command = 'cat in.txt > out.txt; echo "$FROM_SETUP $FROM_ENV $SSH_SCHEDULER_JOB" >> out.txt'
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    summary = await Batch([Job("j", command, 1)], [this_machine(tmp_path)], options, bus=bus).run()

    assert summary.outcomes["j"].ok
    (executor,) = opened
    (request,) = executor.requests
    assert request.name == "j" and request.work == ShellCommand(command)
    assert request.needs == needs and request.timeout == 600.0 and request.gpus == ()
    assert request.setup == ("export FROM_SETUP=setup",) and request.env["FROM_ENV"] == "env"
    assert request.staged == StagePlan([("in.txt", request.staged.files[0][1])], [])  # type: ignore[union-attr]
    (started,) = [e for e in events if isinstance(e, JobStarted)]
    assert started.slurm_job == f"pid {executor.pids[0]}"  # the backend's own name for the run
    assert events.index(started) < next(i for i, e in enumerate(events) if isinstance(e, JobFinished))
    assert (tmp_path / "results" / "j" / "out.txt").read_text() == "forwarded\nsetup env j\n"


class Queued:
    """A backend whose jobs wait in a queue (here: ``queued`` seconds) before they run."""

    name = "queue"
    bytes_sent = 0

    def __init__(self, queued: float) -> None:
        self.queued = queued
        self.started = False

    async def stage(self, forward: ForwardSet) -> StagePlan:
        return StagePlan([], [])

    async def run(self, request: RunRequest, on_output: OutputSink) -> JobExit:
        await asyncio.sleep(self.queued)
        self.started = True
        request.on_started("queued-1")
        await asyncio.Event().wait()  # runs until killed
        raise AssertionError("not reached")

    async def remove(self, jobdir: str, job: str | None = None, *, wait: bool = True) -> None:
        pass


async def test_the_pipelines_timeout_counts_from_the_started_hook_not_from_the_queue(tmp_path: Path) -> None:
    queue = Queued(queued=0.3)
    announced: list[str] = []
    request = RunRequest(
        name="j", work=ShellCommand("true"), jobdir="/nowhere/j", timeout=0.05, on_started=announced.append
    )
    output = OutputFiles(tmp_path, "j")
    run = JobRun(queue, request, output, tmp_path)  # type: ignore[arg-type]
    ended = await run.run()
    # a timer started with the run would have cancelled it in the queue, before it ever ran
    assert queue.started and announced == ["queued-1"]
    assert ended.timed_out and ended.message == "timed out after 0.05 s"
