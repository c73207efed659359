"""What a copy forward sends: the walk, the secrets it never sends, the ignore file, the size check.

Everything here happens before a byte leaves this machine, and nothing here does network I/O
(no asyncio, no asyncssh), so it can be tested on plain folders:

* The walk follows no symlinked folder and skips :data:`DEFAULT_EXCLUDES` (results, VCS data,
  virtualenvs, caches).
* Secrets are never sent from a walk: :data:`SECRET_PATTERNS` (``.ssh``, ``.gnupg``, ``.aws``,
  ``.netrc``, ``id_rsa``...) and any small file holding a PEM or PuTTY private key.  They are
  withheld and listed, never silently shipped.  A secret the user *names* (``--copy-forwards
  .ssh/config``) is refused unless :attr:`ForwardPolicy.allow_secrets`.
* ``.sshschedulerignore`` in the base folder (gitignore syntax, :mod:`ssh_scheduler.jobs.ignore`)
  leaves out more.
* The default copy forward (``.``, nothing named) stops above :attr:`ForwardPolicy.max_bytes` or
  :attr:`ForwardPolicy.max_files` unless confirmed: run from a home folder it would send every
  dataset and old result to every host.
* ``--commands`` lines may copy only paths inside the base folder (:func:`check_job_copies`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import posixpath
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ssh_scheduler.errors import TransferError, plain_text
from ssh_scheduler.jobs.ignore import IgnoreRules
from ssh_scheduler.jobs.secret_scan import KEY_SCAN_BYTES, holds_key_text, holds_private_key

if TYPE_CHECKING:  # only for annotations: every command's start-up imports this module
    from ssh_scheduler.jobs.batch_file import Job
    from ssh_scheduler.jobs.hash_memo import HashMemo

__all__ = [
    "DEFAULT_EXCLUDES",
    "IGNORE_FILE",
    "SECRET_PATTERNS",
    "ForwardPolicy",
    "ForwardSet",
    "Hasher",
    "LocalFile",
    "check_forward_size",
    "check_job_copies",
    "collect_forward",
    "describe_forward",
    "human_bytes",
    "secret_reason",
]

log = logging.getLogger(__name__)

# Never worth sending: results, VCS data, virtualenvs (paths are host-specific), caches, and an
# agent's work root (a home copied forward holds one; it changes while it is walked).
DEFAULT_EXCLUDES = frozenset({"job_results", ".git", ".venv", ".ssh_scheduler"}
                             | {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
IGNORE_FILE = ".sshschedulerignore"
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MAX_FILES = 10_000
LARGEST_SHOWN = 5

SECRET_PATTERNS = (
    # credential folders: keys, tokens, cloud and cluster logins
    ".ssh/", ".gnupg/", ".aws/", ".azure/", ".kube/", ".password-store/", "**/.config/gcloud/",
    "**/.docker/config.json", "**/.config/containers/auth.json", ".kaggle/", "**/.config/kaggle/",
    "**/.config/gh/", "**/.config/hub", "**/.config/rclone/", ".terraform.d/credentials.tfrc.json",
    "**/.local/share/keyrings/",
    # token stores of tools: Hugging Face (also under $HF_HOME), Kaggle, rclone, cargo, gem
    "**/huggingface/token", "**/huggingface/stored_tokens", ".huggingface/", "kaggle.json",
    "rclone.conf", ".rclone.conf", "**/.cargo/credentials", "**/.cargo/credentials.toml",
    "**/.gem/credentials", ".databrickscfg", ".boto", ".s3cfg",
    # files holding passwords or tokens
    ".netrc", "_netrc", ".pgpass", ".git-credentials", ".pypirc", ".npmrc", ".vault-token",
    ".my.cnf",
    # shell and REPL histories: commands typed with a token in them
    ".bash_history", ".zsh_history", ".sh_history", ".histfile", ".history", "fish_history",
    ".python_history", ".psql_history", ".mysql_history", ".sqlite_history", ".node_repl_history",
    ".rediscli_history", ".irb_history", ".Rhistory", ".lesshst", ".viminfo", "**/.ipython/**/history.sqlite",
    "**/.julia/logs/repl_history.jl",
    # private keys by their usual names; key stores
    "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "id_ecdsa_sk", "id_ed25519_sk",
    "*.p12", "*.pfx", "*.ppk", "*.jks", "*.keystore",
)  # fmt: skip
"""gitignore patterns of what a copy forward never sends unless named and allowed."""


ALLOW_SECRETS_FLAG = "--allow-secret-copies"
ALLOW_OUTSIDE_FLAG = "--allow-outside-copies"
CONFIRM_FLAG = "--yes-copy-all"


@dataclass(frozen=True, slots=True)
class ForwardPolicy:
    """What the user allowed a copy forward to send."""

    allow_secrets: bool = False
    """Send secret paths the user names (a walk still withholds the ones it finds)."""
    allow_outside: bool = False
    """``--commands`` lines may copy paths outside the base folder."""
    confirmed: bool = False
    """The user named what to send (``--copy-forwards``) or confirmed a large default copy."""
    max_bytes: int = DEFAULT_MAX_BYTES
    max_files: int = DEFAULT_MAX_FILES


@dataclass(frozen=True, slots=True)
class LocalFile:
    rel: str  # path inside the job directory (posix)
    path: Path  # where it is here
    key: str  # cache key on the host: content hash and executable bit
    size: int


@dataclass(frozen=True, slots=True)
class ForwardSet:
    files: tuple[LocalFile, ...]
    dirs: tuple[str, ...]
    withheld: tuple[str, ...] = ()
    """Secrets the walk found and did not send (relative paths), for messages."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class Hasher:
    """Hashes local files once per batch (keyed by path, size and mtime), and with ``lasting``
    (:class:`~ssh_scheduler.jobs.hash_memo.HashMemo`) not again in a later command while the
    file stays the same file."""

    def __init__(self, lasting: HashMemo | None = None) -> None:
        self._memo: dict[tuple[str, int, int], tuple[str, bool]] = {}
        self.lasting = lasting
        self.read = self.remembered = 0  # files read, files an earlier command had read

    def digest(self, path: Path, st: os.stat_result) -> str:
        return self.inspect(path, st)[0]

    def inspect(self, path: Path, st: os.stat_result) -> tuple[str, bool]:
        """(sha256, whether the file holds a private key): one read serves both."""
        memo_key = (str(path), st.st_size, st.st_mtime_ns)
        found = self._memo.get(memo_key)
        if found is None and self.lasting is not None:
            found = self.lasting.get(memo_key[0], st)
            self.remembered += found is not None
        if found is None:
            self.read += 1
            h = hashlib.sha256()
            head = b""
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    head = head or block
                    h.update(block)
            is_key = st.st_size <= KEY_SCAN_BYTES and holds_key_text(head)
            found = (h.hexdigest(), is_key)
            if self.lasting is not None:
                self.lasting.learn(memo_key[0], st, found)
        self._memo[memo_key] = found
        return found

    def save(self) -> None:
        """What this walk hashed, kept for later commands (with ``lasting``)."""
        if self.lasting is not None:
            self.lasting.save()


