"""Faults on the SSH test cluster (issue 5): lost hosts, a killed coordinator, Ctrl-C.

Each fault is injected at a moment the batch's own progress defines (its output lines, its
journal, the folders it writes), and each test checks that the fault really happened before it
checks what the batch made of it.  Slow by nature (they wait for detection), marked ``slow``;
CI runs them."""

from __future__ import annotations

import functools
import hashlib
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.cluster import Cluster, Host, HostSpec
from tests.live_batch import LiveBatch, batch_processes, journal, machines, run_batch, wait_until

pytestmark = pytest.mark.slow

NO_GPU = ["--no-gpu-required", "--memory-required", "100"]


def states(results: Path, state: str) -> Counter[str]:
    """How many times the journal recorded ``state`` for each job."""
    return Counter(str(e["job"]) for e in journal(results) if e["state"] == state)


def batch_token(results: Path) -> str:
    return next(str(e["token"]) for e in journal(results) if e["state"] == "batch")


def leftover_job_dirs(cluster: Cluster, results: Path) -> list[str]:
    token = batch_token(results)
    return [
        f"{host.name}:{path.name}"
        for host in cluster.hosts
        for path in (host.home / ".ssh_scheduler" / "jobs").glob(f"{token}-*")
    ]


def no_batch_processes_left(*hosts: Host) -> None:
    """Nothing of ours runs on the hosts (kills take a moment to land; 30 s only stops a hung test)."""
    for host in hosts:
        wait_until(functools.partial(nothing_runs_on, host), f"nothing of ours runs on {host.name}", 30)


def nothing_runs_on(host: Host) -> bool:
    return batch_processes(host) == []


def runs_on(hosts: list[Host], command: str) -> bool:
    return any(command in p for host in hosts for p in batch_processes(host))


