"""What the coordinator writes HERE (issue 23): the results folder is a real folder of ours,
entered by one verified descriptor; a write that fails (a real full file system: a small tmpfs,
mounted for the test as root) is said once as the batch's failure and never raises into the
host's reader; the journal is private and loses no line to a full disk; the summary names only
files that exist.  The end-to-end cases are in test_full_disk_cluster.py."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.jobrun import OutputFiles
from ssh_scheduler.errors import ConfigError, LocalWriteError
from ssh_scheduler.events import Ended, HostDown, JobFailed, JobRequeued, Stopping
from ssh_scheduler.planner.actions import Commit, Discard, PlanOptions
from ssh_scheduler.results.journal import JOURNAL_NAME, JobState, Journal, read_journal
from ssh_scheduler.results.results_folder import LOCK_NAME, hold_results_folder
from ssh_scheduler.results.summary import BatchSummary, JobOutcome
from ssh_scheduler.view.display import summary_lines
from tests.cluster import skip_or_fail
from tests.test_plan_copyback import CPU, exit_, jobs, planner, said, started

NOBODY = 65534


@contextlib.contextmanager
def small_disk(path: Path, size: str = "2m") -> Iterator[Path]:
    """``path`` as a fresh tmpfs of ``size``: a real file system that really fills.  Ours, mode
    0755 (a tmpfs root is 1777 by default: a folder every user can write)."""
    if os.geteuid() != 0:
        skip_or_fail("mounting a tmpfs needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(folder: Path) -> Path:
    """Fill ``folder``'s file system to the last byte; returns the file to delete for room."""
    ballast = folder / "ballast"
    with contextlib.suppress(OSError), ballast.open("wb") as f:
        while True:
            f.write(b"\0" * 65536)
    return ballast


# --- the results folder ----------------------------------------------------------------------


def test_a_results_folder_that_is_a_link_or_not_ours_alone_is_refused_in_one_line(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "linked").symlink_to(elsewhere)
    with pytest.raises(ConfigError) as err, hold_results_folder(tmp_path / "linked"):
        pass
    assert str(err.value).startswith(f"cannot use {tmp_path}/linked/ for results: it is a symbolic link (to {elsewhere})")
    assert os.listdir(elsewhere) == []  # no lock, no journal written through it

    if os.geteuid() != 0:
        skip_or_fail("changing a folder's owner needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="it belongs to nobody, not to you") as err, hold_results_folder(theirs):
        pass
    assert "\n" not in str(err.value) and "--results-dir" in str(err.value)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=r"every user can write it \(mode 777\); chmod o-w it"), hold_results_folder(shared):
        pass
    group = tmp_path / "group"
    group.mkdir()
    os.chown(group, 0, NOBODY)
    group.chmod(0o775)
    with pytest.raises(ConfigError, match=r"its group can write it \(mode 775\); chmod g-w it"), hold_results_folder(group):
        pass
    os.chown(group, 0, 0)  # our own private group (root's, here): as OpenSSH, accepted
    with hold_results_folder(group) as folder:
        assert folder is not None and os.path.samestat(os.fstat(folder), os.stat(group))
    assert os.listdir(theirs) == os.listdir(shared) == []


def test_the_folder_made_for_results_is_ours_alone_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        with hold_results_folder(tmp_path / "made" / "job_results"):
            pass
        with hold_results_folder(tmp_path / "made" / "job_results"):  # and usable again
            (tmp_path / "made" / "job_results" / "kept").write_text("")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "made" / "job_results").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "made" / "job_results" / LOCK_NAME).stat().st_mode) == 0o600


# --- the journal -----------------------------------------------------------------------------


