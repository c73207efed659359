"""Scale: many hosts from one coordinator, each scenario on a cluster of its own (not in the
default list).

  scale256  256 test hosts (a cluster of its own): connect + probe + one job each (--reserve,
            and each job waits until every host runs one: a Barrier, so no host can take a
            second) vs pdsh running /bin/true on the same hosts; wall, the time until the last
            job started, coordinator peak RSS, and how long the cluster took to start
  churn     2000 [500] x ``true`` on 4, 16 and 32 hosts (one simulated GPU each, so every probe
            runs nvidia-smi): coordinator CPU ms/job, hosts' CPU ms/job, probes run per host
            (counted on the hosts: their nvidia-smi logs each call)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_driver.base import VENV_BIN, log
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, Run, read, tail
from bench_driver.records import (
    SSH_TOOL,
    Group,
    Scenario,
    Target,
    Tool,
    cold_then_warm,
    slower_target,
)
from bench_driver.verify import journal_summary
from tests.cluster import Cluster, GpuSpec, HostSpec, start_cluster

SCALE_SCENARIOS = ("scale256", "churn")
TRUE = "/bin/true"
PDSH_FANOUT = 32
NO_NEEDS = ("--no-gpu-required", "--num-cpus", "0.001", "--memory-required", "1")
STALL_S = 60.0
"""A barrier no new host has marked for this long lets go: a host that never runs its job (an
sshd that refused) ends the round as failed in about a minute, not at the run's time limit
(420 s, with every other job held)."""


class Barrier:
    """Holds every job of a run until each host runs one, so that no host can take a second:
    each job marks its host in ``folder``, then waits for a shared lock on ``folder/.lock``,
    which the benchmark holds exclusively until every host has marked itself (a thread here
    watches the folder every 10 ms), then lets go: the jobs all end at once, with no polling
    on the hosts.  The hosts see the folder: they share this machine's file system."""

    def __init__(self, folder: Path, hosts: int) -> None:
        self.folder, self.hosts = folder, hosts
        self.opened_at: float | None = None  # epoch seconds when the last host marked itself
        self.stalled: int | None = None  # hosts marked when no new one came for STALL_S
        self._stop = threading.Event()
        self._lock_file: Any = None
        self._watcher: threading.Thread | None = None

    def job(self) -> str:
        return f"touch {self.folder}/$(hostname) && flock -s {self.folder}/.lock true\n"

    def arm(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir()
        self.folder.chmod(0o1777)  # every host's user marks itself there
        lock = self.folder / ".lock"
        lock.touch()
        lock.chmod(0o644)  # the hosts' users take it shared: they read it
        self._lock_file = open(lock)  # noqa: SIM115 (held across the run, closed in release)
        fcntl.flock(self._lock_file, fcntl.LOCK_EX)
        self.opened_at = None
        self.stalled = None
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        seen, since = 0, time.monotonic()
        while not self._stop.wait(0.01):
            marked = sum(1 for e in os.scandir(self.folder) if e.name != ".lock")
            if marked >= self.hosts:
                self.opened_at = time.time()
                break
            if marked != seen:
                seen, since = marked, time.monotonic()
            elif seen and time.monotonic() - since > STALL_S:
                self.stalled = marked
                break
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    def release(self) -> None:
        """After the run (or when it failed): stop watching, let go of the lock."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


def scale_makers(bench: Bench) -> dict[str, Callable[[], Scenario]]:
    return {"scale256": lambda: scenario_scale256(bench), "churn": lambda: scenario_churn(bench)}


def _own_cluster(bench: Bench, specs: list[HostSpec], info: dict[str, Any], key: str) -> Cluster:
    """Start a cluster for one scenario in the bench's second cluster slot (its hosts' CPU is
    then counted per run), noting how long it took."""
    t0 = time.monotonic()
    cluster = start_cluster(specs, timeout=600, base_dir=bench.disk.cluster_base(key))
    info.update(hosts=len(specs), start_s=round(time.monotonic() - t0, 1))
    bench.cluster_info[key] = info
    bench.gpu_cluster = cluster
    log(f"{key} cluster up: {len(specs)} hosts in {info['start_s']} s")
    # The hosts go on starting after they answer (the load average was 98 when round 1 began):
    # that must not land in round 1 alone.
    info["quiet_after_s"] = round(wait_quiet(), 1)
    return cluster


def wait_quiet(limit_s: float = 120.0, busy_below: float = 0.25) -> float:
    """Wait (up to ``limit_s``) until this machine's CPUs were busy less than ``busy_below`` of
    one second; returns the seconds waited."""
    began = time.monotonic()

    def busy_idle() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, idle

    while time.monotonic() - began < limit_s:
        b0, i0 = busy_idle()
        time.sleep(1.0)
        b1, i1 = busy_idle()
        if (b1 - b0) < busy_below * max(1, (b1 - b0) + (i1 - i0)):
            break
    return time.monotonic() - began


def _stop_own(bench: Bench, info: dict[str, Any]) -> None:
    if bench.gpu_cluster is not None:
        t0 = time.monotonic()
        bench.gpu_cluster.stop()
        bench.gpu_cluster = None
        info["stop_s"] = round(time.monotonic() - t0, 1)


def _banner(host: Any) -> bool:
    """Does the host's sshd answer with its banner within 10 s?"""
    try:
        with socket.create_connection((host.ip, host.port), timeout=10) as sock:
            sock.settimeout(10)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def check_hosts(cluster: Cluster) -> None:
    """Before each round: every host's sshd answers; one that does not (it died or refused in an
    earlier round) is restarted, so a round measures the tool, not a broken test host."""
    with ThreadPoolExecutor(32) as pool:
        silent = [h for h, ok in zip(cluster.hosts, pool.map(_banner, cluster.hosts), strict=True) if not ok]
    for host in silent:
        log(f"{host.name}: its sshd did not answer before the round; restarted")
        host.restart()
    still = [h.name for h in silent if not _banner(h)]
    if still:
        raise RuntimeError(f"hosts whose sshd does not answer after a restart: {', '.join(still)}")


