"""The untimed profiled runs of --profile: each ssh_scheduler command once more under
pyinstrument (wall clock, async-aware) and once under py-spy (on-CPU samples, summarised by
scripts/bench_profile.py) into bench/profiles/."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from bench_profile import summarise

from bench_driver.base import PROFILES_DIR, PY, REPO, VENV_BIN, log
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, run_cmd
from bench_driver.records import Scenario


def profile_argv(cmd: Cmd, base: Path, profiler: str) -> list[str]:
    """The same ssh_scheduler command (python -m ssh_scheduler CMD ...) under a profiler."""
    sub = Path(cmd.argv[0]).name
    if profiler == "pyinstrument":
        return [
            str(VENV_BIN / "pyinstrument"),
            "-o",
            f"{base}.pyinstrument.txt",
            "-m",
            "ssh_scheduler",
            sub,
            *cmd.argv[1:],
        ]
    return [str(VENV_BIN / "py-spy"), "record", "-r", "250", "--format", "raw", "-o", f"{base}.pyspy.raw",
            "--", PY, "-m", "ssh_scheduler", sub, *cmd.argv[1:]]  # fmt: skip


def profile(bench: Bench, s: Scenario) -> None:
    """One extra, untimed run of each of the scenario's ssh_scheduler commands under each
    profiler; the py-spy summary's top lines go into ``s.computed["profiles"]``."""
    PROFILES_DIR.mkdir(parents=True, exist_ok=True)
    for group in s.groups:
        for tool in group.tools:
            if tool.profile_argv is None:
                continue
            slug = re.sub(r"[^A-Za-z0-9]+", "-", tool.name).strip("-").lower()
            base = PROFILES_DIR / f"s{s.sid}-{slug}"
            for profiler in ("pyinstrument", "py-spy"):
                group.setup()
                try:
                    cwd = bench.rundir(s.sid, f"{tool.name}-{profiler}")
                    cmd = tool.prepare(cwd)
                    cmd.argv = tool.profile_argv(cmd, base, profiler)
                    run = run_cmd(cmd)
                    log(f"  {profiler} {tool.name}: {run.wall:.2f} s -> {base}.*")
                    shutil.rmtree(cwd, ignore_errors=True)
                finally:
                    group.teardown()
            raw = Path(f"{base}.pyspy.raw")
            if raw.exists():
                text = summarise(raw, 25, "ssh_scheduler/")
                Path(f"{base}.pyspy.txt").write_text(text + "\n")
                s.computed.setdefault("profiles", {})[tool.name] = {
                    "files": [
                        f"{base.relative_to(REPO)}.pyinstrument.txt",
                        f"{base.relative_to(REPO)}.pyspy.txt",
                    ],
                    "top": text.splitlines()[:16],
                }