def test_the_journal_is_private_and_never_written_through_a_link(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        journal.record("b.sh.1", JobState.STARTED, command="secret-token=42 python train.py")
    assert stat.S_IMODE((tmp_path / JOURNAL_NAME).stat().st_mode) == 0o600
    (tmp_path / JOURNAL_NAME).chmod(0o644)  # as an older version left it
    with Journal.open(tmp_path):
        pass
    assert stat.S_IMODE((tmp_path / JOURNAL_NAME).stat().st_mode) == 0o600
    other = tmp_path / "other"
    other.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (other / JOURNAL_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="is a symbolic link; remove it"), Journal.open(other):
        pass
    assert target.read_text() == "keep me\n"


def test_a_full_disk_loses_no_journal_line_and_is_said_once(tmp_path: Path) -> None:
    said: list[str] = []
    with small_disk(tmp_path / "job_results") as results:
        ballast = fill(results)
        with pytest.raises(LocalWriteError) as err, Journal.open(results, on_failure=said.append) as journal:
            journal.record("b.sh.1", JobState.STARTED, host="h1")  # does not raise: the batch goes on
            journal.record("b.sh.2", JobState.STARTED, host="h1")
            assert said == [f"no space left in {results}/: .journal.jsonl (No space left on device)"]
            ballast.unlink()  # room again: the next line writes those waiting first, in order
            journal.record("b.sh.1", JobState.FINISHED, code=0)
            assert [(e["job"], e["state"]) for e in read_journal(results)] == [
                ("b.sh.1", "started"), ("b.sh.2", "started"), ("b.sh.1", "finished")
            ]
            ballast = fill(results)
            journal.record("b.sh.2", JobState.FAILED, code=3, command="x" * 5000)  # past the page it has
        # Still full when the journal closes: the batch's failure, in one line.
        assert str(err.value) == (
            f"no space left in {results}/: .journal.jsonl (No space left on device): 1 lines of the "
            "journal could not be written; a rerun runs those jobs again"
        )
        assert len(said) == 2  # once per time it filled up


# --- job output ------------------------------------------------------------------------------


def test_output_on_a_full_disk_never_raises_and_is_the_batch_s_failure_said_once(tmp_path: Path) -> None:
    said: list[str] = []
    read_end, write_end = os.pipe()
    with small_disk(tmp_path / "job_results") as results:
        fill(results)
        output = OutputFiles(results, "job.1", mirror={1: [write_end]}, on_failure=said.append)
        output.open()
        for _ in range(3):
            output.write(1, b"x" * 1000)  # a raise here would end the host's reader: "host lost"
            output.write(2, b"y")
        assert output.complete() == output.failure
        output.close()
        os.close(write_end)
        assert said == [f"no space left in {results}/: writing job.1.out (No space left on device)"]
        assert output.failure == said[0]
        assert os.read(read_end, 10000) == b"x" * 3000  # the terminal still gets all of it
        os.close(read_end)


def test_the_summary_names_where_results_stay_and_only_files_that_exist(tmp_path: Path) -> None:
    summary = BatchSummary()
    summary.outcomes["kept"] = JobOutcome("kept", "h1", Ended(0, message="no space left", kept_at="h1:/w/jobs/t-kept"))
    summary.outcomes["refused"] = JobOutcome("refused", "h2", Ended(None, message="cannot write"))
    (tmp_path / "kept.err").write_text("")
    (tmp_path / "refused.err").symlink_to(tmp_path / "kept.err")  # not the job's own file
    assert summary.failed == ["kept", "refused"]
    failed_lines = [line for line in summary_lines(summary, tmp_path) if line.startswith("  failed:")]
    assert failed_lines == [
        f"  failed: kept (exit 0, not copied back on h1): results kept on h1:/w/jobs/t-kept; {tmp_path}/kept.err",
        "  failed: refused (cannot write on h2)",
    ]


# --- what the planner makes of it ----------------------------------------------------------


def test_a_local_failure_halts_the_batch_once_and_retries_nothing() -> None:
    """Plain values: the planner's side of a full disk here."""
    plan, actions = planner(jobs(4), PlanOptions(CPU, retries=2), cpus=1)  # one job at a time
    assert started(actions) == ["j0"]
    halt = plan.local_failure("no space left in job_results/: writing j0.out (No space left on device)")
    assert [(s.how, s.reason) for s in said(halt, Stopping)] == [
        ("halt", "no space left in job_results/: writing j0.out (No space left on device); no new jobs start")
    ]
    assert plan.local_failure("again") == []  # said once
    # Its end: no retry (a retry would meet the same disk), no new job in the room it freed.
    at_exit = exit_(plan, "j0", code=1)
    assert [a for a in at_exit if isinstance(a, Discard)] == [] and started(at_exit) == []
    assert any(isinstance(a, Commit) for a in at_exit)
    at_commit = plan.job_committed("j0", Ended(1, message="no space left", kept_at="h0:/w/jobs/t-j0"))
    (failed,) = said(at_commit, JobFailed)
    assert (failed.code, failed.kept, failed.reason) == (1, "h0:/w/jobs/t-j0", "exit 1, not copied back")
    assert started(at_commit) == [] and plan.done and plan.halted
    assert plan.unfinished() == ["j1", "j2", "j3"]
    assert said(halt + at_exit + at_commit, HostDown) == said(halt + at_exit + at_commit, JobRequeued) == []
