"""Reattachment: the agent outlives its channel, and a coordinator that comes back reaches it.

A running agent listens on a unix socket named by its batch token, in the private agents folder
of the work root (:func:`start_unix_server`).  A coordinator that comes back starts the agent
again with the same token; the new process finds the socket and becomes a byte relay between its
channel and the old agent (:func:`relay`), which then serves the new coordinator.  Only our own
uid may connect (SO_PEERCRED), and a socket held by anyone else is refused, never used.

A part of the agent (main.py); runs on the hosts' python3 (3.8 or newer): stdlib only.
"""

import asyncio
import os
import socket
import sys

from ssh_scheduler.agent import hostguard as G


async def start_unix_server(agent, name):
    """Listen on ``name`` in the current folder (our private agents folder: no path length
    limit to work around, nobody else can reach or replace it); only our own uid may talk."""
    async def on_client(reader, writer):
        sock = writer.get_extra_info("socket")
        try:
            if sock is not None and G.peer_uid(sock) == os.getuid():
                await agent.attach(reader, writer)
        finally:
            try:
                writer.close()
            except Exception:
                pass

    if os.path.lexists(name):
        os.unlink(name)  # a dead agent's socket (connecting to it failed)
    old_umask = os.umask(0o077)
    try:
        return await asyncio.start_unix_server(on_client, path=name, limit=1 << 26)
    finally:
        os.umask(old_umask)


def relay(name):
    """If an agent for this token is alive, become a pipe between it and our channel.

    Returns False (nothing done) when no agent answers on the socket ``name`` (in the current
    folder).  Raises Refused when the process answering is not ours.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        return False
    uid = G.peer_uid(sock)
    if uid != os.getuid():
        sock.close()
        raise G.Refused("the agent socket %s is held by another user (uid %d)"
                        % (os.path.abspath(name), uid))
    import selectors

    sel = selectors.DefaultSelector()
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    in_fd = stdin.fileno()
    out_fd = sys.stdout.fileno()
    sel.register(in_fd, selectors.EVENT_READ, "in")
    sel.register(sock, selectors.EVENT_READ, "sock")
    while True:
        for key, _ in sel.select():
            if key.data == "in":
                data = os.read(in_fd, 1 << 16)
                if not data:
                    return True  # closing the socket detaches us from the agent
                sock.sendall(data)
            else:
                data = sock.recv(1 << 16)
                if not data:
                    return True
                view = memoryview(data)
                while view:
                    view = view[os.write(out_fd, view):]
