"""The warm launcher: a process that has loaded every command, forking a copy to run each one.

A command's own start -- the interpreter, typer, asyncio and the coordinator -- costs
about 0.12 s of CPU before it does anything, and a warm connection saves the rest of a short
command's time.  So while this user's hub keeps connections warm, a launcher keeps all of that
loaded.  Commands reach it from their first step (cli/launch.py) over a unix socket in the hub's
private folder, named by the key of everything a command depends on: two ends of the same
user only, both checked (``SO_PEERCRED``).  For each command it forks a copy of itself, which
takes over the command's stdin, stdout, stderr and working folder (descriptors sent along),
environment, umask, resource limits and arguments, and runs it as the command's own process
would; the launcher reports how the copy ended.  A command whose process goes away while its
copy runs (killed, its terminal closed) has its copy stopped (``SIGTERM``: the command's own
clean stop, as for ``kill``).

A command that ends after borrowing a warm connection starts a launcher when none runs
(:func:`start_beside_hub`): it claims the launcher's lock and socket first and hands both over
(:func:`handed_over`), so the next command finds it at once, loading or ready.  It ends when its hub does (the hub's socket is gone: idle, stopped,
or another version), after idling as long as a connection is kept warm, or when its own socket
is taken from it; never while a copy of it runs.

Run as ``python -m ssh_scheduler.cli.launcher`` (by :func:`start_beside_hub` only).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import resource
import selectors
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssh_scheduler.cli import class_code
from ssh_scheduler.cli.launched import become, run_command
from ssh_scheduler.cli.warm_place import (
    ENTRIES,
    GO,
    HEADER,
    MAX_REQUEST,
    READY,
    RLIMITS,
    claim,
    launcher_key,
    launcher_path,
)
from ssh_scheduler.transport.hub_place import (
    KEEP_WARM_VARIABLE,
    HubUnusable,
    keep_warm_seconds,
    private_folder,
    socket_path,
)
from ssh_scheduler.transport.unix_socket import peer_uid

log = logging.getLogger(__name__)

DEFAULT_IDLE = 60.0
"""Seconds a launcher waits for a command when ``$SSH_SCHEDULER_KEEP_WARM`` sets no other (the
hub's default ``keep_warm``)."""
TICK = 1.0
"""Seconds between two looks at whether it should end."""
READ_TIMEOUT = 2.0
"""Seconds a command may take to send its request once connected."""
NOT_LOADED = ("ssh_scheduler.agent", "ssh_scheduler.__main__", "ssh_scheduler.cli.launcher", "ssh_scheduler.functions.joblib_backend")
"""Not loaded ahead: the agent runs on hosts; joblib is optional and only Python callers use it."""


@dataclass
class Running:
    conn: socket.socket
    pid: int
    pidfd: int
    stopped: bool = False
    started: float = field(default_factory=time.monotonic)


@dataclass
class Launcher:
    path: Path
    hub: Path
    idle: float
    listener: socket.socket
    lock: int
    inode: int
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    running: dict[int, Running] = field(default_factory=dict)
    last: float = field(default_factory=time.monotonic)
    launched: int = 0
    pid: int = field(default_factory=os.getpid)


def main() -> None:
    entry = serve()
    if entry is not None:  # in the copy, made the command's own process by now
        run_command(entry)


def serve() -> str | None:
    """Load everything, listen, fork a copy per command.  Returns in a copy (the command to
    run, the copy made its process), or None in the launcher when it is time to end."""
    try:
        folder = private_folder(create=False)
    except HubUnusable as exc:
        log.warning("no launcher: %s", exc)
        return None
    key = launcher_key()
    path = launcher_path(folder, key)
    place = handed_over(path, sys.argv[1:]) if len(sys.argv) > 1 else claim(path)
    if place is None:  # another launcher of this key runs (or what was handed over is not ours)
        return None
    lock, listener = place
    os.ftruncate(lock, 0)
    os.lseek(lock, 0, os.SEEK_SET)  # (a descriptor handed over may be past what its claimer wrote)
    os.write(lock, f"{os.getpid()}\n".encode())
    launcher = Launcher(path, socket_path(folder), idle_seconds(), listener, lock, os.stat(path).st_ino)
    log.info("launcher %s loading (pid %d)", path.name, os.getpid())
    preload()
    if threading.active_count() != 1:  # a fork copies only the forking thread: never fork then
        log.warning("no launcher: loading the commands started a thread")
        close(launcher)  # (the callers waiting in the backlog run their commands themselves)
        return None
    launcher.selector.register(listener, selectors.EVENT_READ, None)

    def on_term(_signum: int, _frame: object) -> None:  # hub stop: end now, or after the copies
        launcher.idle = -1.0
        if os.getpid() == launcher.pid and not launcher.running:
            close(launcher)
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    os.write(lock, READY)  # (loading_launchers: the benchmark waits for it)
    log.info("launcher ready")
    while True:
        for selected, _ in launcher.selector.select(TICK):
            if selected.data is None:
                # No SIGTERM between the fork and the copy's record: the launcher would end
                # without telling its caller how the command ended.  (A copy sets its own mask.)
                signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
                try:
                    launch = accept(launcher)
                finally:
                    if os.getpid() == launcher.pid:
                        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
                if launch is not None:
                    return launch
            else:
                reap_or_stop(launcher, selected.data)
        if not launcher.running and should_end(launcher):
            close(launcher)
            return None


def handed_over(path: Path, args: list[str]) -> tuple[int, socket.socket] | None:
    """The lock and listening socket the command that started us claimed for us (claim; their
    descriptors and the key they are for in ``args``), or None: handed over for another key
    than ours (another context), they are not ours to serve, and nobody's once we end."""
    if len(args) != 6 or args[0::2] != ["--lock-fd", "--listen-fd", "--key"]:
        log.warning("no launcher: arguments not understood: %s", args)
        return None
    lock, listen, key = int(args[1]), int(args[3]), args[5]
    listener = socket.socket(fileno=listen)
    if path != launcher_path(path.parent, key):
        log.warning("no launcher: handed a place for another key (%s)", key)
        with contextlib.suppress(OSError):
            os.unlink(launcher_path(path.parent, key))  # we hold its lock: no launcher serves it
        listener.close()
        os.close(lock)
        return None
    os.set_inheritable(lock, False)
    listener.set_inheritable(False)
    return lock, listener


def idle_seconds() -> float:
    return keep_warm_seconds(os.environ.get(KEEP_WARM_VARIABLE, "")) or DEFAULT_IDLE


def preload() -> None:
    """Every command's modules, loaded once here rather than by each command.  Not asyncssh: a
    command that starts here borrows its connections from the hub, which has it loaded, and only
    the rare one that must connect directly (the hub refused) loads it, as a cold command does.
    It was 80 ms of this process's start, which runs beside the first command, on its CPUs."""
    # (with the kept code of their dataclasses, written back: the next cold command finds it)
    for name, exc in class_code.load_all(NOT_LOADED):  # it loads (or fails) in the command
        log.info("not loaded ahead: %s (%s)", name, exc)
    gc.collect()
    gc.freeze()  # what is loaded stays out of every copy's collections (and its pages shared)


def should_end(launcher: Launcher) -> bool:
    if launcher.idle < 0:  # SIGTERM
        return True
    if time.monotonic() - launcher.last > launcher.idle:
        return True
    if not launcher.hub.exists():  # the hub ended (idle, stopped): warm starts end with it
        return True
    try:
        return os.stat(launcher.path).st_ino != launcher.inode  # our socket was taken from us
    except OSError:
        return True


def close(launcher: Launcher) -> None:
    with contextlib.suppress(OSError):
        if os.stat(launcher.path).st_ino == launcher.inode:
            os.unlink(launcher.path)
    with contextlib.suppress(OSError):
        lock = launcher.path.with_suffix(".lock")
        if os.stat(lock).st_ino == os.fstat(launcher.lock).st_ino:
            os.unlink(lock)  # while it is held: a launcher starting now makes a new one
    launcher.selector.close()
    launcher.listener.close()
    os.close(launcher.lock)
    log.info("launcher ended after %d commands", launcher.launched)


def accept(launcher: Launcher) -> str | None:
    try:
        conn, _ = launcher.listener.accept()
    except OSError:
        return None
    fds: list[int] = []
    try:
        if peer_uid(conn) != os.getuid():
            log.warning("refused a command from uid %d", peer_uid(conn))
            conn.close()
            return None
        request = receive(conn)
        problem = refusal(request)
        if problem:
            reply(conn, {"refused": problem})
            conn.close()
            return None
        # Taken only once the caller says so: a caller that gave up waiting runs its command
        # itself, and must never find it run here as well.
        reply(conn, {"ready": True})
        fds = given_over(conn)
        pid = os.fork()
    except (OSError, ValueError) as exc:
        log.info("a command not taken: %s", exc)
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    if pid == 0:
        forget(launcher, conn)
        become(request, fds)
        return str(request["entry"])
    for fd in fds:
        os.close(fd)
    launcher.launched += 1
    launcher.last = time.monotonic()
    pidfd = os.pidfd_open(pid)
    running = Running(conn, pid, pidfd)
    launcher.running[pid] = running
    launcher.selector.register(pidfd, selectors.EVENT_READ, running)
    launcher.selector.register(conn, selectors.EVENT_READ, running)
    try:
        reply(conn, {"pid": pid})
    except OSError:
        stop_copy(running)
    log.info("launched %s as pid %d", request["entry"], pid)
    return None


def receive(conn: socket.socket) -> Any:
    """A caller's request: its length, then its JSON (nothing follows before we answer it)."""
    conn.settimeout(READ_TIMEOUT)
    data = b""
    while len(data) < HEADER.size:
        data += _chunk(conn)
    (size,) = HEADER.unpack_from(data)
    if size > MAX_REQUEST:
        raise ValueError(f"a request of {size} bytes")
    while len(data) < HEADER.size + size:
        data += _chunk(conn)
    return json.loads(data[HEADER.size :])


def _chunk(conn: socket.socket) -> bytes:
    chunk = conn.recv(1 << 16)
    if not chunk:
        raise ValueError("a request cut short")
    return chunk


def refusal(request: Any) -> str:
    """Why this request cannot run here as it would in its own process ("" when it can)."""
    if not isinstance(request, dict) or request.get("entry") not in ENTRIES:
        return "not a command"
    if not isinstance(request.get("argv"), list) or not isinstance(request.get("env"), dict):
        return "no arguments or environment"
    for name in RLIMITS:
        _, hard = request["rlimits"].get(name, resource.getrlimit(getattr(resource, name)))
        _, our_hard = resource.getrlimit(getattr(resource, name))
        if our_hard != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > our_hard):
            return f"{name} above the launcher's"  # a limit a copy could not raise to
    return ""


