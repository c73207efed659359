"""A --commands line whose own inputs cannot be sent when its job is placed: that job fails with
the reason in one line, and the batch goes on (the jobs running finish, the rest start).

Each line's copy forward is checked before any job starts (it must exist: test_forward.py), but it
is walked only when its job is placed, and a folder can change in between.  Run on this machine
(no --machines): the jobs' own commands change the folder, so no timing is guessed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_line_whose_inputs_went_away_fails_alone_and_the_batch_goes_on(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "x").write_text("one\n")
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "y").write_text("two\n")
    (tmp_path / "home").mkdir()
    # b.sh.1 removes what b.sh.2 copies forward; b.sh.2 and b.sh.3 are placed together once it
    # ended, and b.sh.3 is still running when b.sh.2's walk finds nothing.
    (tmp_path / "b.sh").write_text(
        f"--job-name one --copy-forwards one 'rm -r {tmp_path}/two && cat one/x'\n"
        "--job-name two --after one --copy-forwards two 'cat two/y'\n"
        "--job-name three --after one --copy-forwards one 'sleep 1 && cat one/x > got && echo three'\n"
    )
    result = subprocess.run(
        [
            sys.executable, "-m", "ssh_scheduler", "execute_batch", "b.sh", "--commands", "--no-gpu-required",
            "--num-cpus", "0", "--memory-required", "0", "--copy-backwards", "got",
        ],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home")),
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out, err = result.stdout, result.stderr
    assert "Traceback" not in out + err, err
    assert result.returncode == 1, (out, err)  # one job failed; nothing ended the batch
    failed = [line for line in out.splitlines() if line.startswith("failed:")]
    assert len(failed) == 1 and "two" in failed[0], out
    assert "(--copy-forwards: two does not exist (relative to .)" in failed[0], out
    # Said in the job's line (and the summary's list of failures), never as the batch's error.
    assert not [line for line in err.splitlines() if line.startswith("error:")], err
    assert "  failed: two (--copy-forwards: two does not exist" in err, err
    assert any(line.startswith("finished:") and "three" in line for line in out.splitlines()), out
    assert (tmp_path / "job_results" / "three" / "got").read_text() == "one\n"
    assert (tmp_path / "job_results" / "three.out").read_text() == "three\n"
    assert not (tmp_path / "job_results" / "two").exists()
