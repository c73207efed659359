"""execute_batch end to end on the SSH test cluster (issue 3's acceptance), through the real CLI."""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.live_batch import (
    EXECUTE_BATCH,
    REPO,
    LiveBatch,
    batch_processes,
    machines,
    run_batch,
    wait_until,
)

ANCESTOR_BATCH = """\
echo "one job"
echo "jobs will tell you if they fail" && exit 1
echo "another job" && echo "a combined job (bash syntax applies)"
bash local.sh && echo "you can also call local files because they are copied by the remote by the default value of --copy-forwards"
"""


def test_ancestor_example_on_two_hosts(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "batch_script.sh").write_text(ANCESTOR_BATCH)
    result = run_batch(tmp_path, "batch_script.sh", *machines(cluster4, 2), "--memory-required=2000")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("machine limits:  {")
    assert lines[1] == "machine gpu choices: [[0, 1], [0, 1]]"
    started = [line for line in lines if line.startswith("started: ")]
    assert len(started) == 4
    assert all(re.match(r"started: batch_script\.sh\.\d;  export CUDA_VISIBLE_DEVICES=[01] && ", s) for s in started)
    assert "finished: batch_script.sh.1; echo \"one job\"" in lines
    assert any(line.startswith('failed: batch_script.sh.2; echo "jobs will tell you if they fail" && exit 1  (exit 1 on h') for line in lines)
    assert any(line.startswith("failed: batch_script.sh.4; bash local.sh") and "(exit 127 on h" in line for line in lines)
    results = tmp_path / "job_results"
    for n in range(1, 5):
        assert (results / f"batch_script.sh.{n}").is_dir()
    # Every job that ended has both files, as the ancestor promised (and GNU parallel's --results
    # and Slurm make them): only the one that ran a missing file wrote on stderr.
    assert sorted(p.name for p in results.glob("*.out")) == [f"batch_script.sh.{n}.out" for n in range(1, 5)]
    assert sorted(p.name for p in results.glob("*.err")) == [f"batch_script.sh.{n}.err" for n in range(1, 5)]
    assert [(results / f"batch_script.sh.{n}.err").read_text() for n in range(1, 4)] == ["", "", ""]
    assert (results / "batch_script.sh.4.out").read_text() == ""
    assert (results / "batch_script.sh.3.out").read_text() == "another job\na combined job (bash syntax applies)\n"
    assert "local.sh" in (results / "batch_script.sh.4.err").read_text()

    # Results are never overwritten: a rerun skips every job with the ancestor's warning.
    again = run_batch(tmp_path, "batch_script.sh", *machines(cluster4, 2))
    # ... and the earlier failures, now skipped, still fail the run (a CI loop must not pass).
    assert again.returncode == 1, again.stderr
    assert "skipped: batch_script.sh.2, batch_script.sh.4; rerun with --retry-failed" in again.stderr
    assert again.stdout.count("WARNING: job results already exists for line") == 4
    assert (results / "batch_script.sh.3.out").read_text().startswith("another job")


def _intervals(results: Path, count: int) -> list[tuple[str, str, float, float]]:
    records = []
    for n in range(1, count + 1):
        host, gpus, start, end = (results / f"gpus.sh.{n}.out").read_text().split()
        records.append((host, gpus, float(start), float(end)))
    return records


