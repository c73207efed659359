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

# _socket, not socket: socket.py's import (its enums, selectors) costs 5 ms of every start,
# and the thin start needs only the socket type itself and its constants.
import _socket
import contextlib
import json
import os
import resource
import signal
import struct
import sys
from pathlib import Path

from ssh_scheduler.cli.warm_place import (
    GO,
    HEADER,
    MAX_REQUEST,
    READY_WAIT,
    RLIMITS,
    STREAMS,
    claim,
    launcher_key,
    launcher_path,
    wanted,
)
from ssh_scheduler.transport.hub_place import (
    KEEP_WARM_VARIABLE,
    HubUnusable,
    keep_warm_seconds,
    private_folder,
    spawn_detached,
    start_early,
)
from ssh_scheduler.transport.unix_socket import peer_uid, reachable

TYPE_CHECKING = False  # the thin start imports this module: typing's own import costs it 2 ms
if TYPE_CHECKING:
    from typing import Any

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)
"""Signals passed on to the copy that runs the command (Ctrl-Z stops both: :func:`_follow`)."""
IGNORABLE = (*FORWARDED, signal.SIGPIPE, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
CONNECTING = frozenset({"execute_batch", "execute_remote", "execute_to", "doctor"})
"""The commands that connect to hosts (through the hub, while warm connections are allowed)."""
NOT_CONNECTING = frozenset({"-h", "--help", "--version"})


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
        # We end as the copy ended, at once: nothing here holds anything the interpreter's
        # teardown would finish (no exit handlers, no threads), and tearing down the thin
        # start's modules cost every warm command 15 ms on a 2-core machine.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    if wanted() and connects(entry, sys.argv[1:]):
        # No hub listens (none handed the command over): start it now, so that it loads while
        # this process loads the command, not after (a hub unused exits in 2 s).
        start_early()
    # The command's modules, about to load here, make their dataclasses from kept code.
    from ssh_scheduler.cli import class_code

    class_code.install()
    # The command runs as a launcher's copy runs it, and ends the same way: its exit handlers,
    # threads and streams as the interpreter would, but not the interpreter's teardown of every
    # module (60 ms of CPU after a cold batch had printed its last line).
    from ssh_scheduler.cli.launched import run_command

    if not wanted():
        run_command(entry)
    # A command that went to the hub starts a launcher as it ends, for the next command (which
    # waits for one still loading).  Not at once: on 2 cores its load (~0.3 s of CPU) beside
    # the command's own start and the hub's cost a cold 4-job batch 0.50 s instead of 0.45 s.
    from ssh_scheduler.transport.hub_client import when_hub_used

    used: list[bool] = []
    when_hub_used(lambda: used.append(True))

    def after() -> None:
        if used:
            start_beside_hub()

    run_command(entry, after=after)


def connects(entry: str, args: list[str]) -> bool:
    """Whether the command ``entry args`` will connect to hosts through the hub: one of
    :data:`CONNECTING`, not asking for help (a dry run probes the hosts), and not told to keep
    nothing warm (``--keep-warm 0``: no hub for this command, not even one started early)."""
    if NOT_CONNECTING.intersection(args):
        return False
    for at, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith("--keep-warm=") else None
        if arg == "--keep-warm" and at + 1 < len(args):
            value = args[at + 1]
        if value is not None and keep_warm_seconds(value) == 0:
            return False
    if entry == "ssh_scheduler":
        entry = next((a.replace("-", "_") for a in args if not a.startswith("-")), "")
    return entry in CONNECTING


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
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        lines = _Lines(sock)
        if not _hand_over(sock, lines, path, entry):
            return None
        # Committed: the launcher runs the command now, whatever happens, so it never runs here.
        return _follow(sock, lines)
    finally:
        sock.close()


def _hand_over(sock: _socket.socket, lines: _Lines, path: Path, entry: str) -> bool:
    """Send the command and, once the launcher is ready for it, give it over (``GO``, with our
    standard streams and folder).  False when that did not happen (the command runs here)."""
    cwd = -1
    try:
        sock.settimeout(READY_WAIT)
        with reachable(path) as where:
            sock.connect(where)
        if peer_uid(sock) != os.getuid():  # another user's socket in our folder: never theirs to run
            return False
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        data = json.dumps(request_for(entry), separators=(",", ":")).encode("utf-8", "surrogatepass")
        if len(data) > MAX_REQUEST:
            return False
        sock.sendall(HEADER.pack(len(data)) + data)
        reply = lines.next()
        if not (isinstance(reply, dict) and reply.get("ready") is True):
            return False
        # Our stdin, stdout, stderr and folder go with the GO, not before: a caller that gives
        # up leaves nothing of its own waiting in the launcher's socket.
        sock.sendmsg([GO], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("4i", 0, 1, 2, cwd))])
    except (OSError, ValueError):
        return False
    finally:
        if cwd >= 0:
            os.close(cwd)
    return True


class _Lines:
    """The launcher's JSON lines on ``sock``, one at a time (two may come in one read)."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.pending = b""

    def next(self) -> Any:
        while b"\n" not in self.pending:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ValueError("the launcher closed the connection")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


def _follow(sock: _socket.socket, lines: _Lines) -> int:
    """The command is the launcher's: learn the copy's pid, pass our signals on to it, wait for
    its end, end as it did."""
    sock.settimeout(None)
    try:
        started = lines.next()
    except (OSError, ValueError):
        started = None
    pid = started.get("pid") if isinstance(started, dict) else None
    if not isinstance(pid, int) or pid <= 0:
        sys.stderr.write(
            "error: the warm launcher took this command and failed before it started it (see its log"
            f" in the hub's folder; run it again, with {KEEP_WARM_VARIABLE}=0 to run it without the launcher)\n"
        )
        return 1

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
    try:
        end = lines.next()
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
    """For a command that went to the hub, as it ends: start a launcher when none runs for this
    key, its lock and socket claimed here and handed over (it loads in the background; this
    command does not wait for it)."""
    try:
        folder = private_folder(create=True)
        key = launcher_key()
        path = launcher_path(folder, key)
        place = claim(path)  # listening from now on: the next command finds it, loading or not
        if place is None:  # one runs
            return
        lock, listener = place
        try:
            fds = (lock, listener.fileno())
            args = ["--lock-fd", str(lock), "--listen-fd", str(listener.fileno()), "--key", key]
            started = spawn_detached("ssh_scheduler.cli.launcher", args, path.with_suffix(".log"), fds)
            os.pwrite(lock, f"{started.pid}\n".encode(), 0)  # (what it writes there itself)
        finally:
            listener.close()
            os.close(lock)
    except (HubUnusable, OSError) as exc:
        import logging  # (only here: the thin start stays small)

        logging.getLogger(__name__).debug("no launcher started: %s", exc)
