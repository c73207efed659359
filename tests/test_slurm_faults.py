"""Faults with a Slurm machine, against the real test Slurm: Ctrl-C twice scancels what we
submitted, a SIGKILLed coordinator's rerun reattaches to its Slurm jobs without submitting them
again, and a node killed mid-batch is requeued by Slurm and followed, losing and duplicating no job."""

from __future__ import annotations

import signal
from pathlib import Path

from ssh_scheduler.results.journal import batch_token
from tests.conftest_slurm import SlurmSite
from tests.live_batch import LiveBatch, run_batch, wait_until
from tests.test_slurm_batch import shared_dir, slurm_machine


def our_jobs(slurm: SlurmSite, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Slurm's record of this test's jobs (named sshs-<token>-<job>, or sshs-<token>-@<first
    job> for an array), by Slurm job id."""
    prefix = f"sshs-{_token(tmp_path)}-"
    return {j["JobId"]: j for j in slurm.slurm.jobs() if j["JobName"].startswith(prefix)}


def _token(tmp_path: Path) -> str:
    token = batch_token(tmp_path / "job_results")
    assert token, "no batch token in the journal yet"
    return token


def all_running(slurm: SlurmSite, tmp_path: Path, count: int) -> bool:
    try:
        jobs = our_jobs(slurm, tmp_path)
    except (OSError, AssertionError):
        return False
    return len(jobs) == count and all(j["JobState"] == "RUNNING" for j in jobs.values())


def gated(gate: Path, then: str = "true") -> str:
    return (
        f"n=0; while [ ! -e {gate}/go ] && [ $n -lt 3000 ]; do sleep 0.1; n=$((n+1)); done; {then}"
    )


def test_ctrl_c_twice_scancels_everything_we_submitted(slurm: SlurmSite, tmp_path: Path) -> None:
    gate = shared_dir(slurm)
    (tmp_path / "b.sh").write_text((gated(gate) + "\n") * 4)
    batch = LiveBatch(
        tmp_path, "b.sh", "--machines", slurm_machine(slurm, tmp_path), "--no-gpu-required"
    )
    try:
        batch.wait_for("started:", 4)
        wait_until(lambda: all_running(slurm, tmp_path, 4), "4 jobs running in Slurm")
        batch.signal(signal.SIGINT)
        batch.wait_for("stopping", stderr=True)
        batch.signal(signal.SIGINT)
        assert batch.finish(timeout=60) == 130, batch.text()
    finally:
        batch.finish()
    jobs = our_jobs(slurm, tmp_path)
    assert len(jobs) == 4 and {j["JobState"] for j in jobs.values()} == {"CANCELLED"}, jobs
    assert (
        slurm.slurm.command("squeue", "-h", "-r", "-o", "%j").split() == []
    )  # nothing queued at all


def test_a_killed_coordinators_rerun_reattaches_without_resubmitting(
    slurm: SlurmSite, tmp_path: Path
) -> None:
    gate = shared_dir(slurm)
    (tmp_path / "b.sh").write_text(
        "".join(gated(gate, f"echo done-{n}") + "\n" for n in range(1, 4))
    )
    machine = slurm_machine(slurm, tmp_path)
    batch = LiveBatch(tmp_path, "b.sh", "--machines", machine, "--no-gpu-required")
    try:
        batch.wait_for("started:", 3)
        wait_until(lambda: all_running(slurm, tmp_path, 3), "3 jobs running in Slurm")
    finally:
        batch.kill()  # SIGKILL: no scancel, the jobs stay in Slurm
    before = our_jobs(slurm, tmp_path)
    assert len(before) == 3 and {j["JobState"] for j in before.values()} == {"RUNNING"}
    assert slurm.login.ssh(f"touch {gate}/go").returncode == 0
    again = run_batch(tmp_path, "b.sh", "--machines", machine, "--no-gpu-required")
    assert again.returncode == 0, again.stdout + again.stderr
    after = our_jobs(slurm, tmp_path)
    assert set(after) == set(before)  # the same Slurm jobs, none submitted again
    assert {row["JobState"] for row in after.values()} == {"COMPLETED"}
    assert "reattached" in again.stdout + again.stderr
    for n in range(1, 4):
        assert (tmp_path / "job_results" / f"b.sh.{n}.out").read_text() == f"done-{n}\n"


def test_a_node_killed_mid_batch_loses_no_job_and_duplicates_none(
    slurm: SlurmSite, tmp_path: Path
) -> None:
    shared = shared_dir(slurm)
    ledger = shared / "ledger"
    (tmp_path / "b.sh").write_text(
        "".join(gated(shared, f"echo b.sh.{n} >> {ledger}") + "\n" for n in range(1, 9))
    )
    batch = LiveBatch(
        tmp_path,
        "b.sh",
        "--machines",
        slurm_machine(slurm, tmp_path, max_queued=8),
        "--gpus-per-job",
        "1",
    )
    victim = ""
    try:
        batch.wait_for("started:", 8)
        wait_until(lambda: all_running(slurm, tmp_path, 8), "8 jobs running in Slurm")
        running = our_jobs(slurm, tmp_path)
        victim = next(iter(running.values()))["NodeList"]
        on_victim = {job_id for job_id, row in running.items() if row["NodeList"] == victim}
        slurm.slurm.kill_node(victim)

        def requeued() -> bool:
            rows = our_jobs(slurm, tmp_path)
            return all(rows[job_id]["Restarts"] == "1" for job_id in on_victim)

        wait_until(requeued, f"Slurm requeues the jobs of {victim}", timeout=90)
        assert slurm.login.ssh(f"touch {shared}/go").returncode == 0
        assert batch.finish(timeout=180) == 0, batch.text()
    finally:
        if batch.proc.poll() is None:
            batch.kill()
        if victim:
            slurm.slurm.start_node(victim)
    assert sorted(ledger.read_text().split()) == sorted(
        f"b.sh.{n}" for n in range(1, 9)
    )  # each once
    assert len([line for line in batch.out if line.startswith("finished: b.sh.")]) == 8
    rows = our_jobs(slurm, tmp_path)
    assert len(rows) == 8 and {row["JobState"] for row in rows.values()} == {"COMPLETED"}
    assert {job_id for job_id, row in rows.items() if row["Restarts"] == "1"} == on_victim
