"""A --commands line whose own inputs cannot be sent when its job is placed: that job fails with
the reason in one line, and the batch goes on (the jobs running finish, the rest start).

Each line's copy forward is checked before any job starts (it must exist: test_forward.py), but it
is walked only when its job is placed, and a folder can change in between.  Run on this machine
(no --machines): the jobs' own commands change the folder, and a job waits for the batch's own
line, so no timing is guessed."""

from __future__ import annotations

from pathlib import Path

from tests.live_batch import LiveBatch, batch_env


def test_a_line_whose_inputs_went_away_fails_alone_and_the_batch_goes_on(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "x").write_text("one\n")
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "y").write_text("two\n")
    (tmp_path / "home").mkdir()
    gate = tmp_path / "gate"
    # one removes what two copies forward; two and three are placed together once it ended, and
    # three runs until the test has seen two fail (the gate), so it is running when two fails.
    (tmp_path / "b.sh").write_text(
        f"--job-name one --copy-forwards one 'rm -r {tmp_path}/two && cat one/x'\n"
        "--job-name two --after one --copy-forwards two 'cat two/y'\n"
        f"--job-name three --after one --copy-forwards one 'while [ ! -e {gate} ]; do sleep 0.05; done; "
        "cat one/x > got && echo three'\n"
    )
    batch = LiveBatch(
        tmp_path, "b.sh", "--commands", "--no-gpu-required", "--num-cpus", "0", "--memory-required", "0",
        "--copy-backwards", "got", env={**batch_env(), "HOME": str(tmp_path / "home")},
    )  # fmt: skip
    try:
        (failed,) = batch.wait_for("failed:")  # without the fix: the batch ends first, with an error
        gate.touch()
        code = batch.finish(timeout=120)
    finally:
        gate.touch()
        if batch.proc.poll() is None:
            batch.kill()
    out, err = "\n".join(batch.out), "\n".join(batch.err)
    assert "Traceback" not in out + err, err
    assert code == 1, batch.text()  # one job failed; nothing ended the batch
    assert failed.startswith("failed: two;") and "(--copy-forwards: two does not exist (relative to .)" in failed, out
    assert [line for line in batch.out if line.startswith("failed:")] == [failed]
    # Said in the job's line (and the summary's list of failures), never as the batch's error.
    assert not [line for line in batch.err if line.startswith("error:")], err
    assert "  failed: two (--copy-forwards: two does not exist" in err, err
    assert any(line.startswith("finished: three;") for line in batch.out), out
    assert (tmp_path / "job_results" / "three" / "got").read_text() == "one\n"
    assert (tmp_path / "job_results" / "three.out").read_text() == "three\n"
    assert not (tmp_path / "job_results" / "two").exists()
