"""Where every command starts: handed to the warm launcher when one is ready, else run here.

The console scripts begin in this module, which imports only the standard library,
``cli.warm_place`` and ``transport.hub_place``: 20 ms, where the command's own modules (typer,
asyncio, asyncssh, the coordinator) take 100 ms more.  While this user's hub keeps connections
warm, a launcher (cli/launcher.py) keeps those modules loaded: when one runs for the same code,
python and process context (``warm_place.launcher_key``), the command is handed to it.  It
forks a copy of itself that takes over this process's stdin, stdout and stderr, working folder,
environment, umask, resource limits and arguments, runs the command as this process would have,
and tells us how it ended, which is how we end.  A signal sent to us (Ctrl-C, ``kill``, a closed
terminal) is passed on to that copy, and Ctrl-Z stops both.

Anything else -- no launcher, one of another user, one that refuses the command or fails
before it takes it -- and the command runs here, as it always did: slower, never different.
``SSH_SCHEDULER_KEEP_WARM=0`` (no hub: a CI job, a test suite) never hands a command over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ssh_scheduler.cli.warm_place import (
    HEADER,
    MAX_REQUEST,
    REACH_TIMEOUT,
    RLIMITS,
    STREAMS,
    entry_function,
    launcher_path,
    wanted,
)
from ssh_scheduler.transport.hub_place import (
    KEEP_WARM_VARIABLE,
    HubUnusable,
    private_folder,
)
from ssh_scheduler.transport.unix_socket import peer_uid, reachable

log = logging.getLogger(__name__)

LOAD_WAIT = 0.6
"""Seconds a command waits for a launcher that is loading (it loads in about 0.4 s on a busy
2-core machine) before it runs itself."""
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)
"""Signals passed on to the copy that runs the command (Ctrl-Z stops both: :func:`_follow`)."""
IGNORABLE = (*FORWARDED, signal.SIGPIPE, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


def execute_batch_main() -> None:
    start("execute_batch")


def execute_remote_main() -> None:
    start("execute_remote")


def execute_to_main() -> None:
    start("execute_to")


def combine_folders_main() -> None:
    start("combine_folders")


def main() -> None:
    start("ssh_scheduler")


def start(entry: str) -> None:
    """Run the command ``entry`` with this process's arguments: through a launcher, or here."""
    code = through_launcher(entry)
    if code is not None:
        raise SystemExit(code)
    from ssh_scheduler.cli import main as commands

    if wanted():
        # A command that goes to the hub starts a launcher beside it at once: it loads while
        # the command goes on, so that the next command finds it ready.
        from ssh_scheduler.transport.hub_client import when_hub_used

        when_hub_used(start_beside_hub)
    entry_function(commands, entry)()


# --- handing the command over ------------------------------------------------------------------


def request_for(entry: str) -> dict[str, Any]:
    """What the launcher's copy takes over (the descriptors travel beside it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    streams = []
    for name in STREAMS:
        stream = getattr(sys, name)
        streams.append({
            "encoding": getattr(stream, "encoding", None) or "utf-8",
            "errors": getattr(stream, "errors", None) or "strict",
            "line_buffering": bool(getattr(stream, "line_buffering", False)),
            "write_through": bool(getattr(stream, "write_through", False)),
            "open": stream is not None,
        })
    return {
        "entry": entry,
        "argv": sys.argv,
        "path0": sys.path[0] if sys.path else "",  # the script's folder (the rest is in the key)
        "env": dict(os.environ),
        "umask": mask,
        "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in RLIMITS},
        "streams": streams,
        # Signals this process ignores (nohup: SIGHUP; a script's background job: SIGINT and
        # SIGQUIT) and blocks: its copy ignores and blocks the same.
        "ignored": [int(sig) for sig in IGNORABLE if signal.getsignal(sig) == signal.SIG_IGN],
        "blocked": sorted(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }


def through_launcher(entry: str) -> int | None:
    """The command's exit status, run by a launcher; None when none took it (run it here)."""
    if not wanted():
        return None
    try:
        path = launcher_path(private_folder(create=False))
    except (HubUnusable, OSError):
        return None
    if not path.exists() and not _loading(path):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        pid = _hand_over(sock, path, entry)
        if pid is None:
            return None
        return _follow(sock, pid)
    finally:
        sock.close()


