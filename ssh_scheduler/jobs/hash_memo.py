"""What this machine's files hashed to, kept between commands: a rerun of a batch whose inputs did
not change reads none of them again (5,000 small files: ~0.45 s of reading, hashing and scanning
for keys on each run before its first job could start; a dataset of large files: seconds).

A file's figures are used again only while it is the same file with the same content:
the same path, device, inode, size, mtime and *ctime*.  Writing a file moves its ctime, and no
program can set a ctime back (``touch -d``, ``cp -p``, ``rsync -t`` and ``tar x`` restore an
mtime only), so a file rewritten to the same size with its mtime put back is read again.  What
changed less than :data:`RACY_SECONDS` before the command began is not kept: a write in the same
clock tick as the read would leave every figure as it was (git's "racy" entries).  The figures
include whether the file holds a private key, as that scan saw it: a changed scan (this package's
next version) reads every file again.

One JSON file per walked path (a ``--copy-forwards`` folder or file), named by the hash of its
absolute path, in the user's cache folder (``$XDG_CACHE_HOME/ssh_scheduler/hashes``, else
``~/.cache/ssh_scheduler/hashes``), private to the user.  Each walk writes what it found there
and nothing else, so a removed file leaves the memo with the next walk; two commands walking the
same folder at once each write a whole file (renamed into place), the last one stays.  Memo
files nobody wrote for :data:`KEEP_DAYS` go.  Whatever goes wrong with the memo (another owner,
a link, a broken file, a full disk) costs only the reading it would have saved: it is logged
and left alone for the command.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["HashMemo", "default_path"]

log = logging.getLogger(__name__)

RACY_SECONDS = 2.0
"""Files changed less than this before the command began are read again next time (2 s: the
coarsest mtime of common filesystems, FAT's, and a margin for a file server's clock)."""
KEEP_DAYS = 90
FOLDER = "hashes"
_VERSION = 1

Found = tuple[str, bool]
"""(sha256 hex digest, whether the file holds a private key)."""
Row = tuple[int, int, int, int, int, str, bool]
"""A file's device, inode, size, mtime_ns and ctime_ns as it was read, and what it held."""


def default_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ssh_scheduler" / FOLDER


def scan_version() -> str:
    """The key scan and the hashing as this package does them: the source of their modules
    (this folder's forward.py and secret_scan.py, read, not imported: forward imports this)."""
    digest = hashlib.sha256()
    for name in ("forward.py", "secret_scan.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:32]


def _ours(st: os.stat_result, kind: int) -> bool:
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and not st.st_mode & 0o022


class HashMemo:
    """The memo of one command (a folder of memo files, ``folder``): a walked path's figures
    read once (:meth:`preload`), looked up file by file (:meth:`get`), and what the walk found
    written back (:meth:`save`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.since = time.time()  # made before any file is read: the racy rule's clock
        self._scan: str | None = None  # None until first needed; "" when the memo is unusable
        self._known: dict[str, Row] = {}  # what earlier walks found, of the preloaded paths
        self._found: dict[str, Row] = {}  # what this command's walks found (kept or read)
        self._tops: list[str] = []  # the preloaded paths, in order
        self._saved: set[str] = set()
        self._fd = -1  # the folder, opened once (the command's life)
        self._lock = threading.Lock()  # walks run in threads

    def _usable(self) -> bool:
        if self._scan is None:
            try:
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                if not _ours(os.fstat(self._fd), stat.S_IFDIR):
                    raise OSError(f"{self.folder} is not a folder of this user's alone")
                self._scan = scan_version()
            except Exception as exc:  # never the command's failure: it reads its files instead
                log.info("hash memo %s not used: %s", self.folder, exc)
                self._scan = ""
        return bool(self._scan)

    def _file(self, top: str) -> str:
        return hashlib.sha256(os.fsencode(top)).hexdigest()[:32] + ".json"

    def preload(self, top: str) -> None:
        """What earlier walks of ``top`` (an absolute path) found, read once."""
        with self._lock:
            if top in self._tops or not self._usable():
                return
            self._tops.append(top)
            try:
                fd = os.open(self._file(top), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._fd)
            except FileNotFoundError:
                return
            except OSError as exc:
                log.info("hash memo of %s not used: %s", top, exc)
                return
            try:
                with os.fdopen(fd, encoding="utf-8") as f:
                    if not _ours(os.fstat(f.fileno()), stat.S_IFREG):
                        raise ValueError("not a file of this user's alone")
                    memo = json.load(f)
                if memo.get("version") != _VERSION or memo.get("scan") != self._scan or memo.get("top") != top:
                    return  # another scan's (or format's) verdicts: read every file again
                for path, row in memo["files"].items():
                    self._known[path] = (*row[:6], bool(row[6]))
            except Exception as exc:  # a broken memo is read again from the files themselves
                log.info("hash memo of %s not used: %s", top, exc)

    def get(self, path: str, st: os.stat_result) -> Found | None:
        """What ``path`` hashed to when it was the file ``st`` describes, or None."""
        row = self._known.get(path)
        if row is None or row[:5] != _identity(st):
            return None
        self._found[path] = row
        return row[5], row[6]

    def learn(self, path: str, st: os.stat_result, found: Found) -> None:
        """What ``path`` (the file ``st`` described before it was read) hashed to."""
        if max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 <= self.since - RACY_SECONDS:
            self._found[path] = (*_identity(st), found[0], found[1])
        # else it changed just before the command began: a write in its read's tick would not show

    def save(self) -> None:
        """Each preloaded path's memo file: what this command's walks found below it."""
        with self._lock:
            tops = [top for top in self._tops if top not in self._saved]
            if not tops or not self._usable():
                return
            found = self._found.copy()  # another walk (a job's own copies) may add to it meanwhile
            try:
                for top in tops:
                    below = top.rstrip("/") + "/"
                    files = {p: row for p, row in found.items() if p == top or p.startswith(below)}
                    if files and files == {p: row for p, row in self._known.items() if p == top or p.startswith(below)}:
                        os.utime(self._file(top), dir_fd=self._fd, follow_symlinks=False)  # still in use
                    else:
                        self._write(self._file(top), {"version": _VERSION, "scan": self._scan, "top": top, "files": files})
                    self._saved.add(top)
                self._forget_old()
            except Exception as exc:  # a full disk: only a saving lost
                log.info("hash memo %s not saved: %s", self.folder, exc)

    def _write(self, name: str, memo: dict[str, Any]) -> None:
        tmp = f"{name}.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(memo, f, separators=(",", ":"))  # (ASCII: a name's surrogates escaped)
            os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except BaseException:
            os.unlink(tmp, dir_fd=self._fd)
            raise

    def _forget_old(self) -> None:
        """Memo files (or a killed command's half-written ones) nobody wrote for KEEP_DAYS."""
        old = time.time() - KEEP_DAYS * 86400
        for name in os.listdir(self._fd):
            st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < old:
                os.unlink(name, dir_fd=self._fd)


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
