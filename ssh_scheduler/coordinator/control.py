"""Acting on a running batch from another terminal: ``ssh-scheduler pause`` / ``resume`` /
``cancel JOB...`` / ``cancel --all``.

The coordinator serves a unix socket in its results folder (``job_results/.control.sock``, mode
0600, and each peer's uid checked with ``SO_PEERCRED``: root ignores the mode, and only the
batch's owner may steer it).  One request per connection: a JSON line in, a JSON line out.
The requests become planner events (:meth:`Planner.pause`, ``resume``, ``cancel``); the
coordinator performs the actions they return, as for any other event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from ssh_scheduler.errors import SchedulerError
from ssh_scheduler.planner.actions import Action
from ssh_scheduler.planner.plan import Planner

__all__ = ["SOCKET_NAME", "ControlError", "ControlServer", "batch_requests", "send_request"]

log = logging.getLogger(__name__)

SOCKET_NAME = ".control.sock"
MAX_REQUEST = 1 << 20
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class Steerable(Protocol):
    """What a request steers: the coordinator of a batch (``coordinator.batch.Batch``), named
    here by what it offers so that the batch may import this module and not the reverse."""

    @property
    def planner(self) -> Planner | None: ...

    def perform(self, actions: Sequence[Action]) -> None: ...

    def request_stop(self) -> None: ...


class ControlError(SchedulerError):
    """No coordinator answers, or it refused the request."""


@contextlib.contextmanager
def _reachable(path: Path) -> Iterator[str]:
    """A path for ``bind``/``connect`` that fits ``sun_path``: a long one goes through
    ``/proc/self/fd/N`` of its folder (deep pytest or home folders exceed 107 bytes)."""
    if len(os.fsencode(path)) <= _UNIX_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class ControlServer:
    def __init__(self, results_dir: Path, handle: Handler, *, allowed_uid: int | None = None) -> None:
        self.path = results_dir / SOCKET_NAME
        self.handle = handle
        self.allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a coordinator that was killed
        umask = os.umask(0o177)  # created 0600: never a moment when others could connect
        try:
            with _reachable(self.path) as where:
                self._server = await asyncio.start_unix_server(self._serve, path=where, limit=MAX_REQUEST)
        except OSError as exc:
            log.warning("cannot serve %s (%s): pause, resume and cancel will not reach this batch", self.path, exc)
        finally:
            os.umask(umask)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            uid = peer_uid(writer.get_extra_info("socket"))
            if uid != self.allowed_uid:
                reply: dict[str, Any] = {"ok": False, "error": f"uid {uid} may not control a batch of uid {self.allowed_uid}"}
            else:
                try:
                    request = json.loads(await reader.readline())
                    reply = self.handle(request) if isinstance(request, dict) else {"ok": False, "error": "not a JSON object"}
                except ValueError as exc:
                    reply = {"ok": False, "error": f"bad request: {exc}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.debug("control connection ended: %s", exc)
        finally:
            writer.close()


def batch_requests(batch: Steerable) -> Handler:
    """What a request does to ``batch``: planner events, performed by the coordinator."""

    def handle(request: dict[str, Any]) -> dict[str, Any]:
        planner = batch.planner
        if planner is None:
            return {"ok": False, "error": "the batch is still connecting to its hosts; try again"}
        command = request.get("command")
        if command == "pause":
            batch.perform(planner.pause())
        elif command == "resume":
            batch.perform(planner.resume())
        elif command == "cancel":
            jobs = request.get("jobs")
            if not isinstance(jobs, list) or not all(isinstance(j, str) for j in jobs):
                return {"ok": False, "error": "cancel needs a list of job names"}
            unknown = [j for j in jobs if j not in planner.jobs]
            for job in jobs:
                batch.perform(planner.cancel(job))
            if unknown:
                return {"ok": False, "error": f"not jobs of this batch: {', '.join(unknown)}"}
        elif command == "stop":
            # The whole batch, as Ctrl-C twice: kill what runs, clean the hosts, journal it.
            if not planner.draining:
                batch.request_stop()
            batch.request_stop()
        elif command != "status":
            return {"ok": False, "error": f"unknown command {command!r}"}
        return {"ok": True, "pid": os.getpid(), "host": socket.gethostname(), "paused": planner.paused, "running": planner.running()}

    return handle


def send_request(results_dir: Path, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request to the coordinator serving ``results_dir`` (blocking: for the CLI)."""
    path = results_dir / SOCKET_NAME
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            with _reachable(path) as where:
                sock.connect(where)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no batch is running in {results_dir} (nothing answers on {path})") from None
        except OSError as exc:
            raise ControlError(f"cannot reach the batch in {results_dir}: {exc.strerror or exc}") from None
        # A refusing coordinator answers without reading: the reply still waits to be read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    try:
        reply = json.loads(data)
    except ValueError:
        raise ControlError(f"the batch in {results_dir} gave no answer") from None
    if not reply.get("ok"):
        raise ControlError(str(reply.get("error")))
    return dict(reply)
