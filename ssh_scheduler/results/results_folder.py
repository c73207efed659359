"""One results folder, one run: the lock file in ``job_results/`` and checks on what is in it.

Two coordinators on one ``job_results/`` would both run every job, clean each other's staging
folders and mark good results failed.  :func:`hold_results_folder` takes an exclusive ``flock``
on ``job_results/.lock`` for the whole run and writes its pid, host and start time into it, so a
second run is refused with one line naming the first.  The kernel drops the lock when its holder
dies, however it dies, so a lock left by a killed run is simply taken over (the file's old text
is only ever shown, never trusted).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ssh_scheduler.errors import ConfigError, TransferError, plain_text
from ssh_scheduler.results.journal import JOURNAL_NAME
from ssh_scheduler.results.local_folder import local_write_error, open_results_folder

__all__ = ["LOCK_NAME", "hold_results_folder", "refuse_planted_links"]

LOCK_NAME = ".lock"  # also in batch.RESERVED_NAMES: no job may be called so


def _holder(fd: int) -> str:
    """The lock's holder as its file says, for a message (the file may hold anything)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0))
        pid, host, started = int(data["pid"]), str(data["host"]), float(data["started"])
    except (OSError, ValueError, TypeError, KeyError):
        return "a run that wrote no readable pid yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    return f"pid {pid} on host {plain_text(host)[:100]}, started {since}"


@contextlib.contextmanager
def hold_results_folder(results: Path, *, create: bool = True) -> Iterator[int | None]:
    """Hold ``results`` for this run; yields its verified descriptor
    (:func:`~ssh_scheduler.results.local_folder.open_results_folder`: a real folder, ours alone),
    which everything the run writes there is created relative to.  ``create=False`` (a dry
    run): a folder that does not exist is left uncreated, needs no lock, and yields None.  A
    folder made here and left holding nothing but the lock (the run stopped before its first
    job) is removed again."""
    made = not os.path.lexists(results)
    if not create and not results.is_dir():
        yield None
        return
    folder = open_results_folder(results, create=create)
    try:
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        except OSError as exc:
            why = "it is a symlink" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
            raise ConfigError(
                f"cannot open the lock file {plain_text(str(results / LOCK_NAME))}: {why} (remove it, "
                f"or use another --results-dir)"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"{plain_text(str(results / LOCK_NAME))} is not a regular file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(
                    f"{plain_text(str(results))}/ is in use by another run ({_holder(fd)}); wait for "
                    f"it to end, stop it, or use another --results-dir"
                ) from None
            mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": round(time.time(), 3)}
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(mine).encode() + b"\n", 0)
            except OSError as exc:
                raise local_write_error(exc, results, LOCK_NAME) from None
            yield folder
        finally:
            # The lock file stays (removing it could let two runs hold locks on different files),
            # unless the run left nothing else in a folder it made (a batch refused once the hosts
            # answered has opened its journal but written nothing to it).
            with contextlib.suppress(OSError):
                if made and _holds_nothing(folder):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(JOURNAL_NAME, dir_fd=folder)
                    os.unlink(LOCK_NAME, dir_fd=folder)
                    os.rmdir(results)
            os.close(fd)  # releases the lock
    finally:
        os.close(folder)


def _holds_nothing(folder: int) -> bool:
    """Only the lock, and at most an empty journal."""
    names = set(os.listdir(folder))
    if names == {LOCK_NAME}:
        return True
    return names == {LOCK_NAME, JOURNAL_NAME} and os.stat(JOURNAL_NAME, dir_fd=folder, follow_symlinks=False).st_size == 0


def refuse_planted_links(results: Path, names: Iterable[str]) -> None:
    """A job's output files and result folder are ours to create: a symlink already standing at
    ``job_results/<job>.out`` (or ``.err``, or ``<job>``) would redirect the job's output into
    whatever it points at.  One error line, before anything is dispatched.

    The folder is listed once (a 100,000-job batch would otherwise cost 300,000 ``lstat`` calls,
    about 1.5 s, even for a dry run)."""
    try:
        with os.scandir(results) as entries:
            links = {entry.name for entry in entries if entry.is_symlink()}
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing stands there yet
    if not links:
        return
    for name in names:
        for suffix in ("", ".out", ".err"):
            path = results / f"{name}{suffix}"
            if path.name in links:
                raise TransferError(
                    f"{plain_text(str(path))} is a symlink (to "
                    f"{plain_text(os.readlink(path))[:200]}); job outputs are never written "
                    f"through links: remove it and rerun"
                )
