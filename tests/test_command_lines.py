"""No argument we put on a remote command line can pass 64 KiB, however many jobs (issue: the agent
travelled as one 32 KB argument, the Slurm status query grew with the jobs followed, on a road
that ends at Linux's 128 KiB for one argument).

Measured where remote commands are issued (tests/command_lines.py): transports' exec and agent
starts, the shell commands the agent runs for us; and, for what the agent itself runs on a
Slurm login node (squeue, scontrol, sacct), by stand-ins that log the longest argument they got.
10,000 jobs followed on a Slurm machine through the real executor and agent (stand-ins for
Slurm); a batch on the suite's real Slurm for the whole road at a smaller count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.batch import run_batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.doctor import check_script
from ssh_scheduler.coordinator.fleet import killable
from ssh_scheduler.executors.slurm import open_slurm_executor
from ssh_scheduler.executors.slurm_jobs import batch_script, job_name, sbatch_argv
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.machines.machine import local_machine
from ssh_scheduler.machines.probe import PROBE_COMMAND
from ssh_scheduler.machines.slurm import SlurmSettings
from ssh_scheduler.transport.bootstrap import agent_start
from tests.command_lines import LIMIT, Issued, record_commands
from tests.conftest_slurm import SlurmSite
from tests.test_slurm_batch import slurm_machine

JOBS = 10_000
TOKEN = "tok"


@pytest.fixture
def issued(monkeypatch: pytest.MonkeyPatch) -> Issued:
    return record_commands(monkeypatch)


def slurm_stand_ins(tmp_path: Path) -> tuple[Path, Path, Path]:
    """squeue (lists queue.txt), scontrol (knows no job), sacct (every job it is asked of
    COMPLETED), sbatch (a fresh id each time) and scancel; each logs its name, how many
    arguments it got and the longest one's length.  The folder for the PATH, the log, the queue."""
    bin_dir, log, queue = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "queue.txt"
    bin_dir.mkdir()
    queue.write_text("")
    logged = (
        "max=0; for a in \"$@\"; do [ ${#a} -gt $max ] && max=${#a}; done\n"
        f'echo "$(basename "$0") $# $max" >> {shlex.quote(str(log))}\n'
    )
    counter = shlex.quote(str(tmp_path / "next_id"))
    tools = {
        "squeue": f"cat {shlex.quote(str(queue))}\n",
        "scontrol": "",
        "sacct": "echo \"$7\" | tr ',' '\\n' | sed 's/$/|COMPLETED|0:0/'\n",
        "sbatch": f"n=$(cat {counter} 2>/dev/null || echo 1000); echo $((n + 1)) > {counter}; echo $n\n",
        "scancel": "",
    }
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{logged}{body}")
        (bin_dir / name).chmod(0o755)
    return bin_dir, log, queue


def calls(log: Path) -> list[tuple[str, int, int]]:
    return [(name, int(count), int(longest)) for name, count, longest in (line.split() for line in log.read_text().splitlines())]


async def test_ten_thousand_jobs_on_a_slurm_machine_put_no_argument_past_64_kib(
    issued: Issued, tmp_path: Path
) -> None:
    bin_dir, log, queue = slurm_stand_ins(tmp_path)
    settings = SlurmSettings(command_prefix=f"PATH={shlex.quote(str(bin_dir))}:$PATH")
    machine = dataclasses.replace(local_machine(), workdir=str(tmp_path / "work"))
    executor = await open_slurm_executor(machine, settings=settings, token=TOKEN)
    try:
        jobs = [f"jobs.sh.{n}" for n in range(1, JOBS + 1)]
        folders = {job: executor.jobdir(TOKEN, job) for job in jobs}
        submitted = await asyncio.gather(*(
            executor._submitter.submit(
                job, folders[job],
                sbatch_argv(settings, name=job_name(TOKEN, job), jobdir=folders[job], needs=Needs(), timeout=None),
                batch_script("true", {"SSH_SCHEDULER_JOB": job}, gpus=0, jobdir=folders[job]),
            )
            for job in jobs
        ))  # fmt: skip
        ids = [s.slurm_id for s in submitted]
        assert all(ids), submitted[:3]
        # ended, without the wait status squeue tells (as an older squeue would): so scontrol
        # and sacct are asked of every one, their ids batched
        queue.write_text("".join(f"{i}|{job_name(TOKEN, j)}|COMPLETED|None|\n" for i, j in zip(ids, jobs, strict=True)))
        reply = await executor._query(ids, {job: (folders[job], 0, 0) for job in jobs})  # type: ignore[arg-type]
        assert len(reply.queue) == JOBS and len(reply.detail) == JOBS  # every one heard of
        queue.write_text("".join(f"{i}|{job_name(TOKEN, j)}|RUNNING|None|0\n" for i, j in zip(ids, jobs, strict=True)))
    finally:
        await executor.close()  # scancels every job of ours Slurm still runs

    assert issued.queries and max(len(q.follow) for q in issued.queries) == JOBS
    assert 0 < issued.longest() <= LIMIT, issued.longest()
    ran = calls(log)
    assert max(longest for _name, _count, longest in ran) <= LIMIT
    count = {name: sum(1 for n, _, _ in ran if n == name) for name in ("squeue", "scontrol", "sacct", "sbatch", "scancel")}
    # one squeue per query (opening, following, closing), one scontrol for every job that ended,
    # and what must carry ids batched: a handful of sacct and scancel, sbatch per array chunk
    assert (count["squeue"], count["scontrol"]) == (3, 1), count
    assert 1 < count["sacct"] < 20 and 1 < count["scancel"] < 20, count
    assert 1 < count["sbatch"] < JOBS // 20, count
    assert sum(n for name, n, _ in ran if name == "scancel") == JOBS  # each id once


def test_the_constant_command_lines_are_short() -> None:
    """What does not depend on the jobs at all: the agent's start (only its first stage travels
    as an argument), the probe, doctor's check, execute_to's watchdog around a short command."""
    start = agent_start("python3", "~/.ssh_scheduler", "t" * 64)
    for line in (start.command, PROBE_COMMAND, check_script("~/.ssh_scheduler", (), SlurmSettings()), killable("true")):
        assert len(line.encode()) <= 16 * 1024
    assert len(start.payload) > len(start.command)  # the agent itself comes on stdin


async def test_a_batch_on_the_real_slurm_puts_no_argument_past_64_kib(
    issued: Issued, slurm: SlurmSite, tmp_path: Path
) -> None:
    machine = load_machine(slurm_machine(slurm, tmp_path, max_queued=40))
    jobs = [Job(f"b.sh.{n}", f"echo {n}", n) for n in range(1, 41)]
    summary = await run_batch(
        jobs, [machine],
        BatchOptions(
            needs=Needs(cpus=0.01, memory_mb=1, gpus=0, gpu_memory_mb=0), gpus_explicit=True,
            results_dir=tmp_path / "results", base_dir=tmp_path,
        ),
        out=lambda _: None, err=lambda _: None,
    )  # fmt: skip
    assert all(outcome.ok for outcome in summary.outcomes.values()), summary.outcomes
    assert (tmp_path / "results" / "b.sh.40.out").read_text() == "40\n"
    assert issued.starts and issued.queries  # the agent started, Slurm was followed by request
    # nothing of the status query is on a command line: only squeue's version check names squeue
    assert [p for p in issued.probes if "squeue" in p and "squeue --version" not in p] == []
    assert 0 < issued.longest() <= LIMIT, issued.longest()
