"""The open-file limit a many-host batch needs: raised up to the hard limit, or one clear line
with the fix.  Each case runs in a fresh interpreter whose limits it sets first (lowering a
hard limit cannot be undone in-process)."""

from __future__ import annotations

import subprocess
import sys

from ssh_scheduler.coordinator.open_files import files_needed


def with_limits(soft: int, hard: int, hosts: int) -> subprocess.CompletedProcess[str]:
    code = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "from ssh_scheduler.errors import ConfigError\n"
        "from ssh_scheduler.coordinator.open_files import raise_open_files_limit\n"
        "try:\n"
        f"    print(raise_open_files_limit({hosts}), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "except ConfigError as exc:\n"
        "    print('error:', exc)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_the_soft_limit_is_raised_to_the_hard_one_when_the_hosts_need_it() -> None:
    assert files_needed(256) > 256
    assert with_limits(256, 4096, 256).stdout.split() == ["4096", "4096"]


def test_enough_already_is_left_alone() -> None:
    assert with_limits(1024, 4096, 8).stdout.split() == ["1024", "1024"]


def test_a_hard_limit_too_low_is_one_line_with_the_fix() -> None:
    out = with_limits(256, 512, 256).stdout
    assert out.count("\n") == 1 and out.startswith("error: 256 hosts need about")
    assert f"ulimit -n {files_needed(256)}" in out and "(hard limit)" in out
