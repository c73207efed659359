"""``combine_folders DEST SRC1 SRC2 ...``: safely merge result folders.

The merge happens in two phases so that a conflict never leaves DEST half-written:

1. :func:`~ssh_scheduler.results.combine_plan.plan_combine` walks every source and the part of DEST that
   the sources touch, decides for every relative path whether it is new, identical (collapsed)
   or a conflict, and raises :class:`CombineConflictError` listing *every* conflict.  It reads,
   never writes.
2. :func:`combine_folders` carries the plan out: every file goes to a temporary name in its
   destination directory and is hard-linked into place, which fails instead of overwriting.

Result folders come from other machines, so their content is untrusted: symlinks are never
followed out of a source, never recreated pointing outside it, and DEST is only ever entered
through ``O_NOFOLLOW`` directory descriptors, so a symlink planted in DEST is never written through.
Nothing named ``.git`` is merged: hooks or a config there would run in DEST's git.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, NamedTuple

from ssh_scheduler.errors import TransferError
from ssh_scheduler.results.combine_plan import (
    CombinePlan,
    CombineReport,
    PlannedCopy,
    PlannedLink,
    plan_combine,
)
from ssh_scheduler.results.combine_tree import (
    COPY_CHUNK,
    HASH_CHUNK,
    KEPT_MODE_BITS,
    READ_FLAGS,
    TEMP_FLAGS,
    one_line,
)
from ssh_scheduler.results.dir_cursor import DirCursor

__all__ = ["combine_folders"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _log_warning(line: str) -> None:
    log.warning("%s", line)


def _log_info(line: str) -> None:
    log.info("%s", line)


def combine_folders(
    dest: Path,
    sources: Sequence[Path],
    *,
    dry_run: bool = False,
    out: Callable[[str], None] = _log_info,
    warn: Callable[[str], None] = _log_warning,
) -> CombineReport:
    """Merge ``sources`` into ``dest``; see the module docstring.

    Raises :class:`ConfigError` for unusable arguments and :class:`CombineConflictError` (DEST
    untouched) when the sources disagree.  With ``dry_run`` it prints ``copy SRC/p -> DEST/p``
    (and ``link DEST/p -> TARGET``) lines through ``out``, odd characters escaped, and writes
    nothing.  Each skipped item
    is reported through ``warn`` and in the returned report.
    """
    plan = plan_combine(dest, sources)
    for line in plan.skipped:
        warn(line)
    if dry_run:
        # Names come from other machines: a control character in one must not reach the
        # terminal (or split the line); they are escaped as every other message does.
        for copy in plan.copies:
            src = os.path.join(plan.source_labels[copy.source], copy.rel)
            out(one_line(f"copy {src} -> {os.path.join(plan.dest_label, copy.rel)}"))
        for link in plan.links:
            out(one_line(f"link {os.path.join(plan.dest_label, link.rel)} -> {link.target}"))
        return CombineReport(len(plan.copies), plan.identical, len(plan.links), plan.skipped)
    return _execute(plan, warn)


class _Skip(Exception):
    """One file is left out; the message is its warning line."""


# One directory's share of the work: (relative dir, files to copy into it, links to make in it).
_Unit = tuple[str, list[PlannedCopy], list[PlannedLink]]

# Files per batch a writer takes at once: big enough that a writer's cursors stay on one
# directory for a while, small enough that a big directory is still spread over all writers.
_BATCH_FILES: Final = 256


def _batches(plan: CombinePlan) -> list[list[_Unit]]:
    """Cut the plan into batches of neighbouring directories, in tree order."""
    work: dict[str, tuple[list[PlannedCopy], list[PlannedLink]]] = {}
    for new_dir in plan.new_dirs:
        work.setdefault(new_dir.rel, ([], []))
    for copy in plan.copies:
        work.setdefault(copy.rel.rpartition("/")[0], ([], []))[0].append(copy)
    for link in plan.links:
        work.setdefault(link.rel.rpartition("/")[0], ([], []))[1].append(link)
    batches: list[list[_Unit]] = []
    current: list[_Unit] = []
    size = 0
    for rel_dir in sorted(work, key=_dir_key):
        copies, links = work[rel_dir]
        for start in range(0, max(len(copies), 1), _BATCH_FILES):
            piece = copies[start : start + _BATCH_FILES]
            current.append((rel_dir, piece, links if start == 0 else []))
            size += len(piece) + 1
            if size >= _BATCH_FILES:
                batches.append(current)
                current, size = [], 0
    if current:
        batches.append(current)
    return batches


def _dir_key(rel_dir: str) -> list[str]:
    return rel_dir.split("/") if rel_dir else []


def _default_writers() -> int:
    # Writing small files is syscall-bound (open, sendfile, link, ...), and syscalls run without
    # the GIL, so threads overlap them even on few cores; a handful is enough to keep the disk
    # and the cores busy without fighting over the same directories.
    return min(4, max(2, os.cpu_count() or 1))


class _Writer:
    """One writer thread's state: its own cursors into DEST and into each source."""

    def __init__(self, plan: CombinePlan, dest_fd: int, source_fds: Sequence[int], tag: int):
        self._plan = plan
        # Folders made 0700 while we write into them: the source's mode is applied at the end, so
        # a read-only source folder does not stop us from filling it.
        self.dest = DirCursor(dest_fd, create=True, mode=0o700, root_label=plan.dest_label)
        self._sources = [
            DirCursor(fd, create=False, root_label=label)
            for fd, label in zip(source_fds, plan.source_labels, strict=True)
        ]
        self._temp_names = (f".combine-{os.getpid()}-{tag}-{n}.tmp" for n in itertools.count())
        self.copied = 0
        self.links = 0

    def write(self, batch: list[_Unit]) -> list[str]:
        """Carry out one batch; returns its warning lines."""
        skipped: list[str] = []
        for rel_dir, copies, links in batch:
            parts = _dir_key(rel_dir)
            try:
                dest_fd = self.dest.enter(parts)
            except OSError as exc:
                # The plan saw a real directory (or nothing) here: DEST changed under us.
                raise TransferError(
                    f"{os.path.join(self._plan.dest_label, rel_dir)} is not a real directory "
                    f"any more ({exc.strerror}); {self._plan.dest_label} is partly combined"
                ) from exc
            try:
                for copy in copies:
                    cursor = self._sources[copy.source]
                    name = copy.rel.rpartition("/")[2]
                    try:
                        source_fd = cursor.enter(parts)
                    except OSError as exc:  # the source directory vanished or was swapped
                        skipped.append(
                            one_line(f"skipped {cursor.where(name)}: {exc.strerror or exc}")
                        )
                        continue
                    try:
                        _copy_file(source_fd, dest_fd, name, copy.compared, self._temp_names)
                        self.copied += 1
                    except _Skip as exc:
                        skipped.append(one_line(f"skipped {cursor.where(name)}: {exc}"))
                for link in links:
                    name = link.rel.rpartition("/")[2]
                    try:
                        os.symlink(link.target, name, dir_fd=dest_fd)
                        self.links += 1
                    except FileExistsError:
                        skipped.append(
                            one_line(
                                f"skipped {self.dest.where(name)}: appeared meanwhile; not overwritten"
                            )
                        )
            except OSError as exc:  # ENOSPC, EIO, EACCES in DEST...: no point going on
                raise TransferError(
                    f"writing into {self.dest.where()} failed: {exc.strerror or exc}; "
                    f"{self._plan.dest_label} is partly combined"
                ) from exc
        return skipped

    def close(self) -> None:
        self.dest.close()
        for cursor in self._sources:
            cursor.close()


