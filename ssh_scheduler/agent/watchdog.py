"""``execute_to``'s watchdog: runs one command and kills all of it when the channel closes.

sshd leaves a command running when its channel closes (no pty: no SIGHUP), so closing the
channel on timeout or Ctrl-C would not stop it.  This program runs the command in a session of
its own, and kills that whole session (TERM, then KILL after the grace period) when its stdin,
the channel, reaches end of file: the channel closed or the connection dropped.  The command
itself gets /dev/null as stdin (so it cannot hang waiting for input).  Its exit status is the
command's (128+n for signal n).

coordinator/fleet.py (``killable``) sends this file's text on the command line as one line, with
the command and the grace period as its arguments; it runs on whatever python3 the host has
(``-I -S``), so: standard library only, no f-strings, only annotations that evaluate anywhere.
The command runs as the agent runs jobs: ``bash --norc -c``, /bin/sh only where bash is missing.
"""

import _thread
import os
import signal
import sys
import time


def start(shell: "list[str]", command: str) -> int:
    """The command's pid, in a session of its own, stdin from /dev/null, default signals."""
    defaults = [s for s in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", None)) if s]
    try:
        return os.posix_spawn(
            shell[0], shell + ["-c", command], os.environ,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
            setsid=True, setsigdef=defaults,
        )
    except (AttributeError, TypeError, NotImplementedError):  # python3 < 3.8, or no setsid
        import subprocess

        return subprocess.Popen(shell + ["-c", command], stdin=subprocess.DEVNULL,
                                start_new_session=True).pid


def kill_at_end_of_input(pid: int, grace: float, gone: "list[int]", done: "_thread.LockType") -> None:
    """Wait for stdin's end, then TERM the command's session, KILL it after ``grace`` s."""
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    gone.append(1)
    try:
        os.killpg(pid, signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            time.sleep(0.05)
            os.killpg(pid, 0)  # raises once the whole session is gone
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    done.release()


def main(argv: "list[str]") -> None:
    command, grace = argv[0], float(argv[1])
    shell = ["/bin/bash", "--norc"] if os.path.exists("/bin/bash") else ["/bin/sh"]
    done = _thread.allocate_lock()
    done.acquire()
    gone = []  # type: list[int]
    pid = start(shell, command)
    _thread.start_new_thread(kill_at_end_of_input, (pid, grace, gone, done))
    status = os.waitpid(pid, 0)[1]
    if gone:  # the channel closed: let the killing finish before we exit
        done.acquire(True, grace + 1)
    sys.exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


if __name__ == "__main__":
    main(sys.argv[1:])
