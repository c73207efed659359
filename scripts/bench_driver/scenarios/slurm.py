"""Through Slurm: scripts/bench_slurm.py starts its own test Slurm and measures both sides.

  slurm  (c) 1000 [200] x ``true`` through a test Slurm vs ``sbatch --array`` by hand (only
         when asked: --scenarios slurm)
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_driver.base import PY
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, Run, read, tail
from bench_driver.records import Group, Scenario, Target, Tool


def scenario_slurm(bench: Bench) -> Scenario:
    """(c) 1000 [200] jobs through Slurm vs ``sbatch --array`` by hand: scripts/bench_slurm.py
    starts its own test Slurm and measures both; its JSON line is kept as computed values."""
    jobs = 200 if bench.quick else 1000
    script = bench.code_root / "scripts" / "bench_slurm.py"

    def cmd(cwd: Path) -> Cmd:
        return Cmd([PY, str(script), "--jobs", str(jobs), "--rounds", "1"], cwd, env=bench.env)

    def verify(c: Cmd, run: Run) -> None:
        lines = read(c.cwd / "stdout.txt").strip().splitlines()
        run.extra["slurm"] = (
            json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        )
        if run.ok and not run.extra["slurm"]:
            run.ok, run.note = False, f"no result line: {tail(c.cwd / 'stderr.txt')}"

    tool = Tool(
        "execute_batch vs sbatch --array (bench_slurm.py)", cmd, verify, jobs, "ssh_scheduler"
    )

    def targets(s: Scenario) -> list[Target]:
        for run in tool.good():
            s.computed.update(run.extra["slurm"])
        return []

    return Scenario(
        "slurm",
        f"(c) {jobs} x true through Slurm vs one sbatch --array by hand",
        [Group([tool])],
        {"jobs": jobs},
        targets,
        rounds=1,
    )