# --- secrets -------------------------------------------------------------------------------------




@functools.cache
def _secret_rules() -> IgnoreRules:
    return IgnoreRules(SECRET_PATTERNS)  # compiled when first needed, not at start-up


def _secret_rule(rel: str, is_dir: bool) -> str | None:
    rule = _secret_rules().match(rel, is_dir)
    return None if rule is None else f"matches the secret pattern {rule.pattern}"


def secret_reason(rel: str, is_dir: bool) -> str | None:
    """Which secret pattern a relative path or one of its parent folders matches, or None."""
    parts = rel.split("/")
    for depth in range(1, len(parts) + 1):
        reason = _secret_rule("/".join(parts[:depth]), is_dir or depth < len(parts))
        if reason is not None:
            return reason
    return None


def _named_secret(given: str, top: Path) -> str | None:
    """Why a path the user named is a secret: by its name as given, by where it really is (a
    symlink, ``..``), or by its content."""
    is_dir = top.is_dir()
    if not is_dir and holds_private_key(top, top.stat()):
        return "holds a private key"
    if not is_dir and top.name.endswith(".pub"):
        return None  # a public key, even from ~/.ssh: installing one on hosts is common
    for rel in (posixpath.normpath(given.replace(os.sep, "/")).lstrip("/"), str(top).lstrip("/")):
        reason = secret_reason(rel, is_dir)
        if reason is not None:
            return reason
    return None


