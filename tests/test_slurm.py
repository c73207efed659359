"""Slurm, the pure part (machines/slurm.py, executors/slurm_jobs.py): sbatch from a job's needs, the
slurm: section, and Slurm's own answers, captured from the test Slurm (tests/data/slurm/) -- squeue,
scontrol, sbatch refusals; and the status query as the shipped agent serves it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.agent.main import Agent
from ssh_scheduler.errors import ConfigError
from ssh_scheduler.executors.slurm_jobs import (
    batch_script,
    final_status,
    job_name,
    parse_scontrol,
    parse_squeue,
    parse_submitted,
    poll_reply,
    queue_status,
    sbatch_argv,
    status_of,
    status_query,
    submit_command,
)
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.slurm import SlurmSettings, parse_slurm_section
from ssh_scheduler.transport.bootstrap import agent_start

DATA = Path(__file__).parent / "data" / "slurm"


def data(name: str) -> str:
    return (DATA / name).read_text()


def scontrol_jobs(name: str) -> dict[str, dict[str, str]]:
    rows = [parse_scontrol(line) for line in data(name).splitlines() if line.startswith("JobId=")]
    return {
        row["JobName"] if row["JobName"] != "tokA-array" else f"array-{row['ArrayTaskId']}": row
        for row in rows
    }


def test_sbatch_asks_for_the_jobs_needs_and_carries_the_batch_token() -> None:
    settings = SlurmSettings(
        partition="gpu", account="lab", qos="high", sbatch_args=("--constraint=a100",)
    )
    argv = sbatch_argv(
        settings, name=job_name("tok1", "jobs.sh.3"), jobdir="/users/u/w/jobs/tok1-jobs.sh.3",
        needs=Needs(cpus=2.5, memory_mb=4000, gpus=2), timeout=90,
    )  # fmt: skip
    assert argv[:2] == ["sbatch", "--parsable"]
    for option in (
        "--job-name=sshs-tok1-jobs.sh.3", "--chdir=/users/u/w/jobs/tok1-jobs.sh.3",
        "--output=/users/u/w/jobs/tok1-jobs.sh.3.out", "--error=/users/u/w/jobs/tok1-jobs.sh.3.err",
        "--partition=gpu", "--account=lab", "--qos=high", "--gres=gpu:2", "--cpus-per-task=3",
        "--mem=4000M", "--time=2", "--constraint=a100",
    ):  # fmt: skip
        assert option in argv
    cpu_only = sbatch_argv(
        SlurmSettings(time_limit="1:00:00"),
        name="n",
        jobdir="/d",
        needs=Needs(gpus=0),
        timeout=None,
    )
    assert not any(a.startswith(("--gres", "--partition")) for a in cpu_only)
    assert "--time=1:00:00" in cpu_only
    # a job named run%j: Slurm would write its output to run<job id>.out; %% is a '%' to it
    named = sbatch_argv(SlurmSettings(), name="n", jobdir="/d/t-run%j", needs=Needs(), timeout=None)
    assert "--output=/d/t-run%%j.out" in named and "--error=/d/t-run%%j.err" in named
    assert "--chdir=/d/t-run%j" in named  # not a pattern there


def test_the_batch_script_leaves_cuda_visible_devices_to_slurm_for_gpu_jobs() -> None:
    env = {"SSH_SCHEDULER_JOB": "j 1", "CUDA_VISIBLE_DEVICES": "4,5", "X": "it's"}
    gpu = batch_script("echo $X", env, gpus=1, jobdir="/w/jobs/t-j 1")
    assert "CUDA_VISIBLE_DEVICES" not in gpu
    assert "export SSH_SCHEDULER_JOB='j 1'" in gpu and "bash --norc -c 'echo $X'" in gpu
    cpu = batch_script("true", {"CUDA_VISIBLE_DEVICES": ""}, gpus=0, jobdir="/w/jobs/t-j")
    assert "export CUDA_VISIBLE_DEVICES=''" in cpu  # a job without GPUs sees none
    # the submit line hands the script to sbatch on stdin, and it arrives intact
    line = submit_command(SlurmSettings(command_prefix="true"), ["cat"], gpu)
    assert (
        subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, check=True).stdout
        == gpu
    )


def test_what_sbatch_printed() -> None:
    assert parse_submitted("42\n") == "42"
    assert parse_submitted("43;cluster2\n") == "43"
    assert parse_submitted(data("sbatch_impossible.txt")) is None


def test_squeue_states_as_captured() -> None:
    # the agent's squeue (id|name|state|reason|wait status) after jobs that ended every way
    queue = parse_squeue(data("squeue_exit_codes.txt"))
    assert queue["1803"].name == "tokC-ok" and queue["1803"].state == "COMPLETED"
    assert queue["1807_2"].name == "tokC-@a|b"  # a "|" in a name stays in it
    assert queue["1807_2"].state == "FAILED" and queue["1807_2"].reason == "NonZeroExitCode"
    assert queue_status(queue["1809"]).running and queue_status(queue["1810"]).waiting
    requeued = parse_squeue(data("squeue_requeued.txt"))["1813"]  # scontrol requeue of a running job
    assert requeued.state == "PENDING" and requeued.reason == "BeginTime"
    assert queue_status(requeued).waiting  # a requeued job is followed, not ended
    # the same job in scontrol: running, then requeued (Restarts=1) and waiting for a node
    before, after = (
        parse_scontrol(data("scontrol_before_node_kill.txt")),
        parse_scontrol(data("scontrol_requeued_node_down.txt")),
    )
    assert (before["JobState"], before["Restarts"]) == ("RUNNING", "0")
    assert (after["JobState"], after["Restarts"]) == ("PENDING", "1") and after[
        "Reason"
    ].startswith("ReqNodeNotAvail")
    assert final_status(data("scontrol_requeued_node_down.txt")).waiting  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("job", "code", "message"),
    [
        ("tokA-ok", 0, None),
        ("tokA-fail", 3, None),
        ("tokA-sig", 137, "Slurm: JobLaunchFailure"),
        ("tokA-cancel", 143, "cancelled in Slurm (scancel)"),
        ("array-2", 2, None),
    ],
)
def test_exit_codes_from_scontrol_as_captured(job: str, code: int, message: str | None) -> None:
    row = scontrol_jobs("scontrol_mixed.txt")[job]
    status = status_of(row["JobState"], row["ExitCode"], row["Reason"])
    assert status.done and status.code == code and status.message == message


@pytest.mark.parametrize("state", ["NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "REVOKED", "SPECIAL_EXIT"])
def test_a_job_slurm_ended_is_never_a_success(state: str) -> None:
    # sacct and scontrol show a job whose node failed (no requeue) as NODE_FAIL with ExitCode
    # 0:0: its command never finished, so it must not count as finished
    for status in (status_of(state, "0:0"), final_status(f"sacct 17|{state}|0:0\n")):
        assert status is not None and status.done
        assert status.code == 1 and status.message == f"Slurm: {state}"
    assert status_of(state, "0:9").code == 137  # a signal stays what it was


@pytest.mark.parametrize(
    ("job", "code", "message"),
    [
        ("1803", 0, None),
        ("1804", 3, None),  # exit 3: wait status 768
        ("1805", 137, "Slurm: JobLaunchFailure"),  # kill -9 $$
        ("1806", 143, "Slurm: JobLaunchFailure"),  # kill -TERM $$
        ("1807_1", 1, None),
        ("1807_2", 2, None),
        ("1808", 143, "cancelled in Slurm (scancel)"),
        ("1802", 124, "Slurm ended it at its time limit (TIMEOUT)"),
    ],
)
def test_how_a_job_ended_as_squeue_tells_it(job: str, code: int, message: str | None) -> None:
    # the same jobs' scontrol said ExitCode 0:0, 3:0, 0:9, 0:15, 1:0, 2:0, 0:15, 0:15
    status = queue_status(parse_squeue(data("squeue_exit_codes.txt"))[job])
    assert status.done and status.code == code and status.message == message


def test_final_status_from_scontrol_or_sacct() -> None:
    line = next(x for x in data("scontrol_mixed.txt").splitlines() if "JobName=tokA-fail " in x)
    assert final_status(line) == status_of("FAILED", "3:0", "NonZeroExitCode")
    assert final_status(data("scontrol_requeued.txt")) is not None
    assert not final_status(data("scontrol_requeued.txt")).done  # type: ignore[union-attr]
    assert final_status("sacct 17|TIMEOUT|0:0\n17.batch|CANCELLED|0:15\n").code == 124  # type: ignore[union-attr]
    assert final_status("slurm_load_jobs error: Invalid job id specified") is None
    timeout = parse_scontrol(data("scontrol_timeout.txt"))
    assert status_of(timeout["JobState"], timeout["ExitCode"]).code == 124


def stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """squeue, scontrol and sacct answering from the captures, each call logged; the folder to
    put first on the PATH and the log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    logged = f'echo "$(basename "$0") $*" >> {shlex.quote(str(log))}\n'
    (bin_dir / "squeue").write_text(  # as captured, and one that ended without a wait status
        f"#!/bin/sh\n{logged}cat {DATA / 'squeue_exit_codes.txt'}\necho '3|tokA-fail|FAILED|NonZeroExitCode|'\n"
    )
    (bin_dir / "scontrol").write_text(  # one job's line, or every job's
        f"#!/bin/sh\n{logged}"
        f'if [ -n "$4" ]; then grep "^JobId=$4 " {DATA / "scontrol_mixed.txt"}; exit $?; fi\n'
        f"cat {DATA / 'scontrol_mixed.txt'}\n"
    )
    (bin_dir / "sacct").write_text(f"#!/bin/sh\n{logged}echo '77|COMPLETED|0:0'\necho '78|TIMEOUT|0:0'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, log


def ask_the_agent(tmp_path: Path, request: P.SlurmQuery) -> P.SlurmReply:
    """The shipped agent (started as on a host) answers one status query."""
    start = agent_start(sys.executable, str(tmp_path / "root"))
    with subprocess.Popen(["/bin/sh", "-c", start.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        request.id = 1
        proc.stdin.write(start.payload + request.encode())
        proc.stdin.flush()
        answer = W.decode_answer(proc.stdout.readline())
        proc.stdin.write(P.Bye().encode())
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    assert isinstance(answer, P.SlurmReply), answer
    return answer


SQUEUE_LINE = "squeue --me -r -t all -h -O JobArrayID:0|,Name:0|,State:0|,Reason:0|,exit_code:0"


def test_the_agent_answers_the_status_query_with_squeue_and_one_scontrol_for_the_rest(tmp_path: Path) -> None:
    """squeue once, which tells how the jobs it lists ended; those it shows ended without a
    wait status, or no longer lists, told by ONE scontrol of every job (filtered: an array task
    by its A_T id), those scontrol no longer knows by one sacct; then each job's new output."""
    bin_dir, log = stand_ins(tmp_path)
    jobs = tmp_path / "root" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "t-j.out").write_bytes(b"hello\nworld\n")
    (jobs / "t-j2.err").write_bytes(b"oops\n")
    os.mkfifo(jobs / "t-fifo.out")  # a job's leftover: never waited on
    (tmp_path / "elsewhere.out").write_bytes(b"not ours\n")
    request = status_query(
        SlurmSettings(command_prefix=f"PATH={shlex.quote(str(bin_dir))}:$PATH"),
        # no wait status, running, an array task that failed, failed, two aged out
        ["3", "1809", "1807_2", "1804", "77", "78"],
        {
            "j": (str(jobs / "t-j"), 6, 0),
            "j2": (str(jobs / "t-j2"), 0, 0),
            "fifo": (str(jobs / "t-fifo"), 0, 0),
            "none": (str(jobs / "t-none"), 0, 0),
            "out": (str(tmp_path / "elsewhere"), 0, 0),  # outside the work root: not read
        },
    )
    reply = poll_reply(ask_the_agent(tmp_path, request))
    assert reply.squeue_ok and reply.queue["3"].state == "FAILED"
    assert queue_status(reply.queue["1807_2"]).code == 2 and queue_status(reply.queue["1804"]).code == 3
    assert set(reply.detail) == {"3", "77", "78"}  # squeue told the others; 1809 still runs
    assert final_status(reply.detail["3"]).code == 3  # type: ignore[union-attr]
    assert final_status(reply.detail["77"]).code == 0  # type: ignore[union-attr]
    assert final_status(reply.detail["78"]).code == 124  # type: ignore[union-attr]
    assert reply.data == {"j": {1: b"world\n"}, "j2": {2: b"oops\n"}}
    assert log.read_text().splitlines() == [
        SQUEUE_LINE,
        "scontrol -o show job",
        "sacct -P -n -X -o JobID,State,ExitCode -j 77,78",
    ]


def test_jobs_squeue_tells_whole_cost_nothing_more(tmp_path: Path) -> None:
    bin_dir, log = stand_ins(tmp_path)
    prefix = f"PATH={shlex.quote(str(bin_dir))}:$PATH"
    request = status_query(SlurmSettings(command_prefix=prefix), ["1804", "1807_1", "1808", "1809"], {})
    reply = poll_reply(ask_the_agent(tmp_path, request))
    assert reply.detail == {} and log.read_text().splitlines() == [SQUEUE_LINE]
    assert [queue_status(reply.queue[i]).code for i in ("1804", "1807_1", "1808")] == [3, 1, 143]


def test_a_squeue_without_exit_code_leaves_no_job_waiting(tmp_path: Path) -> None:
    # a squeue that refuses the exit_code field (as 22.05 refuses a field it does not know):
    # the plain format is asked next, and the jobs that ended are asked of scontrol
    bin_dir, log = stand_ins(tmp_path)
    (bin_dir / "squeue").write_text(
        f'#!/bin/sh\necho "squeue $*" >> {shlex.quote(str(log))}\n'
        'case "$*" in *exit_code*) echo "squeue: error: Invalid job format specification: exit_code:0"; exit 1;; esac\n'
        "echo '3|tokA-fail|FAILED|NonZeroExitCode|'\necho '5|tokA-timeout|RUNNING|None|'\n"
    )
    request = status_query(SlurmSettings(command_prefix=f"PATH={shlex.quote(str(bin_dir))}:$PATH"), ["3", "5"], {})
    reply = poll_reply(ask_the_agent(tmp_path, request))
    assert reply.squeue_ok and queue_status(reply.queue["5"]).running
    assert set(reply.detail) == {"3"} and final_status(reply.detail["3"]).code == 3  # type: ignore[union-attr]
    assert log.read_text().splitlines() == [
        SQUEUE_LINE, "squeue --me -r -t all -h -o %i|%j|%T|%r|", "scontrol -o show job 3"
    ]


def test_one_job_that_ended_is_asked_of_scontrol_alone(tmp_path: Path) -> None:
    bin_dir, log = stand_ins(tmp_path)
    request = status_query(SlurmSettings(command_prefix=f"PATH={shlex.quote(str(bin_dir))}:$PATH"), ["3", "1809"], {})
    reply = poll_reply(ask_the_agent(tmp_path, request))
    assert set(reply.detail) == {"3"} and final_status(reply.detail["3"]).code == 3  # type: ignore[union-attr]
    assert log.read_text().splitlines()[1:] == ["scontrol -o show job 3"]


def test_a_status_query_without_squeue_says_why(tmp_path: Path) -> None:
    request = status_query(SlurmSettings(command_prefix="PATH=/nonexistent"), ["3"], {})
    reply = poll_reply(ask_the_agent(tmp_path, request))
    assert not reply.squeue_ok and reply.detail == {}
    assert "squeue" in reply.squeue_text and "not found" in reply.squeue_text


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ([1], "'slurm' must be a mapping"),
        ({"partiton": "gpu"}, "unknown key 'slurm.partiton'"),
        ({"max_queued": 0}, "'slurm.max_queued' must be a whole number from 1 to 100000"),
        ({"sbatch_args": ["constraint=a"]}, "'slurm.sbatch_args' must be a list of sbatch options"),
        ({"partition": ""}, "'slurm.partition' must be one line of text"),
        ({"poll_interval": 0}, "'slurm.poll_interval' must be a number of seconds"),
        ({"arrays": "yes"}, "'slurm.arrays' must be true or false"),
    ],
)
def test_slurm_section_errors_are_one_line_with_the_fix(section: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_slurm_section(section, "m.yaml:3")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_slurm_section_values() -> None:
    settings = parse_slurm_section(
        {
            "partition": "gpu",
            "max_queued": 64,
            "sbatch_args": "--constraint=a100 --nice=5",
            "command_prefix": "module load slurm",
        },
        "m",
    )
    assert settings == SlurmSettings(
        partition="gpu",
        max_queued=64,
        sbatch_args=("--constraint=a100", "--nice=5"),
        command_prefix="module load slurm",
    )
    assert parse_slurm_section(None, "m") == SlurmSettings()


def test_a_slurm_queue_takes_max_queued_jobs_after_every_host_with_room() -> None:
    from ssh_scheduler.machines.host_state import GpuState, HostState
    from ssh_scheduler.planner.allocate import MachineResources, choose

    queue = MachineResources(
        "slurm",
        HostState(cpu_count=3, load_1m=0.0, mem_total_mb=0, mem_available_mb=0, job_slots=3),
    )
    gpu = GpuState(0, "GPU-1", "H100", 16000, 0, 16000, 0.0)
    host = MachineResources(
        "box",
        HostState(cpu_count=4, load_1m=0.0, mem_total_mb=8000, mem_available_mb=8000, gpus=(gpu,)),
    )
    needs = Needs(gpus=2, memory_mb=10**6)  # more than any placeholder: Slurm judges, not us
    assert queue.could_ever_fit(needs) and not host.could_ever_fit(needs)
    one = Needs(gpus=1)
    placed = []
    for n in range(5):
        target = choose([queue, host], one)
        if target is None:
            break
        placed.append((target.name, target.allocate(f"j{n}", one).gpu_indices))
    # the host first, then three in the queue, with no GPU of ours: Slurm sets CUDA_VISIBLE_DEVICES
    assert placed == [("box", (0,)), ("slurm", ()), ("slurm", ()), ("slurm", ())]
    queue.release("j2")
    assert choose([queue, host], one) is queue


def test_an_array_runs_each_task_in_its_own_jobs_folder(tmp_path: Path) -> None:
    from ssh_scheduler.executors.slurm_array import (
        array_script,
        array_submit_command,
        parse_array_script,
        shared_options,
        task_outputs,
    )

    folders = [str(tmp_path / f"tok-j {n}") for n in range(3)]  # a space survives the quoting
    assert parse_array_script(array_script(folders)) == folders
    one, two = (
        sbatch_argv(
            SlurmSettings(partition="p"),
            name=f"sshs-t-{n}",
            jobdir=folders[n],
            needs=Needs(gpus=1),
            timeout=None,
        )
        for n in (0, 1)
    )
    assert shared_options(one) == shared_options(two) and "--gres=gpu:1" in shared_options(one)
    assert shared_options(one) != shared_options(
        sbatch_argv(SlurmSettings(), name="x", jobdir="/d", needs=Needs(gpus=2), timeout=None)
    )
    # the submission line writes every job's script and the dispatch script, then runs sbatch
    # (a stand-in here answers as sbatch --parsable does)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 77\n")
    (bin_dir / "sbatch").chmod(0o755)
    for folder in folders:
        Path(folder).mkdir()
    jobs = [(f, batch_script(f"echo task {n} in $PWD", {}, gpus=1, jobdir=f)) for n, f in enumerate(folders)]
    stem = str(tmp_path / "t-@a%j")  # a '%' in a job name: Slurm would expand %j
    line = array_submit_command(
        SlurmSettings(command_prefix=f"PATH={shlex.quote(str(bin_dir))}:$PATH"), shared_options(one),
        name="sshs-t-@a", workdir=str(tmp_path), stem=stem, jobs=jobs,
    )  # fmt: skip
    # Slurm opens each task's output itself (what it says of the task lands there too)
    assert f"--output={tmp_path}/t-@a%%j.%a.out" in line and "--open-mode=append" in line
    done = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, check=True)
    assert parse_submitted(done.stdout) == "77"
    script = Path(stem + ".array").read_text()
    assert task_outputs(script, stem) == [f"{stem}.{n}" for n in range(3)]
    for n, folder in enumerate(folders):  # task n of the array, as slurmd would run it
        env = {"SLURM_ARRAY_TASK_ID": str(n), "PATH": "/usr/bin:/bin"}
        with open(f"{stem}.{n}.out", "ab") as out:
            subprocess.run(["/bin/sh", stem + ".array"], env=env, stdout=out, check=True)
        assert Path(f"{stem}.{n}.out").read_text() == f"task {n} in {folder}\n"
        assert Path(f"{folder}.began").exists()  # its script began: it is never sent again
    # an array an older version submitted wrote each task's output next to its job's folder
    older = script.replace('exec /bin/sh "$f.sh"', 'exec /bin/sh "$f.sh" >>"$f.out" 2>>"$f.err"')
    assert task_outputs(older, stem) == folders


