"""How the journal is written: a private file, appended to and never through a link; ``fsync``
grouped to once a second; a full disk that loses no line and is heard once each time it fills.
(Pure: files in tmp_path, ``os`` calls and the clock stood in for where a disk cannot be made
to fail on cue.)"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ssh_scheduler.errors import ConfigError, LocalWriteError
from ssh_scheduler.results import journal as journal_module
from ssh_scheduler.results.journal import FSYNC_EVERY, JOURNAL_NAME, JobState, Journal, read_journal

LOGGER = "ssh_scheduler.results.journal"


@pytest.fixture
def descriptors(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The descriptors ``os.open`` gave and those ``os.close`` closed, from here on (counted
    rather than read from /proc, which another thread's files would change)."""
    seen: dict[str, list[int]] = {"opened": [], "closed": []}
    real_open, real_close = os.open, os.close

    def opened(*args: Any, **kwargs: Any) -> int:
        fd = real_open(*args, **kwargs)
        seen["opened"].append(fd)
        return fd

    def closed(fd: int) -> None:
        real_close(fd)
        seen["closed"].append(fd)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "close", closed)
    return seen


# ---------------------------------------------------------------- a private file, never a link


def test_a_new_journal_is_created_private_not_made_private_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0600 from its first moment: a journal created wider and chmod-ed after could be opened
    by another user in between, and it holds every command."""
    chmods: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "fchmod", lambda fd, mode: chmods.append((fd, mode)))
    old = os.umask(0o022)
    try:
        with Journal.open(tmp_path) as journal:
            journal.record("a", JobState.PLACED, host="h1")
    finally:
        os.umask(old)
    assert chmods == []
    assert stat.S_IMODE((tmp_path / JOURNAL_NAME).stat().st_mode) == 0o600


def test_an_older_wider_journal_is_made_private_through_its_own_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / JOURNAL_NAME).write_text("")
    (tmp_path / JOURNAL_NAME).chmod(0o644)
    real_fchmod = os.fchmod
    chmods: list[int] = []

    def fchmod(fd: int, mode: int) -> None:
        chmods.append(mode)
        real_fchmod(fd, mode)

    monkeypatch.setattr(os, "fchmod", fchmod)
    with Journal.open(tmp_path) as journal:
        assert stat.S_IMODE(os.fstat(journal.fd).st_mode) == 0o600
    assert chmods == [0o600]
    assert stat.S_IMODE((tmp_path / JOURNAL_NAME).stat().st_mode) == 0o600
    with Journal.open(tmp_path):  # private already: left as it is
        pass
    assert chmods == [0o600]


def test_a_rerun_appends_after_the_lines_an_earlier_run_wrote(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        journal.record("", JobState.BATCH, token="0123456789abcdef")
        journal.record("a", JobState.PLACED, host="h1")
    with Journal.open(tmp_path) as journal:
        journal.record("a", JobState.STARTED, host="h1")
    assert [(e["job"], e["state"]) for e in read_journal(tmp_path)] == [("", "batch"), ("a", "placed"), ("a", "started")]


def test_a_link_at_the_journal_s_name_is_refused_in_its_own_words(
    tmp_path: Path, descriptors: dict[str, list[int]]
) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    results = tmp_path / "results"
    results.mkdir()
    (results / JOURNAL_NAME).symlink_to(target)
    with pytest.raises(ConfigError) as err, Journal.open(results):
        pass
    assert str(err.value) == (
        f"{results / JOURNAL_NAME} is a symbolic link; remove it (the journal is never written through a link)"
    )
    assert target.read_text() == "keep me\n"
    assert descriptors["opened"] and sorted(descriptors["opened"]) == sorted(descriptors["closed"])


def test_another_open_failure_names_the_folder_the_file_and_the_os_s_reason(
    tmp_path: Path, descriptors: dict[str, list[int]]
) -> None:
    (tmp_path / JOURNAL_NAME).mkdir()  # a folder at its name: open(2) says EISDIR
    with pytest.raises(LocalWriteError) as err, Journal.open(tmp_path):
        pass
    assert str(err.value) == f"cannot write in {tmp_path}/: {JOURNAL_NAME} (Is a directory)"
    assert descriptors["opened"] and sorted(descriptors["opened"]) == sorted(descriptors["closed"])


def test_a_journal_of_another_user_is_refused_and_its_descriptor_closed(
    tmp_path: Path, descriptors: dict[str, list[int]]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    (tmp_path / JOURNAL_NAME).write_text("")
    os.chown(tmp_path / JOURNAL_NAME, 4321, 4321)
    with pytest.raises(ConfigError) as err, Journal.open(tmp_path):
        pass
    assert str(err.value) == f"{tmp_path / JOURNAL_NAME} is not a file of yours; remove it or use another --results-dir"
    assert descriptors["opened"] and sorted(descriptors["opened"]) == sorted(descriptors["closed"])


def test_a_fifo_at_the_journal_s_name_is_refused(tmp_path: Path, descriptors: dict[str, list[int]]) -> None:
    os.mkfifo(tmp_path / JOURNAL_NAME)
    # A reader on the other end, so that opening it for writing does not wait for one.
    reader = os.open(tmp_path / JOURNAL_NAME, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(ConfigError) as err, Journal.open(tmp_path):
            pass
    finally:
        os.close(reader)
    assert str(err.value) == f"{tmp_path / JOURNAL_NAME} is not a file of yours; remove it or use another --results-dir"
    assert sorted(descriptors["opened"]) == sorted(descriptors["closed"])  # the reader's, the folder's, the FIFO's


# ---------------------------------------------------------------- fsync, grouped


class Clock:
    """The journal's ``time``: a monotonic clock moved by hand, the wall clock as it is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(journal_module, "time", clock)
    return clock


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield calls