# --- the walk ------------------------------------------------------------------------------------


def _load_ignore(base: Path) -> IgnoreRules:
    path = base / IGNORE_FILE
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return IgnoreRules()
    except OSError as exc:
        raise TransferError(f"cannot read {plain_text(str(path))}: {exc.strerror or exc}") from None
    return IgnoreRules(text.splitlines())


@dataclass(slots=True)
class _Walk:
    ignore: IgnoreRules
    excluded: frozenset[str]
    filter_secrets: bool
    withheld: list[str]

    def keep(self, rel: str, is_dir: bool) -> bool:
        """Not ignored, and not a secret by its name (a link's target and the content are
        checked by :func:`collect_forward`, which reads the entry anyway)."""
        if self.ignore.ignored(rel, is_dir):
            return False
        # The parent folders were checked on the way down: only the entry itself is new.
        return not self.withhold(rel, _secret_rule(rel, is_dir))

    def withhold(self, rel: str, reason: str | None) -> bool:
        if reason is None or not self.filter_secrets:
            return False
        log.info("copy forward: withholding %s (%s)", rel, reason)
        self.withheld.append(rel)
        return True

    def entries(self, top: Path, top_rel: str) -> Iterator[tuple[Path, str]]:
        if not top.is_dir():
            yield top, top_rel
            return
        for dirpath, dirnames, filenames in os.walk(top, onerror=_unreadable_folder(top, top_rel)):
            here = Path(dirpath)
            rel_dir = here.relative_to(top).as_posix()
            prefix = posixpath.normpath(f"{top_rel}/{rel_dir}")
            prefix = "" if prefix == "." else prefix

            def rel_of(name: str, prefix: str = prefix) -> str:
                return f"{prefix}/{name}" if prefix else name

            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in self.excluded and self.keep(rel_of(d), is_dir=True)
            )
            if prefix:
                yield here, prefix
            for name in sorted(filenames):
                if self.keep(rel_of(name), is_dir=False):
                    yield here / name, rel_of(name)


def _unreadable(rel: str, exc: OSError) -> TransferError:
    return TransferError(
        f"--copy-forwards: cannot read {plain_text(rel)} ({exc.strerror or exc}); fix: make it "
        f"readable, or leave it out with a line in {IGNORE_FILE}"
    )


def _unreadable_folder(top: Path, top_rel: str) -> Callable[[OSError], None]:
    """os.walk's error hook: a folder that cannot be listed would be sent empty (a job missing
    inputs, said nowhere); one that vanished has nothing to send."""

    def refuse(exc: OSError) -> None:
        if isinstance(exc, FileNotFoundError):
            return
        where = Path(exc.filename or top)
        inside = where.is_relative_to(top)
        rel = posixpath.normpath(f"{top_rel}/{where.relative_to(top).as_posix()}") if inside else str(where)
        raise _unreadable(rel, exc)

    return refuse