async def test_a_slurm_command_that_hangs_is_killed_and_said(tmp_path: Path) -> None:
    """squeue stuck on a controller that never answers: the agent kills it after its timeout
    and answers with why, instead of holding the query (and every job's end) forever."""
    agent = Agent(str(tmp_path / "root"), "tok")
    rc, said = await agent.run_command(["sleep", "30"], timeout=0.2)
    assert (rc, said) == (127, "sleep: no answer within 0.2 s")
    assert agent.children == set() and agent.spawning == 0
    assert await agent.run_command(["/nonexistent/squeue"]) == (
        127, "/nonexistent/squeue: [Errno 2] No such file or directory: '/nonexistent/squeue'")


def test_a_batch_script_marks_that_it_began_before_anything_runs(tmp_path: Path) -> None:
    """The mark (``<folder>.began``) is made before the job's command: a job Slurm ends without
    it never ran, and only such a job is sent again.  One whose mark cannot be made does not run
    its command at all (sent again, it would have run twice)."""
    folder = tmp_path / "t-j"
    folder.mkdir()
    script = tmp_path / "t-j.sh"
    script.write_text(batch_script(f"echo ran > {tmp_path}/ran", {}, gpus=0, jobdir=str(folder)))
    subprocess.run(["/bin/sh", str(script)], cwd=folder, check=True)
    assert (tmp_path / "t-j.began").exists() and (tmp_path / "ran").read_text() == "ran\n"
    (tmp_path / "t-k.began").mkdir()  # where its mark should go: it cannot be made
    script.write_text(batch_script(f"echo ran > {tmp_path}/ran2", {}, gpus=0, jobdir=str(tmp_path / "t-k")))
    done = subprocess.run(["/bin/sh", str(script)], cwd=folder, capture_output=True, text=True, check=False)
    assert done.returncode == 1 and not (tmp_path / "ran2").exists(), done