def _batch_cmd(bench: Bench, cwd: Path, lines: str, hosts: list[str], *extra: str) -> Cmd:
    assert bench.gpu_cluster is not None
    (cwd / "batch").write_text(lines)
    argv = [
        str(VENV_BIN / "execute_batch"), "batch", "--machines",
        *bench.machines(hosts, bench.gpu_cluster), *extra,
    ]  # fmt: skip
    return Cmd(argv, cwd, env=bench.env)


def _finished_hosts(cwd: Path) -> Counter[str]:
    placed, _first, _last = journal_summary(cwd / "job_results")
    return Counter(placed)


def scenario_scale256(bench: Bench) -> Scenario:
    hosts = 256
    info: dict[str, Any] = {}
    state: dict[str, Barrier] = {}

    def prepare() -> None:
        cluster = _own_cluster(bench, [HostSpec(cpus=2) for _ in range(hosts)], info, "scale256")
        state["barrier"] = Barrier(cluster.base / "barrier", hosts)

    def names() -> list[str]:
        assert bench.gpu_cluster is not None
        return [h.name for h in bench.gpu_cluster.hosts]

    def make(cwd: Path) -> Cmd:
        assert bench.gpu_cluster is not None
        check_hosts(bench.gpu_cluster)
        barrier = state["barrier"]
        barrier.arm()
        return _batch_cmd(bench, cwd, barrier.job() * hosts, names(), *NO_NEEDS, "--reserve", "--quiet")

    def verify(cmd: Cmd, run: Run) -> None:
        barrier = state["barrier"]
        barrier.release()
        placed, _first, _last = journal_summary(cmd.cwd / "job_results")
        t0 = run.extra["_t0_epoch"]
        run.extra.update(
            hosts_used=len(placed),
            most_jobs_on_a_host=max(placed.values(), default=0),
            last_job_started_s=round(barrier.opened_at - t0, 2) if barrier.opened_at else None,
            peak_rss_per_host_kb=round(run.maxrss_mb * 1024 / hosts),
        )
        if barrier.stalled is not None:
            run.ok, run.note = False, (f"only {barrier.stalled} of {hosts} hosts ran their job; no other "
                                       f"came for {STALL_S:.0f} s")
        elif run.ok and (barrier.opened_at is None or len(placed) != hosts):
            run.ok, run.note = False, f"{len(placed)} hosts used (want {hosts}, one job each)"

    def pdsh(cwd: Path) -> Cmd:
        assert bench.gpu_cluster is not None
        check_hosts(bench.gpu_cluster)
        return bench.pdsh_cmd(cwd, bench.gpu_cluster, names(), TRUE, PDSH_FANOUT)

    def verify_pdsh(cmd: Cmd, run: Run) -> None:
        # pdsh says each host it could not run on (and each non-zero exit) on stderr
        if run.ok and read(cmd.cwd / "stderr.txt").strip():
            run.ok, run.note = False, tail(cmd.cwd / "stderr.txt")

    # Ours cold in every round (the hosts' login processes ended, the hub and launcher too), as
    # pdsh logs into every host in every run, then warm (the 2nd call); both judged.  It was
    # cold in round 1 only, which also took the cluster's start-up load.
    ours = Tool(SSH_TOOL + " cold", make, verify, hosts, "ssh_scheduler")
    held: list[int] = []
    pair, warm = cold_then_warm(ours, lambda: bench.make_cold(cluster=bench.gpu_cluster), held)
    peer = Tool(f"pdsh -R ssh -f {PDSH_FANOUT} {TRUE}", pdsh, verify_pdsh, hosts)

    def targets(s: Scenario) -> list[Target]:
        s.computed["connections_held_before_cold"] = held
        return [
            slower_target("cold: wall <= 1.0 x pdsh's", ours, peer, 1.0),
            slower_target("warm: wall <= 1.0 x pdsh's", warm, peer, 1.0),
        ]

    def finish() -> None:
        for label, r in [*(("cold", r) for r in ours.good()), *(("warm", r) for r in warm.good())]:
            s.notes.append(
                f"round {r.round_no + 1} {label}: wall {r.wall:.1f} s, the last host's job started after "
                f"{r.extra['last_job_started_s']} s, coordinator peak RSS {r.maxrss_mb:.0f} MB "
                f"({r.extra['peak_rss_per_host_kb']} KB per host), CPU {r.cpu_s:.1f} s"
            )
        _stop_own(bench, info)
        s.notes.append(f"cluster of {hosts} hosts: started in {info.get('start_s')} s, stopped in {info.get('stop_s')} s")

    s = Scenario(
        "scale256",
        f"{hosts} hosts: connect + probe + one job each (--reserve) vs pdsh running {TRUE} on them",
        [pair, Group([peer])],
        params={"hosts": hosts, "pdsh_fanout": PDSH_FANOUT},
        targets=targets,
        prepare=prepare,
        finish=finish,
        notes=[
            "each job marks its host, then waits until every host has one (a lock the benchmark "
            "holds until then: no polling on the hosts), so no host takes a second",
            f"pdsh: -f {PDSH_FANOUT} (its default fan-out), our key exchange and cipher; "
            "ssh_scheduler connects 8 hosts at once (its default)",
        ],
    )
    return s