def collect_forward(
    paths: Sequence[str],
    base: Path,
    hasher: Hasher,
    excludes: Iterable[str] = DEFAULT_EXCLUDES,
    *,
    policy: ForwardPolicy = ForwardPolicy(),
) -> ForwardSet:
    """Walk the paths to send (relative to ``base``), following no symlinked directory, leaving
    out what the ignore file names and withholding secrets."""
    walk = _Walk(_load_ignore(base), frozenset(excludes), True, [])
    counts = (hasher.read, hasher.remembered)
    own_output = _own_output()
    files: dict[str, LocalFile] = {}
    dirs: set[str] = set()
    base_resolved = base.resolve()
    for given in paths:
        top = (base / given).resolve() if not os.path.isabs(given) else Path(given)
        if not top.exists():
            raise TransferError(f"--copy-forwards: {plain_text(given)} does not exist (relative to {base})")
        named_secret = _named_secret(given, top)
        if named_secret is not None and not policy.allow_secrets:
            raise TransferError(
                f"--copy-forwards {plain_text(given)} {named_secret}; secrets are not sent to "
                f"hosts unless you pass {ALLOW_SECRETS_FLAG}"
            )
        try:
            top_rel = top.relative_to(base_resolved).as_posix()
        except ValueError:
            top_rel = top.name
        # A secret the user named and allowed is sent whole; everything else is filtered.
        walk.filter_secrets = named_secret is None
        if hasher.lasting is not None:
            hasher.lasting.preload(str(top))
        for local, rel in walk.entries(top, top_rel):
            try:
                st = os.lstat(local)
            except FileNotFoundError:
                # The folder is live (another program's temporary file): what is gone between
                # the listing and this look is not there to send.
                log.info("copy forward: %s vanished while the folder was read; not sent", rel)
                continue
            if stat.S_ISLNK(st.st_mode):
                # A file linked under an innocent name to a secret place is still a secret.
                if walk.withhold(rel, secret_reason(os.path.realpath(local).lstrip("/"), False)):
                    continue
                try:
                    st = os.stat(local)
                except OSError:
                    continue  # a dangling link: nothing to send
            if stat.S_ISDIR(st.st_mode):
                dirs.add(rel)
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if (st.st_dev, st.st_ino) in own_output:
                log.info("copy forward: leaving out %s: this command's own output goes there", rel)
                continue
            try:
                digest, is_key = hasher.inspect(local, st)
            except FileNotFoundError:
                log.info("copy forward: %s vanished while the folder was read; not sent", rel)
                continue
            except OSError as exc:  # unreadable: sending the rest would be a silent other input
                raise _unreadable(rel, exc) from None
            if walk.withhold(rel, "holds a private key" if is_key else None):
                continue
            executable = "x" if st.st_mode & 0o111 else "r"
            files[rel] = LocalFile(rel, local, f"{digest}-{executable}", st.st_size)
    dirs.discard(".")
    if hasher.lasting is not None:
        read, remembered = hasher.read - counts[0], hasher.remembered - counts[1]
        log.info("copy forward: %d files read, %d known as an earlier command read them", read, remembered)
    return ForwardSet(
        tuple(sorted(files.values(), key=lambda f: f.rel)),
        tuple(sorted(dirs)),
        tuple(sorted(set(walk.withheld))),
    )


def _own_output() -> frozenset[tuple[int, int]]:
    """The files this process's stdout and stderr write into (``execute_batch b.sh > log.txt``
    run in the folder it copies): never sent.  The file grows while it is hashed and sent, so
    no host could keep it under its hash (each host would fetch it again by SFTP, a round trip
    before the first job starts), and a job has no use for the log of the batch it is in."""
    found = set()
    for fd in (1, 2):
        with contextlib.suppress(OSError, ValueError):
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                found.add((st.st_dev, st.st_ino))
    return frozenset(found)


# --- size ----------------------------------------------------------------------------------------


def human_bytes(size: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _largest(forward: ForwardSet) -> str:
    """The biggest top-level entries (a folder counts all its files), the biggest first."""
    sizes: dict[str, int] = {}
    for f in forward.files:
        top = f.rel.split("/", 1)[0]
        sizes[top] = sizes.get(top, 0) + f.size
    biggest = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:LARGEST_SHOWN]
    return ", ".join(f"{plain_text(name)} ({human_bytes(size)})" for name, size in biggest)


def _over_limit(forward: ForwardSet, paths: Sequence[str], policy: ForwardPolicy) -> str | None:
    if policy.confirmed or tuple(paths) != (".",):
        return None
    if forward.total_bytes > policy.max_bytes:
        return f"more than --forward-max-bytes {human_bytes(policy.max_bytes)}"
    if len(forward.files) > policy.max_files:
        return f"more than --forward-max-files {policy.max_files} files"
    return None


