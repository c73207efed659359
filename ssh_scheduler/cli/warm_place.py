"""What the thin start (launch.py), the warm launcher (launcher.py), its copies (launched.py) and
``status`` share about warm starts: which launcher a process may use (its key and socket), what a
request carries, where one listens (:func:`claim`), and which launchers run.  The standard
library, ``transport.hub_place`` and ``transport.unix_socket`` only: the thin start imports it
before anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from ssh_scheduler.transport.hub_place import (
    KEEP_WARM_VARIABLE,
    HubUnusable,
    hub_key,
    keep_warm_seconds,
    private_folder,
    sha256,
)
from ssh_scheduler.transport.unix_socket import reachable

TYPE_CHECKING = False  # the thin start imports this module: typing's own import costs it 2 ms
if TYPE_CHECKING:
    import socket
    from typing import Any

ENTRIES = ("execute_batch", "execute_remote", "execute_to", "combine_folders", "ssh_scheduler")
"""The commands a launcher runs: ``cli.main``'s ``<name>_main`` (``ssh_scheduler``: ``main``)."""
PREFIX = "launcher-"
HEADER = struct.Struct("!I")
"""A request's length, before its JSON."""
MAX_REQUEST = 4 << 20
"""Bytes of one request: arguments and environment (Linux allows 2 MiB of each)."""
READY_WAIT = 1.0
"""Seconds a caller waits for a launcher to say "ready" (a millisecond when it is well; about
0.4 s when it is still loading, started by the command just before) before it gives up and runs
its command itself."""
GO = b"G"
"""What a caller sends once told "ready": from then on the command is the launcher's to run, and a
caller that gave up before never sends it (so no command runs twice)."""
STREAMS = ("stdin", "stdout", "stderr")
RLIMITS = tuple(sorted(name for name in dir(resource) if name.startswith("RLIMIT_")))
"""The process's resource limits a command runs under (``ulimit``): passed on, each one."""


def entry_function(commands: Any, entry: str) -> Callable[[], None]:
    function: Callable[[], None] = getattr(commands, "main" if entry == "ssh_scheduler" else f"{entry}_main")
    return function


# --- which launcher ----------------------------------------------------------------------------


def launcher_key() -> str:
    """The hub's key (this package's code, the python, the environment connections depend on),
    and what else of this process a command run elsewhere would not share: the interpreter's
    flags and module path, the file-name encoding, the user and groups, the CPUs it may use, its
    priority, its cgroup (a Slurm job's, a systemd scope's) and namespaces, its warning options
    and hash seed.  A command from a process that differs in any of them meets no launcher and
    runs where it was started."""
    parts = [
        hub_key(),
        repr(tuple(sys.flags)),
        repr((sys.warnoptions, getattr(sys, "_xoptions", {}), os.environ.get("PYTHONHASHSEED"))),
        repr(sys.path[1:]),  # [0]: the script's own folder, which imports nothing of ours
        sys.getfilesystemencoding(),
        f"{os.getuid()}:{os.getgid()}:{sorted(os.getgroups())}",
        repr(sorted(os.sched_getaffinity(0))),
        str(os.getpriority(os.PRIO_PROCESS, 0)),
        _read("/proc/self/cgroup"),
        *(_link(f"/proc/self/ns/{name}") for name in ("mnt", "net", "pid", "user", "uts", "ipc")),
    ]
    digest = sha256()
    digest.update("\0".join(parts).encode("utf-8", "surrogateescape"))
    return str(digest.hexdigest())[:20]


def launcher_path(folder: Path, key: str | None = None) -> Path:
    return folder / f"{PREFIX}{key or launcher_key()}.sock"


READY = b"ready\n"
"""What a launcher adds to its lock file once it has loaded everything (after its pid's line)."""


def claim(path: Path) -> tuple[int, socket.socket] | None:
    """The launcher's place at ``path``: its lock file's descriptor, locked, and its socket,
    listening; None when a live launcher holds the lock.  Whoever claims it (a launcher, or the
    command that starts one and hands both over) listens before the launcher loads: a command
    that comes meanwhile waits in the backlog for "ready" instead of finding nobody there."""
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another launcher of this key runs
        os.close(lock)
        return None
    import socket  # (only here: the thin start uses _socket, without socket.py's 5 ms)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        os.ftruncate(lock, 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead launcher's (we hold the lock: no live one serves it)
        with reachable(path) as where:
            listener.bind(where)
        os.chmod(path, 0o600)
        listener.listen(64)
    except BaseException:
        listener.close()
        os.close(lock)
        raise
    return lock, listener


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            return file.read()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def wanted() -> bool:
    """Warm starts are for people at a terminal or a script of theirs, with the hub allowed."""
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
        return False
    return keep_warm_seconds(os.environ.get(KEEP_WARM_VARIABLE, "")) != 0


def running_launchers() -> list[int]:
    """The pids of this user's launchers that run now (any key: every version, every context)."""
    return [pid for pid, _said in _held_locks() if pid]


def loading_launchers() -> list[int]:
    """The pids of this user's launchers that run but have not loaded everything yet (0: one
    whose pid is not written yet)."""
    return [pid for pid, said in _held_locks() if READY not in said]


def _held_locks() -> list[tuple[int, bytes]]:
    """(pid or 0, what its lock file says) of each launcher that runs."""
    try:
        folder = private_folder(create=False)
        locks = sorted(folder.glob(f"{PREFIX}*.lock"))
    except (HubUnusable, OSError):
        return []
    held = []
    for lock in locks:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its launcher runs
            said = b""
            with contextlib.suppress(OSError):
                said = os.read(fd, 64)
            first = said.split()[:1]
            held.append((int(first[0]) if first and first[0].isdigit() else 0, said))
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return held


