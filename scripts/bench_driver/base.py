"""Where the benchmark finds things (the repository, the measured venv, the results and profile
folders) and its progress log line (stderr: stdout carries the table)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
PY = str(VENV_BIN / "python")
RESULTS_DIR = REPO / "bench" / "results"
PROFILES_DIR = REPO / "bench" / "profiles"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
