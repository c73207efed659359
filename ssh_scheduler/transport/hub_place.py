"""Where this user's hub listens and which hub a command may use: the standard library only.

The hub (hub_server.py) and its clients (hub_client.py, and the command line's thin start,
cli/launch.py, which must not import asyncio or asyncssh to stay quick) agree here on the
private folder (:func:`private_folder`), the key that names a hub by the code and environment it
serves (:func:`hub_key`), and the socket and lock names under it.  The hub's process is started
here too (:func:`spawn_hub`), so that a command that will connect can start it first thing
(:func:`start_early`): it loads beside the command's own start instead of after it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

TYPE_CHECKING = False  # the thin start imports this module: typing's own import costs it 2 ms
if TYPE_CHECKING:
    import subprocess
    from typing import Any

FOLDER_NAME = "ssh_scheduler"
KEEP_WARM_VARIABLE = "SSH_SCHEDULER_KEEP_WARM"
"""The default ``keep_warm`` of machines that set none (0: no hub; a CI job, a test suite)."""
SOCKET_PREFIX = "hub-"
REACH_TIMEOUT = 5.0
"""Seconds to reach a running hub's socket."""
SUPPORTED = sys.platform == "linux"
"""Peer credentials (SO_PEERCRED) and /proc/self/fd: elsewhere every command connects directly."""
ENVIRONMENT = ("HOME", "USER", "LOGNAME", "PATH", "SHELL", "SSH_AUTH_SOCK", "KRB5CCNAME")
"""What of the environment a connection depends on (keys and the ssh-agent, ``~``, the login
name, the ProxyCommand's shell and PATH): part of the hub's key, so the hub that connects for a
command has the same values."""


def keep_warm_seconds(text: str) -> float | None:
    """A ``$SSH_SCHEDULER_KEEP_WARM`` value as seconds (0: no hub); None when it is empty or no
    number of seconds (its readers then take the default, and the hub's client says so)."""
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None


class HubUnusable(Exception):
    """The hub cannot be used (none runs, it refused, it is not ours): connect directly."""


class HubAbsent(HubUnusable):
    """Nobody listens on the hub's socket (none was started, or a dead one's file is left)."""


# --- where, and whose ------------------------------------------------------------------------


def folder_path() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / FOLDER_NAME
    return Path("/tmp") / f"{FOLDER_NAME}-{os.getuid()}"


def private_folder(create: bool) -> Path:
    """The hub's folder, made (0700) when ``create`` and missing; raises :class:`HubUnusable`
    when it is not a folder of ours closed to everyone else (a planted one is never used)."""
    path = folder_path()
    if create:
        with contextlib.suppress(FileExistsError, FileNotFoundError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise HubUnusable(f"{path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise HubUnusable(f"{path} is not a folder")
    if st.st_uid != os.getuid():
        raise HubUnusable(f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise HubUnusable(f"{path} is open to others (mode {stat.S_IMODE(st.st_mode):o}, not 700)")
    return path


def sha256() -> Any:
    """A SHA-256 hash object, CPython's own: ``hashlib`` first loads OpenSSL (its import cost
    every command's thin start 5 ms), though the two give the same digest."""
    try:
        from _sha2 import sha256 as built_in  # Python 3.12 and later
    except ImportError:
        try:
            from _sha256 import sha256 as built_in  # Python 3.11
        except ImportError:  # a Python built without them
            from hashlib import sha256 as built_in
    return built_in()


@functools.cache
def hub_key() -> str:
    """This package's version (each module's name, size and modification time), the python
    running it and the :data:`ENVIRONMENT`, hashed: a hub serves exactly what its key says."""
    digest = sha256()
    digest.update(os.fsencode(sys.executable) + b"\0")
    for name in ENVIRONMENT:
        digest.update(f"{name}={os.environ.get(name, '')}\0".encode("utf-8", "surrogateescape"))
    package = Path(__file__).resolve().parents[1]
    digest.update(os.fsencode(package) + b"\0")
    for rel, st in sorted(_modules(package, "")):
        digest.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}\0".encode("utf-8", "surrogateescape"))
    return str(digest.hexdigest())[:20]


def _modules(folder: Path, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and entry.name != "__pycache__":
                yield from _modules(Path(entry.path), f"{prefix}{entry.name}/")
            elif entry.name.endswith(".py"):
                yield prefix + entry.name, entry.stat()


def socket_path(folder: Path, key: str | None = None) -> Path:
    return folder / f"{SOCKET_PREFIX}{key or hub_key()}.sock"


def lock_path(socket_file: Path) -> Path:
    return socket_file.with_suffix(".lock")


# --- starting it -------------------------------------------------------------------------------


class Starting:
    """A hub process started for ``path``: it says ``ready``, ``busy`` (another hub holds the
    name) or ``failed: ...`` on the pipe ``said``, then its first process exits (the hub forks
    away from it).  (No dataclass: its import costs the thin start 3 ms.)"""

    __slots__ = ("logfile", "path", "process", "said")

    def __init__(self, path: Path, process: subprocess.Popen[bytes], said: int, logfile: Path) -> None:
        self.path = path
        self.process = process
        self.said = said
        self.logfile = logfile


_early: dict[Path, Starting] = {}
LOG_LIMIT = 1 << 20
"""Bytes of a hub's or launcher's log above which the next start begins it afresh."""


def spawn_detached(module: str, args: list[str], logfile: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """``python -m module args`` in a session of its own, from ``/``, writing to ``logfile``
    (begun afresh above :data:`LOG_LIMIT`): how the hub and the launcher are started."""
    import subprocess  # (only here: the thin start stays small)

    with contextlib.suppress(OSError):
        if logfile.stat().st_size > LOG_LIMIT:
            logfile.unlink()
    log_fd = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
            pass_fds=pass_fds, start_new_session=True, cwd="/",
        )
    finally:
        os.close(log_fd)


def spawn_hub(path: Path) -> Starting:
    """Start the hub process for ``path`` and return at once.  It runs hub_server.py as a
    program: python and that module's imports, none of the command line's (typer, the
    commands), which is 70 ms less before it listens."""
    logfile = path.with_suffix(".log")
    read_end, write_end = os.pipe()
    try:
        process = spawn_detached(
            "ssh_scheduler.transport.hub_server", ["--status-fd", str(write_end)], logfile, (write_end,)
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return Starting(path, process, read_end, logfile)


def start_early() -> None:
    """Start the hub now when none listens for this key (the command starting will connect,
    and would otherwise start it only when it first connects).  Never raises: the command's own
    start (hub_client.start_hub) tries again and says what went wrong."""
    try:
        path = socket_path(private_folder(create=True))
        if path not in _early and not path.exists():
            _early[path] = spawn_hub(path)
    except (HubUnusable, OSError):
        pass


def take_early(path: Path) -> Starting | None:
    """The start :func:`start_early` made for ``path``, once (whoever takes it waits for it)."""
    return _early.pop(path, None)
