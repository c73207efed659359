#!/usr/bin/python3 -IS
"""PID 1 of a simulated host's PID namespace: reap every orphan, nothing else.

sshd runs as a (daemonized) child of this init, so it can be stopped and restarted
without ending the host; killing this process (SIGKILL from the parent namespace) makes the
kernel kill every process of the host at once ("crash").  SIGTERM/SIGINT end the host too.
"""

import os
import signal
import sys

WANTED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}


def main() -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, WANTED)
    while True:
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        info = signal.sigtimedwait(WANTED, 30.0)
        if info is not None and info.si_signo != signal.SIGCHLD:
            return 0


if __name__ == "__main__":
    sys.exit(main())
