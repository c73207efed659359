"""A job that rewrites a staged input in place (issue 23, item 8): staged inputs are hard links
into the host's content-addressed cache, so a job that writes through one (after a chmod, or as
root) changes the entry every later job would be linked to.  It must neither reach a later job
nor cost the host: the spoiled entry is removed (when the job's results are listed, or at the
next staging that finds it changed), sent again, and the next job staged afresh."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.live_batch import journal, run_batch

pytestmark = pytest.mark.namespaces


@pytest.mark.parametrize("copy_back", [(), ("--copy-backwards", "result.txt")], ids=["listed", "named"])
def test_a_job_that_rewrites_a_staged_input_spoils_nothing(
    cluster4: Cluster, tmp_path: Path, copy_back: tuple[str, ...]
) -> None:
    host = cluster4["h3"]
    (tmp_path / "in.txt").write_text("good\n")
    # One job at a time (each needs every CPU): the second is staged after the first wrote.
    (tmp_path / "b.sh").write_text(
        "chmod u+w in.txt && echo spoiled > in.txt && echo done > result.txt\ncat in.txt > result.txt\n"
    )
    machines = ["--machines", str(host.machine_file), "--no-gpu-required", "--memory-required", "100",
                "--num-cpus", str(host.spec.cpus)]  # fmt: skip
    done = run_batch(tmp_path, "b.sh", *machines, *copy_back)
    results = tmp_path / "job_results"
    assert done.returncode == 0, done.stdout + done.stderr
    assert (results / "b.sh.2" / "result.txt").read_text() == "good\n"
    assert "lost" not in done.stderr and "host h3" not in done.stderr, done.stderr
    assert {e["state"] for e in journal(results) if e.get("job")} <= {"placed", "started", "finished"}
    # Nothing in the host's cache holds what the first job wrote.
    assert host.run(f"grep -rlx spoiled {host.workdir}/cache", user=host.user).stdout == ""
