"""Fan-out: one command on many hosts.

  4  ``hostname`` on 16 and 32 hosts: execute_to, cold then warm (a second call right after),
     vs pdsh -R ssh on the same hosts with our key exchange, and the raw-asyncssh fan-out
     (scripts/bench_fanout.py)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench_driver.base import PY, REPO, VENV_BIN
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
    slower_target,
)
from bench_driver.verify import verify_lines

SIZES = (16, 32)
COMMAND = "hostname"  # a program (/bin/hostname): what each host answers tells it ran there


def scenario4(bench: Bench) -> Scenario:
    assert bench.cluster is not None
    cluster = bench.cluster
    held: list[int] = []

    def names(n: int) -> list[str]:
        return [f"h{i}" for i in range(1, n + 1)]

    def ssh(n: int) -> Callable[[Path], Cmd]:
        def cmd(cwd: Path) -> Cmd:
            argv = [str(VENV_BIN / "execute_to"), "--machines", *bench.machines(names(n)), COMMAND]
            return Cmd(argv, cwd, env=bench.env)

        return cmd

    def fanout(n: int) -> Callable[[Path], Cmd]:
        def cmd(cwd: Path) -> Cmd:
            hosts = [f"{h}={bench.host(h).user}@{bench.host(h).ip}:{bench.host(h).port}" for h in names(n)]
            argv = [PY, str(REPO / "scripts" / "bench_fanout.py"), COMMAND, *hosts,
                    "--key", str(cluster.key_path), "--known-hosts", str(cluster.known_hosts),
                    *bench.asyncssh_options()]  # fmt: skip
            return Cmd(argv, cwd, env=bench.env)

        return cmd

    groups: list[Group] = []
    trios: list[tuple[int, Tool, Tool, Tool, Tool]] = []
    for n in SIZES:
        cold = Tool(f"{SSH_TOOL} execute_to cold, {n} hosts", ssh(n), verify_lines(n), n, "ssh_scheduler",
                    profile_argv=profile_argv if n == SIZES[0] else None)  # fmt: skip
        pair, warm = cold_then_warm(cold, lambda n=n: bench.make_cold(cluster, names(n)), held)
        pdsh = Tool(f"pdsh -R ssh -f 32, {n} hosts",
                    lambda cwd, n=n: bench.pdsh_cmd(cwd, cluster, names(n), COMMAND, 32),
                    verify_lines(n), n)  # fmt: skip
        fan = Tool(f"asyncssh fan-out, {n} hosts", fanout(n), verify_lines(n), n, "floor")
        groups += [pair, Group([pdsh]), Group([fan])]
        trios.append((n, cold, warm, pdsh, fan))

    def targets(s: Scenario) -> list[Target]:
        s.computed["connections_held_before_cold"] = held
        out = []
        for n, cold, warm, pdsh, fan in trios:
            out += [
                slower_target(f"cold: wall <= 1.0 x pdsh's, {n} hosts", cold, pdsh, 1.0),
                slower_target(f"warm: wall <= 0.25 x pdsh's, {n} hosts", warm, pdsh, 0.25),
                slower_target(f"reported: cold wall <= 1.3 x the fan-out's, {n} hosts", cold, fan, 1.3),
            ]
        return out

    return Scenario(
        "4",
        f"{COMMAND} on {' and '.join(map(str, SIZES))} hosts: execute_to (cold, then warm) vs pdsh "
        "and a raw-asyncssh fan-out (scripts/bench_fanout.py)",
        groups,
        {"hosts": list(SIZES), "pdsh_fanout": 32, "command": COMMAND},
        targets,
        notes=[
            "pdsh: PDSH_SSH_ARGS = the cluster's OpenSSH options (strict host keys, its known_hosts) "
            "and our key exchange and cipher; -f 32 (its default fan-out: every host at once here)",
            "the fan-out floor: one process, asyncssh connections to every host at once, conn.run, print; "
            "measured whole (interpreter start and import asyncssh included), like execute_to",
        ],
    )
