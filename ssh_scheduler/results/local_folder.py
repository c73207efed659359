"""The results folder as a verified descriptor, and a failed write in it as one line.

Everything a batch creates on this machine (job outputs, results, the journal, the lock) is
created relative to one descriptor of ``job_results/``, opened without following a link and
checked to be ours and writable by nobody else: a folder swapped for a symlink mid-run, or one
another user can write, can then never redirect a write.  The user named the path, so links
*above* it are theirs to use; the folder itself must be a real one.

A write that fails here (a full disk, a quota, an unwritable folder) is the batch's failure,
never a host's: :func:`local_write_error` names it with the folder first ("no space left in
job_results/: ..."), so the user knows where to make room.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from pathlib import Path

from ssh_scheduler.errors import ConfigError, LocalWriteError, plain_text

__all__ = ["FOLDER_FLAGS", "local_write_error", "open_results_folder", "shown_folder"]

FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_FULL = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}


def shown_folder(folder: Path | str) -> str:
    """The folder as a message names it: ``job_results/``."""
    return plain_text(str(folder)).rstrip("/") + "/"


def local_write_error(exc: OSError, folder: Path | str, what: str) -> LocalWriteError:
    """One line for a write that failed in ``folder`` here: ``no space left in job_results/:
    writing b.sh.3.out (No space left on device)``.  ``what``: what was being written."""
    reason = exc.strerror or str(exc)
    head = _FULL.get(exc.errno or 0, "cannot write")
    hint = " (a symbolic link is in the way: remove it)" if exc.errno == errno.ELOOP else ""
    return LocalWriteError(f"{head} in {shown_folder(folder)}: {plain_text(what)} ({reason}){hint}")


def _private_group(gid: int) -> bool:
    """Is ``gid`` our own private group (named as we are, no one else in it)?  Debian and
    Ubuntu give every user one, and a umask of 002 makes new folders writable by it; OpenSSH
    accepts such a file, and so do we."""
    try:
        me = pwd.getpwuid(os.geteuid()).pw_name
        group = grp.getgrgid(gid)
    except (KeyError, OSError):
        return False
    return group.gr_name == me and set(group.gr_mem) <= {me}


def _why_not_ours(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = f"uid {st.st_uid}"
        return f"it belongs to {owner}, not to you"
    if st.st_mode & stat.S_IWOTH:
        return f"every user can write it (mode {stat.S_IMODE(st.st_mode):o}); chmod o-w it"
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid):
        return f"its group can write it (mode {stat.S_IMODE(st.st_mode):o}); chmod g-w it"
    return None


def open_results_folder(folder: Path, *, create: bool) -> int:
    """A descriptor of ``folder``, made first if ``create`` (0755; its parents as mkdir -p
    makes them), refused with one line when it is a symlink, not a folder, or not ours alone.
    The caller closes it."""
    if create:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(folder, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise local_write_error(exc, folder.parent, f"making {folder.name}/") from None
    try:
        fd = os.open(folder, FOLDER_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and folder.is_symlink():
            why = f"it is a symbolic link (to {plain_text(os.readlink(folder))[:200]})"
        elif exc.errno == errno.ENOTDIR:
            why = "it is not a folder"
        else:
            why = exc.strerror or str(exc)
        raise ConfigError(
            f"cannot use {shown_folder(folder)} for results: {why}; results are only written into "
            f"a real folder of yours: remove it, or pass another --results-dir"
        ) from None
    try:
        refused = _why_not_ours(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if refused is not None:
        os.close(fd)
        raise ConfigError(
            f"cannot use {shown_folder(folder)} for results: {refused}; others could plant links "
            f"or files where job results go: use a folder only you can write, or pass another "
            f"--results-dir"
        )
    return fd
