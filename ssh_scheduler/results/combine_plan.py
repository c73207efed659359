"""The planning half of ``combine_folders``: what a merge would do, decided without writing.

See :mod:`ssh_scheduler.results.combine` for the whole merge; this module walks the sources and DEST.

The merge happens in two phases so that a conflict never leaves DEST half-written:

1. :func:`plan_combine` walks every source and the part of DEST that the sources touch, decides
   for every relative path whether it is new, identical (collapsed) or a conflict, and raises
   :class:`CombineConflictError` listing *every* conflict.  It reads, never writes.
2. :func:`combine_folders` carries the plan out: every file goes to a temporary name in its
   destination directory and is hard-linked into place, which fails instead of overwriting.

Result folders come from other machines, so their content is untrusted: symlinks are never
followed out of a source, never recreated pointing outside it, and DEST is only ever entered
through ``O_NOFOLLOW`` directory descriptors, so a symlink planted in DEST is never written through.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from ssh_scheduler.errors import ConfigError, ConflictError
from ssh_scheduler.results.combine_tree import (
    DIR,
    FILE,
    KEPT_MODE_BITS,
    KIND_NAMES,
    LINK,
    SPECIAL,
    DestView,
    Entry,
    digest,
    drop_unsafe,
    one_line,
    path_key,
    walk,
)

__all__ = [
    "CombineConflictError",
    "CombinePlan",
    "CombineReport",
    "Conflict",
    "PlannedCopy",
    "PlannedDir",
    "PlannedLink",
    "plan_combine",
]

_MAX_LISTED_CONFLICTS: Final = 20

@dataclass(frozen=True, slots=True)
class Conflict:
    """One relative path the sources (or DEST) disagree about."""

    path: str
    sources: tuple[str, ...]  # every party holding the path, DEST included, as the user named it
    reason: str


@dataclass(frozen=True, slots=True)
class CombineReport:
    """What :func:`combine_folders` did (or, with ``dry_run``, would do).

    ``copied``: files written; ``identical``: source files and links not written because the same
    content already is in DEST or comes from an earlier source; ``links``: symlinks created;
    ``skipped``: one warning line per thing left out.
    """

    copied: int
    identical: int
    links: int
    skipped: tuple[str, ...]


class PlannedCopy(NamedTuple):
    """A file to copy: ``sources[source]/rel`` -> ``dest/rel``."""

    source: int
    rel: str
    # (size, mtime_ns) the file had when its content was compared with other copies of the same
    # path; None when it was never compared.  A mismatch at copy time means the comparison is stale.
    compared: tuple[int, int] | None


class PlannedLink(NamedTuple):
    """A symlink to recreate at ``dest/rel`` with the same relative ``target``."""

    source: int
    rel: str
    target: str


class PlannedDir(NamedTuple):
    """A directory that DEST lacks; ``mode`` is applied once everything inside it is written."""

    rel: str
    mode: int


@dataclass(frozen=True, slots=True)
class CombinePlan:
    """Everything :func:`combine_folders` will do; produced by :func:`plan_combine`."""

    dest: Path  # absolute, symlinks above it resolved
    dest_label: str  # DEST as the user named it, for messages
    dest_exists: bool
    sources: tuple[Path, ...]  # absolute, resolved
    source_labels: tuple[str, ...]
    copies: tuple[PlannedCopy, ...]
    links: tuple[PlannedLink, ...]
    new_dirs: tuple[PlannedDir, ...]
    identical: int
    skipped: tuple[str, ...]


class CombineConflictError(ConflictError):
    """A :class:`ConflictError` that carries every conflict, not just the ones in its message."""

    def __init__(self, conflicts: Sequence[Conflict], dest_label: str) -> None:
        self.conflicts: tuple[Conflict, ...] = tuple(conflicts)
        shown = "; ".join(
            one_line(f"{c.path} ({c.reason}: {', '.join(c.sources)})")
            for c in self.conflicts[:_MAX_LISTED_CONFLICTS]
        )
        more = len(self.conflicts) - _MAX_LISTED_CONFLICTS
        tail = f"; and {more} more" if more > 0 else ""
        super().__init__(
            f"{len(self.conflicts)} conflicting path(s), nothing was written to {dest_label}: "
            f"{shown}{tail}"
        )


# --------------------------------------------------------------------------------------------
# Planning (reads only)
# --------------------------------------------------------------------------------------------


def plan_combine(dest: Path, sources: Sequence[Path]) -> CombinePlan:
    """Decide what combining ``sources`` into ``dest`` does, without writing anything.

    Raises :class:`ConfigError` for unusable arguments and :class:`CombineConflictError` (a
    :class:`ConflictError`) listing every conflict.
    """
    dest_abs, dest_exists, roots = _check_arguments(dest, sources)
    labels = tuple(str(s) for s in sources)
    dest_label = str(dest)
    skipped: list[str] = []

    trees = [walk(str(root), label) for root, label in zip(roots, labels, strict=True)]
    for tree, label in zip(trees, labels, strict=True):
        drop_unsafe(tree, tree.get, label, skipped)

    def any_source_dir(rel: str) -> bool:
        for tree in trees:
            entry = tree.get(rel)
            if entry is not None and entry.kind == DIR:
                return True
        return False

    # Only the directories the sources also have can hold a conflict, so the rest of a possibly
    # huge DEST is never listed.
    dest_view = DestView(str(dest_abs) if dest_exists else None, any_source_dir, dest_label)

    # A link that stays inside its own source could still lead outside once merged, e.g. through
    # a symlink already planted in DEST; check it again against what DEST will look like.  One
    # pass is enough: a link whose resolution goes through a link rejected here meets the same
    # failure on the way, so removing rejected links never makes an accepted one unsafe.
    def merged_lookup(rel: str) -> Entry | None:
        entry = dest_view.lookup(rel)
        if entry is not None:
            return entry
        for tree in trees:
            entry = tree.get(rel)
            if entry is not None:
                return entry
        return None

    for tree, label in zip(trees, labels, strict=True):
        drop_unsafe(tree, merged_lookup, label, skipped)

    # Merge: the first claim of every path, plus the full list of parties for the (few) paths
    # claimed more than once.  Directories present in several sources are the normal case and
    # need no list.
    first: dict[str, tuple[int, Entry]] = {}
    shared: dict[str, list[tuple[int, Entry]]] = {}
    for index, tree in enumerate(trees):
        for rel, entry in tree.items():
            item = (index, entry)
            prev = first.setdefault(rel, item)
            if prev is item:
                continue
            if prev[1].kind == DIR and entry.kind == DIR and rel not in shared:
                continue
            shared.setdefault(rel, [prev]).append(item)

    dest_entries = dest_view.scanned
    for rel, dest_entry in dest_entries.items():
        claim = first.get(rel)
        if claim is None:
            continue
        if claim[1].kind == DIR and dest_entry.kind == DIR and rel not in shared:
            continue
        shared[rel] = [(-1, dest_entry), *shared.get(rel, [claim])]

    # index -1 stands for DEST in party lists
    def label_of(index: int) -> str:
        return dest_label if index < 0 else labels[index]

    conflicts: list[Conflict] = []
    compared: dict[str, tuple[int, int]] = {}
    for rel in sorted(shared, key=path_key):
        parties = shared[rel]
        reason = _disagreement(parties, compared)
        if reason is not None:
            conflicts.append(Conflict(rel, tuple(label_of(i) for i, _ in parties), reason))
    if conflicts:
        raise CombineConflictError(conflicts, dest_label)

    copies: list[PlannedCopy] = []
    links: list[PlannedLink] = []
    new_dirs: list[PlannedDir] = []
    identical = 0
    for rel, (index, entry) in first.items():
        holders = shared.get(rel)
        if holders is not None:
            if entry.kind != DIR:
                # Everyone agrees (else we raised): one copy is written unless DEST has it already.
                # With DEST among the holders every source copy is identical to it; without it
                # every copy but the first is.  Either way that is len(holders) - 1.
                identical += len(holders) - 1
                if holders[0][0] < 0:
                    continue
            elif rel in dest_entries:
                continue
        elif rel in dest_entries:  # a directory DEST already has
            continue
        if entry.kind == FILE:
            copies.append(PlannedCopy(index, rel, compared.get(entry.path)))
        elif entry.kind == LINK:
            links.append(PlannedLink(index, rel, entry.target))
        else:
            new_dirs.append(PlannedDir(rel, stat.S_IMODE(entry.mode) & KEPT_MODE_BITS))

    return CombinePlan(
        dest=dest_abs,
        dest_label=dest_label,
        dest_exists=dest_exists,
        sources=roots,
        source_labels=labels,
        copies=tuple(sorted(copies, key=lambda c: path_key(c.rel))),
        links=tuple(sorted(links, key=lambda c: path_key(c.rel))),
        new_dirs=tuple(sorted(new_dirs, key=lambda d: path_key(d.rel))),
        identical=identical,
        skipped=tuple(skipped),
    )


def _check_arguments(dest: Path, sources: Sequence[Path]) -> tuple[Path, bool, tuple[Path, ...]]:
    if not sources:
        raise ConfigError("combine_folders needs at least one source folder")
    # The user named these paths, so symlinks *above* them are theirs to use; everything below
    # them is walked without following symlinks.
    roots: list[Path] = []
    for source in sources:
        try:
            root = source.resolve(strict=True)
        except (OSError, RuntimeError):
            raise ConfigError(f"source folder {source} does not exist") from None
        if not root.is_dir():
            raise ConfigError(f"source {source} is not a directory")
        if root in roots:
            raise ConfigError(f"source folder {source} is given twice")
        roots.append(root)
    dest_exists = dest.exists()
    if not dest_exists and os.path.lexists(dest):
        # Creating it would create whatever the dangling link points to, wherever that is.
        raise ConfigError(f"destination {dest} is a dangling symlink")
    if dest_exists and not dest.is_dir():
        raise ConfigError(f"destination {dest} exists and is not a directory")
    dest_abs = dest.resolve()
    for source, root in zip(sources, roots, strict=True):
        if root == dest_abs:
            raise ConfigError(f"source {source} is the destination {dest}")
        if dest_abs.is_relative_to(root):
            raise ConfigError(f"destination {dest} is inside source {source}")
        if root.is_relative_to(dest_abs):
            raise ConfigError(f"source {source} is inside destination {dest}")
    return dest_abs, dest_exists, tuple(roots)


def _disagreement(
    parties: list[tuple[int, Entry]], compared: dict[str, tuple[int, int]]
) -> str | None:
    """Why the parties holding one path disagree, or None when they agree."""
    kinds = {entry.kind for _, entry in parties}
    if len(kinds) > 1:
        return " vs ".join(KIND_NAMES[entry.kind] for _, entry in parties)
    kind = kinds.pop()
    if kind == DIR:
        return None
    if kind == LINK:
        targets = {entry.target for _, entry in parties}
        return None if len(targets) == 1 else "different symlink targets"
    if kind == SPECIAL:  # only DEST can hold special files at this point
        return "special file"
    # Regular files: sizes first (one lstat each); content hashes only when all sizes match.
    stats: list[os.stat_result] = []
    for _, entry in parties:
        try:
            stats.append(os.lstat(entry.path))
        except OSError as exc:
            return f"unreadable: {exc.strerror}"
    if len({st.st_size for st in stats}) > 1:
        return "different content (sizes differ)"
    digests: set[bytes] = set()
    for (_, entry), st in zip(parties, stats, strict=True):
        try:
            digests.add(digest(entry.path))
        except OSError as exc:
            return f"unreadable: {exc.strerror}"
        compared[entry.path] = (st.st_size, st.st_mtime_ns)
    return None if len(digests) == 1 else "different content"

