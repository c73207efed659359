"""The hub: a per-user background process that keeps hosts' SSH connections (and agents) warm.

Started by a command that will connect and finds none (hub_place.spawn_hub runs this module as
a program: ``python -m ssh_scheduler.transport.hub_server``), in a session of its own, detached
from every terminal; it serves :mod:`hub_wire`'s socket in the user's private folder and ends by
itself once it holds nothing: each connection goes ``keep_warm`` seconds after its last use
(hub_pool.py), a changed key or known_hosts entry closes it at once, and the hub exits a moment
after the last one.
``ssh-scheduler hub stop`` stops it sooner (connections lent to a running command finish first).

Every client connection is one request (hub_wire.py): ``open`` lends a connection for as long as
that client connection stays open (the *lease*; its pings are answered there); ``exec``,
``agent``, ``sftp``, ``upload`` and ``download`` each use a lease, as the methods of the same
names use an SSH connection (transport/ssh.py does the work here, exactly as it would in the
client); ``status`` and ``stop`` are the command line's.  Only our own uid is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import resource
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ssh_scheduler.errors import ConnectionLostError, SchedulerError
from ssh_scheduler.transport.base import bounded
from ssh_scheduler.transport.hub_place import hub_key, lock_path, private_folder, socket_path
from ssh_scheduler.transport.hub_pool import Held, Pool
from ssh_scheduler.transport.hub_wire import (
    END,
    ERR,
    FAIL,
    OUT,
    error_json,
    frame,
    json_frame,
    machine_from_json,
    receive_request,
    reply_line,
)
from ssh_scheduler.transport.unix_socket import peer_uid, reachable

log = logging.getLogger(__name__)

T = TypeVar("T")
EXIT_GRACE = 2.0
"""Seconds the hub stays with nothing held and nobody connected before it exits."""
SWEEP_EVERY = 5.0
"""Seconds between two checks of every idle connection's key files and known_hosts entries (a
connection about to be lent is checked then, whatever the time)."""
REQUEST_TIMEOUT = 10.0
READY = b"ready\n"
OWN_SUFFIX = ".own"
"""A hub's own socket: ``hub-KEY.PID.own``, beside its name ``hub-KEY.sock``."""
BUSY = b"busy\n"


@dataclass(eq=False)
class Lease:
    """A connection lent to one client, for as long as its ``open`` connection stays open."""

    id: str
    held: Held
    keep: float
    ops: set[asyncio.Task[Any]] = field(default_factory=set)
    streams: set[asyncio.StreamWriter] = field(default_factory=set)
    usable: bool = True
    """False once a file transfer was cut off midway (an SFTP session in an unknown state)."""
    clean: bool = False
    """The client said goodbye (a client that vanished, killed, leaves nothing to reuse)."""
    batch: bool = False
    """A batch's agent ran on it: a spare is started for the next batch when it is given back."""