def test_crashed_host_jobs_complete_exactly_once_elsewhere(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("sleep 1; hostname > where.txt\n" * 60)
    batch = LiveBatch(tmp_path, "b.sh", *machines(cluster4), *NO_GPU, "--num-cpus", "1")
    crashed = cluster4.hosts[1]
    try:
        batch.wait_for("started:", 12)
        crashed.crash()
        batch.wait_for(f"warning: host {crashed.name} lost", stderr=True)
        assert batch.finish() == 0, batch.text()
    finally:
        batch.finish()
    results = tmp_path / "job_results"
    finished = states(results, "finished")
    assert sorted(finished) == sorted(f"b.sh.{n}" for n in range(1, 61))
    assert set(finished.values()) == {1}
    requeued = states(results, "requeued")
    assert requeued and all(line.endswith(f"host {crashed.name} was lost") for line in batch.out if line.startswith("requeued:"))
    for name in requeued:
        assert (results / name / "where.txt").read_text().strip() != crashed.name


def wait_for_home_file(name: str) -> str:
    """Shell: wait until ~/name exists (the test writes it from outside); at most ~2 min, then fail."""
    return f"n=0; until [ -e ~/{name} ] || [ $n -ge 1200 ]; do n=$((n+1)); sleep 0.1; done; [ -e ~/{name} ]"


def test_cut_host_comes_back_and_its_late_results_are_discarded(cluster4: Cluster, tmp_path: Path) -> None:
    """h3 is cut off while it runs jobs; they are requeued elsewhere, yet finish on h3 during the
    cut (late results).  The network heals, h3 comes back during the batch, and each job's result
    is committed once: from the run that was not cut off.  Each run writes a fresh id into its
    result and into a log in its host's home, so the test can tell the late run from the other.

    Marker files the test writes into the homes order things without a timer: the first jobs
    hold until the cut happened, the last 8 until h3 is back (so the batch cannot end first)."""
    cut = cluster4.hosts[2]
    markers = ("started.log", "done.log", "cut", "gate")
    for host in cluster4.hosts:
        for name in markers:
            (host.home / name).unlink(missing_ok=True)
    run = "id=$(cat /proc/sys/kernel/random/uuid); echo $id > run.txt; hostname > where.txt; echo {name} $id >> ~/done.log"
    lines = [
        f"echo b.sh.{n} >> ~/started.log; {wait_for_home_file('cut')} && sleep 1 && {run.format(name=f'b.sh.{n}')}"
        for n in range(1, 33)
    ]
    lines += [f"{wait_for_home_file('gate')} && {run.format(name=f'b.sh.{n}')}" for n in range(33, 41)]
    (tmp_path / "b.sh").write_text("\n".join(lines) + "\n")

    def log(name: str) -> list[str]:
        path = cut.home / name
        return path.read_text().splitlines() if path.exists() else []

    def requeued_from_cut() -> set[str]:
        return {
            line.split()[1].rstrip(";") for line in batch.out
            if line.startswith("requeued:") and line.endswith(f"host {cut.name} was lost")
        }

    def open_everywhere(marker: str) -> None:
        for host in cluster4.hosts:
            (host.home / marker).write_text("")

    batch = LiveBatch(
        tmp_path, "b.sh", *machines(cluster4), *NO_GPU, "--num-cpus", "1", "--keepalive", "1", "--lease", "60",
    )  # fmt: skip
    try:
        batch.wait_for("started:", 12)
        wait_until(lambda: log("started.log"), "jobs run on h3")  # their own word, not the printout
        cut.cut_network()
        on_cut = set(log("started.log"))  # these run on h3 now, and will to their end
        open_everywhere("cut")
        batch.wait_for(f"warning: host {cut.name} lost", stderr=True)
        wait_until(lambda: on_cut <= requeued_from_cut(), "the cut host's jobs are requeued")
        wait_until(lambda: on_cut <= {line.split()[0] for line in log("done.log")}, "the late runs end")
        late = dict(line.split() for line in log("done.log"))
        cut.heal_network()
        batch.wait_for(f"host {cut.name} is back", stderr=True)
        open_everywhere("gate")
        assert batch.finish() == 0, batch.text()
    finally:
        cut.heal_network()
        open_everywhere("cut")
        open_everywhere("gate")
        batch.finish()
    results = tmp_path / "job_results"
    finished = states(results, "finished")
    assert sorted(finished) == sorted(f"b.sh.{n}" for n in range(1, 41))
    assert set(finished.values()) == {1}  # committed once each
    for name in on_cut:
        committed = (results / name / "run.txt").read_text().strip()
        assert committed != late[name], f"{name}: the late result from {cut.name} was committed"
        assert (results / name / "where.txt").read_text().strip() != cut.name
    # Back in use, h3 dropped what it still held for us: nothing runs, no job folders remain.
    no_batch_processes_left(cut)
    assert leftover_job_dirs(cluster4, results) == []


def wait_for_file(folder: Path, pattern: str) -> Path:
    found: list[Path] = []

    def seen() -> bool:
        found[:] = list(folder.glob(pattern)) if folder.exists() else []
        return bool(found)

    wait_until(seen, f"{folder}/{pattern}", timeout=120)
    return found[0]


def test_coordinator_killed_at_moments_of_progress_reattaches_and_loses_nothing(
    cluster4: Cluster, tmp_path: Path
) -> None:
    """SIGKILL the coordinator (1) while it uploads an input, (2) after 4 jobs started, (3) while
    it copies a job's results home; rerun after each.  The reruns reattach to the jobs the hosts
    kept running, and in the end every job ran to completion once, its output and results whole."""
    count = 12
    data = os.urandom(96 * 1024 * 1024)
    (tmp_path / "data.bin").write_bytes(data)
    lines = ["sha256sum data.bin | cut -c1-64 > input.sha; echo job1 > result.txt; echo out1"]
    # Jobs 2-11 note in their host's home that they run: the moment "4 jobs run" is theirs to say.
    lines += [f"echo b.sh.{n} >> ~/started.log; sleep 1.5; echo job{n} > result.txt; echo out{n}" for n in range(2, count)]
    lines.append(
        f"head -c 128M /dev/urandom > big.bin; sha256sum big.bin > big.sha; echo job{count} > result.txt; echo out{count}"
    )
    (tmp_path / "b.sh").write_text("\n".join(lines) + "\n")
    hosts = cluster4.hosts[:2]
    for host in hosts:
        (host.home / "started.log").unlink(missing_ok=True)

    def running_on_hosts() -> set[str]:
        logs = [host.home / "started.log" for host in hosts]
        return {line for log in logs if log.exists() for line in log.read_text().split()}

    args = ["b.sh", *machines(cluster4, 2), *NO_GPU, "--num-cpus", "1", "--lease", "60"]
    results = tmp_path / "job_results"

    # (1) During the upload of data.bin: the host's cache holds the partial upload.
    batch = LiveBatch(tmp_path, *args)
    part = wait_for_file(hosts[0].home / ".ssh_scheduler" / "cache", "*.part-*")
    batch.kill()
    assert part.exists() and "started:" not in "\n".join(batch.out)  # killed mid-transfer

    # (2) Once 4 jobs run on the hosts: those must be reattached by the next run.
    batch = LiveBatch(tmp_path, *args)
    wait_until(lambda: len(running_on_hosts()) >= 4, "4 jobs run")
    batch.kill()
    running = running_on_hosts() - set(states(results, "finished"))
    assert len(running) >= 4

    # (3) While job 12's results come home: its staging folder exists, its result does not.
    batch = LiveBatch(tmp_path, *args)
    try:
        wait_for_file(results, f".partial-b.sh.{count}-*")
        batch.kill()
    finally:
        batch.finish()
    reattached = {line.split()[1] for line in batch.out if line.startswith("reattached:")}
    assert running <= reattached, batch.text()
    assert list(results.glob(f".partial-b.sh.{count}-*")) and not (results / f"b.sh.{count}").exists()

    final = run_batch(tmp_path, *args)
    assert final.returncode == 0, final.stdout + final.stderr
    assert f"reattached: b.sh.{count} on " in final.stdout  # its results were still on the host
    assert states(results, "finished") == Counter(f"b.sh.{n}" for n in range(1, count + 1))
    for n in range(1, count + 1):
        assert (results / f"b.sh.{n}" / "result.txt").read_text() == f"job{n}\n"
        assert (results / f"b.sh.{n}.out").read_text() == f"out{n}\n"  # caught up, not repeated
    assert (results / "b.sh.1" / "input.sha").read_text().strip() == hashlib.sha256(data).hexdigest()
    big = results / f"b.sh.{count}"
    assert (big / "big.sha").read_text().split()[0] == hashlib.sha256((big / "big.bin").read_bytes()).hexdigest()
    assert not list(results.glob(".partial-*"))
    no_batch_processes_left(*hosts)
    assert leftover_job_dirs(cluster4, results) == []


def test_a_coordinator_that_never_comes_back_leaves_nothing_once_the_lease_ran_out(
    cluster4: Cluster, tmp_path: Path
) -> None:
    host = cluster4.hosts[3]
    (host.home / "started.log").unlink(missing_ok=True)
    (tmp_path / "b.sh").write_text("echo $$ >> ~/started.log; setsid sleep 305 & sleep 306\n" * 2)
    batch = LiveBatch(tmp_path, "b.sh", "--machines", str(host.machine_file), *NO_GPU, "--lease", "3")
    log = host.home / "started.log"
    wait_until(lambda: log.exists() and len(log.read_text().split()) == 2, "both jobs run")
    batch.kill()
    # The jobs outlive their coordinator (that is what the lease is for)...
    assert any("sleep 306" in p for p in batch_processes(host))
    # ...until the lease runs out: then the agent kills them, removes their folders and exits.
    no_batch_processes_left(host)
    assert leftover_job_dirs(cluster4, tmp_path / "job_results") == []


def test_second_ctrl_c_kills_everything_even_what_ignores_sigterm(cluster4: Cluster, tmp_path: Path) -> None:
    lines = ["(sleep 300 &); setsid sleep 301 & sleep 302"] * 4
    lines.append("trap '' TERM; (sleep 303 &); sleep 304")  # TERM cannot end it: only the KILL
    (tmp_path / "b.sh").write_text("\n".join(lines) + "\n")
    hosts = cluster4.hosts[:2]
    batch = LiveBatch(tmp_path, "b.sh", *machines(cluster4, 2), *NO_GPU, "--num-cpus", "1")
    try:
        batch.wait_for("started:", 5)
        for sleep in ("sleep 301", "sleep 303", "sleep 304"):
            wait_until(functools.partial(runs_on, hosts, sleep), f"{sleep} runs")
        batch.signal(signal.SIGINT)
        batch.wait_for("stopping", stderr=True)
        batch.signal(signal.SIGINT)
        assert batch.finish(timeout=60) == 130, batch.text()
    finally:
        batch.finish()
    assert any(line.startswith("killing") for line in batch.err)
    results = tmp_path / "job_results"
    no_batch_processes_left(*hosts)
    assert leftover_job_dirs(cluster4, results) == []
    assert set(states(results, "cancelled")) == {f"b.sh.{n}" for n in range(1, 6)}


def test_first_ctrl_c_drains(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("sleep 1.5; echo done\n" * 12)
    batch = LiveBatch(tmp_path, "b.sh", *machines(cluster4, 1), *NO_GPU, "--num-cpus", "1")
    try:
        batch.wait_for("started:")
        batch.signal(signal.SIGINT)
        assert batch.finish(timeout=60) == 1  # not every job ran
    finally:
        batch.finish()
    err = "\n".join(batch.err)
    assert "stopping: no new jobs will start" in err and "not run" in err
    results = tmp_path / "job_results"
    begun, ended = set(states(results, "started")), set(states(results, "finished"))
    assert 1 <= len(begun) < 12 and ended == begun  # the running ones finished, no new ones


def test_max_sessions_two_with_twenty_concurrent_jobs(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One agent channel carries every job: sshd's MaxSessions 2 does not limit them.  Each job
    joins a rendezvous (its PID in a folder in the home) and waits until more than two are
    there at once (at most ~20 s, then it fails)."""
    cluster = make_cluster([HostSpec(cpus=16, max_sessions=2)])
    meet = "mkdir -p ~/meet && touch ~/meet/$$ && n=0; until [ $(ls ~/meet | wc -l) -ge 3 ]; do n=$((n+1)); [ $n -lt 400 ] || exit 9; sleep 0.05; done; echo ok"
    (tmp_path / "b.sh").write_text((meet + "\n") * 20)
    result = run_batch(tmp_path, "b.sh", *machines(cluster), *NO_GPU, "--num-cpus", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("finished:") == 20


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
