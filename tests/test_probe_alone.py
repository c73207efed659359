"""A probe runs alone -- one GPU process list, beside the memory read -- only while no job of ours
runs on the host, from its start to its end (machines/probe.py ``ALONE``; the agent's
``op_probe``).  Only then does every process it lists count as someone else's, which is what
makes one unordered list as safe as the two around the read.  Against the shipped agent over
pipes: the probe's script says which way it ran (its first argument), and a job started while
an alone probe runs has the probe taken again the usual way, its reply naming the job.  On the
coordinator's side, one list beside a job of ours is not believed for the GPUs.  On the SSH test
cluster, a dry run's probe runs alone (and a batch's first probe: test_gpu_freed_midprobe_cluster)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.agent.hostguard import JOBS_DIR
from ssh_scheduler.executors.host import AgentExecutor
from ssh_scheduler.machines.probe import ALONE
from tests.cluster import Cluster, GpuSpec, HostSpec
from tests.live_batch import machines, run_batch
from tests.probe_counter import alone_probes, count_probes, ordered_pairs, probes
from tests.test_agent_adopt import Agent
from tests.test_probe import UUID, capture, probe_text

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
    """The alone run waits at a FIFO for the job to have started (the job writes it); the reply
    is then the second run's, without the argument, and names the job."""
    root = tmp_path / "root"
    started = tmp_path / "job-started"
    os.mkfifo(started)
    waits = f'if [ "$1" = {ALONE} ]; then read -r _ < {started}; fi'
    assert agent.proc.stdin is not None and agent.proc.stdout is not None
    agent.proc.stdin.write(P.Probe(id=2, cmd=f"{SAYS_HOW}; {waits}", alone=ALONE).encode())
    run_job(agent, 3, "j", f"echo started > {started}; exec sleep 30", root)
    reply = W.decode_answer(agent.proc.stdout.readline())
    assert isinstance(reply, P.ProbeReply), reply
    assert reply.out == "ran []\n", reply  # without the second run: "ran [alone]"
    assert list(reply.own) == ["j"] and reply.own["j"].pids
    kill_job(agent, 4, "j")


@pytest.mark.parametrize("own", [{}, {"j": {"pids": [77], "rss_mb": 10}}])
async def test_a_host_whose_agent_names_a_job_of_ours_beside_one_list_gets_no_gpus(own: dict[str, dict[str, object]]) -> None:
    """The coordinator's side of the rule: the agent's reply naming a running job of ours
    (its own usage) with output of one process list is not believed for the GPUs."""
    alone = probe_text(gpus=capture("nvsmi_csv_nounits_busy.txt"), apps=(f"618, 21482, {UUID}", 0), one_list=True)

    class Session:
        async def probe(self, command: str) -> tuple[str, int, dict[str, dict[str, object]]]:
            return alone, 0, own

    transport = SimpleNamespace(machine=SimpleNamespace(name="h"))
    executor = AgentExecutor(transport, Session())  # type: ignore[arg-type]
    state, usage = await executor.probe()
    if own:
        assert state.gpus == () and state.gpu_error is not None, state
        assert list(usage) == ["j"]
    else:
        assert [gpu.uuid for gpu in state.gpus] == [UUID] and state.gpu_error is None


def test_a_dry_runs_look_at_a_gpu_host_runs_alone(make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    """On the SSH test cluster, through the host's login shell: the dry run starts nothing, so
    its one probe of the host lists the processes once (two nvidia-smi calls, not three)."""
    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16000)])])
    host = cluster.hosts[0]
    count_probes(host)
    (tmp_path / "b.sh").write_text("true\n")
    result = run_batch(tmp_path, "b.sh", *machines(cluster), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert (probes(host), alone_probes(host), ordered_pairs(host)) == (1, 1, [])
