"""The one per-job pipeline, seen from the commands that use it (issue 10's acceptance): execute_remote
gets what a batch job gets, and a --commands batch places each line by its own needs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.cluster import Cluster
from tests.test_batch_cluster import machines, run_batch
from tests.test_remote_cluster import EXECUTE_REMOTE, env, remote


def jobs_folder(host) -> Path:  # type: ignore[no-untyped-def]
    return Path(host.workdir) / "jobs"


def test_execute_remote_sets_the_batch_environment(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[0]
    result = remote(
        tmp_path, host.machine_file, "--gpus", "1", "--job-name", "envjob",
        'echo "$CUDA_VISIBLE_DEVICES|$CUDA_DEVICE_ORDER|$SSH_SCHEDULER_JOB"',
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1|PCI_BUS_ID|envjob\n"


def test_execute_remote_timeout_kills_the_whole_tree(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[1]
    marker = f"pipeline-timeout-{os.getpid()}"
    result = remote(
        tmp_path, host.machine_file, "--timeout", "1", "--job-name", "slow",
        f"(sleep 300 && echo {marker}) & sleep 300",
    )
    assert result.returncode == 124, (result.returncode, result.stderr)
    left = host.run(f"pgrep -f 'sleep 300' -u {host.user} || true")
    assert left.stdout.strip() == "", left.stdout  # nothing of the job survived its timeout
    assert not any(jobs_folder(host).glob("*-slow*")), list(jobs_folder(host).iterdir())


def test_execute_remote_keeps_output_on_the_host_while_it_runs_and_cleans_up_on_cancel(
    cluster4: Cluster, tmp_path: Path
) -> None:
    host = cluster4.hosts[2]
    proc = subprocess.Popen(
        [*EXECUTE_REMOTE, "--machine", str(host.machine_file), "--job-name", "kept", "echo early; sleep 300"],
        cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "early\n"
        # While it runs, the host keeps the job's output next to its folder (as for batch jobs, so
        # a coordinator that reattaches can catch up).  The agent sends output home first and then
        # writes the host's copy (CI saw the line here before the file): a bounded wait.
        deadline = time.monotonic() + 30
        kept = [p.read_text() for p in jobs_folder(host).glob("*-kept.out")]
        while kept != ["early\n"] and time.monotonic() < deadline:
            time.sleep(0.05)
            kept = [p.read_text() for p in jobs_folder(host).glob("*-kept.out")]
        assert kept == ["early\n"]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    deadline = time.monotonic() + 30  # a safety bound only: the removal is awaited before exit
    while any(jobs_folder(host).glob("*-kept*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(jobs_folder(host).glob("*-kept*")), list(jobs_folder(host).iterdir())
    assert host.run(f"pgrep -f 'sleep 300' -u {host.user} || true").stdout.strip() == ""


def test_commands_lines_are_placed_by_their_own_needs(cluster4: Cluster, tmp_path: Path) -> None:
    # Two GPUs per host and GPU lines that reserve a GPU each: 8 GPU lines fill every GPU of the
    # 4 hosts, and the 8 CPU lines run beside them without holding one.
    report = 'echo "$(hostname) [$CUDA_VISIBLE_DEVICES] $(date +%s.%N)"; sleep 1; date +%s.%N'
    lines = [f"--job-name gpu{i} --gpus-per-job 1 --gpu-memory-required 1000 '{report}'" for i in range(8)]
    lines += [f"--job-name cpu{i} --no-gpu-required --num-cpus 0.5 '{report}'" for i in range(8)]
    lines.append("--job-name after --after gpu0 --after cpu0 --no-gpu-required 'echo done'")
    (tmp_path / "mixed.sh").write_text("\n".join(lines) + "\n")
    result = run_batch(tmp_path, "mixed.sh", "--commands", *machines(cluster4), "--memory-required", "100")
    assert result.returncode == 0, result.stdout + result.stderr
    results = tmp_path / "job_results"
    seen: dict[str, tuple[str, str, float, float]] = {}
    for name in [f"gpu{i}" for i in range(8)] + [f"cpu{i}" for i in range(8)]:
        first, end = (results / f"{name}.out").read_text().splitlines()
        host, gpus, start = first.split()
        seen[name] = (host, gpus, float(start), float(end))
    gpu_slots = {(h, g) for name, (h, g, _, _) in seen.items() if name.startswith("gpu")}
    assert all(re.fullmatch(r"\[[01]\]", g) for _, g in gpu_slots)
    assert len(gpu_slots) == 8  # one GPU each, every GPU used
    assert all(g == "[]" for name, (_, g, _, _) in seen.items() if name.startswith("cpu"))
    # CPU lines did not wait for GPU lines: some ran at the same time as them.
    gpu_spans = [(s, e) for n, (_, _, s, e) in seen.items() if n.startswith("gpu")]
    assert any(s < ge and gs < e for n, (_, _, s, e) in seen.items() if n.startswith("cpu") for gs, ge in gpu_spans)
    started = [line for line in result.stdout.splitlines() if line.startswith("started: after;")]
    assert len(started) == 1
    assert (results / "after.out").read_text() == "done\n"