async def test_a_job_sent_again_leads_an_array_of_its_own_files(tmp_path: Path) -> None:
    """Arrays are named after their first job (``@<job>``): a job Slurm failed before it began
    and that leads an array again gets ``@<job>@2``, so the new array's tasks never append to
    (and are never followed from) the first array's task outputs, which other jobs had."""
    import asyncio

    from ssh_scheduler.executors.slurm_array import parse_array_script
    from ssh_scheduler.executors.slurm_submit import Submitter

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    counter = tmp_path / "n"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\nn=$(cat {counter} 2>/dev/null || echo 10); echo $((n + 1)) > {counter}; echo $n\n")
    (bin_dir / "sbatch").chmod(0o755)
    settings = SlurmSettings(command_prefix=f"PATH={shlex.quote(str(bin_dir))}:$PATH")
    jobs = tmp_path / "jobs"
    jobs.mkdir()

    def jobdir(token: str, job: str) -> str:
        return f"{jobs}/{token}-{job}"

    async def run(line: str) -> tuple[str, int]:
        done = await asyncio.to_thread(subprocess.run, ["/bin/sh", "-c", line], capture_output=True, text=True)
        return done.stdout + done.stderr, done.returncode

    async def nothing(ids: list[str]) -> None:
        pass

    submitter = Submitter("login", settings, "t", run, nothing, jobdir)

    async def together(*names: str) -> list[tuple[str | None, str]]:
        argv = sbatch_argv(settings, name="x", jobdir="/d", needs=Needs(), timeout=None)
        done = await asyncio.gather(*(
            submitter.submit(n, jobdir("t", n), argv, batch_script("true", {}, gpus=0, jobdir=jobdir("t", n)))
            for n in names
        ))  # fmt: skip
        return [(d.slurm_id, d.output) for d in done]

    try:
        assert await together("X", "Y") == [("10_0", f"{jobs}/t-@X.0"), ("10_1", f"{jobs}/t-@X.1")]
        assert await together("X", "Z") == [("11_0", f"{jobs}/t-@X@2.0"), ("11_1", f"{jobs}/t-@X@2.1")]
        assert await together("W") == [("12", f"{jobs}/t-W")]  # alone: its own folder's files
        assert sorted(p.name for p in jobs.glob("*.array")) == ["t-@X.array", "t-@X@2.array"]
        assert parse_array_script((jobs / "t-@X@2.array").read_text()) == [f"{jobs}/t-X", f"{jobs}/t-Z"]
    finally:
        await submitter.close()
