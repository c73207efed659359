"""Throughput: many tiny jobs on 4 hosts, against the raw-asyncssh floor (scripts/bench_floor.py)
and GNU parallel.

  1  1000 [300] x ``true``, no GPU, nothing copied (zero needs, and tiny needs that spread jobs)
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
from bench_driver.bench import SPREAD_NEEDS, Bench
from bench_driver.measure import Cmd
from bench_driver.profiling import profile_argv
from bench_driver.records import SSH_TOOL, Group, Scenario, Target, Tool, first_job_target
from bench_driver.verify import verify_batch, verify_floor, verify_lines


def s1_tools(
    bench: Bench,
    sid: str,
    n_jobs: int,
    label: str = "",
    *,
    spread: bool = True,
    floors: Sequence[int] | None = None,
) -> list[Tool]:
    names = ["h1", "h2", "h3", "h4"]
    batch = bench.root / f"batch_true_{n_jobs}"
    batch.write_text("true\n" * n_jobs)

    def ssh(
        cwd: Path, needs: Sequence[str] = ("--num-cpus", "0", "--memory-required", "0")
    ) -> Cmd:
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
        Tool(
            SSH_TOOL + label,
            ssh,
            verify_batch(n_jobs),
            n_jobs,
            "ssh_scheduler",
            profile_argv=profile_argv,
        ),
    ]
    if spread:
        tools.append(
            Tool(
                SSH_TOOL + " (--num-cpus 0.001 --memory-required 1)" + label,
                lambda cwd: ssh(cwd, SPREAD_NEEDS),
                verify_batch(n_jobs),
                n_jobs,
                "info",
                profile_argv=profile_argv,
            )
        )
    for per_host in floors if floors is not None else bench.args.floor_channels:
        tools.append(
            Tool(
                f"asyncssh floor ({per_host} ch/host){label}",
                partial(bench.floor_cmd, batch=batch, names=names, per_host=per_host),
                verify_floor(n_jobs),
                n_jobs,
                "floor",
            )
        )
    tools.append(
        Tool(
            f"GNU parallel -S --controlmaster -j4{label}",
            lambda cwd: bench.parallel_cmd(cwd, batch, 4, 4),
            verify_lines(0),
            n_jobs,
        )
    )
    return tools


def scenario1(bench: Bench) -> Scenario:
    n = 300 if bench.quick else 1000
    tools = s1_tools(bench, "1", n)

    def targets(s: Scenario) -> list[Target]:
        return s1_targets(s, SSH_TOOL)

    return Scenario(
        "1",
        f"{n} x true on 4 hosts (no GPU, nothing copied)",
        [Group([t]) for t in tools],
        {
            "jobs": n,
            "hosts": 4,
            "parallel_jobs_per_host": 4,
            "floor_channels_per_host": bench.args.floor_channels,
        },
        targets,
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
            "GNU parallel -S --controlmaster -j10",
            lambda cwd: bench.parallel_cmd(cwd, batch, 4, slots),
            verify_lines(0),
            n,
        ),
    ]

    def targets(s: Scenario) -> list[Target]:
        med = s.tool(SSH_TOOL).median()
        return [
            Target(
                f"wall <= ideal {ideal:.1f} s + 0.3 s", SSH_TOOL, med, ideal + 0.3, False, " s"
            ),
            first_job_target(s.tool(SSH_TOOL)),
        ]

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
    lan = s1_tools(bench, "5", n, " LAN", spread=False)[0]
    lan.kind = "info"
    lat_tools = s1_tools(
        bench, "5", n, f" +{ms:.0f}ms", spread=False, floors=[max(bench.args.floor_channels)]
    )
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
        a, b = lat_ssh.median(), lan.median()
        s.computed["tcp_connect_ms"] = probe
        return [
            Target(
                f"+{ms:.0f} ms wall <= 2 x LAN wall",
                lat_ssh.name,
                a / b if a and b else None,
                2.0,
                False,
                "x",
            )
        ]

    return Scenario(
        "5",
        f"scenario 1 ({n} x true, 4 hosts) with {ms:.0f} ms added per host (set_latency) vs LAN",
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


def s1_targets(s: Scenario, ssh_name: str) -> list[Target]:
    ssh = s.tool(ssh_name)
    ssh_med = ssh.median()
    out: list[Target] = [first_job_target(ssh)]
    floors = [t for t in s.tools if t.kind == "floor" and t.median()]
    if floors:
        best = min(floors, key=lambda t: t.median() or 1e9)
        fm = best.median()
        out.append(
            Target(
                "jobs/s >= 1.0 x floor's (best floor)",
                best.name,
                (fm / ssh_med) if ssh_med and fm else None,
                1.0,
                True,
                "x",
            )
        )
    par = [t for t in s.tools if t.name.startswith("GNU parallel")]
    if par:
        pm = par[0].median()
        out.append(
            Target(
                ">= 10 x faster than parallel",
                par[0].name,
                pm / ssh_med if pm and ssh_med else None,
                10.0,
                True,
                "x",
            )
        )
    return out


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
