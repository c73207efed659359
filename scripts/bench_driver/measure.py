"""Running one whole process and measuring it: wall time around the subprocess (start-up
included), CPU and peak RSS of its process tree from ``wait4``, the whole machine's busy share,
the CPU the simulated hosts spent meanwhile (on a small machine they share its cores), and the
SSH connections the hosts accepted during the run and still held after it (what tells a warm
run that reused connections from a second cold one)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.cluster import Cluster

RUN_TIMEOUT = 420.0


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    total = sum(parts[:8])
    return total - idle, total


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of a live process (its reaped descendants included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def hosts_cpu_s(clusters: Sequence[Cluster | None]) -> float:
    """CPU used so far by the simulated hosts: each host's init (PID 1 of its namespace, which
    reaps everything detached) and its live direct children (the sshd listener, which reaps the
    sessions), counting their reaped descendants.  Still-running processes' own children are
    missed until they exit, so take the difference around a run that leaves nothing behind."""
    total = 0.0
    for cluster in clusters:
        if cluster is None or not cluster.namespaces:
            continue
        for h in cluster.hosts:
            pid = h.init_pid
            if not pid:
                continue
            total += proc_cpu_s(pid)
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                children = []
            for child in children:
                total += proc_cpu_s(int(child))
    return total


def host_tcp(init_pid: int) -> tuple[int, int]:
    """(TCP connections the host has accepted so far, connections to its sshd established now),
    read in its network namespace: ``/proc/<its init>/net`` is that namespace's.  Every
    connection to a test host is an SSH login, so the first's difference around a run is the
    logins the run made; the second, read after a run, is what something (a hub) keeps open."""
    accepted = held = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        lines = Path(f"/proc/{init_pid}/net/snmp").read_text().splitlines()
        names, values = (ln.split() for ln in lines if ln.startswith("Tcp:"))
        accepted = int(values[names.index("PassiveOpens")])
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{init_pid}/net/tcp").read_text().splitlines()[1:]:
            local, _remote, state = line.split()[1:4]
            held += local.endswith(":0016") and state == "01"  # port 22, ESTABLISHED
    return accepted, held


def hosts_tcp(clusters: Sequence[Cluster | None]) -> tuple[int, int]:
    """:func:`host_tcp` summed over every host of the namespaced clusters; (0, 0) for loopback
    ones, whose hosts share this machine's counters."""
    accepted = held = 0
    for cluster in clusters:
        if cluster is None or not cluster.namespaces:
            continue
        for h in cluster.hosts:
            if h.init_pid:
                a, b = host_tcp(h.init_pid)
                accepted, held = accepted + a, held + b
    return accepted, held


@dataclass
class Cmd:
    argv: list[str]
    cwd: Path
    stdin: Path | None = None
    env: dict[str, str] | None = None


@dataclass
class Run:
    wall: float
    rc: int
    cpu_s: float  # user+sys of the whole child process tree (the client side only)
    maxrss_mb: float  # peak RSS of the largest process of the tree
    machine_busy_pct: float  # all CPUs, every tenant, during the run
    load1: float  # 1-minute load average when the run started
    hosts_cpu_s: float = 0.0  # CPU the simulated hosts (sshd, agents, jobs) used during the run
    round_no: int = 0  # which round of its scenario (0-based): runs of one round are compared
    ok: bool = True
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "wall_s": round(self.wall, 4),
            "rc": self.rc,
            "ok": self.ok,
            "client_cpu_s": round(self.cpu_s, 3),
            "hosts_cpu_s": round(self.hosts_cpu_s, 3),
            "peak_rss_mb": round(self.maxrss_mb, 1),
            "machine_busy_pct": round(self.machine_busy_pct, 1),
            "load1_at_start": round(self.load1, 2),
            "round": self.round_no + 1,
        }
        if self.note:
            d["note"] = self.note
        d.update({k: v for k, v in self.extra.items() if not k.startswith("_")})
        return d


def run_cmd(cmd: Cmd, timeout: float = RUN_TIMEOUT, clusters: Sequence[Cluster | None] = ()) -> Run:
    """Run one whole process (stdout/stderr to files in its cwd) and measure it."""
    hosts0 = hosts_cpu_s(clusters)
    accepted0, _held = hosts_tcp(clusters)
    with contextlib.ExitStack() as stack:
        stdin: Any = stack.enter_context(open(cmd.stdin, "rb")) if cmd.stdin else subprocess.DEVNULL
        out = stack.enter_context(open(cmd.cwd / "stdout.txt", "wb"))
        err = stack.enter_context(open(cmd.cwd / "stderr.txt", "wb"))
        load1 = os.getloadavg()[0]
        busy0, total0 = cpu_times()
        t0 = time.perf_counter()
        t0_epoch = time.time()
        proc = subprocess.Popen(
            cmd.argv,
            cwd=cmd.cwd,
            stdin=stdin,
            stdout=out,
            stderr=err,
            env=cmd.env,
            start_new_session=True,
        )
    timed_out = False
    deadline = t0 + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline and not timed_out:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    busy1, total1 = cpu_times()
    hosts1 = hosts_cpu_s(clusters)
    accepted1, held = hosts_tcp(clusters)
    busy_pct = 100.0 * (busy1 - busy0) / max(1.0, total1 - total0)
    run = Run(
        wall=wall,
        rc=proc.returncode,
        cpu_s=usage.ru_utime + usage.ru_stime,
        maxrss_mb=usage.ru_maxrss / 1024.0,
        machine_busy_pct=busy_pct,
        load1=load1,
        hosts_cpu_s=max(0.0, hosts1 - hosts0),
    )
    run.extra["_t0_epoch"] = t0_epoch
    if any(c is not None and c.namespaces for c in clusters):
        run.extra["ssh_logins"] = accepted1 - accepted0
        run.extra["ssh_connections_held_after"] = held
    if timed_out:
        run.ok, run.note = False, f"killed after {timeout:.0f} s"
    elif run.rc != 0:
        run.ok, run.note = False, f"exit {run.rc}: {tail(cmd.cwd / 'stderr.txt')}"
    return run


def tail(path: Path, n: int = 300) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return text[-n:].replace("\n", " | ")


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
