"""Copy inputs forward and results back.

Forward, rsync-style but content-addressed: every local file is hashed once per batch; each host
keeps a cache ``<workdir>/cache/<sha256>-<r|x>`` so a file reaches a host at most once however many
jobs use it, and not at all when an earlier batch already sent the same bytes.  Each job gets a
private directory whose inputs are hard links into that cache.

Back: the host is untrusted.  The agent lists what to fetch, but every name is validated here,
every local file is created relative to directory file descriptors with ``O_NOFOLLOW``/``O_EXCL``
(from the results folder's verified descriptor down), remote symlinks are only recreated when
they stay inside the job folder, special files are skipped, and limits stop a flood: per job
(bytes, files, folders deep) and per batch (:class:`CopyBudget`).  Results land in a staging
folder that is renamed into ``job_results/<job>`` only when complete, so a crash never leaves a
partial result visible.  A write that fails here (a full disk) fails the whole copy-back as this
machine's fault (``LocalWriteError``), never as a skipped file: nothing half-copied stays here,
and the caller leaves the results on the host.

Small files travel many to a message through the agent (bulk.py) rather than by an SFTP round trip
sequence each; that changes how the bytes come, not one of the checks above.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ssh_scheduler.agent.protocol import ManifestEntry, decode_listing
from ssh_scheduler.agent.wire import ProtocolError
from ssh_scheduler.errors import TransferError
from ssh_scheduler.executors import bulk
from ssh_scheduler.executors.session import HostSession
from ssh_scheduler.executors.stage_plan import StagePlan

# The walk, secrets, ignore file and size check live in the pure module forward; these names
# stay importable from here.
from ssh_scheduler.jobs.forward import DEFAULT_EXCLUDES as DEFAULT_EXCLUDES
from ssh_scheduler.jobs.forward import ForwardSet as ForwardSet
from ssh_scheduler.jobs.forward import Hasher as Hasher
from ssh_scheduler.jobs.forward import LocalFile as LocalFile
from ssh_scheduler.jobs.forward import collect_forward as collect_forward
from ssh_scheduler.results.dir_cursor import DIR_FLAGS, DirCursor
from ssh_scheduler.results.local_folder import local_write_error
from ssh_scheduler.transport.base import RemoteFileError, SizeLimitExceeded, printable

UPLOAD_CONCURRENCY = 4
MAX_WARNINGS = 50  # per job: a host sending 10^5 bad names must not flood the terminal


class HostCache:
    """What one host's cache holds, so each distinct file is uploaded at most once per batch."""

    def __init__(self, host: HostSession) -> None:
        self.host = host
        self._ready: dict[str, asyncio.Future[None]] = {}
        self._limit = asyncio.Semaphore(UPLOAD_CONCURRENCY)
        self.bytes_uploaded = 0
        self.files_uploaded = 0

    async def ensure(self, files: Sequence[LocalFile]) -> None:
        unique = {f.key: f for f in files}
        new = [f for key, f in unique.items() if key not in self._ready]
        loop = asyncio.get_running_loop()
        for f in new:
            self._ready[f.key] = loop.create_future()
        # Taken now: a concurrent ensure whose upload fails drops its keys from _ready meanwhile.
        waiting = [self._ready[key] for key in unique]
        if new:
            try:
                missing = set(await self.host.have([f.key for f in new], {f.key: f.size for f in new}))
                await self._send([f for f in new if f.key in missing])
            except BaseException as exc:
                for f in new:
                    fut = self._ready.pop(f.key)
                    if not fut.done():
                        fut.set_exception(exc)
                        fut.exception()  # mark retrieved: the caller raises it below
                raise
            for f in new:
                if not self._ready[f.key].done():
                    self._ready[f.key].set_result(None)
        await asyncio.gather(*waiting)

    async def resend(self, files: Sequence[LocalFile]) -> None:
        """Send these again: the host said they are gone from its cache (spoiled and removed)."""
        for f in files:
            ready = self._ready.get(f.key)
            if ready is not None and ready.done():
                del self._ready[f.key]
        await self.ensure(files)

    async def _send(self, files: list[LocalFile]) -> None:
        """Small files many to a message through the agent (bulk.py), the rest by SFTP."""
        small = [f for f in files if f.size <= bulk.SMALL_FILE]
        large = [f for f in files if f.size > bulk.SMALL_FILE]
        again = await bulk.put_small(self.host, small) if small else []
        kept = {f.key for f in small} - {f.key for f in again}
        self.bytes_uploaded += sum(f.size for f in small if f.key in kept)
        self.files_uploaded += len(kept)
        await asyncio.gather(*(self._upload(f) for f in large + again))

    async def _upload(self, f: LocalFile) -> None:
        # Private (like the work root around it), read-only: a job that rewrites an input in
        # place must not change what later jobs are linked to.
        mode = 0o500 if f.key.endswith("-x") else 0o400
        target = f"{self.host.root}/cache/{f.key}"
        if not self.host.inside_root(target):
            raise TransferError(f"{self.host.name}: refusing to upload to {shown(target)}, outside the work root")
        async with self._limit:
            sent = await self.host.transport.upload(f.path, target, mode)
        self.bytes_uploaded += sent
        self.files_uploaded += 1


