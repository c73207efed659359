"""The test Slurm itself (tests/slurm_cluster.py): a GPU array submitted over SSH on the login node."""

from __future__ import annotations

import os
import re
import time

from tests.conftest_slurm import SlurmSite


def test_gpu_array_over_ssh_gets_one_gpu_per_task(slurm: SlurmSite) -> None:
    login = slurm.login
    # every task holds its GPU until all 8 have started, so all 8 run at once on 4 nodes x 2 GPUs
    script = (
        "echo $SLURM_ARRAY_TASK_ID $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES > gpu-$SLURM_ARRAY_TASK_ID.txt; "
        "n=0; while [ $(ls gpu-*.txt | wc -l) -lt 8 ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done"
    )
    login.ssh("rm -rf smoke && mkdir smoke", timeout=30)
    sub = login.ssh(
        f"cd smoke && sbatch --parsable --array=1-8 --gres=gpu:1 -o /dev/null --wrap '{script}'"
    )
    assert sub.returncode == 0, sub.stderr
    array = sub.stdout.strip()
    assert re.fullmatch(r"\d+", array)
    deadline = time.monotonic() + 120
    while not _ended(slurm, array):
        assert time.monotonic() < deadline, slurm.slurm.logs()
        time.sleep(0.2)
    # the files were written by slurmd (root namespace) as the login user, in the shared home
    smoke = login.home / "smoke"
    rows = [(smoke / f"gpu-{i}.txt").read_text().split() for i in range(1, 9)]
    assert all(os.stat(smoke / f"gpu-{i}.txt").st_uid == login.uid for i in range(1, 9))
    assert sorted(int(r[0]) for r in rows) == list(range(1, 9))
    assert all(r[2] in ("0", "1") for r in rows), rows
    # eight tasks at once on 8 GPUs: no two share a node's GPU
    assert len({(r[1], r[2]) for r in rows}) == 8, rows
    states = {j["JobState"] for j in slurm.slurm.jobs() if j.get("ArrayJobId") == array}
    assert states == {"COMPLETED"}


def _ended(slurm: SlurmSite, array: str) -> bool:
    tasks = [j for j in slurm.slurm.jobs() if j.get("ArrayJobId") == array]
    return len(tasks) == 8 and all(
        j["JobState"] not in ("PENDING", "RUNNING", "COMPLETING") for j in tasks
    )
