"""Through Slurm: scripts/bench_slurm.py starts its own test Slurm and measures both sides.

  slurm  (c) 300 [100] x ``true`` through a test Slurm vs one ``sbatch --array=1-300`` by hand
         from the login node, in alternation for --rounds rounds (one Slurm for them all)
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_driver.base import PY, REPO
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, Run, read, tail
from bench_driver.records import Group, Scenario, Target, Tool


def scenario_slurm(bench: Bench) -> Scenario:
    """(c) 300 [100] jobs through Slurm vs ``sbatch --array`` by hand: scripts/bench_slurm.py
    starts its own test Slurm and measures both sides, alternating, every round; its JSON line
    is kept as computed values, and its per-round pairs make the target's rounds."""
    jobs = 100 if bench.quick else 300
    rounds = bench.args.rounds
    script = REPO / "scripts" / "bench_slurm.py"

    def cmd(cwd: Path) -> Cmd:
        argv = [PY, str(script), "--jobs", str(jobs), "--rounds", str(rounds)]
        return Cmd(argv, cwd, env=bench.env)

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
        ratios: list[float | None] = []
        for run in tool.good():
            s.computed.update(run.extra["slurm"])
            ratios = [r["ratio_us_to_hand"] for r in run.extra["slurm"].get("per_round", [])]
        return [Target(f"wall <= 1.1 x one sbatch --array=1-{jobs} by hand", tool.name, ratios, 1.1, False, "x")]

    return Scenario(
        "slurm",
        f"(c) {jobs} x true through Slurm vs one sbatch --array=1-{jobs} by hand from the login node",
        [Group([tool])],
        {"jobs": jobs, "rounds_inside": rounds},
        targets,
        rounds=1,
        notes=[f"one process runs all {rounds} rounds on one test Slurm, the two sides alternating; "
               "the by-hand ssh login uses our key exchange and cipher"],
        report_first=slurm_walls,
    )


def slurm_walls(s: Scenario) -> list[str]:
    rounds = s.computed.get("per_round") or []
    return [f"round {i}: by hand {r['by_hand_s']} s, through us {r['through_us_s']} s"
            for i, r in enumerate(rounds, 1)]  # fmt: skip
