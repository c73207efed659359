"""Faults on the SSH test cluster (issue 5): lost hosts, a killed coordinator, Ctrl-C.

Slow by nature (they wait for detection and leases), marked ``slow``; CI runs them."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.cluster import Cluster, Host, HostSpec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXECUTE_BATCH = [sys.executable, "-m", "ssh_scheduler", "execute_batch"]


def start_batch(cwd: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [*EXECUTE_BATCH, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )


def run_batch(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*EXECUTE_BATCH, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def wait_for_lines(proc: subprocess.Popen[str], prefix: str, count: int, timeout: float = 60) -> list[str]:
    """Read stdout until ``count`` lines start with ``prefix``."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while len([s for s in seen if s.startswith(prefix)]) < count:
        assert time.monotonic() < deadline, f"timed out waiting for {prefix!r}: {seen}"
        line = proc.stdout.readline()
        assert line, f"batch ended early: {seen}"
        seen.append(line)
    return seen


def journal(results: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (results / ".journal.jsonl").read_text().splitlines() if line.strip()]


def batch_processes(host: Host) -> list[str]:
    """Processes of the host's login user (our agent and jobs), seen inside the host."""
    out = host.run(f"ps -u {host.user} -o pid=,args=").stdout
    return [line for line in out.splitlines() if line.strip() and "ps -u" not in line]


def machines(cluster: Cluster, count: int | None = None) -> list[str]:
    return ["--machines", *(str(p) for p in cluster.machine_files[:count])]


NO_GPU = ["--no-gpu-required", "--memory-required", "100"]


