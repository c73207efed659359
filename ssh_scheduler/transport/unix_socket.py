"""What every private unix socket of ours needs: a name that fits ``sun_path`` however deep its
folder is, and who is at the other end (the hub's socket and the coordinator's control socket
both refuse every other user)."""

from __future__ import annotations

# _socket, not socket: socket.py's own import costs 5 ms (its enums, selectors) of the thin
# start, which needs only the socket type itself and its constants (socket.socket is a subclass).
import _socket
import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

__all__ = ["UNIX_PATH_MAX", "peer_uid", "reachable"]

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL


@contextlib.contextmanager
def reachable(path: Path) -> Iterator[str]:
    """A name for ``bind``/``connect`` that fits ``sun_path``: a long path (a deep
    XDG_RUNTIME_DIR, home or pytest folder) goes through ``/proc/self/fd/N`` of its folder."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def peer_uid(sock: _socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)