class Hub:
    def __init__(self, path: Path, lock: int) -> None:
        self.path = path
        self._lock: int | None = lock
        self.pool = Pool()
        self._spares: list[Held] = []  # a batch gave them back: their spares start once no client holds any
        self.leases: dict[str, Lease] = {}
        self.clients = 0
        self.last_activity = time.monotonic()
        self.stopping = False
        self.done = asyncio.Event()
        self._server: socket.socket | None = None
        self._own_server: socket.socket | None = None
        self.own = path
        self._inode: int | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ops: dict[str, Callable[[dict[str, Any], list[int], asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]] = {
            "open": self._open, "exec": self._exec, "agent": self._agent, "sftp": self._sftp,
            "upload": self._upload, "download": self._download, "status": self._status, "stop": self._stop,
        }

    # -- the sockets -------------------------------------------------------------------------------
    def listen(self) -> None:
        """The hub's name (for new clients, while it takes them) and its own socket (what it
        lent is reached there until it exits, also after a new hub took the name)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a dead hub's (we hold the lock: no live hub serves it)
        for stale in self.path.parent.glob(f"{self.path.stem}.*{OWN_SUFFIX}"):
            with contextlib.suppress(ValueError, OSError):
                if not _alive(int(stale.name.rsplit(".", 2)[-2])):
                    stale.unlink()  # a dead hub's own socket
        self.own = self.path.with_name(f"{self.path.stem}.{os.getpid()}{OWN_SUFFIX}")
        self._server = _bound(self.path)
        self._inode = os.stat(self.path).st_ino
        self._own_server = _bound(self.own)

    async def run(self) -> None:
        assert self._server is not None and self._own_server is not None
        loop = asyncio.get_running_loop()
        ticker = asyncio.create_task(self._tick())
        accepting = [asyncio.create_task(self._accept(loop, s)) for s in (self._server, self._own_server)]
        try:
            await self.done.wait()
        finally:
            for task in (*accepting, ticker):
                task.cancel()
            self._unlisten()
            self._own_server.close()
            with contextlib.suppress(OSError):
                os.unlink(self.own)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, *accepting, ticker, return_exceptions=True)
            await self.pool.close_all()

    def _unlisten(self) -> None:
        """No new client: the socket and the lock go, so that a new hub may start at once beside
        this one while it finishes what it lent."""
        if self._server is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self._inode:  # ours still: no newer hub's
                    os.unlink(self.path)
            self._server.close()
            self._server = None
        if self._lock is not None:
            with contextlib.suppress(OSError):
                if os.stat(lock_path(self.path)).st_ino == os.fstat(self._lock).st_ino:
                    os.unlink(lock_path(self.path))  # before it is released: a new one is made
            os.close(self._lock)
            self._lock = None

    async def _accept(self, loop: asyncio.AbstractEventLoop, server: socket.socket) -> None:
        while True:
            try:
                sock, _ = await loop.sock_accept(server)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    await asyncio.sleep(0.1)
                    continue
                raise
            task = asyncio.create_task(self._client(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _tick(self) -> None:
        """Close what changed under it; exit once nothing is held and nobody is here."""
        swept = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            if time.monotonic() - swept >= SWEEP_EVERY:
                self.pool.sweep()
                swept = time.monotonic()
            if self.clients or self.leases or not self.pool.idle:
                self.last_activity = time.monotonic()
            elif time.monotonic() - self.last_activity > EXIT_GRACE or self.stopping:
                self.done.set()

    # -- one client connection ---------------------------------------------------------------------
    async def _client(self, sock: socket.socket) -> None:
        self.clients += 1
        fds: list[int] = []
        try:
            uid = peer_uid(sock)
            if uid != os.getuid():  # root ignores the socket's mode: the uid decides
                log.warning("refused a connection from uid %d", uid)
                with contextlib.suppress(OSError):
                    sock.send(reply_line({"ok": False, "refused": f"uid {uid} may not use the hub of uid {os.getuid()}"}))
                return
            request, fds = await bounded(receive_request(sock), REQUEST_TIMEOUT)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
            sock = None  # type: ignore[assignment]  # the writer owns it now
            try:
                handler = self._ops.get(str(request.get("op")))
                if handler is None:
                    writer.write(reply_line({"ok": False, "refused": f"unknown request {request.get('op')!r}"}))
                else:
                    try:
                        await handler(request, fds, reader, writer)
                    except SchedulerError as exc:  # before its reply (a lease that is gone)
                        writer.write(reply_line({"ok": False, **error_json(exc)}))
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        except (ConnectionError, OSError, ValueError, TimeoutError) as exc:
            log.debug("a client connection ended: %s", exc)
        except Exception:  # one client's bad request never ends the hub
            log.exception("a request failed")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if sock is not None:
                sock.close()
            self.clients -= 1
            self.last_activity = time.monotonic()

    def _lease(self, request: dict[str, Any]) -> Lease:
        lease = self.leases.get(str(request.get("lease")))
        if lease is None:
            raise ConnectionLostError("the connection hub no longer holds this connection")
        return lease

    # -- the requests --------------------------------------------------------------------------------
    async def _open(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.stopping:
            writer.write(reply_line({"ok": False, "refused": "the hub is stopping"}))
            return
        machine = machine_from_json(request["machine"])
        writer.write(reply_line({"accepted": True}))  # alive: the client may wait for a connect
        try:
            held, warm = await self.pool.lend(
                machine, accept_new=bool(request.get("accept_new")), keepalive=request.get("keepalive")
            )
        except SchedulerError as exc:  # what connecting says (unknown host key, login refused...)
            writer.write(reply_line({"ok": False, **error_json(exc)}))
            return
        except Exception as exc:  # the hub's own failure: the client connects directly
            log.exception("%s: lending a connection failed", machine.name)
            writer.write(reply_line({"ok": False, "refused": f"the hub failed: {type(exc).__name__}: {exc}"}))
            return
        lease = Lease(secrets.token_hex(16), held, float(request.get("keep") or 0))
        self.leases[lease.id] = lease
        try:
            writer.write(reply_line({"ok": True, "lease": lease.id, "warm": warm, "own": str(self.own)}))
            await writer.drain()
            while line := await reader.readline():  # the client's pings, until it lets go
                if line.strip() == b"bye":
                    lease.clean = True
                    break
                if line.strip() == b"ping":
                    writer.write(b"pong\n")
                    await writer.drain()
        finally:
            del self.leases[lease.id]
            await self._release(lease)

    async def _release(self, lease: Lease) -> None:
        """The client let go (or vanished): what it left open is closed, the connection goes back."""
        for stream in list(lease.streams):
            stream.close()
        if lease.ops:
            await asyncio.wait(lease.ops, timeout=15)
        for task in lease.ops:
            lease.usable = False
            task.cancel()
        self.pool.give_back(lease.held, lease.keep, usable=lease.usable and lease.clean)
        if lease.batch:
            self._spares.append(lease.held)
        # Not while a client still holds a connection: starting agents here (channels, their
        # code sent) would delay what it waits for, the end of its other hosts' sessions.
        if not self.leases:
            for held in self._spares if not self.stopping else ():
                self.pool.start_spare(held)
            self._spares.clear()

    async def _while_there(
        self, lease: Lease, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, work: Awaitable[T], *, transfer: bool = False
    ) -> T:
        """``work`` as one of the lease's operations, cancelled when the client goes away (its
        end of the connection closed: what cancelling the call does in the client).  A file
        ``transfer`` cut off midway leaves the connection to nobody after this client."""
        task = asyncio.ensure_future(work)
        lease.ops.add(task)
        lease.streams.add(writer)
        gone = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                lease.usable = lease.usable and not transfer
            return await task
        finally:
            gone.cancel()
            lease.ops.discard(task)
            lease.streams.discard(writer)

    async def _exec(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lease = self._lease(request)
        writer.write(reply_line({"ok": True}))

        def sink(kind: int) -> Callable[[bytes], None]:
            return lambda data: writer.write(frame(kind, data))

        try:
            result = await self._while_there(
                lease, reader, writer, lease.held.transport.exec(str(request["command"]), sink(OUT), sink(ERR))
            )
        except asyncio.CancelledError:
            if self.done.is_set():
                raise
            return  # the client went away: its command was closed with the channel
        except Exception as exc:
            writer.write(json_frame(FAIL, error_json(exc)))
        else:
            writer.write(json_frame(END, {"code": result.exit_code}))
        await writer.drain()

    async def _agent(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lease = self._lease(request)
        token = str(request.get("token") or "")
        lease.batch = lease.batch or bool(token)
        try:
            link, warm = await self.pool.agent_for(lease.held, token)
        except Exception as exc:
            writer.write(reply_line({"ok": False, **error_json(exc)}))
            return
        writer.write(reply_line({"ok": True, "warm": warm}))
        lease.streams.add(writer)
        task = asyncio.ensure_future(link.serve(reader, writer))
        lease.ops.add(task)
        try:
            await asyncio.shield(task)
        finally:
            lease.ops.discard(task)
            lease.streams.discard(writer)

    async def _sftp(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lease = self._lease(request)
        await self._answer(lease, reader, writer, self._sftp_open(lease))

    async def _sftp_open(self, lease: Lease) -> dict[str, Any]:
        await lease.held.transport.open_file_channel()
        return {}

    async def _upload(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lease = self._lease(request)
        work = lease.held.transport.upload_descriptor(fds[0], str(request["remote"]), int(request["mode"]), str(request.get("shown")))
        await self._answer(lease, reader, writer, _sized(work))

    async def _download(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lease = self._lease(request)
        work = lease.held.transport.download(str(request["remote"]), fds[0], int(request["limit"]))
        await self._answer(lease, reader, writer, _sized(work))

    async def _answer(self, lease: Lease, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, work: Awaitable[dict[str, Any]]) -> None:
        try:
            reply = {"ok": True, **await self._while_there(lease, reader, writer, work, transfer=True)}
        except asyncio.CancelledError:
            if self.done.is_set():
                raise
            return
        except Exception as exc:
            reply = {"ok": False, **error_json(exc)}
        writer.write(reply_line(reply))
        await writer.drain()

    async def _status(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(reply_line({
            "ok": True, "pid": os.getpid(), "key": hub_key(), "socket": str(self.path), "stopping": self.stopping,
            "held": [h.describe() for h in self.pool.held],
        }))

    async def _stop(self, request: dict[str, Any], fds: list[int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """No new client; idle connections closed now, lent ones when their command ends."""
        self.stopping = True
        self._unlisten()
        for held in list(self.pool.held):
            if not held.lent:
                await self.pool.drop(held)
        writer.write(reply_line({"ok": True, "pid": os.getpid(), "lent": sum(h.lent for h in self.pool.held)}))
        for lease in self.leases.values():
            lease.keep = 0  # closed when given back


async def _sized(work: Awaitable[int]) -> dict[str, Any]:
    return {"size": await work}


def _bound(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    umask = os.umask(0o177)  # created 0600: never a moment when others could connect
    try:
        with reachable(path) as where:
            server.bind(where)
    finally:
        os.umask(umask)
    server.listen(128)
    server.setblocking(False)
    return server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- the process ------------------------------------------------------------------------------


def serve(status_fd: int) -> int:
    """The hub process (started by hub_place.spawn_hub): detach, take
    the lock of this hub's socket, listen, tell the starter through ``status_fd``, serve until
    idle.  Returns the exit status."""
    if os.fork() > 0:  # the starter reaps this parent at once: the hub is nobody's zombie
        os._exit(0)
    os.setsid()  # a session of its own, no terminal: a closed one never reaches it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s hub %(process)d %(levelname)s: %(message)s")
    os.chdir("/")
    status = os.fdopen(status_fd, "wb", buffering=0)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # three descriptors a host: as many as allowed
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        folder = private_folder(create=True)
        path = socket_path(folder)
        lock = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            status.write(BUSY)  # another hub for this key runs (or is starting): use it
            return 0
        from ssh_scheduler.transport.loading import import_asyncssh

        import_asyncssh()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        hub = Hub(path, lock)
        hub.listen()
    except Exception as exc:
        with contextlib.suppress(OSError):
            status.write(f"failed: {exc}\n".encode())
        return 1
    with contextlib.suppress(OSError):
        status.write(READY)
    status.close()
    for signo in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signo, hub.done.set)
    try:
        loop.run_until_complete(hub.run())
    finally:
        loop.close()
    return 0


def main(argv: list[str]) -> int:
    """``python -m ssh_scheduler.transport.hub_server --status-fd N``, where N is the pipe its
    starter reads."""
    if len(argv) != 2 or argv[0] != "--status-fd" or not argv[1].isdigit() or not _is_pipe(int(argv[1])):
        sys.stderr.write("error: the hub is started by the commands that use it (keep_warm); nothing to run by hand\n")
        return 2
    return serve(int(argv[1]))


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
