"""Many hosts from one coordinator, on the real test cluster: a host that does not answer never
holds back the others, connections open a bounded number at a time (counted on the hosts'
side), and job turnover costs no probes (the hosts' nvidia-smi counts its calls).

Every order here is the batch's own (its output lines) or the hosts' (their sockets and logs),
never a clock."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster import Cluster, GpuSpec, Host, HostSpec
from tests.live_batch import LiveBatch, machines, run_batch, wait_until

CHEAP = ("--no-gpu-required", "--num-cpus", "0.1", "--memory-required", "10")


@pytest.mark.namespaces  # a frozen sshd in its own network namespace
def test_a_host_that_never_answers_does_not_hold_back_the_others(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster(32)
    silent = cluster.hosts[0]  # first in the list: the batch knocks on its door at once
    # Its sshd accepts TCP (the kernel's backlog) but never says a word; with a long connect
    # timeout the batch cannot learn anything about it before the test thaws it.
    patient(silent)
    silent.freeze()
    gate = cluster.base / "go"  # the jobs end once the test has seen the batch knock
    (tmp_path / "b.sh").write_text(f"until [ -e {gate} ]; do sleep 0.1; done; hostname\n" * 64)
    batch = LiveBatch(tmp_path, "b.sh", *machines(cluster), *CHEAP)
    try:
        wait_until(lambda: connections(silent) >= 1, "the batch connects to the silent host")
        gate.write_text("")
        batch.wait_for("finished: ", 64)
        # Every job ran and ended while the silent host had not answered: nothing about it was
        # said (the old coordinator placed nothing before every host had answered).
        assert not any(silent.name + ":" in line or f" {silent.name} " in line for line in batch.out + batch.err), batch.text()
    finally:
        silent.thaw()
        gate.touch()
        code = batch.finish()
    assert code == 0, batch.text()
    where = {(tmp_path / "job_results" / f"b.sh.{n}.out").read_text().strip() for n in range(1, 65)}
    assert silent.name not in where and len(where) >= 1


def patient(host: Host) -> None:
    """The batch waits for this host's SSH banner as long as the test needs."""
    host.machine_file.write_text(host.machine_file.read_text() + "connect_timeout: 600\n")


def connections(host: Host) -> int:
    """SSH connections the host's kernel accepted (established TCP on port 22), even while
    its sshd is frozen."""
    out = host.run("ss -Htn state established '( sport = :22 )'", check=True).stdout
    return len(out.splitlines())


@pytest.mark.namespaces
def test_connections_open_at_most_max_connecting_at_once(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster(10)
    hosts = list(cluster.hosts)
    for host in hosts:  # every login stalls until the test lets that host's sshd answer
        patient(host)
        host.freeze()
    # One job per host, each held until the test is done, so the batch needs every host.
    gate = cluster.base / "go"
    (tmp_path / "b.sh").write_text(f"until [ -e {gate} ]; do sleep 0.1; done\n" * 10)
    batch = LiveBatch(tmp_path, "b.sh", *machines(cluster), *CHEAP, "--reserve", "--max-connecting", "3")
    thawed: list[Host] = []
    try:
        while len(thawed) < len(hosts):
            waiting = min(3, len(hosts) - len(thawed))

            def knocking() -> list[Host]:
                return [h for h in hosts if h not in thawed and connections(h)]

            wait_until(lambda: len(knocking()) >= waiting, f"{waiting} hosts being connected")  # noqa: B023
            now = knocking()
            assert len(now) == waiting, ([h.name for h in now], batch.text())  # never more than --max-connecting
            now[0].thaw()  # one login completes: one more host may be tried
            thawed.append(now[0])
    finally:
        for host in hosts:
            host.thaw()
        gate.write_text("")
        code = batch.finish()
    assert code == 0, batch.text()
    assert all(connections(h) == 0 for h in hosts)  # the batch closed what it opened


@pytest.mark.namespaces
def test_a_host_slow_to_start_its_agent_holds_no_other_hosts_login(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """``--max-connecting`` counts logins (the unauthenticated connections sshd's MaxStartups
    counts), not what follows: with room for one, the next host logs in and runs a job while the
    first host's agent is still starting."""
    cluster = make_cluster(2)
    slow = cluster.hosts[0]  # first in the list: logged into first
    gate = cluster.base / "agent-go"
    stub = slow.dir / "bin" / "python3"  # first on the host's PATH: the agent's python waits
    stub.write_text(f'#!/bin/sh\nuntil [ -e {gate} ]; do sleep 0.05; done\nexec /usr/bin/python3 "$@"\n')
    stub.chmod(0o755)
    (tmp_path / "b.sh").write_text("hostname\n")
    batch = LiveBatch(tmp_path, "b.sh", *machines(cluster), *CHEAP, "--max-connecting", "1")
    try:
        [started] = batch.wait_for("started: ", 1)
        # ...while the slow host's agent still waits at the gate, and before anything was said
        # of that host: holding its room to log in through its agent's start, the batch would
        # have kept the other host out until it gave the slow one up (its hello never came).
        assert not gate.exists()
        assert not any(slow.name in line for line in batch.out + batch.err), batch.text()
    finally:
        gate.write_text("")
        code = batch.finish()
    assert code == 0, batch.text()
    assert (tmp_path / "job_results" / "b.sh.1.out").read_text() == f"{cluster.hosts[1].name}\n", started


@pytest.mark.slow
def test_five_hundred_short_jobs_cost_one_probe_per_host(make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16000)]) for _ in range(4)])
    for host in cluster.hosts:  # nvidia-smi notes each call in the host's home, then answers
        real = host.dir / "bin" / "nvidia-smi.real"
        (host.dir / "bin" / "nvidia-smi").rename(real)
        (host.dir / "bin" / "nvidia-smi").write_text(f'#!/bin/sh\necho "$*" >> ~/nvidia-smi.calls\nexec {real} "$@"\n')
        (host.dir / "bin" / "nvidia-smi").chmod(0o755)
    (tmp_path / "b.sh").write_text("true\n" * 500)
    result = run_batch(tmp_path, "b.sh", *machines(cluster), *CHEAP, "--probe-interval", "3600", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sum(line.startswith("finished: ") for line in result.stdout.splitlines()) == 500
    probes = {}
    for host in cluster.hosts:
        calls = (host.home / "nvidia-smi.calls").read_text().splitlines()
        probes[host.name] = sum("--query-gpu" in call for call in calls)
    # Each host was probed once when the batch began; no job was seen running by a probe, so no
    # release needed one (the old coordinator probed every host after every job end, 1 s apart).
    assert all(1 <= count <= 2 for count in probes.values()), probes
