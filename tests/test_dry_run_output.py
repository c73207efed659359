"""A dry run's plan is printed a buffer at a time (``cli.common.out_line_held``), not a write per
line: the lines must all come, in order, with every stderr line where it was printed among them
(stdout and stderr into one file, as ``> log 2>&1`` has them), and a reader that goes away must
end the command as quietly as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL = ["--no-gpu-required", "--num-cpus", "0", "--memory-required", "0", "--copy-forwards", "empty"]
JOBS = 3000


def batch(tmp: Path, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp / "home"))
    return subprocess.run(
        [sys.executable, "-m", "ssh_scheduler", "execute_batch", *args, *LOCAL],
        cwd=tmp, env=env, text=True, timeout=120, check=False, **kwargs,  # type: ignore[call-overload]
    )


def an_earlier_failure(tmp: Path) -> None:
    """Job ``a`` failed in an earlier run, so the dry run skips it (a line on stdout) and does not
    run ``b``, which waits for it (a line on stderr, between the header and the plan)."""
    (tmp / "empty").mkdir()
    (tmp / "first.sh").write_text("--job-name a false\n")
    assert batch(tmp, "first.sh", "--commands", capture_output=True).returncode == 1
    lines = ["--job-name a false", "--job-name b --after a true"] + [f"--job-name j{i} true" for i in range(JOBS)]
    (tmp / "b.sh").write_text("".join(line + "\n" for line in lines))


def test_the_plan_and_the_lines_to_stderr_come_in_the_order_printed(tmp_path: Path) -> None:
    an_earlier_failure(tmp_path)
    with open(tmp_path / "log", "w") as log:  # one file for both, as `> log 2>&1`
        done = batch(tmp_path, "b.sh", "--commands", "--dry-run", stdout=log, stderr=subprocess.STDOUT)
    lines = (tmp_path / "log").read_text().splitlines()
    assert done.returncode == 1, lines[-5:]  # (b does not run)
    header = [  # stdout, stdout, stdout, stdout, stderr: as the events came
        "WARNING: job results already exists for line 1",
        "copy forward (empty): 0 files",
        "machine limits:",
        "machine gpu choices:",
        "not run: b (a failed in an earlier run",
    ]
    assert [line[: len(start)] for line, start in zip(lines, header, strict=False)] == header
    plan = [f"plan: j{i} -> localhost CUDA_VISIBLE_DEVICES=" for i in range(JOBS)]
    assert lines[len(header) :] == plan


def test_a_reader_that_goes_away_ends_the_dry_run_quietly(tmp_path: Path) -> None:
    an_earlier_failure(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home"))
    command = (
        f"{sys.executable} -m ssh_scheduler execute_batch b.sh --commands --dry-run {' '.join(LOCAL)} "
        "2>err.txt | head -1; echo ${PIPESTATUS[0]}"
    )
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines()[0].startswith("WARNING: job results already exists for line 1")
    assert result.stdout.splitlines()[-1] == "141"
    err = (tmp_path / "err.txt").read_text()
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_a_library_warning_comes_after_the_lines_held_before_it(tmp_path: Path) -> None:
    """The command line's log handler (``warning: ...`` on stderr) writes what
    ``out_line_held`` kept first, as ``err_line`` does."""
    script = (
        "import logging\n"
        "from ssh_scheduler.cli.common import err_line, out_line_held, write_held\n"
        "from ssh_scheduler.cli.main import show_library_logs\n"
        "show_library_logs()\n"
        "out_line_held('one'); logging.getLogger('ssh_scheduler.x').warning('two')\n"
        "out_line_held('three'); err_line('four'); out_line_held('five'); write_held()\n"
    )
    with open(tmp_path / "log", "w") as log:
        subprocess.run(
            [sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log,
            stderr=subprocess.STDOUT, check=True, timeout=60,
        )
    assert (tmp_path / "log").read_text().splitlines() == ["one", "warning: two", "three", "four", "five"]


def test_a_line_to_stderr_is_printed_when_the_reader_of_stdout_went_away() -> None:
    """What was held for a reader that left is dropped; the line to stderr (an error, say) is
    still printed."""
    script = (
        "import sys\n"
        "from ssh_scheduler.cli.common import err_line, out_line_held\n"
        "sys.stdin.readline()\n"  # (until the reader of stdout is gone)
        "out_line_held('plan: x'); err_line('error: shown'); err_line('and after it')\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdin is not None
    child.stdout.close()
    _, err = child.communicate(b"go\n", timeout=60)
    assert (child.returncode, err.decode().splitlines()) == (0, ["error: shown", "and after it"])
