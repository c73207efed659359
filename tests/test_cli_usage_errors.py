"""A command line click refuses (an unknown option, a value of the wrong type, a missing argument)
is one ``error:`` line naming the flag and where to look, exit status 2, as every other refusal
is: not click's framed box of usage, hint and message over five lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_batch import batch_env

MODULE = [sys.executable, "-m", "ssh_scheduler"]
SCRIPT = Path(sys.executable).parent / "execute_batch"  # the console script, as users run it


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=batch_env(), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["execute_batch", "b.sh", "--keep-warm", "abc"], ["'--keep-warm'", "'abc' is not a valid float",
                                                          "(see ssh-scheduler execute_batch --help)"]),
        (["execute_batch", "b.sh", "--max-connecting", "x"], ["'--max-connecting'", "'x'"]),
        (["execute_batch", "b.sh", "--no-such-flag"], ["No such option: --no-such-flag"]),
        (["execute_batch"], ["Missing argument", "batch_file"]),
        (["execute_remote", "--machine"], ["--machine", "requires an argument"]),
        (["execute_to", "--bogus", "true"], ["No such option: --bogus", "(see ssh-scheduler execute_to --help)"]),
        (["status", "--bogus"], ["No such option: --bogus", "(see ssh-scheduler status --help)"]),
    ],
)
def test_a_refused_command_line_is_one_error_line(args: list[str], words: list[str], tmp_path: Path) -> None:
    result = run([*MODULE, *args], tmp_path)
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not any(ch in result.stderr for ch in "╭│╰"), result.stderr  # no framed box


def test_the_console_script_says_its_own_name(tmp_path: Path) -> None:
    if not SCRIPT.exists():
        pytest.fail(f"{SCRIPT} is missing: the package is not installed in this interpreter's environment")
    result = run([str(SCRIPT), "b.sh", "--keep-warm", "abc"], tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("error: Invalid value for '--keep-warm': 'abc' is not a valid float "
                             "(see execute_batch --help)\n")


def test_no_words_at_all_still_show_the_help(tmp_path: Path) -> None:
    result = run(MODULE, tmp_path)
    assert result.returncode == 2
    assert "Usage: ssh-scheduler" in result.stdout and "execute_batch" in result.stdout


def test_help_still_exits_zero(tmp_path: Path) -> None:
    result = run([*MODULE, "execute_batch", "--help"], tmp_path)
    assert result.returncode == 0 and "Usage:" in result.stdout and result.stderr == ""