def _execute(
    plan: CombinePlan, warn: Callable[[str], None], writers: int | None = None
) -> CombineReport:
    """Write what ``plan`` says, with ``writers`` threads; warnings go to ``warn`` at the end."""
    batches = _batches(plan)
    try:
        if not plan.dest_exists:
            os.makedirs(plan.dest, exist_ok=True)
        dest_fd = os.open(plan.dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise TransferError(f"cannot create {plan.dest_label}: {exc.strerror or exc}") from exc
    source_fds: list[int] = []
    team: list[_Writer] = []
    try:
        for path in plan.sources:
            source_fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        count = max(1, min(writers or _default_writers(), len(batches)))
        team = [_Writer(plan, dest_fd, source_fds, tag) for tag in range(count)]
        results: list[list[str]] = [[] for _ in batches]
        errors: list[BaseException] = []
        taken = iter(range(len(batches)))
        lock = threading.Lock()

        def drain(writer: _Writer) -> None:
            try:
                while not errors:
                    with lock:
                        index = next(taken, None)
                    if index is None:
                        return
                    results[index] = writer.write(batches[index])
            except BaseException as exc:  # handed to the main thread, which re-raises it
                errors.append(exc)

        if count == 1:
            drain(team[0])
        else:
            threads = [threading.Thread(target=drain, args=(w,), daemon=True) for w in team]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]

        # Directory modes last (deepest first), so that read-only ones were writable while filled.
        created = set().union(*(writer.dest.created for writer in team))
        chmod_cursor = team[0].dest
        try:
            for new_dir in reversed(plan.new_dirs):
                if new_dir.rel in created:
                    os.fchmod(chmod_cursor.enter(new_dir.rel.split("/")), new_dir.mode)
        except OSError as exc:
            raise TransferError(
                f"setting the mode of {chmod_cursor.where()} failed: {exc.strerror or exc}"
            ) from exc
    finally:
        for writer in team:
            writer.close()
        for fd in (dest_fd, *source_fds):
            os.close(fd)

    skipped = [line for lines in results for line in lines]
    for line in skipped:
        warn(line)
    return CombineReport(
        sum(w.copied for w in team),
        plan.identical,
        sum(w.links for w in team),
        (*plan.skipped, *skipped),
    )


