"""Fan-out: one command on many hosts.

  4  ``hostname`` on 16 and 32 hosts: execute_to vs pdsh -R ssh and the raw-asyncssh fan-out
     floor (scripts/bench_fanout.py)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench_driver.base import PY, REPO, VENV_BIN
from bench_driver.bench import Bench
from bench_driver.measure import Cmd
from bench_driver.profiling import profile_argv
from bench_driver.records import SSH_TOOL, Group, Scenario, Target, Tool
from bench_driver.verify import verify_lines


def scenario4(bench: Bench) -> Scenario:
    assert bench.cluster is not None
    cluster = bench.cluster
    ssh_opts = cluster.hosts[0].ssh_argv()[1:-3]  # the wrapper's options (strict host keys)

    def names(n: int) -> list[str]:
        return [f"h{i}" for i in range(1, n + 1)]

    def ssh(n: int) -> Callable[[Path], Cmd]:
        def cmd(cwd: Path) -> Cmd:
            argv = [
                str(VENV_BIN / "execute_to"),
                "--machines",
                *bench.machines(names(n)),
                "hostname",
            ]
            return Cmd(argv, cwd, env=bench.env)

        return cmd

    def fanout(n: int) -> Callable[[Path], Cmd]:
        def cmd(cwd: Path) -> Cmd:
            hosts = [
                f"{h}={bench.host(h).user}@{bench.host(h).ip}:{bench.host(h).port}"
                for h in names(n)
            ]
            argv = [PY, str(REPO / "scripts" / "bench_fanout.py"), "hostname", *hosts,
                    "--key", str(cluster.key_path), "--known-hosts", str(cluster.known_hosts)]  # fmt: skip
            return Cmd(argv, cwd, env=bench.env)

        return cmd

    def pdsh(cwd: Path) -> Cmd:
        env = dict(bench.env)
        env["PDSH_RCMD_TYPE"] = "ssh"
        env["PDSH_SSH_ARGS"] = " ".join([*ssh_opts, "-l%u", "%h"])
        w = ",".join(f"{bench.host(h).user}@{bench.host(h).ip}" for h in names(16))
        return Cmd(["pdsh", "-R", "ssh", "-f", "32", "-w", w, "hostname"], cwd, env=env)

    ssh16 = Tool(
        SSH_TOOL + " execute_to",
        ssh(16),
        verify_lines(16),
        16,
        "ssh_scheduler",
        profile_argv=profile_argv,
    )
    fan16 = Tool("asyncssh fan-out (16 hosts)", fanout(16), verify_lines(16), 16, "floor")
    ssh32 = Tool(
        SSH_TOOL + " execute_to (32 hosts)", ssh(32), verify_lines(32), 32, "ssh_scheduler"
    )
    fan32 = Tool("asyncssh fan-out (32 hosts)", fanout(32), verify_lines(32), 32, "floor")
    peer = Tool("pdsh -R ssh", pdsh, verify_lines(16), 16)
    tools = [ssh16, fan16, peer, ssh32, fan32]

    def ratio(a: Tool, b: Tool) -> float | None:
        x, y = a.median(), b.median()
        return x / y if x and y else None

    def targets(s: Scenario) -> list[Target]:
        return [
            Target(
                "execute_to wall <= 0.6 x pdsh", peer.name, ratio(ssh16, peer), 0.6, False, "x"
            ),
            Target(
                "execute_to wall <= 1.3 x fan-out, 16 hosts",
                fan16.name,
                ratio(ssh16, fan16),
                1.3,
                False,
                "x",
            ),
            Target(
                "execute_to wall <= 1.3 x fan-out, 32 hosts",
                fan32.name,
                ratio(ssh32, fan32),
                1.3,
                False,
                "x",
            ),
        ]

    return Scenario(
        "4",
        "hostname on 16 and 32 hosts: execute_to vs pdsh and a raw-asyncssh fan-out (scripts/bench_fanout.py)",
        [Group([t]) for t in tools],
        {"hosts": [16, 32], "pdsh_fanout": 32},
        targets,
        notes=[
            "pdsh uses PDSH_SSH_ARGS = the cluster wrapper's options (StrictHostKeyChecking=yes, cluster known_hosts)",
            "the fan-out floor: one process, asyncssh connections to every host at once, conn.run, print; "
            "measured whole (interpreter start and import asyncssh included), like execute_to",
        ],
    )
