"""The machine and the measured code, for the report and the JSON: cores, CPU model, memory,
load, OS, Python and asyncssh, the peers' versions, the git commit and the package's tree hash."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_driver.base import PY, REPO

# What measures (the driver, its floors and peers' helpers, the test cluster): a change there
# changes the numbers too, so the result says when it was not committed.
BENCH_CODE = ("scripts/bench", "scripts/bench_run.py", "scripts/bench_driver", "scripts/bench_floor.py", "scripts/bench_floor_common.py",
              "scripts/bench_agent_floor.py", "scripts/bench_agent_floor_host.py", "scripts/bench_fanout.py",
              "scripts/bench_kex.py", "scripts/bench_slurm.py", "scripts/bench_combine.py", "tests/cluster")


def label(env: dict[str, Any]) -> tuple[str, str]:
    """(what was measured, in words; the result file's label).  A run is labelled with a commit
    only when the package is that commit's: with uncommitted changes to it, the label says
    ``<sha>-dirty`` and the words say the commit is not what was measured."""
    sha = env["git_sha"]
    changed = env["ssh_scheduler_uncommitted_changes"]
    if changed:
        return (f"the working tree: git {sha} plus uncommitted changes to {len(changed)} package "
                f"file(s), not commit {sha}", f"{sha}-dirty")  # fmt: skip
    bench = env.get("bench_uncommitted_changes") or []
    return f"git {sha}" + (f" (the benchmark's own code has {len(bench)} uncommitted change(s))" if bench else ""), sha


def sh(argv: Sequence[str], cwd: Path | None = None) -> str:
    try:
        r = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=20, check=False, cwd=cwd
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (r.stdout or r.stderr).strip()


def environment() -> dict[str, Any]:
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_total = ""
    with contextlib.suppress(OSError, IndexError):
        mem_total = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    dirty = sh(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "ssh_scheduler", "pyproject.toml"]
    )
    bench_dirty = sh(["git", "-C", str(REPO), "status", "--porcelain", "--", *BENCH_CODE])
    asyncssh_version = sh([PY, "-c", "import asyncssh; print(asyncssh.__version__)"])
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_total": mem_total,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "kernel": platform.release(),
        "os": sh(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "python": sys.version.split()[0],
        "asyncssh": asyncssh_version,
        "openssh": sh(["ssh", "-V"]),
        "parallel": sh(["parallel", "--version"]).splitlines()[0]
        if shutil.which("parallel")
        else None,
        "pdsh": sh(["pdsh", "-V"]).splitlines()[0] if shutil.which("pdsh") else None,
        "git_sha": sh(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or "nogit",
        "git_subject": sh(["git", "-C", str(REPO), "log", "-1", "--format=%s"]),
        "ssh_scheduler_uncommitted_changes": dirty.splitlines() if dirty else [],
        "bench_uncommitted_changes": bench_dirty.splitlines() if bench_dirty else [],
        "ssh_scheduler_tree_hash": sh(
            ["sh", "-c", f"cd {REPO} && find ssh_scheduler -name '*.py' | sort | xargs cat | sha256sum | cut -c1-12"]
        ),
    }
