"""execute_batch with a Slurm machine (executor_slurm) against the real test Slurm of
tests/slurm_cluster.py, through its SSH login node."""

from __future__ import annotations

import asyncio
import re
import secrets
import subprocess
import sys
from pathlib import Path

import yaml

from ssh_scheduler.agent import slurm as agent_slurm
from ssh_scheduler.executors import slurm_jobs as S
from ssh_scheduler.machines.slurm import SlurmSettings
from ssh_scheduler.results.journal import batch_token
from tests.conftest_slurm import SlurmSite
from tests.live_batch import LiveBatch, batch_env, run_batch, wait_until

DOCTOR = [sys.executable, "-m", "ssh_scheduler", "doctor"]


def slurm_machine(slurm: SlurmSite, tmp_path: Path, **settings: object) -> str:
    path = tmp_path / "slurm.yaml"
    path.write_text(
        yaml.safe_dump(slurm.slurm.machine_yaml(slurm.login, poll_interval=0.3, **settings))
    )
    return str(path)


def shared_dir(slurm: SlurmSite) -> Path:
    """A fresh folder in the login user's home, which every Slurm node sees at the same path."""
    path = slurm.login.home / f"shared-{secrets.token_hex(3)}"
    assert slurm.login.ssh(f"mkdir {path}").returncode == 0
    return path