def _count_probes(cluster: Cluster) -> None:
    """Wrap each host's nvidia-smi so that it notes every call in the host's home."""
    for host in cluster.hosts:
        real = host.dir / "bin" / "nvidia-smi.real"
        (host.dir / "bin" / "nvidia-smi").rename(real)
        wrapper = host.dir / "bin" / "nvidia-smi"
        wrapper.write_text(f'#!/bin/sh\necho "$*" >> ~/nvidia-smi.calls\nexec {real} "$@"\n')
        wrapper.chmod(0o755)


def _probes(cluster: Cluster, names: list[str]) -> list[int]:
    counts = []
    for host in cluster.hosts:
        if host.name in names:
            calls = host.home / "nvidia-smi.calls"
            text = calls.read_text() if calls.exists() else ""
            counts.append(sum("--query-gpu" in line for line in text.splitlines()))
            calls.unlink(missing_ok=True)
    return counts


def scenario_churn(bench: Bench) -> Scenario:
    jobs = 500 if bench.quick else 2000
    sizes = (4, 16, 32)
    info: dict[str, Any] = {}

    def prepare() -> None:
        cluster = _own_cluster(bench, [HostSpec(cpus=4, gpus=[GpuSpec(memory_mb=16000)]) for _ in range(max(sizes))], info, "churn")
        _count_probes(cluster)

    def tool(size: int) -> Tool:
        def make(cwd: Path) -> Cmd:
            assert bench.gpu_cluster is not None
            _probes(bench.gpu_cluster, [h.name for h in bench.gpu_cluster.hosts])  # start from zero
            names = [h.name for h in bench.gpu_cluster.hosts[:size]]
            return _batch_cmd(bench, cwd, "true\n" * jobs, names, *NO_NEEDS, "--quiet")

        def verify(cmd: Cmd, run: Run) -> None:
            assert bench.gpu_cluster is not None
            probes = _probes(bench.gpu_cluster, [h.name for h in bench.gpu_cluster.hosts[:size]])
            run.extra.update(
                coordinator_cpu_ms_per_job=round(run.cpu_s * 1000 / jobs, 2),
                hosts_cpu_ms_per_job=round(run.hosts_cpu_s * 1000 / jobs, 2),
                probes_per_host_max=max(probes, default=0),
                probes_per_host_mean=round(sum(probes) / max(1, len(probes)), 2),
            )
            done = sum(_finished_hosts(cmd.cwd).values())
            if run.ok and done != jobs:
                run.ok, run.note = False, f"{done} of {jobs} jobs placed"

        return Tool(f"{SSH_TOOL} {size} hosts", make, verify, jobs, "ssh_scheduler")

    def finish() -> None:
        for t in s.tools:
            for r in t.good():
                s.notes.append(
                    f"{t.name}: coordinator {r.extra['coordinator_cpu_ms_per_job']} ms/job, hosts "
                    f"{r.extra['hosts_cpu_ms_per_job']} ms/job, probes per host max "
                    f"{r.extra['probes_per_host_max']} (mean {r.extra['probes_per_host_mean']})"
                )
        _stop_own(bench, info)

    s = Scenario(
        "churn",
        f"{jobs} x true on 4, 16 and 32 hosts: CPU per job and probes per host",
        [Group([tool(n)]) for n in sizes],
        params={"jobs": jobs, "hosts": list(sizes)},
        prepare=prepare,
        finish=finish,
    )
    return s
