"""The agent floor's host side: the least an agent can do per job.  scripts/bench_agent_floor.py
starts this file's text on each host over one SSH channel (``python3 -u -I -S -c TEXT SLOTS``,
as ssh_scheduler starts its agent), then writes job lines on its stdin, ``ID<TAB>COMMAND``.

Each command is split into words and spawned directly (``posix_spawnp``, no shell), in a session
of its own (as our agent starts every job), with /dev/null for its stdin, stdout and stderr: no
output capture, no journal, no files.  At most SLOTS run at once (more lines wait).  Each exit is
answered ``ID STATUS`` on stdout (STATUS: the exit code, or minus the signal).  When stdin ends
and the last job has exited, the program exits.

It runs on the hosts' python3 (3.8+), standard library only.
"""

import collections
import contextlib
import os
import selectors
import shlex
import signal
import sys


def exit_code(status):
    """What a shell says of a wait status: the exit code, or minus the killing signal."""
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else 255


def main():
    slots = int(sys.argv[1])
    devnull = os.open(os.devnull, os.O_RDWR)
    quiet = [(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)]
    # SIGCHLD wakes the selector through this pipe (signal.set_wakeup_fd): one loop, no threads.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signo, frame: None)
    os.set_blocking(0, False)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    env = dict(os.environ)
    waiting = collections.deque()
    running = {}
    pending = b""
    ended = False
    while not (ended and not waiting and not running):
        for key, _events in selector.select():
            if key.fd == 0:
                data = os.read(0, 65536)
                if not data:
                    ended = True
                    selector.unregister(0)
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                waiting.extend(lines)
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        answers = []
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            answers.append(f"{running.pop(pid)} {exit_code(status)}\n")
        while waiting and len(running) < slots:
            job, _tab, command = waiting.popleft().decode().partition("\t")
            argv = shlex.split(command)
            try:
                running[os.posix_spawnp(argv[0], argv, env, file_actions=quiet, setsid=True)] = job
            except (OSError, IndexError):
                answers.append(f"{job} 127\n")
        if answers:
            os.write(1, "".join(answers).encode())


if __name__ == "__main__":
    main()
