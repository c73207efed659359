"""Copy inputs forward and results back.

Forward, rsync-style but content-addressed: every local file is hashed once per batch; each host
keeps a cache ``<workdir>/cache/<sha256>-<r|x>`` so a file reaches a host at most once however many
jobs use it, and not at all when an earlier batch already sent the same bytes.  Each job gets a
private directory whose inputs are hard links into that cache.

Back: the host is untrusted.  The agent lists what to fetch, but every name is validated here,
every local file is created relative to directory file descriptors with ``O_NOFOLLOW``/``O_EXCL``,
remote symlinks are only recreated when they stay inside the job folder, special files are
skipped, and size and count limits stop a flood.  Results land in a staging folder that is renamed
into ``job_results/<job>`` only when complete, so a crash never leaves a partial result visible.

Small files travel many to a message through the agent (bulk.py) rather than by an SFTP round trip
sequence each; that changes how the bytes come, not one of the checks above.
"""

from __future__ import annotations

import asyncio
import contextlib
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW  # a link is never followed (ELOOP)


class _SafeTree:
    """Creates entries under one root directory without ever following a symlink."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd

    def _open_dir(self, parts: Sequence[str], create: bool) -> int:
        fd = os.dup(self.root_fd)
        try:
            for part in parts:
                # Open first, make only when missing: most files land in folders made already, and
                # a mkdir that fails with EEXIST still locks the parent folder.
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mkdir(self, rel: str) -> None:
        os.close(self._open_dir(rel.split("/"), create=True))

    def create_file(self, rel: str, mode: int) -> tuple[int, int]:
        """Returns (file fd, parent dir fd)."""
        *parents, name = rel.split("/")
        dfd = self._open_dir(parents, create=True)
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode & 0o777, dir_fd=dfd
            )
        except BaseException:
            os.close(dfd)
            raise
        return fd, dfd

    def symlink(self, rel: str, target: str) -> None:
        *parents, name = rel.split("/")
        dfd = self._open_dir(parents, create=True)
        try:
            os.symlink(target, name, dir_fd=dfd)
        finally:
            os.close(dfd)


async def fetch_back(
    host: HostSession,
    jobdir: str,
    dest: Path,
    *,
    paths: Sequence[str] | None,
    limits: CopyLimits,
    entries: object = None,
) -> CopyBackReport:
    """Bring a job's results home into ``dest`` (which must not exist yet), atomically.

    ``entries``: the listing the agent already sent with the job's exit; without it, ask.

    On any failure (a limit exceeded, the connection lost) nothing is left here and the results
    stay on the host; names, links and special files the host should not send are skipped with
    a warning in the report.
    """
    if dest.exists() or dest.is_symlink():
        raise TransferError(f"{dest} already exists; results are never overwritten")
    if not host.inside_root(jobdir):
        raise TransferError(f"{host.name}: refusing to fetch from {shown(jobdir)}, outside the work root")
    if entries is None:
        entries = await host.manifest(jobdir, list(paths) if paths else None)
    if isinstance(entries, list) and len(entries) > limits.max_files:
        raise TransferError(
            f"{host.name}:{jobdir} holds {len(entries)} entries, over the copy-back limit of "
            f"{limits.max_files} files (raise --max-result-files); the results stay on the host"
        )
    try:
        listing, malformed = decode_listing(entries)
    except ProtocolError:
        raise TransferError(
            f"{host.name}:{jobdir}: the host sent a malformed list of results; nothing was "
            f"copied back and the results stay on the host"
        ) from None
    report = CopyBackReport()
    if malformed:
        _warn(report, f"{host.name}: malformed manifest entry skipped" + (f" ({malformed} in all)" if malformed > 1 else ""))
    if not listing:
        os.mkdir(dest, 0o755)  # nothing to copy: an empty folder appears whole at once
        return report
    staging = dest.parent / f".partial-{dest.name}-{secrets.token_hex(4)}"
    os.mkdir(staging, 0o755)
    root_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    # Small files are asked of the agent many to a message, ahead of being written here in the
    # listing's order, each by the same checks below; only names that pass them are asked for.
    small = [
        (entry.path, entry.size) for entry in listing
        if entry.kind == "file" and 0 <= entry.size <= bulk.SMALL_FILE and safe_relpath(entry.path) is not None
    ]  # fmt: skip
    prefetch = bulk.Prefetch(host, jobdir, small, limits.max_bytes)
    try:
        tree = _SafeTree(root_fd)
        for entry in listing:
            await _fetch_entry(host, jobdir, tree, entry, report, limits, prefetch)
        await prefetch.close()
        os.close(root_fd)
        root_fd = -1
        os.rename(staging, dest)
    except BaseException:
        await prefetch.close()
        if root_fd >= 0:
            os.close(root_fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if report.suppressed:
        report.warnings.append(f"{host.name}: ... and {report.suppressed} more warnings")
    return report


def _warn(report: CopyBackReport, message: str) -> None:
    if len(report.warnings) < MAX_WARNINGS:
        report.warnings.append(message)
    else:
        report.suppressed += 1


async def _fetch_entry(
    host: HostSession,
    jobdir: str,
    tree: _SafeTree,
    entry: ManifestEntry,
    report: CopyBackReport,
    limits: CopyLimits,
    prefetch: bulk.Prefetch,
) -> None:
    kind, link = entry.kind, entry.link
    rel = safe_relpath(entry.path)
    if rel is None:
        _warn(report, f"{host.name}: unsafe name '{shown(entry.path)}' refused")
        return
    try:
        if kind == "dir":
            tree.mkdir(rel)
        elif kind == "link":
            if link is not None and link_stays_inside(rel, link):
                tree.symlink(rel, link)
            else:
                _warn(report, f"{shown(rel)}: symlink to '{shown(link)}' leaves the job folder; skipped")
        elif kind == "file":
            fd, dfd = tree.create_file(rel, entry.mode)
            done = False
            try:
                budget = limits.max_bytes - report.bytes
                try:
                    got = await _download(host, jobdir, rel, fd, budget, prefetch)
                except SizeLimitExceeded:
                    raise TransferError(
                        f"{host.name}:{jobdir}: results exceed the copy-back limit of "
                        f"{limits.max_bytes} bytes (raise --max-result-bytes); they stay on the host"
                    ) from None
                except RemoteFileError as exc:
                    _warn(report, f"{shown(rel)}: not copied: {shown(str(exc), 500)}")
                    return
                report.bytes += got
                report.files += 1
                done = True
            finally:
                os.close(fd)
                if not done:  # no empty stand-in for a file that did not come
                    with contextlib.suppress(OSError):
                        os.unlink(rel.rsplit("/", 1)[-1], dir_fd=dfd)
                os.close(dfd)
        else:
            _warn(report, f"{shown(rel)}: special file skipped")
    except (OSError, ValueError) as exc:
        # ELOOP / ENOTDIR / EEXIST: something tried to redirect us through a link or reuse a name.
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        _warn(report, f"{shown(rel)}: refused ({reason})")


async def _download(host: HostSession, jobdir: str, rel: str, fd: int, budget: int, prefetch: bulk.Prefetch) -> int:
    """One result file into ``fd``: from the agent's bulk answer when it has one, else by SFTP;
    either way counted against the same byte budget."""
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
