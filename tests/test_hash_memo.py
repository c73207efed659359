"""The memo of what local files hashed to (jobs/hash_memo.py): a later command reads no file that
stayed the same file, and reads again every file that may have changed -- rewritten to the same
size with its mtime put back, replaced, changed just before it was read -- or that a changed key
scan would judge anew.  A memo it cannot use costs the reading, never the command.  On real
files; which files were read is counted at ``open``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ssh_scheduler.jobs import forward, hash_memo
from ssh_scheduler.jobs.forward import ForwardSet, Hasher, collect_forward
from ssh_scheduler.jobs.hash_memo import HashMemo

KEY_TEXT = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n-----END OPENSSH PRIVATE KEY-----\n"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files the walk opens to hash (forward's ``open``)."""
    opened: list[str] = []

    def counting_open(path: object, *args: object, **kwargs: object) -> object:
        opened.append(os.path.basename(str(path)))
        return open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(forward, "open", counting_open, raising=False)
    return opened


@pytest.fixture
def data(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    for i in range(5):
        (folder / f"f{i}.txt").write_text(f"input {i}\n")
    (folder / "sub" / "deep.bin").write_bytes(os.urandom(3000))
    (folder / "id_like").write_bytes(KEY_TEXT)  # a key under an innocent name
    (folder / os.fsdecode(b"caf\xe9.txt")).write_text("a name that is no UTF-8\n")  # latin-1
    return folder


@pytest.fixture
def walk(tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], ForwardSet]:
    """One command's walk of ``data`` with the memo, saved as a command saves it.  The files are
    made moments before: they count as old enough here (RACY_SECONDS has its own test)."""
    monkeypatch.setattr(hash_memo, "RACY_SECONDS", 0.0)
    memo_folder = tmp_path / "cache" / "ssh_scheduler" / hash_memo.FOLDER

    def one() -> ForwardSet:
        time.sleep(0.02)  # the memo is made after the files' last change, as in a later command
        hasher = Hasher(HashMemo(memo_folder))
        found = collect_forward(["data"], tmp_path, hasher)
        hasher.save()
        return found

    return one


def keys(found: ForwardSet) -> dict[str, str]:
    return {f.rel: f.key for f in found.files}


def test_a_later_command_reads_no_file_that_stayed_the_same(walk: Callable[[], ForwardSet], reads: list[str]) -> None:
    first = walk()
    assert sorted(reads) == sorted(["deep.bin", "f0.txt", "f1.txt", "f2.txt", "f3.txt", "f4.txt", "id_like", os.fsdecode(b"caf\xe9.txt")])
    reads.clear()
    second = walk()
    assert reads == []
    assert keys(second) == keys(first) and second.withheld == first.withheld == ("data/id_like",)


def test_a_file_rewritten_to_its_size_with_its_mtime_put_back_is_read_again(
    walk: Callable[[], ForwardSet], reads: list[str], data: Path
) -> None:
    walk()
    target = data / "f2.txt"
    before = target.stat()
    target.write_text("INPUT 2\n")  # the same size
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -p or tar x would
    reads.clear()
    found = keys(walk())
    assert reads == ["f2.txt"]  # its ctime moved: no program can put that back
    assert found["data/f2.txt"] == hashlib.sha256(b"INPUT 2\n").hexdigest() + "-r"


def test_a_replaced_file_is_read_again(walk: Callable[[], ForwardSet], reads: list[str], data: Path) -> None:
    walk()
    target, new = data / "f3.txt", data / "new.tmp"
    before = target.stat()
    new.write_text("INPUT 3\n")
    os.utime(new, ns=(before.st_atime_ns, before.st_mtime_ns))
    new.replace(target)  # another inode under the same name, the same size and mtime
    reads.clear()
    assert keys(walk())["data/f3.txt"] == hashlib.sha256(b"INPUT 3\n").hexdigest() + "-r"
    assert reads == ["f3.txt"]


def test_a_file_changed_just_before_it_was_read_is_read_again_next_time(
    tmp_path: Path, reads: list[str], data: Path
) -> None:
    for _ in range(2):  # RACY_SECONDS as it is: every file here changed a moment ago
        hasher = Hasher(HashMemo(tmp_path / "memo"))
        collect_forward(["data"], tmp_path, hasher)
        hasher.save()
    assert len(reads) == 2 * 8  # a write in the tick of the first read would not have shown


