"""The ancestor README's example, start to finish.

  7  its 4-line batch (Step 2, with the flags of Step 5) on the 2 hosts with 2 GPUs each, and
     ``execute_batch --help`` alone (the start-up)
"""

from __future__ import annotations

from pathlib import Path

from bench_driver.base import VENV_BIN
from bench_driver.bench import Bench
from bench_driver.measure import Cmd
from bench_driver.profiling import profile_argv
from bench_driver.records import SSH_TOOL, Group, Scenario, Target, Tool, first_job_target
from bench_driver.verify import verify_batch


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

    main = Tool(
        SSH_TOOL, ssh, verify_batch(4), 4, "ssh_scheduler", profile_argv=profile_argv
    )
    tools = [main, Tool("execute_batch --help (start-up only)", startup, kind="info")]

    def targets(s: Scenario) -> list[Target]:
        return [
            Target("start to finish <= 0.4 s", SSH_TOOL, main.median(), 0.4, False, " s"),
            first_job_target(main),
        ]

    return Scenario(
        "7",
        "the ancestor README's 4-line example (Step 2, flags of Step 5) on 2 hosts with 2 GPUs each",
        [Group([t]) for t in tools],
        {"jobs": 4, "hosts": 2, "flags": "--memory-required=2000"},
        targets,
        notes=["examples/local.sh exists in the working directory, so all 4 jobs succeed"],
    )
