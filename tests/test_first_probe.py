"""The first probe rides on the agent's hello: no round trip of its own before the first job.

The agent starts the probe a ``hello`` carries and answers it under the probe's own id, as if
it had been a ``probe`` request; an older agent ignores the field and the coordinator falls
back to a ``probe`` request.  Against the shipped agent (over stdin) and through ``run_batch``
against the in-process hostile server, which logs every request it gets.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.coordinator.batch import run_batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.executors.host import open_executor
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.machine import local_machine
from ssh_scheduler.transport.bootstrap import agent_start
from tests.hostile_server import HostileServer, hostile_server


def agent_answers(tmp_path: Path, requests: list[W.Request], count: int) -> tuple[list[W.Message], bytes]:
    """``count`` answers of the shipped agent to these requests, and what it said after them."""
    start = agent_start(sys.executable, str(tmp_path / "root"))
    with subprocess.Popen(["/bin/sh", "-c", start.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(start.payload + b"".join(r.encode() for r in requests))
        proc.stdin.flush()
        answers = [W.decode_answer(proc.stdout.readline()) for _ in range(count)]
        proc.stdin.write(P.Bye().encode())
        proc.stdin.close()
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    return answers, rest


def test_the_agent_answers_the_probe_its_hello_carries_under_the_probes_id(tmp_path: Path) -> None:
    hello = P.Hello(id=1, lease=60, probe=P.Probe(id=2, cmd="echo probed; exit 3"))
    answers, rest = agent_answers(tmp_path, [hello], 2)
    by_id = {a.id: a for a in answers}
    assert isinstance(by_id[1], P.HelloReply) and by_id[1].probing is True
    probe = by_id[2]
    assert isinstance(probe, P.ProbeReply) and (probe.out, probe.rc) == ("probed\n", 3)
    assert rest == b""


def test_a_hello_without_a_probe_is_answered_alone(tmp_path: Path) -> None:
    answers, rest = agent_answers(tmp_path, [P.Hello(id=1, lease=60)], 1)
    (hello,) = answers
    assert isinstance(hello, P.HelloReply) and hello.probing is False
    assert rest == b""  # no probe answer follows


@pytest.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[HostileServer]:
    async with hostile_server(tmp_path) as server:
        yield server


async def one_job(hostile: HostileServer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    summary = await run_batch(
        [Job("j", "echo hi", 1)],
        [hostile.machine()],
        BatchOptions(
            needs=Needs(cpus=0.01, memory_mb=1, gpus=0, gpu_memory_mb=0),
            gpus_explicit=True,
            results_dir=tmp_path / "results",
            base_dir=src,
            probe_interval=3600,
        ),
        out=lambda _: None,
        err=lambda _: None,
    )
    assert summary.outcomes["j"].ok


async def test_the_first_job_is_placed_without_a_probe_request(hostile: HostileServer, tmp_path: Path) -> None:
    hostile.folds_probe = True
    await one_job(hostile, tmp_path)
    tags = [r.TAG for r in hostile.requests]
    assert tags[0] == "hello" and "run" in tags and "probe" not in tags
    hello = hostile.requests[0]
    assert isinstance(hello, P.Hello) and hello.probe is not None and "nproc" in hello.probe.cmd


async def test_an_agent_that_ignores_the_folded_probe_gets_a_probe_request(
    hostile: HostileServer, tmp_path: Path
) -> None:
    await one_job(hostile, tmp_path)  # folds_probe False: an agent from before the field
    tags = [r.TAG for r in hostile.requests]
    assert tags[:2] == ["hello", "probe"] and "run" in tags
    assert tags.count("probe") == 1


async def test_a_session_that_does_not_probe_first_sends_no_probe(hostile: HostileServer) -> None:
    hostile.folds_probe = True
    executor = await open_executor(hostile.machine())
    try:
        hello = hostile.requests[0]
        assert isinstance(hello, P.Hello) and hello.probe is None
        state, _ = await executor.probe()  # a later probe is a request of its own
        assert state.cpu_count > 0
        assert [r.TAG for r in hostile.requests] == ["hello", "probe"]
    finally:
        await executor.close()


async def test_the_agents_probe_runs_in_bin_sh_not_a_shell_found_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent starts a probe with /bin/sh itself, so it gets the probe script as it is: the
    login-shell wrapper (``sh -c '...'``) would start a second shell, whichever ``sh`` comes
    first on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "path-sh-ran"
    (bin_dir / "sh").write_text(f"#!/bin/sh\ntouch {marker}\nexec /bin/sh \"$@\"\n")
    (bin_dir / "sh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    machine = dataclasses.replace(local_machine(), name="here", workdir=str(tmp_path / "work"))
    executor = await open_executor(machine, probe_first=True)
    try:
        state, _own = await executor.probe()
    finally:
        await executor.close()
    assert state.cpu_count >= 1 and state.mem_total_mb > 0
    assert not marker.exists()
