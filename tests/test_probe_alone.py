"""A probe runs alone -- one GPU process list, beside the memory read -- only while no job of ours
runs on the host, from its start to its end (machines/probe.py ``ALONE``; the agent's
``op_probe``).  Only then does every process it lists count as someone else's, which is what
makes one unordered list as safe as the two around the read.  Against the shipped agent over
pipes: the probe's script says which way it ran (its first argument), and a job started while
an alone probe runs has the probe taken again the usual way, its reply naming the job.  On the
coordinator's side, one list beside a job of ours is not believed for the GPUs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.agent.hostguard import JOBS_DIR
from ssh_scheduler.executors.host import AgentExecutor
from ssh_scheduler.machines.probe import ALONE
from tests.test_agent_adopt import Agent

SAYS_HOW = 'echo "ran [$1]"'


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    started = Agent(tmp_path / "root")
    try:
        assert isinstance(started.ask(P.Hello(id=1, lease=60)), P.HelloReply)
        yield started
    finally:
        started.end()


def run_job(agent: Agent, request_id: int, job: str, command: str, root: Path) -> None:
    """Start a job; its ``started`` event read."""
    assert agent.proc.stdin is not None and agent.proc.stdout is not None
    cwd = f"{root}/{JOBS_DIR}/t-{job}"
    agent.proc.stdin.write(P.Run(id=request_id, job=job, cmd=command, cwd=cwd, stage=P.Staging()).encode())
    agent.proc.stdin.flush()
    started = json.loads(agent.proc.stdout.readline())
    assert started.get("ev") == "started" and started.get("job") == job, started


def kill_job(agent: Agent, request_id: int, job: str) -> None:
    ended = agent.ask(P.Kill(id=request_id, job=job, grace=0.1))
    assert isinstance(ended, P.Exit) and ended.job == job, ended


def test_a_probe_while_no_job_runs_is_given_the_alone_argument(agent: Agent) -> None:
    reply = agent.ask(P.Probe(id=2, cmd=SAYS_HOW, alone=ALONE))
    assert isinstance(reply, P.ProbeReply), reply
    assert (reply.out, reply.rc, reply.own) == (f"ran [{ALONE}]\n", 0, {})


def test_a_probe_that_asks_nothing_alone_never_runs_alone(agent: Agent) -> None:
    reply = agent.ask(P.Probe(id=2, cmd=SAYS_HOW))
    assert isinstance(reply, P.ProbeReply) and reply.out == "ran []\n", reply


def test_a_probe_while_a_job_runs_lists_around_the_read(agent: Agent, tmp_path: Path) -> None:
    run_job(agent, 2, "j", "sleep 30", tmp_path / "root")
    runs = tmp_path / "runs"
    reply = agent.ask(P.Probe(id=3, cmd=f'{SAYS_HOW}; echo "[$1]" >> {runs}', alone=ALONE))
    assert isinstance(reply, P.ProbeReply) and reply.out == "ran []\n", reply
    assert list(reply.own) == ["j"] and reply.own["j"].pids
    assert runs.read_text() == "[]\n"  # run once, the usual way: not alone first, then again
    kill_job(agent, 4, "j")
    # The job ended: the host is ours alone again.
    again = agent.ask(P.Probe(id=5, cmd=SAYS_HOW, alone=ALONE))
    assert isinstance(again, P.ProbeReply) and again.out == f"ran [{ALONE}]\n", again


def test_a_job_started_while_an_alone_probe_runs_has_it_taken_again(agent: Agent, tmp_path: Path) -> None:
    """The alone run waits (up to a minute, never timed) until the job has started; the reply
    is then the second run's, without the argument, and names the job."""
    root = tmp_path / "root"
    flag = tmp_path / "job-started"
    waits = f'if [ "$1" = {ALONE} ]; then i=0; while [ ! -e {flag} ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done; fi'
    assert agent.proc.stdin is not None and agent.proc.stdout is not None
    agent.proc.stdin.write(P.Probe(id=2, cmd=f"{SAYS_HOW}; {waits}", alone=ALONE).encode())
    run_job(agent, 3, "j", f"touch {flag}; exec sleep 30", root)
    reply = W.decode_answer(agent.proc.stdout.readline())
    assert isinstance(reply, P.ProbeReply), reply
    assert flag.exists()
    assert reply.out == "ran []\n", reply  # without the second run: "ran [alone]"
    assert list(reply.own) == ["j"] and reply.own["j"].pids
    kill_job(agent, 4, "j")


def alone_output() -> str:
    """What the probe prints run alone on a host with one GPU and one process on it."""
    uuid = "GPU-0"
    return "\n".join(
        [
            "@@ssh_scheduler:begin@@",
            "@@ssh_scheduler:nproc@@", "4", "@@ssh_scheduler:status nproc 0@@",
            "@@ssh_scheduler:loadavg@@", "0.00 0.00 0.00 1/1 1", "@@ssh_scheduler:status loadavg 0@@",
            "@@ssh_scheduler:meminfo@@", "MemTotal: 1024000 kB", "MemAvailable: 512000 kB",
            "@@ssh_scheduler:status meminfo 0@@",
            "@@ssh_scheduler:one_process_list@@", "@@ssh_scheduler:status one_process_list 0@@",
            "@@ssh_scheduler:gpus@@", f"0, {uuid}, N, 16000, 1000, 15000, 0", "@@ssh_scheduler:status gpus 0@@",
            "@@ssh_scheduler:gpu_processes@@", f"77, 1000, {uuid}", "@@ssh_scheduler:status gpu_processes 0@@",
            "@@ssh_scheduler:end@@",
        ]
    ) + "\n"


@pytest.mark.parametrize("own", [{}, {"j": {"pids": [77], "rss_mb": 10}}])
async def test_a_host_whose_agent_names_a_job_of_ours_beside_one_list_gets_no_gpus(own: dict[str, dict[str, object]]) -> None:
    """The coordinator's side of the rule: the agent's reply naming a running job of ours
    (its own usage) with output of one process list is not believed for the GPUs."""

    class Session:
        async def probe(self, command: str) -> tuple[str, int, dict[str, dict[str, object]]]:
            return alone_output(), 0, own

    transport = SimpleNamespace(machine=SimpleNamespace(name="h"))
    executor = AgentExecutor(transport, Session())  # type: ignore[arg-type]
    state, usage = await executor.probe()
    if own:
        assert state.gpus == () and state.gpu_error is not None, state
        assert list(usage) == ["j"]
    else:
        assert [gpu.uuid for gpu in state.gpus] == ["GPU-0"] and state.gpu_error is None