def _loading(path: Path) -> bool:
    """A launcher of this key holds its lock but does not listen yet (it is loading: a command
    that went to the hub a moment ago started it): wait for it, up to :data:`LOAD_WAIT`.  True
    once it listens."""
    try:
        fd = os.open(path.with_suffix(".lock"), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        deadline = time.monotonic() + LOAD_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: it runs
                if path.exists():
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.01)
                continue
            return False  # nobody holds it: no launcher is coming
    finally:
        os.close(fd)


def _hand_over(sock: socket.socket, path: Path, entry: str) -> int | None:
    """Send the command; the pid of the copy that runs it, or None (it runs here)."""
    cwd = -1
    try:
        sock.settimeout(REACH_TIMEOUT)
        with reachable(path) as where:
            sock.connect(where)
        if peer_uid(sock) != os.getuid():  # another user's socket in our folder: never theirs to run
            return None
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        data = json.dumps(request_for(entry), separators=(",", ":")).encode("utf-8", "surrogatepass")
        if len(data) > MAX_REQUEST:
            return None
        message = HEADER.pack(len(data)) + data
        sent = socket.send_fds(sock, [message], [0, 1, 2, cwd])
        sock.sendall(message[sent:])
        reply = _line(sock)
    except (OSError, ValueError):
        return None
    finally:
        if cwd >= 0:
            os.close(cwd)
    pid = reply.get("pid") if isinstance(reply, dict) else None
    return pid if isinstance(pid, int) and pid > 0 else None


def _line(sock: socket.socket) -> Any:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise ValueError("the launcher closed the connection")
        data += chunk
    return json.loads(data)


def _follow(sock: socket.socket, pid: int) -> int:
    """The command runs in ``pid`` now: pass our signals on, wait for its end, end as it did."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def stop(_signum: int, _frame: object) -> None:  # Ctrl-Z: the command stops, and so do we
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)

    def carry_on(_signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    for forwarded in FORWARDED:
        if signal.getsignal(forwarded) != signal.SIG_IGN:  # one we ignore is not the copy's either
            signal.signal(forwarded, forward)
    signal.signal(signal.SIGTSTP, stop)
    signal.signal(signal.SIGCONT, carry_on)
    sock.settimeout(None)
    try:
        end = _line(sock)
    except (OSError, ValueError):
        end = None
    if not isinstance(end, dict) or not isinstance(end.get("code", end.get("signal")), int):
        sys.stderr.write(
            f"error: the warm launcher ended while it ran this command (pid {pid}); how the command ended is"
            f" unknown (run it again with {KEEP_WARM_VARIABLE}=0 to run it without the launcher)\n"
        )
        return 1
    if "signal" in end:  # it died of a signal: so do we, as a shell expects of the command
        signum = int(end["signal"])
        for handled in (*FORWARDED, signal.SIGTSTP, signal.SIGCONT):
            signal.signal(handled, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            os.kill(os.getpid(), signum)
        return 128 + signum
    return int(end["code"])


# --- after a command run here ---------------------------------------------------------------


def start_beside_hub() -> None:
    """For a command that goes to the hub: start a launcher when none runs for this key (it
    loads in the background; this command does not wait for it)."""
    try:
        folder = private_folder(create=True)
        path = launcher_path(folder)
        if path.exists():
            return
        import subprocess  # (only here: the thin start stays small)

        with contextlib.suppress(OSError):
            if path.with_suffix(".log").stat().st_size > 1 << 20:
                path.with_suffix(".log").unlink()
        log_fd = os.open(path.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            subprocess.Popen(
                [sys.executable, "-m", "ssh_scheduler.cli.launcher"],
                stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True, cwd="/",
            )
        finally:
            os.close(log_fd)
    except (HubUnusable, OSError) as exc:
        log.debug("no launcher started: %s", exc)
