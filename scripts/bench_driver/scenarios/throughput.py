"""Throughput: many tiny jobs on 4 hosts, against two floors and GNU parallel.

  1  1000 [300] x ``/bin/true``, 4 at once per host for every tool, no GPU, nothing copied:
     against the exec floor (scripts/bench_floor.py), the agent floor
     (scripts/bench_agent_floor.py) and GNU parallel -M
  2  200 x ``sleep 0.1`` with 10 slots per host (ideal 0.5 s)
  5  scenario 1 with 25 ms added on every host (cluster set_latency) vs the same on the LAN
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import statistics
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench_driver.base import VENV_BIN
from bench_driver.bench import Bench
from bench_driver.measure import Cmd
from bench_driver.profiling import profile_argv
from bench_driver.records import (
    SSH_TOOL,
    Group,
    Scenario,
    Target,
    Tool,
    cold_then_warm,
    faster_target,
    slower_target,
    wall_target,
)
from bench_driver.verify import verify_batch, verify_floor, verify_lines

SLOTS = 4
"""Jobs at once per host, for every tool: ssh_scheduler's slots (--num-cpus 1 on 4-CPU hosts),
each floor's channels or agent slots, GNU parallel's -j."""
TRUE = "/bin/true"  # a real program: `true` alone is a shell builtin, which no peer would exec


def s1_tools(bench: Bench, sid: str, n_jobs: int, label: str = "", *, unbounded: bool = False,
             agent_floor: bool = True) -> list[Tool]:
    """ssh_scheduler, the exec floor, the agent floor and GNU parallel, each running ``n_jobs``
    x /bin/true on h1..h4, SLOTS at once per host, the OpenSSH and asyncssh sides on our key
    exchange; ``unbounded`` adds ssh_scheduler with --num-cpus 0 (no slot limit) as info."""
    names = ["h1", "h2", "h3", "h4"]
    batch = bench.root / f"batch_true_{n_jobs}"
    batch.write_text(f"{TRUE}\n" * n_jobs)

    def ssh(cwd: Path, needs: Sequence[str] = ("--num-cpus", "1", "--memory-required", "0")) -> Cmd:
        shutil.copy(batch, cwd / "batch")
        (cwd / "empty").mkdir()
        argv = [
            str(VENV_BIN / "execute_batch"), "batch",
            "--machines", *bench.machines(names),
            "--no-gpu-required", *needs,
            "--copy-forwards", "empty",
        ]  # fmt: skip
        return Cmd(argv, cwd, env=bench.env)

    tools = [
        Tool(SSH_TOOL + label, ssh, verify_batch(n_jobs, limits=SLOTS), n_jobs, "ssh_scheduler",
             profile_argv=profile_argv),
    ]  # fmt: skip
    if unbounded:
        tools.append(
            Tool(
                SSH_TOOL + " (--num-cpus 0: no slot limit, info)" + label,
                lambda cwd: ssh(cwd, ("--num-cpus", "0", "--memory-required", "0")),
                verify_batch(n_jobs),
                n_jobs,
                "info",
            )
        )
    floors = [("exec floor", "bench_floor.py")] + ([("agent floor", "bench_agent_floor.py")] if agent_floor else [])
    for what, script in floors:
        tools.append(
            Tool(
                f"{what} ({SLOTS}/host){label}",
                partial(bench.floor_cmd, batch=batch, names=names, per_host=SLOTS, script=script),
                verify_floor(n_jobs),
                n_jobs,
                "floor",
            )
        )
    tools.append(
        Tool(
            f"GNU parallel -S -M -j{SLOTS}{label}",
            lambda cwd: bench.parallel_cmd(cwd, batch, 4, SLOTS),
            verify_lines(0),
            n_jobs,
        )
    )
    return tools


def scenario1(bench: Bench) -> Scenario:
    n = 300 if bench.quick else 1000
    tools = s1_tools(bench, "1", n, unbounded=True)
    cold, exec_floor, agent_floor, par = (tools[0], *tools[2:])
    cold.name = SSH_TOOL + " cold"
    # Every round, ours once cold (nothing held: its hub starts, it connects, every module
    # loads), as each peer and floor connects afresh in every run, then once warm (the 2nd
    # call: what a hub keeping connections serves).  Both are judged.
    held: list[int] = []
    pair, warm = cold_then_warm(cold, lambda: bench.make_cold(names=["h1", "h2", "h3", "h4"]), held)

    def targets(s: Scenario) -> list[Target]:
        s.computed["connections_held_before_cold"] = held
        return [
            faster_target(f"{what}: jobs/s >= 0.8 x the agent floor's", ours, agent_floor, 0.8)
            for what, ours in (("cold", cold), ("warm", warm))
        ] + [
            faster_target(f"{what}: jobs/s >= 1.0 x the exec floor's", ours, exec_floor, 1.0)
            for what, ours in (("cold", cold), ("warm", warm))
        ] + [
            faster_target(f"{what}: jobs/s >= 10 x GNU parallel -M's", ours, par, 10.0)
            for what, ours in (("cold", cold), ("warm", warm))
        ]

    return Scenario(
        "1",
        f"{n} x {TRUE} on 4 hosts, {SLOTS} at once per host for every tool (no GPU, nothing copied)",
        [pair, *(Group([t]) for t in tools[1:])],
        {"jobs": n, "hosts": 4, "jobs_at_once_per_host": SLOTS, "command": TRUE},
        targets,
        notes=[
            f"ssh_scheduler: --num-cpus 1 on 4-CPU hosts = {SLOTS} slots per host (checked in its "
            "'machine limits' line); the floors and parallel run the same number at once per host",
            "exec floor (scripts/bench_floor.py): asyncssh, one connection per host, a channel and the "
            "login shell per job -- more host work than our agent, a bar rather than a floor",
            "agent floor (scripts/bench_agent_floor.py): one channel per host running a minimal "
            "stdlib agent that spawns each line without a shell, reporting only its exit status "
            "(no output capture, journal or files): what our design can cost at best",
        ],
        report_last=jobs_per_host,
    )


def scenario2(bench: Bench) -> Scenario:
    names = ["h1", "h2", "h3", "h4"]
    n = 200
    batch = bench.root / "batch_sleep"
    batch.write_text("sleep 0.1\n" * n)
    slots = 10
    ideal = n * 0.1 / (slots * len(names))

    def ssh(cwd: Path) -> Cmd:
        shutil.copy(batch, cwd / "batch")
        (cwd / "empty").mkdir()
        argv = [
            str(VENV_BIN / "execute_batch"), "batch",
            "--machines", *bench.machines(names),
            "--no-gpu-required", "--num-cpus", "0.5", "--memory-required", "100",
            "--copy-forwards", "empty",
        ]  # fmt: skip
        return Cmd(argv, cwd, env=bench.env)

    tools = [
        Tool(
            SSH_TOOL,
            ssh,
            verify_batch(n, limits=slots),
            n,
            "ssh_scheduler",
            profile_argv=profile_argv,
        ),
        Tool(
            "GNU parallel -S -M -j10",
            lambda cwd: bench.parallel_cmd(cwd, batch, 4, slots),
            verify_lines(0),
            n,
        ),
    ]

    def targets(s: Scenario) -> list[Target]:
        return [wall_target(f"wall <= ideal {ideal:.1f} s + 0.3 s", s.tool(SSH_TOOL), ideal + 0.3)]

    return Scenario(
        "2",
        f"{n} x sleep 0.1 on 4 hosts, {slots} slots/host (--num-cpus 0.5 on 4 CPUs x 1.25); ideal {ideal:.1f} s",
        [Group([t]) for t in tools],
        {"jobs": n, "hosts": 4, "slots_per_host": slots, "ideal_s": ideal},
        targets,
    )


def scenario5(bench: Bench) -> Scenario:
    n = 300 if bench.quick else 1000
    names = ["h1", "h2", "h3", "h4"]
    ms = 25.0
    lan = s1_tools(bench, "5", n, " LAN", agent_floor=False)[0]
    lan.kind = "info"
    lat_tools = s1_tools(bench, "5", n, f" +{ms:.0f}ms", agent_floor=False)
    lat_ssh = lat_tools[0]
    probe: dict[str, Any] = {}

    def set_latency() -> None:
        for nm in names:
            bench.host(nm).set_latency(ms)
        probe.setdefault("rtt_ms_with_latency", []).append(
            tcp_rtt_ms([bench.host(nm) for nm in names])
        )

    def clear_latency() -> None:
        for nm in names:
            bench.host(nm).clear_latency()
        probe.setdefault("rtt_ms_lan", []).append(tcp_rtt_ms([bench.host(nm) for nm in names]))

    def targets(s: Scenario) -> list[Target]:
        s.computed["tcp_connect_ms"] = probe
        return [slower_target(f"+{ms:.0f} ms wall <= 2 x LAN wall", lat_ssh, lan, 2.0)]

    return Scenario(
        "5",
        f"scenario 1 ({n} x {TRUE}, 4 hosts) with {ms:.0f} ms added per host (set_latency) vs LAN",
        [
            Group([lan], setup=clear_latency),
            Group(lat_tools, setup=set_latency, teardown=clear_latency),
        ],
        {"jobs": n, "hosts": 4, "latency_ms": ms},
        targets,
        notes=[
            "latency: tests/cluster set_latency (NFQUEUE helper delaying each host's outgoing packets); "
            "'tcp_connect_ms' in the JSON is the measured TCP connect time to port 22 with and without it",
        ],
        report_first=connect_times,
        report_last=jobs_per_host,
    )


def tcp_rtt_ms(hosts: Sequence[Any]) -> float:
    """Median TCP connect time (SYN -> SYN/ACK) to the hosts' sshd, in ms."""
    times = []
    for h in hosts:
        for _ in range(3):
            t0 = time.perf_counter()
            with contextlib.suppress(OSError), socket.create_connection((h.ip, h.port), timeout=2):
                times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2) if times else -1.0


def connect_times(s: Scenario) -> list[str]:
    c = s.computed
    return [f"TCP connect to sshd, ms: {c['tcp_connect_ms']}"] if c.get("tcp_connect_ms") else []


def jobs_per_host(s: Scenario) -> list[str]:
    """How each tool's last good run spread the jobs over the hosts (from the batch journal)."""
    out = []
    for t in s.tools:
        dist = [r.extra.get("placed_per_host") for r in t.good() if r.extra.get("placed_per_host")]
        if dist:
            out.append(f"{t.name}: jobs per host {dist[-1]}")
    return out
