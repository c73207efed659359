"""The smallest commands a user types, start to finish, each cold and then warm (a second call
right after the first: what a hub keeping connections would serve).

  7       the ancestor README's 4-line batch (Step 2, with the flags of Step 5) on the 2 hosts
          with 2 GPUs each: start to finish and launch to the first job, and
          ``execute_batch --help`` alone (the start-up)
  remote  ``execute_remote --machine h1 hostname``: one command, end to end
"""

from __future__ import annotations

from pathlib import Path

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
    first_job_target,
    wall_target,
)
from bench_driver.verify import verify_batch, verify_lines


def scenario7(bench: Bench) -> Scenario:
    names = ["h15", "h16"]
    lines = [
        'echo "one job"',
        'echo "another job"',
        'echo "another job" && echo "a combined job (bash syntax applies)"',
        'bash examples/local.sh && echo "you can also call local files because they are copied by the remote by the default value of --copy-forwards"',
    ]

    def ssh(cwd: Path) -> Cmd:
        (cwd / "batch_script.sh").write_text("\n".join(lines) + "\n")
        (cwd / "examples").mkdir()
        (cwd / "examples" / "local.sh").write_text('echo "local.sh ran on $(hostname)"\n')
        argv = [
            str(VENV_BIN / "execute_batch"), "batch_script.sh",
            "--machines", *bench.machines(names),
            "--memory-required=2000",
        ]  # fmt: skip
        return Cmd(argv, cwd, env=bench.env)

    def startup(cwd: Path) -> Cmd:
        return Cmd([str(VENV_BIN / "execute_batch"), "--help"], cwd, env=bench.env)

    held: list[int] = []
    cold = Tool(SSH_TOOL + " cold", ssh, verify_batch(4), 4, "ssh_scheduler", profile_argv=profile_argv)
    pair, warm = cold_then_warm(cold, lambda: bench.make_cold(names=names), held)
    startup_only = Tool("execute_batch --help (start-up only)", startup, kind="info")

    def targets(s: Scenario) -> list[Target]:
        s.computed["connections_held_before_cold"] = held
        return [
            wall_target("cold: start to finish <= 0.4 s", cold, 0.4),
            wall_target("warm: start to finish <= 0.25 s", warm, 0.25),
            first_job_target(cold, 0.3, " (cold)"),
            first_job_target(warm, 0.1, " (warm)"),
        ]

    return Scenario(
        "7",
        "the ancestor README's 4-line example (Step 2, flags of Step 5) on 2 hosts with 2 GPUs each",
        [pair, Group([startup_only])],
        {"jobs": 4, "hosts": 2, "flags": "--memory-required=2000"},
        targets,
        notes=[
            "examples/local.sh exists in the working directory, so all 4 jobs succeed",
            "launch to first job: the journal's first 'started' against the process's start",
        ],
    )


def scenario_remote(bench: Bench) -> Scenario:
    host = "h1"
    held: list[int] = []

    def remote(cwd: Path) -> Cmd:
        argv = [str(VENV_BIN / "execute_remote"), "--machine", *bench.machines([host]), "hostname"]
        return Cmd(argv, cwd, env=bench.env)

    cold = Tool(SSH_TOOL + " execute_remote cold", remote, verify_lines(1, host), 1, "ssh_scheduler",
                profile_argv=profile_argv)  # fmt: skip
    pair, warm = cold_then_warm(cold, lambda: bench.make_cold(names=[host]), held)

    def targets(s: Scenario) -> list[Target]:
        s.computed["connections_held_before_cold"] = held
        return [wall_target("warm: end to end <= 0.15 s", warm, 0.15)]

    return Scenario(
        "remote",
        f"execute_remote: one command (hostname) on one host ({host}), end to end, cold then warm",
        [pair],
        {"host": host, "command": "hostname"},
        targets,
        notes=["run in an empty folder: the default --copy-forwards has nothing to send"],
    )