def test_gpu_batch_one_job_per_gpu_with_output_results_and_exit_codes(
    slurm: SlurmSite, tmp_path: Path
) -> None:
    marks = shared_dir(slurm)
    # each job holds its GPU until all eight have started: eight at once on 4 nodes x 2 GPUs.  A
    # barrier never reached (fewer at once) fails the job, and so the test, instead of falling
    # through after its 60 s as if all eight had run together.
    job = (
        f"echo $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES; touch {marks}/$SSH_SCHEDULER_JOB; "
        f"n=0; while [ $(ls {marks} | wc -l) -lt 8 ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done; "
        f'[ $(ls {marks} | wc -l) -ge 8 ] || {{ echo "barrier: $(ls {marks} | wc -l) of 8 at once" >&2; exit 9; }}; '
        "echo made > result.txt; echo to-stderr >&2"
    )
    lines = [job] * 7 + [job + "; exit 3"]
    (tmp_path / "jobs.sh").write_text("\n".join(lines) + "\n")
    result = run_batch(
        tmp_path,
        "jobs.sh",
        "--machines",
        slurm_machine(slurm, tmp_path, max_queued=8),
        "--gpus-per-job",
        "1",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout.splitlines()
    started = [line for line in out if line.startswith("started: jobs.sh.")]
    assert len(started) == 8, result.stdout
    # Slurm picks each job's GPU: the line names the Slurm job, not a CUDA_VISIBLE_DEVICES of ours
    assert all(re.search(r"  \(Slurm job \d+(_\d+)? through ", line) for line in started), started
    assert not any("export CUDA_VISIBLE_DEVICES" in line for line in started), started
    assert len([line for line in out if line.startswith("finished: jobs.sh.")]) == 7, result.stdout
    assert any(line.startswith("failed: jobs.sh.8;") and "exit 3" in line for line in out), (
        result.stdout
    )
    results = tmp_path / "job_results"
    placed = [(results / f"jobs.sh.{n}.out").read_text().split() for n in range(1, 9)]
    assert all(p[0] in slurm.slurm.nodes and p[1] in ("0", "1") for p in placed), placed
    assert len({tuple(p) for p in placed}) == 8, placed  # one job per GPU, set by Slurm
    for n in range(1, 9):
        assert (results / f"jobs.sh.{n}" / "result.txt").read_text() == "made\n"
        assert (results / f"jobs.sh.{n}.err").read_text() == "to-stderr\n"
    token = batch_token(results)
    ours = [j for j in slurm.slurm.jobs() if j["JobName"].startswith(f"sshs-{token}-")]
    assert sorted(j["JobState"] for j in ours) == ["COMPLETED"] * 7 + ["FAILED"]
    # submitted together with the same needs: one sbatch --array, named after its first job
    assert len({j["ArrayJobId"] for j in ours}) == 1 and all(
        j["JobName"].startswith(f"sshs-{token}-@jobs.sh.") for j in ours
    )


def test_output_streams_home_while_the_job_runs(slurm: SlurmSite, tmp_path: Path) -> None:
    gate = shared_dir(slurm)
    (tmp_path / "jobs.sh").write_text(
        f"echo first; n=0; while [ ! -e {gate}/go ] && [ $n -lt 1200 ]; do sleep 0.1; n=$((n+1)); done; echo second\n"
    )
    batch = LiveBatch(
        tmp_path, "jobs.sh", "--machines", slurm_machine(slurm, tmp_path), "--no-gpu-required"
    )
    try:
        out = tmp_path / "job_results" / "jobs.sh.1.out"
        wait_until(
            lambda: out.exists() and out.read_text() == "first\n",
            "the first line at home",
            timeout=60,
        )
        assert not (gate / "go").exists()  # still running: it waits for the gate
        assert slurm.login.ssh(f"touch {gate}/go").returncode == 0
        assert batch.finish(timeout=120) == 0, batch.text()
    finally:
        if batch.proc.poll() is None:
            batch.kill()
    assert out.read_text() == "first\nsecond\n"


def test_a_job_sbatch_refuses_is_a_failed_line(slurm: SlurmSite, tmp_path: Path) -> None:
    (tmp_path / "jobs.sh").write_text("echo never\n")
    result = run_batch(
        tmp_path, "jobs.sh", "--machines", slurm_machine(slurm, tmp_path), "--gpus-per-job", "3"
    )
    assert result.returncode == 1
    assert any(line.startswith("failed: jobs.sh.1;") for line in result.stdout.splitlines()), (
        result.stdout
    )
    err = (tmp_path / "job_results" / "jobs.sh.1.err").read_text()
    assert "sbatch refused it" in err and "Requested node configuration is not available" in err, (
        err
    )


def test_a_mixed_batch_uses_an_ssh_host_and_slurm_together(
    slurm: SlurmSite, tmp_path: Path
) -> None:
    (tmp_path / "jobs.sh").write_text(
        "sleep 1; echo slurm=${SLURM_JOB_ID:-none} gpu=$CUDA_VISIBLE_DEVICES\n" * 6
    )
    result = run_batch(
        tmp_path, "jobs.sh", "--machines", str(slurm.plain.machine_file), slurm_machine(slurm, tmp_path, max_queued=4),
        "--gpus-per-job", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    said = [
        (tmp_path / "job_results" / f"jobs.sh.{n}.out").read_text().split() for n in range(1, 7)
    ]
    on_host = [s for s in said if s[0] == "slurm=none"]
    in_slurm = [s for s in said if s[0] != "slurm=none"]
    assert on_host and in_slurm, said
    assert all(s[1] == "gpu=0" for s in on_host)  # the host's one GPU, placed by us
    assert all(s[1] in ("gpu=0", "gpu=1") for s in in_slurm)  # placed by Slurm


def doctor(cwd: Path, machine: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DOCTOR, "--machines", machine],
        cwd=cwd,
        env=batch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_doctor_checks_slurm_on_the_login_node(slurm: SlurmSite, tmp_path: Path) -> None:
    good = doctor(tmp_path, slurm_machine(slurm, tmp_path))
    assert good.returncode == 0, good.stdout + good.stderr
    assert re.search(
        r"^login: a Slurm login node \(slurm\S* 22\.05\.\d+\): sbatch, squeue", good.stdout, re.M
    ), good.stdout
    # an ordinary host named a Slurm login node: its squeue finds no Slurm to talk to
    bad_yaml = tmp_path / "not-slurm.yaml"
    bad_yaml.write_text(
        yaml.safe_dump({**slurm.plain.machine_yaml(), "slurm": {"partition": "debug"}})
    )
    bad = doctor(tmp_path, str(bad_yaml))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "plain: Slurm does not answer on this login node (squeue: " in bad.stdout
    assert "fix: put sbatch and squeue on the PATH" in bad.stdout


def test_a_dry_run_plans_jobs_into_the_slurm_queue(slurm: SlurmSite, tmp_path: Path) -> None:
    (tmp_path / "jobs.sh").write_text("true\n" * 3)
    result = run_batch(
        tmp_path, "jobs.sh", "--machines", slurm_machine(slurm, tmp_path, max_queued=2), "--dry-run"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    plans = [line for line in result.stdout.splitlines() if line.startswith("plan: ")]
    assert len(plans) == 3 and all(" -> login " in line for line in plans), result.stdout
    assert "slurm.yaml': 2}" in result.stdout  # machine limits: the queue's max_queued
    assert "gpu choices: [[]]" in result.stdout  # no GPUs of ours: Slurm places them


def one_cpu_job(
    slurm: SlurmSite, tmp_path: Path, line: str, *options: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """Run a one-line batch without GPUs on Slurm; the batch's result and Slurm's record of the job."""
    (tmp_path / "jobs.sh").write_text(line + "\n")
    result = run_batch(
        tmp_path,
        "jobs.sh",
        "--machines",
        slurm_machine(slurm, tmp_path),
        "--no-gpu-required",
        *options,
    )
    token = batch_token(tmp_path / "job_results")
    (row,) = [j for j in slurm.slurm.jobs() if j["JobName"] == f"sshs-{token}-jobs.sh.1"]
    return result, row


def test_timeout_is_slurms_time_limit_and_ends_the_job_on_time(
    slurm: SlurmSite, tmp_path: Path
) -> None:
    result, row = one_cpu_job(slurm, tmp_path, "echo begun; sleep 120", "--timeout", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert any(
        line.startswith("failed: jobs.sh.1;") and "timed out" in line
        for line in result.stdout.splitlines()
    ), result.stdout
    assert row["TimeLimit"] == "00:01:00"  # --time, in Slurm's whole minutes
    assert row["JobState"] == "CANCELLED"  # and our own --timeout scancelled it first
    assert (tmp_path / "job_results" / "jobs.sh.1.out").read_text() == "begun\n"


def test_output_past_max_output_bytes_is_dropped_and_the_job_cancelled(
    slurm: SlurmSite, tmp_path: Path
) -> None:
    line = "head -c 100000 /dev/zero | tr '\\0' x; sleep 120"
    result, row = one_cpu_job(slurm, tmp_path, line, "--max-output-bytes", "1000")
    assert result.returncode == 1, result.stdout + result.stderr
    assert (tmp_path / "job_results" / "jobs.sh.1.out").read_text() == "x" * 1000
    assert row["JobState"] == "CANCELLED"


def test_the_agents_squeue_tells_how_jobs_ended_on_the_real_slurm(slurm: SlurmSite) -> None:
    """The status query's own squeue line (agent/slurm.py) against the real squeue: accepted
    as written (no retry in the plain format), a name holding "|" kept whole, and each job that
    ended told by its wait status exactly as scontrol's ExitCode tells it, with nothing more run."""
    site = slurm.slurm
    name = f"sshs-t{secrets.token_hex(4)}-a|b"
    ids = {
        wrap: site.command("sbatch", "--parsable", "-J", name, "-o", "/dev/null", "--wrap", wrap).strip()
        for wrap in ("true", "exit 3", "kill -9 $$")
    }
    for job_id in ids.values():
        wait_until(lambda j=job_id: site.job_field(j, "JobState") in S.DONE_STATES, f"job {job_id} ended")  # type: ignore[misc]
    ran: list[list[str]] = []

    async def run(argv: list[str]) -> tuple[int, str]:
        ran.append(argv)
        proc = subprocess.run(argv, capture_output=True, text=True, env=site.env, check=False)
        return proc.returncode, proc.stdout + proc.stderr

    query = S.status_query(SlurmSettings(), list(ids.values()), {})
    reply = S.poll_reply(asyncio.run(agent_slurm.query(query, run)))
    assert ran == [agent_slurm.SQUEUE], ran  # squeue told all: no retry, no scontrol, no sacct
    assert reply.squeue_ok and reply.detail == {}
    for wrap, code in (("true", 0), ("exit 3", 3), ("kill -9 $$", 137)):
        entry = reply.queue[ids[wrap]]
        assert entry.name == name
        told = S.queue_status(entry)
        assert told.done and told.code == code, (wrap, entry)
        exit_code = site.job_field(ids[wrap], "ExitCode")
        assert told == S.status_of(entry.state, exit_code, entry.reason), (wrap, exit_code)


def test_what_slurm_says_of_an_array_task_is_in_its_err(slurm: SlurmSite, tmp_path: Path) -> None:
    # Two jobs placed together go as one array; Slurm opens each task's output itself, so its own
    # words about a task (here: cancelled by someone else's scancel) reach that job's .err, as a
    # single job's do.  The array's dispatch script once sent them to /dev/null.
    (tmp_path / "jobs.sh").write_text("echo begun; sleep 120\n" * 2)
    batch = LiveBatch(
        tmp_path, "jobs.sh", "--machines", slurm_machine(slurm, tmp_path), "--no-gpu-required"
    )
    outs = [tmp_path / "job_results" / f"jobs.sh.{n}.out" for n in (1, 2)]
    try:
        wait_until(lambda: all(p.exists() and p.read_text() == "begun\n" for p in outs), "both running", timeout=60)
        tasks = [j for j in slurm.slurm.jobs() if j["JobName"].endswith("-@jobs.sh.1") and j["JobState"] == "RUNNING"]
        assert len(tasks) == 2, tasks  # one array
        assert slurm.login.ssh("scancel " + " ".join(j["JobId"] for j in tasks)).returncode == 0
        assert batch.finish(timeout=120) == 1, batch.text()
    finally:
        if batch.proc.poll() is None:
            batch.kill()
    for n in (1, 2):
        err = (tmp_path / "job_results" / f"jobs.sh.{n}.err").read_text()
        assert re.search(r"\*\*\* JOB \d+ ON \S+ CANCELLED AT \S+", err), err
        assert f"failed: jobs.sh.{n}" in batch.text()


def test_a_percent_in_a_job_name_is_no_pattern_to_slurm(slurm: SlurmSite, tmp_path: Path) -> None:
    # sbatch expands %j, %x, %a... in --output/--error: a job named r%j.sh.1 would have had its
    # output written to r<Slurm id>.sh.1.out, where nobody reads it.  One job (one sbatch), then
    # two (one array, its files named after the first job).
    for folder, batch, lines in (("one", "r%j.sh", ["one"]), ("two", "a%x.sh", ["two", "three"])):
        cwd = tmp_path / folder
        cwd.mkdir()
        (cwd / batch).write_text("".join(f"echo {word}\n" for word in lines))
        result = run_batch(cwd, batch, "--machines", slurm_machine(slurm, cwd), "--no-gpu-required")
        assert result.returncode == 0, result.stdout + result.stderr
        for n, word in enumerate(lines, 1):
            assert (cwd / "job_results" / f"{batch}.{n}.out").read_text() == f"{word}\n"


def tries_of(slurm: SlurmSite, cwd: Path, job: str = "jobs.sh.1") -> list[dict[str, str]]:
    """Slurm's record of each submission of this batch's job (none before the batch began)."""
    token = batch_token(cwd / "job_results")
    rows = [j for j in slurm.slurm.jobs() if token and j["JobName"] == f"sshs-{token}-{job}"]
    return sorted(rows, key=lambda j: int(j["JobId"]))


def test_a_job_slurm_fails_before_its_script_began_is_sent_again(slurm: SlurmSite, tmp_path: Path) -> None:
    """A job Slurm fails before its batch script begins never ran its command (slurmd can lose
    a starting job's script to a race of its own, and the job fails with execve's ENOENT): it is
    sent again, and Slurm's words about the failed try stay in its .err.  Made to happen here by
    sbatch's ``--input`` naming a file per Slurm job id that exists only for jobs submitted after
    the first: slurmstepd cannot open the first job's stdin and fails it before its script."""
    gates = shared_dir(slurm)
    (tmp_path / "jobs.sh").write_text("echo ran\n")
    machine = slurm_machine(slurm, tmp_path, sbatch_args=[f"--input={gates}/in-%j"])
    batch = LiveBatch(tmp_path, "jobs.sh", "--machines", machine, "--no-gpu-required")
    try:
        wait_until(lambda: tries_of(slurm, tmp_path), "the first try is in Slurm")
        first = int(tries_of(slurm, tmp_path)[0]["JobId"])
        later = " ".join(f"{gates}/in-{n}" for n in range(first + 1, first + 200))
        assert slurm.login.ssh(f"touch {later}").returncode == 0
        assert batch.finish(timeout=120) == 0, batch.text()
    finally:
        if batch.proc.poll() is None:
            batch.kill()
    assert (tmp_path / "job_results" / "jobs.sh.1.out").read_text() == "ran\n"
    err = (tmp_path / "job_results" / "jobs.sh.1.err").read_text()
    assert f"ssh_scheduler: Slurm ended job {first} (FAILED, exit " in err, err
    assert "submitting it again" in err
    tries = tries_of(slurm, tmp_path)
    assert int(tries[0]["JobId"]) == first and len(tries) >= 2, tries
    assert [j["JobState"] for j in tries] == ["FAILED"] * (len(tries) - 1) + ["COMPLETED"], tries


def test_a_job_sent_again_is_followed_from_where_its_output_was(slurm: SlurmSite, tmp_path: Path) -> None:
    """A single job sent again appends to the same output files (``--open-mode=append``): what
    came home of them while its first try waited is not brought again.  Each try is held
    (``--hold``) until the test releases it: the first once some output of it is home, so the
    offsets it was followed to are not zero when it fails (before its script: ``--input`` as
    above) and is sent again."""
    gates = shared_dir(slurm)
    (tmp_path / "jobs.sh").write_text("echo ran\n")
    machine = slurm_machine(slurm, tmp_path, sbatch_args=[f"--input={gates}/in-%j", "--hold"])
    batch = LiveBatch(tmp_path, "jobs.sh", "--machines", machine, "--no-gpu-required")
    out = tmp_path / "job_results" / "jobs.sh.1.out"
    try:
        wait_until(lambda: tries_of(slurm, tmp_path), "the first try is in Slurm, held")
        first = tries_of(slurm, tmp_path)[0]
        assert first["StdOut"].endswith("jobs.sh.1.out"), first
        assert slurm.login.ssh(f"printf 'before\\n' >> {first['StdOut']}").returncode == 0
        wait_until(lambda: out.exists() and out.read_text() == "before\n", "the held try's output is home")
        later = " ".join(f"{gates}/in-{n}" for n in range(int(first["JobId"]) + 1, int(first["JobId"]) + 200))
        assert slurm.login.ssh(f"touch {later}; scontrol release {first['JobId']}").returncode == 0
        wait_until(lambda: len(tries_of(slurm, tmp_path)) == 2, "the job is sent again")
        assert slurm.login.ssh(f"scontrol release {tries_of(slurm, tmp_path)[1]['JobId']}").returncode == 0
        assert batch.finish(timeout=120) == 0, batch.text()
    finally:
        if batch.proc.poll() is None:
            batch.kill()
    assert out.read_text() == "before\nran\n"  # "before" once: the second try followed from it
    assert [j["JobState"] for j in tries_of(slurm, tmp_path)] == ["FAILED", "COMPLETED"]


def test_a_job_that_ran_and_failed_is_not_sent_again(slurm: SlurmSite, tmp_path: Path) -> None:
    """Its script began (its mark is there): exit 2 is its own answer, told once."""
    result, row = one_cpu_job(slurm, tmp_path, "echo once; exit 2")
    assert result.returncode == 1 and "(exit 2 on" in result.stdout, result.stdout + result.stderr
    assert row["JobState"] == "FAILED"
    assert (tmp_path / "job_results" / "jobs.sh.1.out").read_text() == "once\n"
    assert "submitting it again" not in (tmp_path / "job_results" / "jobs.sh.1.err").read_text()


def test_a_job_cancelled_before_it_began_is_not_sent_again(slurm: SlurmSite, tmp_path: Path) -> None:
    """Someone's scancel of a job still waiting: it never began, yet it ended as asked, so it is
    told as cancelled, not sent again (only a job Slurm FAILED before its script is)."""
    (tmp_path / "jobs.sh").write_text("echo ran\n")
    machine = slurm_machine(slurm, tmp_path, sbatch_args=["--begin=now+600"])
    batch = LiveBatch(tmp_path, "jobs.sh", "--machines", machine, "--no-gpu-required")
    try:
        wait_until(lambda: tries_of(slurm, tmp_path), "submitted")
        assert slurm.login.ssh(f"scancel {tries_of(slurm, tmp_path)[0]['JobId']}").returncode == 0
        assert batch.finish(timeout=120) == 1, batch.text()
    finally:
        if batch.proc.poll() is None:
            batch.kill()
    assert "failed: jobs.sh.1" in batch.text()
    assert [j["JobState"] for j in tries_of(slurm, tmp_path)] == ["CANCELLED"]
