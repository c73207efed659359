"""A running job that frees its GPU memory in the middle of a probe hides no other user's memory,
on the SSH test cluster through the real CLI.  Another user holds memory that the process list
does not show (another container's); our jobs reserve more than they hold, hold it a while, free
it and live on.  A probe whose first process list still showed a job's memory while
``memory.used`` no longer counted it took that memory off the other user's share; the probe lists
the processes again after reading the memory (machines/probe.listed_throughout), and the next
job waits.  The gap between a probe's calls is widened so the race is there to be lost; probes
are counted, never timed."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tests.cluster import GpuSpec, HostSpec
from tests.probe_counter import alone_probes, count_probes, ordered_pairs
from tests.test_batch_cluster import machines, run_batch
from tests.test_overcommit_cluster import peak_overlap


def test_a_job_freeing_its_memory_mid_probe_leaves_the_other_users_memory_counted(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16384)]) for _ in range(3)])
    # 15904 MiB per GPU, 6500 of them held by another user whom the process list leaves out:
    # with a job's 7000 MiB reserved, 2404 MiB are left, never enough for a second job.
    holds = []
    for host in cluster.hosts:
        holds.append(host.hold_gpu(0, 6500, util=0))
        count_probes(host, hide_pids=(holds[-1].pid,), widen_s=0.8, mark_listed=True)
    # Each job holds 6500 MiB until a probe's first process list has shown it, frees it at once
    # (0.8 s before that probe reads the memory) and lives on 2 s (its GPU process is gone, a
    # zombie of `sleep`; the job's pid lives): every job loses the race, on every host.
    line = (
        "start=$(date +%s.%N); sh -c 'gpu_hold --mb 6500 --seconds 120 & h=$!; "
        "while [ ! -e ~/listed.$h ]; do sleep 0.05; done; kill $h; exec sleep 2'; "
        'echo "$(hostname) $start $(date +%s.%N)"'
    )
    (tmp_path / "gpus.sh").write_text((line + "\n") * 12)
    try:
        result = run_batch(
            tmp_path, "gpus.sh", *machines(cluster), "--gpu-memory-required", "7000",
            "--no-reserve-gpu", "--gpu-utilization", "0.3", "--num-cpus", "0.1",
            "--memory-required", "100", "--probe-interval", "0.2", timeout=240,
        )
    finally:
        for hold in holds:
            hold.release()
    assert result.returncode == 0, result.stdout + result.stderr
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for n in range(1, 13):
        host, start, end = (tmp_path / "job_results" / f"gpus.sh.{n}.out").read_text().split()
        spans[host].append((float(start), float(end)))
    # One job at a time on each GPU: the other user's 6500 MiB stayed counted all along.
    peaks = {host: peak_overlap(runs) for host, runs in spans.items()}
    assert sorted(peaks.values()) == [1, 1, 1], peaks
    # The race was there to be lost: a probe's first list showed a job's process that its
    # second list, after the memory was read, no longer did.
    freed_mid_probe = 0
    for host in cluster.hosts:
        for first, second in ordered_pairs(host):
            freed_mid_probe += any(line not in second for line in first)
    assert freed_mid_probe >= 6, freed_mid_probe
    # Each host's first probe came before any job of ours ran there: it ran alone, one list.
    assert all(alone_probes(host) >= 1 for host in cluster.hosts), [alone_probes(host) for host in cluster.hosts]