async def send_forward(cache: HostCache, forward: ForwardSet, jobdir: str) -> None:
    await cache.host.stage(jobdir, *await prepare_forward(cache, forward))


async def prepare_forward(cache: HostCache, forward: ForwardSet) -> StagePlan:
    """Make sure the host's cache holds every input; returns what to stage (files, dirs), for
    ``HostSession.stage`` or for the run request itself."""
    await cache.ensure(forward.files)
    return StagePlan([(f.rel, f.key) for f in forward.files], list(forward.dirs))


# --- back ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CopyLimits:
    max_bytes: int = 10 * 1024**3
    max_files: int = 100_000
    max_output_bytes: int | None = None  # a job's streamed stdout + stderr (None: no limit)
    max_depth: int = 64  # folders in a result's path: each costs a directory open here
    batch_files: int = 10_000_000  # listed by every copy-back of a batch together
    batch_bytes: int = 10 * 1024**4  # brought home by every copy-back of a batch together


class CopyBudget:
    """What every copy-back of one batch together may still cost here: entries listed (each
    is checked, and created, here) and bytes written.  Shared by the batch's jobs; hosts, not
    the user, decide what they send, so a fleet of hostile ones cannot make the coordinator
    list and write without end."""

    def __init__(self, limits: CopyLimits) -> None:
        self.limits = limits
        self.files_left = limits.batch_files
        self.bytes_left = limits.batch_bytes


class BudgetSpent(TransferError):
    """The batch's copy-back budget (:class:`CopyBudget`) is spent: nothing more comes home."""


@dataclass(frozen=True, slots=True)
class Destination:
    """Where one job's results go here: ``name`` inside the results folder, which is open as
    ``folder`` (a verified descriptor: nothing below it is reached through a link) and named
    ``shown`` in messages; ``budget``, the batch's copy-back budget (None: no batch limit)."""

    folder: int
    name: str
    shown: Path
    budget: CopyBudget | None = None


@dataclass(slots=True)
class CopyBackReport:
    files: int = 0
    bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    suppressed: int = 0  # warnings beyond MAX_WARNINGS, counted only


def _encodable(name: str) -> bool:
    """Can this name be a file name here?  (A lone surrogate that is not a surrogate-escaped
    byte cannot, and would crash ``os.open``.)"""
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return True


def safe_relpath(rel: object) -> str | None:
    """The validated relative path, or None when a remote name could escape or is malformed."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or rel.startswith("/"):
        return None
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    if not _encodable(rel):
        return None
    return rel


def link_stays_inside(rel: str, target: str) -> bool:
    """May the link ``rel -> target`` be recreated inside the job folder?

    Only relative targets of the form ``../../a/b``: the ``..`` steps come first and climb no
    higher than the link's own directory is deep.  A ``..`` after a name is refused even when it
    looks harmless, because the kernel resolves it *after* following that name: with
    ``a/b/x -> ../..``, the target ``a/b/x/../..`` reads as ``a`` but leads two levels above the
    job folder.  Since the link's parent directories are real directories (the tree never
    follows links) and every other link obeys the same rule, no link can lead outside.
    """
    if not isinstance(target, str) or not target or target.startswith("/") or "\x00" in target:
        return False
    if not _encodable(target):
        return False
    parts = [p for p in target.split("/") if p not in ("", ".")]
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    if ".." in parts[ups:]:
        return False
    depth = rel.count("/")  # directories between the job folder and the link
    return ups <= depth


def shown(name: object, limit: int = 200) -> str:
    """A remote name for a message: control characters and odd bytes escaped, cut if long."""
    return printable(name if isinstance(name, str) else repr(name), limit)


# What a host's names can make creating an entry fail with: a link or file where a folder goes
# (ELOOP, ENOTDIR), a name twice (EEXIST, EISDIR), a name this file system cannot hold.  Such an
# entry is skipped with a warning; any other failure (ENOSPC, EDQUOT, EIO, EACCES...) is here,
# the batch's (LocalWriteError).
_HOST_CAUSED = frozenset(
    {errno.ELOOP, errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ, errno.EMLINK}
)
# What writing into a file we opened fails with when the fault is here, not in what was sent.
_WRITE_FAILED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EBADF})


class _SafeTree:
    """Creates entries under one root directory without ever following a symlink (its folders
    entered through a :class:`DirCursor`, made 0755 where missing)."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._cursor = DirCursor(root_fd, create=True, mode=0o755)

    def _enter(self, parts: Sequence[str]) -> int:
        return self._cursor.enter(parts)

    def mkdir(self, rel: str) -> None:
        self._enter(rel.split("/"))

    def create_file(self, rel: str, mode: int) -> tuple[int, int]:
        """Returns (file fd, parent dir fd); the parent stays the tree's to close."""
        *parents, name = rel.split("/")
        dfd = self._enter(parents)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o777, dir_fd=dfd)
        return fd, dfd

    def symlink(self, rel: str, target: str) -> None:
        *parents, name = rel.split("/")
        os.symlink(target, name, dir_fd=self._enter(parents))

    def close(self) -> None:
        self._cursor.close()


