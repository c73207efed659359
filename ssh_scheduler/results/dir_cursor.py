"""A path of folders below a root, entered through descriptors: ``combine_folders`` writing
DEST and reading its sources, and a job's results written into its staging folder.

Each folder is opened with ``O_NOFOLLOW`` relative to its parent, so no symlink on the way
(planted before or during the run) is ever followed.  The chain from the previous call is kept
and only what differs is opened: a listing in tree order opens each folder about once, not once
per entry and level.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

__all__ = ["DIR_FLAGS", "DirCursor"]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a link: ELOOP


class DirCursor:
    """Descriptors for one folder path below ``root_fd`` (borrowed: never closed here; only ever
    used as a ``dir_fd``).  With ``create``, a missing folder is made with ``mode`` and its
    path added to :attr:`created`.  Not shareable between threads."""

    def __init__(self, root_fd: int, *, create: bool, mode: int = 0o700, root_label: str = "") -> None:
        self.root_fd = root_fd
        self._root_label = root_label
        self._create = create
        self._mode = mode
        self._names: list[str] = []
        self._fds: list[int] = []
        self.created: set[str] = set()

    def enter(self, parts: Sequence[str]) -> int:
        """The descriptor of the folder ``parts`` below the root (the root itself for none)."""
        common = 0
        limit = min(len(parts), len(self._names))
        while common < limit and self._names[common] == parts[common]:
            common += 1
        while len(self._fds) > common:
            os.close(self._fds.pop())
            self._names.pop()
        for name in parts[common:]:
            parent = self._fds[-1] if self._fds else self.root_fd
            self._fds.append(self._open(parent, name))
            self._names.append(name)
        return self._fds[-1] if self._fds else self.root_fd

    def _open(self, parent: int, name: str) -> int:
        # Open first, make only when missing: most entries land in folders made already, and a
        # mkdir that fails with EEXIST still locks the parent folder.
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not self._create:
                raise
        # Made meanwhile by another writer: O_NOFOLLOW on the open below still checks it.
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, self._mode, dir_fd=parent)
            self.created.add("/".join([*self._names, name]))
        return os.open(name, DIR_FLAGS, dir_fd=parent)

    def where(self, name: str = "") -> str:
        """The current folder (or ``name`` in it) for a message."""
        return os.path.join(self._root_label, *self._names, name)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())
        self._names.clear()
