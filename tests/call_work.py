"""What the Executor's cluster tests run on the hosts.  Copied into each test's project folder
as ``work.py``: a module of the user's that is installed nowhere and reaches the hosts only
through the copied-forward folder.

Side effects go into the host's home, where the test reads them (``host.home``): ``started.log``
when a call starts, ``done.log`` when it ends, ``calls.log`` for each run of a counted call; a
call that waits does so for a file the test writes there (``gate``)."""

import os
import socket
import subprocess
import time
import uuid

HOME = os.path.expanduser("~")


class Refused(Exception):
    pass


def refuse(why):
    raise Refused(why)


def where():
    """Where it runs (a Slurm job: its node), and on which GPUs."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return node, os.environ.get("CUDA_VISIBLE_DEVICES")


def note(log, text):
    with open(os.path.join(HOME, log), "a") as f:
        f.write(text + "\n")


def wait_for(name):
    while not os.path.exists(os.path.join(HOME, name)):
        time.sleep(0.05)


def gated(name):
    """Starts, waits for the gate, ends: each end is one line of done.log with a fresh id."""
    note("started.log", f"{name} {os.getpid()}")
    wait_for("gate")
    run = uuid.uuid4().hex
    note("done.log", f"{name} {run}")
    return socket.gethostname(), run


def counted(i):
    """One line of calls.log per run (with the run the test wrote in ~/run); from 5 on, it
    waits for the gate."""
    with open(os.path.join(HOME, "run")) as f:
        run = f.read().strip()
    note("calls.log", f"{run} {i}")
    if i >= 5:
        wait_for("gate")
    return i * i


def hold_gpu(mb, seconds):
    start = time.time()
    subprocess.run(["gpu_hold", "--mb", str(mb), "--seconds", str(seconds)], check=True)
    return socket.gethostname(), os.environ["CUDA_VISIBLE_DEVICES"], start, time.time()


def big(n):
    return b"x" * n


def sleep_marked(marker):
    note(marker, str(os.getpid()))
    time.sleep(600)
