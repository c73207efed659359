"""combine_folders on many small files: scripts/bench_combine.py as a whole process (from the
measured code when --ref has it), 100k [20k] files in three sources.

  combine  its wall, and its own timing of combine_folders alone (computed)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench_driver.base import PY
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, Run, read, tail
from bench_driver.records import Group, Scenario, Target, Tool


def scenario_combine(bench: Bench) -> Scenario:
    files = 20_000 if bench.quick else 100_000

    def cmd(cwd: Path) -> Cmd:
        script = bench.code_root / "scripts" / "bench_combine.py"
        return Cmd(
            [PY, str(script), "--files", str(files), "--workdir", str(cwd)], cwd, env=bench.env
        )

    def verify(c: Cmd, run: Run) -> None:
        try:
            data = json.loads(read(c.cwd / "stdout.txt").strip().splitlines()[-1])
        except (ValueError, IndexError):
            data = {}
        run.extra["combine"] = data
        if run.ok and "seconds" not in data:
            run.ok, run.note = False, f"no result line: {tail(c.cwd / 'stderr.txt')}"

    tool = Tool("combine_folders (bench_combine.py)", cmd, verify, files, "ssh_scheduler")

    def targets(s: Scenario) -> list[Target]:
        secs = [r.extra["combine"]["seconds"] for r in tool.good()]
        if secs:
            med = statistics.median(secs)
            s.computed["combine_seconds_median"] = med
            s.computed["combine_files_per_s"] = round(files / med)
        return []

    return Scenario(
        "combine",
        f"combine_folders of {files:,} small files (3 sources, a third identical): scripts/bench_combine.py",
        [Group([tool])],
        {"files": files},
        targets,
        notes=[
            "wall = the whole bench_combine.py process (builds the trees too); "
            "'combine_seconds_median' in the JSON is its own timing of combine_folders alone"
        ],
        rounds=1 if bench.quick else min(2, bench.args.rounds),
        report_first=combine_alone,
    )


def combine_alone(s: Scenario) -> list[str]:
    c = s.computed
    if "combine_seconds_median" not in c:
        return []
    return [f"combine_folders alone: {c['combine_seconds_median']:.2f} s = {c['combine_files_per_s']:,} files/s"]
