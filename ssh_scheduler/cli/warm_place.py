"""What the thin start (launch.py), the warm launcher (launcher.py), its copies (launched.py) and
``status`` share about warm starts: which launcher a process may use (its key and socket), what a
request carries, and which launchers run.  The standard library and ``transport.hub_place`` only:
the thin start imports it before anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
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
)

TYPE_CHECKING = False  # the thin start imports this module: typing's own import costs it 2 ms
if TYPE_CHECKING:
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
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:20]


def launcher_path(folder: Path, key: str | None = None) -> Path:
    return folder / f"{PREFIX}{key or launcher_key()}.sock"


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
    return [pid for pid, _lock in _held_locks()]


def loading_launchers() -> list[int]:
    """The pids of this user's launchers that run but do not listen yet (still loading)."""
    return [pid for pid, lock in _held_locks() if not lock.with_suffix(".sock").exists()]


def _held_locks() -> list[tuple[int, Path]]:
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
            with contextlib.suppress(ValueError, OSError):
                held.append((int(os.read(fd, 32).split()[0]), lock))
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return held


