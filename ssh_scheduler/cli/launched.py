"""A launcher's copy (cli/launcher.py): made the command's own process, run, ended as one.

:func:`become` takes over what the command's process sent: its standard streams and working
folder (descriptors), environment, umask, resource limits, arguments, and the encoding and
buffering of its streams.  :func:`run_command` runs the command as its console script would and
gives it the end an interpreter would (its exit status, a traceback, ``atexit`` handlers, threads
joined), without tearing down what the launcher loaded: freeing every module of a copy writes to
all its pages, 50 ms for nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import locale
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from ssh_scheduler.cli.warm_place import RLIMITS, STREAMS, entry_function

__all__ = ["become", "run_command"]


def become(request: dict[str, Any], fds: list[int]) -> None:
    """Make this process the command's: ``fds`` are its stdin, stdout, stderr and folder."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in request.get("ignored", ()):  # as the command's process had them
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, request.get("blocked", ()))
    for stream in (sys.stdout, sys.stderr):  # the launcher's own, before its descriptors go
        with contextlib.suppress(Exception):
            stream.flush()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    os.fchdir(fds[3])
    for fd in fds:
        os.close(fd)
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["env"])
    with contextlib.suppress(locale.Error):
        locale.setlocale(locale.LC_CTYPE, "")
    for name in RLIMITS:  # (the launcher checked that each can be set: launcher.refusal)
        soft, hard = request["rlimits"][name]
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(getattr(resource, name), (soft, hard))
    for fd, (name, spec) in enumerate(zip(STREAMS, request["streams"], strict=True)):
        stream = text_stream(fd, spec) if spec.get("open") else None
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.argv = list(request["argv"])
    if sys.path and isinstance(request.get("path0"), str):
        sys.path[0] = request["path0"]
    # Its name in top and ps -o comm, as its own process's would be (not python's).
    with contextlib.suppress(OSError, IndexError), open("/proc/self/comm", "w") as comm:
        comm.write(os.path.basename(sys.argv[0])[:15])
    gc.unfreeze()


def text_stream(fd: int, spec: dict[str, Any]) -> io.TextIOWrapper:
    """A standard stream as the command's interpreter made it (encoding, errors, buffering)."""
    raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
    buffered: io.BufferedReader | io.BufferedWriter = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffered,
        encoding=spec["encoding"],
        errors=spec["errors"],
        line_buffering=bool(spec["line_buffering"]),
        write_through=bool(spec["write_through"]),
    )


def run_command(entry: str, after: Callable[[], object] | None = None) -> NoReturn:
    """Run the command ``entry`` and end this process as its interpreter would end (``after``:
    once it has, what else to do before the process goes)."""
    from ssh_scheduler.cli import main as commands

    interrupted = False
    try:
        entry_function(commands, entry)()
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException as exc:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    code = finish(code)
    if after is not None:
        with contextlib.suppress(Exception):
            after()
    if interrupted:  # python ends of an uncaught Ctrl-C by SIGINT, so its caller knows (a shell's 130)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def exit_status(exc: SystemExit) -> int:
    """The status a SystemExit gives a process (None: 0; a number; any other value: printed, 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{exc.code}\n")
    return 1


def finish(code: int) -> int:
    """What the interpreter does at its end that a command may rely on: threads that are not
    daemons joined (and the hooks that stop pools' workers), ``atexit`` handlers run, the
    standard streams flushed (a failed flush: 120, as python's own exit gives)."""
    shutdown = getattr(threading, "_shutdown", None)  # the interpreter's own step at exit
    if shutdown is not None:
        shutdown()
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is not None:
        run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            code = code or 120
    return code
