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
        "ssh_scheduler_tree_hash": sh(
            ["sh", "-c", f"cd {REPO} && find ssh_scheduler -name '*.py' | sort | xargs cat | sha256sum | cut -c1-12"]
        ),
    }
