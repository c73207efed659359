"""A detached batch on the SSH test cluster: attach from another process sees it, and
``cancel --all`` kills its jobs on the hosts (checked on the hosts) and cleans them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "ssh_scheduler"]
NO_GPU = ["--no-gpu-required", "--memory-required", "100"]
MARK = "sleep 3131"  # one job command no other test runs: found on a host by pgrep -f


def cli(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=timeout
    )


def job_processes(cluster: Cluster, count: int) -> dict[str, list[str]]:
    found = {}
    for host in cluster.hosts[:count]:
        listed = host.run(f"pgrep -f '^{MARK}$' || true", user=host.user)
        found[host.name] = listed.stdout.split()
    return found


def wait_for(check: object, limit: float = 60) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if callable(check) and check():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_cancel_all_kills_a_detached_batch_s_jobs_on_the_hosts(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text(f"{MARK}\n" * 4 + "echo never\n")
    machines = ["--machines", *(str(p) for p in cluster4.machine_files[:2])]
    started = cli(tmp_path, "execute_batch", "b.sh", "--detach", *machines, *NO_GPU, "--num-cpus", "2")
    assert started.returncode == 0, started.stderr
    assert "detached: the batch runs on in the background" in started.stderr
    assert wait_for(lambda: sum(len(p) for p in job_processes(cluster4, 2).values()) == 4)  # 2 per host
    state = json.loads(cli(tmp_path, "status", "--json").stdout)
    assert state["coordinator"] == "running" and state["counts"]["running"] == 4

    records = [json.loads(x) for x in (tmp_path / "job_results" / ".events.jsonl").read_text().splitlines()]
    token = next(r["token"] for r in records if r["event"] == "batch_started")
    assert [len(list((h.workdir / "jobs").glob(f"{token}-*"))) for h in cluster4.hosts[:2]] == [2, 2]

    stopped = cli(tmp_path, "cancel", "--all")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines()[-1] == "stopped"  # the coordinator has ended
    assert job_processes(cluster4, 2) == {h.name: [] for h in cluster4.hosts[:2]}  # killed, not orphaned
    for host in cluster4.hosts[:2]:
        assert list((host.workdir / "jobs").glob(f"{token}-*")) == []  # the job folders were cleaned

    attached = cli(tmp_path, "attach")
    assert attached.returncode == 130
    assert attached.stdout.count("started: b.sh.") == 4 and "echo never" not in attached.stdout
    assert attached.stderr.splitlines()[-1] == "cancelled: running jobs were killed"
    journal = [json.loads(x) for x in (tmp_path / "job_results" / ".journal.jsonl").read_text().splitlines()]
    assert sorted(e["job"] for e in journal if e["state"] == "cancelled") == [f"b.sh.{n}" for n in range(1, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["batch", "sweep"])
def test_ctrl_c_before_the_batch_is_under_way_stops_the_coordinator_too(cluster4: Cluster, tmp_path: Path, what: str) -> None:
    # One Ctrl-C: the parent passes it on as one signal, and nothing runs yet, so a drain would end
    # the batch as "done" (a coordinator that took it as a Ctrl-C did so, and reported success).
    (tmp_path / "b.sh").write_text(f"{MARK}\n")
    (tmp_path / "sweep.yaml").write_text(f"template:\n  train: {MARK}\n---\nlr: [1]\n")
    batch, folder = (["b.sh"], tmp_path / "job_results") if what == "batch" else (["--sweep", "sweep.yaml"], tmp_path / "job_results" / ".jobs")
    cluster4.hosts[1].freeze()  # its sshd never answers: the start waits on it
    machines = ["--machines", *(str(p) for p in cluster4.machine_files[:2])]
    parent = subprocess.Popen(
        [*CLI, "execute_batch", *batch, "--detach", *machines, *NO_GPU], cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )

    def coordinators() -> list[int]:
        return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != parent.pid and _cwd(p) == tmp_path]

    lock = folder / ".lock"
    # The coordinator holds the results folder (so it runs the batch) and waits on the host.
    assert wait_for(lambda: lock.is_file() and lock.read_text().strip() != "")
    child = int(json.loads(lock.read_text())["pid"])
    assert child in coordinators()
    parent.send_signal(signal.SIGINT)
    _out, err = parent.communicate(timeout=60)
    assert parent.returncode == 130, err
    assert "cancelled: running jobs were killed" in err
    assert wait_for(lambda: not coordinators(), 30), coordinators()
    assert not Path(f"/proc/{child}").exists()
    assert job_processes(cluster4, 1) == {cluster4.hosts[0].name: []}
    if what == "batch":
        assert not (tmp_path / "job_results").exists()  # made by that run, and left empty
    else:  # the sweep laid its combinations out first; no job of it started (the journal, when
        # the coordinator got as far as making it, is empty)
        journal = folder / ".journal.jsonl"
        assert not journal.exists() or journal.read_text() == ""
        assert not (folder / "default.train").exists()


def _cwd(proc: Path) -> Path | None:
    try:
        return Path(os.readlink(proc / "cwd"))
    except OSError:
        return None