def test_crashed_host_jobs_complete_exactly_once_elsewhere(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text('sleep 1; hostname > where.txt\n' * 60)
    proc = start_batch(tmp_path, "b.sh", *machines(cluster4), *NO_GPU, "--num-cpus", "1")
    wait_for_lines(proc, "started:", 12)
    crashed = cluster4.hosts[1]
    crashed.crash()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    assert "requeued:" in out
    results = tmp_path / "job_results"
    finished = Counter(e["job"] for e in journal(results) if e["state"] == "finished")
    assert sorted(finished) == sorted(f"b.sh.{n}" for n in range(1, 61))
    assert set(finished.values()) == {1}
    requeued = {e["job"] for e in journal(results) if e["state"] == "requeued"}
    assert requeued
    for name in requeued:
        assert (results / str(name) / "where.txt").read_text().strip() != crashed.name


def test_cut_network_requeues_and_leaves_nothing_behind(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text('sleep 2; hostname > where.txt\n' * 40)
    proc = start_batch(
        tmp_path, "b.sh", *machines(cluster4), *NO_GPU, "--num-cpus", "1",
        "--keepalive", "1", "--lease", "6",
    )
    wait_for_lines(proc, "started:", 12)
    cut = cluster4.hosts[2]
    cut.cut_network()
    lines = wait_for_lines(proc, "requeued:", 1, timeout=30)
    assert any(cut.name in line for line in lines if line.startswith("requeued:"))
    time.sleep(1)
    cut.heal_network()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    results = tmp_path / "job_results"
    finished = Counter(e["job"] for e in journal(results) if e["state"] == "finished")
    assert len(finished) == 40 and set(finished.values()) == {1}
    # Whatever still ran on the host when it was cut off is gone once its lease ran out.
    deadline = time.monotonic() + 15
    while batch_processes(cut) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert batch_processes(cut) == []
    token = next(e["token"] for e in journal(results) if e["state"] == "batch")
    assert list((cut.home / ".ssh_scheduler" / "jobs").glob(f"{token}-*")) == []


def test_killed_coordinator_rerun_until_done(cluster4: Cluster, tmp_path: Path) -> None:
    rng = random.Random(20261126)
    count = 24
    (tmp_path / "b.sh").write_text(
        "".join(f"sleep 0.{n % 5 + 2}; echo job{n} > result.txt; echo out{n}\n" for n in range(1, count + 1))
    )
    args = ["b.sh", *machines(cluster4, 2), *NO_GPU, "--num-cpus", "1", "--lease", "30"]
    results = tmp_path / "job_results"

    def check_no_partial_results() -> None:
        for entry in results.iterdir() if results.exists() else ():
            if entry.is_dir() and not entry.name.startswith("."):
                n = int(entry.name.rsplit(".", 1)[1])
                assert (entry / "result.txt").read_text() == f"job{n}\n", entry

    for _ in range(20):
        proc = start_batch(tmp_path, *args)
        time.sleep(rng.uniform(0.3, 2.5))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        check_no_partial_results()
    final = run_batch(tmp_path, *args)
    assert final.returncode == 0, final.stdout + final.stderr
    check_no_partial_results()
    for n in range(1, count + 1):
        assert (results / f"b.sh.{n}" / "result.txt").read_text() == f"job{n}\n"
        assert (results / f"b.sh.{n}.out").read_text().endswith(f"out{n}\n")
    finished = Counter(e["job"] for e in journal(results) if e["state"] == "finished")
    assert all(c == 1 for c in finished.values()), finished
    assert not list(results.glob(".partial-*"))


def test_second_ctrl_c_kills_everything_including_grandchildren(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("(sleep 300 &); setsid sleep 301 & sleep 302\n" * 4)
    proc = start_batch(tmp_path, "b.sh", *machines(cluster4, 2), *NO_GPU, "--num-cpus", "1")
    wait_for_lines(proc, "started:", 4)
    time.sleep(0.5)
    hosts = cluster4.hosts[:2]
    assert any("sleep 301" in p for h in hosts for p in batch_processes(h))
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "stopping" in err and "killing" in err
    entries = journal(tmp_path / "job_results")
    token = next(e["token"] for e in entries if e["state"] == "batch")
    for host in hosts:
        deadline = time.monotonic() + 10
        while batch_processes(host) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert batch_processes(host) == [], host.name
        jobs_dir = host.home / ".ssh_scheduler" / "jobs"
        leftovers = sorted(p.name for p in jobs_dir.glob(f"{token}-*"))
        assert leftovers == [], (host.name, leftovers)
    assert {e["job"] for e in entries if e["state"] == "cancelled"} == {f"b.sh.{n}" for n in range(1, 5)}


def test_first_ctrl_c_drains(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("sleep 1.5; echo done\n" * 12)
    proc = start_batch(tmp_path, "b.sh", *machines(cluster4, 1), *NO_GPU, "--num-cpus", "1")
    wait_for_lines(proc, "started:", 1)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "stopping: no new jobs will start" in err
    entries = journal(tmp_path / "job_results")
    begun = {e["job"] for e in entries if e["state"] == "started"}
    ended = {e["job"] for e in entries if e["state"] == "finished"}
    assert 1 <= len(begun) < 12 and ended == begun  # the running ones finished, no new ones
    assert "not run" in err
    assert proc.returncode == 1  # not every job ran


def test_max_sessions_two_with_twenty_concurrent_jobs(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster([HostSpec(cpus=16, max_sessions=2)])
    (tmp_path / "b.sh").write_text("sleep 1; echo ok\n" * 20)
    started = time.monotonic()
    result = run_batch(tmp_path, "b.sh", *machines(cluster), *NO_GPU, "--num-cpus", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("finished:") == 20
    assert time.monotonic() - started < 15  # they ran side by side, not one after another


def test_timeout_kills_the_job_and_reports_it(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("sleep 30 & sleep 31\necho quick\n")
    result = run_batch(tmp_path, "b.sh", *machines(cluster4, 1), *NO_GPU, "--timeout", "1.5")
    assert result.returncode == 1
    assert "failed: b.sh.1; sleep 30 & sleep 31  (timed out after 1.5 s on h1)" in result.stdout
    assert "finished: b.sh.2; echo quick" in result.stdout
    assert not any("sleep 3" in p for p in batch_processes(cluster4.hosts[0]))


def test_retries_prefer_another_host_and_halt_stops(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text('test "$(hostname)" != h1 || exit 7; echo ok\n' * 2)
    result = run_batch(tmp_path, "b.sh", *machines(cluster4, 2), *NO_GPU, "--retries", "1", "--num-cpus", "3")
    assert result.returncode == 0, result.stdout + result.stderr

    (tmp_path / "h.sh").write_text("exit 1\n" * 10)
    halted = run_batch(tmp_path, "h.sh", *machines(cluster4, 1), *NO_GPU, "--num-cpus", "4", "--halt", "soon,fail=2")
    assert halted.returncode == 1
    assert "halting: 2 jobs failed" in halted.stderr
    assert halted.stdout.count("failed:") < 10


def test_rerun_refuses_a_changed_command_and_retries_failed_on_request(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("echo one\nexit 3\n")
    args = ["b.sh", *machines(cluster4, 1), *NO_GPU]
    assert run_batch(tmp_path, *args).returncode == 1
    (tmp_path / "b.sh").write_text("echo one\necho fixed\n")
    refused = run_batch(tmp_path, *args, "--retry-failed")
    assert refused.returncode == 2 and "changed since" in refused.stderr
    fixed = run_batch(tmp_path, *args, "--retry-failed", "--allow-changed")
    assert fixed.returncode == 0, fixed.stderr
    results = tmp_path / "job_results"
    assert (results / "b.sh.2.out").read_text() == "fixed\n"
    assert (results / ".failed" / "b.sh.2.1" / "b.sh.2").is_dir()