def test_a_changed_key_scan_judges_every_file_anew(
    walk: Callable[[], ForwardSet], reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    walk()
    monkeypatch.setattr(hash_memo, "scan_version", lambda: "another scan")
    reads.clear()
    assert walk().withheld == ("data/id_like",)
    assert len(reads) == 8


def memo_file(folder: Path, top: Path) -> Path:
    """The memo file of the walked path ``top`` (named by the hash of its absolute path)."""
    return folder / (hashlib.sha256(os.fsencode(str(top))).hexdigest()[:32] + ".json")


@pytest.mark.parametrize("spoil", ["garbage", "another top", "link", "fifo", "open folder"])
def test_a_memo_that_cannot_be_used_costs_only_the_reading(
    tmp_path: Path, reads: list[str], data: Path, spoil: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hash_memo, "RACY_SECONDS", 0.0)
    folder = tmp_path / "memo"
    folder.mkdir(mode=0o700)
    target = memo_file(folder, data)
    elsewhere = tmp_path / "elsewhere.json"
    time.sleep(0.02)
    first = Hasher(HashMemo(folder))
    expected = keys(collect_forward(["data"], tmp_path, first))
    first.save()
    if spoil == "garbage":
        target.write_text('{"version": 1, "files": [')
    elif spoil == "another top":  # copied from another folder's memo: its paths are not these
        memo = json.loads(target.read_text())
        target.write_text(json.dumps({**memo, "top": "/elsewhere"}))
    elif spoil == "link":
        target.rename(elsewhere)
        target.symlink_to(elsewhere)
    elif spoil == "fifo":  # refused, never waited on
        target.unlink()
        os.mkfifo(target, 0o600)
    else:
        folder.chmod(0o777)  # anyone could put a memo there
    caplog.set_level(logging.INFO)
    reads.clear()
    hasher = Hasher(HashMemo(folder))
    walked: list[ForwardSet] = []  # in a thread of its own: a memo that blocks fails, not hangs, the test
    walker = threading.Thread(target=lambda: walked.append(collect_forward(["data"], tmp_path, hasher)), daemon=True)
    walker.start()
    walker.join(60)
    assert walked, "the walk never ended (waiting on the memo file?)"
    assert keys(walked[0]) == expected
    assert len(reads) == 8  # every file read again
    if spoil != "another top":
        assert "not used" in caplog.text
    before = elsewhere.read_bytes() if spoil == "link" else b""
    hasher.save()
    if spoil == "link":
        assert elsewhere.read_bytes() == before  # never written through the link
    if spoil in ("link", "fifo"):
        assert target.is_file() and not target.is_symlink()  # replaced by a memo of its own


def test_the_memo_is_private_and_holds_what_the_last_walk_found(
    walk: Callable[[], ForwardSet], tmp_path: Path, data: Path
) -> None:
    walk()
    (data / "f4.txt").unlink()
    walk()
    folder = tmp_path / "cache" / "ssh_scheduler" / hash_memo.FOLDER
    [memo] = list(folder.iterdir())
    assert memo == memo_file(folder, data)
    assert memo.stat().st_mode & 0o777 == 0o600 and folder.stat().st_mode & 0o777 == 0o700
    files = json.loads(memo.read_text())["files"]
    assert sorted(os.path.relpath(p, data) for p in files) == sorted([
        "f0.txt", "f1.txt", "f2.txt", "f3.txt", "id_like", "sub/deep.bin", os.fsdecode(b"caf\xe9.txt"),
    ])  # a removed file leaves the memo with the next walk


def test_memo_files_nobody_wrote_for_keep_days_go(walk: Callable[[], ForwardSet], tmp_path: Path) -> None:
    """A save sweeps the folder: what is older than KEEP_DAYS (another folder's memo, a killed
    command's half-written one) goes; what is younger, and anything that is not a plain file
    (a link: its target is never touched), stays."""
    folder = tmp_path / "cache" / "ssh_scheduler" / hash_memo.FOLDER
    folder.mkdir(parents=True, mode=0o700)
    now = time.time()
    ages = {"old.json": hash_memo.KEEP_DAYS + 1, "young.json": hash_memo.KEEP_DAYS - 1}
    for name, days in ages.items():
        (folder / name).write_text("{}")
        os.utime(folder / name, (now - days * 86400, now - days * 86400))
    target = tmp_path / "target.json"
    target.write_text("{}")
    os.utime(target, (now - 400 * 86400, now - 400 * 86400))
    (folder / "link.json").symlink_to(target)
    os.utime(folder / "link.json", (now - 400 * 86400,) * 2, follow_symlinks=False)
    walk()
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted(["young.json", "link.json", memo_file(folder, tmp_path / "data").name])
    assert target.exists()


def test_the_memo_lives_in_the_users_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hash_memo.default_path() == tmp_path / "xdg" / "ssh_scheduler" / "hashes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hash_memo.default_path() == tmp_path / "home" / ".cache" / "ssh_scheduler" / "hashes"


def test_a_memo_folder_that_is_a_link_is_not_used(
    tmp_path: Path, data: Path, reads: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Someone who could swap the folder for a link could feed any verdict (a key "not a key"):
    it is opened without following one, and not used."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "memo").symlink_to(real)
    caplog.set_level(logging.INFO)
    hasher = Hasher(HashMemo(tmp_path / "memo"))
    collect_forward(["data"], tmp_path, hasher)
    hasher.save()
    assert "hash memo" in caplog.text and "not used" in caplog.text
    assert list(real.iterdir()) == []


def test_a_memo_still_in_use_is_kept_fresh_and_each_holds_its_own_path(
    walk: Callable[[], ForwardSet], tmp_path: Path, data: Path
) -> None:
    """A walk that finds everything as its memo says rewrites nothing but marks the memo used
    (its mtime), so KEEP_DAYS counts from the last use, not the last change; and a command that
    walks two paths keeps each one's files in that path's memo only."""
    walk()
    folder = tmp_path / "cache" / "ssh_scheduler" / hash_memo.FOLDER
    memo = memo_file(folder, data)
    aged = time.time() - (hash_memo.KEEP_DAYS + 1) * 86400
    os.utime(memo, (aged, aged))
    before = memo.read_bytes()
    walk()
    assert memo.read_bytes() == before and memo.stat().st_mtime > time.time() - 60
    other = tmp_path / "other"
    other.mkdir()
    (other / "o.txt").write_text("o\n")
    hasher = Hasher(HashMemo(folder))
    time.sleep(0.02)
    collect_forward(["data", "other"], tmp_path, hasher)
    hasher.save()
    for top, names in ((data, 8), (other, 1)):
        files = json.loads(memo_file(folder, top).read_text())["files"]
        assert len(files) == names and all(p.startswith(f"{top}/") for p in files), files


def test_one_command_reads_a_file_once_however_often_it_is_walked(
    tmp_path: Path, data: Path, reads: list[str]
) -> None:
    hasher = Hasher()  # no lasting memo: the command's own
    first = collect_forward(["data"], tmp_path, hasher)
    assert collect_forward(["data"], tmp_path, hasher) == first
    assert len(reads) == 8 and hasher.read == 8