async def fetch_back(
    host: HostSession,
    jobdir: str,
    dest: Destination,
    *,
    paths: Sequence[str] | None,
    limits: CopyLimits,
    entries: object = None,
) -> CopyBackReport:
    """Bring a job's results home into ``dest`` (which must not exist yet), atomically.

    ``entries``: the listing the agent already sent with the job's exit; without it, ask.

    On any failure (a limit exceeded, the connection lost, a full disk here: then
    :class:`~ssh_scheduler.errors.LocalWriteError`) nothing is left here and the results stay on
    the host; names, links and special files the host should not send are skipped with a
    warning in the report.
    """
    try:
        os.lstat(dest.name, dir_fd=dest.folder)
    except FileNotFoundError:
        pass
    else:
        raise TransferError(f"{dest.shown / dest.name} already exists; results are never overwritten")
    if not host.inside_root(jobdir):
        raise TransferError(f"{host.name}: refusing to fetch from {shown(jobdir)}, outside the work root")
    if entries is None:
        entries = await host.manifest(jobdir, list(paths) if paths else None)
    if isinstance(entries, list) and len(entries) > limits.max_files:
        raise TransferError(
            f"{host.name}: the job folder holds {len(entries)} entries, over the copy-back limit of "
            f"{limits.max_files} files (raise --max-result-files)"
        )
    budget = dest.budget
    if budget is not None and isinstance(entries, list) and len(entries) > budget.files_left:
        raise BudgetSpent(
            f"{host.name}: the job folder holds {len(entries)} entries, more than the {budget.files_left} the "
            f"batch may still copy back of its {budget.limits.batch_files} (raise --max-batch-result-files)"
        )
    try:
        listing, malformed = decode_listing(entries)
    except ProtocolError:
        raise TransferError(f"{host.name}: the host sent a malformed list of results; nothing was copied back") from None
    deepest = max((entry.path.count("/") + 1 for entry in listing if isinstance(entry.path, str)), default=0)
    if deepest > limits.max_depth:
        raise TransferError(
            f"{host.name}: a result is {deepest} folders deep, over the copy-back limit of "
            f"{limits.max_depth} (raise --max-result-depth)"
        )
    if budget is not None:
        budget.files_left -= len(listing)
    report = CopyBackReport()
    if malformed:
        _warn(report, f"{host.name}: malformed manifest entry skipped" + (f" ({malformed} in all)" if malformed > 1 else ""))
    staging = dest.name if not listing else f".partial-{dest.name}-{secrets.token_hex(4)}"
    try:
        # Nothing to copy: the empty folder is the result, appearing whole at once.
        os.mkdir(staging, 0o755, dir_fd=dest.folder)
    except OSError as exc:
        raise local_write_error(exc, dest.shown, f"copying back {dest.name}") from None
    if not listing:
        return report
    # Small files are asked of the agent many to a message, ahead of being written here in the
    # listing's order, each by the same checks below; only names that pass them are asked for.
    small = [
        (entry.path, entry.size) for entry in listing
        if entry.kind == "file" and 0 <= entry.size <= bulk.SMALL_FILE and safe_relpath(entry.path) is not None
    ]  # fmt: skip
    byte_limit = limits.max_bytes if budget is None else min(limits.max_bytes, budget.bytes_left)
    prefetch = bulk.Prefetch(host, jobdir, small, byte_limit)
    tree: _SafeTree | None = None
    try:
        tree = _SafeTree(os.open(staging, DIR_FLAGS, dir_fd=dest.folder))
        fetch = _Fetch(host, jobdir, dest, tree, report, limits, prefetch)
        for entry in listing:
            await fetch.entry(entry)
        await prefetch.close()
        tree.close()
        os.close(tree.root_fd)
        tree = None
        try:
            os.lstat(dest.name, dir_fd=dest.folder)
        except FileNotFoundError:
            os.rename(staging, dest.name, src_dir_fd=dest.folder, dst_dir_fd=dest.folder)
        else:
            raise TransferError(f"{dest.shown / dest.name} appeared meanwhile; results are never overwritten")
    except BaseException as exc:
        await prefetch.close()
        if tree is not None:
            tree.close()
            os.close(tree.root_fd)
        shutil.rmtree(staging, ignore_errors=True, dir_fd=dest.folder)
        if isinstance(exc, OSError):  # the staging folder's own open or rename: here
            raise local_write_error(exc, dest.shown, f"copying back {dest.name}") from None
        raise
    if report.suppressed:
        report.warnings.append(f"{host.name}: ... and {report.suppressed} more warnings")
    return report