def _copy_file(
    source_dir: int,
    dest_dir: int,
    name: str,
    compared: tuple[int, int] | None,
    temp_names: Iterator[str],
) -> None:
    """Copy one file into ``dest_dir``: temp file, then hard link into place (never overwrites)."""
    try:
        source = os.open(name, READ_FLAGS, dir_fd=source_dir)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Skip("became a symlink after it was planned") from None
        raise _Skip(exc.strerror or str(exc)) from None
    try:
        st = os.fstat(source)
        if not stat.S_ISREG(st.st_mode):
            raise _Skip("is no longer a regular file")
        if compared is not None and compared != (st.st_size, st.st_mtime_ns):
            raise _Skip("changed after it was compared with the other copies")
        temp = _create_temp(dest_dir, temp_names)
        try:
            try:
                _copy_data(source, temp.fd, st.st_size)
                os.fchmod(temp.fd, stat.S_IMODE(st.st_mode) & KEPT_MODE_BITS)
                os.utime(temp.fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(temp.fd)
            _place(dest_dir, temp.name, name)
        finally:
            # After link() the temp name is a second name of the placed file; after a failure it
            # must not linger either.  (Only the rename fallback has removed it already.)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp.name, dir_fd=dest_dir)
    finally:
        os.close(source)


class _Temp(NamedTuple):
    fd: int
    name: str


def _create_temp(dest_dir: int, temp_names: Iterator[str]) -> _Temp:
    while True:
        name = next(temp_names)
        try:
            return _Temp(os.open(name, TEMP_FLAGS, 0o600, dir_fd=dest_dir), name)
        except FileExistsError:  # a leftover of a crashed run, or a source file by that name
            continue


def _copy_data(source: int, dest: int, size: int) -> None:
    # Exactly the size fstat() reported: a file still being appended to is copied as it was then.
    remaining = size
    try:
        while remaining > 0:
            sent = os.sendfile(dest, source, None, min(remaining, COPY_CHUNK))
            if sent == 0:
                break
            remaining -= sent
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or remaining != size:
            raise
        # sendfile() between these two files is not supported: plain read/write.
        while remaining > 0:
            chunk = os.read(source, min(remaining, HASH_CHUNK))
            if not chunk:
                break
            remaining -= len(chunk)
            view = memoryview(chunk)
            while view:  # write() may take less than it was given
                view = view[os.write(dest, view) :]


def _place(dest_dir: int, temp: str, name: str) -> None:
    """Give the finished temp file its real name, refusing to replace anything there.

    rename() would silently replace a file that appeared since the plan; link() fails instead.
    """
    try:
        os.link(temp, name, src_dir_fd=dest_dir, dst_dir_fd=dest_dir, follow_symlinks=False)
    except FileExistsError:
        raise _Skip("its destination appeared meanwhile; not overwritten") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A filesystem without hard links: rename, after checking; the window between the two is
        # the best such a filesystem allows.
        try:
            os.lstat(name, dir_fd=dest_dir)
        except FileNotFoundError:
            os.rename(temp, name, src_dir_fd=dest_dir, dst_dir_fd=dest_dir)
        else:
            raise _Skip("its destination appeared meanwhile; not overwritten") from None
