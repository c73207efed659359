"""Acting on a running batch from another terminal: ``ssh-scheduler pause`` / ``resume`` /
``cancel JOB...`` / ``cancel --all``.

The coordinator serves a unix socket in its results folder (``job_results/.control.sock``, mode
0600, and each peer's uid checked with ``SO_PEERCRED``: root ignores the mode, and only the
batch's owner may steer it).  The client checks the other way round before it sends anything:
the socket must not be a link, and whoever serves it must be of the client's uid; its reply is read
up to :data:`MAX_REPLY` bytes and checked like any input (:func:`reply_problem`).  One request per
connection: a JSON line in, a JSON line out.
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
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ssh_scheduler.errors import SchedulerError, plain_text
from ssh_scheduler.planner.actions import Action
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.transport.unix_socket import peer_uid, reachable

__all__ = ["SOCKET_NAME", "ControlError", "ControlServer", "NoCoordinator", "batch_requests", "reply_problem", "send_request"]

log = logging.getLogger(__name__)

SOCKET_NAME = ".control.sock"
MAX_REQUEST = 1 << 20

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
            with reachable(self.path) as where:
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


class NoCoordinator(ControlError):
    """Nothing answers on the socket: no batch runs there (``status`` then reads the journal)."""


MAX_REPLY = 1 << 20
"""Bytes of a reply read at most: the running list of a very large batch fits many times."""
MAX_RUNNING = 1_000_000
_REPLY_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "ok": (lambda v: isinstance(v, bool), "true or false"),
    "error": (lambda v: isinstance(v, str), "a message"),
    "pid": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 31, "a process id"),
    "host": (lambda v: isinstance(v, str) and 0 < len(v) <= 255, "a host name"),
    "paused": (lambda v: isinstance(v, bool), "true or false"),
    "running": (
        lambda v: isinstance(v, list) and len(v) <= MAX_RUNNING and all(isinstance(j, str) for j in v),
        "a list of job names",
    ),
}


def reply_problem(reply: object) -> str | None:
    """What is wrong with a parsed reply, or None: the client reads it like any input."""
    if not isinstance(reply, dict):
        return "is not a JSON object"
    if "ok" not in reply:
        return "has no 'ok'"
    for key, (check, what) in _REPLY_FIELDS.items():
        if key in reply and not check(reply[key]):
            return f"has {key!r} that is not {what}"
    return None


def _check_socket(path: Path, results_dir: Path) -> None:
    """The socket is there, a socket, and not a link to one somewhere else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise NoCoordinator(f"no batch is running in {plain_text(results_dir)} (nothing answers on {plain_text(path)})") from None
    except OSError as exc:
        raise ControlError(f"cannot reach the batch in {plain_text(results_dir)}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(mode):
        raise ControlError(
            f"{plain_text(path)} is a symbolic link, not the socket a coordinator serves: not followed "
            "(remove it; a running batch serves its own socket there)"
        )
    if not stat.S_ISSOCK(mode):
        raise NoCoordinator(f"no batch is running in {plain_text(results_dir)} ({plain_text(path)} is not a socket)")


def send_request(results_dir: Path, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request to the coordinator serving ``results_dir`` (blocking: for the CLI).

    Whoever serves the socket is checked before a byte is sent: its uid (``SO_PEERCRED``) must be
    ours, as the coordinator checks ours; a socket served by another user, a link, or a reply that
    is not what a coordinator answers is one :class:`ControlError`, its content never shown raw."""
    path = results_dir / SOCKET_NAME
    _check_socket(path, results_dir)
    data = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                with reachable(path) as where:
                    sock.connect(where)
            except (FileNotFoundError, ConnectionRefusedError):
                raise NoCoordinator(
                    f"no batch is running in {plain_text(results_dir)} (nothing answers on {plain_text(path)})"
                ) from None
            uid = peer_uid(sock)
            if uid != os.getuid():
                raise ControlError(
                    f"{plain_text(path)} is served by uid {uid}, not by you (uid {os.getuid()}): not your batch's "
                    "coordinator, so nothing was asked of it (remove the socket if you did not start it)"
                )
            # A refusing coordinator answers without reading: the reply still waits to be read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(json.dumps(request).encode() + b"\n")
            with contextlib.suppress(ConnectionResetError):
                while not data.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                    if len(data) > MAX_REPLY:
                        raise ControlError(f"the batch in {plain_text(results_dir)} answered more than {MAX_REPLY} bytes; not read")
    except TimeoutError:
        raise ControlError(f"the batch in {plain_text(results_dir)} did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise ControlError(f"cannot reach the batch in {plain_text(results_dir)}: {exc.strerror or exc}") from None
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError):
        raise ControlError(f"the batch in {plain_text(results_dir)} gave no answer") from None
    problem = reply_problem(reply)
    if problem is not None:
        raise ControlError(f"the answer on {plain_text(path)} {problem}: not a coordinator's reply")
    if not reply["ok"]:
        raise ControlError(plain_text(reply.get("error") or "the batch refused the request", 300))
    return dict(reply)
