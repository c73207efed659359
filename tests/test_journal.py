"""The journal and what a rerun learns from it (pure: files in tmp_path, no hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.planner.policy import Resumable
from ssh_scheduler.results.journal import (
    JOURNAL_NAME,
    Journal,
    batch_token,
    last_states,
    read_journal,
)
from ssh_scheduler.results.resume import changed_commands, in_flight


def test_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        journal.record("", "batch", token="0123456789abcdef")
        journal.record("a", "started", host="h1", gpus=[1], command="echo a")
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(b'{"job":"a","state":"fini')  # the coordinator died mid-write
    entries = read_journal(tmp_path)
    assert [e["state"] for e in entries] == ["batch", "started"]
    assert batch_token(tmp_path) == "0123456789abcdef"


def test_states_fold_and_keep_the_command(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        journal.record("a", "placed", host="h1", gpus=[0], command="echo a")
        journal.record("a", "started", host="h1", gpus=[0], command="echo a")
        journal.record("a", "failed", code=3, host="h1")
        journal.record("b", "started", host="h2", gpus=[], command="echo b")
    last = last_states(tmp_path)
    assert last["a"]["state"] == "failed" and last["a"]["command"] == "echo a"
    jobs = [Job("a", "echo A", 1), Job("b", "echo b", 2)]
    assert changed_commands(jobs, last) == ["a"]
    assert in_flight(jobs, last) == {"b": Resumable("b", "h2", ())}


def test_no_journal_means_a_new_batch(tmp_path: Path) -> None:
    assert read_journal(tmp_path) == [] and batch_token(tmp_path) is None


def test_a_job_cancelled_before_it_had_a_host_is_recorded_as_a_rerun_can_read_it(tmp_path: Path) -> None:
    """`ssh-scheduler cancel` of a queued job: its event names no host; the journal line must
    still be one the journal's own reader (status, report, a rerun) accepts."""
    from ssh_scheduler.events import JobCancelled
    from ssh_scheduler.results.journal import JournalWriter

    with Journal.open(tmp_path) as journal:
        writer = JournalWriter(journal)
        writer(JobCancelled(job="queued", host=""))
        writer(JobCancelled(job="running", host="h1"))
    entries = read_journal(tmp_path)
    assert [(e["job"], e["state"], e.get("host")) for e in entries] == [("queued", "cancelled", None), ("running", "cancelled", "h1")]


def test_each_state_change_is_one_line_with_what_a_rerun_reads(tmp_path: Path) -> None:
    """What the journal writes for each event, field by field (a rerun, `status` and `report`
    read these lines back), and the wall-clock time of each line."""
    import time

    from ssh_scheduler.events import (
        BatchStarted,
        JobFailed,
        JobFinished,
        JobPlaced,
        JobRequeued,
        JobRetrying,
        JobStarted,
    )
    from ssh_scheduler.results.journal import JournalWriter

    before = time.time()
    with Journal.open(tmp_path) as journal:
        writer = JournalWriter(journal)
        writer(BatchStarted(t=0, token="0123456789abcdef", jobs=3, hosts=("h1",)))
        writer(JobPlaced(t=0, job="a", host="h1", gpus=(0, 2), command="echo a"))
        writer(JobStarted(t=0, job="a", host="h1", gpus=(0, 2), command="echo a", attempt=2))
        writer(JobRetrying(t=0, job="a", host="h1", code=3, attempt=1, attempts=2))
        writer(JobRequeued(t=0, job="a", host="h1", reason="lost"))
        writer(
            JobFinished(
                t=0, job="a", host="h1", command="echo a", code=0, seconds=1.23456,
                bytes_received=42,
            )
        )  # fmt: skip
        writer(
            JobFailed(
                t=0, job="b", host="h2", command="echo b", code=None, reason="timeout",
                seconds=2.00049, timed_out=True, bytes_received=7, kept="h2:/tmp/b",
            )
        )  # fmt: skip
        writer(
            JobFailed(t=0, job="c", host="h2", command="echo c", code=1, reason="exit", seconds=0.5)
        )
    after = time.time()
    entries = read_journal(tmp_path)
    assert all(before - 0.001 <= e["t"] <= after + 0.001 for e in entries)
    assert [{k: v for k, v in e.items() if k != "t"} for e in entries] == [
        {"job": "", "state": "batch", "token": "0123456789abcdef", "jobs": 3},
        {"job": "a", "state": "placed", "host": "h1", "gpus": [0, 2], "command": "echo a"},
        {"job": "a", "state": "started", "host": "h1", "gpus": [0, 2], "command": "echo a"},
        {"job": "a", "state": "retry", "host": "h1", "code": 3},
        {"job": "a", "state": "requeued", "host": "h1"},
        {"job": "a", "state": "finished", "code": 0, "host": "h1", "timed_out": False, "seconds": 1.235, "bytes": 42},
        {"job": "b", "state": "failed", "code": None, "host": "h2", "timed_out": True, "seconds": 2.0, "bytes": 7, "kept": "h2:/tmp/b"},
        {"job": "c", "state": "failed", "code": 1, "host": "h2", "timed_out": False, "seconds": 0.5, "bytes": 0},
    ]  # fmt: skip


def test_a_full_disk_loses_no_line_and_the_batch_hears_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What cannot be written waits in memory, in order, and goes out with the next line that
    can (the rest of a short write first); `on_failure` hears it once; what still waits at the
    close is the batch's failure, counted in lines."""
    import errno
    import logging
    import os

    from ssh_scheduler.errors import LocalWriteError

    real_write = os.write
    disk = {"full": False, "short": False}

    def write(fd: int, data: bytes) -> int:
        if disk["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        if disk["short"]:
            disk["short"] = False
            return real_write(fd, data[:5])
        return real_write(fd, data)

    heard: list[str] = []
    with Journal.open(tmp_path, on_failure=heard.append) as journal:
        monkeypatch.setattr(os, "write", write)
        journal.record("a", "placed", host="h1", gpus=[], command="echo a")
        disk["full"] = True
        journal.record("a", "started", host="h1", gpus=[], command="echo a")
        journal.record("b", "placed", host="h1", gpus=[], command="echo b")
        assert len(heard) == 1 and JOURNAL_NAME in heard[0] and "No space left" in heard[0]
        disk["full"], disk["short"] = False, True
        with caplog.at_level(logging.INFO, logger="ssh_scheduler.results.journal"):
            journal.record("b", "started", host="h1", gpus=[], command="echo b")
        assert f"{JOURNAL_NAME}: written again" in caplog.text
        monkeypatch.undo()
    assert [(e["job"], e["state"]) for e in read_journal(tmp_path)] == [
        ("a", "placed"), ("a", "started"), ("b", "placed"), ("b", "started"),
    ]  # fmt: skip
    assert len(heard) == 1

    later = tmp_path / "later"
    later.mkdir()
    with (
        pytest.raises(LocalWriteError) as err,
        Journal.open(later, on_failure=heard.append) as journal,
    ):
        monkeypatch.setattr(os, "write", write)
        disk["full"] = True
        journal.record("c", "placed", host="h1", gpus=[], command="echo c")
        journal.record("c", "started", host="h1", gpus=[], command="echo c")
    monkeypatch.undo()
    assert "No space left" in str(err.value)
    assert str(err.value).endswith(
        ": 2 lines of the journal could not be written; a rerun runs those jobs again"
    )