def describe_forward(forward: ForwardSet, paths: Sequence[str], policy: ForwardPolicy) -> str:
    """One line for ``--dry-run``: what the copy forward would send."""
    named = " ".join(plain_text(p) for p in paths)
    line = (
        f"copy forward ({named}): {len(forward.files)} files, {human_bytes(forward.total_bytes)}"
        f" ({forward.total_bytes} bytes)"
    )
    if forward.files:
        line += f"; largest: {_largest(forward)}"
    if forward.withheld:
        shown = ", ".join(plain_text(w) for w in forward.withheld[:LARGEST_SHOWN])
        more = f" and {len(forward.withheld) - LARGEST_SHOWN} more" if len(forward.withheld) > LARGEST_SHOWN else ""
        line += f"; withheld as secrets: {shown}{more}"
    over = _over_limit(forward, paths, policy)
    if over is not None:
        line += f"; {over}: a run would stop and ask for --copy-forwards or {CONFIRM_FLAG}"
    return line


def check_forward_size(forward: ForwardSet, paths: Sequence[str], policy: ForwardPolicy) -> None:
    """Stop a default copy forward (``.``) that is bigger than the limits, before anything is
    sent: it is usually a run from the wrong folder."""
    over = _over_limit(forward, paths, policy)
    if over is None:
        return
    raise TransferError(
        f"the default copy forward (.) would send {len(forward.files)} files, "
        f"{human_bytes(forward.total_bytes)} to every host, {over} (largest: {_largest(forward)}); "
        f"name what the jobs need with --copy-forwards, list what to leave out in {IGNORE_FILE}, "
        f"or pass {CONFIRM_FLAG} to send it all (--dry-run shows the size)"
    )


# --- --commands lines ----------------------------------------------------------------------------


def _outside_reason(path: str, base: Path, local: bool) -> str | None:
    """Why ``path`` is not a path inside ``base``: absolute, ``..``, or (for a local path) a
    symlink leading out."""
    if path.startswith("/") or os.path.isabs(path):
        return "is an absolute path"
    if ".." in path.replace(os.sep, "/").split("/"):
        return "contains '..'"
    if local:
        real = os.path.realpath(base / path)
        root = os.path.realpath(base)
        if real != root and not real.startswith(root.rstrip("/") + "/"):
            return "leads out of it through a symlink"
    return None


def check_job_copies(jobs: Sequence[Job], base: Path, policy: ForwardPolicy) -> None:
    """``--commands`` lines copy only paths inside the batch's base folder, unless allowed: a
    hostile batch line must not send ``~/.ssh/id_ed25519`` or ``../../etc/passwd`` to the
    hosts and back.  Checked for every job before anything is dispatched."""
    for job in jobs:
        copies = [("--copy-forwards", p, True) for p in job.copy_forwards or ()]
        copies += [("--copy-backwards", p, False) for p in job.copy_backwards or ()]
        for option, path, local in copies:
            where = f"batch line {job.line_number} (job {plain_text(job.name)})"
            if not policy.allow_outside:
                reason = _outside_reason(path, base, local)
                if reason is not None:
                    raise TransferError(
                        f"{where}: {option} {plain_text(path)} {reason}; a batch line may copy "
                        f"only paths inside its folder {plain_text(str(base.resolve()))} unless you "
                        f"pass {ALLOW_OUTSIDE_FLAG}"
                    )
            if local and not os.path.exists(base / path):  # now: at its job's placement it ends the batch
                raise TransferError(f"{where}: {option} {plain_text(path)} does not exist (relative to {base})")
            if local and not policy.allow_secrets and os.path.lexists(base / path):
                top = (base / path).resolve()
                secret = _named_secret(path, top) if top.exists() else None
                if secret is not None:
                    raise TransferError(
                        f"{where}: {option} {plain_text(path)} {secret}; secrets are not sent "
                        f"to hosts unless you pass {ALLOW_SECRETS_FLAG}"
                    )
