"""What the hub and its clients share: where the hub listens, who may talk to it, and how.

The hub (hub_server.py) is a per-user background process that keeps hosts' SSH connections warm
between commands; clients (hub_client.py) reach it over a unix socket in a private folder:
``$XDG_RUNTIME_DIR/ssh_scheduler/`` (systemd's per-user folder), else ``/tmp/ssh_scheduler-UID/``,
which must be a real folder of ours with no access for anyone else (``hub_place.private_folder``).
Both ends check the other's uid (``SO_PEERCRED``): root ignores the folder's mode, and a socket
that another user managed to plant answers with its owner's uid.

One hub serves one version of this package with one environment: the socket's name carries a key
of both (``hub_place.hub_key``), so a hub never serves code it was not started from (a new release, an
edited checkout) or a login whose ssh-agent, HOME or PATH differ from the one it connects with.

The wire: each connection starts with one JSON request line from the client, which may carry file
descriptors (``SCM_RIGHTS``: same uid on both ends, so a download goes straight into the client's
file), and one JSON reply line.  A stream that follows (a command's output, the agent's) comes
as frames: a kind byte, a 4-byte length, the bytes (:func:`frame`, :func:`read_frame`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from ssh_scheduler import errors
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.machines.slurm import SlurmSettings
from ssh_scheduler.transport.base import RemoteFileError, SizeLimitExceeded, bounded
from ssh_scheduler.transport.hub_place import HubAbsent, HubUnusable
from ssh_scheduler.transport.unix_socket import peer_uid, reachable

MAX_REQUEST = 1 << 20
MAX_FDS = 4

# Frame kinds of a stream from the hub.
OUT = 1  # stdout bytes
ERR = 2  # stderr bytes
END = 3  # JSON: how it ended ({"code": ..., "signal": ...} or the agent's exit details)
FAIL = 4  # JSON: the error that ended it (:func:`error_json`)
_HEAD = struct.Struct("!BI")


# --- requests: one JSON line each way, descriptors alongside ---------------------------------


async def connect_socket(path: Path, timeout: float) -> socket.socket:
    """A connection to the hub at ``path``, its peer checked to be us (else HubUnusable)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        with reachable(path) as where:
            await bounded(asyncio.get_running_loop().sock_connect(sock, where), timeout)
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise HubUnusable(f"{path} is served by uid {uid}, not by us (uid {os.getuid()}): refused")
    except HubUnusable:
        sock.close()
        raise
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise HubAbsent(f"{path}: {exc.strerror}") from None
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise HubUnusable(f"{path}: {getattr(exc, 'strerror', None) or exc or 'no answer'}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def send_request(sock: socket.socket, request: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """The request line (and descriptors) on a fresh connection: its buffer holds it whole."""
    line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
    sent = socket.send_fds(sock, [line], list(fds)) if fds else sock.send(line)
    if sent != len(line):
        raise HubUnusable("the hub's socket took only part of a request")


async def receive_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The hub's side of :func:`send_request`: one line and the descriptors that came with it
    (the client sends nothing more before the reply, so nothing past the line is read)."""
    loop = asyncio.get_running_loop()
    data = b""
    fds: list[int] = []
    try:
        while not data.endswith(b"\n"):
            if len(data) > MAX_REQUEST:
                raise ValueError("request too long")
            try:
                chunk, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, MAX_FDS)
            except BlockingIOError:
                await _readable(loop, sock)
                continue
            fds.extend(got)
            if not chunk:
                raise ValueError("connection closed before its request")
            data += chunk
        request = json.loads(data)
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def reply_line(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply, separators=(",", ":")).encode() + b"\n"


# --- streams: frames --------------------------------------------------------------------------


def frame(kind: int, data: bytes = b"") -> bytes:
    return _HEAD.pack(kind, len(data)) + data


def json_frame(kind: int, value: object) -> bytes:
    return frame(kind, json.dumps(value, separators=(",", ":")).encode())


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next frame; ``(0, b"")`` when the stream ended (between frames or inside one)."""
    try:
        kind, size = _HEAD.unpack(await reader.readexactly(_HEAD.size))
        return kind, await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0, b""


# --- values across: machines and errors -------------------------------------------------------


def machine_json(machine: Machine) -> dict[str, Any]:
    return dataclasses.asdict(machine)


def machine_from_json(data: dict[str, Any]) -> Machine:
    """The :class:`Machine` :func:`machine_json` describes (lists back to tuples)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Machine):
        if field.name not in data:
            continue
        value = data[field.name]
        if field.name == "jump_host" and value is not None:
            value = machine_from_json(value)
        elif field.name == "slurm" and value is not None:
            value = SlurmSettings(**{k: _tuples(v) for k, v in value.items()})
        else:
            value = _tuples(value)
        values[field.name] = value
    return Machine(**values)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (*vars(errors).values(), RemoteFileError, SizeLimitExceeded)
    if isinstance(cls, type) and issubclass(cls, errors.SchedulerError)
}


def error_json(exc: BaseException) -> dict[str, Any]:
    """An error to send: our own errors by class; an OSError with its errno (writing a download
    into the client's descriptor failed: a full disk here, which the client must tell from the
    host's fault, as it does without the hub); anything else as a lost connection."""
    if type(exc).__name__ in _ERRORS and isinstance(exc, errors.SchedulerError):
        return {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError) and exc.errno is not None:
        return {"error": "OSError", "errno": exc.errno, "message": exc.strerror or str(exc)}
    return {"error": "ConnectionLostError", "message": f"the connection hub failed: {type(exc).__name__}: {exc}"}


def error_from_json(data: object) -> Exception:
    """The error :func:`error_json` sent, as the same class with the same one-line message."""
    if not isinstance(data, dict):
        return errors.ConnectionLostError("the connection hub sent a malformed answer")
    if data.get("error") == "OSError" and isinstance(data.get("errno"), int):
        return OSError(data["errno"], str(data.get("message", "")))
    cls = _ERRORS.get(str(data.get("error")), errors.TransportError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(data.get("message", "")))
    return exc
