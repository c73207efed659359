"""A retried attempt on the same host stays the coordinator's to kill (SSH test cluster).

The failed attempt's task still removes its folder when the retry is placed under the same job
name; that task's end must not drop the retry's task and run, or ``--timeout``, ``cancel`` and
stop would find nothing to kill.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.cluster import Cluster
from tests.live_batch import journal, machines, run_batch

NO_GPU = ["--no-gpu-required", "--memory-required", "100"]


def test_a_retry_on_the_same_host_is_killed_at_its_timeout(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[0]
    marker = host.home / "first-attempt-failed"
    marker.unlink(missing_ok=True)
    # The first attempt fails; the second outlives --timeout and says so if nothing kills it.
    (tmp_path / "b.sh").write_text(
        'test -e "$HOME/first-attempt-failed" || { touch "$HOME/first-attempt-failed"; exit 5; }; '
        "sleep 20; echo survived\n"
    )
    try:
        result = run_batch(tmp_path, "b.sh", *machines(cluster4, 1), *NO_GPU, "--retries", "1", "--timeout", "2")
        assert marker.exists()  # the first attempt really failed there
    finally:
        marker.unlink(missing_ok=True)
    states = Counter(str(e["state"]) for e in journal(tmp_path / "job_results") if e["job"] == "b.sh.1")
    assert states["retry"] == 1 and states["started"] == 2, states
    assert result.returncode == 1, result.stdout + result.stderr
    assert "timed out after 2 s" in result.stdout
    out = tmp_path / "job_results" / "b.sh.1.out"
    assert not out.exists() or "survived" not in out.read_text()