def test_forty_jobs_two_per_gpu_every_gpu_used(cluster4: Cluster, tmp_path: Path) -> None:
    # 15520 MiB free per GPU and 7000 MiB per job: exactly two jobs fit on a GPU.  Each job really
    # holds its memory (gpu_hold registers with the simulated nvidia-smi), so the re-probes see
    # our own processes and must count each job once.
    line = (
        'start=$(date +%s.%N); gpu_hold --mb 7000 --seconds 0.6; '
        'echo "$(hostname) $CUDA_VISIBLE_DEVICES $start $(date +%s.%N)"'
    )
    (tmp_path / "gpus.sh").write_text((line + "\n") * 40)
    result = run_batch(
        tmp_path, "gpus.sh", *machines(cluster4), "--gpu-memory-required", "7000",
        "--no-reserve-gpu", "--memory-required", "100", "--num-cpus", "0.1",
        "--probe-interval", "0.5",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    records = _intervals(tmp_path / "job_results", 40)
    per_gpu: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for host, gpus, start, end in records:
        assert re.fullmatch(r"[01]", gpus), gpus
        per_gpu[(host, gpus)].append((start, end))
    assert len(per_gpu) == 8, sorted(per_gpu)  # every GPU of the 4 hosts was used
    for key, spans in per_gpu.items():
        events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
        level = peak = 0
        for _, step in events:
            level += step
            peak = max(peak, level)
        assert peak <= 2, f"{key}: {peak} jobs shared the GPU at once"
    assert max(len(s) for s in per_gpu.values()) >= 3  # GPUs were reused as jobs ended


def test_other_users_processes_keep_jobs_off_their_gpus(cluster4: Cluster, tmp_path: Path) -> None:
    """Another user holds both GPUs of h1: the batch says it is waiting for room instead of
    starting anything.  Then GPU 0 is freed, and later GPU 1: no job may start on a GPU before
    it was freed.  Each job records, as it starts, which frees it can see (marker files the
    test writes into the home just before releasing a hold): its own view, not a clock."""
    h1 = cluster4.hosts[0]
    holds = [h1.hold_gpu(gpu, 15000, util=100) for gpu in (0, 1)]
    line = 'echo $CUDA_VISIBLE_DEVICES; for f in freed0 freed1; do [ ! -e ~/$f ] || echo $f; done; sleep 0.5'
    (tmp_path / "gpus.sh").write_text((line + "\n") * 16)
    batch = LiveBatch(
        tmp_path, "gpus.sh", *machines(cluster4, 1), "--gpu-memory-required", "4000",
        "--memory-required", "100", "--num-cpus", "0.1", "--probe-interval", "0.5",
    )
    try:
        (waiting,) = batch.wait_for("waiting: ", stderr=True)
        assert "GPUs 0:520/16000 MiB (other users) 1:520/16000 MiB (other users)" in waiting, waiting
        assert not any(line.startswith("started:") for line in batch.out)
        for gpu, progress in ((0, 0), (1, 3)):
            if progress:
                batch.wait_for("finished:", progress)
            (h1.home / f"freed{gpu}").write_text("")
            holds[gpu].release()
        assert batch.finish() == 0, batch.text()
    finally:
        for hold in holds:
            hold.release()
        batch.finish()
    seen = [(tmp_path / "job_results" / f"gpus.sh.{n}.out").read_text().split() for n in range(1, 17)]
    for device, *freed in seen:
        assert f"freed{device}" in freed, f"a job started on GPU {device} while another user held it: {seen}"
    assert {device for device, *_ in seen} == {"0", "1"}, seen  # both used once free


def test_inputs_reach_each_host_once_and_not_again(cluster4: Cluster, tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for i in range(20):
        (work / "data" / f"part{i:02}.bin").write_bytes(os.urandom(1024 * 1024))
    (work / "batch.sh").write_text(
        "".join(f"cat data/*.bin | wc -c > size.txt; head -c 1000 data/part{i % 20:02}.bin > mine.bin\n" for i in range(100))
    )
    for host in cluster4.hosts:
        subprocess.run(["rm", "-rf", str(host.home / ".ssh_scheduler" / "cache")], check=True)
    args = ["batch.sh", *machines(cluster4), "--no-gpu-required", "--memory-required", "50", "--num-cpus", "0.1"]
    first = run_batch(work, *args)
    assert first.returncode == 0, first.stdout + first.stderr
    sent = int(re.search(r"sent (\d+) bytes", first.stderr).group(1))  # type: ignore[union-attr]
    twenty_mb = 20 * 1024 * 1024
    assert sent <= 1.1 * 4 * twenty_mb
    on_disk = 0
    for host in cluster4.hosts:
        cache = host.home / ".ssh_scheduler" / "cache"
        on_disk += sum(p.stat().st_size for p in cache.iterdir())
    assert twenty_mb * 4 <= on_disk <= 1.1 * 4 * twenty_mb + 4 * 64 * 1024
    # Results hold what the job made, not the untouched inputs.
    result_dir = work / "job_results" / "batch.sh.7"
    assert sorted(p.name for p in result_dir.iterdir()) == ["mine.bin", "size.txt"]
    assert (result_dir / "size.txt").read_text().strip() == str(twenty_mb)
    # Remote job directories are removed once their results are home.
    journal = (work / "job_results" / ".journal.jsonl").read_text()
    token = re.search(r'"state":"batch","token":"([0-9a-f]+)"', journal).group(1)  # type: ignore[union-attr]
    for host in cluster4.hosts:
        assert list((host.home / ".ssh_scheduler" / "jobs").glob(f"{token}-*")) == []

    again = run_batch(work, *args, "--results-dir", "job_results_2")
    assert again.returncode == 0, again.stdout + again.stderr
    resent = int(re.search(r"sent (\d+) bytes", again.stderr).group(1))  # type: ignore[union-attr]
    assert resent < 1024 * 1024


def test_unsatisfiable_job_is_an_error_before_anything_runs(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("touch ran\n")
    result = run_batch(tmp_path, "b.sh", *machines(cluster4, 2), "--gpu-memory-required", "90000")
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: job b.sh.1")
    assert "h1" in error[0] or "h2" in error[0]
    assert "started:" not in result.stdout
    assert not (tmp_path / "job_results" / "b.sh.1").exists()


def test_dry_run_prints_the_plan_and_runs_nothing(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("touch ran\n" * 6)
    result = run_batch(tmp_path, "b.sh", *machines(cluster4, 2), "--dry-run")
    assert result.returncode == 0, result.stderr
    plan = [line for line in result.stdout.splitlines() if line.startswith("plan: ")]
    assert len(plan) == 6
    assert {line.split()[3] for line in plan} == {"h1", "h2"}
    assert not (tmp_path / "job_results").exists()


def test_no_machines_runs_here_without_ssh(tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text('echo "hello $CUDA_VISIBLE_DEVICES." > made.txt; cat made.txt\n')
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home"))
    result = subprocess.run(
        [*EXECUTE_BATCH, "b.sh", "--no-gpu-required", "--num-cpus", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "job_results" / "b.sh.1.out").read_text() == "hello .\n"
    assert (tmp_path / "job_results" / "b.sh.1" / "made.txt").read_text() == "hello .\n"


@pytest.mark.parametrize("form", ["several", "repeated"])
def test_machines_flag_takes_several_values_or_repeats(cluster4: Cluster, tmp_path: Path, form: str) -> None:
    (tmp_path / "b.sh").write_text("hostname\n" * 4)
    files = [str(p) for p in cluster4.machine_files[:2]]
    flags = ["--machines", *files] if form == "several" else ["--machines", files[0], "--machines", files[1]]
    result = run_batch(tmp_path, "b.sh", *flags, "--no-gpu-required", "--num-cpus", "0")
    assert result.returncode == 0, result.stderr
    assert "'h1'" in result.stdout.splitlines()[0] or "h1.yaml" in result.stdout.splitlines()[0]


def test_commands_mode_lines_carry_their_own_copies_and_names(cluster4: Cluster, tmp_path: Path) -> None:
    for name in ("example1", "example2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "input.txt").write_text(f"data of {name}\n")
    (tmp_path / "test.py").write_text(
        "import sys, pathlib\n"
        "name = sys.argv[1]\n"
        "text = pathlib.Path(name, 'input.txt').read_text()\n"
        "pathlib.Path(name, 'output.txt').write_text(text.upper())\n"
        "print(sorted(p.name for p in pathlib.Path('.').iterdir()))\n"
    )
    (tmp_path / "cmds.sh").write_text(
        "execute_remote --copy-forwards example1 test.py --copy-backwards example1 --job-name example1 'python3 test.py example1'\n"
        "execute_remote --copy-forwards example2 test.py --copy-backwards example2 --job-name example2 'python3 test.py example2'\n"
    )
    result = run_batch(tmp_path, "cmds.sh", "--commands", *machines(cluster4, 2), "--no-gpu-required")
    assert result.returncode == 0, result.stdout + result.stderr
    results = tmp_path / "job_results"
    for name in ("example1", "example2"):
        assert (results / f"{name}.out").read_text() == f"['{name}', 'test.py']\n"
        assert (results / name / name / "output.txt").read_text() == f"DATA OF {name.upper()}\n"
        assert sorted(p.name for p in (results / name).iterdir()) == [name]


def test_a_host_down_at_the_start_is_used_once_it_answers(cluster4: Cluster, tmp_path: Path) -> None:
    late = cluster4.hosts[1]
    late.stop_sshd()
    (tmp_path / "b.sh").write_text("sleep 1; hostname\n" * 40)
    batch = LiveBatch(tmp_path, "b.sh", *machines(cluster4, 2), "--no-gpu-required", "--num-cpus", "1")
    try:
        batch.wait_for("warning: h2", stderr=True)  # seen down at the start...
        batch.wait_for("started:")  # ...while the batch went on without it
        late.start_sshd()
        batch.wait_for("host h2 is back", stderr=True)
        assert batch.finish() == 0, batch.text()
    finally:
        late.start_sshd()
        batch.finish()
    where = Counter((tmp_path / "job_results" / f"b.sh.{n}.out").read_text().strip() for n in range(1, 41))
    assert where["h2"] > 0 and where["h1"] > 0


@pytest.mark.namespaces
def test_a_host_whose_probe_hangs_or_lies_is_set_aside_with_a_reason(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.cluster import GpuSpec, HostSpec

    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16000)]) for _ in range(3)])
    garbage, hanging = cluster.hosts[1], cluster.hosts[2]
    # Each fake nvidia-smi leaves a mark in its host's home, so the test knows it was asked.
    (garbage.dir / "bin" / "nvidia-smi").write_text("#!/bin/sh\ntouch ~/asked\necho 'this is not csv, at all'\n")
    # An nvidia-smi that never answers (a wedged driver): the probe gives up on it after its timeout.
    (hanging.dir / "bin" / "nvidia-smi").write_text("#!/bin/sh\ntouch ~/asked\nexec sleep 1000\n")
    (tmp_path / "b.sh").write_text("hostname\n" * 6)
    result = run_batch(tmp_path, "b.sh", *machines(cluster), "--gpu-memory-required", "1000", "--no-reserve-gpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (garbage.home / "asked").exists() and (hanging.home / "asked").exists()
    # The probe's own timeout (10 s, then KILL 5 s later) ends the hung nvidia-smi, even one a
    # re-probe started just before the batch ended.
    wait_until(lambda: not any("sleep 1000" in p for p in batch_processes(hanging)), "the hung nvidia-smi ends", 40)
    where = {(tmp_path / "job_results" / f"b.sh.{n}.out").read_text().strip() for n in range(1, 7)}
    assert where == {"h1"}  # only the host whose GPUs could be read takes GPU jobs
    header = result.stdout.splitlines()[1]
    assert header.startswith("machine gpu choices: [[0]")
