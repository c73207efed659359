"""The agent's plumbing that knows nothing of jobs: blocking writes, reading a stream in a thread,
walking a job folder for its results listing, and the pidfd child watcher.

Runs on the hosts' python3 (3.8 or newer) as part of the agent (shipped with it by
``transport.agent_bootstrap``): stdlib only, no 3.9+ syntax.
"""

import asyncio
import os
import stat
import sys


class BlockingWriter(object):
    def __init__(self, fd):
        self.fd = fd

    def write(self, data):
        while data:
            data = data[os.write(self.fd, data):]


def feed_from_file(loop, reader):
    for line in iter(sys.stdin.buffer.readline, b""):
        loop.call_soon_threadsafe(reader.feed_data, line)
    loop.call_soon_threadsafe(reader.feed_eof)


def kind_of(mode):
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "special"


def walk(start, base):
    """Yield (relative path, lstat) below ``start`` without following symlinks."""
    try:
        st = os.lstat(start)
    except OSError:
        return
    rel = os.path.relpath(start, base)
    if rel != ".":
        yield rel, st
    if not stat.S_ISDIR(st.st_mode):
        return
    stack = [start]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                for entry in it:
                    try:
                        est = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    yield os.path.relpath(entry.path, base), est
                    if stat.S_ISDIR(est.st_mode):
                        stack.append(entry.path)
        except OSError:
            continue


def use_pidfd_watcher(loop):
    """Before 3.12 asyncio waits for each child in a thread of its own; a pidfd watcher costs
    no thread per job (3.12+ picks it by itself)."""
    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return
    try:
        watcher = asyncio.PidfdChildWatcher()
        asyncio.get_event_loop_policy().set_child_watcher(watcher)
        watcher.attach_loop(loop)
        os.close(os.pidfd_open(os.getpid()))  # the kernel must support pidfds
    except (AttributeError, OSError, RuntimeError):
        asyncio.get_event_loop_policy().set_child_watcher(asyncio.ThreadedChildWatcher())
