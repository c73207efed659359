"""Paths below a folder the agent verified, opened one name at a time through descriptors.

The work root is opened once, checked all the way from / (boot.open_root), and kept as a
descriptor with its folders (hostguard.WorkRoot).  Everything the agent makes, reads, links or
removes below it goes through here: each name is opened relative to the descriptor of the folder
before it, with O_NOFOLLOW, so a link a job (or anyone) planted is never followed and a path
someone renames or re-links later changes nothing the agent opens.  A name that would climb out
(absolute, ``..``) is refused before anything is opened.

Runs on the hosts' python3 (3.8 or newer) as part of the agent: stdlib only, no 3.9+ syntax;
the annotations are strings, checked by mypy, never evaluated there.
"""

from __future__ import annotations

import os
import stat

from ssh_scheduler.agent.boot import FOLDER

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterator, List, Optional, Tuple

READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def names(rel: object) -> Optional[List[str]]:
    """The names of the relative path ``rel`` (``a/./b`` -> ``[a, b]``), or None when it is not
    one that stays below its folder (absolute, ``..``, empty, a NUL)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        return None
    parts = [part for part in rel.split("/") if part not in ("", ".")]
    if ".." in parts:
        return None
    return parts


def open_child(dir_fd: int, name: str) -> int:
    """A descriptor of the folder ``name`` of the folder ``dir_fd`` (a link is not followed)."""
    return os.open(name, FOLDER, dir_fd=dir_fd)


def open_folder(dir_fd: int, parts: List[str], create: bool = False) -> int:
    """A descriptor of the folder ``parts`` below ``dir_fd`` (``[]``: that folder itself), every
    name opened without following a link (ELOOP, ENOTDIR); missing folders are made (0700) when
    ``create``.  The caller closes it."""
    fd = os.open(".", FOLDER, dir_fd=dir_fd)
    try:
        for name in parts:
            try:
                nxt = os.open(name, FOLDER, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(name, FOLDER, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


class At(object):
    """``with At(dir_fd, rel) as (folder, name):`` the folder holding ``rel`` below ``dir_fd``,
    opened as :func:`open_folder` does, and the last name in it.  ValueError when ``rel`` would
    leave ``dir_fd`` (or names it)."""

    def __init__(self, dir_fd: int, rel: str, create: bool = False) -> None:
        parts = names(rel)
        if not parts:
            raise ValueError("not a path inside its folder: %r" % (rel,))
        self.parts = parts
        self.dir_fd = dir_fd
        self.create = create
        self.fd = -1

    def __enter__(self) -> Tuple[int, str]:
        self.fd = open_folder(self.dir_fd, self.parts[:-1], self.create)
        return self.fd, self.parts[-1]

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def lstat(dir_fd: int, name: str) -> Optional[os.stat_result]:
    """The entry ``name`` of the folder ``dir_fd`` itself (a link is not followed), or None."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "special"


def remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` from the folder ``dir_fd`` and everything below it (``rm -rf``), never
    following a link; what cannot be removed stays (a job's leftovers are not worth an error)."""
    st = lstat(dir_fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        return
    try:
        fd = os.open(name, FOLDER, dir_fd=dir_fd)
    except OSError:
        return
    try:
        if st.st_mode & 0o700 != 0o700:
            os.fchmod(fd, 0o700)  # a job may leave a read-only folder: it is ours to empty
        for entry in list(os.scandir(fd)):
            if entry.is_dir(follow_symlinks=False):
                remove(fd, entry.name)
                continue
            try:  # not a folder as listed (its type from the listing: no lstat per file)
                os.unlink(entry.name, dir_fd=fd)
            except IsADirectoryError:  # became one since
                remove(fd, entry.name)
            except OSError:
                pass
    except OSError:
        pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass


def walk(dir_fd: int, parts: List[str]) -> Iterator[Tuple[str, os.stat_result]]:
    """(path relative to ``dir_fd``, lstat) of the entry ``parts`` below ``dir_fd`` and of
    everything below it, never through a link: a link on the way ends the walk there (it is
    listed, as a link, when it is what ``parts`` names).  ``[]``: everything below ``dir_fd``."""
    if parts:
        try:
            with At(dir_fd, "/".join(parts)) as (folder, name):
                st = lstat(folder, name)
        except OSError:
            return
        if st is None:
            return
        yield "/".join(parts), st
        if not stat.S_ISDIR(st.st_mode):
            return
    stack = ["/".join(parts)]
    while stack:
        rel = stack.pop()
        try:
            fd = open_folder(dir_fd, rel.split("/") if rel else [])
        except OSError:
            continue  # replaced by a link or gone since it was listed
        try:
            entries = list(os.scandir(fd))
            found = []
            for entry in entries:
                try:
                    found.append((entry.name, entry.stat(follow_symlinks=False)))
                except OSError:
                    continue
        except OSError:
            continue
        finally:
            os.close(fd)
        for name, st in found:
            path = rel + "/" + name if rel else name
            yield path, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)


def read_link(dir_fd: int, rel: str) -> Optional[str]:
    """Where the link ``rel`` below ``dir_fd`` points (None if it is not one any more)."""
    try:
        with At(dir_fd, rel) as (folder, name):
            return os.readlink(name, dir_fd=folder)
    except (OSError, ValueError):
        return None


def copy_file(src_dir: int, src: str, dst_dir: int, dst: str, mode: int) -> None:
    """Copy the regular file ``src`` of ``src_dir`` to a new ``dst`` in ``dst_dir`` (mode
    ``mode``), neither followed through a link; a copy that could not be finished is removed."""
    source = os.open(src, READ, dir_fd=src_dir)
    try:
        if not stat.S_ISREG(os.fstat(source).st_mode):
            raise OSError(0, "not a regular file", src)
        target = os.open(dst, CREATE, 0o600, dir_fd=dst_dir)
        try:
            while True:
                block = os.read(source, 1 << 20)
                if not block:
                    break
                view = memoryview(block)
                while view:
                    view = view[os.write(target, view):]
            os.fchmod(target, mode)
        except BaseException:
            os.close(target)
            try:
                os.unlink(dst, dir_fd=dst_dir)
            except OSError:
                pass
            raise
        os.close(target)
    finally:
        os.close(source)


def read_regular(dir_fd: int, rel: str, limit: int) -> Tuple[Optional[bytes], Optional[str]]:
    """``(bytes, None)``: at most ``limit`` bytes of the regular file ``rel`` below ``dir_fd``;
    ``(None, reason)`` for anything else.  No link is followed on the way (O_NOFOLLOW at every
    name), a FIFO is never waited on (O_NONBLOCK, then refused as not a regular file), so a
    job's leftovers cannot stall or redirect it."""
    try:
        with At(dir_fd, rel) as (folder, name):
            fd = os.open(name, READ | os.O_NONBLOCK, dir_fd=folder)
    except ValueError:
        return None, "not a path inside the job folder"
    except OSError as exc:
        return None, exc.strerror or str(exc)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "not a regular file"
        chunks = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), None
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.close(fd)