def given_over(conn: socket.socket) -> list[int]:
    """The caller's ``GO`` and, with it, its stdin, stdout, stderr and working folder (only now:
    a caller that gave up before never left its descriptors waiting in our socket)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1, 8, socket.MSG_CMSG_CLOEXEC)
    if data != GO or len(fds) != 4 or not stat.S_ISDIR(os.fstat(fds[3]).st_mode):
        for fd in fds:
            os.close(fd)
        raise ValueError("the caller gave up before it was taken" if not data else "not its streams and folder")
    return list(fds)


def reply(conn: socket.socket, value: dict[str, Any]) -> None:
    conn.sendall(json.dumps(value).encode() + b"\n")


def reap_or_stop(launcher: Launcher, running: Running) -> None:
    """A copy ended (report it), or its command's process went away (stop the copy)."""
    try:
        ended, status, usage = os.wait4(running.pid, os.WNOHANG)
    except ChildProcessError:
        ended, status, usage = running.pid, 0, None
    if ended == 0:  # the command's process closed its end (or wrote, which it never does)
        try:
            closed = running.conn.recv(4096, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            closed = False
        except OSError:
            closed = True
        if closed:
            launcher.selector.unregister(running.conn)
            stop_copy(running)
        return
    if os.WIFSIGNALED(status):
        end = {"signal": os.WTERMSIG(status)}
    else:
        end = {"code": os.waitstatus_to_exitcode(status)}
    with contextlib.suppress(OSError):
        running.conn.settimeout(READ_TIMEOUT)
        reply(running.conn, end)
    with contextlib.suppress(KeyError, ValueError):
        launcher.selector.unregister(running.conn)
    launcher.selector.unregister(running.pidfd)
    os.close(running.pidfd)
    running.conn.close()
    del launcher.running[running.pid]
    launcher.last = time.monotonic()
    cpu = usage.ru_utime + usage.ru_stime if usage is not None else float("nan")
    log.info("pid %d ended (%s) after %.3f s, %.3f s of CPU", running.pid, end, launcher.last - running.started, cpu)


def stop_copy(running: Running) -> None:
    running.stopped = True
    with contextlib.suppress(ProcessLookupError):
        os.kill(running.pid, signal.SIGTERM)


def forget(launcher: Launcher, conn: socket.socket) -> None:
    """In a copy: nothing of the launcher's left open or in charge (its log, its handlers)."""
    for handler in list(log.handlers):  # the launcher's log is not the command's
        log.removeHandler(handler)
    for running in launcher.running.values():
        os.close(running.pidfd)
        running.conn.close()
    launcher.selector.close()
    launcher.listener.close()
    os.close(launcher.lock)
    conn.close()


if __name__ == "__main__":
    # Its own lines to its log (stderr); a copy drops this handler before its command runs.
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s launcher %(process)d: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    main()