def test_fsync_is_at_most_once_a_second_and_at_the_close(tmp_path: Path, clock: Clock, fsyncs: list[int]) -> None:
    with Journal.open(tmp_path) as journal:
        for _ in range(5):  # a burst within the second: written, not synced
            journal.record("a", JobState.PLACED, host="h1")
            clock.now += FSYNC_EVERY / 10
        assert fsyncs == []
        clock.now += FSYNC_EVERY  # a second since the open: the next line is synced
        journal.record("a", JobState.STARTED, host="h1")
        assert fsyncs == [journal.fd]
        clock.now += FSYNC_EVERY / 2  # half a second since that sync
        journal.record("a", JobState.FINISHED, code=0)
        assert len(fsyncs) == 1
        clock.now += FSYNC_EVERY  # a second and a half since it
        journal.record("b", JobState.PLACED, host="h1")
        assert len(fsyncs) == 2
    assert len(fsyncs) == 3  # the close syncs what is left
    assert len(read_journal(tmp_path)) == 8


def test_no_fsync_while_lines_wait_for_room(
    tmp_path: Path, clock: Clock, fsyncs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    heard: list[str] = []
    with Journal.open(tmp_path, on_failure=heard.append) as journal:
        monkeypatch.setattr(os, "write", full_disk)
        clock.now += 5 * FSYNC_EVERY
        journal.record("a", JobState.PLACED, host="h1")
        assert fsyncs == [] and len(heard) == 1
        monkeypatch.setattr(os, "write", REAL_WRITE)
        journal.record("a", JobState.STARTED, host="h1")  # both go out now, and are synced
        assert fsyncs == [journal.fd]


# ---------------------------------------------------------------- a full disk

REAL_WRITE = os.write


def full_disk(fd: int, data: bytes) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def no_space(folder: Path) -> str:
    return f"no space left in {folder}/: {JOURNAL_NAME} (No space left on device)"


def test_the_first_line_that_cannot_be_written_is_heard_at_once_with_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    heard: list[str] = []
    with Journal.open(tmp_path, on_failure=heard.append) as journal:
        monkeypatch.setattr(os, "write", full_disk)
        journal.record("a", JobState.PLACED, host="h1")  # the journal's very first line
        assert heard == [no_space(tmp_path)]
        monkeypatch.setattr(os, "write", REAL_WRITE)
        journal.record("a", JobState.STARTED, host="h1")
    assert heard == [no_space(tmp_path)]
    assert len(read_journal(tmp_path)) == 2


def test_a_disk_that_fills_again_after_the_lines_went_out_is_heard_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    heard: list[str] = []
    with caplog.at_level(logging.INFO, logger=LOGGER), Journal.open(tmp_path, on_failure=heard.append) as journal:
        journal.record("a", JobState.PLACED, host="h1")
        assert caplog.messages == []  # nothing was waiting: nothing to say
        monkeypatch.setattr(os, "write", full_disk)
        journal.record("a", JobState.STARTED, host="h1")
        monkeypatch.setattr(os, "write", REAL_WRITE)
        journal.record("b", JobState.PLACED, host="h1")
        assert caplog.messages == [f"{tmp_path}/{JOURNAL_NAME}: written again"]
        journal.record("b", JobState.STARTED, host="h1")
        assert len(caplog.messages) == 1  # said once, when they went out
        monkeypatch.setattr(os, "write", full_disk)
        journal.record("c", JobState.PLACED, host="h1")
        monkeypatch.setattr(os, "write", REAL_WRITE)
    assert heard == [no_space(tmp_path), no_space(tmp_path)]
    assert len(read_journal(tmp_path)) == 5


def test_without_a_listener_a_full_disk_is_logged_once_as_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER), Journal.open(tmp_path) as journal:
        monkeypatch.setattr(os, "write", full_disk)
        journal.record("a", JobState.PLACED, host="h1")
        journal.record("a", JobState.STARTED, host="h1")
        monkeypatch.setattr(os, "write", REAL_WRITE)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, f"{no_space(tmp_path)}; its lines wait in memory"),
        (logging.INFO, f"{tmp_path}/{JOURNAL_NAME}: written again"),
    ]


def test_a_failed_fsync_is_heard_with_the_os_s_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines were written, but the disk could not keep them (an I/O error): the batch hears
    it as it hears a full disk; nothing waits, so the close itself does not fail."""

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    heard: list[str] = []
    with Journal.open(tmp_path, on_failure=heard.append) as journal:
        monkeypatch.setattr(os, "fsync", fsync)
        journal.record("a", JobState.PLACED, host="h1")
    assert heard == [f"cannot write in {tmp_path}/: {JOURNAL_NAME} (Input/output error)"]
