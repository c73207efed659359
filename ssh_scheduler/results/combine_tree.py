"""The file-system side of ``combine_folders`` shared by planning and writing: how a tree is
walked without following links, how DEST is looked at only where the sources reach, which
symlinks would lead out of the merged tree, and the flags every open uses.

Result folders come from other machines, so their content is untrusted: nothing here follows a
symlink, and a link is judged by resolving it against what the walk saw, never the filesystem.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable
from typing import Final

from ssh_scheduler.errors import ConfigError

# Entry kinds.  Plain ints rather than an Enum: they are compared once per file of a 100k-file
# tree, and enum attribute access is measurably slower there.
DIR: Final = 0
FILE: Final = 1
LINK: Final = 2
SPECIAL: Final = 3
KIND_NAMES: Final = {DIR: "directory", FILE: "file", LINK: "symlink", SPECIAL: "special file"}

MAX_SYMLINK_HOPS: Final = 40  # the kernel's own limit (ELOOP)
GIT: Final = ".git"
HASH_CHUNK: Final = 1 << 20
COPY_CHUNK: Final = 1 << 30

# O_NONBLOCK: if a source file was swapped for a FIFO after the walk, open() must not hang on it;
# it has no effect on regular files.  O_NOFOLLOW: a symlink swapped in is refused, not followed.
READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
TEMP_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# Owners are not kept, so setuid/setgid bits would now mean "run as whoever combined" (root,
# possibly): they are dropped.  Everything else (rwx for all, sticky) is kept.
KEPT_MODE_BITS: Final = 0o1777


def one_line(text: str) -> str:
    # str(err) must stay one line even for a file name with a newline in it.
    return text if text.isprintable() else repr(text)[1:-1]


class Entry:
    """One directory entry found by a walk, never followed if it is a symlink."""

    __slots__ = ("kind", "mode", "path", "target")

    def __init__(self, kind: int, path: str, mode: int = 0, target: str = "") -> None:
        self.kind = kind
        self.path = path  # absolute path, for reading during the plan
        self.mode = mode  # only filled for directories (and special files, for the message)
        self.target = target  # only for symlinks


Lookup = Callable[[str], "Entry | None"]


def walk(root: str, label: str, descend: Callable[[str], bool] | None = None) -> dict[str, Entry]:
    """Map every entry below ``root`` by its '/'-joined relative path, never following symlinks.

    ``descend(rel)`` decides whether a subdirectory is entered (DEST is only walked where the
    sources have directories).  Only directories are stat()ed: on Linux scandir already knows the
    type of every entry, and a file's size is only needed when another copy of it exists.
    """
    entries: dict[str, Entry] = {}
    pending: list[tuple[str, str]] = [(root, "")]
    while pending:
        path, prefix = pending.pop()
        try:
            with os.scandir(path) as listing:
                for item in listing:
                    rel = prefix + item.name
                    if item.is_dir(follow_symlinks=False):
                        mode = item.stat(follow_symlinks=False).st_mode
                        entries[rel] = Entry(DIR, item.path, mode)
                        if descend is None or descend(rel):
                            pending.append((item.path, rel + "/"))
                    elif item.is_file(follow_symlinks=False):
                        entries[rel] = Entry(FILE, item.path)
                    elif item.is_symlink():
                        entries[rel] = Entry(LINK, item.path, target=os.readlink(item.path))
                    else:
                        mode = item.stat(follow_symlinks=False).st_mode
                        entries[rel] = Entry(SPECIAL, item.path, mode)
        except OSError as exc:
            where = os.path.join(label, prefix.rstrip("/")) if prefix else label
            raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from exc
    return entries


class DestView:
    """What DEST holds, listed only where the sources have directories and looked up lazily
    elsewhere (a source symlink may point into a part of DEST no source touches)."""

    def __init__(self, root: str | None, descend: Callable[[str], bool], label: str) -> None:
        self._root = root
        self.scanned: dict[str, Entry] = {}
        self._listed_dirs: set[str] = set()
        self._extra: dict[str, Entry | None] = {}
        if root is not None:

            def descend_and_note(rel: str) -> bool:
                if descend(rel):
                    self._listed_dirs.add(rel)
                    return True
                return False

            self._listed_dirs.add("")
            self.scanned = walk(root, label, descend_and_note)

    def lookup(self, rel: str) -> Entry | None:
        if self._root is None:
            return None
        parent = rel.rpartition("/")[0]
        if parent in self._listed_dirs:
            return self.scanned.get(rel)
        if rel not in self._extra:
            # The resolver looks components up in order and expands symlinks itself, so every
            # ancestor of ``rel`` is a real directory here and lstat cannot leave DEST.
            path = os.path.join(self._root, rel)
            try:
                st = os.lstat(path)
            except OSError:
                self._extra[rel] = None
            else:
                if stat.S_ISDIR(st.st_mode):
                    self._extra[rel] = Entry(DIR, path, st.st_mode)
                elif stat.S_ISLNK(st.st_mode):
                    self._extra[rel] = Entry(LINK, path, target=os.readlink(path))
                elif stat.S_ISREG(st.st_mode):
                    self._extra[rel] = Entry(FILE, path)
                else:
                    self._extra[rel] = Entry(SPECIAL, path, st.st_mode)
        return self._extra[rel]


def _git_part(rel: str) -> int | None:
    """The index of the first ``.git`` component of ``rel`` (any case: on a case-insensitive
    file system ``.GIT`` is the same folder), or None."""
    for index, part in enumerate(rel.split("/")):
        if part.casefold() == GIT:
            return index
    return None


def drop_unsafe(tree: dict[str, Entry], lookup: Lookup, label: str, skipped: list[str]) -> None:
    """Remove special files, symlinks that leave the tree and everything named ``.git``, with
    one warning line each (one per ``.git``, not per file in it)."""
    drop: list[str] = []
    for rel, entry in tree.items():
        git = _git_part(rel)
        if git is not None:
            # A source's .git (a folder, or a file naming one) merged into a DEST that is a git
            # work tree would be DEST's own: hooks/ and config run code at the next git command.
            if git == rel.count("/"):
                skipped.append(
                    one_line(f"skipped {os.path.join(label, rel)}: a .git is never merged (its hooks would run in DEST)")
                )
            drop.append(rel)
        elif entry.kind == SPECIAL:
            what = special_name(entry.mode)
            skipped.append(
                one_line(
                    f"skipped {os.path.join(label, rel)}: {what} (special files are not copied)"
                )
            )
            drop.append(rel)
        elif entry.kind == LINK:
            problem = link_problem(rel, entry.target, lookup)
            if problem is not None:
                skipped.append(
                    one_line(
                        f"skipped {os.path.join(label, rel)}: symlink to {entry.target} {problem}"
                    )
                )
                drop.append(rel)
    for rel in drop:
        del tree[rel]


def special_name(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "special file"


def link_problem(rel: str, target: str, lookup: Lookup) -> str | None:
    """Why the symlink at ``rel`` must not be recreated, or None if it stays inside the tree.

    The target is resolved the way the kernel would, component by component and expanding the
    tree's own symlinks, but against ``lookup`` (what the walk saw) instead of the filesystem, so
    nothing outside the tree is ever touched.  A purely textual normpath check is not enough:
    ``a/b/l -> s/../x`` with ``a/b/s -> ../..`` leaves the tree.
    """
    if target.startswith("/"):
        return "is absolute"
    where = rel.split("/")[:-1]
    todo = target.split("/")[::-1]
    hops = 0
    # Once a component is missing (or not a directory) the kernel stops with ENOENT/ENOTDIR; we
    # cannot know what will be there later, so a '..' after that point is treated as escaping.
    unknown = False
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if unknown or not where:
                return "leaves the tree"
            where.pop()
            continue
        where.append(part)
        if unknown:
            continue
        entry = lookup("/".join(where))
        if entry is None or entry.kind in (FILE, SPECIAL):
            unknown = True
        elif entry.kind == LINK:
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                return "loops"
            if entry.target.startswith("/"):
                return "leads through an absolute symlink"
            where.pop()
            todo.extend(entry.target.split("/")[::-1])
    return None


def path_key(rel: str) -> list[str]:
    # Component-wise order keeps a directory's entries together ("a/b" right after "a", before
    # "a-c"), so the writer walks each directory once.
    return rel.split("/")


def digest(path: str) -> bytes:
    fd = os.open(path, READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file any more")
        digest = hashlib.blake2b()
        while chunk := os.read(fd, HASH_CHUNK):
            digest.update(chunk)
        return digest.digest()
    finally:
        os.close(fd)
