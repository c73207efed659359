"""The command line on this machine (no SSH): argument forms and how it ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ssh_scheduler.cli.params import expand_multi_value

REPO = Path(__file__).resolve().parents[1]


def test_several_values_after_one_flag_become_repeated_flags() -> None:
    argv = ["b.sh", "--machines", "a.yaml", "b.yaml", "--copy-forwards", "x", "y", "--dry-run"]
    assert expand_multi_value(argv) == [
        "b.sh", "--machines", "a.yaml", "--machines", "b.yaml",
        "--copy-forwards", "x", "--copy-forwards", "y", "--dry-run",
    ]
    assert expand_multi_value(["--machines", "a", "--", "cmd"]) == ["--machines", "a", "cmd"]


def test_a_reader_that_goes_away_ends_the_batch_quietly(tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("echo x\n" * 200)
    (tmp_path / "empty").mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home"))
    command = (
        f"{sys.executable} -m ssh_scheduler execute_batch b.sh --no-gpu-required --num-cpus 0 "
        "--memory-required 0 --copy-forwards empty 2>err.txt | head -1; echo ${PIPESTATUS[0]}"
    )
    result = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.splitlines()[-1] == "141"
    assert "Traceback" not in (tmp_path / "err.txt").read_text()