def _warn(report: CopyBackReport, message: str) -> None:
    if len(report.warnings) < MAX_WARNINGS:
        report.warnings.append(message)
    else:
        report.suppressed += 1


@dataclass(slots=True)
class _Fetch:
    """One copy-back's entries, written into its staging tree one by one."""

    host: HostSession
    jobdir: str
    dest: Destination
    tree: _SafeTree
    report: CopyBackReport
    limits: CopyLimits
    prefetch: bulk.Prefetch

    def _here(self, exc: OSError, rel: str) -> TransferError:
        return local_write_error(exc, self.dest.shown, f"copying back {self.dest.name}/{shown(rel)}")

    async def entry(self, entry: ManifestEntry) -> None:
        host, report = self.host, self.report
        kind, link = entry.kind, entry.link
        rel = safe_relpath(entry.path)
        if rel is None:
            _warn(report, f"{host.name}: unsafe name '{shown(entry.path)}' refused")
            return
        try:
            if kind == "dir":
                self.tree.mkdir(rel)
            elif kind == "link":
                if link is not None and link_stays_inside(rel, link):
                    self.tree.symlink(rel, link)
                else:
                    _warn(report, f"{shown(rel)}: symlink to '{shown(link)}' leaves the job folder; skipped")
            elif kind == "file":
                await self._file(rel, entry.mode)
            else:
                _warn(report, f"{shown(rel)}: special file skipped")
        except (OSError, ValueError) as exc:
            # ELOOP / ENOTDIR / EEXIST: something tried to redirect us through a link or reuse a
            # name; anything else (ENOSPC...) is this machine's, and the whole copy-back's.
            if isinstance(exc, OSError) and exc.errno not in _HOST_CAUSED:
                raise self._here(exc, rel) from None
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            _warn(report, f"{shown(rel)}: refused ({reason})")

    async def _file(self, rel: str, mode: int) -> None:
        fd, dfd = self.tree.create_file(rel, mode)
        done = False
        try:
            budget = self.dest.budget
            left = self.limits.max_bytes - self.report.bytes
            batch_left = budget.bytes_left if budget is not None else left
            try:
                got = await _download(self.host, self.jobdir, rel, fd, min(left, batch_left), self.prefetch)
            except SizeLimitExceeded:
                if budget is not None and batch_left < left:
                    raise BudgetSpent(
                        f"{self.host.name}: the batch's results passed its copy-back budget of "
                        f"{budget.limits.batch_bytes} bytes (raise --max-batch-result-bytes)"
                    ) from None
                raise TransferError(
                    f"{self.host.name}: the results exceed the copy-back limit of "
                    f"{self.limits.max_bytes} bytes (raise --max-result-bytes)"
                ) from None
            except RemoteFileError as exc:
                _warn(self.report, f"{shown(rel)}: not copied: {shown(str(exc), 500)}")
                return
            except OSError as exc:
                if exc.errno in _WRITE_FAILED:  # writing here failed: the copy-back fails
                    raise self._here(exc, rel) from None
                # A local transport reading this machine's files: the source could not be read.
                _warn(self.report, f"{shown(rel)}: not copied: {exc.strerror or exc}")
                return
            self.report.bytes += got
            self.report.files += 1
            if budget is not None:
                budget.bytes_left -= got
            done = True
        finally:
            os.close(fd)
            if not done:  # no empty stand-in for a file that did not come
                with contextlib.suppress(OSError):
                    os.unlink(rel.rsplit("/", 1)[-1], dir_fd=dfd)


async def _download(host: HostSession, jobdir: str, rel: str, fd: int, budget: int, prefetch: bulk.Prefetch) -> int:
    """One result file into ``fd``: from the agent's bulk answer when it has one, else by SFTP;
    either way counted against the same byte budget.  Writing ``fd`` failing raises the
    OSError it is (the caller knows it is this machine's)."""
    blob = await prefetch.get(rel)
    if blob is None:
        return await host.transport.download(f"{jobdir}/{rel}", fd, budget)
    data = bulk.content(host, rel, blob)
    if len(data) > budget:
        raise SizeLimitExceeded(f"{jobdir}/{rel}", budget)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)
