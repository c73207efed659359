"""A GPU another user frees is used soon, on the SSH test cluster through the real CLI: the
planner looks again at a host whose GPUs others hold while a job waits for one, backing off,
instead of waiting for the periodic probe (planner/probe_schedule.py).  Probes are counted,
never timed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.cluster import Cluster, GpuSpec, HostSpec
from tests.live_batch import LiveBatch, machines, wait_until
from tests.probe_counter import count_probes, probes


def test_a_gpu_another_user_frees_is_seen_by_the_next_looks_not_the_periodic_probe(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16000)])])
    host = cluster.hosts[0]
    count_probes(host)
    hold = host.hold_gpu(0, 15000, util=100)
    (tmp_path / "gpu.sh").write_text("[ -e ~/freed ] && echo freed-first\n")
    # The periodic probe is an hour away: only the rule for held GPUs can look again.
    batch = LiveBatch(
        tmp_path, "gpu.sh", *machines(cluster), "--gpu-memory-required", "4000",
        "--memory-required", "100", "--num-cpus", "0.1", "--probe-interval", "3600",
    )
    try:
        batch.wait_for("waiting: ", stderr=True)
        # The host is looked at again and again while the other user holds its GPU.
        wait_until(lambda: probes(host) >= 4, "four probes while the GPU is held")
        assert not any(line.startswith("started:") for line in batch.out)
        looked = probes(host)
        (host.home / "freed").write_text("")
        hold.release()
        assert batch.finish() == 0, batch.text()
    finally:
        hold.release()
        if batch.proc.poll() is None:  # a failure above: the batch would wait for an hour
            batch.kill()
    assert (tmp_path / "job_results" / "gpu.sh.1.out").read_text() == "freed-first\n"
    assert probes(host) > looked  # a later look saw it free, an hour before the periodic one
