"""The agent's paths through descriptors (agent/rooted.py) on a real filesystem: what ``remove``
empties and what it leaves alone, and staging a job's inputs folder by folder (agent/files.py)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from ssh_scheduler.agent import files as F
from ssh_scheduler.agent import rooted as R


def test_remove_empties_a_tree_and_never_follows_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "precious.txt").write_text("mine\n")
    job = tmp_path / "jobs" / "j1"
    (job / "a" / "b" / "c").mkdir(parents=True)
    (job / "a" / "b" / "c" / "deep.txt").write_text("x")
    (job / "top.txt").write_text("x")
    (job / "a" / "b" / "file").write_text("x")
    (job / "link-to-outside").symlink_to(outside / "keep")
    (job / "a" / "link-to-file").symlink_to(outside / "keep" / "precious.txt")
    os.mkfifo(job / "a" / "fifo")
    locked = job / "a" / "locked"
    locked.mkdir()
    (locked / "inner.txt").write_text("x")
    locked.chmod(0o500)  # a job may leave a folder it cannot write: still ours to empty
    jobs = os.open(tmp_path / "jobs", os.O_RDONLY | os.O_DIRECTORY)
    try:
        R.remove(jobs, "j1")
        R.remove(jobs, "missing")  # nothing there: nothing to do
    finally:
        os.close(jobs)
    assert os.listdir(tmp_path / "jobs") == []
    assert (outside / "keep" / "precious.txt").read_text() == "mine\n"


def test_remove_of_a_plain_file_or_a_link_removes_only_that_name(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "t.txt").write_text("t")
    (tmp_path / "f.txt").write_text("f")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        R.remove(fd, "f.txt")
        R.remove(fd, "link")
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == ["target"]
    assert (tmp_path / "target" / "t.txt").read_text() == "t"


class _Staging(F.FileOperations):
    """The agent's file requests over a cache and a jobs folder of its own (no connection)."""

    def __init__(self, root: Path) -> None:
        self.trust = None
        self.staged: dict[str, dict[str, tuple[int, int, int, str]]] = {}
        flags = os.O_RDONLY | os.O_DIRECTORY
        self.work = SimpleNamespace(
            fd=os.open(root, flags), cache=os.open(root / "cache", flags), jobs=os.open(root / "jobs", flags)
        )

    def below_root(self, path: str) -> str:
        return path

    def close(self) -> None:
        for fd in (self.work.fd, self.work.cache, self.work.jobs):
            os.close(fd)


def test_inputs_are_staged_each_in_its_folder_whatever_their_order(tmp_path: Path) -> None:
    """Files come folder by folder, but not only: one folder's files may come again after
    another's, and a file may sit at the top between them."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "jobs").mkdir()
    rels = ["a/1.txt", "a/2.txt", "b/c/3.txt", "a/4.txt", "top.txt", "b/5.txt", "b/c/6.txt", "a/d/7.txt"]
    staged = []
    for rel in rels:
        data = f"content of {rel}\n".encode()
        key = hashlib.sha256(data).hexdigest() + "-r"
        (tmp_path / "cache" / key).write_bytes(data)
        (tmp_path / "cache" / key).chmod(0o400)
        staged.append(SimpleNamespace(rel=rel, key=key))
    ops = _Staging(tmp_path)
    try:
        ops.stage("jobs/j1", staged, ["empty/dir"])
        listed = ops.list_results("jobs/j1", [])
    finally:
        ops.close()
    job = tmp_path / "jobs" / "j1"
    found = sorted(str(p.relative_to(job)) for p in job.rglob("*") if p.is_file())
    assert found == sorted(rels)
    for rel in rels:
        assert (job / rel).read_text() == f"content of {rel}\n"
        assert stat.S_IMODE((job / rel).stat().st_mode) == 0o400  # a link to the read-only entry
    assert (job / "empty" / "dir").is_dir()
    assert set(ops.staged["jobs/j1"]) == set(rels)
    assert listed == []  # untouched inputs are no results


@pytest.mark.parametrize("rel", ["", "/etc/passwd", "../escape.txt", "a/../../escape.txt"])
def test_an_input_path_that_leaves_the_job_folder_is_refused(tmp_path: Path, rel: str) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "jobs").mkdir()
    data = b"x"
    key = hashlib.sha256(data).hexdigest() + "-r"
    (tmp_path / "cache" / key).write_bytes(data)
    ops = _Staging(tmp_path)
    try:
        with pytest.raises(ValueError):
            ops.stage("jobs/j1", [SimpleNamespace(rel="ok.txt", key=key), SimpleNamespace(rel=rel, key=key)], [])
    finally:
        ops.close()
    assert not (tmp_path / "escape.txt").exists()
